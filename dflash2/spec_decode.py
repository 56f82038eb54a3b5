"""DFlash 2 speculative decoding: the draft -> cut -> verify loop (the target is target.Target; the drafters
answer proposers.py's interface, the policy policy.py's).

Everything here stays on the device: randomness is drawn as uniform tensors (`torch.rand(...,
generator=g)`) and handed to verify.py's math, so no step needs a host sync and a run can be replayed.
"""

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .kernels import check_attn_backend
from .model import DraftContext
from .policy import ConfidenceThreshold, Policy, machine_costs
from .proposers import NoDrafts, make_proposer, proposer_kind
from .results import Requests
from .settings import DecodeSettings, InputError, SettingError
from .target import SlotCache, install_output_hooks, text_config
from .verify import (Sampling, process_logits, tree_ancestors, verify_greedy, verify_sampled, verify_tree_greedy,
                     verify_tree_sampled)

# --- the draft -> cut -> verify loop ---


def block_sizes(end, pos, block_size):
    """Each row's block this step, min(B, end - pos): its anchor plus at most the tokens it may still
    make (the authors' verify_size); end [b] is the position after a row's last allowed token."""
    return (end - pos).clamp(1, block_size)


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

    @classmethod
    def gathered(cls, parts, groups):
        """The Rows of a batch prefilled a group of rows at a time: rows groups[i] are parts[i]'s."""
        if len(parts) == 1 and groups[0] == sorted(groups[0]):
            return parts[0]
        order = torch.tensor([r for g in groups for r in g], device=parts[0].anchor.device)
        fields = [torch.empty_like(torch.cat([getattr(p, n) for p in parts])) for n in ("anchor", "pos", "end", "live")]
        for f, n in zip(fields, ("anchor", "pos", "end", "live")):
            f[order] = torch.cat([getattr(p, n) for p in parts])
        ctx = None if parts[0].ctx is None else DraftContext.gathered([p.ctx for p in parts], groups)
        return cls(SlotCache.gathered([p.cache for p in parts], groups), ctx, *fields)

    def admit(self, slots, new):
        """Rows `slots` take over the rows of `new` (freshly prefilled requests)."""
        self.cache.copy_rows(slots, new.cache)
        if self.ctx is not None:
            self.ctx.copy_rows(slots, new.ctx)
        for name in ("anchor", "pos", "end", "live"):
            getattr(self, name)[slots] = getattr(new, name)


VIEW_BUCKET = 128  # static mode: attention views grow in steps of this many slots
PREFILL_TOKENS = 4096  # a prefill forward's rows times its longest prompt, at most (one row at least): a batch is
# prefilled a group of rows at a time, longest prompts first, each group padded to its own longest. The bench's 32
# math500 prompts (59 to 449 tokens, 4,399 in all) padded to one width are 14,368 tokens; in groups, 7,514. The loop
# yields between groups (decode_steps), so a prefill of many long prompts is not one indivisible turn.


def prefill_groups(lens, static=False):
    """The rows of a batch (prompt lengths `lens`) in prefill groups: longest first, a group growing while its rows
    times its longest prompt stay within PREFILL_TOKENS. A static (compiled) run prefills the batch at once: its
    shapes are bucketed by the batch's longest prompt."""
    if static:
        return [list(range(len(lens)))]
    groups = []
    for r in sorted(range(len(lens)), key=lambda r: -lens[r]):
        if groups and (len(groups[-1]) + 1) * lens[groups[-1][0]] <= PREFILL_TOKENS:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _prefill(target, proposer, prompts, max_len, max_new_tokens, W, static, sampling, u=None):
    """One target forward over right-padded prompts into a new cache (pad slots lie in the future of
    every real query); the proposer's context gets their features. Returns the new Rows, anchored at
    each prompt's first generated token (drawn with uniforms u [b] at T > 0, if given)."""
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
    if static:  # one compiled prefill per width bucket: every position's logits (keeping a few is a shape per few)
        logits, feats = target.forward(ids, positions, cache, width)
        last = logits.gather(1, (lens - 1).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])).squeeze(1)
    else:  # each prompt's last logits only
        logits, feats = target.forward(ids, positions, cache, width, last=lens - 1)
        last = logits.squeeze(1)
    ctx = proposer.context(len(prompts), max_len, device, defer=not static)
    if ctx is not None:
        ctx.write(feats, positions)
    live = torch.ones(len(prompts), dtype=torch.bool, device=device)
    return Rows(cache, ctx, sampling.first_tokens(last, u), lens, lens + max_new_tokens, live)


class Verified(NamedTuple):
    """What a step verified: num_accepted [b], out [b, W] (the accepted drafts, the target's token, then -1), each
    row's verified block widths [b] (anchor included: what the cut kept, else W), the forward's width W, and the
    step's tensors for a trace (None unless traced)."""

    num_accepted: torch.Tensor
    out: torch.Tensor
    widths: torch.Tensor
    width: int
    record: dict | None


def decode_step(target, proposer, rows, sampling, view_len, ctx_len, cut=None, traced=False):
    """One step for every row (docs/SPEC.md §3-5): draft a block, cut it, verify it with one target forward, write
    the verified features into the drafter's context, advance anchors and positions. A row's block shrinks to
    min(W, tokens it may still make + 1) (block_sizes). cut(confidence [b, W-1], drafts each row may verify [b])
    -> (drafts kept per row [b], the forward's width W): the policy, reading the confidences only (a stopping
    rule, SPEC §10)."""
    W = proposer.width
    sizes = block_sizes(rows.end, rows.pos, W)
    d = proposer.draft(rows.ctx, rows.anchor, rows.pos, sizes, ctx_len, sampling, traced)
    widths = torch.full_like(sizes, W)
    if cut is not None:
        keep, W = cut(d.confidence, sizes - 1)
        d, sizes, widths = d.first(W - 1), torch.minimum(sizes, keep + 1), keep + 1
    block_pos = rows.pos[:, None] + torch.arange(W, device=rows.pos.device)
    logits, feats = target.forward(torch.cat([rows.anchor[:, None], d.tokens], 1), block_pos, rows.cache, view_len)
    num_accepted, out, u_accept, u_emit = verify_chain(d, logits, sizes - 1, sampling)
    record = None if not traced else dict(
        anchor_pos=rows.pos, anchor=rows.anchor, sizes=sizes, drafts=d.tokens, q=d.q, candidates=d.candidates,
        target_argmax=logits.argmax(-1), u_accept=u_accept, u_emit=u_emit, num_accepted=num_accepted, out=out)
    if rows.ctx is not None:
        rows.ctx.write(feats, block_pos)
    rows.advance(num_accepted, out)
    return Verified(num_accepted, out, widths, W, record)


def verify_chain(d, logits, num_drafts, sampling):
    """verify_greedy, or at T > 0 verify_sampled with fresh uniforms. Returns num_accepted, out and the uniforms."""
    if sampling.temperature == 0:
        return *verify_greedy(d.tokens, logits, num_drafts), None, None
    b, n = d.tokens.shape
    u_accept = torch.rand(b, n, generator=sampling.generator, device=logits.device)
    u_emit = torch.rand(b, generator=sampling.generator, device=logits.device)
    p = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return *verify_sampled(d.tokens, d.q.to(p.dtype), p, u_accept, u_emit, num_drafts), u_accept, u_emit


def decode_tree_step(target, proposer, rows, sampling, budget, scores, view_len, ctx_len, cut=None, traced=False):
    """decode_step with a tree: draft a block, build a tree of `budget` nodes over its candidates, verify
    every node in one target forward (a node sees the context, the anchor and its ancestors, at position
    anchor + depth), descend while the target's token is a child (docs/SPEC.md §9), then move the
    accepted path's K/V to slot = position and write its features into the drafter's context.
    cut(tree) -> N <= budget (the policy): the step verifies the tree's N best nodes instead.

    The tree's K/V go to scratch slots pos .. pos + budget, past every committed slot of the row.
    """
    b, device = rows.anchor.shape[0], rows.anchor.device
    sizes = block_sizes(rows.end, rows.pos, proposer.width)
    grow = proposer.tree(rows.ctx, rows.anchor, rows.pos, sizes, ctx_len, scores)
    tree = grow(budget)
    if cut is not None and (n := cut(tree)) < budget:  # a tree is fixed before the target's draws: any cut is lossless
        budget, tree = n, grow(n)
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
    commit_path(rows, feats, path, proposer.width)
    rows.advance(num_accepted, out)
    return Verified(num_accepted, out, torch.full_like(sizes, budget + 1), budget + 1, record)


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
    """Every input check of generate, once per call. Returns the resolved settings, the proposer, the width W of a
    verify forward (the block, or for a tree at least budget + 1), the longest prompt's length and the target's
    context length."""
    cfg = text_config(target.model.config)
    block = getattr(getattr(drafter, "config", None), "block_size", None)
    s = settings.resolved(target.device.type, block)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("every prompt must contain at least one token")
    kind, tree = proposer_kind(s.method, propose), s.tree_budget is not None
    if kind.drafter_type is not None and drafter is None:
        raise SettingError("method", f"{s.method!r} needs a drafter")
    if kind.drafter_type is not None and not isinstance(drafter, kind.drafter_type):
        raise SettingError("method", f"{s.method!r} needs {kind.needs}; this one is a {type(drafter).__name__}")
    if tree and not kind.trees:
        raise SettingError("method", f"{s.method!r} needs a drafter whose candidates make a tree (and no propose)")
    if tree and any("sparse" in t for t in getattr(cfg, "layer_types", None) or ()):
        # MiniMax-M3's MSA indexer pools keys into blocks by slot and masks them by slot <= position, so
        # a tree's nodes, which sit in scratch slots, would not pick the blocks their path alone would.
        raise InputError(f"method {s.method!r} needs a target with dense attention: block-sparse (MSA) layers "
                         "choose key blocks by cache slot, which tree verification moves (docs/SPEC_NOTES.md)")
    proposer = make_proposer(kind, target, drafter, s.block_size or 1, propose)
    if s.dspark_threshold > 0 and not proposer.confidence_head:
        raise SettingError("dspark_threshold", "needs a drafter with a confidence head (DeepSpec's cut reads it); "
                                               "this one has none")
    limit = getattr(cfg, "max_position_embeddings", None)
    W, longest = check_prompt_length(prompts, s, kind, limit)
    return s, proposer, W, longest, limit


def check_prompt_length(prompts, s, kind, limit):
    """(W, longest prompt): the verify forward's width W under the resolved settings s and proposer class kind,
    checked to fit the target's context `limit` (None: no limit known). The CLI calls it from the target's
    config.json before the weights load; generate calls it through check_generate_args."""
    W = kind.width_of(s.block_size or 1)
    W = max(W, s.tree_budget + 1) if s.tree_budget is not None else W
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + s.max_new_tokens + W + 1 > limit:
        raise InputError(f"prompt too long: {longest} prompt tokens + {s.max_new_tokens} new tokens + block {W} "
                         f"exceed the target's context of {limit} positions")
    return W, longest


def make_policy(s, target, drafter, proposer):
    """The run's policy object: None for a fixed block, DeepSpec's confidence threshold, or the auto policy
    (this machine's costs, measured once: policy.machine_costs)."""
    if s.dspark_threshold > 0:
        return ConfidenceThreshold(s.dspark_threshold)
    if s.policy == "auto" and proposer.drafter_type is not None:  # a drafter's costs (not a test's proposals)
        tree = s.tree_budget is not None
        return Policy(machine_costs(target, drafter), s.tree_budget if tree else s.block_size, tree=tree)
    return None


def generate(target, drafter, prompts, settings=None, *, on_emit=None, propose=None, trace=None, policy_override=None,
             **fields):
    """Speculative decoding of a batch of prompts (lists of token ids) under one DecodeSettings (keyword
    fields build or amend it: generate(..., max_new_tokens=64)); one decode step per iteration.

    `method="ar"` runs the same loop with no drafts. `max_batch` caps the requests in flight: the
    rest wait in order and are prefilled into the rows of finished requests (continuous batching; a finished
    row may stay empty for a few steps so that rows about to finish are refilled in the same forward,
    results.Requests.hold). `propose(anchor, pos, requests) -> (drafts, q)` replaces the drafter (tests force
    acceptance patterns with it). `on_emit(request, tokens)` streams output. `trace(record)` receives
    every step's tensors (tracing adds host copies). `static=True` limits shapes to a few buckets (cache
    views rounded up to VIEW_BUCKET slots) for compiled cores. `method="dflash2-tree"` verifies a tree
    of `tree_budget` nodes with decode_tree_step. The default `policy="auto"` lets a policy.Policy choose each
    step's width from this machine's costs (one width for the batch); `policy="fixed"` verifies every row's whole
    block (or tree); `policy_override=` replaces the policy object the settings would build (tests, replays).
    Returns one Result per prompt.
    """
    book = None
    for book in decode_steps(target, drafter, prompts, settings, on_emit=on_emit, propose=propose, trace=trace,
                             policy_override=policy_override, **fields):
        pass
    return book.results


@torch.inference_mode()
def decode_steps(target, drafter, prompts, settings=None, *, on_emit=None, propose=None, trace=None,
                 policy_override=None, **fields):
    """generate's loop, one step per next(): yields its Requests book after the first prefill and after every
    step (bench.py's --lockstep lets several decodes take turns step by step)."""
    settings = DecodeSettings(**fields) if settings is None else dataclasses.replace(settings, **fields)
    forced = None if propose is None else lambda anchor, pos: propose(anchor, pos, torch.tensor(book.request))
    s, proposer, W, longest, limit = check_generate_args(target, drafter, prompts, settings, forced)
    device = target.device
    max_len = longest + s.max_new_tokens + W + 1
    if s.static:  # round up so later requests reuse the same compiled shapes
        max_len = min(-(-max_len // 256) * 256, limit or max_len)
    sampling = Sampling(s.temperature, s.top_k, s.top_p, torch.Generator(device=device).manual_seed(s.seed),
                        0.0 if s.walk == "greedy" else s.temperature)
    book = Requests(prompts, s, on_emit)
    traced = trace is not None
    policy = policy_override if policy_override is not None else make_policy(s, target, drafter, proposer)
    tree = s.tree_budget is not None
    cut = None if policy is None else policy.cut_tree if tree else policy.cut_chain
    if tree:
        step = functools.partial(decode_tree_step, target, proposer, sampling=sampling, budget=s.tree_budget,
                                 scores=s.tree_scores, cut=cut, traced=traced)
    else:
        step = functools.partial(decode_step, target, proposer, sampling=sampling, cut=cut, traced=traced)
    plain = functools.partial(decode_step, target, NoDrafts(target.vocab_size), sampling=sampling, traced=traced)

    def admit(rows, free):
        """Prefill the next waiting requests into rows `free` (rows past the end are appended), a group of rows
        per forward (prefill_groups), yielding the book between groups."""
        reqs = book.take(len(free))
        batch = [prompts[r] for r in reqs]
        groups, parts = prefill_groups([len(p) for p in batch], s.static), []
        u = sampling.first_uniforms(len(batch), device)  # in row order, whatever the groups
        for g in groups:
            if parts:
                yield book
            parts.append(_prefill(target, proposer, [batch[i] for i in g], max_len, s.max_new_tokens, W, s.static,
                                  sampling, None if u is None else u[torch.tensor(g, device=device)]))
        new = Rows.gathered(parts, groups)
        if rows is None:
            rows = new
        else:
            rows.admit(torch.tensor(free, device=device), new)
        book.admit(free, reqs, new.anchor.tolist())  # host sync of the prefill
        rows.live = torch.tensor(book.alive, device=device)
        return rows

    rows = yield from admit(None, list(range(min(len(prompts), s.max_batch or len(prompts)))))
    yield book
    while True:
        free = book.free_rows()
        if free:  # an admitted request may already be done (stop token, or max_new_tokens = 1): loop again
            rows = yield from admit(rows, free)
            continue
        if not any(book.alive):
            break
        if not s.static:  # static shapes keep finished rows, frozen in place
            keep = book.compact()
            if keep is not None:
                rows.select(torch.tensor(keep, device=device))
        drafted = policy is None or policy.begin(book.request, book.steps(), book.alive)
        ctx_len = int(book.pos.max())  # every slot before the furthest anchor
        view_len = ctx_len + (W if drafted else 1)  # a plain step attends over no draft slots
        if s.static:  # a handful of shapes, each compiled once; the extra slots are masked out
            view_len = ctx_len = min(-(-(ctx_len + W) // VIEW_BUCKET) * VIEW_BUCKET, max_len)
        v = (step if drafted else plain)(rows=rows, view_len=view_len, ctx_len=ctx_len)
        host = torch.cat([v.widths[:, None], v.num_accepted[:, None], v.out], 1).cpu()  # the one host sync per step
        widths = host[:, 0].tolist()
        if traced:
            trace(dict(v.record, requests=list(book.request), steps=book.steps(),
                       widths=None if policy is None else widths))
        if policy is not None:
            policy.end(book.alive, host[:, 1].tolist(), drafted, v.width)
        if book.commit(host[:, 1:], widths):
            rows.live = torch.tensor(book.alive, device=device)
        yield book
