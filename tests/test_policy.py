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
from dflash2.target import Target
from targets import ARCHS, TREE_ARCHS, reference_greedy, tiny_drafter, tiny_target
from test_spec_decode import _loop_tv, _sampling_pair
from test_verify import all_prefixes, build_toy, max_error_against_target, toy_settings

_pairs = {}


def pair(arch):
    if arch not in _pairs:
        model = tiny_target(arch)
        drafter = tiny_drafter(model)
        _pairs[arch] = (model, Target(model, drafter.config.target_layer_ids), drafter)
    return _pairs[arch]


def costs(slope, draft, tree=None):
    """Synthetic costs: V(w) = 1 + slope (w - 1), a draft of `draft` one-token forwards."""
    return pol.Costs([1 + slope * w for w in range(40)], draft, draft if tree is None else tree)


costs_st = st.builds(costs, st.floats(0.0, 0.6), st.floats(0.0, 3.0))


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
        assert res.tokens == reference_greedy(model, prompt, n)
        assert len(res.widths) == res.verify_steps - 1 and all(1 <= w <= cap + 1 for w in res.widths)


def test_drafting_that_does_not_pay_turns_into_plain_steps_and_back():
    """Costly drafts: after the first drafted steps the rows decode plainly (width 1), trying again after 2, 4,
    8, ... plain steps; cheap drafts and flat costs: every step drafts the whole block."""
    model, target, drafter = pair("llama")
    prompts = [[1, 2, 3], [9, 8, 7, 6]]
    dear = sd.generate(target, drafter, prompts, max_new_tokens=40, policy="auto",
                       policy_override=pol.Policy(costs(0.05, 4.0), 8))
    for prompt, res in zip(prompts, dear):
        assert res.tokens == reference_greedy(model, prompt, 40)
        assert res.widths.count(1) > len(res.widths) / 2 and max(res.widths) > 1
    cheap = sd.generate(target, drafter, prompts, max_new_tokens=40, policy="auto",
                        policy_override=pol.Policy(costs(0.0, 0.0), 8))
    assert all(set(r.widths) == {8} for r in cheap)


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


def test_failed_tries_double_the_wait_and_a_paying_try_halves_it():
    """Drafts cost 1 and a verify 1 + 0.1 (w - 1): a step that accepts nothing makes 1 token for 2, one that
    accepts 5 makes 6 for 2.5. The waits double up to 64; each drafted step after which the rate still pays
    halves the wait."""
    fail, win = [0] * 9, [5]
    runs = plain_runs(pol.Policy(costs(0.1, 1.0), 8), [0, 0] + fail + win + [0, 0])
    assert runs[:10] == [0, 2, 4, 8, 16, 32, 64, 64, 64, 64]  # two drafted steps first: a new request starts at 1.3
    # the paying try (rate 0.7 * 0.9 + 0.3 * 6 / 2.5 = 1.35) and the failure after it (1.10) each halve the wait;
    # the second failure (0.92) waits 16 plain steps, where the policy before halving waited 2
    assert runs[10:] == [64, 0, 0, 16]


def test_each_row_is_cut_on_its_own_and_the_forward_is_the_widest():
    model, target, drafter = pair("llama")
    policy = pol.Policy(costs(0.1, 0.2), 8)
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.9, 0.1, 0.9, 0.9], [0.05, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]])
    policy.begin([0, 1], [1, 1], [True, True])
    keep, width = policy.cut_chain(conf)
    assert keep.tolist() == [4, 0] and width == 5


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
    """The policy's chain_keep on the toy, given every slot's confidence; shift=1 (planted) judges slot k by
    c_{k+1}, which reads d_k."""
    def keep_of(block):
        conf = confidences(Q, vocab, n, block)
        conf = torch.cat([conf[:, shift:], torch.ones(1, shift)], 1)
        return int(pol.chain_keep(conf, torch.tensor([rho]), c))

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


def test_sampling_loop_with_the_policy_preserves_target_distribution():
    """Monte Carlo through the real loop, the policy cutting each row's block on its own (costs at which the
    rows of one batch choose blocks of 2 and of 3)."""
    model, target, drafter = _sampling_pair()
    results = []
    tv, bound = _loop_tv(model, target, drafter, "dflash2", rows=30000, n=3, policy="auto",
                         policy_override=pol.Policy(costs(0.011, 0.1), 4), results_out=results)
    assert tv < bound, (tv, bound)
    widths = [w for r in results for w in r.widths]
    assert min(widths.count(2), widths.count(3)) > 0.1 * len(widths)  # rows of one batch cut differently


# --- costs and traces ---


def test_measured_costs_are_sane():
    model, target, drafter = pair("llama")
    c = pol.measure_costs(target, drafter)
    assert c.verify[0] == 1.0 and all(a <= b for a, b in zip(c.verify, c.verify[1:])) and c.draft > 0
    assert c.key == pol.cost_key(target, drafter) and c.ms_per_token > 0


def scripted(target, drafter, *verifies):
    """A measure function returning Costs with these V(2) values in turn (the rest flat), counting its calls."""
    calls = []

    def measure(t, d):
        v2 = verifies[len(calls) % len(verifies)]
        calls.append(v2)
        return pol.Costs([1.0, v2] + [v2 + 0.1] * 40, 0.3, 0.3, pol.cost_key(target, drafter), 50.0)

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
    policy = pol.Policy(pol.Costs([1, 1.5, 2.0, 2.5, 3.0, 3.5], 0.1, 0.1), 4, tree=True)
    policy.begin([0], [1], [True])
    rate = {b: (1 + [0.9, 1.4, 1.5, 1.5][b - 1]) / (0.1 + 1 + 0.5 * b) for b in (2, 4)}
    assert policy.cut_tree(Tree) == max(rate, key=rate.get)
    assert math.isclose(rate[2], 2.4 / 2.1)
