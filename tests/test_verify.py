"""Verification math (SPEC §5): greedy is exact, sampling preserves the target distribution.

The sampled case is checked three ways over a tiny vocabulary, at temperatures other than 1 with
top-k and top-p: by exact enumeration built from the acceptance and residual helpers verify_sampled
uses; by an exact, sampling-free enumeration of verify_sampled itself (every cell of its uniforms,
cells from the definition); and by Monte Carlo on verify_sampled. Broken verifiers are planted to
show the checks fail when the math is wrong.
"""

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from dflash2 import verify
from dflash2.settings import check_sampling_params

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
MC_ROWS = 200_000


# --- a toy target and drafter over every prefix of a tiny vocabulary ---


def all_prefixes(vocab, max_len):
    """Every token tuple of length 0..max_len, shortest first, lexicographic within a length."""
    return [t for k in range(max_len + 1) for t in itertools.product(range(vocab), repeat=k)]


def prefix_rows(tokens, vocab):
    """Row of each prefix tokens[:, :k] (k = 0..width) in all_prefixes order, vocab >= 2: [rows, width + 1]."""
    code = tokens.new_zeros(tokens.shape[0])
    rows = [code]
    for k in range(1, tokens.shape[1] + 1):
        code = code * vocab + tokens[:, k - 1]
        rows.append((vocab**k - 1) // (vocab - 1) + code)  # prefixes shorter than k come first
    return torch.stack(rows, 1)


def toy_target(vocab, n, temperature, top_k, top_p, gen):
    """P(. | prefix) for every prefix of length <= n: process_logits of random logits. [prefixes, V] float64."""
    logits = 2 * torch.randn(len(all_prefixes(vocab, n)), vocab, generator=gen, dtype=torch.float64)
    return verify.process_logits(logits, temperature, top_k, top_p)


def toy_proposal(vocab, n, walk, support, gen):
    """q(. | accepted prefix) for every prefix of length < n, [prefixes, V] float64.

    sampled: a random distribution on a random top-`support` set; greedy: one-hot on a random token.
    """
    rows = len(all_prefixes(vocab, n - 1))
    scores = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    if walk == "greedy":
        return torch.nn.functional.one_hot(scores.argmax(-1), vocab).to(torch.float64)
    kth = scores.topk(support, -1).values[:, -1:]
    weights = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    return weights.masked_fill(scores < kth, float("-inf")).softmax(-1)


def exact_verification_law(P, Q, vocab, n):
    """{emitted tokens: probability} of one verification step, enumerated over drafts d ~ q and accept/reject outcomes.

    Emitted tokens are the a accepted drafts plus one residual or bonus token, so the tuple's
    length is a + 1. Acceptance and residual come from the helpers verify_sampled uses.
    """
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    alpha = verify.acceptance_probability(P[: len(Q)], Q).tolist()
    residual = verify.residual_distribution(P[: len(Q)], Q).tolist()
    p, q = P.tolist(), Q.tolist()
    law = {}

    def walk(prefix, reach):
        row = index[prefix]
        if len(prefix) == n:
            for t in range(vocab):
                law[prefix + (t,)] = law.get(prefix + (t,), 0.0) + reach * p[row][t]
            return
        # The residual depends only on the accepted prefix, so every rejected draft shares it.
        reject = reach * sum(q[row][d] * (1 - alpha[row][d]) for d in range(vocab))
        for t in range(vocab):
            law[prefix + (t,)] = law.get(prefix + (t,), 0.0) + reject * residual[row][t]
        for d in range(vocab):
            if q[row][d] > 0:
                walk(prefix + (d,), reach * q[row][d] * alpha[row][d])

    walk((), 1.0)
    return law


def max_error_against_target(law, P, vocab, n):
    """max over sequences s of length n+1 of |Pr(verifier emits s, then the target continues) - Pr_target(s)|."""
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    p = P.tolist()
    worst = 0.0
    for seq in itertools.product(range(vocab), repeat=n + 1):
        step = [p[index[seq[:j]]][seq[j]] for j in range(n + 1)]
        target = math.prod(step)
        emitted = sum(law.get(seq[:m], 0.0) * math.prod(step[m:]) for m in range(1, n + 2))
        worst = max(worst, abs(emitted - target))
    return worst


def verify_sampled_law(P, Q, vocab, n):
    """{emitted tokens: probability} of the real verify_sampled, exactly, with no sampling.

    verify_sampled is a deterministic function of its uniforms that is constant on cells: each
    u_accept[i] below or above alpha_i = min(1, P_{i-1}(d_i) / q_i(d_i)), and u_emit inside one token's
    interval of the inverse CDF of what the definition emits from (normalize(max(P_a - q_{a+1}, 0)) at
    the first rejection a, P_n when all pass). One batched call at the midpoint of every cell of every
    draft chain, each outcome weighted by the chain's and the cell's probability, is the exact law
    when the code follows the definition; a code that departs from it (another threshold, residual
    or row) answers differently at some midpoint. The cells come from the formulas above, not sd's helpers.
    """
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    p, q = P.tolist(), Q.tolist()
    cases = []  # (probability, drafts, u_accept, u_emit)
    for chain in itertools.product(range(vocab), repeat=n):
        rows = [index[chain[:i]] for i in range(n + 1)]
        reach = math.prod(q[rows[i]][chain[i]] for i in range(n))
        if reach == 0:
            continue
        alpha = [min(1.0, p[rows[i]][chain[i]] / q[rows[i]][chain[i]]) for i in range(n)]
        for passes in itertools.product((True, False), repeat=n):
            cell = math.prod(a if ok else 1 - a for a, ok in zip(alpha, passes))
            if cell == 0:
                continue
            u_accept = [a / 2 if ok else (1 + a) / 2 for a, ok in zip(alpha, passes)]
            stop = passes.index(False) if False in passes else n
            emit = p[rows[stop]]
            if stop < n:
                residual = [max(x - y, 0.0) for x, y in zip(p[rows[stop]], q[rows[stop]])]
                emit = residual if sum(residual) > 0 else emit
            total, below = sum(emit), 0.0
            for r in emit:
                if r > 0:
                    cases.append((reach * cell * r / total, chain, u_accept, (below + r / 2) / total))
                below += r
    probs, drafts, u_accept, u_emit = zip(*cases)
    drafts = torch.tensor(drafts).view(len(cases), n)
    where = prefix_rows(drafts, vocab)
    u_accept = torch.tensor(u_accept, dtype=torch.float64).view(len(cases), n)
    num_accepted, out = verify.verify_sampled(drafts, Q[where[:, :n]], P[where], u_accept,
                                          torch.tensor(u_emit, dtype=torch.float64))
    assert ((out >= 0) == (torch.arange(n + 1) <= num_accepted[:, None])).all()
    law = {}
    for prob, a, row in zip(probs, num_accepted.tolist(), out.tolist()):
        law[tuple(row[: a + 1])] = law.get(tuple(row[: a + 1]), 0.0) + prob
    return law


def sampled_block(P, Q, vocab, n, rows, gen):
    """Draw `rows` draft chains d_i ~ q(. | d_<i) and run the real verify_sampled on them (float32)."""
    drafts = torch.zeros(rows, 0, dtype=torch.long)
    for _ in range(n):
        q_rows = Q[prefix_rows(drafts, vocab)[:, -1]]
        drafts = torch.cat([drafts, verify.sample_from(q_rows, torch.rand(rows, generator=gen))[:, None]], 1)
    where = prefix_rows(drafts, vocab)
    p, q = P[where].float(), Q[where[:, :n]].float()
    return verify.verify_sampled(drafts, q, p, torch.rand(rows, n, generator=gen), torch.rand(rows, generator=gen))


def outcome_codes(tokens, vocab):
    """One integer per emitted tuple (padding -1 counts as digit 0): [rows, n+1] -> [rows]."""
    weights = (vocab + 1) ** torch.arange(tokens.shape[-1])
    return ((tokens + 1) * weights).sum(-1)


def total_variation(codes, law, vocab, n):
    """TV between the empirical law of codes and `law`, and a bound it stays under w.p. >= 1 - exp(-40).

    E[TV] <= 1/2 sum_k sqrt(p_k / N), and TV moves by at most 1/N per sample, so by McDiarmid
    P(TV > E[TV] + t) <= exp(-2 N t^2) = exp(-40) at t = 0.01, N = 200k.
    """
    rows = codes.shape[0]
    keys = torch.tensor([list(k) + [-1] * (n + 1 - len(k)) for k in law])
    exact = dict(zip(outcome_codes(keys, vocab).tolist(), law.values()))
    found, counts = codes.unique(return_counts=True)
    empirical = dict(zip(found.tolist(), (counts / rows).tolist()))
    tv = 0.5 * sum(abs(empirical.get(k, 0.0) - exact.get(k, 0.0)) for k in exact.keys() | empirical.keys())
    bound = 0.5 * sum(math.sqrt(v / rows) for v in exact.values()) + math.sqrt(40 / (2 * rows))
    return tv, bound


def first_token_law(law, vocab):
    """Marginal law of the first emitted token, as a one-token `law`."""
    first = {}
    for k, v in law.items():
        first[k[:1]] = first.get(k[:1], 0.0) + v
    return first


toy_settings = st.fixed_dictionaries(
    {
        "vocab": st.integers(2, 6),
        "n": st.integers(1, 3),
        "temperature": st.floats(0.3, 2.0),
        "top_k": st.integers(0, 6),
        "top_p": st.one_of(st.just(1.0), st.floats(0.2, 1.0)),
        "walk": st.sampled_from(["sampled", "greedy"]),
        "support": st.integers(1, 6),
        "seed": st.integers(0, 2**31 - 1),
    }
)


def build_toy(cfg):
    gen = torch.Generator().manual_seed(cfg["seed"])
    vocab, n = cfg["vocab"], cfg["n"]
    P = toy_target(vocab, n, cfg["temperature"], cfg["top_k"], cfg["top_p"], gen)
    Q = toy_proposal(vocab, n, cfg["walk"], min(cfg["support"], vocab), gen)
    return P, Q, gen


# --- sampling preserves the target distribution ---


@settings(FAST, max_examples=150)
@given(toy_settings)
def test_sampling_preserves_target_distribution(cfg):
    P, Q, _ = build_toy(cfg)
    vocab, n = cfg["vocab"], cfg["n"]
    law = exact_verification_law(P, Q, vocab, n)
    assert abs(sum(law.values()) - 1) < 1e-12
    assert max_error_against_target(law, P, vocab, n) < 1e-9


# Fixed cases run on every run, whatever Hypothesis draws: temperatures other than 1 with top-k and
# top-p together, and three drafts, so the residual after an accepted prefix is reached.
HARD_CASES = [
    dict(vocab=4, n=3, temperature=0.5, top_k=3, top_p=0.9, walk="sampled", support=3, seed=5),
    dict(vocab=5, n=3, temperature=1.7, top_k=4, top_p=0.8, walk="sampled", support=4, seed=8),
    dict(vocab=4, n=3, temperature=0.4, top_k=3, top_p=0.95, walk="greedy", support=1, seed=2),
]


def with_examples(cases):
    def decorate(test):
        for case in reversed(cases):
            test = example(case)(test)
        return test

    return decorate


@settings(FAST, max_examples=60)
@with_examples(HARD_CASES)
@given(toy_settings)
def test_verify_sampled_follows_the_definition_exactly(cfg):
    """The real verify_sampled, enumerated over every cell of its uniforms (no sampling), emits the target's law."""
    P, Q, _ = build_toy(cfg)
    vocab, n = cfg["vocab"], cfg["n"]
    law = verify_sampled_law(P, Q, vocab, n)
    assert abs(sum(law.values()) - 1) < 1e-12
    assert max_error_against_target(law, P, vocab, n) < 1e-9


@settings(FAST, max_examples=6)
@with_examples(HARD_CASES[:1])
@given(toy_settings)
def test_verify_sampled_matches_exact_law(cfg):
    P, Q, gen = build_toy(cfg)
    vocab, n = cfg["vocab"], cfg["n"]
    num_accepted, out_tokens = sampled_block(P, Q, vocab, n, MC_ROWS, gen)
    law = exact_verification_law(P, Q, vocab, n)
    positions = torch.arange(n + 1)
    assert ((out_tokens >= 0) == (positions <= num_accepted[:, None])).all()
    tv, bound = total_variation(outcome_codes(out_tokens, vocab), law, vocab, n)
    assert tv < bound
    tv, bound = total_variation(outcome_codes(out_tokens[:, :1], vocab), first_token_law(law, vocab), vocab, 0)
    assert tv < bound


# --- negative controls: planted bugs that both checks must catch ---


def always_accept(p_draft, q_draft):
    return torch.ones_like(p_draft)


def residual_is_target(p, q):
    return p


@pytest.mark.parametrize("walk", ["sampled", "greedy"])
@pytest.mark.parametrize("helper, mutant", [("acceptance_probability", always_accept), ("residual_distribution", residual_is_target)])
def test_checks_detect_broken_verifier(monkeypatch, walk, helper, mutant):
    cfg = dict(vocab=4, n=2, temperature=1.0, top_k=3, top_p=0.95, walk=walk, support=3, seed=1)
    P, Q, gen = build_toy(cfg)
    monkeypatch.setattr(verify, helper, mutant)
    law = exact_verification_law(P, Q, 4, 2)
    assert max_error_against_target(law, P, 4, 2) > 1e-2
    # Monte Carlo against the correct law: restore the helper only for the reference enumeration.
    _, out_tokens = sampled_block(P, Q, 4, 2, MC_ROWS, gen)
    monkeypatch.undo()
    tv, bound = total_variation(outcome_codes(out_tokens, 4), exact_verification_law(P, Q, 4, 2), 4, 2)
    assert tv > 2 * bound


# --- greedy ---


def brute_force_greedy(draft_ids, target_logits):
    best = target_logits.argmax(-1).tolist()
    results = []
    for drafts, row in zip(draft_ids.tolist(), best):
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == row[accepted]:
            accepted += 1
        results.append((accepted, drafts[:accepted] + [row[accepted]]))
    return results


@settings(FAST, max_examples=40)
@given(
    n=st.integers(1, 7),
    vocab=st.integers(2, 40),
    extra_rows=st.integers(0, 4),
    data=st.data(),
)
def test_greedy_matches_target(n, vocab, extra_rows, data):
    # Every acceptance length 0..n appears at least once, in a ragged batch.
    lengths = data.draw(st.permutations(list(range(n + 1)) + [data.draw(st.integers(0, n)) for _ in range(extra_rows)]))
    seed = data.draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(len(lengths), n + 1, vocab, generator=gen)
    best = target_logits.argmax(-1)
    draft_ids = torch.randint(vocab, (len(lengths), n), generator=gen)
    for row, length in enumerate(lengths):
        draft_ids[row, :length] = best[row, :length]
        if length < n:
            draft_ids[row, length] = (best[row, length] + data.draw(st.integers(1, vocab - 1))) % vocab
    num_accepted, out_tokens = verify.verify_greedy(draft_ids, target_logits)
    assert num_accepted.tolist() == lengths
    for row, (accepted, emitted) in enumerate(brute_force_greedy(draft_ids, target_logits)):
        assert out_tokens[row].tolist() == emitted + [-1] * (n - accepted)


# --- process_logits and sample_from ---


def brute_force_process_logits(row, temperature, top_k, top_p):
    """One row by the definition; returns (probs, distance of the nucleus boundary from top_p)."""
    z = [x / temperature for x in row]
    if top_k:
        kth = sorted(z, reverse=True)[min(top_k, len(z)) - 1]
        z = [x if x >= kth else -math.inf for x in z]
    top = max(z)
    e = [math.exp(x - top) for x in z]
    probs = [x / sum(e) for x in e]
    margin = math.inf
    if top_p < 1:
        kept, mass = set(), 0.0
        for t in sorted(range(len(probs)), key=lambda t: -probs[t]):
            if mass >= top_p:
                break
            kept.add(t)
            mass += probs[t]
            margin = min(margin, abs(mass - top_p))
        last = min(probs[t] for t in kept)
        kept |= {t for t, x in enumerate(probs) if x == last}  # ties with the last one taken come too
        probs = [x if t in kept else 0.0 for t, x in enumerate(probs)]
        probs = [x / sum(probs) for x in probs]
    return probs, margin


@settings(FAST, max_examples=80)
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(1, 30),
    temperature=st.floats(0.1, 3.0),
    top_k=st.integers(0, 35),
    top_p=st.one_of(st.just(1.0), st.floats(1e-3, 1.0)),
    seed=st.integers(0, 2**31 - 1),
)
def test_process_logits_matches_definition(rows, vocab, temperature, top_k, top_p, seed):
    logits = 3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    probs = verify.process_logits(logits, temperature, top_k, top_p)
    for got, row in zip(probs.tolist(), logits.tolist()):
        want, margin = brute_force_process_logits(row, temperature, top_k, top_p)
        assume(margin > 1e-9)  # a nucleus boundary exactly at top_p is a tie
        assert got == pytest.approx(want, abs=1e-12)
        kept = [p for p in got if p > 0]
        if top_k and top_p == 1:
            assert len(kept) == min(top_k, vocab)
        if top_p < 1:
            unfiltered = verify.process_logits(torch.tensor(row, dtype=torch.float64), temperature, top_k)
            mass = unfiltered[torch.tensor(got) > 0].sum().item()
            assert mass >= top_p - 1e-12 and mass - unfiltered[torch.tensor(got) > 0].min().item() < top_p


@settings(FAST, max_examples=60)
@given(
    vocab=st.integers(1, 12),
    spread=st.integers(0, 3),
    temperature=st.floats(0.3, 2.0),
    top_k=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_top_k_keeps_every_token_tied_with_the_kth(vocab, spread, temperature, top_k, seed):
    """Integer logits tie a lot (the continuous ones above never do): top-k keeps every token whose logit
    equals the k-th largest, as the definition says (SPEC §5), never exactly k by position. A port that keeps
    exactly k (SGLang's sparse top-k) passes the test above and fails this one (tests/test_ports.py)."""
    logits = torch.randint(-spread, spread + 1, (vocab,), generator=torch.Generator().manual_seed(seed)).double()
    kth = logits.sort(descending=True).values[min(top_k, vocab) - 1]
    probs = verify.process_logits(logits, temperature, top_k)
    assert ((probs > 0) == (logits >= kth)).all()
    assert probs.tolist() == pytest.approx(brute_force_process_logits(logits.tolist(), temperature, top_k, 1.0)[0], abs=1e-12)


@settings(FAST, max_examples=60)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(1, 40),
    spread=st.integers(0, 4),
    top_p=st.floats(1e-3, 1.0, exclude_max=True),
    tiers=st.lists(st.integers(1, 45), max_size=3).map(lambda t: tuple(sorted(t))),
    seed=st.integers(0, 2**31 - 1),
)
def test_nucleus_with_ties_is_exact_and_order_free(rows, vocab, spread, top_p, tiers, seed):
    """Integer logits in a narrow range tie a lot: the tiered top-k path must give the full sort's
    cutoff exactly, the kept set must not depend on the vocabulary's order, and it must match the
    definition (prefix, then every tie of the last token taken)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-spread, spread + 1, (rows, vocab), generator=gen).double()
    probs = logits.softmax(-1)
    full = verify.nucleus_cutoff(probs, top_p, tiers=())
    assert torch.equal(verify.nucleus_cutoff(probs, top_p, tiers=tiers), full)
    perm = torch.randperm(vocab, generator=gen)
    kept = probs >= full
    assert torch.equal((probs[:, perm] >= verify.nucleus_cutoff(probs[:, perm], top_p, tiers=tiers))[:, perm.argsort()], kept)
    for row, k in zip(logits.tolist(), kept.tolist()):
        want, margin = brute_force_process_logits(row, 1.0, 0, top_p)
        assume(margin > 1e-9)
        assert k == [w > 0 for w in want]


def test_nucleus_boundary_at_exactly_top_p_is_left_out():
    """P = [1/2, 1/4, 1/4] with top_p = 1/2: the mass before the second token is exactly top_p, not < top_p."""
    for dtype in (torch.float32, torch.float64):
        assert verify.process_logits(torch.tensor([math.log(2), 0.0, 0.0], dtype=dtype), 1.0, 0, 0.5).tolist() == [1, 0, 0]
        assert verify.process_logits(torch.tensor([math.log(2), 0.0, 0.0], dtype=dtype), 1.0, 0, 0.5001).tolist() == [
            0.5, 0.25, 0.25]


@settings(FAST, max_examples=60)
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=12).filter(sum),
    cut=st.integers(0, 12),
    tiers=st.lists(st.integers(1, 12), max_size=2).map(lambda t: tuple(sorted(t))),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_nucleus_boundary_ties_are_exact(counts, cut, tiers, dtype, seed):
    """Probabilities k / 2^m (every partial sum exact in floating point) and top_p equal to the mass of
    the first `cut` sorted tokens, so the boundary is met exactly: the kept set must be the definition's,
    in exact arithmetic (mass before < top_p, then the ties of the last token taken)."""
    from fractions import Fraction

    total = 1 << (sum(counts) - 1).bit_length()
    counts = counts + [total - sum(counts)] if total > sum(counts) else counts
    counts = [counts[i] for i in torch.randperm(len(counts), generator=torch.Generator().manual_seed(seed)).tolist()]
    ordered = sorted(counts, reverse=True)
    top_p = Fraction(sum(ordered[: max(1, min(cut, len(counts) - 1))]), total)
    assume(0 < top_p < 1)
    kept, mass = [], Fraction(0)
    for c in ordered:
        if mass >= top_p:
            break
        kept.append(c)
        mass += Fraction(c, total)
    want = [c >= kept[-1] for c in counts]
    probs = torch.tensor(counts, dtype=dtype) / total
    got = (probs >= verify.nucleus_cutoff(probs[None], float(top_p), tiers=tiers)[0]).tolist()
    assert got == want


def test_nucleus_tiers_match_the_full_sort_on_a_real_vocabulary():
    """The CPU default tiers on a 49,152-token vocabulary, with nuclei inside the first tier, the
    second, and past both (a flat row)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=gen) * torch.tensor([12.0, 8.0, 5.0, 3.0, 1.0, 0.0])[:, None]
    probs = logits.softmax(-1)
    full = verify.nucleus_cutoff(probs, 0.95, tiers=())
    assert torch.equal(verify.nucleus_cutoff(probs, 0.95), full)
    sizes = (probs >= full).sum(-1)
    first, second = verify.NUCLEUS_TIERS
    assert (sizes < first).any() and ((first < sizes) & (sizes <= second)).any() and (sizes > second).any()


@pytest.mark.parametrize(
    "temperature, top_p, top_k, name",
    [(-0.5, 1.0, 0, "temperature"), (math.nan, 1.0, 0, "temperature"), (1.0, 0.0, 0, "top_p"), (1.0, 1.5, 0, "top_p"), (1.0, 0.9, -1, "top_k")],
)
def test_sampling_params_are_validated(temperature, top_p, top_k, name):
    with pytest.raises(ValueError, match=name):
        check_sampling_params(temperature, top_p, top_k)


def test_process_logits_rejects_greedy_temperature():
    check_sampling_params(0.0, 1.0, 0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        verify.process_logits(torch.zeros(3), 0.0)


def test_sample_from_inverts_the_cdf():
    probs = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, 0.0])  # unnormalised, zero head and tail
    # u = 1 stands for u * total rounding up to total: it must not reach the zero tail.
    u = torch.tensor([0.0, 0.49, 0.5, 0.74, 0.75, 0.999, 1.0])
    assert verify.sample_from(probs.expand(len(u), -1), u).tolist() == [1, 1, 3, 3, 4, 4, 4]


def test_impossible_drafts_are_never_accepted():
    """A draft the target gives probability 0 is rejected, even with u = 0 and whether or not q gives it mass."""
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]] * 2)  # P_0(token 0) = 0
    q = torch.tensor([[[0.0, 0.0, 0.0, 1.0]], [[1.0, 0.0, 0.0, 0.0]]])  # q(d) = 0, then q(d) = 1
    drafts = torch.tensor([[0], [0]])
    num_accepted, out = verify.verify_sampled(drafts, q, p, torch.zeros(2, 1), torch.zeros(2))
    assert num_accepted.tolist() == [0, 0] and out[:, 0].tolist() == [1, 1]
    assert verify.acceptance_probability(torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.5])).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("sampled", [False, True])
@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 4), n=st.integers(1, 6), V=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_num_drafts_equals_cutting_the_arrays(sampled, b, n, V, seed):
    """Verifying with num_drafts = k equals verifying the arrays cut to k drafts, every output (the
    bonus row included, and -1 past it) the same."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, n + 1, (b,), generator=g)
    drafts = torch.randint(0, V, (b, n), generator=g)
    logits = torch.randn(b, n + 1, V, generator=g, dtype=torch.float64)
    logits[:, :n].scatter_add_(-1, drafts[..., None], torch.full((b, n, 1), 3.0, dtype=torch.float64))  # accepts happen
    q = torch.softmax(torch.randn(b, n, V, generator=g, dtype=torch.float64), -1)
    u_accept, u_emit = torch.rand(b, n, generator=g, dtype=torch.float64), torch.rand(b, generator=g, dtype=torch.float64)
    p = verify.process_logits(logits, 0.9)
    if sampled:
        got = verify.verify_sampled(drafts, q, p, u_accept, u_emit, num_drafts=k)
    else:
        got = verify.verify_greedy(drafts, logits, num_drafts=k)
    for r in range(b):
        c = int(k[r])
        if sampled:
            want = verify.verify_sampled(drafts[r:r + 1, :c], q[r:r + 1, :c], p[r:r + 1, : c + 1], u_accept[r:r + 1, :c],
                                         u_emit[r:r + 1])
        else:
            want = verify.verify_greedy(drafts[r:r + 1, :c], logits[r:r + 1, : c + 1])
        assert got[0][r] == want[0][0]
        assert got[1][r, : c + 1].tolist() == want[1][0].tolist() and (got[1][r, c + 1:] == -1).all()


def test_verify_module_imports_without_transformers():
    """The oracle other implementations import needs torch only: with transformers unimportable,
    dflash2.verify imports and runs, and importing it loads no transformers module."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['transformers'] = None\n"  # any import of it now raises ImportError
            "import torch, dflash2.verify as v\n"
            "assert v.verify_greedy(torch.tensor([[1]]), torch.eye(3)[None, :2]).__len__() == 2\n"
            "assert not [m for m in sys.modules if m.startswith('transformers.')]\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
