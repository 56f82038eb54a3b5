"""Tree verification math (SPEC §9): the tree of the best nodes, its mask, and lossless greedy and sampled descents.

- build_tree (batched beam) equals build_tree_reference (a heap search) on drawn scores of both
  kinds, ties included, and both equal a brute-force ranking of every path on small cases.
- tree_ancestors equals a per-node parent walk.
- A chain-shaped tree verifies as verify_greedy / verify_sampled do.
- verify_tree_sampled, enumerated over every cell of its uniforms (no sampling), on drawn tree
  shapes over tiny vocabularies at temperatures other than 1 with top-k and top-p, emits every
  sequence with the target's probability; Monte Carlo agrees.
- Planted bugs are caught: the p/q rule on deterministic children, an ancestor missing from the mask.
"""

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash2 import verify
from test_verify import with_examples

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
MC_ROWS = 300_000


def f32(x):
    return torch.tensor(x, dtype=torch.float32).item()


# --- tree scores ---


def make_scores(kind, b, n, K, V, ties, seed):
    """(logw, cand_ids): selector-shaped from random edge scores S, or marginal-shaped from random U.

    ties: integer scores on 3 levels, so that many log weights (and path sums) are exactly equal.
    """
    gen = torch.Generator().manual_seed(seed)
    draw = (lambda *s: torch.randint(0, 3, s, generator=gen).float()) if ties else (
        lambda *s: 2 * torch.randn(*s, generator=gen))
    if kind == "marginal":
        cand_ids, logw = verify.marginal_log_weights(draw(b, n, V), K)
        return logw, cand_ids
    V = max(V, K)
    U = draw(b, n, V)
    cand_ids = torch.randn(b, n, V, generator=gen).topk(K, -1).indices
    S = draw(b, n, K, K)
    S[:, 0] = S[:, 0, :1]  # slot 1: every row is the anchor's
    return verify.selector_log_weights(S, U, cand_ids), cand_ids


@st.composite
def tree_inputs(draw, max_n=7, max_k=16, max_budget=64):
    b, n, K = draw(st.integers(1, 4)), draw(st.integers(1, max_n)), draw(st.integers(1, max_k))
    depths = draw(st.one_of(st.none(), st.lists(st.integers(0, n), min_size=b, max_size=b)))
    return dict(kind=draw(st.sampled_from(["selector", "marginal"])), b=b, n=n, K=K, V=draw(st.integers(1, 20)),
                ties=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
                budget=draw(st.integers(1, max_budget)), max_depth=depths)


def build_both(cfg):
    logw, cand_ids = make_scores(cfg["kind"], cfg["b"], cfg["n"], cfg["K"], cfg["V"], cfg["ties"], cfg["seed"])
    md = None if cfg["max_depth"] is None else torch.tensor(cfg["max_depth"])
    return logw, cand_ids, md


def paths_of(tree, r):
    """{entry: tuple of candidate indices from the root} for the valid nodes of row r."""
    parents, cidx, valid = tree.parents[r].tolist(), tree.cand_index[r].tolist(), tree.valid[r].tolist()
    out = {0: ()}
    for i in range(len(parents)):
        if valid[i]:
            out[i + 1] = out[parents[i]] + (cidx[i],)
    del out[0]
    return out


def rank_key(score, path):
    """The tie rule: higher score, then shallower, then the lexicographically smaller candidate-index tuple."""
    return (-score, len(path), path)


def path_score(logw, r, path):
    score = 0.0
    for t, c in enumerate(path):
        score = f32(score + logw[r][t][path[t - 1] if t else 0][c])
    return score


def check_tree(tree, logw, cand_ids, budget, max_depth):
    """Structure, scores, order, and the top-N property by the frontier: the chosen nodes are
    closed under prefixes and each ranks above every unchosen node whose parent is chosen (every
    unchosen node ranks below such a node, its ancestor or itself), so they are the N first."""
    b, n, M = cand_ids.shape
    lw = logw.float().tolist()
    for r in range(b):
        md = n if max_depth is None else min(int(max_depth[r]), n)
        valid = tree.valid[r].tolist()
        count = sum(valid)
        total = sum(M**d for d in range(1, md + 1))
        assert count == min(budget, total)
        assert valid == [True] * count + [False] * (budget - count)  # padding last
        paths = paths_of(tree, r)
        parents, depth = tree.parents[r].tolist(), tree.depth[r].tolist()
        tokens, scores = tree.tokens[r].tolist(), tree.scores[r].tolist()
        for i in range(count):
            p = parents[i]
            assert 0 <= p <= i and (p == 0 or valid[p - 1])  # ancestors precede descendants
            assert depth[i] == (1 if p == 0 else depth[p - 1] + 1) == len(paths[i + 1]) <= md
            assert tokens[i] == cand_ids[r, depth[i] - 1, paths[i + 1][-1]]
            assert scores[i] == path_score(lw, r, paths[i + 1])  # exactly: the same float32 sums
        for i in range(count, budget):
            assert (tokens[i], parents[i], depth[i], scores[i]) == (0, 0, 1, float("-inf"))
        siblings = [(parents[i], tokens[i]) for i in range(count)]
        assert len(set(siblings)) == count  # siblings carry distinct tokens
        keys = [(depth[i], -scores[i], paths[i + 1]) for i in range(count)]
        assert keys == sorted(keys)  # canonical order
        chosen = set(paths.values())
        frontier = [path + (c,) for path in [()] + list(chosen) if len(path) < md for c in range(M)]
        frontier = [f for f in frontier if f not in chosen]
        if frontier:
            worst = max(rank_key(scores[i], paths[i + 1]) for i in range(count))
            best_left = min(rank_key(path_score(lw, r, f), f) for f in frontier)
            assert worst < best_left


def assert_same_tree(a, b):
    assert a.slots == b.slots
    for name in ("tokens", "parents", "depth", "scores", "valid", "cand_index"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name


TIE_CASES = [
    dict(kind="marginal", b=2, n=3, K=4, V=4, ties=True, seed=3, budget=20, max_depth=[3, 1]),
    dict(kind="selector", b=3, n=7, K=16, V=20, ties=True, seed=11, budget=64, max_depth=None),
    dict(kind="selector", b=2, n=2, K=1, V=1, ties=False, seed=0, budget=5, max_depth=[2, 0]),
]


@settings(FAST, max_examples=300)
@with_examples(TIE_CASES)
@given(tree_inputs())
def test_build_tree_equals_the_heap_reference(cfg):
    logw, cand_ids, md = build_both(cfg)
    tree = verify.build_tree(logw, cand_ids, cfg["budget"], md)
    assert_same_tree(tree, verify.build_tree_reference(logw, cand_ids, cfg["budget"], md))
    check_tree(tree, logw, cand_ids, cfg["budget"], md)


@settings(FAST, max_examples=100)
@with_examples(TIE_CASES[:1])
@given(tree_inputs(max_n=4, max_k=4, max_budget=40))
def test_build_tree_is_the_brute_force_top_n(cfg):
    """Every path ranked by the tie rule; the first N, in canonical order, are the tree."""
    logw, cand_ids, md = build_both(cfg)
    tree = verify.build_tree(logw, cand_ids, cfg["budget"], md)
    b, n, M = cand_ids.shape
    lw = logw.tolist()
    for r in range(b):
        depth = n if md is None else min(int(md[r]), n)
        every = [p for d in range(1, depth + 1) for p in itertools.product(range(M), repeat=d)]
        best = sorted(every, key=lambda p: rank_key(path_score(lw, r, p), p))[: cfg["budget"]]
        best.sort(key=lambda p: (len(p), -path_score(lw, r, p), p))
        assert list(paths_of(tree, r).values()) == best


def test_score_helpers():
    gen = torch.Generator().manual_seed(0)
    S = torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64)
    U = torch.randn(2, 3, 10, generator=gen)
    cand = torch.randn(2, 3, 10, generator=gen).topk(4, -1).indices
    logw = verify.selector_log_weights(S, U, cand)
    # The same law built the long way: a full-vocabulary row, U_t with the candidates' entries replaced by S_t(a, .).
    for r, t, a in itertools.product(range(2), range(3), range(4)):
        row = U[r, t].double().clone()
        row[cand[r, t]] = S[r, t, a]
        want = torch.log_softmax(row, -1)[cand[r, t]]
        assert torch.allclose(logw[r, t, a].double(), want, atol=1e-6)
    assert logw.dtype == torch.float32 and bool((logw <= 0).all())
    # Candidates that are the whole vocabulary: the walk's law itself.
    full = U[:, :, :4].topk(4, -1).indices
    assert torch.allclose(verify.selector_log_weights(S, U[:, :, :4], full), torch.log_softmax(S.float(), -1))
    for width, M in ((4, 4), (10, 10), (64, 10)):
        ids, lw = verify.marginal_log_weights(U, width)
        assert ids.shape == (2, 3, M) and lw.shape == (2, 3, M, M)
        assert torch.equal(ids, U.topk(M, -1).indices)
        assert torch.equal(lw[:, :, 1], torch.log_softmax(U, -1).gather(-1, ids))
        assert lw.stride(2) == 0  # the same row for every parent, not a copy


def test_tree_functions_never_sync_with_the_host():
    """On the meta device any read of a value (item, tolist, bool, nonzero) raises."""
    b, n, V, N = 3, 4, 20, 8
    ids, lw = verify.marginal_log_weights(torch.randn(b, n, V, device="meta"), 5)
    tree = verify.build_tree(lw, ids, N, torch.zeros(b, dtype=torch.long, device="meta"))
    assert verify.tree_ancestors(tree.parents).shape == (b, N + 1, N + 1)
    greedy = verify.verify_tree_greedy(tree, torch.randn(b, N + 1, V, device="meta"))
    sampled = verify.verify_tree_sampled(tree, torch.rand(b, N + 1, V, device="meta"),
                                         torch.rand(b, N + 1, device="meta"))
    for out in (greedy, sampled):
        assert [x.shape for x in out] == [(b,), (b, n), (b, n + 1), (b, N + 1)]


# --- hand-drawn trees ---


@st.composite
def drawn_trees(draw, vocab, n, max_nodes=8, max_padding=2):
    """(parents, tokens, valid): valid nodes first, each child of the anchor or an earlier node, depth <= n,
    siblings distinct; then padding nodes with any parent and token (they must be ignored)."""
    parents, tokens, depth = [], [], [0]
    for _ in range(draw(st.integers(0, max_nodes))):
        open_ = [e for e in range(len(depth)) if depth[e] < n
                 and sum(p == e for p in parents) < vocab]
        if not open_:
            break
        p = draw(st.sampled_from(open_))
        used = {t for q, t in zip(parents, tokens) if q == p}
        t = draw(st.sampled_from([t for t in range(vocab) if t not in used]))
        parents.append(p), tokens.append(t), depth.append(depth[p] + 1)
    count = len(parents)
    for _ in range(draw(st.integers(0, max_padding))):
        parents.append(draw(st.integers(0, len(parents))))
        tokens.append(draw(st.integers(0, vocab - 1)))
    return parents, tokens, [True] * count + [False] * (len(parents) - count)


def make_tree(parents, tokens, valid, n):
    """A one-row Tree from lists (depth from the parents; scores are not used by the verifiers)."""
    depth = []
    for p in parents:
        depth.append(1 if p == 0 else depth[p - 1] + 1)
    N = len(parents)
    kids = [(p, t) for p, t, v in zip(parents, tokens, valid) if v]
    assert len(set(kids)) == len(kids) and all(d <= n for d, v in zip(depth, valid) if v)
    long = lambda x: torch.tensor([x], dtype=torch.long).view(1, N)  # noqa: E731
    return verify.Tree(long(tokens), long(parents), long(depth), torch.zeros(1, N),
                       torch.tensor([valid], dtype=torch.bool).view(1, N), long([0] * N), slots=n)


def slow_ancestors(parents):
    """A[i, j] by walking up from every entry, one parent at a time."""
    b, N = parents.shape
    A = torch.zeros(b, N + 1, N + 1, dtype=torch.bool)
    for r in range(b):
        par = [0] + parents[r].tolist()
        for i in range(N + 1):
            j = i
            A[r, i, j] = True
            while j != 0:
                j = par[j]
                A[r, i, j] = True
    return A


def missing_closure(parents):
    """Planted bug: each entry sees itself and its parent only (no repeated closure)."""
    b, N = parents.shape
    par = torch.cat([parents.new_zeros(b, 1), parents], 1)
    return torch.eye(N + 1, dtype=torch.bool).expand(b, N + 1, N + 1) | torch.nn.functional.one_hot(par, N + 1).bool()


@settings(FAST, max_examples=60)
@given(st.integers(1, 7), st.data())
def test_tree_ancestors_match_a_parent_walk(n, data):
    trees = [data.draw(drawn_trees(5, n, max_nodes=20)) for _ in range(data.draw(st.integers(1, 3)))]
    N = max(len(t[0]) for t in trees)
    parents = torch.tensor([t[0] + [0] * (N - len(t[0])) for t in trees], dtype=torch.long).view(len(trees), N)
    assert torch.equal(verify.tree_ancestors(parents), slow_ancestors(parents))


def test_missing_ancestor_is_caught():
    """The check above fails for a mask that lacks the closure: a chain of 3 under the anchor."""
    parents = torch.tensor([[0, 1, 2, 0]])
    assert torch.equal(verify.tree_ancestors(parents), slow_ancestors(parents))
    assert not torch.equal(missing_closure(parents), slow_ancestors(parents))
    cand_ids, logw = verify.marginal_log_weights(torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(0)), 3)
    tree = verify.build_tree(logw, cand_ids, 16)  # 3 nodes at depth 1, so some deeper
    assert not torch.equal(missing_closure(tree.parents), slow_ancestors(tree.parents))


# --- a toy target over every prefix of a tiny vocabulary ---


def all_prefixes(vocab, max_len):
    return [t for k in range(max_len + 1) for t in itertools.product(range(vocab), repeat=k)]


def toy_logits(vocab, n, gen):
    return 2 * torch.randn(len(all_prefixes(vocab, n)), vocab, generator=gen, dtype=torch.float64)


def entry_prefixes(tree, r=0):
    """The token tuple of the path to every entry of [anchor, nodes] (padding: its own parent chain)."""
    parents, tokens = tree.parents[r].tolist(), tree.tokens[r].tolist()
    prefix = [()]
    for p, t in zip(parents, tokens):
        prefix.append(prefix[p] + (t,) if p < len(prefix) else (t,))
    return prefix


def child_of(tree, entry, token, r=0):
    """The valid child of entry carrying token, by the definition (None if there is none)."""
    for j, (p, t, v) in enumerate(zip(tree.parents[r].tolist(), tree.tokens[r].tolist(), tree.valid[r].tolist())):
        if v and p == entry and t == token:
            return j + 1
    return None


def tree_sampled_law(tree, P, vocab, n, seed=0):
    """{emitted tokens: probability} of the real verify_tree_sampled on a one-row tree, exactly, with no sampling.

    Its output is a function of the uniforms, constant while each u_i stays inside one token's
    interval of P_i's inverse CDF. Walk the tree by the definition: at an entry, every token t
    with P(t) > 0 is drawn with u = the middle of t's interval; descend if a valid child carries t,
    else the walk ends. One batched call on every walk (the other entries' uniforms random),
    weighted by its probability, is the exact law when the code follows the definition.
    Also returns, per walk, the tokens the definition emits, for a direct comparison.
    """
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    prefixes = entry_prefixes(tree)
    rows = [index.get(x, 0) for x in prefixes]  # padding entries: any row
    p = P.tolist()
    cases = []  # (probability, {entry: u}, emitted tokens)

    def walk(entry, prefix, reach, fixed):
        dist = p[index[prefix]]
        total, below = sum(dist), 0.0
        for t, mass in enumerate(dist):
            if mass > 0:
                u = {**fixed, entry: (below + mass / 2) / total}
                child = child_of(tree, entry, t)
                if child is None:
                    cases.append((reach * mass / total, u, prefix + (t,)))
                else:
                    walk(child, prefix + (t,), reach * mass / total, u)
            below += mass

    walk(0, (), 1.0, {})
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(len(cases), len(prefixes), generator=gen, dtype=torch.float64)
    for k, (_, fixed, _) in enumerate(cases):
        for entry, value in fixed.items():
            u[k, entry] = value
    batch = tree_batch(tree, len(cases))
    padding = [1 + j for j, v in enumerate(tree.valid[0].tolist()) if not v]
    p_entries = P[rows].clone()
    p_entries[padding] = torch.nn.functional.one_hot(torch.tensor(0), vocab).to(P.dtype)  # a law no walk may use
    num_accepted, path, out, y = verify.verify_tree_sampled(batch, p_entries.expand(len(cases), -1, -1), u)
    entry_valid = torch.cat([torch.ones(len(cases), 1, dtype=torch.bool), batch.valid], 1)
    assert entry_valid.gather(1, path.clamp(min=0)).all()  # the path goes through valid nodes only
    assert ((out >= 0) == (torch.arange(n + 1) <= num_accepted[:, None])).all()
    assert ((path >= 0) == (torch.arange(n) < num_accepted[:, None])).all()
    # the path's tokens are the draws at their parents, the emitted token the draw at the last node
    visited = torch.cat([torch.zeros(len(cases), 1, dtype=torch.long), path.clamp(min=0)], 1)
    assert torch.equal(torch.where(out >= 0, y.gather(1, visited), -1), out)
    law = {}
    for (prob, _, _), a, row in zip(cases, num_accepted.tolist(), out.tolist()):
        law[tuple(row[: a + 1])] = law.get(tuple(row[: a + 1]), 0.0) + prob
    return law, [(prob, emitted, tuple(row[: a + 1]))
                 for (prob, _, emitted), a, row in zip(cases, num_accepted.tolist(), out.tolist())]


def tree_batch(tree, rows):
    return verify.Tree(*(x.expand(rows, -1) for x in tree[:6]), slots=tree.slots)


def max_error_against_target(law, P, vocab, n):
    """max over sequences s of length n+1 of
    |Pr(the verifier emits a prefix of s, then the target continues to s) - Pr_target(s)|."""
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    p = P.tolist()
    worst = 0.0
    for seq in itertools.product(range(vocab), repeat=n + 1):
        step = [p[index[seq[:j]]][seq[j]] for j in range(n + 1)]
        emitted = sum(law.get(seq[:m], 0.0) * math.prod(step[m:]) for m in range(1, n + 2))
        worst = max(worst, abs(emitted - math.prod(step)))
    return worst


toy_settings = st.fixed_dictionaries({
    "vocab": st.integers(2, 5),
    "n": st.integers(1, 3),
    "temperature": st.floats(0.3, 2.0),
    "top_k": st.integers(0, 5),
    "top_p": st.one_of(st.just(1.0), st.floats(0.2, 1.0)),
    "seed": st.integers(0, 2**31 - 1),
})


def toy_target(cfg):
    gen = torch.Generator().manual_seed(cfg["seed"])
    logits = toy_logits(cfg["vocab"], cfg["n"], gen)
    return logits, verify.process_logits(logits, cfg["temperature"], cfg["top_k"], cfg["top_p"])


# Fixed cases, run every time: a full two-level tree; a deep chain with side branches and two
# padding nodes, each carrying a token the target may draw at its parent that no valid child carries.
HARD_TREES = [
    (dict(vocab=3, n=2, temperature=0.7, top_k=2, top_p=0.95, seed=12),
     ([0, 0, 0, 1, 1, 2, 2, 3], [0, 1, 2, 0, 1, 2, 0, 1], 0)),
    (dict(vocab=4, n=3, temperature=1.7, top_k=3, top_p=0.8, seed=8),
     ([0, 1, 2, 1, 0, 0, 1], [2, 0, 3, 1, 1, 3, 2], 2)),
]


def hard_tree(case):
    cfg, (parents, tokens, padding) = case
    valid = [True] * (len(parents) - padding) + [False] * padding
    return cfg, make_tree(parents, tokens, valid, cfg["n"])


@settings(FAST, max_examples=150)
@given(toy_settings, st.data())
def test_sampled_tree_verification_is_the_target_law(cfg, data):
    """Exact enumeration on drawn tree shapes: every sequence has the target's probability to 1e-9."""
    vocab, n = cfg["vocab"], cfg["n"]
    tree = make_tree(*data.draw(drawn_trees(vocab, n)), n)
    _, P = toy_target(cfg)
    law, walks = tree_sampled_law(tree, P, vocab, n, seed=cfg["seed"])
    assert abs(sum(law.values()) - 1) < 1e-12
    assert max_error_against_target(law, P, vocab, n) < 1e-9
    for prob, emitted, got in walks:
        assert got == emitted or prob < 1e-12  # (cells too thin for a float64 midpoint)


@pytest.mark.parametrize("case", HARD_TREES)
def test_sampled_tree_verification_fixed_trees(case):
    cfg, tree = hard_tree(case)
    _, P = toy_target(cfg)
    law, walks = tree_sampled_law(tree, P, cfg["vocab"], cfg["n"])
    assert max_error_against_target(law, P, cfg["vocab"], cfg["n"]) < 1e-9
    for prob, emitted, got in walks:
        assert got == emitted or prob < 1e-12


def monte_carlo_tv(cfg, tree):
    """verify_tree_sampled on MC_ROWS rows of float32 uniforms: the TV distance to the exact law, and a
    bound it stays under with probability >= 1 - exp(-40)."""
    vocab, n = cfg["vocab"], cfg["n"]
    _, P = toy_target(cfg)
    law, _ = tree_sampled_law(tree, P, vocab, n)
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    rows = [index.get(x, 0) for x in entry_prefixes(tree)]
    gen = torch.Generator().manual_seed(cfg["seed"])
    u = torch.rand(MC_ROWS, len(rows), generator=gen)
    _, _, out, _ = verify.verify_tree_sampled(tree_batch(tree, MC_ROWS), P[rows].float().expand(MC_ROWS, -1, -1), u)
    weights = (vocab + 1) ** torch.arange(n + 1)
    codes = ((out + 1) * weights).sum(-1)
    keys = torch.tensor([list(k) + [-1] * (n + 1 - len(k)) for k in law])
    exact = dict(zip(((keys + 1) * weights).sum(-1).tolist(), law.values()))
    found, counts = codes.unique(return_counts=True)
    empirical = dict(zip(found.tolist(), (counts / MC_ROWS).tolist()))
    tv = 0.5 * sum(abs(empirical.get(k, 0.0) - exact.get(k, 0.0)) for k in exact.keys() | empirical.keys())
    # E[TV] <= 1/2 sum sqrt(p/N); TV moves by <= 1/N per sample, so McDiarmid: P(TV > E + t) <= exp(-40).
    bound = 0.5 * sum(math.sqrt(v / MC_ROWS) for v in exact.values()) + math.sqrt(40 / (2 * MC_ROWS))
    return tv, bound


def test_sampled_tree_verification_monte_carlo_fixed_tree():
    tv, bound = monte_carlo_tv(*hard_tree(HARD_TREES[1]))
    assert tv < bound


@settings(FAST, max_examples=3)
@given(toy_settings, st.data())
def test_sampled_tree_verification_monte_carlo(cfg, data):
    tv, bound = monte_carlo_tv(cfg, make_tree(*data.draw(drawn_trees(cfg["vocab"], cfg["n"])), cfg["n"]))
    assert tv < bound


# --- planted bug: the p/q rule on deterministic children ---


def pq_children_law(tree, P, Q, vocab, n):
    """Exact law of a broken verifier: at each node, test its children in order, accepting child c
    with probability min(1, P(c) / q(c)) (q: the drafter's marginal at the children's slot), and
    after a rejection go on with P = normalize(max(P - q, 0)); when every child is rejected, emit a
    draw from what is left. Lossless only if the children were drawn from q; here they are chosen."""
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    prefixes = entry_prefixes(tree)
    kids = {e: [j + 1 for j, p in enumerate(tree.parents[0].tolist()) if p == e and tree.valid[0, j]]
            for e in range(len(prefixes))}
    law = {}

    def walk(entry, reach):
        prefix = prefixes[entry]
        p = P[index[prefix]]
        q = Q[len(prefix)] if len(prefix) < n else None  # (a node at depth n has no children)
        for child in kids[entry]:
            c = prefixes[child][-1]
            alpha = float(verify.acceptance_probability(p[c], q[c]))
            walk(child, reach * alpha)
            reach *= 1 - alpha
            p = verify.residual_distribution(p, q)
        for t in range(vocab):
            law[prefix + (t,)] = law.get(prefix + (t,), 0.0) + reach * float(p[t])

    walk(0, 1.0)
    return law


def test_pq_rule_on_deterministic_children_is_caught():
    """A tree of the drafter's top marginal tokens (DDTree's scores) over V = 4: the exact law of the
    real verifier is the target's; the p/q mutant's is off by more than 1e-2."""
    vocab, n = 4, 2
    gen = torch.Generator().manual_seed(1)
    U = 2 * torch.randn(1, n, vocab, generator=gen, dtype=torch.float64)
    cand_ids, logw = verify.marginal_log_weights(U, 3)
    tree = verify.build_tree(logw, cand_ids, 6)
    Q = torch.softmax(U[0], -1)  # the drafter's marginal per slot
    P = verify.process_logits(toy_logits(vocab, n, gen), 0.8, 3, 0.95)
    law, _ = tree_sampled_law(tree, P, vocab, n)
    assert max_error_against_target(law, P, vocab, n) < 1e-9
    mutant = pq_children_law(tree, P, Q, vocab, n)
    assert abs(sum(mutant.values()) - 1) < 1e-9  # a distribution, only the wrong one
    assert max_error_against_target(mutant, P, vocab, n) > 1e-2


# --- a chain is a tree ---


def chain_tree(drafts, num_drafts=None):
    b, n = drafts.shape
    parents = torch.arange(n).expand(b, n)
    valid = torch.ones(b, n, dtype=torch.bool) if num_drafts is None else torch.arange(n) < num_drafts[:, None]
    return verify.Tree(drafts, parents, torch.arange(1, n + 1).expand(b, n), torch.zeros(b, n), valid,
                       torch.zeros(b, n, dtype=torch.long), slots=n)


@settings(FAST, max_examples=60)
@given(st.integers(1, 4), st.integers(1, 7), st.integers(2, 6), st.booleans(), st.integers(0, 2**31 - 1))
def test_chain_tree_verifies_as_verify_greedy(b, n, vocab, cut, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, n + 1, vocab, generator=gen)
    drafts = logits[:, :n].argmax(-1)
    wrong = torch.rand(b, n, generator=gen) < 0.2
    drafts = torch.where(wrong, torch.randint(0, vocab, (b, n), generator=gen), drafts)
    num_drafts = torch.randint(0, n + 1, (b,), generator=gen) if cut else None
    a, out = verify.verify_greedy(drafts, logits, num_drafts)
    ta, path, tout, y = verify.verify_tree_greedy(chain_tree(drafts, num_drafts), logits)
    assert torch.equal(a, ta) and torch.equal(out, tout)
    assert torch.equal(path, torch.where(torch.arange(1, n + 1) <= a[:, None], torch.arange(1, n + 1), -1))
    assert torch.equal(y, logits.argmax(-1))


@settings(FAST, max_examples=40)
@given(st.integers(1, 4), st.integers(1, 7), st.integers(1, 64), st.integers(0, 2**31 - 1), st.data())
def test_built_single_chain_verifies_as_verify_greedy(b, n, budget, seed, data):
    """One candidate per slot: build_tree gives the chain of the first min(budget, max_depth) drafts."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 6
    cand_ids, logw = verify.marginal_log_weights(torch.randn(b, n, vocab, generator=gen), 1)
    max_depth = torch.tensor(data.draw(st.lists(st.integers(0, n), min_size=b, max_size=b)))
    tree = verify.build_tree(logw, cand_ids, budget, max_depth)
    N, drafts = min(budget, n), cand_ids[..., 0]
    assert torch.equal(tree.parents[:, :N], torch.where(tree.valid[:, :N], torch.arange(N), 0))
    logits = torch.randn(b, n + 1, vocab, generator=gen)
    boost = 3.0 * (torch.rand(b, n, 1, generator=gen) < 0.7).float()
    logits[:, :n].scatter_add_(-1, drafts[..., None], boost)  # so that some drafts are accepted
    a, out = verify.verify_greedy(drafts, logits, max_depth.clamp(max=budget))
    # entry i of the chain is node i at depth i: the target's row i (padding entries: any row)
    rows = torch.arange(budget + 1).clamp(max=n).expand(b, budget + 1)
    ta, _, tout, _ = verify.verify_tree_greedy(tree, logits.gather(1, rows[..., None].expand(-1, -1, vocab)))
    assert torch.equal(a, ta) and torch.equal(out, tout)


def chain_verify_sampled_law(drafts, P_rows, num_drafts):
    """{emitted: probability} of the real verify_sampled with one-hot q on fixed drafts, exactly:
    every cell of u_accept (below or above alpha_i = P_{i-1}(d_i)) and of u_emit (token intervals of
    the residual, P_a without d_{a+1}, or P_n)."""
    n = len(drafts)
    p = P_rows.tolist()
    cases = []
    for passes in itertools.product((True, False), repeat=n):
        alpha = [p[i][drafts[i]] if i < num_drafts else 0.0 for i in range(n)]
        cell = math.prod(a if ok else 1 - a for a, ok in zip(alpha, passes))
        if cell == 0:
            continue
        stop = passes.index(False) if False in passes else n
        emit = list(p[stop])
        if stop < num_drafts:
            emit[drafts[stop]] = 0.0
        total, below = sum(emit), 0.0
        for t, r in enumerate(emit):
            if r > 0:
                u_accept = [a / 2 if ok else (1 + a) / 2 for a, ok in zip(alpha, passes)]
                cases.append((cell * r / total, u_accept, (below + r / 2) / total))
            below += r
    probs, u_accept, u_emit = zip(*cases)
    k = len(cases)
    d = torch.tensor(drafts).expand(k, n)
    q = torch.nn.functional.one_hot(d, P_rows.shape[-1]).to(torch.float64)
    u_accept = torch.tensor(u_accept, dtype=torch.float64).view(k, n)
    a, out = verify.verify_sampled(d, q, P_rows.expand(k, -1, -1), u_accept, torch.tensor(u_emit, dtype=torch.float64),
                                   torch.full((k,), num_drafts))
    law = {}
    for prob, ai, row in zip(probs, a.tolist(), out.tolist()):
        law[tuple(row[: ai + 1])] = law.get(tuple(row[: ai + 1]), 0.0) + prob
    return law


@settings(FAST, max_examples=80)
@given(toy_settings, st.data())
def test_chain_tree_has_the_law_of_verify_sampled(cfg, data):
    """Same drafts, same target: the chain-shaped tree and verify_sampled with one-hot q emit the same law."""
    vocab, n = cfg["vocab"], cfg["n"]
    drafts = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    num_drafts = data.draw(st.integers(0, n))
    _, P = toy_target(cfg)
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    P_rows = P[[index[tuple(drafts[:i])] for i in range(n + 1)]]
    chain = chain_verify_sampled_law(drafts, P_rows, num_drafts)
    tree = chain_tree(torch.tensor([drafts]), torch.tensor([num_drafts]))
    law, _ = tree_sampled_law(tree, P, vocab, n)
    assert max(abs(chain.get(k, 0.0) - law.get(k, 0.0)) for k in chain.keys() | law.keys()) < 1e-12


# --- greedy: the target's own continuation ---


@settings(FAST, max_examples=150)
@given(st.integers(2, 5), st.integers(1, 3), st.integers(0, 2**31 - 1), st.data())
def test_greedy_tree_emits_the_target_greedy_chain(vocab, n, seed, data):
    """Out = the target's greedy tokens g_1..g_{a+1}, a = the longest prefix of g that is a path of valid nodes."""
    tree = make_tree(*data.draw(drawn_trees(vocab, n, max_nodes=12)), n)
    logits = toy_logits(vocab, n, torch.Generator().manual_seed(seed))
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    greedy = ()
    for _ in range(n + 1):
        greedy += (int(logits[index[greedy]].argmax()),)
    entry, a = 0, 0
    while a < n and (child := child_of(tree, entry, greedy[a])) is not None:
        entry, a = child, a + 1
    rows = [index.get(x, 0) for x in entry_prefixes(tree)]
    num_accepted, path, out, _ = verify.verify_tree_greedy(tree, logits[rows][None])
    assert int(num_accepted) == a
    assert out[0].tolist() == list(greedy[: a + 1]) + [-1] * (n - a)
    assert [entry_prefixes(tree)[e] for e in path[0, :a].tolist()] == [greedy[:k] for k in range(1, a + 1)]


def test_greedy_on_built_trees_batched():
    """Built trees, a batch: each row's out tokens are the greedy chain of its toy target while the tree holds it."""
    vocab, n, b = 5, 3, 4
    gen = torch.Generator().manual_seed(7)
    cand_ids, logw = verify.marginal_log_weights(torch.randn(b, n, vocab, generator=gen), 3)
    tree = verify.build_tree(logw, cand_ids, 10, torch.tensor([3, 2, 1, 0]))
    logits = toy_logits(vocab, n, gen)
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    rows = [[index.get(x, 0) for x in entry_prefixes(tree, r)] for r in range(b)]
    num_accepted, _, out, _ = verify.verify_tree_greedy(tree, logits[torch.tensor(rows)])
    for r in range(b):
        greedy, entry, a = (), 0, 0
        for _ in range(n + 1):
            greedy += (int(logits[index[greedy]].argmax()),)
        while a < n and (child := child_of(tree, entry, greedy[a], r)) is not None:
            entry, a = child, a + 1
        assert int(num_accepted[r]) == a and out[r, : a + 1].tolist() == list(greedy[: a + 1])
