"""The speculation policy replayed offline, free of the machine's timing noise: the speedup it would reach on each
prompt if every step cost what measure_costs says (a plain step V(1), a drafted step D + V(width)).

    python docs/policy_replay.py --tasks mt-bench:0:10,chat-heldout:0:10,gsm8k:0:3 --data-dir ../shared/data

Pass 1 (slow, cached in --cache): greedy decoding of each prompt one token per step, with the drafter run at every
position; it records the uncut drafts of the full block and the law's confidences c_t (proposers.selector_confidence,
which this script wraps to read them). Greedy output does not depend on the policy, so the tokens a drafted step
would accept at position i are the leading drafts equal to the output after i.
Pass 2: policy.Policy itself (and the full block, for comparison) walks each output: at each step it decides to
draft or not, cuts the chain from the recorded confidences and is told what was accepted, as in the loop.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash2 import proposers, spec_decode  # noqa: E402
from dflash2.policy import Costs, Policy, machine_costs  # noqa: E402


class EveryPosition(Policy):
    """Drafts at every step and verifies the anchor alone: one token per step, the drafter seen everywhere."""

    def begin(self, requests, steps, alive):
        super().begin(requests, steps, alive)
        return True

    def cut_chain(self, conf):
        return torch.zeros(conf.shape[0], dtype=torch.long, device=conf.device), 1


class FullBlock(Policy):
    def begin(self, requests, steps, alive):
        super().begin(requests, steps, alive)
        return True

    def cut_chain(self, conf):
        return torch.full((conf.shape[0],), self.cap - 1, device=conf.device), self.cap


class ResetWait(Policy):
    """The policy before commit b1bb333: a drafted step after which drafting still pays resets the wait to 2."""

    def end(self, alive, accepted, drafted, width):
        super().end(alive, accepted, drafted, width)
        if drafted:
            for s, a in zip(self.rows, alive):
                if a and s.rate >= 1.0:
                    s.backoff = 2


def record(specs, data_dir, max_new_tokens):
    from dflash2.pair import load_pair, stop_token_ids
    from dflash2.prompts import encode_prompt, format_prompt, load_tasks

    pair = load_pair()
    costs = machine_costs(pair.target, pair.drafter)
    seen, wrapped = {}, proposers.selector_confidence

    def confidence(selector, h, U, anchor, drafts, cand_ids=None):
        conf = wrapped(selector, h, U, anchor, drafts, cand_ids)
        seen["drafts"].append(drafts[0].tolist())
        seen["conf"].append(conf[0].tolist())
        return conf

    proposers.selector_confidence = confidence
    rows, stops = [], stop_token_ids(pair.target.model, pair.tokenizer)
    try:
        for spec in specs.split(","):
            task, first, num = spec.split(":")
            texts = load_tasks([task], data_dir, int(first) + int(num))[task][int(first):]
            for i, text in enumerate(texts):
                seen.update(drafts=[], conf=[])
                ids = encode_prompt(pair.tokenizer, format_prompt(task, text))
                res = spec_decode.generate(pair.target, pair.drafter, [ids], policy_override=EveryPosition(costs, 8),
                                           block_size=8, max_new_tokens=max_new_tokens, stop_ids=stops)[0]
                rows.append(dict(task=task, index=int(first) + i, tokens=res.tokens, **seen))
                print(f"recorded {task} {int(first) + i}: {len(res.tokens)} tokens", file=sys.stderr, flush=True)
    finally:
        proposers.selector_confidence = wrapped
    return dict(costs=costs.__dict__, rows=rows)


def accepted_at(row, i):
    """Drafts the target accepts at position i: the leading drafts equal to the greedy output after i."""
    n = 0
    for k, d in enumerate(row["drafts"][i]):
        if i + 1 + k >= len(row["tokens"]) or row["tokens"][i + 1 + k] != d:
            break
        n += 1
    return n


def replay(row, policy, costs, extra=0.0):
    """(speedup over plain decoding, share of drafted steps) of `policy` on one recorded output; each drafted
    step is charged `extra` on top of the measured draft (what the loop adds: the context writes)."""
    n, i, cost, steps, drafted_steps = len(row["tokens"]), 0, 0.0, 0, 0
    while i < n - 1:
        drafted = policy.begin([0], [steps], [True])
        accepted, width = 0, 1
        if drafted:
            keep, width = policy.cut_chain(torch.tensor([row["conf"][i]]))
            accepted = min(accepted_at(row, i), int(keep[0]), n - 2 - i)
            cost += costs.draft + extra + costs.V(width)
            drafted_steps += 1
        else:
            cost += 1.0
        policy.end([True], [accepted], drafted, width)
        i, steps = i + accepted + 1, steps + 1
    return (n - 1) / cost, drafted_steps / max(steps, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="mt-bench:0:10,chat-heldout:0:10,gsm8k:0:3", help="task:first:count,...")
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--cache", default="/tmp/policy_replay.json", help="pass 1's record (reused when it exists)")
    ap.add_argument("--before-halving", action="store_true",
                    help="also replay the policy as it was before the wait halving (ResetWait)")
    ap.add_argument("--extra-draft-cost", type=float, default=0.0, metavar="X",
                    help="charge each drafted step X more (units of V(1)) than measure_costs' draft; the policy "
                         "itself still sees the measured costs")
    args = ap.parse_args()
    cache = Path(args.cache)
    data = json.loads(cache.read_text()) if cache.is_file() else None
    if data is None or data.get("tasks") != args.tasks:
        data = dict(record(args.tasks, args.data_dir, args.max_new_tokens), tasks=args.tasks)
        cache.write_text(json.dumps(data))
    costs = Costs(**data["costs"])
    print(f"costs: V(2) {costs.V(2):.2f}, V(4) {costs.V(4):.2f}, V(8) {costs.V(8):.2f}, draft {costs.draft:.2f} "
          f"(units of V(1) = {costs.ms_per_token:.1f} ms); a drafted step charged {args.extra_draft_cost:.2f} more\n")
    before = " | before halving" if args.before_halving else ""
    print(f"| prompt | tokens | full block | policy | policy's drafted steps{before} |\n|---|---|---|---|---|"
          + "---|" * args.before_halving)
    table = []
    for row in data["rows"]:
        full, _ = replay(row, FullBlock(costs, 8), costs, args.extra_draft_cost)
        auto, share = replay(row, Policy(costs, 8), costs, args.extra_draft_cost)
        old = replay(row, ResetWait(costs, 8), costs, args.extra_draft_cost)[0] if args.before_halving else None
        table.append((row["task"], full, auto, old))
        print(f"| {row['task']} {row['index']} | {len(row['tokens'])} | {full:.2f}× | {auto:.2f}× | {share:.2f} |"
              + (f" {old:.2f}× |" if old is not None else ""))
    for task in dict.fromkeys(r[0] for r in table):
        full, auto, old = ([r[k] for r in table if r[0] == task] for k in (1, 2, 3))
        print(f"\n{task}: full block mean {sum(full) / len(full):.3f}× (lowest {min(full):.2f}×), "
              f"policy mean {sum(auto) / len(auto):.3f}× (lowest {min(auto):.3f}×)"
              + (f", before halving mean {sum(old) / len(old):.3f}× (lowest {min(old):.3f}×)" if args.before_halving
                 else ""), end="")
    print()


if __name__ == "__main__":
    main()
