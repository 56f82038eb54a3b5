"""Train a DFlash 2 drafter for a target model by self-distillation.

    python -m dflash2.train data  --data-dir ../shared/data --out runs/smollm2      # target writes its own responses
    python -m dflash2.train train --out runs/smollm2 --steps 2000                   # fit the drafter on them
    python -m dflash2.train run --minutes 10 --out runs/gpu --device cuda           # the whole recipe in 10 minutes

Data: the target answers training prompts, greedily or sampled (`data --temperature`); we keep the token ids and,
on a CPU, the target's tapped hidden states (the drafter's context features), so training never runs the target
again; without them (`data --no-features`, and `run`) training recomputes the features from the frozen target on
the fly, as a GPU does faster than it could read them. Loss (SPEC §6): position-decayed cross-entropy over the
draft slots plus the selector's cross-entropy over its K candidates. The prompts come from prompts.py
(`training_prompts`).
"""
import argparse
import itertools
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from .bench import format_prompt, load_tasks, mean_tau
from .checkpoint import DFlash2Config, spread_target_layer_ids
from .machine import half_dtype
from .model import DFlash2Drafter
from .pair import cache_kwarg, load_target, stop_token_ids
from .prompts import (FOLLOW_UPS, PROMPT_SOURCES, SELF_INSTRUCT_KINDS, SELF_INSTRUCT_TOPICS, chat_ids, filter_generated,
                      training_prompts)
from .settings import DEFAULT_TARGET, DTYPE_NAMES, HelpFormatter, check_sampling_params
from .spec_decode import Target, generate
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


# --------------------------------------------------------------------------- data

@torch.no_grad()
def generate_with_features(model, prompts: list[list[int]], taps: list[int], max_new_tokens: int,
                           stop_ids: set[int], pad_id: int, temperature: float = 0.0, top_p: float = 1.0,
                           generator: torch.Generator | None = None, deadline: float | None = None):
    """Batched generation (left padded) on the model's device that also returns the tapped hidden states of every
    token fed to the target: features[i] is [len_i - 1, n*H] bf16 on the CPU for sequence i (the last token is never
    fed); None for every sequence when taps is empty.

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
        if taps:
            feats.append(torch.cat([out.hidden_states[l + 1] for l in taps], dim=-1).to("cpu", torch.bfloat16))
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
    return [(s, torch.cat([feats[0][i, width - len(p):]] + ([later[i, : counts[i] - 1]] if later is not None else [])))
            for i, (s, p) in enumerate(zip(seqs, prompts))]


def save_shard(path: Path, rows, prompt_lens):
    """One shard of self-distilled sequences: token ids, prompt lengths and, if generated, the features."""
    shard = {"ids": [r[0] for r in rows], "prompt_lens": list(prompt_lens)}
    if rows[0][1] is not None:
        shard["features"] = [r[1] for r in rows]
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
    encoded = [chat_ids(tok, p) for p in prompts]
    if args.exclude:  # later stages: skip prompts an earlier `dflash2.train data` run already answered
        seen = seen_prompts(args.exclude)
        keep = [i for i, e in enumerate(encoded) if tuple(e) not in seen]
        print(f"--exclude: {len(encoded) - len(keep)} of {len(encoded)} prompts already in {', '.join(args.exclude)}")
        prompts, encoded = [prompts[i] for i in keep], [encoded[i] for i in keep]
    prompts, encoded = prompts[: args.max_prompts], encoded[: args.max_prompts]
    stop = set(stop_token_ids(model, tok))
    meta = {"target": args.target, "taps": taps, "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
            "temperature": args.temperature, "top_p": args.top_p, "features": args.features}
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
                                      generator=gen)
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
    encoded = [chat_ids(tok, p) for p in prompts]
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


def load_shards(data_dir: Path):
    """All self-distilled sequences: (token ids [L], features [L-1, n*H] bf16 or None if not stored, prompt length)."""
    seqs = []
    for path in sorted(Path(data_dir).glob("shard_*.pt")):
        shard = torch.load(path)
        feats = shard.get("features") or [None] * len(shard["ids"])
        seqs += [(i, f, p) for i, f, p in zip(shard["ids"], feats, shard["prompt_lens"]) if len(i) >= p + 2]
    if not seqs:
        raise FileNotFoundError(f"no training shards in {data_dir}: run `python -m dflash2.train data` first")
    return seqs


@torch.no_grad()
def generation_dtype(name, device):
    """The target's dtype for generating data: the one named, else bf16 where it is native (about 2x faster
    than float32 on such a CPU), float32 on a CPU that would emulate it (machine.half_dtype)."""
    return getattr(torch, name) if name else half_dtype(device)


def target_features(model, seqs, taps, bf16=True):
    """The frozen target's tapped hidden states over each sequence but its last token, computed now instead of read
    from a shard: [S, L, n*H] float32 on the model's device. Sequences are right padded: causal attention never
    looks at the padding, and no block's context reaches past its own anchor."""
    ids = torch.zeros(len(seqs), max(len(i) for i, _, _ in seqs) - 1, dtype=torch.long)
    for s, (i, _, _) in enumerate(seqs):
        ids[s, : len(i) - 1] = i[:-1]
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):  # the decoder alone: no LM head
        hs = model.get_decoder()(input_ids=ids.to(model.device), output_hidden_states=True, use_cache=False).hidden_states
    return torch.cat([hs[l + 1] for l in taps], dim=-1).float()


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for draft slots k = 1..B-1 (SPEC §6): early slots matter most."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def default_gamma(block_size: int) -> float:
    """DFlash's decay: 4 for block 8, 5 for 10, 7 for 16 (linear in between)."""
    return {8: 4.0, 10: 5.0, 16: 7.0}.get(block_size, 4.0 + 3.0 * (block_size - 8) / 8)


def make_batch(seqs, block_size, anchors_per_seq, mask_token_id, generator, features=None):
    """Random anchors in each response; block = anchor + masks; context = everything before the anchor.

    Returns padded context features [S, L, n*H] (the stored ones, or `features` from target_features), per-block
    (sequence index, anchor position, block ids [nb, B], gold ids [nb, B-1] with -100 past the end of the sequence).
    """
    feats = features
    if feats is None:
        feats = torch.zeros(len(seqs), max(len(f) for _, f, _ in seqs), seqs[0][1].shape[-1])
        for s, (_, f, _) in enumerate(seqs):
            feats[s, : len(f)] = f.float()
    seq_idx, anchor_pos, blocks, gold = [], [], [], []
    for s, (ids, _, prompt_len) in enumerate(seqs):
        lo, hi = prompt_len, len(ids) - 2  # the first anchor at inference is the first generated token
        n = min(anchors_per_seq, hi - lo + 1)
        for a in (lo + torch.randperm(hi - lo + 1, generator=generator)[:n]).tolist():
            seq_idx.append(s)
            anchor_pos.append(a)
            blocks.append([int(ids[a])] + [mask_token_id] * (block_size - 1))
            g = ids[a + 1 : a + block_size].tolist()
            gold.append(g + [-100] * (block_size - 1 - len(g)))
    return feats, torch.tensor(seq_idx), torch.tensor(anchor_pos), torch.tensor(blocks), torch.tensor(gold)


def drafter_loss(drafter, embed_tokens, lm_head_weight, batch, weights, selector_weight=1.0):
    """Position-decayed CE over the draft slots + the selector's CE over its K candidates (SPEC §6).

    Blocks never see each other: each block attends to its own sequence's context (slots before its
    anchor) and to itself. Returns (loss, per-slot draft top-1 accuracy [B-1], selector accuracy).
    """
    feats, seq_idx, anchor_pos, blocks, gold = batch
    S, L, _ = feats.shape
    nb, B = blocks.shape
    positions = torch.arange(L, device=feats.device).expand(S, L)
    ctx_kv = [(k[seq_idx], v[seq_idx]) for k, v in drafter.context_kv(feats, positions)]
    ctx_valid = positions[:1] < anchor_pos[:, None]
    block_pos = anchor_pos[:, None] + torch.arange(B, device=feats.device)
    embeds = embed_tokens(blocks) * drafter.config.input_embedding_scale
    h = drafter(embeds, block_pos, ctx_kv, ctx_valid)[:, 1:]
    U = drafter.draft_logits(h, lm_head_weight)  # [nb, B-1, V]
    valid = gold >= 0
    ce = F.cross_entropy(U.flatten(0, 1), gold.flatten().clamp(min=0), reduction="none").view(nb, B - 1)
    w = weights[None, :] * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    acc = ((U.argmax(-1) == gold) & valid).sum(0).float() / valid.sum(0).clamp(min=1)

    # Selector: candidates of each slot, gold predecessor teacher-forced (anchor for slot 1).
    selector = drafter.candidate_selector
    cand_ids, _ = selector.candidates(U.detach(), selector.top_k)
    prev = torch.cat([blocks[:, :1], gold[:, :-1].clamp(min=0)], dim=1)  # [nb, B-1]
    wh = selector.hidden_projection(h)
    bilinear = torch.einsum("btr,btr,btkr->btk", wh, selector.predecessor_codebook[prev],
                            selector.successor_codebook[cand_ids])
    scores = U.gather(-1, cand_ids) + bilinear
    hit = cand_ids == gold[..., None]
    in_c = hit.any(-1) & valid
    sel_ce = F.cross_entropy(scores[in_c], hit[in_c].float().argmax(-1)) if in_c.any() else U.sum() * 0
    sel_acc = (scores.argmax(-1)[in_c] == hit[in_c].float().argmax(-1)).float().mean() if in_c.any() else torch.tensor(0.)
    return loss + selector_weight * sel_ce, loss.detach(), sel_ce.detach(), acc, sel_acc


def drafter_config_for(target_config, args) -> DFlash2Config:
    """A drafter shaped after the target: same hidden size, heads and vocab (it shares embedding and LM head)."""
    H = target_config.hidden_size
    head_dim = getattr(target_config, "head_dim", None) or H // target_config.num_attention_heads
    return DFlash2Config(
        hidden_size=H, intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
        num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
        head_dim=head_dim, vocab_size=target_config.vocab_size,
        num_target_layers=target_config.num_hidden_layers, target_layer_ids=args.taps,
        mask_token_id=args.mask_token_id, rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=target_config.rope_parameters["rope_theta"], max_position_embeddings=target_config.max_position_embeddings,
        layer_types=["sliding_attention"] * args.layers, sliding_window=2048, use_sliding_window=True,
        block_size=args.block_size, selector_rank=args.rank, selector_top_k=args.top_k, dtype="bfloat16",
        bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id)


def lr_at(step, total, warmup, peak):
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


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


class _Loss(torch.nn.Module):
    """drafter_loss as a module's forward: DistributedDataParallel averages the gradients of what runs through it."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, *args):
        return drafter_loss(self.drafter, *args)


def train(args, target=None):
    """Fit a drafter on `args.out`/data; checkpoints to `args.out`/drafter (published format).

    On args.device (default cpu); under torchrun, data parallel (each rank draws its own batches). With
    args.deadline (a time.monotonic() value, from `run`) steps stop there, the cosine schedule ends there at the
    pace so far, and the drafter is also written every args.save_minutes."""
    torch.set_num_threads(args.threads)
    rank, world, device = ddp_setup(torch.device(getattr(args, "device", "cpu")))
    if args.bf16 is None:  # autocast where bf16 is native; emulated bf16 is slower than float32
        args.bf16 = half_dtype(device) == torch.bfloat16
    deadline, save_s = getattr(args, "deadline", None), 60 * getattr(args, "save_minutes", 0)
    out = Path(args.out)
    meta = json.loads((out / "data" / "meta.json").read_text())
    args.taps = meta["taps"]
    if target is None:
        target, _ = load_target(meta["target"], device=device)
    for p in target.parameters():
        p.requires_grad_(False)  # frozen: the drafter shares its embedding and LM head
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings().weight
    seqs = load_shards(out / "data")
    extra = []
    for d in getattr(args, "extra_data", None) or []:
        other = json.loads((Path(d) / "meta.json").read_text())
        if other["taps"] != meta["taps"] or other["target"] != meta["target"]:
            raise SystemExit(f"error: --extra-data {d} was made from target {other['target']} taps {other['taps']}, "
                             f"but {out / 'data'} from {meta['target']} taps {meta['taps']}")
        extra += load_shards(Path(d))
    ckpt_path = out / "train_state.pt"
    torch.manual_seed(args.seed)
    if getattr(args, "init", None):  # fine-tune a published checkpoint: its config fixes the shape
        drafter = DFlash2Drafter.from_pretrained(args.init).float().train()
        c = drafter.config
        if c.target_layer_ids != list(args.taps):
            raise SystemExit(f"error: --init {args.init} taps target layers {c.target_layer_ids}, but the data in "
                             f"{out / 'data'} was tapped at {list(args.taps)}")
        if c.hidden_size != target.config.hidden_size or c.vocab_size != target.config.vocab_size:
            raise SystemExit(f"error: --init {args.init} has hidden {c.hidden_size} / vocab {c.vocab_size}; the "
                             f"target has {target.config.hidden_size} / {target.config.vocab_size}")
        args.block_size, args.top_k, args.mask_token_id = c.block_size, c.selector_top_k, c.mask_token_id
    else:
        drafter = DFlash2Drafter(drafter_config_for(target.config, args)).float().train()
        with torch.no_grad():  # start the final norm where the shared LM head expects its inputs
            drafter.norm.weight.copy_(target.get_decoder().norm.weight)
    drafter.to(device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.seed + rank)  # batches are drawn on the CPU, whatever the device
    step, history = 0, []
    if args.resume and ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        g.set_state(state["generator"])
        step, history = state["step"], state["history"]
    loss_of = _Loss(drafter)
    if world > 1:  # find_unused_parameters: a batch with no gold token among the selector's candidates skips it
        loss_of = torch.nn.parallel.DistributedDataParallel(loss_of, device_ids=[device.index] if device.index is not None
                                                            else None, find_unused_parameters=True)
    weights = position_weights(args.block_size, args.gamma or default_gamma(args.block_size)).to(device)
    n_tokens = sum(len(i) - p for i, _, p in seqs + extra)
    # Each step draws round(extra_share * batch_seqs) sequences from --extra-data, the rest from out/data;
    # by default the share is proportional to the sizes (uniform over all sequences).
    share = args.extra_share if getattr(args, "extra_share", None) is not None else len(extra) / (len(seqs) + len(extra))
    if not 0.0 <= share <= 1.0:
        raise SystemExit(f"error: --extra-share must be between 0 and 1, got {share}")
    n_extra = round(share * args.batch_seqs) if extra else 0
    stored = all(f is not None for _, f, _ in seqs + extra)
    if rank == 0:
        print(f"{len(seqs)} + {len(extra)} extra sequences ({n_extra} of {args.batch_seqs} per step"
              f"{f', on each of {world} processes' if world > 1 else ''}), {n_tokens} response tokens, features "
              f"{'from the shards' if stored else 'from the target at each step'}; drafter "
              f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params on {device}", flush=True)
    t0 = time.time() - (history[-1]["wall_s"] if history else 0.0)
    t_start = last_save = time.monotonic()
    took = 0.0  # the last step's seconds: under a deadline no step starts that would end past it
    steps = itertools.count(step) if deadline is not None else range(step, args.steps)
    bar = tqdm(steps, initial=step, total=None if deadline is not None else args.steps, desc="train", disable=rank > 0)
    for step in bar:
        total = args.steps
        if deadline is not None:  # the schedule ends at the deadline: the steps so far plus those that fit at this pace
            spent = time.monotonic() - t_start
            total = step + 1 + (int(max(0.0, deadline - time.monotonic()) * step / spent) if step else 0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.warmup, args.lr)
        began = time.monotonic()
        pick = [seqs[i] for i in torch.randint(len(seqs), (args.batch_seqs - n_extra,), generator=g).tolist()]
        if n_extra:
            pick += [extra[i] for i in torch.randint(len(extra), (n_extra,), generator=g).tolist()]
        feats = None if all(f is not None for _, f, _ in pick) else target_features(target, pick, args.taps, args.bf16)
        batch = [t.to(device) for t in make_batch(pick, args.block_size, args.anchors, args.mask_token_id, g, feats)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss, ce, sel_ce, acc, sel_acc = loss_of(embed, lm_head, batch, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.clip)
        opt.step()
        rec = {"step": step + 1, "loss": loss.item(), "ce": float(ce), "selector_ce": float(sel_ce),
               "acc": [round(float(a), 4) for a in acc], "selector_acc": float(sel_acc), "wall_s": time.time() - t0}
        history.append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{rec['acc'][0]:.2f}", acc7=f"{rec['acc'][-1]:.2f}",
                        sel=f"{rec['selector_acc']:.2f}")
        took = time.monotonic() - began
        last = step + 1 == args.steps or (deadline is not None and time.monotonic() + took > deadline)
        due = last or (step + 1) % args.save_every == 0 or (save_s and time.monotonic() - last_save > save_s)
        if due and rank == 0:
            torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "generator": g.get_state(),
                        "step": step + 1, "history": history}, ckpt_path.with_suffix(".tmp"))
            ckpt_path.with_suffix(".tmp").rename(ckpt_path)
            drafter.save_pretrained(out / "drafter", dtype=torch.bfloat16)
            (out / "history.json").write_text(json.dumps(history))
            last_save = time.monotonic()
        if getattr(args, "snapshot_every", 0) and (step + 1) % args.snapshot_every == 0 and rank == 0:
            drafter.save_pretrained(out / "snapshots" / f"step_{step + 1:05d}", dtype=torch.bfloat16)
        if last:
            break
    bar.close()
    return drafter, history


# --------------------------------------------------------------------------- the whole recipe on a budget

RUN_PHASES = {"prompts": 0.10, "responses": 0.50, "train": 0.85, "tau": 1.00}  # each ends at this share (RUN_RULE)
RUN_RULE = """The budget is split by a fixed rule: self-instruct prompts until 10% of it has passed (loading included),
responses until 50%, training until 85%, tau in the rest; a phase that ends early (every prompt answered, say)
leaves its time to the next. Responses: the prompts shuffled, in batches taking turns greedy and T = 1 (top-p 0.95);
once every prompt is answered, a second pass with the other setting. On CUDA the target's features are computed at each
training step (no feature shards); the drafter is written every --save-minutes, so a run cut short leaves one."""


def measure_tau(model, tok, drafter, data_dir, deadline, max_new_tokens=128):
    """τ as bench.py measures it (greedy, one prompt at a time, mean over prompts of tokens per verify step) on
    chat-heldout and GSM8K, the two tasks taking turns until the deadline; at least one prompt each."""
    tasks = load_tasks(("chat-heldout", "gsm8k"), data_dir, 100)
    target, stops = Target(model, drafter.config.target_layer_ids), stop_token_ids(model, tok)
    results, took = {task: [] for task in tasks}, 0.0
    for i, task in itertools.product(range(100), tasks):
        if i and time.monotonic() + took > deadline:  # the next prompt would end past the deadline
            break
        start = time.monotonic()
        ids = chat_ids(tok, format_prompt(task, tasks[task][i]))
        results[task] += generate(target, drafter, [ids], max_new_tokens=max_new_tokens, stop_ids=stops)
        took = time.monotonic() - start
    return {t: {"tau": mean_tau(r), "prompts": len(r)} for t, r in results.items()}


def run(args):
    """The whole recipe under a wall-clock budget: prompts, responses, training, tau (RUN_RULE)."""
    t0 = time.monotonic()
    end = {phase: t0 + share * args.minutes * 60 for phase, share in RUN_PHASES.items()}
    device = check_device(args.device)
    out = Path(args.out)
    if not args.minutes > 0:
        usage_error(f"--minutes must be > 0, got {args.minutes}")
    if any((out / "data").glob("shard_*")):
        usage_error(f"--out {out} already holds a run's data; name a new folder")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        usage_error("run is one process: under torchrun use `data` and `train`")
    (out / "data").mkdir(parents=True, exist_ok=True)
    report = {"minutes": args.minutes, "device": str(device), "target": args.target or DEFAULT_TARGET, "init": args.init}

    def say(phase, text):
        left = max(0.0, end["tau"] - time.monotonic())
        report[phase] = text
        print(f"[run] {phase}: {text}; {int(left // 60)}m{left % 60:04.1f}s left", flush=True)

    torch.set_num_threads(args.threads)
    batch_size = args.batch_size or (512 if device.type == "cuda" else 16)
    model, tok = load_target(args.target, device=device, dtype=generation_dtype(None, device))
    n_layers = model.config.num_hidden_layers
    taps = (DFlash2Drafter.from_pretrained(args.init).config.target_layer_ids if args.init
            else sorted(set(spread_target_layer_ids(n_layers, min(5, n_layers)))))
    say("load", f"target {report['target']} ({n_layers} layers) on {device}, taps {taps}")

    # 1. prompts: the sources, plus questions the target writes (evaluation text filtered out)
    prompts = training_prompts(args.data_dir, sources=[s for s in args.sources.split(",") if s], seed=args.seed)
    asked, usable, questions = self_instruct(model, tok, args.self_instruct, args.data_dir, batch_size, args.seed,
                                             deadline=end["prompts"])
    (out / "self_instruct.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    prompts += questions
    random.Random(args.seed).shuffle(prompts)
    say("prompts", f"{len(prompts) - len(questions)} from {args.sources} + {len(questions)} self-instruct "
                   f"({asked} asked, {usable} usable)")

    # 2. responses: greedy and T = 1 batches in turn (RUN_RULE); features stored on a CPU, else recomputed in training
    features = args.features if args.features is not None else device.type == "cpu"
    encoded = [chat_ids(tok, p) for p in prompts]
    stop, pad = set(stop_token_ids(model, tok)), tok.pad_token_id if tok.pad_token_id is not None else 0
    (out / "data" / "meta.json").write_text(json.dumps({"target": args.target, "taps": taps, "features": features,
                                                       "max_new_tokens": args.max_new_tokens, "top_p": 0.95}))
    batches = [range(i, min(i + batch_size, len(encoded))) for i in range(0, len(encoded), batch_size)]
    counts, tokens = {0.0: 0, 1.0: 0}, 0
    for k, (second, (j, idx)) in enumerate(itertools.product((0, 1), enumerate(batches))):
        if k and time.monotonic() > end["responses"]:
            break
        temperature = float((j + second) % 2)
        gen = torch.Generator(device).manual_seed(args.seed * 1_000_003 + k)
        rows = generate_with_features(model, [encoded[i] for i in idx], taps if features else [], args.max_new_tokens,
                                      stop, pad, temperature, 0.95 if temperature else 1.0, gen, end["responses"])
        save_shard(out / "data" / f"shard_{k:05d}.pt", rows, [len(encoded[i]) for i in idx])
        counts[temperature] += len(rows)
        tokens += sum(len(r[0]) - len(encoded[i]) for r, i in zip(rows, idx))
    say("responses", f"{sum(counts.values())} ({counts[0.0]} greedy, {counts[1.0]} at T = 1), {tokens} tokens")

    # 3. training; the drafter is written every --save-minutes and at the end
    targs = build_parser().parse_args(["train", "--out", str(out), "--seed", str(args.seed), "--threads",
                                       str(args.threads), "--warmup", "20", "--save-every", str(10**9), "--anchors", "16",
                                       "--batch-seqs", str(args.batch_seqs or (128 if device.type == "cuda" else 8))])
    targs.init, targs.device, targs.deadline, targs.save_minutes = args.init, str(device), end["train"], args.save_minutes
    _, history = train(targs, target=model)
    last = history[-50:]
    say("train", f"{len(history)} steps, last {len(last)}: draft CE {sum(h['ce'] for h in last) / len(last):.3f}, "
                 f"slot-1 accuracy {sum(h['acc'][0] for h in last) / len(last):.3f}; drafter in {out / 'drafter'}")

    # 4. tau of the written drafter, loaded back from its files
    drafter = DFlash2Drafter.from_pretrained(out / "drafter", device=device, attn_backend="sdpa")
    tau = measure_tau(model, tok, drafter, args.data_dir, end["tau"])
    report["tau_by_task"] = tau
    say("tau", ", ".join(f"{t} {r['tau']:.2f} ({r['prompts']} prompts)" for t, r in tau.items()))
    report["wall_s"] = round(time.monotonic() - t0, 1)
    (out / "run.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def plot_history(history, path, window=50, before=()):
    """Loss and per-slot top-1 accuracy over training (moving averages), saved as an image.

    before: the histories of the runs this one continues (`train --init`), oldest first, drawn first;
    a dotted line marks where each later run begins.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(xs):
        return [sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]

    joined, starts = [], []
    for run in list(before) + [history]:
        offset = joined[-1]["step"] if joined else 0
        if joined:
            starts.append(offset)
        joined += [dict(h, step=h["step"] + offset) for h in run]
    history = joined
    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(steps, smooth([h["ce"] for h in history]), label="draft CE (position-weighted)")
    ax1.plot(steps, smooth([h["selector_ce"] for h in history]), label="selector CE")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.set_yscale("log")
    ax1.legend()
    for k in range(len(history[0]["acc"])):
        ax2.plot(steps, smooth([h["acc"][k] for h in history]), label=f"slot {k + 1}")
    ax2.plot(steps, smooth([h["selector_acc"] for h in history]), "k--", label="selector (gold in C_t)")
    ax2.set_xlabel("step")
    ax2.set_ylabel("top-1 accuracy")
    for start in starts:
        for ax in (ax1, ax2):
            ax.axvline(start, color="gray", linestyle=":", label="_nolegend_")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def build_parser():
    ap = argparse.ArgumentParser(prog="dflash2-train", description=__doc__, formatter_class=HelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    target_help = "target model: directory or hub id (default: the embedded SmolLM2-135M-Instruct)"
    device_help = "torch device: cpu, or cuda (an error if this machine has none)"
    d = sub.add_parser("data", help="self-distil training data from the target", formatter_class=HelpFormatter)
    d.add_argument("--target", default=None, help=target_help)
    d.add_argument("--data-dir", default="../shared/data", help="local GSM8K/MBPP/... files the prompt sets read")
    d.add_argument("--out", default="runs/smollm2", help="run directory; shards go to OUT/data/")
    d.add_argument("--taps", default="1,8,14,21,27", help="target layers whose hidden states are stored")
    d.add_argument("--max-prompts", type=int, default=4000, help="answer at most this many prompts")
    d.add_argument("--sources", default="gsm8k,mbpp,chat",
                   help=f"prompt sets, comma separated, from {','.join(PROMPT_SOURCES)} (see dflash2/prompts.py)")
    d.add_argument("--prompts-file", action="append", default=[], metavar="JSONL",
                   help="also answer these prompts (from `dflash2.train prompts`); repeatable")
    d.add_argument("--exclude", action="append", default=[], metavar="DIR",
                   help="skip prompts already answered in this earlier data/ folder; repeatable")
    d.add_argument("--max-new-tokens", type=int, default=256, help="length cap of each response")
    d.add_argument("--batch-size", type=int, default=32, help="prompts generated together; one shard each (a GPU: 512)")
    d.add_argument("--device", default="cpu", help=device_help + "; under torchrun each rank writes every n-th shard")
    d.add_argument("--features", action=argparse.BooleanOptionalAction, default=True,
                   help="store the tapped hidden states (6 KB a token for SmolLM2); --no-features keeps token ids "
                        "only and `train` recomputes the features from the target at each step (the GPU way)")
    d.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    d.add_argument("--seed", type=int, default=0, help="prompt shuffle and sampling seed")
    d.add_argument("--dtype", default=None, choices=DTYPE_NAMES,
                   help="target dtype for generation (default: bfloat16 where native, ~2x faster there; else float32)")
    d.add_argument("--temperature", type=float, default=0.0,
                   help="0: the target's greedy responses; > 0: sampled ones (e.g. 0.7 or 1.0, as users sample)")
    d.add_argument("--top-p", type=float, default=1.0, help="nucleus for sampled responses (the card uses 0.95)")
    pr = sub.add_parser("prompts", help="have the target write prompts (self-instruct) or follow-ups (multi-turn)",
                        formatter_class=HelpFormatter)
    pr.add_argument("--kind", choices=("self-instruct", "multi-turn"), required=True,
                    help="self-instruct: new user questions; multi-turn: first turn, answer, follow-up")
    pr.add_argument("--out", required=True, metavar="JSONL", help="write the prompts here")
    pr.add_argument("--num", type=int, default=1000, help="questions to ask for / first turns to answer")
    pr.add_argument("--first-turns", default=None, metavar="JSONL", help="multi-turn: first turns from this file")
    pr.add_argument("--answer-tokens", type=int, default=128, help="multi-turn: length cap of the first answer")
    pr.add_argument("--target", default=None, help=target_help)
    pr.add_argument("--data-dir", default="../shared/data", help="evaluation sets to filter generated prompts against")
    pr.add_argument("--batch-size", type=int, default=48, help="requests generated together (a GPU: 512)")
    pr.add_argument("--device", default="cpu", help=device_help)
    pr.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    pr.add_argument("--seed", type=int, default=0, help="topic/kind draw and sampling seed")
    pr.add_argument("--dtype", default=None, choices=DTYPE_NAMES,
                    help="target dtype for generation (default: bfloat16 where native, else float32)")
    t = sub.add_parser("train", help="fit a drafter on the self-distilled data", formatter_class=HelpFormatter)
    t.add_argument("--out", default="runs/smollm2", help="directory holding data/ (from `dflash2.train data`)")
    t.add_argument("--steps", type=int, default=2000, help="optimizer steps (linear warmup, then cosine decay to lr/10)")
    t.add_argument("--batch-seqs", type=int, default=8, help="sequences per step")
    t.add_argument("--anchors", type=int, default=32, help="random anchors (blocks) per sequence")
    t.add_argument("--block-size", type=int, default=8, help="anchor + drafts per block (a new drafter only)")
    t.add_argument("--gamma", type=float, default=None, help="position decay (default 4 for block 8)")
    t.add_argument("--layers", type=int, default=2, help="drafter layers (a new drafter only)")
    t.add_argument("--intermediate-size", type=int, default=1536, help="drafter MLP width (a new drafter only)")
    t.add_argument("--rank", type=int, default=24, help="selector rank r")
    t.add_argument("--top-k", type=int, default=16, help="selector candidates K")
    t.add_argument("--mask-token-id", type=int, default=16, help="token id of the masked draft slots")
    t.add_argument("--lr", type=float, default=6e-4, help="AdamW peak learning rate")
    t.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    t.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast matmuls (default: on where bf16 is native: CUDA, CPUs with AVX512-BF16/AMX)")
    t.add_argument("--save-every", type=int, default=100, help="write OUT/drafter and the resume state every N steps")
    t.add_argument("--snapshot-every", type=int, default=0, metavar="N",
                   help="also keep the drafter every N steps in OUT/snapshots/step_N (for a tau-vs-steps curve; 0 = off)")
    t.add_argument("--resume", action="store_true", help="continue from OUT's last saved state")
    t.add_argument("--init", default=None, metavar="DIR",
                   help="start from this published drafter checkpoint (fine-tuning); its config sets the shape")
    t.add_argument("--extra-data", action="append", default=[], metavar="DIR",
                   help="another `dflash2.train data` output (its data/ folder) to mix in; repeatable")
    t.add_argument("--extra-share", type=float, default=None,
                   help="fraction of each step's sequences drawn from --extra-data (default: by size)")
    t.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    t.add_argument("--seed", type=int, default=0, help="batch sampling and initialization seed")
    t.add_argument("--device", default="cpu",
                   help=device_help + "; under torchrun, data parallel (cuda:LOCAL_RANK with nccl, cpu with gloo)")
    r = sub.add_parser("run", help="the whole recipe under a wall-clock budget: prompts, responses, training, tau",
                       formatter_class=HelpFormatter, description=RUN_RULE)
    r.add_argument("--minutes", type=float, required=True, help="wall-clock budget, loading included")
    r.add_argument("--out", required=True, help="run directory: data/, drafter/ (published format), run.json")
    r.add_argument("--device", default="cpu", help=device_help)
    r.add_argument("--target", default=None, help=target_help + ", in bf16 where native, else float32")
    r.add_argument("--data-dir", default="../shared/data", help="GSM8K/MBPP/... files: prompt sources, eval filter, tau")
    r.add_argument("--init", default=None, metavar="DIR", help="fine-tune this published drafter (default: a new "
                                                                "2-layer one, 5 taps spread over the target's layers)")
    r.add_argument("--sources", default=",".join(PROMPT_SOURCES), help="prompt sets, comma separated (see `data`)")
    r.add_argument("--self-instruct", type=int, default=3296, metavar="N",
                   help="questions to ask the target for (the topic x kind grid, cycled), within the prompts' time")
    r.add_argument("--max-new-tokens", type=int, default=256, help="length cap of each response")
    r.add_argument("--batch-size", type=int, default=None, help="prompts generated together (default: 512 on CUDA, 16 on CPU)")
    r.add_argument("--batch-seqs", type=int, default=None,
                   help="sequences per training step, 16 blocks each (default: 128 on CUDA, 8 on CPU)")
    r.add_argument("--features", action=argparse.BooleanOptionalAction, default=None,
                   help="store the target's features while generating (default: on a CPU, where a forward pass costs "
                        "more than reading them); --no-features recomputes them at each training step (default on CUDA)")
    r.add_argument("--save-minutes", type=float, default=2.0, help="write OUT/drafter this often while training")
    r.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    r.add_argument("--seed", type=int, default=0, help="prompt shuffle, sampling and training seed")
    pl = sub.add_parser("plot", help="draw the loss and per-slot accuracy curves (needs matplotlib)",
                        formatter_class=HelpFormatter)
    pl.add_argument("--out", default="runs/smollm2", help="run directory holding history.json")
    pl.add_argument("--png", default="docs/training.png", help="image to write")
    pl.add_argument("--before", action="append", default=[], metavar="JSON",
                    help="history.json of a run this one continues (--init), drawn first; repeat, oldest first")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.cmd == "data":
        make_data(args)
    elif args.cmd == "prompts":
        make_prompts(args)
    elif args.cmd == "train":
        check_device(args.device)
        train(args)
    elif args.cmd == "run":
        run(args)
    else:
        before = [json.loads(Path(b).read_text()) for b in args.before]
        plot_history(json.loads((Path(args.out) / "history.json").read_text()), args.png, before=before)
    ddp_teardown()


if __name__ == "__main__":
    main()
