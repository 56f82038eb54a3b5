"""DFlash 2 speculative decoding: the target behind a slot cache and the draft -> select -> verify loop.

Everything here stays on the device: randomness is drawn as uniform tensors (`torch.rand(...,
generator=g)`) and handed to verify.py's math, so no step needs a host sync and a run can be replayed.
"""

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from . import kernels
from .model import check_attn_backend, dflash1_walk
from .settings import METHODS, check_sampling_params
from .verify import process_logits, sample_from, verify_greedy, verify_sampled

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


def fix_partial_rotary(model):
    """transformers' minimax_m3_vl_text reads only rope_parameters["partial_rotary_factor"] and ignores its
    own rotary_dim field, so a config without the factor silently runs full RoPE (SPEC §7). Restore the
    factor from rotary_dim and rebuild the rotary tables. Returns True when it had to fix something."""
    config = getattr(model.config, "text_config", model.config)
    rotary_dim = getattr(config, "rotary_dim", None)
    rope = getattr(config, "rope_parameters", None)
    if not rotary_dim or not isinstance(rope, dict) or "partial_rotary_factor" in rope:
        return False
    rope["partial_rotary_factor"] = rotary_dim / config.head_dim
    base = model.get_decoder()
    old = base.rotary_emb
    base.rotary_emb = type(old)(config=config).to(old.inv_freq.device)
    return True


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
        # load_target(prepack=True) swapped the linears for oneDNN ones; the draft head follows suit
        self.prepacked = any(isinstance(m, kernels.PackedLinear) for m in model.modules())
        bad = [l for l in self.layer_ids if not 0 <= l < self.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for a target with {self.num_layers} layers")

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
    def forward(self, ids, positions, cache, view_len):
        """ids, positions [b, T]; writes K/V at those positions; keys visible iff slot <= query position.

        view_len bounds the slots attended (>= max position + 1). Returns logits [b, T, V] (float32)
        and features [b, T, n*H] (empty when no layers are tapped).
        """
        cache.write_positions = positions
        cache.write_rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        cache.view_len = view_len
        slots = torch.arange(view_len, device=ids.device)
        dtype = self.lm_head_weight.dtype
        visible = slots[None, None, None, :] <= positions[:, None, :, None]
        mask = torch.zeros(visible.shape, dtype=dtype, device=ids.device).masked_fill(~visible, torch.finfo(dtype).min)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache,
                         use_cache=True, output_hidden_states=bool(self.layer_ids))
        if self.layer_ids:
            feats = torch.cat([out.hidden_states[l + 1] for l in self.layer_ids], dim=-1)
        else:
            feats = ids.new_zeros(ids.shape + (0,), dtype=dtype)
        return out.logits.float(), feats


# --- the draft -> select -> verify loop ---


class DraftContext:
    """The drafter's KV cache: context K/V only, slot j = position j, per layer [b, kv_heads, max_len, hd].

    A row's context is every slot before its anchor; rejected drafts' rows are written too but
    stay invisible (slot >= anchor position) until overwritten, so no crop is needed.
    """

    def __init__(self, drafter, batch, max_len, device):
        cfg = drafter.config
        self.drafter = drafter
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        dtype = next(drafter.parameters()).dtype
        self.kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                   for _ in range(cfg.num_hidden_layers)]

    def write(self, features, positions):
        new = self.drafter.context_kv(features.to(self.kv[0][0].dtype), positions)
        idx = positions[:, None, :, None].expand(-1, self.kv[0][0].shape[1], -1, self.kv[0][0].shape[-1])
        for (k, v), (nk, nv) in zip(self.kv, new):
            k.scatter_(2, idx, nk)
            v.scatter_(2, idx, nv)

    def view(self, length):
        return [(k[:, :, :length], v[:, :, :length]) for k, v in self.kv]

    def select_rows(self, rows):
        self.kv = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.kv]

    def copy_rows(self, rows, other):
        for (k, v), (ok, ov) in zip(self.kv, other.kv):
            k[rows], v[rows] = ok, ov


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


class _Timer:
    """Wall time per phase of a step, only when asked for (it synchronises the device)."""

    def __init__(self, timings, device):
        self.timings, self.device, self.last = timings, device, None

    def __call__(self, phase=None):
        if self.timings is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if phase is not None:
            self.timings[phase] = self.timings.get(phase, 0.0) + now - self.last
        self.last = now


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
        return (len(self.tokens) - 1) / len(self.accepted) if self.accepted else None


def mean_acceptance_length(results):
    """The authors' benchmark figure over requests: the mean of the per-request acceptance lengths
    (requests with no decode step left out); None if there are none."""
    taus = [r.acceptance_length for r in results if r.acceptance_length is not None]
    return sum(taus) / len(taus) if taus else None


VIEW_BUCKET = 128  # static mode: attention views grow in steps of this many slots


def _prefill(target, drafter, prompts, max_len, B, static):
    """One target forward over right-padded prompts into a new cache (pad slots lie in the future of
    every real query); the drafter's context gets their features. Returns the cache, the draft
    context (None without a drafter), the logits at each prompt's last token and the prompt lengths."""
    device = target.device
    lens = torch.tensor([len(p) for p in prompts])
    width = int(lens.max())
    if static:  # bucketed prompt width, so prompts of similar length share one compiled prefill
        width = min(-(-width // 64) * 64, max_len - B - 1)
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
    return cache, ctx, last, lens


@torch.inference_mode()
def generate(target, drafter, prompts, method="dflash2", max_new_tokens=256, temperature=0.0, top_k=0,
             top_p=1.0, seed=0, stop_ids=(), block_size=None, on_emit=None, propose=None, trace=None,
             static=False, timings=None, max_batch=None):
    """Speculative decoding of a batch of prompts (lists of token ids) with a ragged per-row state.

    Per step: draft block -> top-K candidates -> selector walk -> one target forward over
    [anchor, drafts] -> verification -> emit accepted + 1 tokens. As in the authors' loop, a row's
    block shrinks to what is left of its budget, min(B, 1 + tokens still to make), so its last
    drafts come from a shorter block (shapes stay B wide; the slots past it are ignored). `method="ar"` runs the same
    cache code with no drafts. `max_batch` caps the requests in flight: the rest wait in order and
    each is prefilled into a row as soon as a request finishes (continuous batching); None runs
    every prompt at once. `propose(anchor, pos, rows) -> (drafts, q)` replaces the drafter (tests
    use it to force chosen acceptance patterns). `on_emit(request, tokens)` streams output.
    `trace(record)` receives every step's tensors; tracing adds host copies. `static=True` limits
    shapes to a few buckets (cache views rounded up to VIEW_BUCKET slots) for compiled cores. `timings`,
    a dict, accumulates seconds per phase: prefill, drafter, selector, verify, bookkeeping.
    Returns one Result per prompt.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_sampling_params(temperature, top_p, top_k)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must contain at least one token")
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if method == "ar":
        B = 1
    else:
        if drafter is None and propose is None:
            raise ValueError(f"method {method!r} needs a drafter")
        B = block_size or (drafter.config.block_size if drafter is not None else 8)
        if drafter is not None and not 2 <= B <= drafter.config.block_size:
            raise ValueError(f"block_size must be in [2, {drafter.config.block_size}] (the drafter's), got {B}")
    device = target.device
    longest = max(len(p) for p in prompts)
    max_len = longest + max_new_tokens + B + 1
    limit = getattr(getattr(target.model.config, "text_config", target.model.config), "max_position_embeddings", None)
    if limit is not None and max_len > limit:
        raise ValueError(f"prompt too long: {longest} prompt tokens + {max_new_tokens} new tokens + block {B} "
                         f"exceed the target's context of {limit} positions")
    if static:  # round up so later requests reuse the same compiled shapes
        max_len = min(-(-max_len // 256) * 256, limit or max_len)
    stop_ids = set(stop_ids)
    g = torch.Generator(device=device).manual_seed(seed)
    sampled = temperature > 0
    ctx_drafter = drafter if method != "ar" else None  # whose context a prefill fills (none for ar)
    results = [Result() for _ in prompts]
    timer = _Timer(timings, device)

    def first_tokens(last):
        if sampled:
            u = torch.rand(last.shape[0], generator=g, device=device)
            return sample_from(process_logits(last, temperature, top_k, top_p), u)
        return last.argmax(-1)

    def start(req, token):
        """A request's first token, from its prefill (the prefill counts as its first verification step)."""
        results[req].verify_steps = 1
        return _emit(results[req], [token], max_new_tokens, stop_ids, on_emit, req)

    n = len(prompts) if max_batch is None else min(max_batch, len(prompts))
    waiting = list(range(n, len(prompts)))  # requests not yet admitted, in order
    timer()
    cache, ctx, last, pos = _prefill(target, ctx_drafter, prompts[:n], max_len, B, static)
    anchor = first_tokens(last)
    end = pos + max_new_tokens  # per row: the position after its last allowed token
    host_anchor = anchor.cpu()  # host sync of the prefill
    timer("prefill")
    rows = torch.arange(n)  # row -> request index
    host_pos = torch.tensor([len(p) for p in prompts[:n]])
    live, live_count = None, 0  # device copy of `alive`, rebuilt only when it changes
    alive = [start(req, int(host_anchor[r])) for r, req in enumerate(rows.tolist())]

    while True:
        free = [r for r, a in enumerate(alive) if not a][: len(waiting)]
        if free:  # admit waiting requests into finished rows: prefill them alone, then copy their rows in
            reqs, waiting = waiting[: len(free)], waiting[len(free) :]
            timer()
            new = [prompts[q] for q in reqs]
            new_cache, new_ctx, last, new_pos = _prefill(target, ctx_drafter, new, max_len, B, static)
            first = first_tokens(last)
            slots = torch.tensor(free, device=device)
            cache.copy_rows(slots, new_cache)
            if ctx is not None:
                ctx.copy_rows(slots, new_ctx)
            anchor[slots], pos[slots], end[slots] = first, new_pos, new_pos + max_new_tokens
            host_first = first.cpu()
            timer("prefill")
            rows[free], host_pos[free] = torch.tensor(reqs), torch.tensor([len(p) for p in new])
            for i, (r, req) in enumerate(zip(free, reqs)):
                alive[r] = start(req, int(host_first[i]))
            live = None
            continue  # an admitted request may already be done (stop token, or max_new_tokens = 1)
        keep = torch.tensor([r for r, a in enumerate(alive) if a], dtype=torch.long)
        if len(keep) == 0:
            break
        # Drop finished rows so they cost nothing; static shapes keep them, frozen in place.
        if len(keep) < len(alive) and not static:
            alive = [True] * len(keep)
            rows, host_pos = rows[keep], host_pos[keep]
            dkeep = keep.to(device)
            anchor, pos, end = anchor[dkeep], pos[dkeep], end[dkeep]
            cache.select_rows(dkeep)
            if ctx is not None:
                ctx.select_rows(dkeep)
            live = None
        b = len(rows)
        if live is None or sum(alive) != live_count:  # rows only finish between admissions, so the count tells
            live, live_count = torch.tensor(alive, device=device), sum(alive)
        view_len = int(host_pos.max()) + B
        ctx_len = view_len - B
        if static:  # a handful of shapes, each compiled once; the extra slots are masked out
            view_len = ctx_len = min(-(-view_len // VIEW_BUCKET) * VIEW_BUCKET, max_len)
        cands = None
        sizes = block_sizes(end, pos, B)
        num_drafts = None if B == 1 else sizes - 1
        timer()
        if B == 1:
            drafts = anchor.new_zeros(b, 0)
            q = torch.zeros(b, 0, target.vocab_size, device=device)
        elif propose is not None:
            drafts, q = propose(anchor, pos, rows)
        else:
            h, U = draft(drafter, target, ctx, anchor, pos, ctx_len, B, sizes)
            timer("drafter")
            drafts, q, *cands = select_path(drafter.candidate_selector, h, U, anchor, method, temperature, g,
                                            with_candidates=trace is not None)
            timer("selector")
        block_pos = pos[:, None] + torch.arange(B, device=device)
        logits, feats = target.forward(torch.cat([anchor[:, None], drafts], 1), block_pos, cache, view_len)
        timer("verify")
        u_accept = u_emit = None
        if sampled:
            u_accept = torch.rand(b, B - 1, generator=g, device=device)
            u_emit = torch.rand(b, generator=g, device=device)
            p = process_logits(logits, temperature, top_k, top_p)
            num_accepted, out = verify_sampled(drafts, q.to(p.dtype), p, u_accept, u_emit, num_drafts)
        else:
            num_accepted, out = verify_greedy(drafts, logits, num_drafts)
        if trace is not None:
            trace(dict(requests=rows.tolist(), steps=[results[r].verify_steps for r in rows.tolist()],
                       anchor_pos=pos.tolist(), anchor=anchor.tolist(), sizes=sizes.tolist(), drafts=drafts, q=q,
                       candidates=cands,
                       target_argmax=logits.argmax(-1), u_accept=u_accept, u_emit=u_emit,
                       num_accepted=num_accepted, out=out))
        if ctx is not None:
            ctx.write(feats, block_pos)
        anchor = torch.where(live, out.gather(1, num_accepted[:, None]).squeeze(1), anchor)
        pos = pos + (num_accepted + 1) * live
        host = torch.cat([num_accepted[:, None], out], 1).cpu()  # the one host sync per step
        was_alive, alive = alive, []
        for r, req in enumerate(rows.tolist()):
            if not was_alive[r]:
                alive.append(False)
                continue
            a = int(host[r, 0])
            res = results[req]
            res.verify_steps += 1
            res.accepted.append(a)
            host_pos[r] += a + 1
            alive.append(_emit(res, host[r, 1 : a + 2].tolist(), max_new_tokens, stop_ids, on_emit, req))
        timer("bookkeeping")
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
