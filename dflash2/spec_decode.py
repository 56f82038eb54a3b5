"""DFlash 2 speculative decoding: the draft -> select -> verify loop (the target is target.Target).

Everything here stays on the device: randomness is drawn as uniform tensors (`torch.rand(...,
generator=g)`) and handed to verify.py's math, so no step needs a host sync and a run can be replayed.
"""

import dataclasses
import functools
import time
from dataclasses import dataclass

import torch

from .kernels import check_attn_backend
from .dspark import draft_dspark
from .model import DraftContext, dflash1_walk
from .policy import COST_BATCHES, COST_CONTEXT, TREE_BUDGETS, Policy, cost_key, cost_widths, costs_for, grid_costs
from .results import Requests
from .settings import AUTO_TREE_CAP, DecodeSettings, InputError, SettingError, cache_dir
from .target import SlotCache, install_output_hooks, text_config
from .verify import (build_tree, marginal_log_weights, process_logits, sample_from, selector_log_weights,
                     tree_ancestors, verify_greedy, verify_sampled, verify_tree_greedy, verify_tree_sampled)

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


def draft_confidence(selector, h, U, anchor, drafts, method):
    """c_t [b, n]: the largest probability of the law slot t's draft comes from at T = 1, given the draft before
    it: the selector's law over the whole vocabulary (verify.selector_log_weights), or softmax U_t for dflash.
    It reads d_{t-1}, never d_t, so a cut on it is a stopping rule, lossless at every temperature (SPEC §10)."""
    if method == "dflash":
        return U.float().softmax(-1).amax(-1)
    cand_ids, _ = selector.candidates(U, selector.top_k)
    logw = selector_log_weights(selector.edge_scores(h, U, cand_ids, anchor), U, cand_ids)
    b, n, K = cand_ids.shape
    prev = (cand_ids[:, :-1] == drafts[:, :-1, None]).int().argmax(-1)  # d_{t-1}'s index in C_{t-1}
    prev = torch.cat([prev.new_zeros(b, 1), prev], 1)
    return logw.gather(2, prev[:, :, None, None].expand(b, n, 1, K)).squeeze(2).amax(-1).exp()


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


def compile_core(target, drafter=None, compile_target=True):
    """torch.compile the hot functions: the target forward, the drafter forward and the walk.

    Use with generate(..., static=True): cache views come in a few bucketed lengths, so a
    warm-up at the real length compiles every shape and the steady state never recompiles.
    compile_target=False leaves the target eager (to time the drafter's share alone).
    """
    # One graph per view bucket and prompt-width bucket; dynamo's default limit of 8 is too few.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if compile_target:
        install_output_hooks(target.model)
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
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else drawn from P (verify.process_logits)."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator
    walk_temperature: float = None  # the walk's: temperature, or 0 for a greedy walk (q one-hot) at any temperature

    def __post_init__(self):
        if self.walk_temperature is None:
            self.walk_temperature = self.temperature

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
        ctx = DraftContext(drafter, len(prompts), max_len, device, defer=not static)
        ctx.write(feats, positions)
    live = torch.ones(len(prompts), dtype=torch.bool, device=device)
    return Rows(cache, ctx, sampling.first_tokens(last), lens, lens + max_new_tokens, live)


def decode_step(target, drafter, rows, method, sampling, B, view_len, ctx_len, propose=None, traced=False,
                cut=None):
    """One step for every row: draft a block, select a path, verify it with one target forward, write
    the verified features into the drafter's context, advance anchors and positions (docs/SPEC.md §3-5).

    A row's block shrinks to min(B, tokens it may still make + 1) (block_sizes). cut(confidence [b, B-1], drafts
    each row may verify [b]) -> (drafts to verify per row [b], W): the speculation policy (policy.py) cuts the
    blocks, and the forward is W <= B wide. Returns
    num_accepted [b] and out [b, W] (the accepted drafts, then the target's token, then -1), plus the step's
    tensors for a trace when traced (else None).
    """
    b, device = rows.anchor.shape[0], rows.anchor.device
    cands, drafter_block = None, B
    if method == "dspark" and B > 1:
        B += 1  # every DSpark slot proposes: a block of B slots verifies the anchor and B drafts
    sizes = block_sizes(rows.end, rows.pos, B)
    if B == 1:  # ar: the same loop with no drafts
        drafts, q = rows.anchor.new_zeros(b, 0), torch.zeros(b, 0, target.vocab_size, device=device)
    elif propose is not None:
        drafts, q = propose(rows.anchor, rows.pos)
    elif method == "dspark":
        drafts, q, conf = draft_dspark(drafter, target, rows.ctx, rows.anchor, rows.pos, ctx_len, drafter_block, sampling)
        if cut is not None:  # its confidence head decides (a stopping rule: it reads the previous draft)
            keep, B = cut(conf, sizes - 1)
            drafts, q, sizes = drafts[:, : B - 1], q[:, : B - 1], torch.minimum(sizes, keep + 1)
    else:
        h, U = draft(drafter, target, rows.ctx, rows.anchor, rows.pos, ctx_len, B, sizes)
        drafts, q, *cands = select_path(drafter.candidate_selector, h, U, rows.anchor, method,
                                        sampling.walk_temperature, sampling.generator, with_candidates=traced)
        if cut is not None:  # verify only the first drafts the law expects to be accepted
            keep, B = cut(draft_confidence(drafter.candidate_selector, h, U, rows.anchor, drafts, method), sizes - 1)
            drafts, q, sizes = drafts[:, : B - 1], q[:, : B - 1], torch.minimum(sizes, keep + 1)
            cands = [None if c is None else c[:, : B - 1] for c in cands]
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


def decode_tree_step(target, drafter, rows, sampling, B, budget, scores, view_len, ctx_len, traced=False,
                     cut=None):
    """decode_step with a tree: draft a block, build a tree of `budget` nodes over its candidates, verify
    every node in one target forward (a node sees the context, the anchor and its ancestors, at position
    anchor + depth), descend while the target's token is a child (docs/SPEC.md §9), then move the
    accepted path's K/V to slot = position and write its features into the drafter's context.
    cut(tree) -> N <= budget (the speculation policy): the step verifies the tree's N best nodes instead.

    The tree's K/V go to scratch slots pos .. pos + budget, past every committed slot of the row.
    Returns num_accepted [b], out [b, B] and the step's tensors for a trace when traced.
    """
    b, device = rows.anchor.shape[0], rows.anchor.device
    sizes = block_sizes(rows.end, rows.pos, B)
    h, U = draft(drafter, target, rows.ctx, rows.anchor, rows.pos, ctx_len, B, sizes)
    tree = select_tree(drafter.candidate_selector, h, U, rows.anchor, budget, scores, sizes - 1)
    if cut is not None and (n := cut(tree)) < budget:  # a tree is fixed before the target's draws: any cut is lossless
        budget, tree = n, select_tree(drafter.candidate_selector, h, U, rows.anchor, n, scores, sizes - 1)
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


def check_generate_args(target, drafter, prompts, settings, propose):
    """Every input check of generate, once per call. Returns the resolved settings, the width W of a verify
    forward (the block, or for a tree at least budget + 1), the longest prompt's length and the target's
    context length."""
    cfg = text_config(target.model.config)
    s = settings.resolved(target.device.type, drafter.config.block_size if drafter is not None else None)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("every prompt must contain at least one token")
    if s.method != "ar" and drafter is None and propose is None:
        raise SettingError("method", f"{s.method!r} needs a drafter")
    if s.method == "dflash2-tree" and (drafter is None or propose is not None):
        raise SettingError("method", "'dflash2-tree' needs a drafter (and no propose)")
    if s.method == "dflash2-tree" and any("sparse" in t for t in getattr(cfg, "layer_types", None) or ()):
        # MiniMax-M3's MSA indexer pools keys into blocks by slot and masks them by slot <= position, so
        # a tree's nodes, which sit in scratch slots, would not pick the blocks their path alone would.
        raise InputError("method 'dflash2-tree' needs a target with dense attention: block-sparse (MSA) layers "
                         "choose key blocks by cache slot, which tree verification moves (docs/SPEC_NOTES.md)")
    if s.method == "dspark" and propose is None and not hasattr(drafter, "markov_head"):
        raise SettingError("method", "'dspark' needs a DSpark drafter (DeepSpec's layout, docs/DSPARK.md); this one is "
                                     f"a {type(drafter).__name__}")
    if s.method in ("dflash2", "dflash", "dflash2-tree") and drafter is not None and hasattr(drafter, "markov_head"):
        raise SettingError("method", f"{s.method!r} needs a DFlash 2 drafter; this one is a DSpark drafter "
                                     "(use --method dspark)")
    B = s.block_size or 1
    W = max(B, s.tree_budget + 1) if s.method == "dflash2-tree" else B + (s.method == "dspark")
    longest = max(len(p) for p in prompts)
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit is not None and longest + s.max_new_tokens + W + 1 > limit:
        raise InputError(f"prompt too long: {longest} prompt tokens + {s.max_new_tokens} new tokens + block {W} "
                         f"exceed the target's context of {limit} positions")
    return s, W, longest, limit


@torch.inference_mode()
def generate(target, drafter, prompts, settings=None, *, on_emit=None, propose=None, trace=None, speculation=None,
             **fields):
    """Speculative decoding of a batch of prompts (lists of token ids) under one DecodeSettings (keyword
    fields build or amend it: generate(..., max_new_tokens=64)); one decode step per iteration.

    `method="ar"` runs the same loop with no drafts. `max_batch` caps the requests in flight: the
    rest wait in order and each is prefilled into a row as soon as a request finishes (continuous
    batching). `propose(anchor, pos, requests) -> (drafts, q)` replaces the drafter (tests force
    acceptance patterns with it). `on_emit(request, tokens)` streams output. `trace(record)` receives
    every step's tensors (tracing adds host copies). `static=True` limits shapes to a few buckets (cache
    views rounded up to VIEW_BUCKET slots) for compiled cores. `method="dflash2-tree"` verifies a tree
    of `tree_budget` nodes with decode_tree_step. The default `policy="auto"` lets a policy.Policy choose each
    step's width for the whole batch (this machine's costs, measured once: measure_costs); `policy="fixed"`
    verifies every row's whole block (or tree); `speculation=` passes the Policy (tests, replays).
    Returns one Result per prompt.
    """
    settings = DecodeSettings(**fields) if settings is None else dataclasses.replace(settings, **fields)
    s, W, longest, limit = check_generate_args(target, drafter, prompts, settings, propose)
    device, B = target.device, s.block_size or 1
    max_len = longest + s.max_new_tokens + W + 1
    if s.static:  # round up so later requests reuse the same compiled shapes
        max_len = min(-(-max_len // 256) * 256, limit or max_len)
    sampling = Sampling(s.temperature, s.top_k, s.top_p, torch.Generator(device=device).manual_seed(s.seed),
                        0.0 if s.walk == "greedy" else s.temperature)
    ctx_drafter = drafter if s.method != "ar" else None  # whose context a prefill fills (none for ar)
    book = Requests(prompts, s, on_emit)
    traced = trace is not None
    policy = speculation
    if policy is None and s.policy == "auto" and propose is None:
        policy = Policy(machine_costs(target, drafter),
                        s.tree_budget if s.method == "dflash2-tree" else B, tree=s.method == "dflash2-tree")
    cut = {} if policy is None else dict(cut=policy.cut_tree if s.method == "dflash2-tree" else policy.cut_chain)
    if s.method == "dflash2-tree":
        step = functools.partial(decode_tree_step, target, drafter, sampling=sampling, B=B, budget=s.tree_budget,
                                 scores=s.tree_scores, traced=traced, **cut)
    else:
        proposer = None if propose is None else lambda anchor, pos: propose(anchor, pos, torch.tensor(book.request))
        step = functools.partial(decode_step, target, drafter, method=s.method, sampling=sampling, B=B,
                                 propose=proposer, traced=traced, **cut)
    plain = functools.partial(decode_step, target, drafter, method=s.method, sampling=sampling, B=1, traced=traced)

    def admit(rows, free):
        """Prefill the next waiting requests into rows `free` (rows past the end are appended)."""
        reqs = book.take(len(free))
        new = _prefill(target, ctx_drafter, [prompts[r] for r in reqs], max_len, s.max_new_tokens, W, s.static, sampling)
        if rows is None:
            rows = new
        else:
            rows.admit(torch.tensor(free, device=device), new)
        book.admit(free, reqs, new.anchor.tolist())  # host sync of the prefill
        rows.live = torch.tensor(book.alive, device=device)
        return rows

    rows = admit(None, list(range(min(len(prompts), s.max_batch or len(prompts)))))
    while True:
        free = book.free_rows()
        if free:  # an admitted request may already be done (stop token, or max_new_tokens = 1): loop again
            rows = admit(rows, free)
            continue
        if not any(book.alive):
            break
        if not s.static:  # static shapes keep finished rows, frozen in place
            keep = book.compact()
            if keep is not None:
                rows.select(torch.tensor(keep, device=device))
        view_len = int(book.pos.max()) + W
        ctx_len = view_len - W
        if s.static:  # a handful of shapes, each compiled once; the extra slots are masked out
            view_len = ctx_len = min(-(-view_len // VIEW_BUCKET) * VIEW_BUCKET, max_len)
        drafted = True
        if policy is not None:
            policy.begin(book.request, book.steps())
            drafted = policy.drafts(book.alive)
        num_accepted, out, record = (step if drafted else plain)(rows=rows, view_len=view_len, ctx_len=ctx_len)
        widths = [W] * len(book.request) if policy is None else policy.widths
        if traced:
            trace(dict(record, requests=list(book.request), steps=book.steps(),
                       widths=None if policy is None else widths))
        host = torch.cat([num_accepted[:, None], out], 1).cpu()  # the one host sync per step
        if policy is not None:
            policy.end(book.alive, host[:, 0].tolist(), drafted)
        if book.commit(host, widths):
            rows.live = torch.tensor(book.alive, device=device)
    return book.results


def _best_time(fn, reps, least_s=0.02, warm=True):
    """The fastest of at least reps calls (more while they take under least_s in all), after a warm-up."""
    if warm:
        fn()  # first calls allocate
    best, spent, n = float("inf"), 0.0, 0
    while n < reps or spent < least_s:
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        took = time.perf_counter() - start
        best, spent, n = min(best, took), spent + took, n + 1
    return best


def machine_costs(target, drafter):
    """This machine's policy.Costs for the pair: measured once (measure_costs) and cached in the cache dir."""
    return costs_for(target, drafter, measure_costs, cache_dir() / "costs.json")


@torch.inference_mode()
def measure_costs(target, drafter, max_width=AUTO_TREE_CAP + 1, reps=3):
    """This machine's policy.Costs: a verify forward of b rows by w tokens over a COST_CONTEXT-token context at
    policy.COST_BATCHES rows and policy.cost_widths(b) tokens, and at each b one draft (the chain's walk; a tree at
    the largest budget at one row), each timed as the loop runs it. The rows are copies of one prefilled row."""
    device, ctx, W = target.device, COST_CONTEXT, max_width
    prompt = torch.randint(target.vocab_size, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    sampling = Sampling(0.0, 0, 1.0, torch.Generator(device=device))
    rows = _prefill(target, drafter, [prompt], ctx + W + 2, 1, W, False, sampling)
    seconds, drafts, tree = {}, {b: 0.0 for b in COST_BATCHES}, 0.0
    for b in sorted(COST_BATCHES, reverse=True):  # each b's rows a prefix of the last's (select copies)
        rows.select(torch.zeros(b, dtype=torch.long, device=device) if b > rows.pos.shape[0] else
                    torch.arange(b, device=device))
        seconds[b] = time_verify(target, rows.cache, b, cost_widths(b, W), ctx, W, reps)
        if drafter is not None:
            drafts[b], tree_b = time_draft(target, drafter, rows, ctx, sampling, reps, tree=b == 1)
            tree = tree_b if b == 1 else tree
    one = seconds[1][1]
    verify = {b: {w: t / one for w, t in by_width.items()} for b, by_width in seconds.items()}
    # the tree's draft is the chain's block plus its selection: timed at one row, at b rows in the chain's proportion
    trees = {b: tree / one * (drafts[b] / drafts[1] if drafts[1] else 1.0) for b in COST_BATCHES}
    return grid_costs(verify, {b: t / one for b, t in drafts.items()}, trees, W, cost_key(target, drafter), one * 1000)


def time_verify(target, cache, b, widths, ctx, max_width, reps):
    """{w: seconds} of a verify forward of b rows by w tokens at positions ctx.. (the fastest of reps rounds over
    every width, so that a busy moment slows all widths alike)."""
    device = target.device
    calls = {w: functools.partial(target.forward, torch.zeros(b, w, dtype=torch.long, device=device),
                                  (ctx + torch.arange(w, device=device))[None].expand(b, w), cache, ctx + max_width)
             for w in widths}
    seconds = {w: float("inf") for w in widths}
    for i in range(reps):
        for w in widths:
            seconds[w] = min(seconds[w], _best_time(calls[w], 1, warm=i == 0))
    return seconds


def time_draft(target, drafter, rows, ctx, sampling, reps, tree=True):
    """Seconds of one draft of rows' batch: (the chain's walk and confidences, a tree at the largest budget, or 0
    unless tree); DSpark's walk and confidences for both (it has no tree)."""
    B, sel, anchor, p = drafter.config.block_size, getattr(drafter, "candidate_selector", None), rows.anchor, rows.pos

    def chain():
        h, U = draft(drafter, target, rows.ctx, anchor, p, ctx, B)
        drafts, *_ = select_path(sel, h, U, anchor, "dflash2", 0.0, None, with_candidates=False)
        draft_confidence(sel, h, U, anchor, drafts, "dflash2")

    def tree_draft():
        h, U = draft(drafter, target, rows.ctx, anchor, p, ctx, B)
        select_tree(sel, h, U, anchor, TREE_BUDGETS[-1], "selector", torch.full_like(p, B - 1))

    if hasattr(drafter, "markov_head"):
        t = _best_time(lambda: draft_dspark(drafter, target, rows.ctx, anchor, p, ctx, B, sampling), reps)
        return t, t
    return _best_time(chain, reps), _best_time(tree_draft, reps) if tree else 0.0
