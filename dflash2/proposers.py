"""The proposers: every way of drafting a block answers one interface, so the loop (spec_decode) knows no method
by name. A proposer has

- `width`: the verify forward of a full block, anchor included (1: no drafts);
- `context(batch, max_len, device, defer)`: the drafter's context cache (model.DraftContext), or None;
- `draft(ctx, anchor, pos, sizes, ctx_len, sampling, traced) -> Draft`: drafts d_1..d_{width-1} for each row,
  the law q each was drawn from, and the confidences c_k a cut may read.

DFlash 2's walk and the tree also share `forward` (the drafter's block pass: h, U). A new drafter is a new class.
"""
import functools
from dataclasses import dataclass, field

import torch

from .dspark import DSparkDrafter, dspark_logits, dspark_walk, walk_prev_ids
from .model import DFlash2Drafter, DraftContext, dflash1_walk
from .verify import build_tree, marginal_log_weights, selector_log_weights


@dataclass
class Draft:
    """One step's proposal: tokens [b, n] (d_1..d_n), q [b, n, V] (the law each was drawn from, one-hot for a
    greedy walk), and the confidence c_k [b, n]: the probability slot k's draft is accepted, as its law sees it.
    c_k reads d_1..d_{k-1} and never d_k or later (SPEC §10), so a cut on it is a stopping rule; it is computed
    when a cut first reads it (a fixed block never pays for it). candidates: (ids, logits) [b, n, K] for a trace."""

    tokens: torch.Tensor
    q: torch.Tensor
    confidence_of: callable = field(repr=False)  # () -> [b, n]
    candidates: tuple | None = None

    @functools.cached_property
    def confidence(self):
        return self.confidence_of()

    def first(self, n):
        """The proposal cut to its first n drafts."""
        cands = None if self.candidates is None else tuple(c[:, :n] for c in self.candidates)
        return Draft(self.tokens[:, :n], self.q[:, :n], lambda: self.confidence[:, :n], cands)


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


def select_path(selector, h, U, anchor, temperature, generator):
    """DFlash 2's walk: top-K candidates C_t, edge scores S_t(a, b), left to right d_t = argmax_b S_t(d_{t-1}, b)
    or d_t ~ softmax(S_t(d_{t-1}, .) / T) over C_t (SPEC §4). Returns drafts [b, T-1], q [b, T-1, V] and the
    candidates (ids and draft logits [b, T-1, K])."""
    cand_ids, cand_logits = selector.candidates(U, selector.top_k)
    drafts, q = selector.walk(selector.edge_scores(h, U, cand_ids, anchor), cand_ids, temperature, generator)
    return drafts, q, cand_ids, cand_logits


def selector_confidence(selector, h, U, anchor, drafts, cand_ids=None):
    """c_t [b, n]: the largest probability of the selector's law at slot t over the whole vocabulary at T = 1
    (verify.selector_log_weights), given the draft before it, d_{t-1} (the anchor for t = 1)."""
    if cand_ids is None:
        cand_ids, _ = selector.candidates(U, selector.top_k)
    logw = selector_log_weights(selector.edge_scores(h, U, cand_ids, anchor), U, cand_ids)
    b, n, K = cand_ids.shape
    prev = (cand_ids[:, :-1] == drafts[:, :-1, None]).int().argmax(-1)  # d_{t-1}'s index in C_{t-1}
    prev = torch.cat([prev.new_zeros(b, 1), prev], 1)
    return logw.gather(2, prev[:, :, None, None].expand(b, n, 1, K)).squeeze(2).amax(-1).exp()


def select_tree(selector, h, U, anchor, budget, scores, max_depth):
    """The `budget` best nodes of the block's candidate tree (SPEC §9), by path scores from the selector's
    conditional law (S_t(a, .) over C_t, normalised over the whole vocabulary with U_t outside C_t:
    verify.selector_log_weights) or, as DDTree, from each slot's marginal log softmax(U_t) over its top-`budget`
    tokens. max_depth [b]: each row's drafts."""
    if scores == "selector":
        cand_ids, _ = selector.candidates(U, selector.top_k)
        logw = selector_log_weights(selector.edge_scores(h, U, cand_ids, anchor), U, cand_ids)
    else:
        cand_ids, logw = marginal_log_weights(U, budget)
    return build_tree(logw, cand_ids, budget, max_depth)


class NoDrafts:
    """Plain decoding (`ar`, and the policy's plain steps): the anchor alone, no drafts."""

    drafter_type, needs, trees, confidence_head, width = None, "", False, False, 1

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    @staticmethod
    def width_of(block_size):
        return 1

    def context(self, batch, max_len, device, defer):
        return None

    def draft(self, ctx, anchor, pos, sizes, ctx_len, sampling, traced=False):
        empty = anchor.new_zeros(anchor.shape[0], 0)
        q = torch.zeros(anchor.shape[0], 0, self.vocab_size, device=anchor.device)
        return Draft(empty, q, lambda: q.sum(-1))


class Forced:
    """A test's proposals: propose(anchor, pos) -> (drafts [b, width-1], q) replaces the drafter. Its confidence is
    the largest probability of each slot's q (the law the draft was drawn from, not the draft)."""

    drafter_type, needs, trees, confidence_head = None, "", False, False

    def __init__(self, propose, block_size):
        self.propose, self.width = propose, self.width_of(block_size)

    @staticmethod
    def width_of(block_size):
        """The verify forward's width over a block of block_size (check_prompt_length reads it before loading)."""
        return block_size

    def context(self, batch, max_len, device, defer):
        return None

    def draft(self, ctx, anchor, pos, sizes, ctx_len, sampling, traced=False):
        drafts, q = self.propose(anchor, pos)
        return Draft(drafts, q, lambda: q.amax(-1))


class DFlash2Walk:
    """DFlash 2 (SPEC §3-4): the drafter's block pass, then the selector's walk over its top-K candidates; its
    confidence is the selector's law (selector_confidence). A tree of candidates can be verified instead (tree)."""

    drafter_type, needs, trees, confidence_head = DFlash2Drafter, "a DFlash 2 drafter", True, False

    def __init__(self, target, drafter, block_size):
        self.target, self.drafter, self.width = target, drafter, self.width_of(block_size)
        self.selector = drafter.candidate_selector

    width_of = staticmethod(Forced.width_of)

    def context(self, batch, max_len, device, defer):
        return DraftContext(self.drafter, batch, max_len, device, defer)

    def forward(self, ctx, anchor, pos, sizes, ctx_len):
        return draft(self.drafter, self.target, ctx, anchor, pos, ctx_len, self.width, sizes)

    def draft(self, ctx, anchor, pos, sizes, ctx_len, sampling, traced=False):
        h, U = self.forward(ctx, anchor, pos, sizes, ctx_len)
        drafts, q, cand_ids, cand_logits = select_path(self.selector, h, U, anchor, sampling.walk_temperature,
                                                       sampling.generator)
        return Draft(drafts, q, lambda: selector_confidence(self.selector, h, U, anchor, drafts, cand_ids),
                     (cand_ids, cand_logits))

    def tree(self, ctx, anchor, pos, sizes, ctx_len, scores):
        """grow(budget) -> the tree of the block's `budget` best nodes (select_tree), over one drafter pass."""
        h, U = self.forward(ctx, anchor, pos, sizes, ctx_len)
        return lambda budget: select_tree(self.selector, h, U, anchor, budget, scores, sizes - 1)


class DFlash1Walk(DFlash2Walk):
    """DFlash (v1), the same drafter with no selector: d_t = argmax U_t, or d_t ~ softmax(U_t / T) per slot; its
    confidence is the largest probability of softmax U_t."""

    trees = False

    def draft(self, ctx, anchor, pos, sizes, ctx_len, sampling, traced=False):
        h, U = self.forward(ctx, anchor, pos, sizes, ctx_len)
        drafts, q = dflash1_walk(U, sampling.walk_temperature, sampling.generator)
        cands = self.selector.candidates(U, self.selector.top_k) if traced else None  # only a trace records them
        return Draft(drafts, q, lambda: U.float().softmax(-1).amax(-1), cands)


class DSparkWalk:
    """DSpark (docs/DSPARK.md): the same block pass over [anchor, MASK x (B-1)], but every slot proposes (slot k
    drafts the token at pos + k + 1) by the Markov walk (dspark.dspark_walk), so a block of B slots verifies B
    drafts. The block is never shrunk (DeepSpec's loop); verification is cut instead. The confidence is sigma of
    the confidence head (it reads h_k and the previous draft), or without a head the largest probability of the
    walk's law at T = 1 (a function of the previous draft too)."""

    drafter_type, needs, trees = DSparkDrafter, "a DSpark drafter (DeepSpec's layout, docs/DSPARK.md)", False

    def __init__(self, target, drafter, block_size):
        self.target, self.drafter, self.block_size, self.width = target, drafter, block_size, self.width_of(block_size)
        self.confidence_head = drafter.confidence_head is not None  # DeepSpec's threshold cut reads it

    @staticmethod
    def width_of(block_size):
        return block_size + 1  # every slot drafts: the anchor and B drafts

    def context(self, batch, max_len, device, defer):
        return DraftContext(self.drafter, batch, max_len, device, defer)

    def draft(self, ctx, anchor, pos, sizes, ctx_len, sampling, traced=False):
        drafter, B = self.drafter, self.block_size
        block_pos = pos[:, None] + torch.arange(B, device=pos.device)
        dtype = next(drafter.parameters()).dtype
        head = drafter.lm_head if drafter.own_embeddings else self.target.lm_head_as(dtype)
        embed = drafter.embed_tokens if drafter.own_embeddings else self.target.embed_tokens
        slots = torch.arange(ctx_len, device=pos.device)
        h = drafter(drafter.embed_block(anchor, embed, B).to(dtype), block_pos, ctx.view(ctx_len),
                    slots[None, :] < pos[:, None])
        drafts, q = dspark_walk(drafter, h, anchor, head, sampling.walk_temperature, sampling.generator)

        def confidence():
            prev = walk_prev_ids(anchor, drafts)
            if drafter.confidence_head is None:
                return dspark_logits(drafter, h, prev, head).softmax(-1).amax(-1)
            return drafter.confidence_logits(h, prev).sigmoid()

        return Draft(drafts, q, confidence)


PROPOSERS = {"dflash2": DFlash2Walk, "dflash2-tree": DFlash2Walk, "dflash": DFlash1Walk, "dspark": DSparkWalk,
          "ar": NoDrafts}  # each method's proposer (settings.METHODS)


def proposer_kind(method, propose=None):
    """The class that proposes for a method (a test's propose replaces a drafter)."""
    kind = PROPOSERS[method]
    return Forced if propose is not None and kind is not NoDrafts else kind


def make_proposer(kind, target, drafter, block_size, propose=None):
    if kind is NoDrafts:
        return NoDrafts(target.vocab_size)
    return Forced(propose, block_size) if kind is Forced else kind(target, drafter, block_size)


def drafter_proposer(target, drafter):
    """The proposer a drafter is measured with (policy.measure_costs): its own method over its full block."""
    kind = DSparkWalk if isinstance(drafter, DSparkDrafter) else DFlash2Walk
    return kind(target, drafter, drafter.config.block_size)
