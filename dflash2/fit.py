"""Fitting a DFlash 2 drafter on self-distilled data (SPEC §6): blocks at random anchors, position-decayed
cross-entropy over the draft slots plus the selector's cross-entropy over its K candidates, AdamW with warmup
and cosine decay, data parallel under torchrun. `python -m dflash2.train train` runs it.
"""
import itertools
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .checkpoint import DFlash2Config
from .distill import ddp_setup, load_shards, target_features
from .machine import half_dtype
from .model import DFlash2Drafter
from .pair import load_target


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

