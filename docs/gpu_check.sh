#!/usr/bin/env bash
# The GPU check of issue 38: the paths only a GPU runs, in one call of at most 8 minutes, answered by one JSON
# under 1 MiB ($OUT/gpu_check.json): the GPU-only tests, the CLI with --attn-backend flex and flash, --compile,
# the tree at budget 32, and the bench's ar / dflash2 / dflash2-tree cells at c=1 and c=8 on the embedded pair.
#
#   here:        docs/gpu_train.sh pack          the embedded target's GGUF, the gguf package and the data, in parts
#   the device:  docs/gpu_train.sh stash K       calls 1 .. N-1 (carry runs/gpu/K)
#                docs/gpu_check.sh N             the last call (carry runs/gpu/N): join the payload, run every check
#
# Settings (environment), defaults in brackets: DEVICE [cuda], BUDGET_S [420, the checks' total], CHECKS [all, or a
# comma-separated subset of the names below], PYTHON [python3], STASH [/tmp/dflash2-gpu], OUT [$STASH/out]; a
# rehearsal without the payload: NO_JOIN=1 with TARGET, DRAFT and DATA_DIR naming a pair and the data.
set -euo pipefail
N=${1:?usage: docs/gpu_check.sh N (the number of the last payload part)}
STASH=${STASH:-/tmp/dflash2-gpu}
PY=${PYTHON:-python3}
OUT=${OUT:-$STASH/out}
mkdir -p "$OUT"
if [ -z "${NO_JOIN:-}" ]; then
  STASH=$STASH bash docs/gpu_train.sh join "$N"
  export PYTHONPATH="$STASH/x/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export DFLASH2_CACHE=${DFLASH2_CACHE:-$STASH/cache} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export DATA_DIR=${DATA_DIR:-$STASH/x/data} DEVICE=${DEVICE:-cuda} OUT PY
exec "$PY" - <<'PYEOF'
import json, os, subprocess, sys, time
from pathlib import Path

py, dev, out = os.environ["PY"], os.environ["DEVICE"], Path(os.environ["OUT"])
budget_end = time.monotonic() + float(os.environ.get("BUDGET_S", 420))
pair = [a for k in ("TARGET", "DRAFT") if os.environ.get(k) for a in (f"--{k.lower()}", os.environ[k])]
prompt = ["--prompt", "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                      "How many clips did Natalia sell altogether in April and May?", "--max-new-tokens", "96"]
cli = [py, "dflash2_ref.py", "--device", dev, *pair, *prompt, "--baseline", "--json"]
bench_json = out / "bench.json"
CHECKS = {  # name: (command, seconds at most)
    "gpu_tests": ([py, "-m", "pytest", "-q", "-rs", "tests/test_compile.py", "tests/test_kernels.py",
                   "tests/test_machine.py", "-k", "not subprocess"], 150),
    "cli_flex": (cli + ["--attn-backend", "flex"], 60),
    "cli_flash": (cli + ["--attn-backend", "flash"], 60),
    "cli_compile": (cli + ["--compile"], 120),
    "cli_tree32": (cli + ["--method", "dflash2-tree", "--tree-budget", "32"], 60),
    "bench": ([py, "-m", "dflash2.bench", "--device", dev, *pair, "--data-dir", os.environ["DATA_DIR"],
               "--tasks", "gsm8k,mt-bench", "--methods", "ar,dflash2,dflash2-tree", "--concurrency", "1,8",
               "--num-prompts", "8", "--max-new-tokens", "128", "--out", str(bench_json)], 200),
}
wanted = os.environ.get("CHECKS", "all")
names = list(CHECKS) if wanted == "all" else [n for n in wanted.split(",") if n]
report = {"device": dev, "checks": {}}
try:
    import torch
    report.update(torch=torch.__version__, cuda=torch.cuda.is_available(),
                  gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
except Exception as e:  # the report still says what happened
    report["torch_error"] = repr(e)
for name in names:
    cmd, limit = CHECKS[name]
    left = budget_end - time.monotonic()
    if left < 5:
        report["checks"][name] = {"rc": None, "skipped": "out of time"}
        continue
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=min(limit, left))
        rc, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = "timeout", (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
    entry = {"rc": rc, "seconds": round(time.monotonic() - start, 1), "stderr_tail": stderr[-3000:],
             "stdout_tail": stdout[-3000:]}
    if name.startswith("cli") and rc == 0:
        entry["report"] = {k: v for k, v in json.loads(stdout.strip().splitlines()[-1]).items()
                           if k not in ("text", "ar_text")}
    if name == "bench" and rc == 0:
        entry["results"] = json.loads(bench_json.read_text())["results"]
    report["checks"][name] = entry
    print(f"{name}: rc {rc} in {entry['seconds']} s", flush=True)
text = json.dumps(report, indent=1)
assert len(text) < 1 << 20, len(text)
(out / "gpu_check.json").write_text(text)
print(f"wrote {out / 'gpu_check.json'} ({len(text)} bytes)")
PYEOF
