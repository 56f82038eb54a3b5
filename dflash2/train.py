"""Train a DFlash 2 drafter for a target model by self-distillation.

    python -m dflash2.train data  --data-dir ../shared/data --out runs/smollm2      # target writes its own responses
    python -m dflash2.train train --out runs/smollm2 --steps 2000                   # fit the drafter on them

Data: the target answers training prompts, greedily or sampled (`data --temperature`); we keep the token ids and the
target's tapped hidden states (the drafter's context features), so training never
runs the target again. Loss (SPEC §6): position-decayed cross-entropy over the draft
slots plus the selector's cross-entropy over its K candidates. The prompts come from
prompts.py (`training_prompts`).
"""
import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .model import DFlash2Config, DFlash2Drafter, load_target, stop_token_ids
from .prompts import (FOLLOW_UPS, PROMPT_SOURCES, SELF_INSTRUCT_KINDS, SELF_INSTRUCT_TOPICS, chat_ids, filter_generated,
                      training_prompts)
from .settings import HelpFormatter, check_sampling_params
from .verify import process_logits

# --------------------------------------------------------------------------- data

@torch.no_grad()
def generate_with_features(model, prompts: list[list[int]], taps: list[int], max_new_tokens: int,
                           stop_ids: set[int], pad_id: int, temperature: float = 0.0, top_p: float = 1.0,
                           generator: torch.Generator | None = None):
    """Batched generation (left padded) that also returns the tapped hidden states of every token fed
    to the target: features[i] is [len_i - 1, n*H] for sequence i (the last token is never fed).

    Greedy at temperature 0; else each token is drawn from spec_decode.process_logits (temperature,
    top-p), the law users sample from, so the drafter also learns the target's sampled continuations."""
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
        out = model(input_ids=inp, attention_mask=mask, position_ids=pos, cache=cache,
                    use_cache=True, output_hidden_states=True)
        tapped = torch.cat([out.hidden_states[l + 1] for l in taps], dim=-1).to(torch.bfloat16)
        if temperature > 0:
            probs = process_logits(out.logits[:, -1].float(), temperature, top_p=top_p)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
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
    try:  # before the target loads
        check_sampling_params(args.temperature, args.top_p, 0)
    except ValueError as e:  # a usage error: exit 2, as argparse's
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    model, tok = load_target(args.target, dtype=getattr(torch, args.dtype))
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
            "temperature": args.temperature, "top_p": args.top_p}
    (out / "meta.json").write_text(json.dumps(meta))
    shards = [list(range(i, min(i + args.batch_size, len(encoded)))) for i in range(0, len(encoded), args.batch_size)]
    torch.set_num_threads(args.threads)
    for k, idx in enumerate(tqdm(shards, desc="self-distillation")):
        path = out / f"shard_{k:05d}.pt"
        if path.exists():
            continue  # resumable
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + k)  # per shard, so a resumed run draws alike
        rows = generate_with_features(model, [encoded[i] for i in idx], taps, args.max_new_tokens, stop, pad,
                                      temperature=args.temperature, top_p=args.top_p, generator=gen)
        torch.save({"ids": [r[0] for r in rows], "features": [r[1] for r in rows],
                    "prompt_lens": [len(encoded[i]) for i in idx]}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)


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
                 desc: str) -> list[str]:
    """The target's replies (text) to prompts, batched; greedy at temperature 0, else sampled (top-p 0.95)."""
    stop = set(stop_token_ids(model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out = []
    encoded = [chat_ids(tok, p) for p in prompts]
    for k in tqdm(range(0, len(encoded), batch_size), desc=desc):
        batch = encoded[k : k + batch_size]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + k)
        rows = generate_with_features(model, batch, [0], max_new_tokens, stop, pad, temperature=temperature,
                                      top_p=0.95 if temperature > 0 else 1.0, generator=gen)
        for (ids, _), p in zip(rows, batch):
            resp = [t for t in ids[len(p):].tolist() if t not in stop]
            out.append(tok.decode(resp, skip_special_tokens=True))
    return out


def make_prompts(args):
    """Prompts the target writes itself, filtered for duplicates and for evaluation text, as JSONL.

    self-instruct: for each (topic, kind) the target is asked for a question a user might type, sampled at T = 0.7.
    multi-turn: first turns from --first-turns (a prompts file) or the `talk2` and `docs` sources, the target's
    greedy answer, then a follow-up from FOLLOW_UPS: the response trained on is the answer to the follow-up."""
    model, tok = load_target(args.target, dtype=getattr(torch, args.dtype))
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    if args.kind == "self-instruct":
        grid = [(t, k) for t in SELF_INSTRUCT_TOPICS for k in SELF_INSTRUCT_KINDS]
        rng.shuffle(grid)
        asks = [f"Topic: {t}. Write a question a user could type to a chatbot about this topic, asking for {k}. "
                f"Write it in the user's own words, as one sentence ending with a question mark." for t, k in grid[: args.num]]
        texts = _reply_texts(model, tok, asks, 48, args.batch_size, 0.7, args.seed, "self-instruct")
        candidates = [q for q in map(_clean_question, texts) if q]
        kept = filter_generated(candidates, args.data_dir)
        rows = [{"prompt": q} for q in kept]
        print(f"self-instruct: {len(asks)} asked, {len(candidates)} usable, {len(kept)} kept after duplicate and "
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
    """All self-distilled sequences: (token ids [L], features [L-1, n*H] bf16, prompt length)."""
    seqs = []
    for path in sorted(Path(data_dir).glob("shard_*.pt")):
        shard = torch.load(path)
        seqs += [(i, f, p) for i, f, p in zip(shard["ids"], shard["features"], shard["prompt_lens"])
                 if len(i) >= p + 2]
    if not seqs:
        raise FileNotFoundError(f"no training shards in {data_dir}: run `python -m dflash2.train data` first")
    return seqs


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for draft slots k = 1..B-1 (SPEC §6): early slots matter most."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def default_gamma(block_size: int) -> float:
    """DFlash's decay: 4 for block 8, 5 for 10, 7 for 16 (linear in between)."""
    return {8: 4.0, 10: 5.0, 16: 7.0}.get(block_size, 4.0 + 3.0 * (block_size - 8) / 8)


def make_batch(seqs, block_size, anchors_per_seq, mask_token_id, generator):
    """Random anchors in each response; block = anchor + masks; context = everything before the anchor.

    Returns padded context features [S, L, n*H], per-block (sequence index, anchor position,
    block ids [nb, B], gold ids [nb, B-1] with -100 past the end of the sequence).
    """
    width = max(len(f) for _, f, _ in seqs)
    feats = torch.zeros(len(seqs), width, seqs[0][1].shape[-1])
    seq_idx, anchor_pos, blocks, gold = [], [], [], []
    for s, (ids, f, prompt_len) in enumerate(seqs):
        feats[s, : len(f)] = f.float()
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
    positions = torch.arange(L).expand(S, L)
    ctx_kv = [(k[seq_idx], v[seq_idx]) for k, v in drafter.context_kv(feats, positions)]
    ctx_valid = torch.arange(L)[None, :] < anchor_pos[:, None]
    block_pos = anchor_pos[:, None] + torch.arange(B)
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


def train(args, target=None):
    """Fit a drafter on `args.out`/data; checkpoints to `args.out`/drafter (published format)."""
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    meta = json.loads((out / "data" / "meta.json").read_text())
    args.taps = meta["taps"]
    if target is None:
        target, _ = load_target(meta["target"])
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
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.seed)
    step, history = 0, []
    if args.resume and ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        g.set_state(state["generator"])
        step, history = state["step"], state["history"]
    weights = position_weights(args.block_size, args.gamma or default_gamma(args.block_size))
    n_tokens = sum(len(i) - p for i, _, p in seqs + extra)
    # Each step draws round(extra_share * batch_seqs) sequences from --extra-data, the rest from out/data;
    # by default the share is proportional to the sizes (uniform over all sequences).
    share = args.extra_share if getattr(args, "extra_share", None) is not None else len(extra) / (len(seqs) + len(extra))
    if not 0.0 <= share <= 1.0:
        raise SystemExit(f"error: --extra-share must be between 0 and 1, got {share}")
    n_extra = round(share * args.batch_seqs) if extra else 0
    print(f"{len(seqs)} + {len(extra)} extra sequences ({n_extra} of {args.batch_seqs} per step), "
          f"{n_tokens} response tokens; drafter "
          f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params", flush=True)
    t0 = time.time() - (history[-1]["wall_s"] if history else 0.0)
    bar = tqdm(range(step, args.steps), initial=step, total=args.steps, desc="train")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.warmup, args.lr)
        pick = [seqs[i] for i in torch.randint(len(seqs), (args.batch_seqs - n_extra,), generator=g).tolist()]
        if n_extra:
            pick += [extra[i] for i in torch.randint(len(extra), (n_extra,), generator=g).tolist()]
        batch = make_batch(pick, args.block_size, args.anchors, args.mask_token_id, g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss, ce, sel_ce, acc, sel_acc = drafter_loss(drafter, embed, lm_head, batch, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.clip)
        opt.step()
        rec = {"step": step + 1, "loss": loss.item(), "ce": float(ce), "selector_ce": float(sel_ce),
               "acc": [round(float(a), 4) for a in acc], "selector_acc": float(sel_acc), "wall_s": time.time() - t0}
        history.append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{rec['acc'][0]:.2f}", acc7=f"{rec['acc'][-1]:.2f}",
                        sel=f"{rec['selector_acc']:.2f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "generator": g.get_state(),
                        "step": step + 1, "history": history}, ckpt_path.with_suffix(".tmp"))
            ckpt_path.with_suffix(".tmp").rename(ckpt_path)
            drafter.save_pretrained(out / "drafter", dtype=torch.bfloat16)
            (out / "history.json").write_text(json.dumps(history))
        if getattr(args, "snapshot_every", 0) and (step + 1) % args.snapshot_every == 0:
            drafter.save_pretrained(out / "snapshots" / f"step_{step + 1:05d}", dtype=torch.bfloat16)
    return drafter, history


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
    d.add_argument("--batch-size", type=int, default=32, help="prompts generated together; one shard each")
    d.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    d.add_argument("--seed", type=int, default=0, help="prompt shuffle and sampling seed")
    d.add_argument("--dtype", default="bfloat16", help="target dtype for generation (bf16 is ~2x faster on CPU)")
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
    pr.add_argument("--batch-size", type=int, default=48, help="requests generated together")
    pr.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    pr.add_argument("--seed", type=int, default=0, help="topic/kind draw and sampling seed")
    pr.add_argument("--dtype", default="bfloat16", help="target dtype for generation")
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
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast matmuls")
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
    pl = sub.add_parser("plot", help="draw the loss and per-slot accuracy curves (needs matplotlib)",
                        formatter_class=HelpFormatter)
    pl.add_argument("--out", default="runs/smollm2", help="run directory holding history.json")
    pl.add_argument("--png", default="docs/training.png", help="image to write")
    pl.add_argument("--before", action="append", default=[], metavar="JSON",
                    help="history.json of a run this one continues (--init), drawn first; repeat, oldest first")
    return ap


def main():
    args = build_parser().parse_args()
    if args.cmd == "data":
        make_data(args)
    elif args.cmd == "prompts":
        make_prompts(args)
    elif args.cmd == "train":
        train(args)
    else:
        before = [json.loads(Path(b).read_text()) for b in args.before]
        plot_history(json.loads((Path(args.out) / "history.json").read_text()), args.png, before=before)


if __name__ == "__main__":
    main()
