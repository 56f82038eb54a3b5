"""Table of tau against training step from docs/results/tau_curve.sh outputs (PREFIX_greedy.json, PREFIX_t1.json).

    python docs/results/tau_curve_table.py runs/curve/step_*_greedy.json
"""
import json
import re
import sys
from pathlib import Path


def main(paths):
    rows = []
    for g in sorted(paths):
        step = int(re.search(r"step_(\d+)", g).group(1))
        taus = {r["task"]: r["acceptance_length"] for r in json.loads(Path(g).read_text())["results"]}
        t1 = Path(g.replace("_greedy.json", "_t1.json"))
        if t1.exists():
            taus.update({f"{r['task']} T=1": r["acceptance_length"] for r in json.loads(t1.read_text())["results"]})
        rows.append((step, taus))
    cols = list(rows[0][1])
    print("| stage-5 step | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for step, taus in rows:
        print(f"| {step} | " + " | ".join(f"{taus.get(c, float('nan')):.2f}" for c in cols) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
