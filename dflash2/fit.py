"""Fitting a drafter on self-distilled data: blocks at random anchors; for DFlash 2 (SPEC §6) position-decayed
cross-entropy over the draft slots plus the selector's cross-entropy over its K candidates, for DSpark
(docs/DSPARK.md) DeepSpec's 0.1 CE + 0.9 L1(q, p) + 1.0 BCE(confidence, 1 - TV); AdamW with warmup and cosine
decay (to a step count or a deadline), data parallel under torchrun. `python -m dflash2.train train` runs it.
"""
import itertools
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .checkpoint import DFlash2Config, resolve_checkpoint
from .distill import ddp_setup, load_shards, target_features
from .dspark import DSparkConfig, DSparkDrafter, dspark_logits
from .machine import half_dtype
from .model import DFlash2Drafter
from .pair import is_dspark, load_target


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


DSPARK_ALPHAS = (0.1, 0.9, 1.0)  # CE, L1, confidence BCE: DeepSpec's config/dspark/dspark_qwen3_8b.py:22-28


def dspark_loss_terms(z, target_logits, conf, gold, weights):
    """DeepSpec's DSpark loss terms (modeling/dspark/loss.py:25-162, 227-252) on given logits. With q = softmax(z),
    p = softmax(target_logits) (both at T = 1) and per-slot weights w_k (zero where gold is -100):

        CE  = sum w CE(z, gold) / sum w
        L1  = sum w sum_v |q_v - p_v| / sum w                    (= 2 TV(q, p))
        BCE = sum w BCE(sigmoid(c), a) / sum w,   a = clamp(1 - TV(q, p), 0, 1), detached

    a is the chance that verification accepts a draft from q against p, what the confidence head learns.
    z, target_logits [nb, B, V]; conf [nb, B] logits (None: no head, BCE = 0); gold [nb, B]; weights [B].
    """
    valid = gold >= 0
    w = weights[None, :] * valid
    den = w.sum() + 1e-6
    ce = F.cross_entropy(z.flatten(0, 1).float(), gold.flatten().clamp(min=0), reduction="none").view(w.shape)
    l1 = (z.float().softmax(-1) - target_logits.float().softmax(-1)).abs().sum(-1)
    bce = torch.zeros_like(l1)
    if conf is not None:
        accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
        bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
    return (ce * w).sum() / den, (l1 * w).sum() / den, (bce * w).sum() / den


def dspark_loss(drafter, embed_tokens, lm_head_weight, batch, weights, alphas=DSPARK_ALPHAS):
    """DeepSpec's DSpark training step (modeling/dspark/qwen3/modeling.py:388-520): the block [anchor, MASK x (B-1)]
    at positions a..a+B-1, slot k labelled with the token at a+k+1 (every slot proposes), the Markov head
    teacher-forced on the previous true token (the anchor for slot 0), p the target's next-token law at a+k.

    batch: make_batch(..., block_size + 1, ...) (B + 1 ids a block, B labels) over features [S, L, n*H + H] whose
    last H columns are the target's final hidden state (load_shards / target_features with last_hidden).
    Returns (alpha . (CE, L1, BCE), CE, L1, BCE, per-slot top-1 accuracy of z [B]).
    """
    feats, seq_idx, anchor_pos, blocks, gold = batch
    S, L, width = feats.shape
    nb, B = gold.shape
    H = drafter.config.hidden_size
    ctx, last = feats[..., : width - H], feats[..., width - H :]
    positions = torch.arange(L, device=feats.device).expand(S, L)
    ctx_kv = [(k[seq_idx], v[seq_idx]) for k, v in drafter.context_kv(ctx, positions)]
    ctx_valid = positions[:1] < anchor_pos[:, None]
    block_pos = anchor_pos[:, None] + torch.arange(B, device=feats.device)
    h = drafter(embed_tokens(blocks[:, :B]) * drafter.config.input_embedding_scale, block_pos, ctx_kv, ctx_valid)
    prev = torch.cat([blocks[:, :1], gold[:, :-1].clamp(min=0)], dim=1)  # [anchor, gold_1 .. gold_{B-1}]
    z = dspark_logits(drafter, h, prev, lm_head_weight)
    with torch.no_grad():  # the target's logits at a+k, from its stored final hidden state and its LM head
        x = last[seq_idx[:, None], block_pos.clamp(max=L - 1)]
        target_logits = F.linear(x.to(lm_head_weight.dtype), lm_head_weight).float()
    ce, l1, bce = dspark_loss_terms(z, target_logits, drafter.confidence_logits(h, prev), gold, weights)
    valid = gold >= 0
    acc = ((z.argmax(-1) == gold) & valid).sum(0).float() / valid.sum(0).clamp(min=1)
    a_ce, a_l1, a_conf = alphas
    return a_ce * ce + a_l1 * l1 + a_conf * bce, ce.detach(), l1.detach(), bce.detach(), acc


def target_shape(target_config) -> dict:
    """The config fields a drafter takes from its target: same hidden size, heads and vocab (it shares the target's
    embedding and LM head), and the target's depth, norm epsilon, RoPE base, context and special tokens."""
    H = target_config.hidden_size
    return dict(
        hidden_size=H, num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=getattr(target_config, "head_dim", None) or H // target_config.num_attention_heads,
        vocab_size=target_config.vocab_size, num_target_layers=target_config.num_hidden_layers,
        rms_norm_eps=target_config.rms_norm_eps, rope_theta=target_config.rope_parameters["rope_theta"],
        max_position_embeddings=target_config.max_position_embeddings, bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id)


def drafter_config_for(target_config, args) -> DFlash2Config:
    """A DFlash 2 drafter shaped after the target (target_shape)."""
    return DFlash2Config(
        **target_shape(target_config), intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
        target_layer_ids=args.taps, mask_token_id=args.mask_token_id,
        layer_types=["sliding_attention"] * args.layers, sliding_window=2048, use_sliding_window=True,
        block_size=args.block_size, selector_rank=args.rank, selector_top_k=args.top_k, dtype="bfloat16")


def dspark_config_for(target_config, args) -> DSparkConfig:
    """A DSpark drafter with DFlash 2's backbone knobs (layers, MLP width, taps, mask token), full attention as
    DeepSpec's configs, a vanilla Markov head of rank args.rank and a confidence head on [h_k, W1[prev_k]]."""
    markov = args.rank > 0
    return DSparkConfig(
        **target_shape(target_config), intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
        target_layer_ids=args.taps, mask_token_id=args.mask_token_id, block_size=args.block_size,
        markov_rank=args.rank, markov_head_type="vanilla" if markov else None, enable_confidence_head=True,
        confidence_head_with_markov=markov, num_anchors=args.anchors, dtype="bfloat16")


def lr_at(step, total, warmup, peak):
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


class _Loss(torch.nn.Module):
    """A loss as a module's forward: DistributedDataParallel averages the gradients of what runs through it."""

    def __init__(self, drafter, loss):
        super().__init__()
        self.drafter, self.loss = drafter, loss

    def forward(self, *args):
        return self.loss(self.drafter, *args)


def _agree(values, device, world):
    """Rank 0's numbers on every rank: under a deadline each rank's clock would pick its own schedule and last step."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.broadcast(t, 0)
    return [int(v) for v in t.tolist()]


def train(args, target=None):
    """Fit a drafter (args.arch: dflash2, the default, or dspark) on `args.out`/data; checkpoints to `args.out`/drafter
    (published format; a DSpark drafter without copies of the target's embedding and LM head).

    On args.device (default cpu); under torchrun, data parallel (each rank draws its own batches). With
    args.deadline (a time.monotonic() value, from `run`) or args.minutes (counted from the first step) steps stop
    there, the cosine schedule ends there at the pace so far, and the drafter is also written every
    args.save_minutes. The block draws the same anchors for both architectures: DSpark's B slots are DFlash 2's
    B + 1 (anchor + B drafts) without the last, and slot k is labelled with DFlash 2's draft k + 1."""
    torch.set_num_threads(args.threads)
    rank, world, device = ddp_setup(torch.device(getattr(args, "device", "cpu")))
    if args.bf16 is None:  # autocast where bf16 is native; emulated bf16 is slower than float32
        args.bf16 = half_dtype(device) == torch.bfloat16
    dspark = getattr(args, "arch", "dflash2") == "dspark"
    if getattr(args, "block_size", None) is None:  # both verify 7 drafts and the target's token a step
        args.block_size = 7 if dspark else 8
    deadline, save_s = getattr(args, "deadline", None), 60 * getattr(args, "save_minutes", 0)
    out = Path(args.out)
    meta = json.loads((out / "data" / "meta.json").read_text())
    args.taps = meta["taps"]
    if target is None:
        target, _ = load_target(meta["target"], device=device)
    for p in target.parameters():
        p.requires_grad_(False)  # frozen: the drafter shares its embedding and LM head
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings().weight
    seqs = load_shards(out / "data", last_hidden=dspark)
    extra = []
    for d in getattr(args, "extra_data", None) or []:
        other = json.loads((Path(d) / "meta.json").read_text())
        if other["taps"] != meta["taps"] or other["target"] != meta["target"]:
            raise SystemExit(f"error: --extra-data {d} was made from target {other['target']} taps {other['taps']}, "
                             f"but {out / 'data'} from {meta['target']} taps {meta['taps']}")
        extra += load_shards(Path(d), last_hidden=dspark)
    ckpt_path = out / "train_state.pt"
    torch.manual_seed(args.seed)
    if getattr(args, "init", None):  # fine-tune a published checkpoint: its config fixes the shape
        if is_dspark(resolve_checkpoint(args.init)) != dspark:
            raise SystemExit(f"error: --init {args.init} is a {'DFlash 2' if dspark else 'DSpark'} checkpoint: pass "
                             f"--arch {'dflash2' if dspark else 'dspark'}")
        drafter = (DSparkDrafter if dspark else DFlash2Drafter).from_pretrained(args.init).float().train()
        c = drafter.config
        if dspark and drafter.own_embeddings:  # DeepSpec's frozen copies of the target's tables: use the target's
            del drafter.embed_tokens, drafter.lm_head
        if c.target_layer_ids != list(args.taps):
            raise SystemExit(f"error: --init {args.init} taps target layers {c.target_layer_ids}, but the data in "
                             f"{out / 'data'} was tapped at {list(args.taps)}")
        if c.hidden_size != target.config.hidden_size or c.vocab_size != target.config.vocab_size:
            raise SystemExit(f"error: --init {args.init} has hidden {c.hidden_size} / vocab {c.vocab_size}; the "
                             f"target has {target.config.hidden_size} / {target.config.vocab_size}")
        args.block_size, args.mask_token_id = c.block_size, c.mask_token_id
        args.top_k = getattr(c, "selector_top_k", None)
    elif dspark:
        drafter = DSparkDrafter(dspark_config_for(target.config, args)).float().train()
        with torch.no_grad():  # the heads as DeepSpec's post_init leaves them: N(0, 0.02), zero bias
            for name, w in drafter.named_parameters():
                if name.startswith(("markov_head.", "confidence_head.")):
                    if name.endswith(".bias"):
                        w.zero_()
                    else:
                        w.normal_(0.0, 0.02)
    else:
        drafter = DFlash2Drafter(drafter_config_for(target.config, args)).float().train()
    if not getattr(args, "init", None):
        with torch.no_grad():  # start the final norm where the shared LM head expects its inputs
            drafter.norm.weight.copy_(target.get_decoder().norm.weight)
    try:  # what vLLM and SGLang would misread is refused now, not at the first save
        drafter.config.for_engines(target.config.num_hidden_layers, lm_head.shape[0])
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
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
    loss_of = _Loss(drafter, dspark_loss if dspark else drafter_loss)
    if world > 1:  # find_unused_parameters: a batch with no gold token among the selector's candidates skips it
        loss_of = torch.nn.parallel.DistributedDataParallel(loss_of, device_ids=[device.index] if device.index is not None
                                                            else None, find_unused_parameters=not dspark)
    # DSpark weighs its slots k = 0..B-1 by exp(-k/gamma), DFlash 2 its drafts k = 1..B-1 by exp(-(k-1)/gamma)
    slots = args.block_size + dspark
    weights = position_weights(slots, args.gamma or default_gamma(slots)).to(device)
    names = ("ce", "l1", "confidence_bce", "acc") if dspark else ("ce", "selector_ce", "acc", "selector_acc")
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
              f"{'from the shards' if stored else 'from the target at each step'}; {'DSpark' if dspark else 'DFlash 2'} "
              f"drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params on {device}", flush=True)
    t0 = time.time() - (history[-1]["wall_s"] if history else 0.0)
    t_start = last_save = time.monotonic()
    if deadline is None and getattr(args, "minutes", None):
        deadline = t_start + 60 * args.minutes
    first, took = step, 0.0  # took: the last step's seconds; under a deadline no step starts that would end past it
    steps = itertools.count(step) if deadline is not None else range(step, args.steps)
    bar = tqdm(steps, initial=step, total=None if deadline is not None else args.steps, desc="train", disable=rank > 0)
    for step in bar:
        total = args.steps
        if deadline is not None:  # the schedule ends at the deadline: the steps so far plus those that fit at this pace
            spent, done = time.monotonic() - t_start, step - first
            total, = _agree([step + 1 + (int(max(0.0, deadline - time.monotonic()) * done / spent) if done else 0)],
                            device, world)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.warmup, args.lr)
        began = time.monotonic()
        pick = [seqs[i] for i in torch.randint(len(seqs), (args.batch_seqs - n_extra,), generator=g).tolist()]
        if n_extra:
            pick += [extra[i] for i in torch.randint(len(extra), (n_extra,), generator=g).tolist()]
        feats = None if all(f is not None for _, f, _ in pick) else target_features(target, pick, args.taps, args.bf16,
                                                                                      last_hidden=dspark)
        batch = [t.to(device) for t in make_batch(pick, slots, args.anchors, args.mask_token_id, g, feats)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss, *parts = loss_of(embed, lm_head, batch, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.clip)
        opt.step()
        rec = {"step": step + 1, "loss": loss.item(), "lr": opt.param_groups[0]["lr"],
               **{n: [round(float(a), 4) for a in v] if v.dim() else float(v) for n, v in zip(names, parts)},
               "wall_s": time.time() - t0}
        history.append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{rec['acc'][0]:.2f}", accB=f"{rec['acc'][-1]:.2f}",
                        **({"l1": f"{rec['l1']:.2f}"} if dspark else {"sel": f"{rec['selector_acc']:.2f}"}))
        took = time.monotonic() - began
        if deadline is None:
            last = step + 1 == args.steps
        else:
            last, = _agree([time.monotonic() + took > deadline], device, world)
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

