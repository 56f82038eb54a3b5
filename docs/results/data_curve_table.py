"""Table, fit and picture of docs/results/data_curve.sh's runs: tau against response tokens of training data.

    python docs/results/data_curve_table.py runs/datacurve [--png docs/data_curve.png] [--json OUT.json]

For each fraction of the stage-6 mix it counts the response tokens the run trained on (its data/ and sets/*
folders), reads the four bench outputs, fits tau = a + b * log2(tokens) through the runs that had data, and
says how many tokens that line would need to reach issue 23's goals (an extrapolation, printed as such).
"""

import argparse
import json
import math
from pathlib import Path

import torch

GOALS = {"heldout": ("chat-heldout, greedy (30 prompts)", 2.2), "mt": ("mt-bench, greedy (20)", 2.3),
         "t1": ("gsm8k, T = 1, top-p 0.95 (20)", 2.7), "gsm8k": ("gsm8k, greedy (10)", 3.6)}


def response_tokens(run: Path) -> int:
    n = 0
    for d in [run / "data", *sorted((run / "sets").glob("*"))]:
        for path in sorted(d.glob("shard_*.pt")):
            shard = torch.load(path, mmap=True)  # only the ids and prompt lengths are read
            n += sum(len(i) - p for i, p in zip(shard["ids"], shard["prompt_lens"]) if len(i) >= p + 2)
    return n


def tau(prefix: Path, key: str) -> float:
    rows = json.loads(Path(f"{prefix}_{key}.json").read_text())["results"]
    (row,) = [r for r in rows if r["method"] == "dflash2"]
    return row["acceptance_length"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="docs/results/data_curve.sh's output folder (runs/datacurve)")
    ap.add_argument("--png", help="also draw tau against tokens here")
    ap.add_argument("--json", help="also write the table and fits here")
    args = ap.parse_args()
    points = [("0 (stage 4)", 0, args.root / "frac0")]
    for q, name in ((4, "1/4"), (2, "1/2"), (1, "all")):
        run = args.root / f"frac_1_{q}"
        if Path(f"{run}_gsm8k.json").exists():
            points.append((name, response_tokens(run), run))
    table = [{"fraction": name, "tokens": tok, **{k: tau(prefix, k) for k in GOALS}} for name, tok, prefix in points]
    shipped = None  # the embedded stage-6 drafter, measured the same way: the full mix, but 1,000 + 1,500 steps
    if Path(f"{args.root / 'stage6'}_gsm8k.json").exists() and len(points) > 1 and points[-1][0] == "all":
        shipped = {"fraction": "all: stage 6 as shipped (stage 5's 1,000 steps, then 1,500)", "tokens": points[-1][1],
                   **{k: tau(args.root / "stage6", k) for k in GOALS}}
    print("| fraction of the stage-6 mix | response tokens | " + " | ".join(v[0] for v in GOALS.values()) + " |")
    print("|---" * (2 + len(GOALS)) + "|")
    for row in table + ([shipped] if shipped else []):
        print(f"| {row['fraction']} | {row['tokens']:,} | " + " | ".join(f"{row[k]:.2f}" for k in GOALS) + " |")
    fits = {}
    with_data = [r for r in table if r["tokens"] > 0]
    if len(with_data) >= 2:
        print("\nleast-squares line tau = a + b * log2(tokens) through the runs with data; where it meets the goal:")
        for k, (label, goal) in GOALS.items():
            x = [math.log2(r["tokens"]) for r in with_data]
            y = [r[k] for r in with_data]
            mx, my = sum(x) / len(x), sum(y) / len(y)
            sxx = sum((xi - mx) ** 2 for xi in x)
            b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y)) / sxx
            a = my - b * mx
            need = 2 ** ((goal - a) / b) if b > 0 else None
            fits[k] = {"a": a, "b_per_doubling": b, "goal": goal, "tokens_for_goal": need}
            if need:
                more = need / with_data[-1]["tokens"]
                where = f"{need:.3g} tokens, {more:.3g}x the full mix ({math.ceil(math.log2(more))} more doublings)"
            else:
                where = "never (the line does not rise)"
            print(f"  {label}: {b:+.3f} tau per doubling; goal {goal} at {where}")
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "stage6_shipped": shipped, "fits": fits}, indent=1))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9.5, 4.4))
        for k, (label, goal) in GOALS.items():
            xs = [r["tokens"] for r in with_data]
            line = ax.plot(xs, [r[k] for r in with_data], "o-", label=label)[0]
            ax.axhline(goal, color=line.get_color(), ls=":", lw=1)
            if table[0]["tokens"] == 0:
                ax.plot([xs[0] / 2], [table[0][k]], "s", color=line.get_color(), mfc="none")
            if shipped:
                ax.plot([xs[-1]], [shipped[k]], "*", ms=11, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("response tokens fine-tuned on (log scale); open squares: the stage-4 start, 0 tokens, drawn\n"
                      "at half the smallest run; stars: stage 6 as shipped (the full mix, 2,500 steps against 700)")
        ax.set_ylabel("acceptance length tau")
        ax.set_title("tau against training data (dotted: issue 23's goals)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
