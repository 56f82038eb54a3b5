"""The speculation policy (`auto`) against the full block (`fixed`) in one process, taking turns round by round, so
that a drifting machine slows both alike. Prints each request's tok/s and τ, then the pooled tok/s of each.

    python docs/alternate_policies.py --task gsm8k --num-prompts 5 --max-new-tokens 128 --rounds 3
    python docs/alternate_policies.py --prompt "Write a Python function ..." --max-new-tokens 256 --rounds 4   # one message
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2.pair import load_pair, stop_token_ids  # noqa: E402
from dflash2.prompts import encode_prompt, format_prompt, load_tasks  # noqa: E402  (one chat encoder, issue 41)
from dflash2.spec_decode import generate  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="gsm8k")
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", default=None, help="one user message (the CLI's --prompt) instead of --task's prompts")
    args = ap.parse_args()
    pair = load_pair()
    if args.prompt is not None:
        prompts = [encode_prompt(pair.tokenizer, args.prompt)]
    else:
        prompts = [encode_prompt(pair.tokenizer, format_prompt(args.task, t))
                   for t in load_tasks([args.task], args.data_dir, args.num_prompts)[args.task]]
    stops = stop_token_ids(pair.target.model, pair.tokenizer)  # as the CLI and the bench stop
    total = {"auto": [0, 0.0], "fixed": [0, 0.0]}
    for rnd in range(args.rounds):
        for policy in ("auto", "fixed") if rnd % 2 == 0 else ("fixed", "auto"):
            cells = []
            for p in prompts:
                start = time.perf_counter()
                res = generate(pair.target, pair.drafter, [p], max_new_tokens=args.max_new_tokens, block_size=8,
                               policy=policy, stop_ids=stops)[0]
                seconds = time.perf_counter() - start
                total[policy][0] += len(res.tokens)
                total[policy][1] += seconds
                cells.append(f"{len(res.tokens) / seconds:.1f} tok/s τ {res.acceptance_length:.2f}")
            print(f"round {rnd} {policy:5s}: " + " | ".join(cells), flush=True)
    rate = {k: n / s for k, (n, s) in total.items()}
    print(f"pooled: auto {rate['auto']:.2f} tok/s, fixed {rate['fixed']:.2f} tok/s, auto / fixed "
          f"{rate['auto'] / rate['fixed']:.3f}")


if __name__ == "__main__":
    main()
