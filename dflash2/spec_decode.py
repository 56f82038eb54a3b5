"""DFlash 2 speculative decoding: the target behind a slot cache and the draft -> select -> verify loop.

Everything here stays on the device: randomness is drawn as uniform tensors (`torch.rand(...,
generator=g)`) and handed to verify.py's math, so no step needs a host sync and a run can be replayed.
"""

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import kernels
from .kernels import check_attn_backend
from .model import DraftContext, dflash1_walk
from .pair import cache_kwarg, fix_partial_rotary
from .settings import (DEFAULT_TREE_BUDGET, METHODS, InputError, check_block_size, check_sampling_params,
                       check_tree_settings)
from .verify import (build_tree, marginal_log_weights, process_logits, sample_from, selector_log_weights,
                     tree_ancestors, verify_greedy, verify_sampled, verify_tree_greedy, verify_tree_sampled)

# --- target adapter: any transformers causal LM behind a per-row slot cache ---


class SlotCacheLayer(CacheLayerMixin):
    """Static K/V buffer where slot j always holds absolute position j of that row.

    Rows advance by different amounts each step, so writes go to each row's own positions;
    slots past a row's committed length hold stale drafts, but they always lie in the future
    of every query (causal mask by position), and the next write overwrites them.
    """

    is_compileable = True

    def __init__(self, cache):
        super().__init__()
        self.cache = cache
        self.idx_keys = None

    def lazy_initialization(self, key_states, value_states):
        b, h, _, d = key_states.shape
        shape = (b, h, self.cache.max_len, d)
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros(shape[:3] + (value_states.shape[-1],))
        self.is_initialized = True

    def _write(self, buf, new):
        # buf[r, :, pos[r, t]] = new[r, :, t]: an index_put_, which inductor updates in place (a scatter_
        # into a cache buffer compiles to a copy of the whole buffer, twice, on every forward)
        buf[self.cache.write_rows, :, self.cache.write_positions] = new.transpose(1, 2).to(buf.dtype)
        return buf[:, :, : self.cache.view_len]

    def move(self, src, dst):
        """Slots dst [b, n] take what slots src hold, per row (a tree's accepted path into place)."""
        rows = torch.arange(src.shape[0], device=src.device)[:, None]
        for name in ("keys", "values", "idx_keys"):
            buf = getattr(self, name)
            if buf is not None:
                buf[rows, :, dst] = buf[rows, :, src]  # the right side is gathered first: overlaps are safe

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._write(self.keys, key_states), self._write(self.values, value_states)

    def update_index(self, idx_k):
        """MiniMax-M3 sparse layers also cache their indexer keys."""
        if self.idx_keys is None:
            self.idx_keys = idx_k.new_zeros(idx_k.shape[:2] + (self.cache.max_len, idx_k.shape[-1]))
        return self._write(self.idx_keys, idx_k)

    update_indexer = update_index

    def get_mask_sizes(self, query_length, *args):
        return self.cache.view_len, 0

    def get_seq_length(self):
        return self.cache.view_len

    def get_max_length(self):
        return self.cache.max_len

    def select_rows(self, rows):
        for name in ("keys", "values", "idx_keys"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, rows))

    def copy_rows(self, rows, other):
        """Rows `rows` take over every slot of `other`'s rows (a request admitted into finished rows)."""
        for name in ("keys", "values", "idx_keys"):
            if getattr(self, name) is not None:
                getattr(self, name)[rows] = getattr(other, name)


class SlotCache(Cache):
    """The target's KV cache for ragged batches: one SlotCacheLayer per decoder layer."""

    def __init__(self, num_layers, max_len):
        self.max_len = max_len
        self.write_positions = None
        self.write_rows = None  # [b, 1] row index for the writes, made once per forward, not per layer
        self.view_len = 0
        super().__init__(layers=[SlotCacheLayer(self) for _ in range(num_layers)])

    def select_rows(self, rows):
        for layer in self.layers:
            layer.select_rows(rows)

    def copy_rows(self, rows, other):
        for layer, src in zip(self.layers, other.layers):
            layer.copy_rows(rows, src)

    def move(self, src, dst):
        for layer in self.layers:
            layer.move(src, dst)


class Target:
    """A causal LM seen as: forward(ids, positions, cache) -> logits and tapped hidden states.

    Tapped features are hidden_states[l + 1] (the output of decoder layer l) for l in layer_ids,
    concatenated on the feature axis: exactly the drafter's context input (SPEC §3).
    """

    def __init__(self, model, layer_ids=()):
        self.model = model.eval()
        fix_partial_rotary(model)
        self.layer_ids = list(layer_ids)
        cfg = getattr(model.config, "text_config", model.config)
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.cache_arg = cache_kwarg(model)
        # load_target(prepack=True) swapped the linears for oneDNN ones; the draft head follows suit
        self.prepacked = any(isinstance(m, kernels.PackedLinear) for m in model.modules())
        bad = [l for l in self.layer_ids if not 0 <= l < self.num_layers]
        if bad:
            raise InputError(f"drafter target_layer_ids {bad} do not exist in a target with {self.num_layers} layers")

    @property
    def embed_tokens(self):
        return self.model.get_input_embeddings()

    @property
    def lm_head_weight(self):
        return self.model.get_output_embeddings().weight

    def lm_head_as(self, dtype):
        """The LM head for draft logits in the drafter's dtype, built once: a bf16 drafter reads half the
        bytes per draft; on CPU it is a oneDNN-packed linear (a 3x faster read than aten's bf16 matmul)."""
        head = getattr(self, "_draft_head", None)
        if head is None or getattr(head, "weight", head).dtype != dtype:
            weight = self.lm_head_weight if dtype == self.lm_head_weight.dtype else self.lm_head_weight.detach().to(dtype)
            packed = self.prepacked and kernels.can_prepack(weight)
            head = self._draft_head = kernels.PackedLinear(weight.detach()) if packed else weight
        return head

    @property
    def device(self):
        return self.lm_head_weight.device

    def new_cache(self, max_len):
        return SlotCache(self.num_layers, max_len)

    @torch.no_grad()
    def forward(self, ids, positions, cache, view_len, slots=None, visible=None):
        """ids, positions [b, T]; writes K/V at those positions; keys visible iff slot <= query position.

        A tree passes slots [b, T] (where its K/V go, default positions) and visible [b, T, view_len]
        (default slot <= position). view_len bounds the slots attended (>= max slot + 1). Returns
        logits [b, T, V] (float32) and features [b, T, n*H] (empty when no layers are tapped).
        """
        cache.write_positions = positions if slots is None else slots
        cache.write_rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        cache.view_len = view_len
        if visible is None:
            visible = torch.arange(view_len, device=ids.device)[None, None, :] <= positions[:, :, None]
        visible = visible[:, None]
        dtype = self.lm_head_weight.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=ids.device).masked_fill(~visible, torch.finfo(dtype).min)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, **{self.cache_arg: cache},
                         use_cache=True, output_hidden_states=bool(self.layer_ids))
        if self.layer_ids:
            feats = torch.cat([out.hidden_states[l + 1] for l in self.layer_ids], dim=-1)
        else:
            feats = ids.new_zeros(ids.shape + (0,), dtype=dtype)
        return out.logits.float(), feats


# --- the draft -> select -> verify loop ---


def draft(drafter, target, ctx, anchor, pos, ctx_len, block_size, sizes=None):
    """One drafter pass over [anchor, MASK x (B-1)] at positions pos..pos+B-1 (SPEC §3).

    The context is every slot before the anchor. sizes [b] (default B): a row drafts a block of
    only that many slots (the rest of its B are ignored). Returns the hidden states h [b, B-1, H]
    and the draft logits U [b, B-1, V] of slots 1..B-1.
    """
    block_pos = pos[:, None] + torch.arange(block_size, device=pos.device)
    dtype = next(drafter.parameters()).dtype
    embeds = drafter.embed_block(anchor, target.embed_tokens, block_size).to(dtype)
    slots = torch.arange(ctx_len, device=pos.device)
    block_valid = None if sizes is None else torch.arange(block_size, device=pos.device) < sizes[:, None]
    h = drafter(embeds, block_pos, ctx.view(ctx_len), slots[None, :] < pos[:, None], block_valid=block_valid)[:, 1:]
    return h, drafter.draft_logits(h, target.lm_head_as(dtype))


def block_sizes(end, pos, block_size):
    """Each row's block this step, min(B, end - pos): its anchor plus at most the tokens it may still
    make (the authors' verify_size); end [b] is the position after a row's last allowed token."""
    return (end - pos).clamp(1, block_size)


def select_path(selector, h, U, anchor, method, temperature, generator, with_candidates=True):
    """dflash2: top-K candidates C_t, edge scores S_t(a, b), left-to-right walk (SPEC §4).
    dflash: d_t = argmax U_t (or an independent sample per slot).

    Returns drafts [b, B-1], proposals q [b, B-1, V] (one-hot for greedy walks), and the candidates
    with their draft logits (what a trace records; dflash computes them only when asked).
    """
    if method == "dflash":
        drafts, q = dflash1_walk(U, temperature, generator)
        if not with_candidates:  # v1 needs no top-K; only a trace records it
            return drafts, q, None, None
        return (drafts, q) + selector.candidates(U, selector.top_k)
    cand_ids, cand_logits = selector.candidates(U, selector.top_k)
    drafts, q = selector.walk(selector.edge_scores(h, U, cand_ids, anchor), cand_ids, temperature, generator)
    return drafts, q, cand_ids, cand_logits


def select_tree(selector, h, U, anchor, budget, scores, max_depth):
    """dflash2-tree: the `budget` best nodes of the block's candidate tree (docs/SPEC.md §9), by path
    scores from the selector's conditional law (S_t(a, .) over C_t, normalised over the whole vocabulary with
    U_t outside C_t: verify.selector_log_weights) or, as DDTree, from each
    slot's marginal log softmax(U_t) over its top-`budget` tokens. max_depth [b]: each row's drafts."""
    if scores == "selector":
        cand_ids, _ = selector.candidates(U, selector.top_k)
        logw = selector_log_weights(selector.edge_scores(h, U, cand_ids, anchor), U, cand_ids)
    else:
        cand_ids, logw = marginal_log_weights(U, budget)
    return build_tree(logw, cand_ids, budget, max_depth)


def _install_output_hooks(model):
    """transformers installs its hidden-state hooks on the first forward that asks for them, under a
    threading lock that dynamo cannot trace: a compiled target met first would break its graph there.
    Install them now, eagerly (top-down, so a submodel is never hooked twice)."""
    try:
        from transformers.modeling_utils import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, maybe_install_capturing_hooks
    except ImportError:  # a transformers without output capturing: nothing to install
        return
    for m in model.modules():
        if isinstance(m, PreTrainedModel) and _CAN_RECORD_REGISTRY.get(m):
            maybe_install_capturing_hooks(m)


def compile_core(target, drafter=None, compile_target=True):
    """torch.compile the hot functions: the target forward, the drafter forward and the walk.

    Use with generate(..., static=True): cache views come in a few bucketed lengths, so a
    warm-up at the real length compiles every shape and the steady state never recompiles.
    compile_target=False leaves the target eager (to time the drafter's share alone).
    """
    # One graph per view bucket and prompt-width bucket; dynamo's default limit of 8 is too few.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if compile_target:
        _install_output_hooks(target.model)
    if drafter is not None:
        check_attn_backend(drafter.attn_backend, target.device, compiled=True)
    for obj, name in core_functions(target, drafter, compile_target):
        setattr(obj, name, torch.compile(getattr(obj, name), dynamic=False))


def core_functions(target, drafter=None, with_target=True):
    """The (object, method name) pairs compile_core compiles in place."""
    pairs = [(target.model, "forward")] if with_target else []
    if drafter is not None:
        sel = drafter.candidate_selector
        pairs += [(drafter, "forward"), (drafter, "context_kv"), (sel, "edge_scores"), (sel, "walk")]
    return pairs


@dataclass
class Result:
    """One request's output and its statistics."""

    tokens: list = field(default_factory=list)
    verify_steps: int = 0  # target forwards: the prefill, then one per decode step
    accepted: list = field(default_factory=list)  # drafts accepted at each decode step
    finished_by_stop: bool = False

    @property
    def acceptance_length(self):
        """tau = mean over decode steps of the tokens each commits, the prefill's token excluded (the
        authors' benchmark definition, which the model card reports); 1 <= tau <= block size.
        None when the request ended at its prefill token."""
        steps = self.verify_steps - 1
        return (len(self.tokens) - 1) / steps if steps > 0 else None


@dataclass
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else drawn from P (verify.process_logits)."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator

    def first_tokens(self, last):
        """The token after each prompt, from the prefill's last logits [b, V]."""
        if self.temperature == 0:
            return last.argmax(-1)
        u = torch.rand(last.shape[0], generator=self.generator, device=last.device)
        return sample_from(process_logits(last, self.temperature, self.top_k, self.top_p), u)


@dataclass
class Rows:
    """The device state of the rows in flight: the target's cache, the drafter's context, and per row
    the anchor (the last committed token, not yet in the cache), its position, the position after
    its last allowed token, and whether it is still decoding."""

    cache: SlotCache
    ctx: DraftContext | None
    anchor: torch.Tensor
    pos: torch.Tensor
    end: torch.Tensor
    live: torch.Tensor

    def select(self, keep):
        """Keep only rows `keep` (finished rows dropped so they cost nothing)."""
        self.cache.select_rows(keep)
        if self.ctx is not None:
            self.ctx.select_rows(keep)
        self.anchor, self.pos, self.end, self.live = (t[keep] for t in (self.anchor, self.pos, self.end, self.live))

    def advance(self, num_accepted, out):
        """A step's emitted token becomes each live row's anchor, num_accepted + 1 positions on."""
        self.anchor = torch.where(self.live, out.gather(1, num_accepted[:, None]).squeeze(1), self.anchor)
        self.pos = self.pos + (num_accepted + 1) * self.live

    def admit(self, slots, new):
        """Rows `slots` take over the rows of `new` (freshly prefilled requests)."""
        self.cache.copy_rows(slots, new.cache)
        if self.ctx is not None:
            self.ctx.copy_rows(slots, new.ctx)
        for name in ("anchor", "pos", "end", "live"):
            getattr(self, name)[slots] = getattr(new, name)


VIEW_BUCKET = 128  # static mode: attention views grow in steps of this many slots


def _prefill(target, drafter, prompts, max_len, max_new_tokens, W, static, sampling):
    """One target forward over right-padded prompts into a new cache (pad slots lie in the future of
    every real query); the drafter's context gets their features. Returns the new Rows, anchored at
    each prompt's first generated token."""
    device = target.device
    lens = torch.tensor([len(p) for p in prompts])
    width = int(lens.max())
    if static:  # bucketed prompt width, so prompts of similar length share one compiled prefill
        width = min(-(-width // 64) * 64, max_len - W - 1)  # W: the widest verify forward
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    ids, lens = ids.to(device), lens.to(device)
    positions = torch.arange(width, device=device).expand_as(ids)
    cache = target.new_cache(max_len)
    logits, feats = target.forward(ids, positions, cache, width)
    last = logits.gather(1, (lens - 1).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])).squeeze(1)
    ctx = None
    if drafter is not None:
        ctx = DraftContext(drafter, len(prompts), max_len, device)
        ctx.write(feats, positions)
    live = torch.ones(len(prompts), dtype=torch.bool, device=device)
    return Rows(cache, ctx, sampling.first_tokens(last), lens, lens + max_new_tokens, live)


def decode_step(target, drafter, rows, method, sampling, B, view_len, ctx_len, propose=None, traced=False):
    """One step for every row: draft a block, select a path, verify it with one target forward, write
    the verified features into the drafter's context, advance anchors and positions (docs/SPEC.md §3-5).

    A row's block shrinks to min(B, tokens it may still make + 1) (block_sizes). Returns num_accepted [b]
    and out [b, B] (the accepted drafts, then the target's token, then -1), plus the step's tensors
    for a trace when traced (else None).
    """
    b, device = rows.anchor.shape[0], rows.anchor.device
    sizes = block_sizes(rows.end, rows.pos, B)
    cands = None
    if B == 1:  # ar: the same loop with no drafts
        drafts, q = rows.anchor.new_zeros(b, 0), torch.zeros(b, 0, target.vocab_size, device=device)
    elif propose is not None:
        drafts, q = propose(rows.anchor, rows.pos)
    else:
        h, U = draft(drafter, target, rows.ctx, rows.anchor, rows.pos, ctx_len, B, sizes)
        drafts, q, *cands = select_path(drafter.candidate_selector, h, U, rows.anchor, method,
                                        sampling.temperature, sampling.generator, with_candidates=traced)
    block_pos = rows.pos[:, None] + torch.arange(B, device=device)
    logits, feats = target.forward(torch.cat([rows.anchor[:, None], drafts], 1), block_pos, rows.cache, view_len)
    u_accept = u_emit = None
    if sampling.temperature > 0:
        u_accept = torch.rand(b, B - 1, generator=sampling.generator, device=device)
        u_emit = torch.rand(b, generator=sampling.generator, device=device)
        p = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        num_accepted, out = verify_sampled(drafts, q.to(p.dtype), p, u_accept, u_emit, sizes - 1)
    else:
        num_accepted, out = verify_greedy(drafts, logits, sizes - 1)
    record = None if not traced else dict(
        anchor_pos=rows.pos, anchor=rows.anchor, sizes=sizes, drafts=drafts, q=q, candidates=cands,
        target_argmax=logits.argmax(-1), u_accept=u_accept, u_emit=u_emit, num_accepted=num_accepted, out=out)
    if rows.ctx is not None:
        rows.ctx.write(feats, block_pos)
    rows.advance(num_accepted, out)
    return num_accepted, out, record


def decode_tree_step(target, drafter, rows, sampling, B, budget, scores, view_len, ctx_len, traced=False):
    """decode_step with a tree: draft a block, build a tree of `budget` nodes over its candidates, verify
    every node in one target forward (a node sees the context, the anchor and its ancestors, at position
    anchor + depth), descend while the target's token is a child (docs/SPEC.md §9), then move the
    accepted path's K/V to slot = position and write its features into the drafter's context.

    The tree's K/V go to scratch slots pos .. pos + budget, past every committed slot of the row.
    Returns num_accepted [b], out [b, B] and the step's tensors for a trace when traced.
    """
    b, device = rows.anchor.shape[0], rows.anchor.device
    sizes = block_sizes(rows.end, rows.pos, B)
    h, U = draft(drafter, target, rows.ctx, rows.anchor, rows.pos, ctx_len, B, sizes)
    tree = select_tree(drafter.candidate_selector, h, U, rows.anchor, budget, scores, sizes - 1)
    slots, visible = tree_mask(rows.pos, tree.parents, view_len)
    depth = torch.cat([torch.zeros_like(tree.depth[:, :1]), tree.depth], 1)
    ids = torch.cat([rows.anchor[:, None], tree.tokens], 1)
    logits, feats = target.forward(ids, rows.pos[:, None] + depth, rows.cache, view_len, slots=slots, visible=visible)
    u = None
    if sampling.temperature > 0:
        u = torch.rand(b, budget + 1, generator=sampling.generator, device=device)
        p = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        num_accepted, path, out, y = verify_tree_sampled(tree, p, u)
    else:
        num_accepted, path, out, y = verify_tree_greedy(tree, logits)
    record = None if not traced else dict(
        anchor_pos=rows.pos, anchor=rows.anchor, sizes=sizes, tree=tree, y=y, path=path, u_tree=u,
        num_accepted=num_accepted, out=out)
    commit_path(rows, feats, path, B)
    rows.advance(num_accepted, out)
    return num_accepted, out, record


def tree_mask(pos, parents, view_len):
    """Where a tree's entries [anchor, nodes] go and what they see: slots [b, N+1] = pos .. pos + N (scratch
    slots past the row's committed ones) and visible [b, N+1, view_len]: the context (every slot before the
    anchor) and, among the scratch slots, the entry's ancestors and itself."""
    b, N = parents.shape
    slots = pos[:, None] + torch.arange(N + 1, device=pos.device)
    visible = (torch.arange(view_len, device=pos.device)[None, None, :] < pos[:, None, None]).expand(b, N + 1, view_len)
    visible = visible.clone()
    visible.scatter_(2, slots[:, None, :].expand(b, N + 1, N + 1), tree_ancestors(parents))
    return slots, visible


def commit_path(rows, feats, path, B):
    """After a tree step: the K/V of [anchor, accepted path] move from their scratch slots to slot =
    position (pos + depth), and the drafter's context gets their tapped features at those positions.
    path [b, B-1]: accepted entries of [anchor, nodes] by depth, -1 past the path (there the anchor's
    K/V and features fill slots that lie in the row's future, as a chain step's rejected drafts do)."""
    entries = torch.cat([torch.zeros_like(path[:, :1]), path.clamp(min=0)], 1)
    block_pos = rows.pos[:, None] + torch.arange(B, device=path.device)
    rows.cache.move(rows.pos[:, None] + entries, block_pos)
    if rows.ctx is not None:
        rows.ctx.write(feats.gather(1, entries[:, :, None].expand(-1, -1, feats.shape[-1])), block_pos)


def check_generate_args(target, drafter, prompts, method, max_new_tokens, temperature, top_k, top_p,
                        block_size, max_batch, propose, tree_budget, tree_scores):
    """Every input check of generate, once per call. Returns the block size B (1 for ar), the width W
    of a verify forward (B, or for a tree at least budget + 1), the longest prompt's length and the
    target's context length."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_sampling_params(temperature, top_p, top_k)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must contain at least one token")
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    check_tree_settings(tree_budget, tree_scores)
    if method == "dflash2-tree" and (drafter is None or propose is not None):
        raise ValueError("method 'dflash2-tree' needs a drafter (and no propose)")
    layer_types = getattr(getattr(target.model.config, "text_config", target.model.config), "layer_types", None) or ()
    if method == "dflash2-tree" and any("sparse" in t for t in layer_types):
        # MiniMax-M3's MSA indexer pools keys into blocks by slot and masks them by slot <= position, so
        # a tree's nodes, which sit in scratch slots, would not pick the blocks their path alone would.
        raise InputError("method 'dflash2-tree' needs a target with dense attention: block-sparse (MSA) layers "
                         "choose key blocks by cache slot, which tree verification moves (docs/SPEC_NOTES.md)")
    B = 1
    if method != "ar":
        if drafter is None and propose is None:
            raise ValueError(f"method {method!r} needs a drafter")
        B = block_size or (drafter.config.block_size if drafter is not None else 8)
        check_block_size(B, drafter.config.block_size if drafter is not None else None)
    W = max(B, tree_budget + 1) if method == "dflash2-tree" else B
    longest = max(len(p) for p in prompts)
    limit = getattr(getattr(target.model.config, "text_config", target.model.config), "max_position_embeddings", None)
    if limit is not None and longest + max_new_tokens + W + 1 > limit:
        raise ValueError(f"prompt too long: {longest} prompt tokens + {max_new_tokens} new tokens + block {W} "
                         f"exceed the target's context of {limit} positions")
    return B, W, longest, limit


@torch.inference_mode()
def generate(target, drafter, prompts, method="dflash2", max_new_tokens=256, temperature=0.0, top_k=0,
             top_p=1.0, seed=0, stop_ids=(), block_size=None, on_emit=None, propose=None, trace=None,
             static=False, max_batch=None, tree_budget=None, tree_scores="selector"):
    """Speculative decoding of a batch of prompts (lists of token ids); one decode_step per iteration.

    `method="ar"` runs the same loop with no drafts. `max_batch` caps the requests in flight: the
    rest wait in order and each is prefilled into a row as soon as a request finishes (continuous
    batching); None runs every prompt at once. `propose(anchor, pos, requests) -> (drafts, q)` replaces
    the drafter (tests force acceptance patterns with it). `on_emit(request, tokens)` streams output.
    `trace(record)` receives every step's tensors (tracing adds host copies). `static=True` limits
    shapes to a few buckets (cache views rounded up to VIEW_BUCKET slots) for compiled cores.
    `method="dflash2-tree"` verifies a tree of `tree_budget` nodes (default: DEFAULT_TREE_BUDGET of
    the device type) scored by `tree_scores` ("selector" or "marginal") with decode_tree_step.
    Returns one Result per prompt.
    """
    if method == "dflash2-tree" and tree_budget is None:
        tree_budget = DEFAULT_TREE_BUDGET.get(target.device.type, DEFAULT_TREE_BUDGET["cuda"])
    B, W, longest, limit = check_generate_args(target, drafter, prompts, method, max_new_tokens, temperature, top_k,
                                               top_p, block_size, max_batch, propose, tree_budget, tree_scores)
    max_len = longest + max_new_tokens + W + 1
    if static:  # round up so later requests reuse the same compiled shapes
        max_len = min(-(-max_len // 256) * 256, limit or max_len)
    sampling = Sampling(temperature, top_k, top_p, torch.Generator(device=target.device).manual_seed(seed))
    ctx_drafter = drafter if method != "ar" else None  # whose context a prefill fills (none for ar)
    results = [Result() for _ in prompts]
    host_pos, rows, alive, waiting = torch.zeros(0, dtype=torch.long), None, [], list(range(len(prompts)))
    request = []  # row -> request index

    def admit(free):
        """Prefill the next waiting requests into rows `free` (rows past the end are appended)."""
        nonlocal rows, waiting, host_pos
        reqs, waiting = waiting[: len(free)], waiting[len(free):]
        new = _prefill(target, ctx_drafter, [prompts[r] for r in reqs], max_len, max_new_tokens, W, static, sampling)
        first = new.anchor.cpu()  # host sync of the prefill
        lens = torch.tensor([len(prompts[r]) for r in reqs])  # the new rows' positions, known on the host
        if rows is None:
            rows, host_pos = new, lens
        else:
            rows.admit(torch.tensor(free, device=target.device), new)
            host_pos[free] = lens
        for i, (r, req) in enumerate(zip(free, reqs)):
            request[r:r + 1] = [req]
            results[req].verify_steps = 1  # the prefill is a request's first verification step
            alive[r:r + 1] = [_emit(results[req], [int(first[i])], max_new_tokens, stop_ids, on_emit, req)]
        rows.live = torch.tensor(alive, device=target.device)

    admit(list(range(len(prompts) if max_batch is None else min(max_batch, len(prompts)))))
    while True:
        free = [r for r, a in enumerate(alive) if not a][: len(waiting)]
        if free:  # an admitted request may already be done (stop token, or max_new_tokens = 1): loop again
            admit(free)
            continue
        if not any(alive):
            break
        if not all(alive) and not static:  # static shapes keep finished rows, frozen in place
            keep = [r for r, a in enumerate(alive) if a]
            rows.select(torch.tensor(keep, device=target.device))
            request, host_pos, alive = [request[r] for r in keep], host_pos[keep], [True] * len(keep)
        view_len = int(host_pos.max()) + W
        ctx_len = view_len - W
        if static:  # a handful of shapes, each compiled once; the extra slots are masked out
            view_len = ctx_len = min(-(-view_len // VIEW_BUCKET) * VIEW_BUCKET, max_len)
        if method == "dflash2-tree":
            num_accepted, out, record = decode_tree_step(target, drafter, rows, sampling, B, tree_budget, tree_scores,
                                                         view_len, ctx_len, traced=trace is not None)
        else:
            proposer = None if propose is None else lambda anchor, pos: propose(anchor, pos, torch.tensor(request))
            num_accepted, out, record = decode_step(target, drafter, rows, method, sampling, B, view_len, ctx_len,
                                                    proposer, traced=trace is not None)
        if trace is not None:
            trace(dict(record, requests=list(request), steps=[results[r].verify_steps for r in request]))
        host = torch.cat([num_accepted[:, None], out], 1).cpu()  # the one host sync per step
        was_alive = list(alive)
        for r, req in enumerate(request):
            if alive[r]:
                a = int(host[r, 0])
                results[req].verify_steps += 1
                results[req].accepted.append(a)
                host_pos[r] += a + 1
                alive[r] = _emit(results[req], host[r, 1 : a + 2].tolist(), max_new_tokens, stop_ids, on_emit, req)
        if alive != was_alive:  # a row finished: its anchor and position freeze from now on
            rows.live = torch.tensor(alive, device=target.device)
    return results


def _emit(res, tokens, max_new_tokens, stop_ids, on_emit, req):
    """Append tokens up to a stop token (kept) or max_new_tokens; returns whether the request goes on."""
    out = []
    for t in tokens:
        if len(res.tokens) + len(out) >= max_new_tokens:
            break
        out.append(t)
        if t in stop_ids:
            res.finished_by_stop = True
            break
    res.tokens.extend(out)
    if on_emit is not None and out:
        on_emit(req, out)
    return not res.finished_by_stop and len(res.tokens) < max_new_tokens
