"""The speculation policy (`auto`) against the full block (`fixed`) in one process, taking turns round by round, so
that a drifting machine slows both alike. Prints each request's tok/s and τ, then the pooled tok/s of each and
their ratios to the first. `--modes` adds plain decoding (`ar`) and the loop with a policy that never drafts
(`plain`: what the default costs where no draft pays).

    python docs/alternate_policies.py --task gsm8k --num-prompts 5 --max-new-tokens 128 --rounds 3
    python docs/alternate_policies.py --prompt "Write a Python function ..." --max-new-tokens 256 --rounds 4   # one message
    python docs/alternate_policies.py --task chat-heldout --first 2 --num-prompts 1 --modes auto,ar,plain --rounds 4
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2.pair import load_pair, stop_token_ids  # noqa: E402
from dflash2.prompts import encode_prompt, format_prompt, load_tasks  # noqa: E402  (one chat encoder, issue 41)
from dflash2.policy import Policy  # noqa: E402
from dflash2.spec_decode import generate  # noqa: E402


class NeverDrafts(Policy):
    """Every step plain: the loop's cost where no draft would pay."""

    def begin(self, requests, steps, alive):
        super().begin(requests, steps, alive)
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="gsm8k")
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--first", type=int, default=0, help="skip the task's first N prompts")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", default=None, help="one user message (the CLI's --prompt) instead of --task's prompts")
    ap.add_argument("--modes", default="auto,fixed", help="comma-separated, taking turns: auto, fixed, ar, plain")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not modes or set(modes) - {"auto", "fixed", "ar", "plain"}:
        raise SystemExit(f"--modes: a comma-separated subset of auto,fixed,ar,plain, got {args.modes!r}")
    pair = load_pair()
    if args.prompt is not None:
        prompts = [encode_prompt(pair.tokenizer, args.prompt)]
    else:
        prompts = [encode_prompt(pair.tokenizer, format_prompt(args.task, t))
                   for t in load_tasks([args.task], args.data_dir, args.first + args.num_prompts)[args.task][args.first:]]
    stops = stop_token_ids(pair.target.model, pair.tokenizer)  # as the CLI and the bench stop
    total = {m: [0, 0.0] for m in modes}
    for rnd in range(args.rounds):
        for policy in modes[rnd % len(modes):] + modes[: rnd % len(modes)]:  # the first mode rotates
            cells = []
            for p in prompts:
                start = time.perf_counter()
                if policy == "ar":
                    res = generate(pair.target, None, [p], method="ar", max_new_tokens=args.max_new_tokens,
                                   stop_ids=stops)[0]
                else:
                    res = generate(pair.target, pair.drafter, [p], max_new_tokens=args.max_new_tokens, block_size=8,
                                   stop_ids=stops, **({"policy": policy} if policy != "plain" else
                                                      {"policy_override": NeverDrafts(pair_costs(pair), 8)}))[0]
                seconds = time.perf_counter() - start
                total[policy][0] += len(res.tokens)
                total[policy][1] += seconds
                cells.append(f"{len(res.tokens) / seconds:.1f} tok/s τ {res.acceptance_length:.2f}")
            print(f"round {rnd} {policy:5s}: " + " | ".join(cells), flush=True)
    rate = {k: n / s for k, (n, s) in total.items()}
    print("pooled: " + ", ".join(f"{m} {rate[m]:.2f} tok/s" for m in modes) + "; "
          + ", ".join(f"{m} / {modes[0]} {rate[m] / rate[modes[0]]:.3f}" for m in modes[1:]))


def pair_costs(pair):
    from dflash2.policy import machine_costs

    return machine_costs(pair.target, pair.drafter)


if __name__ == "__main__":
    main()
