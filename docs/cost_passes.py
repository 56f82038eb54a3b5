"""How far apart this machine's measurements of the policy's costs fall (`policy.measure_costs`, run N times in
one process): per pass the V(w) ratios and the drafts, then the largest difference from the pass before, in the share
`policy.agree` compares with `policy.STEADY`. On a quiet machine passes agree; on a busy one they scatter, which is
why `policy.costs_for` caches costs only when two passes in a row agree.

    python docs/cost_passes.py --passes 3
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2 import policy  # noqa: E402
from dflash2.pair import load_pair  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    pair = load_pair()
    print("| pass | " + " | ".join(f"V({w})" for w in policy.COST_WIDTHS) + " | draft | tree draft | largest difference "
          f"from the pass before (STEADY = {policy.STEADY}) |\n" + "|---" * (len(policy.COST_WIDTHS) + 4) + "|")
    prev = None
    for i in range(args.passes):
        c = policy.measure_costs(pair.target, pair.drafter)
        gap = ""
        if prev is not None:
            pairs = [(f"V({w})", prev.V(w), c.V(w)) for w in policy.COST_WIDTHS] + [
                ("draft", prev.draft, c.draft), ("tree draft", prev.draft_tree, c.draft_tree)]
            name, a, b = max(pairs, key=lambda p: abs(p[1] - p[2]) / max(p[1], p[2], 1.0))
            gap = f"{abs(a - b) / max(a, b, 1.0):.2f} at {name} ({'agree' if policy.agree(prev, c) else 'disagree'})"
        print(f"| {i + 1} | " + " | ".join(f"{c.V(w):.2f}" for w in policy.COST_WIDTHS)
              + f" | {c.draft:.2f} | {c.draft_tree:.2f} | {gap} |", flush=True)
        prev = c


if __name__ == "__main__":
    main()
