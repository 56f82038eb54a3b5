"""The sampling and verification math of speculative decoding (docs/SPEC.md §5), torch only.

This module imports nothing but torch, so other implementations can use it as an oracle without
transformers. Randomness comes in as uniform tensors drawn by the caller, so nothing here needs a
host sync and every result can be replayed.
"""
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

# --- the target distribution P ---


def process_logits(logits, temperature, top_k=0, top_p=1.0):
    """Target distribution P over the last dim, as plain sampling builds it.

    z = logits / temperature; z = -inf outside the top_k largest (ties with the k-th kept);
    z = -inf outside the nucleus of softmax(z) (see nucleus_cutoff; always at least one token);
    P = softmax(z). The settings are checked once per run (settings.check_sampling_params), not here.
    """
    if temperature == 0:
        raise ValueError("temperature must be > 0 in process_logits; greedy decoding uses verify_greedy")
    # bf16/fp16 cumulative sums are too coarse for the nucleus boundary.
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if 0 < top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1:
        probs = z.softmax(-1)
        z = z.masked_fill(probs < nucleus_cutoff(probs, top_p), float("-inf"))
    return z.softmax(-1)


def nucleus_cutoff_sorted(probs, top_p):
    """The smallest probability kept in the nucleus, per row, by a full sort: probs [..., V] -> [..., 1].

    Sort the row descending; take the longest prefix in which the mass before each token is < top_p
    (the first token always qualifies); then add every token tied with the last one taken. So a
    token is kept iff probs >= cutoff, whatever order a sort gives equal values.
    """
    vals = probs.sort(-1, descending=True).values
    inside = (vals.cumsum(-1) - vals < top_p).cumprod(-1)  # mass before each token < top_p, as a prefix
    return vals.gather(-1, inside.sum(-1, keepdim=True) - 1)


# On CPU a partial top-k is tens of times faster than a full sort of the vocabulary; the nucleus
# of most rows fits in the first tier. Elsewhere a full sort is cheap and needs no host sync.
NUCLEUS_TIERS = (256, 4096)


def nucleus_cutoff(probs, top_p, tiers=None):
    """nucleus_cutoff_sorted, fast on CPU: the sorted prefix comes from topk over growing tiers (a row
    moves to the next tier only when its nucleus may not end inside the current one). The values,
    their order and so the cutoff are exactly those of the full sort (tests hold them equal)."""
    V = probs.shape[-1]
    flat = probs.reshape(-1, V)
    if tiers is None:
        tiers = NUCLEUS_TIERS if probs.device.type == "cpu" else ()
    cutoff = todo = None  # todo: the rows still open (None: all of them, on the first pass)
    for k in [k for k in tiers if k < V]:
        rows = flat if todo is None else flat[todo]
        vals = rows.topk(k, -1).values
        inside = (vals.cumsum(-1) - vals < top_p).cumprod(-1)
        n_in = inside.sum(-1, keepdim=True)
        found = vals.gather(-1, n_in - 1)
        if todo is None:
            cutoff = found
        else:
            cutoff[todo] = found  # a row's later tier overrides its undecided first answer
        open_ = (n_in == k).squeeze(-1)  # every one of the k was inside: the nucleus may go on
        if not bool(open_.any()):  # host sync; only on CPU (tiers are empty elsewhere)
            return cutoff.view(*probs.shape[:-1], 1)
        todo = open_.nonzero().squeeze(-1) if todo is None else todo[open_]
    if todo is None:
        cutoff = nucleus_cutoff_sorted(flat, top_p)
    else:
        cutoff[todo] = nucleus_cutoff_sorted(flat[todo], top_p)
    return cutoff.view(*probs.shape[:-1], 1)


# --- drawing tokens ---


def sample_from(probs, u):
    """Inverse-CDF draw: the token t with cdf(t-1) <= u * cdf(V-1) < cdf(t); probs [..., V] >= 0, unnormalised ok, u [...] in [0, 1)."""
    cdf = probs.cumsum(-1)
    x = u.to(cdf.dtype).unsqueeze(-1) * cdf[..., -1:]
    token = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    # u * total can round up to total; never step past the last token that has mass.
    positions = torch.arange(probs.shape[-1], device=probs.device)
    last_with_mass = torch.where(probs > 0, positions, 0).amax(-1)
    return torch.minimum(token, last_with_mass)


def sample_index(probs, generator=None):
    """Index ~ probs along the last axis: an inverse-CDF draw with one uniform per row, no host sync.
    (An exponential race, argmax(p / E), needs one Exp(1) draw per vocabulary entry: on CPU that
    cost more than the drafter for DFlash v1's full-vocabulary proposals.)"""
    return sample_from(probs, torch.rand(probs.shape[:-1], generator=generator, device=probs.device))


# --- chain verification ---


@dataclass
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else drawn from P (process_logits), every draw from
    `generator`. walk_temperature: the drafter's walk's (temperature, or 0 for a greedy walk, q one-hot)."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator
    walk_temperature: float = None

    def __post_init__(self):
        if self.walk_temperature is None:
            self.walk_temperature = self.temperature

    def first_tokens(self, last, u=None):
        """The token after each prompt, from the prefill's last logits [b, V]; u [b]: its uniforms, if drawn
        before (first_uniforms)."""
        if self.temperature == 0:
            return last.argmax(-1)
        if u is None:
            u = torch.rand(last.shape[0], generator=self.generator, device=last.device)
        return sample_from(process_logits(last, self.temperature, self.top_k, self.top_p), u)

    def first_uniforms(self, b, device):
        """The uniforms first_tokens would draw for b prompts (None when greedy): a batch prefilled a group of rows
        at a time draws them once, in row order, so the groups never change a sampled output."""
        return None if self.temperature == 0 else torch.rand(b, generator=self.generator, device=device)


def acceptance_probability(p_draft, q_draft):
    """alpha = min(1, P_{i-1}(d_i) / q_i(d_i)), elementwise; q = 0 gives 1 if P > 0 else 0."""
    # x/0 = inf clamps to 1; 0/0 = nan becomes 0 (a draft neither model allows is rejected).
    return (p_draft / q_draft).nan_to_num(nan=0.0).clamp(max=1.0)


def residual_distribution(p, q):
    """normalize(max(P - q, 0)) over the last dim, and P itself where that has no mass (P == q). verify_sampled never
    rejects there (it accepts when u < min(1, P/q) = 1); a rule that can (SGLang's case (i) does) draws from P."""
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass, p)


def verify_greedy(draft_ids, target_logits, num_drafts=None):
    """Greedy chain verification (SPEC §5).

    Accept the longest prefix with d_i == argmax P_{i-1}; the bonus is argmax P_a at the first
    mismatch a (a = n when all match). draft_ids [b, n], target_logits [b, n+1, V] (row i gives P_i;
    temperature, top-k and top-p never move the argmax). num_drafts [b] (default n): a row verifies
    only its first num_drafts drafts (a block cut short at the end of its budget). Returns
    num_accepted [b] and out_tokens [b, n+1]: the a accepted drafts, the bonus at index a, then -1.
    """
    n = draft_ids.shape[1]
    best = target_logits.argmax(-1)
    match = draft_ids == best[:, :n]
    if num_drafts is not None:
        match = match & (torch.arange(n, device=draft_ids.device) < num_drafts[:, None])
    num_accepted = match.long().cumprod(-1).sum(-1)
    # Accepted drafts equal the target argmax, so the emitted tokens are argmax P_0 .. argmax P_a.
    positions = torch.arange(n + 1, device=draft_ids.device)
    out_tokens = torch.where(positions <= num_accepted[:, None], best, -1)
    return num_accepted, out_tokens


def verify_sampled(draft_ids, q, p, u_accept, u_emit, num_drafts=None):
    """Sampled chain verification (SPEC §5), lossless for any proposal q.

    For i = 1..n accept d_i iff u_accept[:, i-1] < min(1, P_{i-1}(d_i) / q_i(d_i)); at the first
    rejection a emit a draw from normalize(max(P_a - q_{a+1}, 0)) and stop; if all n are accepted
    emit a bonus draw from P_n. A greedy walk is one-hot q on the same path.
    draft_ids [b, n]; q [b, n, V] (row i-1 is q_i); p [b, n+1, V] (row i is P_i);
    u_accept [b, n] and u_emit [b] uniforms in [0, 1). num_drafts [b] (default n): a row verifies
    only its first num_drafts drafts, as if n were num_drafts. Returns num_accepted [b] and
    out_tokens [b, n+1]: the a accepted drafts, the emitted token at index a, then -1.
    """
    b, n = draft_ids.shape
    if num_drafts is not None:  # slots past a row's drafts: never accepted, and q = 0 makes the bonus P itself
        q = q * (torch.arange(n, device=q.device) < num_drafts[:, None])[..., None]
    d = draft_ids.unsqueeze(-1)
    alpha = acceptance_probability(p[:, :n].gather(-1, d), q.gather(-1, d)).squeeze(-1)
    if num_drafts is not None:
        alpha = torch.where(torch.arange(n, device=q.device) < num_drafts[:, None], alpha, 0.0)
    # All n tests run at once; the accepted length is the run of passes before the first failure.
    num_accepted = (u_accept < alpha).long().cumprod(-1).sum(-1)
    # q_{n+1} = 0 makes the bonus draw the same rule: residual(P_n, 0) = P_n.
    q_stop_rows = F.pad(q, (0, 0, 0, 1))
    stop = num_accepted.view(b, 1, 1).expand(b, 1, p.shape[-1])
    emitted = sample_from(residual_distribution(p.gather(1, stop), q_stop_rows.gather(1, stop)).squeeze(1), u_emit)
    positions = torch.arange(n + 1, device=draft_ids.device)
    out_tokens = torch.where(positions < num_accepted[:, None], F.pad(draft_ids, (0, 1), value=-1), -1)
    out_tokens = torch.where(positions == num_accepted[:, None], emitted[:, None], out_tokens)
    return num_accepted, out_tokens


# --- tree verification (SPEC §9) ---
# A tree of draft nodes over the top-K candidates of a block's slots: its scores (the selector's
# conditional law or DDTree's per-slot marginal), the budget best nodes found by a per-depth beam
# (build_tree; build_tree_reference is the obvious heap search it must equal), the attention mask
# among [anchor, nodes] (tree_ancestors), and the greedy and sampled descents (verify_tree_*).
# Everything but the reference is batched and free of host syncs.


class Tree(NamedTuple):
    """A draft tree over the sequence [anchor, nodes]: node i (0-based) is entry i + 1, the anchor is entry 0.

    Each tensor is [b, N] (N = the budget): tokens (long); parents (long, an entry index, 0 = the
    anchor); depth (long, 1..n); scores (float32, the sum of log weights along the node's path);
    valid (bool; padding nodes are False and carry token 0, parent 0, depth 1, score -inf,
    cand_index 0); cand_index (long, the node's index among its slot's candidates).
    slots: n, the block's draft slots (no node is deeper); the verifiers' path has this width and
    out_tokens one more. None means N (every depth a tree of N nodes can have).
    Nodes come in canonical order: valid before padding, then depth ascending, then the build order
    (score descending, then the tie rule of build_tree), so ancestors precede descendants.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    scores: torch.Tensor
    valid: torch.Tensor
    cand_index: torch.Tensor
    slots: Optional[int] = None


def selector_log_weights(S, U, cand_ids):
    """Selector path scores: the walk's law over the whole vocabulary, read at the candidates.

    log w_t(a, c) = S_t(a, c) - log(sum over c' in C_t of exp S_t(a, c') + sum over v not in C_t of exp U_t(v)):
    the softmax over C_t that the walk samples from at T = 1, with the tokens outside C_t kept at their
    draft logits (no edge term). So a slot whose K candidates hold little of the draft's mass scores
    its paths lower, and a tree spends its nodes where they are likely to be taken (docs/SPEC_NOTES.md,
    "Tree scores"). Every weight is <= 0, as build_tree needs.

    S [b, n, K, K] (S[:, t-1, a, c] = S_t(C_{t-1}[a], C_t[c]); for t = 1 every row is the anchor's),
    U [b, n, V] the draft logits, cand_ids [b, n, K] -> logw [b, n, K, K] float32.
    """
    S = S.float()
    outside = U.float().scatter(-1, cand_ids, float("-inf")).logsumexp(-1)  # [b, n]; -inf when C_t is all of V
    return S - torch.logaddexp(S.logsumexp(-1), outside[:, :, None])[..., None]


def marginal_log_weights(U, width):
    """DDTree's path scores: per slot the top M = min(width, V) tokens of U_t, scored log softmax(U_t) at them.

    U [b, n, V] -> (cand_ids [b, n, M] (descending U), logw [b, n, M, M] float32). The weight does
    not depend on the parent: logw[:, t, a, c] is the same for every a (an expanded view, no copy).
    """
    M = min(width, U.shape[-1])
    cand_ids = U.topk(M, dim=-1).indices
    at = torch.log_softmax(U.float(), -1).gather(-1, cand_ids)
    b, n, _ = cand_ids.shape
    return cand_ids, at[:, :, None, :].expand(b, n, M, M)


def _empty_tree(b, N, n, device):
    zeros = torch.zeros(b, N, dtype=torch.long, device=device)
    return Tree(zeros, zeros.clone(), torch.ones_like(zeros), torch.full((b, N), float("-inf"), device=device),
                torch.zeros(b, N, dtype=torch.bool, device=device), zeros.clone(), n)


def _rank(score, valid):
    """Indices that order the last dim by (valid first, score descending, then position): two stable sorts."""
    by_score = score.sort(dim=-1, descending=True, stable=True).indices
    invalid = (~valid).gather(-1, by_score).to(torch.int32)
    return by_score.gather(-1, invalid.sort(dim=-1, stable=True).indices)


def build_tree(logw, cand_ids, budget, max_depth=None):
    """The `budget` best nodes of a block's candidate tree, found by a per-depth beam, batched, no host sync.

    A node is a path (c_1..c_d), c_t a candidate index of slot t, 1 <= d <= max_depth[row] (default n);
    its score is logw[:, 0, 0, c_1] + logw[:, 1, c_1, c_2] + ... in float32, summed from the root down.
    logw [b, n, M, M] (row a of slot t: the law of slot t's candidates after candidate a of slot t-1;
    slot 1 reads row 0, the anchor's), cand_ids [b, n, M], max_depth [b] long or None.

    Order of nodes (the tie rule): higher score first; on equal scores the shallower node; on equal
    depth the lexicographically smaller tuple of candidate indices (c_1, .., c_d). Every prefix of a
    node ranks strictly above it (log weights are <= 0, so a rounded float32 sum never rises, and a
    tie goes to the shallower node), so the N = budget first nodes in this order are closed under
    prefixes and form a tree. The beam keeps, per depth, the N first children of the previous
    depth's beam in this order. It holds those N nodes: one of them has its parent among them (so in
    the previous beam, by induction) and fewer than N nodes ranked above it at all, so fewer than N
    of its beam's candidates; and the N first of all the beams' nodes are they. Fewer than N nodes in
    all (small M or max_depth): the rest is padding. Returns a Tree in canonical order (see Tree), slots = n.
    """
    b, n, M = cand_ids.shape
    N, device = budget, cand_ids.device
    if max_depth is None:
        max_depth = torch.full((b,), n, dtype=torch.long, device=device)
    if N == 0 or n == 0:
        return _empty_tree(b, N, n, device)
    logw = logw.float()
    # The depth-0 beam: the anchor in place 0 (its row of slot 1's weights is row 0), padding after it.
    score = torch.zeros(b, N, device=device)
    valid = torch.zeros(b, N, dtype=torch.bool, device=device)
    valid[:, 0] = True
    cidx = torch.zeros(b, N, dtype=torch.long, device=device)
    scores, valids, cidxs, parents = [], [], [], []
    for d in range(1, n + 1):
        # Children of the beam, laid out [beam place, candidate]: the beam is stored in
        # lexicographic order, so this flat order is the children's lexicographic order.
        rows = logw[:, d - 1].gather(1, cidx[:, :, None].expand(b, N, M))
        child_score = (score[:, :, None] + rows).reshape(b, N * M)
        child_valid = (valid[:, :, None] & (max_depth >= d)[:, None, None]).expand(b, N, M).reshape(b, N * M)
        best = _rank(child_score, child_valid)[:, :N]
        # Store the new beam in lexicographic order again (padding last).
        keep = child_valid.gather(1, best)
        best = best.gather(1, torch.where(keep, best, best + N * M).sort(-1).indices)
        valid = child_valid.gather(1, best)
        score = torch.where(valid, child_score.gather(1, best), float("-inf"))
        cidx, parent = best % M, best // M
        scores.append(score), valids.append(valid), cidxs.append(cidx), parents.append(parent)
    # All beams in (depth, lexicographic) order; the N first of them in the tie rule's order.
    all_score, all_valid = torch.cat(scores, 1), torch.cat(valids, 1)
    all_cidx = torch.cat(cidxs, 1)
    depth_of = torch.arange(1, n + 1, device=device).repeat_interleave(N)  # [n*N]
    # Parent as an entry of the concatenation (depth d's beam starts at (d-1)*N); -1: the anchor.
    all_parent = torch.cat([parents[0].new_full(parents[0].shape, -1)]
                           + [p + (d - 1) * N for d, p in enumerate(parents[1:], start=1)], 1)
    chosen = _rank(all_score, all_valid)[:, :N]
    valid = all_valid.gather(1, chosen)
    depth = depth_of[chosen]
    # Canonical order: valid first, depth ascending, the rank order within a depth (stable sort).
    chosen = chosen.gather(1, torch.where(valid, depth, n + 1).sort(dim=-1, stable=True).indices)
    valid, depth = all_valid.gather(1, chosen), depth_of[chosen]
    cand_index = all_cidx.gather(1, chosen)
    entry_place = torch.zeros(b, n * N, dtype=torch.long, device=device)  # chosen entry -> its place 1..N
    entry_place.scatter_(1, chosen, torch.arange(1, N + 1, device=device).expand(b, N))
    parent_entry = all_parent.gather(1, chosen)
    parent = torch.where(parent_entry >= 0, entry_place.gather(1, parent_entry.clamp(min=0)), 0)
    tokens = cand_ids.reshape(b, n * M).gather(1, (depth - 1) * M + cand_index)
    score = torch.where(valid, all_score.gather(1, chosen), float("-inf"))
    return Tree(tokens=torch.where(valid, tokens, 0), parents=torch.where(valid, parent, 0),
                depth=torch.where(valid, depth, 1), scores=score, valid=valid,
                cand_index=torch.where(valid, cand_index, 0), slots=n)


def _f32(x):
    """x rounded to float32 (a Python float). A sum of two float32 values done in float64 and rounded
    once to float32 is the float32 sum exactly (53 >= 2 * 24 + 2), so the reference's sums are build_tree's."""
    return torch.tensor(x, dtype=torch.float32).item()


def build_tree_reference(logw, cand_ids, budget, max_depth=None):
    """build_tree the slow, obvious way: per row, a best-first search over paths with a heap.

    Pop the best node in the tie rule's order (key: -score, depth, candidate-index tuple); record it;
    push its next sibling (the parent's children sorted by the same key) and its best child (if it
    may go deeper). Every node left unpopped ranks below some node in the heap, so the pops come in
    the tie rule's order; stop after `budget` pops. Returns the same Tree as build_tree (host work,
    for tests only).
    """
    import heapq

    b, n, M = cand_ids.shape
    N = budget
    lw = logw.float().tolist()
    cands = cand_ids.tolist()
    depths = [n] * b if max_depth is None else max_depth.tolist()
    rows = []
    for r in range(b):

        def children(path, score):
            d = len(path)  # the children sit at slot d + 1, weights logw[:, d]
            weights = lw[r][d][path[-1] if path else 0]
            kids = [(_f32(score + weights[c]), path + (c,)) for c in range(M)]
            return sorted(kids, key=lambda k: (-k[0], k[1]))

        heap, popped = [], []
        if N > 0 and n > 0 and depths[r] >= 1:
            kids = children((), 0.0)
            heapq.heappush(heap, (-kids[0][0], 1, kids[0][1], 0, kids))
        while heap and len(popped) < N:
            neg, d, path, place, siblings = heapq.heappop(heap)
            popped.append((-neg, path))
            if place + 1 < M:
                s, p = siblings[place + 1]
                heapq.heappush(heap, (-s, d, p, place + 1, siblings))
            if d < min(depths[r], n):
                kids = children(path, -neg)
                heapq.heappush(heap, (-kids[0][0], d + 1, kids[0][1], 0, kids))
        popped.sort(key=lambda node: (len(node[1]), -node[0], node[1]))  # canonical order
        place_of = {path: i + 1 for i, (_, path) in enumerate(popped)}
        row = [(cands[r][len(p) - 1][p[-1]], place_of.get(p[:-1], 0), len(p), s, True, p[-1]) for s, p in popped]
        rows.append(row + [(0, 0, 1, float("-inf"), False, 0)] * (N - len(row)))
    dtypes = (torch.long, torch.long, torch.long, torch.float32, torch.bool, torch.long)
    fields = [torch.tensor([[node[k] for node in row] for row in rows], dtype=dt, device=cand_ids.device).view(b, N)
              for k, dt in enumerate(dtypes)]
    return Tree(*fields, slots=n)


def tree_ancestors(parents):
    """The tree mask among [anchor, nodes]: A [b, N+1, N+1] bool, A[i, j] = entry j is entry i or an ancestor of it.

    parents [b, N] (entries of [anchor, nodes], 0 = the anchor). Row 0, the anchor, sees only itself
    (besides the context). Pointer doubling: with A holding ancestors up to distance m and jump the
    m-th ancestor (the anchor is its own parent), A | A[jump] holds them up to 2m; ceil(log2(N)) rounds.
    """
    b, N = parents.shape
    par = torch.cat([parents.new_zeros(b, 1), parents], 1)  # [b, N+1]
    eye = torch.eye(N + 1, dtype=torch.bool, device=parents.device).expand(b, N + 1, N + 1)
    A = eye | F.one_hot(par, N + 1).bool()
    A[:, 0] = eye[:, 0]  # the anchor's "parent" is itself
    jump, reach = par, 1
    while reach < N:
        A = A | A.gather(1, jump[:, :, None].expand(b, N + 1, N + 1))
        jump, reach = jump.gather(1, jump), 2 * reach
    return A


def _descend(tree, y):
    """From the anchor, move to the valid child carrying y[current] while there is one.

    y [b, N+1]: the target's token at every entry. Each entry's matching child (siblings carry
    distinct tokens, so at most one) comes from one scatter; then `slots` pointer steps.
    """
    b, N = tree.tokens.shape
    n = N if tree.slots is None else tree.slots
    entry = torch.arange(1, N + 1, device=y.device).expand(b, N)
    hit = tree.valid & (tree.tokens == y.gather(1, tree.parents))
    child = torch.zeros(b, N + 1, dtype=torch.long, device=y.device)
    child.scatter_reduce_(1, tree.parents, torch.where(hit, entry, 0), reduce="amax")  # 0: none
    current = torch.zeros(b, dtype=torch.long, device=y.device)
    steps = []
    for _ in range(n):
        step = child.gather(1, current[:, None]).squeeze(1)
        steps.append(step)
        current = torch.where(step > 0, step, current)  # once stopped, stays stopped (child[current] == 0)
    path = torch.stack(steps, 1) if steps else torch.zeros(b, 0, dtype=torch.long, device=y.device)
    num_accepted = (path > 0).sum(-1)
    # Out: y along [anchor, path]; an accepted node's token is y at its parent, then y at the last node.
    visited = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=y.device), path], 1)
    positions = torch.arange(n + 1, device=y.device)
    out_tokens = torch.where(positions <= num_accepted[:, None], y.gather(1, visited), -1)
    return num_accepted, torch.where(path > 0, path, -1), out_tokens


def verify_tree_greedy(tree, target_logits):
    """Greedy tree verification (SPEC §9): from the anchor, y = argmax of the target at the current
    node; descend to the valid child carrying y while there is one, else emit y.

    target_logits [b, N+1, V]: row i is the target's next-token logits after entry i's path.
    Returns num_accepted [b] (the depth reached), path [b, n] (the accepted entries 1..N by depth,
    then -1), out_tokens [b, n+1] (the accepted tokens, the emitted y at index num_accepted, then -1),
    and y [b, N+1] (the target's argmax at every entry). n = tree.slots (N if None).
    """
    y = target_logits.argmax(-1)
    return (*_descend(tree, y), y)


def verify_tree_sampled(tree, p, u):
    """Sampled tree verification (SPEC §9): draw y_i ~ P_i at every entry at once (inverse CDF, u_i),
    then descend as verify_tree_greedy does with these y.

    p [b, N+1, V]: the target distribution at every entry (process_logits: temperature, top-k,
    top-p); u [b, N+1] uniforms in [0, 1). Only the path's draws matter, and the tree is fixed
    before them, so the output is ancestral sampling from P: exact for any tree, with no p/q test
    over the children and no residual. Returns what verify_tree_greedy does, y being the draws.
    """
    y = sample_from(p, u)
    return (*_descend(tree, y), y)
