"""The sampling and verification math of speculative decoding (docs/SPEC.md §5), torch only.

This module imports nothing but torch, so other implementations can use it as an oracle without
transformers. Randomness comes in as uniform tensors drawn by the caller, so nothing here needs a
host sync and every result can be replayed.
"""
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


def acceptance_probability(p_draft, q_draft):
    """alpha = min(1, P_{i-1}(d_i) / q_i(d_i)), elementwise; q = 0 gives 1 if P > 0 else 0."""
    # x/0 = inf clamps to 1; 0/0 = nan becomes 0 (a draft neither model allows is rejected).
    return (p_draft / q_draft).nan_to_num(nan=0.0).clamp(max=1.0)


def residual_distribution(p, q):
    """normalize(max(P - q, 0)) over the last dim; P itself where that has no mass (then P == q and rejection never happens)."""
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
