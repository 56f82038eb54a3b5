#!/bin/bash
# tau against the amount of training data (issue 23: "show the curve that says how far more data would go").
# The stage-4 drafter (before any use-shaped or sampled data) is fine-tuned for the same number of steps on
# nested fractions of stage 6's mix: the first ceil(f * n) shards of each of its six data sets, f = 1/4, 1/2, 1
# (every set's prompts were shuffled before sharding, so a prefix of shards is a random subset).
# Each drafter, the stage-4 one included, is measured with bench.py at concurrency 1, 128 new tokens, on more
# prompts than the 10 of the headline protocol, so that steps of ~0.05 tau are visible: chat-heldout greedy 30,
# mt-bench greedy 20, gsm8k at T = 1 / top-p 0.95 20, gsm8k greedy 10.
#   docs/results/data_curve.sh [STEPS] [FRACTIONS]      (run from the repository root; needs runs/s5* and runs/s6*)
set -e
STEPS=${1:-700}; FRACTIONS=${2:-"4 1 2"}   # 4 = a quarter, 2 = a half, 1 = all; the half runs last
DATA=../shared/data; R=runs/datacurve; mkdir -p $R
SETS="s6 s5 s5g s5t1 s6t1 s5r"             # s6 (regenerated stage-1-4 kinds, greedy) is the main set, as in stage 6

if [ ! -f $R/stage4/model.safetensors ]; then   # the stage-4 drafter: the embedded one before commit 5cd99a9
  mkdir -p $R/stage4
  for f in config.json model.safetensors; do git show 03e478b:dflash2/checkpoints/dflash2-smollm2-135m/$f > $R/stage4/$f; done
fi

measure() {  # measure DRAFTER OUT_PREFIX
  local common="--draft $1 --methods dflash2 --concurrency 1 --max-new-tokens 128 --data-dir $DATA"
  [ -f $2_heldout.json ] || python -m dflash2.bench $common --tasks chat-heldout --num-prompts 30 --out $2_heldout.json
  [ -f $2_mt.json ]      || python -m dflash2.bench $common --tasks mt-bench --num-prompts 20 --out $2_mt.json
  [ -f $2_t1.json ]      || python -m dflash2.bench $common --tasks gsm8k --num-prompts 20 --temperature 1.0 --top-p 0.95 --out $2_t1.json
  [ -f $2_gsm8k.json ]   || python -m dflash2.bench $common --tasks gsm8k --num-prompts 10 --out $2_gsm8k.json
}

measure $R/stage4 $R/frac0
for q in $FRACTIONS; do
  run=$R/frac_1_$q
  for s in $SETS; do   # a data/ folder of symlinks: meta.json and the first ceil(n/q) shards
    d=$run/sets/$s; [ $s = s6 ] && d=$run/data
    mkdir -p $d; ln -sf $PWD/runs/$s/data/meta.json $d/
    n=$(ls runs/$s/data/shard_*.pt | wc -l); k=$(( (n + q - 1) / q ))
    for p in $(ls runs/$s/data/shard_*.pt | head -n $k); do ln -sf $PWD/$p $d/; done
  done
  extra=""; for s in $SETS; do [ $s = s6 ] || extra="$extra --extra-data $run/sets/$s"; done
  [ -f $run/drafter/model.safetensors ] && [ "$(python -c "import json;print(json.load(open('$run/history.json'))[-1]['step'])")" = $STEPS ] || \
    python -m dflash2.train train --out $run --init $R/stage4 $extra --extra-share 0.5 \
      --steps $STEPS --batch-seqs 8 --anchors 16 --warmup 60 $( [ -f $run/train_state.pt ] && echo --resume )
  measure $run/drafter $R/frac_1_${q}
done
