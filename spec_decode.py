"""DFlash 2 speculative decoding: sampling math, verification (SPEC §5) and the draft -> select -> verify loop.

Everything here stays on the device: randomness comes in as uniform tensors drawn by the
caller (`torch.rand(..., generator=g)`), so no step needs a host sync and a run can be replayed.
"""

import torch
import torch.nn.functional as F

# --- sampling and verification math ---


def check_sampling_params(temperature, top_p, top_k):
    """Reject settings plain sampling would not accept: temperature >= 0 (0 = greedy), 0 < top_p <= 1, top_k >= 0 (0 = off)."""
    # Negated comparisons so that NaN fails too.
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not top_k >= 0:
        raise ValueError(f"top_k must be >= 0 (0 means no top-k), got {top_k}")


def process_logits(logits, temperature, top_k=0, top_p=1.0):
    """Target distribution P over the last dim, as plain sampling builds it.

    z = logits / temperature; z = -inf outside the top_k largest (ties with the k-th kept);
    z = -inf outside the nucleus, the fewest highest-probability tokens of softmax(z) whose
    mass reaches top_p (always at least one); P = softmax(z).
    """
    check_sampling_params(temperature, top_p, top_k)
    if temperature == 0:
        raise ValueError("temperature must be > 0 in process_logits; greedy decoding uses verify_greedy")
    # bf16/fp16 cumulative sums are too coarse for the nucleus boundary.
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if 0 < top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1:
        sorted_probs, order = z.softmax(-1).sort(-1, descending=True)
        # A token is in the nucleus iff the mass strictly above it is still short of top_p.
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z.softmax(-1)


def sample_from(probs, u):
    """Inverse-CDF draw: the token t with cdf(t-1) <= u * cdf(V-1) < cdf(t); probs [..., V] >= 0, unnormalised ok, u [...] in [0, 1)."""
    cdf = probs.cumsum(-1)
    x = u.to(cdf.dtype).unsqueeze(-1) * cdf[..., -1:]
    token = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    # u * total can round up to total; never step past the last token that has mass.
    positions = torch.arange(probs.shape[-1], device=probs.device)
    last_with_mass = torch.where(probs > 0, positions, 0).amax(-1)
    return torch.minimum(token, last_with_mass)


def acceptance_probability(p_draft, q_draft):
    """alpha = min(1, P_{i-1}(d_i) / q_i(d_i)), elementwise; q = 0 gives 1 if P > 0 else 0."""
    # x/0 = inf clamps to 1; 0/0 = nan becomes 0 (a draft neither model allows is rejected).
    return (p_draft / q_draft).nan_to_num(nan=0.0).clamp(max=1.0)


def residual_distribution(p, q):
    """normalize(max(P - q, 0)) over the last dim; P itself where that has no mass (then P == q and rejection never happens)."""
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass, p)


def verify_greedy(draft_ids, target_logits):
    """Greedy chain verification (SPEC §5).

    Accept the longest prefix with d_i == argmax P_{i-1}; the bonus is argmax P_a at the first
    mismatch a (a = n when all match). draft_ids [b, n], target_logits [b, n+1, V] (row i gives P_i;
    temperature, top-k and top-p never move the argmax). Returns num_accepted [b] and
    out_tokens [b, n+1]: the a accepted drafts, the bonus at index a, then -1.
    """
    n = draft_ids.shape[1]
    best = target_logits.argmax(-1)
    num_accepted = (draft_ids == best[:, :n]).long().cumprod(-1).sum(-1)
    # Accepted drafts equal the target argmax, so the emitted tokens are argmax P_0 .. argmax P_a.
    positions = torch.arange(n + 1, device=draft_ids.device)
    out_tokens = torch.where(positions <= num_accepted[:, None], best, -1)
    return num_accepted, out_tokens


def verify_sampled(draft_ids, q, p, u_accept, u_emit):
    """Sampled chain verification (SPEC §5), lossless for any proposal q.

    For i = 1..n accept d_i iff u_accept[:, i-1] < min(1, P_{i-1}(d_i) / q_i(d_i)); at the first
    rejection a emit a draw from normalize(max(P_a - q_{a+1}, 0)) and stop; if all n are accepted
    emit a bonus draw from P_n. A greedy walk is one-hot q on the same path.
    draft_ids [b, n]; q [b, n, V] (row i-1 is q_i); p [b, n+1, V] (row i is P_i);
    u_accept [b, n] and u_emit [b] uniforms in [0, 1). Returns num_accepted [b] and
    out_tokens [b, n+1]: the a accepted drafts, the emitted token at index a, then -1.
    """
    b, n = draft_ids.shape
    d = draft_ids.unsqueeze(-1)
    alpha = acceptance_probability(p[:, :n].gather(-1, d), q.gather(-1, d)).squeeze(-1)
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
