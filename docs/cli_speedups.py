"""The README command on many prompts: `python dflash2_ref.py --prompt P --baseline --json [FLAGS]`, one process per
prompt as a user runs it, and the speedup over plain decoding that each run reports (plain decoding runs in the
same process, right after). Prints one table row per prompt and the mean.

    python docs/cli_speedups.py --mt-bench-categories writing,roleplay,reasoning,math,coding,extraction,stem,humanities \
        --heldout 4 --data-dir ../shared/data [-- --block-size 8]

Prompts: the first MT-Bench question of each category named (first turn), and the first N of the held-out chat
prompts (dflash2/heldout/chat.txt), which no training source reads. Flags after `--` go to every run. `--repeat N` runs
each prompt N times and prints each prompt's median: one run's speedup moves with the machine's drift.
"""
import argparse
import itertools
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prompts_of(args):
    out = []
    if args.mt_bench_categories:
        rows = [json.loads(line) for line in (Path(args.data_dir) / "mt_bench" / "question.jsonl").read_text().splitlines()]
        for category in args.mt_bench_categories.split(","):
            row = next(r for r in rows if r["category"] == category)
            out.append((f"mt-bench {category}", row["turns"][0]))
    chat = [t for t in (ROOT / "dflash2" / "heldout" / "chat.txt").read_text().splitlines() if t.strip()]
    out += [(f"heldout {i}", t) for i, t in enumerate(chat[: args.heldout])]
    out += [(f"gsm8k {i}", json.loads(line)["question"] + "\nPlease reason step by step, and put your final answer "
             "within \\boxed{}.") for i, line in
            enumerate((Path(args.data_dir) / "gsm8k" / "test.jsonl").read_text().splitlines()[: args.gsm8k])]
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mt-bench-categories", default="writing,roleplay,reasoning,math,coding,extraction,stem,humanities")
    ap.add_argument("--heldout", type=int, default=4, help="the first N held-out chat prompts")
    ap.add_argument("--gsm8k", type=int, default=0, help="the first N GSM8K test questions")
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--only", default=None, help="keep only these prompts (comma-separated names as printed)")
    ap.add_argument("--repeat", type=int, default=1, help="run each prompt this many times (one process each)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    rows = []
    print(f"flags: {' '.join(extra) or '(none)'}; {platform.processor() or platform.machine()}")
    print("| prompt | τ | tok/s | ar tok/s | speedup | identical | widths (share of steps) |\n|---|---|---|---|---|---|---|")
    todo = [(n, t) for n, t in prompts_of(args) if args.only is None or n in args.only.split(",")]
    for (name, text), _ in itertools.product(todo, range(args.repeat)):
        done = subprocess.run([sys.executable, "dflash2_ref.py", "--prompt", text, "--baseline", "--json", *extra],
                              cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{name}: {done.stderr.strip()}")
        r = json.loads(done.stdout)
        rows.append(dict(prompt=name, **{k: v for k, v in r.items() if k not in ("text", "ar_text")}))
        widths = r.get("widths") or {}
        tau = r["acceptance_length"]
        print(f"| {name} | {'n/a' if tau is None else f'{tau:.2f}'} | {r['tokens_per_s']:.1f} | "
              f"{r['ar_tokens_per_s']:.1f} | {r['speedup']:.2f}× | {r['identical']} | "
              f"{', '.join(f'{w}: {s:.2f}' for w, s in widths.items())} |", flush=True)
    speedups = [r["speedup"] for r in rows]
    print(f"\nmean speedup {statistics.mean(speedups):.2f}×, lowest {min(speedups):.2f}× ({len(rows)} runs)")
    if args.repeat > 1:
        for name, _ in todo:
            mine = [r["speedup"] for r in rows if r["prompt"] == name]
            print(f"{name}: median {statistics.median(mine):.2f}× over {len(mine)} runs ({min(mine):.2f}–{max(mine):.2f}×)")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(flags=extra, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
