"""Check the authors' implementation against this one: run z-lab's `dflash_generate` (PyPI
`dflash==0.1.0`, installed with `pip install --no-deps dflash==0.1.0`) and write its steps as a
trace in this project's format (docs/TRACE.md), which `dflash2_ref.py --check-trace` replays.

    python -m dflash2.conformance --prompt "What is 12 + 30?" --max-new-tokens 64 --out theirs.jsonl
    python -m dflash2.conformance --task gsm8k --task mt-bench --num-prompts 2 --data-dir ../shared/data \\
        --max-new-tokens 64 --out theirs.jsonl
    python dflash2_ref.py --check-trace theirs.jsonl

Their loop is not modified: the adapter only watches it. A hook on the target sees each verify
pass (block ids, positions, logits), a wrapper on `CandidateSelector.select` sees each draft's
logits and candidates, and each request's `acceptance_length` is their own `return_stats` figure.
Greedy only: their sampling draws from torch's RNG (multinomial), whose draws a replay cannot
reproduce. Both models run in float32 with aten's linears, as the trace's config record says.
"""
import argparse
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from .pair import load_pair
from .settings import DecodeSettings
from .trace import config_record, floats, step_record, write_line

PRODUCER = "z-lab dflash==0.1.0 dflash_generate, through dflash2.conformance"


def load_reference():
    """z-lab's dflash.model, or an ImportError that says how to install it."""
    try:
        import dflash.model as reference
    except ImportError as e:
        raise ImportError("the reference implementation is PyPI's dflash==0.1.0: "
                          "pip install --no-deps dflash==0.1.0") from e
    return reference


def load_reference_drafter(draft_dir, dtype=torch.float32):
    """Their DFlash2DraftModel from the same checkpoint files this project loads."""
    reference = load_reference()
    return reference.DFlash2DraftModel.from_pretrained(str(draft_dir), dtype=dtype, attn_implementation="sdpa").eval()


@contextmanager
def _watched(reference, drafter, target):
    """Record what their loop computes, without changing it: per verify pass, the drafts' logits and
    candidates (from CandidateSelector.select) and the target's input, positions and logits."""
    drafts, verifies = [], []
    selector = drafter.candidate_selector
    select = selector.select

    def watched_select(hidden, logits, anchor_ids, temperature):
        path, candidates, q = select(hidden, logits, anchor_ids, temperature)
        # Their top-k is unsorted; the trace lists C_t as torch.topk(sorted=True) orders it (descending,
        # ties in topk's order), after checking that the members are theirs.
        values, ids = logits[0].topk(candidates.shape[-1], dim=-1)
        if ids.sort(-1).values.tolist() != candidates[0].sort(-1).values.tolist():
            raise RuntimeError("their candidates are not the top-K of their draft logits")
        drafts.append((ids, values.float()))
        return path, candidates, q

    def hook(module, args, kwargs, output):
        ids = args[0] if args else kwargs["input_ids"]
        verifies.append((ids[0].tolist(), int(kwargs["position_ids"][0, 0]), output.logits[0].argmax(-1).tolist()))

    selector.select = watched_select
    handle = target.register_forward_hook(hook, with_kwargs=True)
    cuda_time = reference._cuda_time
    reference._cuda_time = time.perf_counter  # return_stats times with torch.cuda.synchronize
    try:
        yield drafts, verifies
    finally:
        selector.select = select
        handle.remove()
        reference._cuda_time = cuda_time


def step_records(request, drafts, verifies):
    """Trace step records of one request from what _watched saw (the first target call is the prefill)."""
    if len(verifies) != len(drafts) + 1:
        raise RuntimeError(f"watched {len(verifies) - 1} verify passes but {len(drafts)} drafts")
    records = []
    for step, ((candidates, cand_logits), (block, start, argmax)) in enumerate(zip(drafts, verifies[1:]), 1):
        n = len(block) - 1
        accepted = 0
        while accepted < n and block[1 + accepted] == argmax[accepted]:
            accepted += 1
        records.append(step_record(
            request=request, step=step, anchor_pos=start, anchor=block[0], drafts=block[1:],
            candidates=candidates[:n].tolist(), cand_logits=floats(cand_logits[:n].cpu()), q=None, q_draft=None,
            target_argmax=argmax, u_accept=None, u_emit=None, num_accepted=accepted,
            out=block[1 : 1 + accepted] + [argmax[accepted]]))
    return records


def reference_generate(reference, drafter, model, prompt, max_new_tokens, stop_ids, block_size=None):
    """Their dflash_generate on one prompt (greedy): (step records for request 0, result fields)."""
    with _watched(reference, drafter, model) as (drafts, verifies):
        stats = reference.dflash_generate(drafter, model, torch.tensor([prompt], device=model.device),
                                          max_new_tokens, list(stop_ids) or None, temperature=0.0,
                                          block_size=block_size, return_stats=True)
    tokens = stats.output_ids[0, stats.num_input_tokens :].tolist()
    result = dict(tokens=tokens, verify_steps=1 + len(stats.acceptance_lengths),
                  finished_by_stop=bool(tokens) and tokens[-1] in set(stop_ids),
                  acceptance_length=statistics.mean(stats.acceptance_lengths) if stats.acceptance_lengths else None)
    return step_records(0, drafts, verifies), result


def write_reference_trace(path, prompts, target=None, draft=None, max_new_tokens=64, block_size=None,
                          device="cpu"):
    """Run their loop on each prompt (lists of token ids) and write one trace of them all, with the
    config record a replay needs: this pair, float32, aten linears, greedy. Returns the records."""
    from .pair import stop_token_ids

    reference = load_reference()
    pair = load_pair(target, draft, torch.device(device), torch.float32, draft_dtype=torch.float32, prepack=False)
    drafter = load_reference_drafter(pair.draft_dir).to(device)
    block_size = block_size or drafter.block_size
    stop_ids = stop_token_ids(pair.target.model, pair.tokenizer)
    settings = DecodeSettings(method="dflash2", max_new_tokens=max_new_tokens, stop_ids=stop_ids, block_size=block_size,
                              policy="fixed")  # the authors' loop verifies whole blocks
    records = [dict(config_record(pair, prompts, settings), producer=PRODUCER)]
    results = []
    for request, prompt in enumerate(prompts):
        steps, result = reference_generate(reference, drafter, pair.target.model, prompt, max_new_tokens, stop_ids,
                                           block_size)
        records += [dict(s, request=request) for s in steps]
        results.append(dict(type="result", request=request, **result))
    records += results
    with open(path, "w") as f:
        for r in records:
            write_line(f, r)
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description="Write a trace of z-lab's dflash_generate (greedy) for "
                                            "dflash2_ref.py --check-trace.")
    p.add_argument("--prompt", action="append", default=[], help="a user message (repeatable)")
    p.add_argument("--task", action="append", default=[], help="prompts of a benchmark task (repeatable): "
                   "gsm8k, math500, humaneval, mbpp, mt-bench")
    p.add_argument("--num-prompts", type=int, default=2, help="prompts per --task (default: 2)")
    p.add_argument("--data-dir", help="local task data (the ../shared/data layout); default: the Hub")
    p.add_argument("--target", help="target directory or hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="drafter directory or hub id (default: the embedded drafter)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="(default: 64)")
    p.add_argument("--block-size", type=int, help="(default: the drafter's)")
    p.add_argument("--out", required=True, help="the trace file to write")
    args = p.parse_args(argv)
    if not args.prompt and not args.task:
        p.error("give --prompt and/or --task")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from transformers import AutoTokenizer

    from .pair import resolve_target
    from .prompts import encode_prompt

    texts = list(args.prompt)
    if args.task:
        from .prompts import format_prompt, load_tasks

        for task, rows in load_tasks(args.task, args.data_dir or "", args.num_prompts).items():
            texts += [format_prompt(task, t) for t in rows]
    tok = AutoTokenizer.from_pretrained(resolve_target(args.target)[1])  # prompts encoded as the CLI does
    prompts = [encode_prompt(tok, t) for t in texts]
    records = write_reference_trace(args.out, prompts, args.target, args.draft, args.max_new_tokens, args.block_size)
    steps = sum(r["type"] == "step" for r in records)
    print(f"wrote {args.out}: {steps} steps of {len(prompts)} request(s) from {PRODUCER}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
