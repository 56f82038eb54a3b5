"""Train a DFlash 2 drafter for a target model by self-distillation.

    python train.py data  --data-dir ../shared/data --out runs/smollm2      # target writes its own responses
    python train.py train --out runs/smollm2 --steps 2000                   # fit the drafter on them

Data: the target answers training prompts greedily; we keep the token ids and the
target's tapped hidden states (the drafter's context features), so training never
runs the target again. Loss (SPEC §6): position-decayed cross-entropy over the draft
slots plus the selector's cross-entropy over its K candidates.
"""
import argparse
import gzip
import itertools
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from model import load_target

GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_WRAP = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"

# --------------------------------------------------------------------------- data

def _mbpp_function_stub(row) -> str | None:
    """HumanEval-shaped prompt from an MBPP row: its first `def` line plus the task as docstring."""
    for line in row["code"].splitlines():
        if line.startswith("def "):
            return f'{line.rstrip()}\n    """ {row["prompt"].strip()}\n    """\n'
    return None


def _general_prompts() -> list[str]:
    """Open-ended chat prompts made up here (no benchmark text), for MT-Bench-like replies."""
    kinds = ["a short story", "a poem", "a blog post", "a product description", "an email to a colleague",
             "a speech", "a short essay", "a dialogue", "a list of tips", "a news summary"]
    topics = ["the ocean", "learning a new language", "a rainy day in the city", "climate change",
              "a robot that learns to paint", "healthy breakfast habits", "the history of the bicycle",
              "working from home", "a trip to the mountains", "saving money", "friendship", "space travel",
              "the importance of sleep", "a small bakery", "electric cars", "time management"]
    asks = ["Explain {t} to a ten-year-old.", "What are the pros and cons of {t}?",
            "Give me three interesting facts about {t}.", "How would you describe {t} in one paragraph?"]
    concepts = ["photosynthesis", "inflation", "machine learning", "gravity", "the water cycle", "democracy",
                "recursion in programming", "supply and demand", "vaccines", "the internet", "black holes",
                "compound interest", "a hash table", "plate tectonics", "the French revolution", "prime numbers"]
    out = [f"Write {k} about {t}." for k in kinds for t in topics]
    out += [a.format(t=c) for a in asks for c in concepts]
    return out


def training_prompts(data_dir: str) -> list[str]:
    """Training prompts only: GSM8K train, MBPP train/validation/prompt splits, generated chat prompts.

    Evaluation sets (GSM8K test, MATH-500, HumanEval, MBPP test 11-510, MT-Bench) are never read here.
    """
    root = Path(data_dir)
    prompts = []
    with open(root / "gsm8k" / "train.jsonl") as f:
        prompts += [json.loads(line)["question"] + GSM8K_SUFFIX for line in f]
    mbpp = json.loads((root / "mbpp" / "sanitized-mbpp.json").read_text())
    for row in mbpp:
        if 11 <= row["task_id"] <= 510:  # test split
            continue
        prompts.append(row["prompt"])
        stub = _mbpp_function_stub(row)
        if stub:
            prompts.append(HUMANEVAL_WRAP.format(prompt=stub))
    prompts += _general_prompts()
    return prompts


def chat_ids(tokenizer, prompt: str, system: str | None = None) -> list[int]:
    """Token ids of one user turn through the target's chat template, with the generation prompt."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return list(ids)


@torch.no_grad()
def generate_with_features(model, prompts: list[list[int]], taps: list[int], max_new_tokens: int,
                           stop_ids: set[int], pad_id: int):
    """Greedy batched generation (left padded) that also returns the tapped hidden states of every
    token fed to the target: features[i] is [len_i - 1, n*H] for sequence i (the last token is never fed)."""
    from transformers import DynamicCache
    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    cache = DynamicCache()
    seqs = [list(p) for p in prompts]
    feats = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    inp, pos = ids, (mask.cumsum(-1) - 1).clamp(min=0)
    for _ in range(max_new_tokens):
        out = model(input_ids=inp, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True, output_hidden_states=True)
        tapped = torch.cat([out.hidden_states[l + 1] for l in taps], dim=-1).to(torch.bfloat16)
        nxt = out.logits[:, -1].argmax(-1)
        for i in range(b):
            if done[i]:
                continue
            row = tapped[i, -inp.shape[1]:]
            feats[i].append(row[mask[i, -inp.shape[1]:].bool()] if inp.shape[1] > 1 else row)
            seqs[i].append(int(nxt[i]))
            if int(nxt[i]) in stop_ids:
                done[i] = True
        if done.all():
            break
        inp = nxt[:, None]
        pos = pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
    return [(torch.tensor(s), torch.cat(f)) for s, f in zip(seqs, feats)]


def make_data(args):
    model, tok = load_target(args.target, dtype=getattr(torch, args.dtype))
    taps = [int(t) for t in args.taps.split(",")]
    out = Path(args.out) / "data"
    out.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(args.data_dir)
    random.Random(args.seed).shuffle(prompts)
    prompts = prompts[: args.max_prompts]
    encoded = [chat_ids(tok, p) for p in prompts]
    eos = getattr(model.generation_config, "eos_token_id", None)
    stop = {tok.eos_token_id} | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    meta = {"target": args.target, "taps": taps, "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts)}
    (out / "meta.json").write_text(json.dumps(meta))
    shards = [list(range(i, min(i + args.batch_size, len(encoded)))) for i in range(0, len(encoded), args.batch_size)]
    torch.set_num_threads(args.threads)
    for k, idx in enumerate(tqdm(shards, desc="self-distillation")):
        path = out / f"shard_{k:05d}.pt"
        if path.exists():
            continue  # resumable
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        rows = generate_with_features(model, [encoded[i] for i in idx], taps, args.max_new_tokens, stop, pad)
        torch.save({"ids": [r[0] for r in rows], "features": [r[1] for r in rows],
                    "prompt_lens": [len(encoded[i]) for i in idx]}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="self-distil training data from the target")
    d.add_argument("--target", default=None)
    d.add_argument("--data-dir", default="../shared/data")
    d.add_argument("--out", default="runs/smollm2")
    d.add_argument("--taps", default="1,8,14,21,27")
    d.add_argument("--max-prompts", type=int, default=4000)
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", default="bfloat16", help="target dtype for generation (bf16 is ~2x faster on CPU)")
    args = ap.parse_args()
    if args.cmd == "data":
        make_data(args)


if __name__ == "__main__":
    main()
