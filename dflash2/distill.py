"""Self-distilled training data: the target answers training prompts (greedily or sampled) and we keep the
token ids and, on a CPU, the target's tapped hidden states (the drafter's context features); and the prompts
the target writes itself (self-instruct, multi-turn follow-ups). `python -m dflash2.train data|prompts` runs it.
"""
import itertools
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from .machine import half_dtype
from .pair import load_target, stop_token_ids
from .prompts import (FOLLOW_UPS, SELF_INSTRUCT_KINDS, SELF_INSTRUCT_TOPICS, encode_prompt, filter_generated,
                      training_prompts)
from .settings import check_sampling_params
from .target import cache_kwarg
from .verify import process_logits


def usage_error(message):
    """Bad input: one line on stderr and exit 2, as argparse's own errors."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_device(name) -> torch.device:
    """The torch device named by --device, refused in one line before anything loads if this machine has none."""
    try:
        device = torch.device(name)
    except RuntimeError:
        usage_error(f"--device {name}: not a torch device (cpu, cuda, cuda:1, ...)")
    if device.type not in ("cpu", "cuda"):
        usage_error(f"--device {name}: only cpu and cuda are supported")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        usage_error(f"--device {name}: this machine has {count or 'no'} CUDA device{'' if count == 1 else 's'}")
    return device


@torch.no_grad()
def ddp_setup(device):
    """Under torchrun (WORLD_SIZE > 1) join the process group, each rank on its own GPU (nccl) or on the CPU (gloo):
    (rank, world size, device). A plain run is rank 0 of 1."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device


def ddp_teardown():
    """Under torchrun, once the command is done: wait for every rank (rank 0 may still be writing the drafter), then
    leave the process group. A rank that exits without destroy_process_group can die in SIGABRT while the interpreter
    shuts down, Gloo's threads still holding tensors of DDP's last all-reduce (pytorch/pytorch#179291); it did so
    once in our CI, failing a two-process run that had trained correctly."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@torch.no_grad()
def generate_with_features(model, prompts: list[list[int]], taps: list[int], max_new_tokens: int,
                           stop_ids: set[int], pad_id: int, temperature: float = 0.0, top_p: float = 1.0,
                           generator: torch.Generator | None = None, deadline: float | None = None,
                           last_hidden: bool = False):
    """Batched generation (left padded) on the model's device that also returns the tapped hidden states of every
    token fed to the target: features[i] is [len_i - 1, n*H] bf16 on the CPU for sequence i (the last token is never
    fed); None for every sequence when taps is empty. Rows are (ids, features), or with last_hidden (and taps)
    (ids, features, last): the final normed hidden state [len_i - 1, H] bf16, from which the LM head gives the
    target's next-token logits at every fed position (DSpark's loss needs that distribution).

    Greedy at temperature 0; else each token is drawn from verify.process_logits (temperature, top-p), the law users
    sample from, so the drafter also learns the target's sampled continuations. At time.monotonic() > deadline the
    batch stops after the token in hand: every response is cut there (each is still the target's own text)."""
    from transformers import DynamicCache
    dev = model.device
    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    cache, cache_kw = DynamicCache(), cache_kwarg(model)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    tokens, running, feats = [], [], []  # per step: the drawn tokens [b], the rows still running [b], the features
    inp, pos = ids, (mask.cumsum(-1) - 1).clamp(min=0)
    for _ in range(max_new_tokens):
        out = model(input_ids=inp, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                    output_hidden_states=bool(taps), **{cache_kw: cache})  # logits of the last position only
        if taps:  # hidden_states[-1] is the decoder's output after its final norm (transformers ties it)
            tapped = [out.hidden_states[l + 1] for l in taps] + ([out.hidden_states[-1]] if last_hidden else [])
            feats.append(torch.cat(tapped, dim=-1).to("cpu", torch.bfloat16))
        if temperature > 0:
            probs = process_logits(out.logits[:, -1].float(), temperature, top_p=top_p)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            nxt = out.logits[:, -1].argmax(-1)
        tokens.append(nxt)
        running.append(~done)
        done = done | torch.isin(nxt, stops)
        if bool(done.all()) or (deadline is not None and time.monotonic() > deadline):
            break
        inp = nxt[:, None]
        pos = pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long, device=dev)], dim=1)
    tokens, counts = torch.stack(tokens, 1).cpu(), torch.stack(running, 1).sum(1).tolist()  # tokens each row drew
    later = torch.cat(feats[1:], dim=1) if len(feats) > 1 else None  # [b, steps - 1, n*H]: one fed token a step
    seqs = [torch.cat([torch.tensor(p), tokens[i, : counts[i]]]) for i, p in enumerate(prompts)]
    if not taps:
        return [(s, None) for s in seqs]
    # the prompt's own positions, then each drawn token but the last
    rows = [(s, torch.cat([feats[0][i, width - len(p):]] + ([later[i, : counts[i] - 1]] if later is not None else [])))
            for i, (s, p) in enumerate(zip(seqs, prompts))]
    if not last_hidden:
        return rows
    H = feats[0].shape[-1] // (len(taps) + 1)
    return [(s, f[:, :-H], f[:, -H:]) for s, f in rows]


def save_shard(path: Path, rows, prompt_lens):
    """One shard of self-distilled sequences: token ids, prompt lengths and, if generated, the features and the
    target's final hidden states (rows of generate_with_features)."""
    shard = {"ids": [r[0] for r in rows], "prompt_lens": list(prompt_lens)}
    if rows[0][1] is not None:
        shard["features"] = [r[1] for r in rows]
    if len(rows[0]) > 2:
        shard["last_hidden"] = [r[2] for r in rows]
    torch.save(shard, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)


def make_data(args):
    try:  # before the target loads
        check_sampling_params(args.temperature, args.top_p, 0)
    except ValueError as e:  # a usage error: exit 2, as argparse's
        usage_error(e)
    rank, world, device = ddp_setup(check_device(args.device))
    model, tok = load_target(args.target, device=device, dtype=generation_dtype(args.dtype, device))
    taps = [int(t) for t in args.taps.split(",")]
    out = Path(args.out) / "data"
    out.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(args.data_dir, sources=[s for s in args.sources.split(",") if s], seed=args.seed)
    for path in args.prompts_file:  # prompts the target wrote (`dflash2.train prompts`): strings or conversations
        prompts += read_prompts_file(path)
    random.Random(args.seed).shuffle(prompts)
    encoded = [encode_prompt(tok, p) for p in prompts]
    if args.exclude:  # later stages: skip prompts an earlier `dflash2.train data` run already answered
        seen = seen_prompts(args.exclude)
        keep = [i for i, e in enumerate(encoded) if tuple(e) not in seen]
        print(f"--exclude: {len(encoded) - len(keep)} of {len(encoded)} prompts already in {', '.join(args.exclude)}")
        prompts, encoded = [prompts[i] for i in keep], [encoded[i] for i in keep]
    prompts, encoded = prompts[: args.max_prompts], encoded[: args.max_prompts]
    stop = set(stop_token_ids(model, tok))
    meta = {"target": args.target, "taps": taps, "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
            "temperature": args.temperature, "top_p": args.top_p, "features": args.features,
            "last_hidden": args.features}
    (out / "meta.json").write_text(json.dumps(meta))
    shards = [list(range(i, min(i + args.batch_size, len(encoded)))) for i in range(0, len(encoded), args.batch_size)]
    torch.set_num_threads(args.threads)
    for k, idx in enumerate(tqdm(shards, desc="self-distillation")):
        path = out / f"shard_{k:05d}.pt"
        if path.exists() or k % world != rank:
            continue  # resumable; under torchrun, another rank's shard
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        gen = torch.Generator(device).manual_seed(args.seed * 1_000_003 + k)  # per shard, so a resumed run draws alike
        rows = generate_with_features(model, [encoded[i] for i in idx], taps if args.features else [],
                                      args.max_new_tokens, stop, pad, temperature=args.temperature, top_p=args.top_p,
                                      generator=gen, last_hidden=args.features)
        save_shard(path, rows, [len(encoded[i]) for i in idx])


def read_prompts_file(path) -> list:
    """Prompts from a JSONL file of {"prompt": str} or {"messages": [...]} rows (`dflash2.train prompts`)."""
    out = []
    for n, line in enumerate(open(path), 1):
        if line.strip():
            row = json.loads(line)
            if "prompt" not in row and "messages" not in row:
                raise SystemExit(f"error: {path} line {n} has neither 'prompt' nor 'messages'")
            out.append(row.get("prompt") or row["messages"])
    return out


def _clean_question(text: str) -> str | None:
    """A generated question cut to its first sentence ending in '?', without labels or quotes; None if unusable
    (no question mark, too short or long, or about the assistant and the task instead of a topic)."""
    line = next((x.strip() for x in text.strip().splitlines() if x.strip()), "")
    if "?" not in line:
        return None
    line = line[: line.index("?") + 1]
    line = re.sub(r'^.*?(asks?|question( is)?|wants to know)\s*[:,]?\s*"?', "", line, count=1, flags=re.I)
    line = re.sub(r'^[\w .-]{0,24}:\s*', "", line.strip(), count=1).strip().strip('"\u201c\u201d*').strip()
    if not 20 <= len(line) <= 300 or line.count(" ") < 3 or re.search(r"assistant|chatbot|question|smol|\[", line, re.I):
        return None
    return line[0].upper() + line[1:]


def _reply_texts(model, tok, prompts: list, max_new_tokens: int, batch_size: int, temperature: float, seed: int,
                 desc: str, deadline: float | None = None) -> list[str]:
    """The target's replies (text) to prompts, batched; greedy at temperature 0, else sampled (top-p 0.95). Past the
    deadline no batch starts and the one running is cut: fewer replies come back."""
    stop = set(stop_token_ids(model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out = []
    encoded = [encode_prompt(tok, p) for p in prompts]
    for k in tqdm(range(0, len(encoded), batch_size), desc=desc):
        if deadline is not None and k and time.monotonic() > deadline:
            break
        batch = encoded[k : k + batch_size]
        gen = torch.Generator(model.device).manual_seed(seed * 1_000_003 + k)
        rows = generate_with_features(model, batch, [], max_new_tokens, stop, pad, temperature=temperature,
                                      top_p=0.95 if temperature > 0 else 1.0, generator=gen, deadline=deadline)
        for (ids, _), p in zip(rows, batch):
            resp = [t for t in ids[len(p):].tolist() if t not in stop]
            out.append(tok.decode(resp, skip_special_tokens=True))
    return out


def self_instruct(model, tok, num, data_dir, batch_size, seed, deadline=None):
    """Questions a user might type, written by the target: (asked, usable, kept after filtering).

    For each (topic, kind) of a shuffled grid, cycled when num exceeds it, the target is asked for a question,
    sampled at T = 0.7; a usable reply is cut to its first sentence ending in "?" (_clean_question), and near-duplicates
    of earlier questions and of every evaluation prompt are dropped (prompts.filter_generated)."""
    grid = [(t, k) for t in SELF_INSTRUCT_TOPICS for k in SELF_INSTRUCT_KINDS]
    random.Random(seed).shuffle(grid)
    asks = [f"Topic: {t}. Write a question a user could type to a chatbot about this topic, asking for {k}. "
            f"Write it in the user's own words, as one sentence ending with a question mark."
            for t, k in itertools.islice(itertools.cycle(grid), num)]
    texts = _reply_texts(model, tok, asks, 48, batch_size, 0.7, seed, "self-instruct", deadline)
    candidates = [q for q in map(_clean_question, texts) if q]
    return len(texts), len(candidates), filter_generated(candidates, data_dir)


def make_prompts(args):
    """Prompts the target writes itself, filtered for duplicates and for evaluation text, as JSONL.

    self-instruct: see self_instruct.
    multi-turn: first turns from --first-turns (a prompts file) or the `talk2` and `docs` sources, the target's
    greedy answer, then a follow-up from FOLLOW_UPS: the response trained on is the answer to the follow-up."""
    device = check_device(getattr(args, "device", "cpu"))
    model, tok = load_target(args.target, device=device, dtype=generation_dtype(args.dtype, device))
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    if args.kind == "self-instruct":
        asked, usable, kept = self_instruct(model, tok, args.num, args.data_dir, args.batch_size, args.seed)
        rows = [{"prompt": q} for q in kept]
        print(f"self-instruct: {asked} asked, {usable} usable, {len(kept)} kept after duplicate and "
              f"evaluation-text filtering")
    else:
        firsts = (read_prompts_file(args.first_turns) if args.first_turns else
                  training_prompts(args.data_dir, sources=("talk2", "docs"), seed=args.seed))
        firsts = [f for f in firsts if isinstance(f, str)]
        rng.shuffle(firsts)
        firsts = firsts[: args.num]
        answers = _reply_texts(model, tok, firsts, args.answer_tokens, args.batch_size, 0.0, args.seed, "first turns")
        rows = []
        for q, a in zip(firsts, answers):
            a = a.strip()
            if len(a) < 20:
                continue
            rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a},
                                      {"role": "user", "content": rng.choice(FOLLOW_UPS)}]})
        print(f"multi-turn: {len(rows)} conversations of {len(firsts)} first turns")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# --------------------------------------------------------------------------- training

def seen_prompts(data_dirs) -> set[tuple[int, ...]]:
    """Token ids of every prompt answered in these `dflash2.train data` outputs (their data/ folders)."""
    seen = set()
    for d in data_dirs:
        paths = sorted(Path(d).glob("shard_*.pt"))
        if not paths:
            raise SystemExit(f"error: --exclude {d} holds no shard_*.pt files")
        for path in paths:
            shard = torch.load(path, mmap=True)  # features stay on disk; only the ids are read
            seen.update(tuple(i[:p].tolist()) for i, p in zip(shard["ids"], shard["prompt_lens"]))
    return seen


def load_shards(data_dir: Path, last_hidden=False):
    """All self-distilled sequences: (token ids [L], features [L-1, n*H] bf16 or None if not stored, prompt length).

    last_hidden: the features carry the target's final hidden state as H more columns, [L-1, n*H + H]; a shard
    that did not store it gives None (the trainer then recomputes both from the target)."""
    seqs = []
    for path in sorted(Path(data_dir).glob("shard_*.pt")):
        shard = torch.load(path)
        feats = shard.get("features") or [None] * len(shard["ids"])
        if last_hidden:
            last = shard.get("last_hidden") or [None] * len(feats)
            feats = [None if f is None or h is None else torch.cat([f, h], -1) for f, h in zip(feats, last)]
        seqs += [(i, f, p) for i, f, p in zip(shard["ids"], feats, shard["prompt_lens"]) if len(i) >= p + 2]
    if not seqs:
        raise FileNotFoundError(f"no training shards in {data_dir}: run `python -m dflash2.train data` first")
    return seqs


@torch.no_grad()
def generation_dtype(name, device):
    """The target's dtype for generating data: the one named, else bf16 where it is native (about 2x faster
    than float32 on such a CPU), float32 on a CPU that would emulate it (machine.half_dtype)."""
    return getattr(torch, name) if name else half_dtype(device)


def target_features(model, seqs, taps, bf16=True, last_hidden=False):
    """The frozen target's tapped hidden states over each sequence but its last token, computed now instead of read
    from a shard: [S, L, n*H] float32 on the model's device (with last_hidden, [S, L, n*H + H]: the final normed
    hidden state after them, as load_shards gives). Sequences are right padded: causal attention never looks at the
    padding, and no block's context reaches past its own anchor."""
    ids = torch.zeros(len(seqs), max(len(i) for i, _, _ in seqs) - 1, dtype=torch.long)
    for s, (i, _, _) in enumerate(seqs):
        ids[s, : len(i) - 1] = i[:-1]
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):  # the decoder alone: no LM head
        out = model.get_decoder()(input_ids=ids.to(model.device), output_hidden_states=True, use_cache=False)
    tapped = [out.hidden_states[l + 1] for l in taps] + ([out.last_hidden_state] if last_hidden else [])
    return torch.cat(tapped, dim=-1).float()


