"""The speculation policy (policy.py) keeps the output exact: greedy runs equal the target's for any costs,
the chain's cut is a stopping rule whose sampled law is the target's (exact enumeration, then Monte Carlo
through the loop), a cut that looks at the draft itself is caught, and a run's widths replay from its trace."""
import itertools
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from dflash2 import policy as pol, spec_decode as sd, verify
from dflash2.settings import AUTO_TREE_CAP
from dflash2.target import Target
from targets import ARCHS, TREE_ARCHS, reference_greedy, synthetic_costs, tiny_drafter, tiny_target
from test_spec_decode import _loop_tv, _sampling_pair, greedy_with_margins
from test_verify import all_prefixes, build_toy, max_error_against_target, toy_settings

_pairs = {}


def pair(arch):
    if arch not in _pairs:
        model = tiny_target(arch)
        drafter = tiny_drafter(model)
        _pairs[arch] = (model, Target(model, drafter.config.target_layer_ids), drafter)
    return _pairs[arch]


def costs(slope, draft, tree=None):
    """Synthetic costs: V(w, b) = 1 + slope (b w - 1), a draft of `draft` one-token forwards at every b."""
    return synthetic_costs(slope, draft, 0.0, tree=tree)


costs_st = st.builds(costs, st.floats(0.0, 0.6), st.floats(0.0, 3.0))


def untied_greedy(model, prompt, n):
    """reference_greedy's tokens, for a prompt whose continuation has no near-tie between the top two logits (an
    exact tie, which a tiny random target can hold, is broken either way by a forward of another shape)."""
    tokens, margins = greedy_with_margins(model, prompt, n)
    assume(min(margins) > 1e-4)
    return tokens


# --- greedy: any cut is lossless ---


@pytest.mark.parametrize("method", ["dflash2", "dflash", "dflash2-tree"])
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), c=costs_st, n=st.integers(1, 16))
def test_greedy_with_the_policy_matches_target(method, data, c, n):
    arch = data.draw(st.sampled_from(TREE_ARCHS if method == "dflash2-tree" else ARCHS))
    model, target, drafter = pair(arch)
    prompts = data.draw(st.lists(st.lists(st.integers(0, 62), min_size=1, max_size=10), min_size=1, max_size=3))
    cap = 32 if method == "dflash2-tree" else 8
    policy = pol.Policy(c, cap, tree=method == "dflash2-tree")
    results = sd.generate(target, drafter, prompts, method=method, max_new_tokens=n, policy="auto",
                          max_batch=data.draw(st.sampled_from([None, 1, 2])), policy_override=policy)
    for prompt, res in zip(prompts, results):
        assert res.tokens == untied_greedy(model, prompt, n)
        assert len(res.widths) == res.verify_steps - 1 and all(1 <= w <= cap + 1 for w in res.widths)


def test_drafting_that_does_not_pay_turns_into_plain_steps_and_back(monkeypatch):
    """Costly drafts: after the first drafted steps the rows decode plainly (width 1), trying again after 2, 4,
    8, ... plain steps; free drafts and flat costs: every step drafts the whole block (with PAY at 1: a free step
    that makes one token a row, as this random drafter's do, breaks even)."""
    model, target, drafter = pair("llama")
    prompts = [[1, 2, 3], [9, 8, 7, 6]]
    dear = sd.generate(target, drafter, prompts, max_new_tokens=40, policy="auto",
                       policy_override=pol.Policy(costs(0.05, 4.0), 8))
    for prompt, res in zip(prompts, dear):
        assert res.tokens == reference_greedy(model, prompt, 40)
        assert res.widths.count(1) > len(res.widths) / 2 and max(res.widths) > 1
    monkeypatch.setattr(pol, "PAY", 1.0)
    cheap = sd.generate(target, drafter, prompts, max_new_tokens=40, policy="auto",
                        policy_override=pol.Policy(costs(0.0, 0.0), 8))
    for r in cheap:  # every step the whole block, or what is left of the request's budget
        emitted = [1 + sum(a + 1 for a in r.accepted[:i]) for i in range(len(r.accepted))]
        assert r.widths == [min(8, 41 - e) for e in emitted]


def plain_runs(policy, accepted):
    """Drive one request through the policy's host state: each drafted step accepts the next count of
    `accepted`. Returns the lengths of the plain runs between drafted steps."""
    runs, plain, told = [], 0, iter(accepted)
    while True:
        if not policy.begin([0], [0], [True]):
            plain += 1
            policy.end([True], [0], False, 1)
            continue
        runs.append(plain)
        plain = 0
        n = next(told, None)
        if n is None:
            return runs[1:]
        policy.end([True], [n], True, n + 1)


def test_failed_tries_double_the_wait_and_a_paying_try_halves_it(monkeypatch):
    """Drafting costs a step 1 (DRAFT_SLACK D's) and a verify 1 + 0.1 (w - 1): a step that accepts nothing makes 1
    token for 2, one that accepts 5 makes 6 for 2.5. The waits double up to 64; each drafted step after which the
    rate still pays halves the wait. (No floor from the loss here: test_a_dear_try_waits_until_its_loss_is_a_small_share.)"""
    monkeypatch.setattr(pol, "EXPLORE", float("inf"))
    fail, win = [0] * 10, [5]
    runs = plain_runs(pol.Policy(costs(0.1, 1.0 / pol.DRAFT_SLACK), 8), fail + win + [0, 0])
    assert runs[:10] == [2, 4, 8, 16, 32, 64, 64, 64, 64, 64]  # the first drafted step is judged on its own; the
    # last wait is the paying try's
    # the paying try (rate 0.7 * 0.9 + 0.3 * 6 / 2.5 = 1.35) and the failure after it (1.10) each halve the wait;
    # the second failure (0.92) waits 16 plain steps, where the policy before halving waited 2
    assert runs[10:] == [0, 0, 16]


def test_a_dear_try_waits_until_its_loss_is_a_small_share():
    """A failed try that cost 2 plain steps for 1 token a row lost 1 plain step: the batch waits 1 / EXPLORE = 100
    plain steps before the next (more than the doubling's 2, 4, .. 64), so failed tries cost EXPLORE of the time; a
    cheap failed try (it lost 0.045 of a step) waits 5 steps at first (0.045 / EXPLORE = 4.5), then the doubling's."""
    assert pol.EXPLORE == 0.01
    assert plain_runs(pol.Policy(costs(0.1, 1.0 / pol.DRAFT_SLACK), 8), [0] * 7) == [100] * 7
    assert plain_runs(pol.Policy(costs(0.1, 0.045 / pol.DRAFT_SLACK), 8), [0] * 7) == [5, 5, 8, 16, 32, 64, 64]


def test_a_batchs_failed_try_is_charged_at_its_slowest_row():
    """A drafted step costs 2 plain steps (flat verify, a draft of one). Two rows that make 3 and 1 tokens average 2,
    break-even by their rate, yet the batch's run is as long as its slower row's, which made 1 token for 2: the try
    lost 1 plain step, and the batch waits 1 / EXPLORE = 100 steps. One row that makes 2 lost nothing and waits the
    doubling's 2."""
    batch = pol.Policy(costs(0.0, 1.0 / pol.DRAFT_SLACK), 8)
    assert batch.begin([0, 1], [0, 0], [True, True])
    batch.end([True, True], [2, 0], True, 3)
    assert batch.rate() == 1.0 and batch.plain_left == round(1 / pol.EXPLORE)
    assert plain_runs(pol.Policy(costs(0.0, 1.0 / pol.DRAFT_SLACK), 8), [1]) == [2]


def test_drafting_the_model_calls_break_even_is_left_to_plain_steps():
    """A drafted step that makes 2 tokens for 1.96 plain steps' cost (rate 1.02: a gain within the costs' error)
    waits, as one that does not pay; one that makes 2 for 1.85 (rate 1.08, over PAY) goes on drafting."""
    assert 1.02 < pol.PAY < 2 / 1.85
    assert plain_runs(pol.Policy(costs(0.0, 0.96 / pol.DRAFT_SLACK), 8), [1, 1, 1, 1]) == [2, 4, 8, 16]
    assert plain_runs(pol.Policy(costs(0.0, 0.85 / pol.DRAFT_SLACK), 8), [1, 1, 1, 1]) == [0, 0, 0, 0]


def compute_bound(rows):
    """Costs at 1 and `rows` rows: one row's forward nearly flat in its tokens (V(w, 1) = 1 + 0.1 (w - 1)); `rows`
    rows' compute-bound, rows tokens cost rows each (V(w, rows) = rows w), so no width pays for a draft there."""
    n = 9
    return pol.Costs([1, rows], [[1 + 0.1 * (w - 1) for w in range(1, n + 1)], [rows * w for w in range(1, n + 1)]],
                     [0.1, 0.5], [0.1, 0.5])


def test_a_batch_where_no_width_can_pay_never_drafts():
    """At 4 rows every width w makes at most w tokens a row for 0.75 + 4 w, against 1 for 4: the batch never drafts,
    not even a first try, and decodes exactly the greedy tokens; one row drafts (8 tokens for 1.85 against 1 for 1)."""
    policy = pol.Policy(compute_bound(4), 8)
    assert not policy.can_pay(4) and policy.can_pay(1)
    assert not policy.begin([0, 1, 2, 3], [0] * 4, [True] * 4) and policy.begin([0], [0], [True])
    model, target, drafter = pair("llama")
    prompts = [[1, 2, 3], [9, 8, 7, 6], [5, 4], [3, 3, 3]]
    results = sd.generate(target, drafter, prompts, max_new_tokens=12, policy_override=pol.Policy(compute_bound(4), 8))
    for prompt, res in zip(prompts, results):
        assert res.tokens == reference_greedy(model, prompt, 12) and set(res.widths) == {1}
    one = sd.generate(target, drafter, prompts[:1], max_new_tokens=12, policy_override=pol.Policy(compute_bound(4), 8))
    assert max(one[0].widths) > 1


def test_a_first_drafted_step_sets_the_rate_and_a_joining_request_takes_the_batchs():
    """Before any drafted step a request has no rate and the batch drafts; the step sets each row's rate to its
    own tokens per unit cost; a request that joins later starts from the live rows' mean, and requests that join
    when no row in flight has a rate start from the batch's last rate, the wait before the next try unchanged."""
    c = costs(0.1, 0.2)
    policy = pol.Policy(c, 8)
    assert policy.begin([0, 1], [0, 0], [True, True]) and policy.rate() == 1.0
    policy.end([True, True], [3, 0], True, 4)
    cost = (pol.DRAFT_SLACK * c.D(2) + c.V(4, 2)) / c.V(1, 2)
    assert [policy.state[r].rate for r in (0, 1)] == [4 / cost, 1 / cost]
    policy.begin([0, 1, 7], [1, 1, 0], [True, False, True])  # row 1 done, request 7 joins
    assert policy.state[7].rate == 4 / cost  # the mean over the live rows with a rate: request 0's
    while policy.plain_left == 0:  # drafted steps that do not pay, until the rate falls and the batch waits
        policy.end([True, False, True], [0, 0, 0], True, 4)
    last, wait = policy.rate(), policy.plain_left
    assert last < pol.PAY and wait > 0
    assert not policy.begin([8, 9], [0, 0], [True, True])  # every row new (a wave after one that ended together):
    assert [policy.state[r].rate for r in (8, 9)] == [last, last] and policy.plain_left == wait  # what was learned


def test_the_batch_verifies_one_width_capped_by_each_rows_budget():
    """One width for the batch: at slot k the live rows' expected tokens (row 0: 0.9^k, row 1: 0.05 at slot 1,
    its last draft) against rho (V(k + 1, 3) - V(k, 3)), rho = 2 live rows / V(1, 3) times their rate 1.3; a row
    with one draft left verifies one, a row that does not decode none."""
    c = costs(0.12, 0.2)
    policy = pol.Policy(c, 8)
    policy.state = {r: pol.RequestState(1.3) for r in range(3)}
    conf = torch.tensor([[0.9] * 4 + [0.1, 0.9, 0.9], [0.05] + [0.9] * 6, [0.9] * 7])
    assert policy.begin([0, 1, 2], [1, 1, 1], [True, True, False])
    keep, width = policy.cut_chain(conf, torch.tensor([7, 1, 7]))
    threshold = 2 / c.V(1, 3) * 1.3 * (c.V(2, 3) - c.V(1, 3))  # 0.755: slot 2 expects 0.81, slot 3 0.729
    assert [0.9 ** k + 0.05 * (k == 1) >= threshold for k in (1, 2, 3)] == [True, True, False]
    assert width == 3 and keep.tolist() == [2, 1, 0]


# --- the batch's width maximises its objective ---


@st.composite
def batch_costs(draw, convex):
    """Drawn costs at 1, 2 and 4 rows (monotone in w and b, through policy.grid_costs); convex: V(., b) convex in w,
    else any measured points."""
    verify, prev = {}, None
    for b in (1, 2, 4):
        if convex:
            lin, quad = draw(st.floats(0.0, 0.5)), draw(st.floats(0.0, 0.1))
            base = 1.0 if b == 1 else prev + draw(st.floats(0.0, 1.0))
            verify[b] = {w: base + lin * (w - 1) + quad * (w - 1) ** 2 for w in range(1, 10)}
            if b > 1:  # at least the fewer rows' cost at every width: a running max would break convexity
                verify[b] = {w: max(v, verify[b // 2][w]) + (verify[b // 2][w] - verify[b // 2][1]) for w, v in
                             verify[b].items()}
        else:
            points = draw(st.lists(st.floats(0.0, 0.6), min_size=3, max_size=3))
            verify[b] = {w: (1.0 if b == 1 else 1.0 + b * 0.1) + sum(points[: i + 1]) for i, w in enumerate((2, 4, 9))}
            verify[b][1] = 1.0 if b == 1 else 1.0 + b * 0.1
        prev = verify[b][1]
    draft = {b: draw(st.floats(0.0, 1.5)) for b in (1, 2, 4)}
    return pol.grid_costs(verify, draft, draft, 9)


class Recording(pol.Policy):
    """The policy, keeping what each chain cut saw and chose."""

    def __init__(self, *args):
        super().__init__(*args)
        self.cuts = []

    def cut_chain(self, conf, allowed):
        allowed_live = (allowed * torch.tensor(self.alive)).tolist()
        keep, width = super().cut_chain(conf, allowed)
        self.cuts.append((conf.double().tolist(), allowed_live, self.rho(), width))
        return keep, width


def objective(conf, allowed, rho, costs, width):
    """E(W) - rho V(W, b) over the batch, the step's constant tokens left out: sum over rows and slots k < W that
    the row may verify of c_1 .. c_k, less rho times the forward's cost."""
    tokens = sum(math.prod(c[:k]) for c, a in zip(conf, allowed) for k in range(1, min(width - 1, a) + 1))
    return tokens - rho * costs.V(width, len(conf))


@pytest.mark.parametrize("convex", [True, False])
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_batch_width_maximises_the_objective(convex, data):
    """Drawn batches under drawn V(w, b): greedy output equals the target's, and at every drafted step the chosen
    width W maximises E(W) - rho V(W, b) over every width (enumerated) when V is convex in w; for any V it is the
    first local maximum: no narrower width does better and the next one does not."""
    c = data.draw(batch_costs(convex))
    model, target, drafter = pair(data.draw(st.sampled_from(ARCHS)))
    prompts = data.draw(st.lists(st.lists(st.integers(0, 62), min_size=1, max_size=8), min_size=1, max_size=4))
    n = data.draw(st.integers(1, 12))
    policy = Recording(c, 8)
    results = sd.generate(target, drafter, prompts, max_new_tokens=n, max_batch=data.draw(st.sampled_from([None, 2])),
                          policy_override=policy)
    for prompt, res in zip(prompts, results):
        assert res.tokens == untied_greedy(model, prompt, n)
    for conf, allowed, rho, width in policy.cuts:
        values = [objective(conf, allowed, rho, c, w) for w in range(1, 1 + max(allowed) + 1)]
        best = values[width - 1]
        assert all(v <= best + 1e-6 for v in values[:width]), (values, width)
        if convex:
            assert all(v <= best + 1e-6 for v in values), (values, width)
        if width < len(values):
            assert values[width] < best + 1e-6, (values, width)


# --- sampled: the chain's cut is a stopping rule ---


def cut_law(P, Q, vocab, n, keep_of):
    """{emitted tokens: probability} of one chain step: the walk draws a whole block d_1..d_n from Q, the cut sees
    the whole block (as the loop's cut sees every slot's confidence) and keep_of(block) says how many of its drafts
    are verified; those go through verify_sampled's rule (its acceptance and residual helpers), and after an
    accepted run the target's own token follows."""
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    alpha = verify.acceptance_probability(P[: len(Q)], Q).tolist()
    residual = verify.residual_distribution(P[: len(Q)], Q).tolist()
    p, q = P.tolist(), Q.tolist()
    law = {}

    def add(seq, mass):
        law[seq] = law.get(seq, 0.0) + mass

    for block in itertools.product(range(vocab), repeat=n):
        reach = math.prod(q[index[block[:j]]][block[j]] for j in range(n))
        if reach == 0:
            continue
        keep = keep_of(block)
        for k in range(keep):
            row, d = index[block[:k]], block[k]
            for t in range(vocab):
                add(block[:k] + (t,), reach * (1 - alpha[row][d]) * residual[row][t])
            reach *= alpha[row][d]
        for t in range(vocab):
            add(block[:keep] + (t,), reach * p[index[block[:keep]]][t])
    return law


def confidences(Q, vocab, n, block):
    """The full vector c_1..c_n of a block: c_k = the largest probability of q(. | d_1..d_{k-1})."""
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    return torch.tensor([[float(Q[index[block[:k]]].max()) for k in range(n)]])


def policy_rule(Q, vocab, n, rho, c, shift=0):
    """The policy's chain_width on the toy (one row), given every slot's confidence; shift=1 (planted) judges slot k by
    c_{k+1}, which reads d_k."""
    def keep_of(block):
        conf = confidences(Q, vocab, n, block)
        conf = torch.cat([conf[:, shift:], torch.ones(1, shift)], 1)
        return pol.chain_width(conf, torch.tensor([n]), rho, c) - 1

    return keep_of


@settings(deadline=None, max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=toy_settings, rho=st.floats(0.5, 4.0), c=costs_st)
def test_the_chain_cut_is_a_stopping_rule_that_keeps_the_target_law(cfg, rho, c):
    P, Q, _ = build_toy(cfg)
    vocab, n = cfg["vocab"], cfg["n"]
    law = cut_law(P, Q, vocab, n, policy_rule(Q, vocab, n, rho, c))
    assert abs(sum(law.values()) - 1) < 1e-12
    assert max_error_against_target(law, P, vocab, n) < 1e-9


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=toy_settings.filter(lambda c: c["n"] >= 2 and c["walk"] == "sampled"), at=st.floats(0.05, 0.95))
def test_a_cut_between_the_confidences_keeps_the_target_law(cfg, at):
    """The rate put between two values slot 2's confidence takes (so whether d_2 is verified depends on d_1, as a
    stopping rule may): the law stays exact. A rule that judged a slot by a later slot's confidence, which reads
    the draft it judges, fails here."""
    P, Q, _ = build_toy(cfg)
    vocab, n = cfg["vocab"], cfg["n"]
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    c1, seen = float(Q[0].max()), sorted({float(Q[index[(d,)]].max()) for d in range(vocab) if Q[0, d] > 0})
    assume(len(seen) > 1 and seen[-1] - seen[0] > 1e-3)
    t = seen[0] + at * (seen[-1] - seen[0])
    law = cut_law(P, Q, vocab, n, policy_rule(Q, vocab, n, c1 * t, costs(1.0, 0.0)))
    assert max_error_against_target(law, P, vocab, n) < 1e-9


def test_a_cut_that_reads_the_draft_is_caught():
    """Planted: verify d_k only if q_k(d_k) >= 0.3, a rule that looks at the draft itself (SPEC §10); and the
    policy's rule shifted one slot, judging d_k by c_{k+1} (which reads d_k). The same exact check that passes the
    stopping rule finds both off the target's law."""
    cfg = dict(vocab=4, n=2, temperature=1.0, top_k=0, top_p=1.0, walk="sampled", support=4, seed=4)
    P, Q, _ = build_toy(cfg)
    index = {prefix: row for row, prefix in enumerate(all_prefixes(4, 2))}

    def biased(block):
        ok = [float(Q[index[block[:k]], block[k]]) >= 0.3 for k in range(2)]
        return (ok + [False]).index(False)

    assert max_error_against_target(cut_law(P, Q, 4, 2, biased), P, 4, 2) > 0.1
    fair = cut_law(P, Q, 4, 2, policy_rule(Q, 4, 2, 1.0, costs(0.3, 0.5)))
    assert max_error_against_target(fair, P, 4, 2) < 1e-9
    shifted = cut_law(P, Q, 4, 2, policy_rule(Q, 4, 2, 1.0, costs(0.5, 0.5), shift=1))
    assert max_error_against_target(shifted, P, 4, 2) > 0.01


def batch_laws(toys, vocab, n, width_of):
    """{emitted tokens: probability} of each row of a batch of chain steps, exactly: every row's draft chain is
    drawn from its own Q (all combinations enumerated), width_of(chains) -> W, and every row verifies its first
    W - 1 drafts (verify_sampled's acceptance and residual), the target's own token after them."""
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}
    rows = []
    for P, Q in toys:
        alpha = verify.acceptance_probability(P[: len(Q)], Q).tolist()
        rows.append((P.tolist(), Q.tolist(), alpha, verify.residual_distribution(P[: len(Q)], Q).tolist()))
    chains = list(itertools.product(range(vocab), repeat=n))
    laws = [{} for _ in toys]
    for combo in itertools.product(chains, repeat=len(toys)):
        reach = [math.prod(q[index[d[:k]]][d[k]] for k in range(n)) for (_, q, _, _), d in zip(rows, combo)]
        if math.prod(reach) == 0:
            continue
        width = width_of(combo)
        for law, (p, q, alpha, residual), d in zip(laws, rows, combo):
            mass = math.prod(reach)
            for k in range(width - 1):
                a = alpha[index[d[:k]]][d[k]]
                for t in range(vocab):
                    law[d[:k] + (t,)] = law.get(d[:k] + (t,), 0.0) + mass * (1 - a) * residual[index[d[:k]]][t]
                mass *= a
            m = width - 1
            for t in range(vocab):
                law[d[:m] + (t,)] = law.get(d[:m] + (t,), 0.0) + mass * p[index[d[:m]]][t]
    return laws


def batch_rule(toys, vocab, n, rho, c):
    """The policy's chain_width on a batch of toys: row r's c_k = the largest probability of q_r(. | its d_1..d_{k-1})."""
    index = {prefix: row for row, prefix in enumerate(all_prefixes(vocab, n))}

    def width_of(combo):
        conf = torch.tensor([[float(Q[index[d[:k]]].max()) for k in range(n)] for (_, Q), d in zip(toys, combo)])
        return pol.chain_width(conf, torch.full((len(toys),), n), rho, c)

    return width_of


BATCH_TOYS = [dict(vocab=3, n=2, temperature=1.0, top_k=0, top_p=1.0, walk="sampled", support=3, seed=s)
              for s in (4, 7, 12)]


@settings(deadline=None, max_examples=12, suppress_health_check=[HealthCheck.too_slow])
@given(rho=st.floats(0.5, 6.0), slope=st.floats(0.0, 0.6))
def test_the_batch_width_keeps_every_rows_law(rho, slope):
    """T = 1, three rows whose target and draft laws differ, one width for the batch from all rows' confidences:
    each row's output law is its target's (exact enumeration over every row's drafts)."""
    toys = [build_toy(cfg)[:2] for cfg in BATCH_TOYS]
    assert not torch.equal(toys[0][0], toys[1][0])
    laws = batch_laws(toys, 3, 2, batch_rule(toys, 3, 2, rho, costs(slope, 0.2)))
    for law, (P, _) in zip(laws, toys):
        assert abs(sum(law.values()) - 1) < 1e-12
        assert max_error_against_target(law, P, 3, 2) < 1e-9


def test_a_batch_width_that_reads_a_draft_is_caught():
    """Planted: the batch widens past slot k only while row 1's draft at slot k has q >= 0.4, a width that reads
    a draft it verifies (SPEC §10). The same exact check that passes the policy's width finds row 1 off its law
    (by 0.006 here), while rows 0 and 2, for which row 1's drafts are outside randomness, keep theirs."""
    toys = [build_toy(cfg)[:2] for cfg in BATCH_TOYS]
    index = {prefix: row for row, prefix in enumerate(all_prefixes(3, 2))}
    fair = batch_rule(toys, 3, 2, 1.0, costs(0.0, 0.2))  # flat costs: the policy verifies every draft

    def peeking(combo):
        d = combo[1]
        return min(fair(combo), 1 + next((k for k in range(2) if float(toys[1][1][index[d[:k]], d[k]]) < 0.4), 2))

    errors = [max_error_against_target(law, P, 3, 2) for law, (P, _) in zip(batch_laws(toys, 3, 2, peeking), toys)]
    assert errors[1] > 1e-3 and max(errors[0], errors[2]) < 1e-9, errors  # the other rows' draws do not bias row 1's
    assert all(max_error_against_target(law, P, 3, 2) < 1e-9
               for law, (P, _) in zip(batch_laws(toys, 3, 2, fair), toys))


def test_sampling_loop_with_the_policy_preserves_target_distribution():
    """Monte Carlo through the real loop, the policy cutting the batch's blocks (costs at which some steps verify
    the whole block of 4 and others stop short of it)."""
    model, target, drafter = _sampling_pair()
    results = []
    steep = pol.Costs([1], [[1.0, 1.01, 1.4, 1.8]], [0.1], [0.1])  # b rows cost b times one: slots 2, 3 cost 0.4 each
    tv, bound = _loop_tv(model, target, drafter, "dflash2", rows=30000, n=3, policy="auto",
                         policy_override=pol.Policy(steep, 4), results_out=results)
    assert tv < bound, (tv, bound)
    widths = {w for r in results for w in r.widths}
    assert min(widths) < 4 and max(widths) > 1, widths


# --- costs and traces ---


def test_measured_costs_are_sane():
    model, target, drafter = pair("llama")
    c = pol.measure_costs(target, drafter, reps=1)
    assert c.batches == list(pol.COST_BATCHES) and c.V(1, 1) == 1.0 and len(c.verify[0]) == AUTO_TREE_CAP + 1
    assert all(c.V(w, b) <= c.V(w + 1, b) and c.V(w, b) <= c.V(w, 2 * b) for b in c.batches for w in range(1, 33))
    assert 0 < c.D(1) <= c.D(32) and 0 < c.D(1, tree=True)
    assert c.key == pol.cost_key(target, drafter) and c.ms_per_token > 0


def scripted(target, drafter, *verifies):
    """A measure function returning Costs with these V(2) values in turn (the rest flat), counting its calls."""
    calls = []

    def measure(t, d):
        v2 = verifies[len(calls) % len(verifies)]
        calls.append(v2)
        return pol.Costs([1], [[1.0, v2] + [v2 + 0.1] * 40], [0.3], [0.3], pol.cost_key(target, drafter), 50.0)

    return measure, calls


def test_costs_are_measured_until_steady_then_cached_and_read_back(tmp_path):
    """Two measurements in a row that agree: their mean is stored; the next process reads it without measuring."""
    model, target, drafter = pair("llama")
    pol._MEMO.clear()
    measure, calls = scripted(target, drafter, 1.5, 1.1, 1.2)  # a busy first pass, then two that agree
    c = pol.costs_for(target, drafter, measure, tmp_path / "costs.json")
    assert calls == [1.5, 1.1, 1.2] and c.steady and c.V(2) == pytest.approx(1.15)
    pol._MEMO.clear()
    again = pol.costs_for(target, drafter, lambda *a: pytest.fail("measured again"), tmp_path / "costs.json")
    assert again.verify == c.verify and again.key == pol.cost_key(target, drafter) and again.steady


def test_unsteady_costs_serve_one_process_and_are_not_cached(tmp_path):
    """No two measurements in a row agree (a busy machine): the median serves this process, marked unsteady,
    nothing is stored, and the next process measures again."""
    model, target, drafter = pair("llama")
    pol._MEMO.clear()
    measure, calls = scripted(target, drafter, 2.2, 1.1, 1.6)
    c = pol.costs_for(target, drafter, measure, tmp_path / "costs.json")
    assert len(calls) == pol.MAX_PASSES and not c.steady and c.V(2) == pytest.approx(1.6)
    assert not (tmp_path / "costs.json").exists()
    pol._MEMO.clear()
    pol.costs_for(target, drafter, measure, tmp_path / "costs.json")
    assert len(calls) == 2 * pol.MAX_PASSES
    pol._MEMO.clear()


measured_grid = st.fixed_dictionaries({b: st.lists(st.floats(0.0, 3.0), min_size=4, max_size=4) for b in (1, 2, 8, 32)})


@settings(max_examples=40, deadline=None)
@given(grid=measured_grid, drafts=st.lists(st.floats(0.0, 2.0), min_size=4, max_size=4))
def test_costs_interpolate_between_the_measured_points(grid, drafts):
    """grid_costs from drawn timings at widths 1, 3, 8, 20 and 1, 2, 8, 32 rows: exact at every measured point
    once made monotone (a running max over w, then b), monotone in w and in b everywhere, and between the
    neighbouring measured points in b (linearly: the midpoint of 2 and 8 rows is halfway), in proportion past 32."""
    widths = (1, 3, 8, 20)
    verify = {b: {w: 1 + sum(v[: i + 1]) for i, w in enumerate(widths)} for b, v in grid.items()}
    c = pol.grid_costs(verify, dict(zip(sorted(grid), drafts)), dict(zip(sorted(grid), drafts)), 24)
    monotone = {}
    for b in sorted(grid):
        for w in widths:
            monotone[b, w] = max([verify[b][w]] + [monotone[a, w] for a in sorted(grid) if a < b])
            assert c.V(w, b) == pytest.approx(monotone[b, w])
    for b in range(1, 40):
        for w in range(1, 24):
            assert c.V(w, b) <= c.V(w + 1, b) + 1e-12 and c.V(w, b) <= c.V(w, b + 1) + 1e-12
    for lo, hi in ((1, 2), (2, 8), (8, 32)):
        for w in range(1, 25):
            for b in range(lo, hi + 1):
                assert min(c.V(w, lo), c.V(w, hi)) - 1e-12 <= c.V(w, b) <= max(c.V(w, lo), c.V(w, hi)) + 1e-12
            assert c.V(w, (lo + hi) / 2) == pytest.approx((c.V(w, lo) + c.V(w, hi)) / 2)
    assert [c.D(b) for b in sorted(grid)] == list(itertools.accumulate(drafts, max))
    assert c.D(5) == pytest.approx(c.D(2) + (c.D(8) - c.D(2)) / 2) and c.V(3, 64) == pytest.approx(2 * c.V(3, 32))


def test_a_cost_cache_of_another_format_is_measured_again(tmp_path):
    """The key names the format: an entry stored under an older format's key is never read as today's costs."""
    model, target, drafter = pair("llama")
    key = pol.cost_key(target, drafter)
    assert key.startswith(f"costs v{pol.COST_FORMAT} | ")
    old_key = key.replace(f"costs v{pol.COST_FORMAT} | ", "")
    digest = __import__("hashlib").sha256(old_key.encode()).hexdigest()[:16]
    (tmp_path / "costs.json").write_text(json.dumps({digest: dict(verify=[1.0, 1.1], draft=0.2, draft_tree=0.3,
                                                                  key=old_key)}))
    pol._MEMO.clear()
    measure, calls = scripted(target, drafter, 1.2)
    c = pol.costs_for(target, drafter, measure, tmp_path / "costs.json")
    pol._MEMO.clear()
    assert len(calls) == 2 and c.V(2) == pytest.approx(1.2) and c.key == key


def test_agreement_of_two_measurements():
    a = costs(0.1, 0.3)
    assert pol.agree(a, costs(0.11, 0.5)) and not pol.agree(a, costs(0.3, 0.3)) and not pol.agree(a, costs(0.1, 0.6))


@pytest.mark.parametrize("method", ["dflash2", "dflash2-tree"])
def test_the_chosen_widths_are_traced_and_replayed(method, tmp_path, capsys):
    """--trace records each step's width; --check-trace replays those widths (not this machine's choice): a
    trace whose first width was edited parts from the reference at that step."""
    import dflash2_ref
    from test_cli import PAIR

    path = tmp_path / "t.jsonl"
    rc = dflash2_ref.main([*PAIR, "--prompt", "the time of day", "--max-new-tokens", "16", "--method", method,
                           "--temperature", "0.7", "--trace", str(path), "--json"])
    assert rc == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[0]["policy"] == "auto"
    steps = [r for r in records if r["type"] in ("step", "tree_step")]
    assert steps and all("width" in r for r in steps)
    capsys.readouterr()
    assert dflash2_ref.main(["--check-trace", str(path)]) == 0
    assert capsys.readouterr().out.startswith("agree:")
    steps[0]["width"] = 1 if steps[0]["width"] > 1 else 2
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert dflash2_ref.main(["--check-trace", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("divergence: request 0 step 1 "), out  # the replay follows the edited width, and parts there


def test_expected_tokens_of_a_tree_count_its_best_nodes():
    """The tree cut's expected tokens are 1 + the sum of its best nodes' path laws; a budget past them adds nothing."""
    class Tree:
        valid = torch.tensor([[True, True, True, False]])
        scores = torch.log(torch.tensor([[0.9, 0.5, 0.1, 1.0]]))

    policy = pol.Policy(costs(0.0, 0.0), 4, tree=True)
    policy.begin([0], [1], [True])
    assert policy.cut_tree(Tree) == 4  # flat costs: the largest budget allowed
    policy = pol.Policy(pol.Costs([1], [[1, 1.5, 2.0, 2.5, 3.0, 3.5]], [0.1], [0.1 / pol.DRAFT_SLACK]), 4, tree=True)
    policy.begin([0], [1], [True])
    rate = {b: (1 + [0.9, 1.4, 1.5, 1.5][b - 1]) / (0.1 + 1 + 0.5 * b) for b in (2, 4)}  # drafting costs a step 0.1
    assert policy.cut_tree(Tree) == max(rate, key=rate.get) == 2
    assert math.isclose(rate[2], 2.4 / 2.1)
