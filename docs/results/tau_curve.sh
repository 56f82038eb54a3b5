#!/bin/bash
# tau of a drafter (default: the embedded one) on the stage-5 curve tasks: mt-bench and chat-heldout greedy,
# gsm8k at the model card's sampling (T = 1, top-p 0.95); bench.py's protocol at concurrency 1, 10 prompts x 128.
#   docs/results/tau_curve.sh DRAFTER_DIR OUT_PREFIX [DATA_DIR]
set -e
DRAFT=${1:-dflash2/checkpoints/dflash2-smollm2-135m}; OUT=$2; DATA=${3:-../shared/data}
common="--draft $DRAFT --methods dflash2 --concurrency 1 --num-prompts 10 --max-new-tokens 128 --data-dir $DATA"
python -m dflash2.bench $common --tasks mt-bench,chat-heldout --out ${OUT}_greedy.json
python -m dflash2.bench $common --tasks gsm8k --temperature 1.0 --top-p 0.95 --out ${OUT}_t1.json
