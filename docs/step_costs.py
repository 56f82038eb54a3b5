"""Where a decode step's time goes inside the loop, for the default policy on one prompt: the median step time of
plain and of drafted steps and, within them, the drafter (with the flush of deferred context writes), the selector,
the law's confidences, the cut, the target's forward, the context projections and the verification. Timed by
wrapping the loop's functions (the wrappers add microseconds).

    python docs/step_costs.py --task mt-bench --first 70 --rounds 2
"""
import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2 import model, proposers, spec_decode as sd  # noqa: E402
from dflash2.pair import load_pair, stop_token_ids  # noqa: E402
from dflash2.policy import Policy, machine_costs  # noqa: E402
from dflash2.prompts import encode_prompt, format_prompt, load_tasks  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="mt-bench")
    ap.add_argument("--first", type=int, default=70, help="the prompt's index in the task (70: MT-Bench humanities)")
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    pair = load_pair()
    text = load_tasks([args.task], args.data_dir, args.first + 1)[args.task][args.first]
    prompt = encode_prompt(pair.tokenizer, format_prompt(args.task, text))
    stops = stop_token_ids(pair.target.model, pair.tokenizer)
    costs = machine_costs(pair.target, pair.drafter)
    part, steps, last = collections.defaultdict(float), [], [None]

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            part[name] += time.perf_counter() - start
            return out
        return wrapper

    for obj, name, label in ((proposers, "draft", "drafter (with the flush)"), (proposers, "select_path", "selector"),
                             (proposers, "selector_confidence", "confidences"), (model.DraftContext, "_project", "projections"),
                             (pair.target, "forward", "target forward"), (sd, "verify_greedy", "verification")):
        setattr(obj, name, timed(label, getattr(obj, name)))

    class Timed(Policy):
        def cut_chain(self, conf):
            start = time.perf_counter()
            out = super().cut_chain(conf)
            part["cut"] += time.perf_counter() - start
            return out

        def end(self, alive, accepted, drafted, width):
            now = time.perf_counter()
            if last[0] is not None:
                steps.append((drafted, now - last[0], dict(part)))
            part.clear()
            last[0] = now
            super().end(alive, accepted, drafted, width)

    print(f"{args.task} {args.first}, {args.max_new_tokens} new tokens; V(1) {costs.ms_per_token:.1f} ms, draft "
          f"{costs.draft:.2f} (measure_costs)")
    for rnd in range(args.rounds):
        steps.clear()
        last[0] = None
        sd.generate(pair.target, pair.drafter, [prompt], policy_override=Timed(costs, 8), max_new_tokens=args.max_new_tokens,
                    block_size=8, stop_ids=stops)
        for drafted in (False, True):
            mine = [s for s in steps if s[0] == drafted]
            if not mine:
                continue
            names = sorted({k for s in mine for k in s[2]})
            print(f"round {rnd} {'drafted' if drafted else 'plain'} steps: {len(mine)}, median "
                  f"{1000 * statistics.median(s[1] for s in mine):.1f} ms; " +
                  ", ".join(f"{k} {1000 * statistics.median(s[2].get(k, 0.0) for s in mine):.2f}" for k in names))


if __name__ == "__main__":
    main()
