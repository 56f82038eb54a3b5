"""The loop is lossless: greedy output equals the target's, token for token, for every batch shape;
its drafter state equals a recomputation without cache; sampling keeps the target's law."""
import inspect
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from dflash2 import policy as policy_module, proposers, results as results_module, spec_decode as sd, verify
from dflash2.target import Target
from targets import ARCHS, reference_greedy, synthetic_costs, tiny_drafter, tiny_target

_cache = {}
PREFILL_TOKENS, HOLD = sd.PREFILL_TOKENS, results_module.HOLD


def pair(arch, block_size=8):
    key = (arch, block_size)
    if key not in _cache:
        model = tiny_target(arch)
        drafter = tiny_drafter(model, block_size)
        _cache[key] = (model, Target(model, drafter.config.target_layer_ids), drafter)
    return _cache[key]


prompts_st = st.lists(st.lists(st.integers(0, 62), min_size=1, max_size=12), min_size=1, max_size=4)
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("arch", ARCHS)
@SETTINGS
@given(prompts=prompts_st, block_size=st.integers(2, 8), method=st.sampled_from(["dflash2", "dflash", "ar"]),
       n=st.integers(1, 12))
def test_greedy_matches_target(arch, prompts, block_size, method, n):
    model, target, drafter = pair(arch)
    results = sd.generate(target, drafter, prompts, method=method, max_new_tokens=n, block_size=block_size)
    for prompt, res in zip(prompts, results):
        assert res.tokens == reference_greedy(model, prompt, n)
        if n == 1:  # the prefill made the only token: no decode step to average over
            assert res.acceptance_length is None
        else:
            assert 1 <= res.acceptance_length <= (1 if method == "ar" else block_size)


@torch.no_grad()
def greedy_with_margins(model, prompt, n):
    """reference_greedy's tokens and, at each, the gap between the target's top two logits."""
    seq, margins = list(prompt), []
    for _ in range(n):
        top = model(torch.tensor([seq])).logits[0, -1].topk(2)
        seq.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
    return seq[len(prompt):], margins


def injecting_proposer(model, prompts, refs, patterns, block_size, vocab, log):
    """A drafter stand-in: proposes the target's own next tokens for k slots, then a wrong token.

    k for (request, step) comes from the Hypothesis-chosen pattern of that request.
    """
    steps = {}

    def propose(anchor, pos, rows):
        drafts = []
        for r, req in enumerate(rows.tolist()):
            k = patterns[req][steps.get(req, 0) % len(patterns[req])]
            steps[req] = steps.get(req, 0) + 1
            full = list(prompts[req]) + refs[req]
            p = int(pos[r])
            truth = full[p + 1 : p + block_size]
            row = [truth[j] if j < k else (truth[j] + 1) % vocab for j in range(block_size - 1)]
            drafts.append(row)
            log.setdefault(req, []).append(k)
        drafts = torch.tensor(drafts, device=anchor.device)
        return drafts, torch.nn.functional.one_hot(drafts, vocab).float()

    return propose


@pytest.mark.parametrize("arch", ARCHS)
@SETTINGS
@given(data=st.data(), block_size=st.integers(2, 8), batch=st.integers(1, 4))
def test_every_acceptance_length_is_exact(arch, data, block_size, batch):
    """Proposal injection forces each acceptance length 0..B-1, ragged across rows; output stays exact."""
    model, target, _ = pair(arch)
    vocab = model.config.vocab_size
    prompts = data.draw(st.lists(st.lists(st.integers(0, vocab - 2), min_size=1, max_size=10),
                                 min_size=batch, max_size=batch))
    patterns = [data.draw(st.permutations(range(block_size))) for _ in range(batch)]
    # Long enough that every pattern entry is used before the last step: the first B steps emit
    # 1 + 2 + ... + B tokens after the prefill's one, and a further B + 1 leave at least one step after.
    n = block_size * (block_size + 1) // 2 + block_size + 2
    refs, margins = zip(*(greedy_with_margins(model, p, n + block_size) for p in prompts))
    # A float32 argmax whose top two logits lie within rounding (one seen: 2.4e-7 apart) is not a
    # property of the loop: the cached and uncached forwards may round it either way.
    assume(min(min(m) for m in margins) > 1e-4)
    log = {}
    propose = injecting_proposer(model, prompts, refs, patterns, block_size, vocab, log)
    results = sd.generate(target, None, prompts, method="dflash2", max_new_tokens=n, block_size=block_size,
                          propose=propose)
    for req, res in enumerate(results):
        assert res.tokens == refs[req][:n]
        # Each step accepts exactly what was injected (the last step may be cut by max_new_tokens).
        assert res.accepted[:-1] == log[req][: len(res.accepted) - 1]
        assert set(res.accepted[:-1]) == set(range(block_size))


@pytest.mark.parametrize("arch", ["llama", "minimax_m3"])
def test_batch_of_mixed_lengths_equals_each_alone(arch):
    model, target, drafter = pair(arch)
    prompts = [[1, 2, 3], list(range(5, 20)), [7], [9, 9, 8, 8, 7, 7, 6]]
    batch = sd.generate(target, drafter, prompts, max_new_tokens=20, policy="fixed")  # a batch's width is its own
    for p, res in zip(prompts, batch):
        alone = sd.generate(target, drafter, [p], max_new_tokens=20, policy="fixed")[0]
        assert res.tokens == alone.tokens and res.accepted == alone.accepted


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("keeps", [True, False])
def test_a_prefill_computes_each_prompts_last_logits_only(arch, keeps, monkeypatch):
    """The prefill's forward asks the model for the logits at each row's last prompt index only (logits_to_keep,
    where the model takes it) and returns them exactly as the full forward's logits there; a model without
    logits_to_keep gives all of them and the right ones are picked."""
    model, target, drafter = pair(arch)
    lens = torch.tensor([3, 7, 7, 1])
    ids = torch.randint(0, 60, (4, 7), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(7).expand(4, 7)
    full, feats = target.forward(ids, positions, target.new_cache(16), 7)
    asked = []
    real = type(model).forward

    def spy(self, *args, **kwargs):
        asked.append(kwargs.get("logits_to_keep"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", spy)
    monkeypatch.setattr(target, "keeps_logits", keeps and target.keeps_logits)
    last, feats_last = target.forward(ids, positions, target.new_cache(16), 7, last=lens - 1)
    assert last.shape == (4, 1, full.shape[-1]) and torch.equal(feats_last, feats)
    torch.testing.assert_close(last[:, 0], full[torch.arange(4), lens - 1])
    assert asked[-1].tolist() == [0, 2, 6] if target.keeps_logits else asked[-1] is None


def test_a_batch_that_never_drafts_never_projects_its_prompts(monkeypatch):
    """The drafter's context writes wait for a read: a batch whose policy never drafts (many rows, where no width
    pays) never runs the drafter's context projection, its prompts' included; its output is ar's."""
    model, target, drafter = pair("llama")
    calls = []
    real = type(drafter).context_kv
    monkeypatch.setattr(type(drafter), "context_kv", lambda self, *a: calls.append(1) or real(self, *a))

    class Never:
        def begin(self, requests, steps, alive):
            return False

        def end(self, *args):
            pass

        def cut_chain(self, *args):
            raise AssertionError("a batch that never drafts never cuts")

    prompts = [[1, 2, 3], list(range(5, 20)), [7]]
    out = sd.generate(target, drafter, prompts, max_new_tokens=6, policy_override=Never())
    assert calls == [] and [r.tokens for r in out] == [r.tokens for r in sd.generate(target, None, prompts,
                                                                                     max_new_tokens=6, method="ar")]
    sd.generate(target, drafter, prompts, max_new_tokens=6, policy="fixed")
    assert calls  # a drafted step reads the context, and projects what waited


def _drafts_by_step(target, drafter, prompts, **kwargs):
    """generate() plus every step's drafts, keyed by (request, step); a static run's frozen rows come
    after their request's last step and are left out by keeping each key's first record."""
    drafts = {}

    def trace(rec):
        for r, (req, step) in enumerate(zip(rec["requests"], rec["steps"])):
            drafts.setdefault((req, step), rec["drafts"][r].tolist())

    return sd.generate(target, drafter, prompts, trace=trace, **kwargs), drafts


@pytest.mark.parametrize("arch", ["llama", "minimax_m3"])
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), method=st.sampled_from(["dflash2", "dflash", "ar"]), static=st.booleans())
def test_continuous_batching_equals_each_alone(arch, data, method, static):
    """With max_batch rows in flight, waiting requests are prefilled into finished rows, a group of rows per
    forward (PREFILL_TOKENS drawn: one row a group up to all of them), at once or after finished rows were held for
    others (HOLD drawn); every request must decode exactly as alone: same tokens, same acceptance, and the same
    drafts at every step (so the gathered and copied target cache and drafter context are right, not only the
    lossless output)."""
    model, target, drafter = pair(arch)
    prompts = data.draw(st.lists(st.lists(st.integers(0, 62), min_size=1, max_size=12), min_size=2, max_size=6))
    max_batch = data.draw(st.integers(1, len(prompts)))
    budget = data.draw(st.sampled_from([1, 12, 24, 4096]))
    hold = data.draw(st.sampled_from([0.0, results_module.HOLD, 100.0]))
    n = data.draw(st.integers(1, 16))
    refs = [reference_greedy(model, p, n) for p in prompts]
    stop = data.draw(st.sampled_from(sorted({t for r in refs for t in r})))  # some requests end early
    kwargs = dict(method=method, max_new_tokens=n, stop_ids=[stop], static=static, policy="fixed")
    sd.PREFILL_TOKENS, results_module.HOLD = budget, hold
    try:
        batch, drafts = _drafts_by_step(target, drafter, prompts, max_batch=max_batch, **kwargs)
    finally:
        sd.PREFILL_TOKENS, results_module.HOLD = PREFILL_TOKENS, HOLD
    for req, (p, ref, res) in enumerate(zip(prompts, refs, batch)):
        assert res.tokens == (ref[: ref.index(stop) + 1] if stop in ref else ref)
        alone, alone_drafts = _drafts_by_step(target, drafter, [p], **kwargs)
        assert res.accepted == alone[0].accepted
        assert {s: d for (q, s), d in drafts.items() if q == req and (0, s) in alone_drafts} == {
            s: d for (_, s), d in alone_drafts.items()}


def _admissions(monkeypatch, target, prompts, accepts, **kwargs):
    """Decode with forced acceptance (accepts[request] drafts accepted at its first step, none after) and record
    each prefill forward: (the requests it admits, the tokens each live row has made by then)."""
    admitted, book, real = [], None, sd._prefill

    def spy(target_, proposer, batch, *args, **kw):
        made = [] if book is None else [len(book.results[q].tokens) for q, a in zip(book.request, book.alive) if a]
        admitted.append((sorted(prompts.index(p) for p in batch), sorted(made)))
        return real(target_, proposer, batch, *args, **kw)

    def propose(anchor, pos, rows):  # the target's next tokens for the first accepts[req] slots, then wrong ones
        drafts = []
        for r, req in enumerate(rows.tolist()):
            k = accepts[req] if not book.results[req].accepted else 0
            truth = refs[req][int(pos[r]) - len(prompts[req]) + 1:][:7]
            drafts.append([truth[j] if j < k else (truth[j] + 1) % vocab for j in range(7)])
        drafts = torch.tensor(drafts, device=anchor.device)
        return drafts, torch.nn.functional.one_hot(drafts, vocab).float()

    vocab, n = target.vocab_size, kwargs["max_new_tokens"]
    refs = [reference_greedy(target.model, p, n + 8) for p in prompts]
    monkeypatch.setattr(sd, "_prefill", spy)
    for book in sd.decode_steps(target, None, prompts, propose=propose, block_size=8, policy="fixed", **kwargs):
        pass
    monkeypatch.setattr(sd, "_prefill", real)
    for req, res in enumerate(book.results):
        assert res.tokens == refs[req][: len(res.tokens)] and (len(res.tokens) == n or res.finished_by_stop)
    return admitted


def test_finished_rows_wait_for_rows_about_to_finish(monkeypatch):
    """Two rows decode 12 tokens each; the first step's drafts put one 2 tokens ahead. Its row is held empty for the
    other's 2 remaining steps (1 row times 2 steps <= HOLD * 2 rows), so both waiting requests are prefilled in one
    forward, and the output stays exact. With HOLD = 0 the row is refilled at once: a prefill for each request. A
    row 3 tokens ahead (3 > 2), or one that ends by a stop token far before the cap, is refilled at once."""
    model, target, drafter = pair("llama")
    prompts = [[1, 2, 3], [5, 6, 7, 8], [9, 8], [4, 4, 4]]
    kwargs = dict(max_new_tokens=12, max_batch=2, stop_ids=[])
    assert _admissions(monkeypatch, target, prompts, [2, 0, 0, 0], **kwargs) == [([0, 1], []), ([2, 3], [])]
    assert _admissions(monkeypatch, target, prompts, [3, 0, 0, 0], **kwargs)[1] == ([2], [9])
    monkeypatch.setattr(results_module, "HOLD", 0.0)
    assert _admissions(monkeypatch, target, prompts, [2, 0, 0, 0], **kwargs)[1] == ([2], [10])
    monkeypatch.setattr(results_module, "HOLD", HOLD)
    refs = [reference_greedy(model, p, 12) for p in prompts]
    i = next(i for i in range(6) if refs[0][i] not in refs[0][:i] + refs[1])  # request 0 ends at token i + 1
    stop = refs[0][i]
    assert _admissions(monkeypatch, target, prompts, [0, 0, 0, 0], **dict(kwargs, stop_ids=[stop]))[1] == ([2],
                                                                                                          [i + 1])


def test_prefill_groups_never_change_a_sampled_output(monkeypatch):
    """The first tokens' uniforms are drawn once, in row order, whatever the prefill groups: a seeded run at T = 1
    makes the same tokens with one row per group, longest first, as a static run, which prefills its rows in order
    in one forward."""
    model, target, drafter = pair("llama")
    prompts = [[1, 2, 3], list(range(5, 20)), [7], [9, 9, 8, 8, 7, 7, 6]]
    runs = []
    for budget, static in ((1, False), (PREFILL_TOKENS, False), (PREFILL_TOKENS, True)):
        monkeypatch.setattr(sd, "PREFILL_TOKENS", budget)
        runs.append([r.tokens for r in sd.generate(target, drafter, prompts, max_new_tokens=8, temperature=1.0,
                                                   seed=3, policy="fixed", static=static)])
    assert runs[0] == runs[1] == runs[2]


def test_prefill_groups_pack_the_longest_prompts_first():
    """Rows in prefill groups: longest first, a group's rows times its longest prompt within PREFILL_TOKENS (one
    row at least); a static run's batch in one group, in order."""
    lens = [5, 40, 3, 20, 20, 1, 100]
    groups = sd.prefill_groups(lens)
    assert sorted(r for g in groups for r in g) == list(range(7))
    assert [r for g in groups for r in g] == sorted(range(7), key=lambda r: -lens[r])
    assert sd.prefill_groups(lens, static=True) == [list(range(7))]
    for budget, want in ((60, [[6], [1], [3, 4, 0], [2, 5]]), (1, [[r] for r in (6, 1, 3, 4, 0, 2, 5)])):
        sd.PREFILL_TOKENS = budget
        try:
            assert sd.prefill_groups(lens) == want
        finally:
            sd.PREFILL_TOKENS = PREFILL_TOKENS


GOLDEN = Path(__file__).resolve().parent / "golden"


@torch.no_grad()
def uncached_draft(model, target, drafter, tokens, size):
    """Context K/V, h and U of a block of `size` slots anchored at tokens[-1], from scratch: one plain
    target forward over tokens[:-1] (no cache) for the context features at positions 0..L-1."""
    ids = torch.tensor([tokens])
    L = len(tokens) - 1
    hidden = model(ids[:, :L], output_hidden_states=True).hidden_states
    feats = torch.cat([hidden[l + 1] for l in drafter.config.target_layer_ids], -1)
    kv = drafter.context_kv(feats, torch.arange(L)[None])
    embeds = drafter.embed_block(ids[:, -1], target.embed_tokens, size)
    h = drafter(embeds, torch.arange(L, L + size)[None], kv, torch.ones(1, L, dtype=torch.bool))[:, 1:]
    return kv, h, drafter.draft_logits(h, target.lm_head_weight)


@pytest.mark.parametrize("temperature, static, policy, prefill_tokens", [
    (0.0, False, None, PREFILL_TOKENS), (0.0, True, None, PREFILL_TOKENS), (0.7, False, None, PREFILL_TOKENS),
    (0.0, False, "costly drafts", PREFILL_TOKENS), (0.0, False, None, 12), (0.0, False, "costly drafts", 1)])
def test_drafter_state_equals_an_uncached_recomputation(monkeypatch, temperature, static, policy, prefill_tokens):
    """At every drafted step of a ragged multi-step run of the golden pair (a fitted drafter, so drafts are
    accepted): each row's committed tokens end in its anchor at its position; its context K/V in
    slots 0..pos-1 equal context_kv of features recomputed without any cache; its h and draft logits
    equal a drafter pass over that recomputed context; and the greedy walk's drafts equal the walk
    over the recomputed scores. Bugs that keep greedy output lossless (a context row one slot late,
    a context mask off by one) fail here, not only in the golden traces. Under the auto policy with costly
    drafts (injected costs) runs of plain steps come between drafted ones: their one-token context writes are
    deferred and projected together by the next draft, which must see them all, each at its position. With a
    small PREFILL_TOKENS the prompts are prefilled in groups of rows, gathered into one cache and context."""
    from dflash2.pair import load_pair
    from dflash2.policy import Policy

    pair_ = load_pair(str(GOLDEN / "target"), str(GOLDEN / "draft"), "cpu", torch.float32)
    model, target, drafter = pair_.target.model, pair_.target, pair_.drafter
    sel = drafter.candidate_selector
    prompts = [[3, 5, 53, 7, 0, 4], [3, 32, 11, 12, 13, 34, 35, 0, 4], [3, 0, 4], [3, 9, 4, 20]]
    n = 20
    emitted = {req: [] for req in range(len(prompts))}
    calls, checked = [], []
    real_draft, signature = proposers.draft, inspect.signature(proposers.draft)

    def spy(*args, **kwargs):
        h, U = real_draft(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(dict(bound.arguments, h=h, U=U))
        return h, U

    plain = []

    def trace(rec):  # called after the step's draft and verify, before its bookkeeping
        if not calls:  # a plain step: no draft, its context write deferred
            plain.append(len(rec["requests"]))
            return
        call = calls.pop()
        ctx, B, sizes = call["ctx"], call["block_size"], call.get("sizes")
        for r, req in enumerate(rec["requests"]):
            if len(emitted[req]) >= n:  # a finished row kept in place by a static run
                continue
            tokens, pos = prompts[req] + emitted[req], int(call["pos"][r])
            assert len(tokens) == pos + 1 and tokens[-1] == int(call["anchor"][r])
            size = B if sizes is None else int(sizes[r])
            kv, h, U = uncached_draft(model, target, drafter, tokens, size)
            for (k, v), (k_ref, v_ref) in zip(ctx.kv, kv):
                torch.testing.assert_close(k[r, :, :pos], k_ref[0], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(v[r, :, :pos], v_ref[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(call["h"][r, : size - 1], h[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(call["U"][r, : size - 1], U[0], atol=1e-4, rtol=1e-4)
            if temperature == 0:
                cand, _ = sel.candidates(U, sel.top_k)
                path, _ = sel.walk(sel.edge_scores(h, U, cand, torch.tensor([tokens[-1]])), cand)
                kept = min(size - 1, rec["drafts"].shape[1])  # a policy's cut verifies a prefix of the walk
                assert rec["drafts"][r, :kept].tolist() == path[0, :kept].tolist()
            checked.append((req, pos))

    monkeypatch.setattr(proposers, "draft", spy)
    monkeypatch.setattr(sd, "PREFILL_TOKENS", prefill_tokens)
    monkeypatch.setattr(policy_module, "EXPLORE", float("inf"))  # tries after 2, 4, 8 plain steps: a short decode
    # has drafted steps that read the writes its plain runs deferred
    override = None if policy is None else Policy(synthetic_costs(0.05, 4.0), 8)
    results = sd.generate(target, drafter, prompts, max_new_tokens=n, temperature=temperature, top_p=0.9,
                          seed=5, static=static, trace=trace, on_emit=lambda req, toks: emitted[req].extend(toks),
                          policy="auto" if policy else "fixed", policy_override=override)
    assert all(len(r.tokens) == n for r in results)
    assert len(checked) + sum(plain) == sum(len(r.accepted) for r in results)
    if policy is not None:  # plain runs, and drafted steps after them that read their deferred writes
        assert sum(plain) > len(checked) > len(prompts)
        assert any(w[i] == 1 and w[i + 1] > 1 for r in results for w in [r.widths] for i in range(len(w) - 1))
    if temperature == 0:
        assert sum(sum(r.accepted) for r in results) >= 10  # accepted prefixes were bookkept too


def test_stop_token_ends_output_inside_an_accepted_run():
    model, target, drafter = pair("llama")
    prompt = [3, 1, 4, 1, 5]
    ref = reference_greedy(model, prompt, 40)
    for j in (0, 5, 17):
        stop = ref[j]
        first = ref.index(stop)
        log = {}
        propose = injecting_proposer(model, [prompt], [ref + [0] * 10], [[7]], 8, model.config.vocab_size, log)
        res = sd.generate(target, None, [prompt], max_new_tokens=40, stop_ids=[stop], propose=propose)[0]
        assert res.tokens == ref[: first + 1] and res.finished_by_stop


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 30), block_size=st.integers(2, 8))
def test_max_new_tokens_is_never_exceeded(n, block_size):
    model, target, _ = pair("llama")
    prompt = [2, 7, 1, 8]
    ref = reference_greedy(model, prompt, n + 8)
    propose = injecting_proposer(model, [prompt], [ref], [[block_size - 1]], block_size, 64, {})
    res = sd.generate(target, None, [prompt], max_new_tokens=n, block_size=block_size, propose=propose)[0]
    assert res.tokens == ref[:n]


@pytest.mark.parametrize("method", ["dflash2", "dflash"])
def test_blocks_shrink_to_what_is_left_of_the_budget(method):
    """Near the end of max_new_tokens a row's block is min(B, end - anchor_pos): its anchor plus at most the
    tokens it may still make, never longer (a block one too long is lossless but drafts past the budget)."""
    model, target, drafter = pair("llama")
    prompts = [[1, 2, 3], list(range(5, 16))]
    steps = []
    sd.generate(target, drafter, prompts, method=method, max_new_tokens=5, block_size=8, trace=steps.append,
                policy="fixed")
    assert steps
    for rec in steps:
        end = torch.tensor([len(prompts[r]) + 5 for r in rec["requests"]])
        assert rec["sizes"].tolist() == torch.clamp(end - rec["anchor_pos"], max=8).tolist()


def test_same_seed_same_sample():
    model, target, drafter = pair("llama")
    prompts = [[1, 2, 3], [4, 5]]
    a = sd.generate(target, drafter, prompts, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=3)
    b = sd.generate(target, drafter, prompts, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=3)
    c = sd.generate(target, drafter, prompts, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=4)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in a] != [r.tokens for r in c]


def test_partial_rotary_is_honoured_for_minimax_m3():
    """transformers' minimax_m3_vl_text ignores rotary_dim unless the factor is in rope_parameters."""
    model = tiny_target("minimax_m3")
    assert "partial_rotary_factor" not in model.config.rope_parameters
    before = model.model.rotary_emb.inv_freq.numel()
    Target(model, [0])
    after = model.model.rotary_emb.inv_freq.numel()
    assert before == model.config.head_dim // 2 and after == model.config.rotary_dim // 2


def test_bad_inputs_are_named():
    model, target, drafter = pair("llama")
    with pytest.raises(ValueError, match="temperature"):
        sd.generate(target, drafter, [[1]], temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        sd.generate(target, drafter, [[1]], temperature=1, top_p=0)
    with pytest.raises(ValueError, match="block_size"):
        sd.generate(target, drafter, [[1]], block_size=9)
    with pytest.raises(ValueError, match="prompt too long"):
        sd.generate(target, drafter, [[1] * 1010], max_new_tokens=20)
    with pytest.raises(ValueError, match="at least one token"):
        sd.generate(target, drafter, [[]])
    with pytest.raises(ValueError, match="max_batch"):
        sd.generate(target, drafter, [[1]], max_batch=0)


def test_minimax_m3_hub_checkpoint_loads_with_partial_rope(tmp_path):
    """A hub-shaped MiniMax-M3 checkpoint (model_type "minimax_m3", VL key layout, rotary_dim but no
    partial_rotary_factor) loads as the text model with partial RoPE and gives the same logits."""
    import json

    from safetensors.torch import save_file

    from dflash2.pair import load_target
    from dflash2.target import fix_partial_rotary
    from tiny_tokenizer import tiny_tokenizer

    ref = tiny_target("minimax_m3")
    fix_partial_rotary(ref)  # the reference runs the deployment's partial RoPE
    cfg = ref.config.to_dict()
    cfg.pop("rope_parameters")
    cfg.update(model_type="minimax_m3", architectures=["MiniMaxM3SparseForConditionalGeneration"],
               rope_theta=ref.config.rope_parameters["rope_theta"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    state = {("language_model." + k): v.contiguous() for k, v in ref.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    tiny_tokenizer(64).save_pretrained(tmp_path)
    loaded, _ = load_target(str(tmp_path))
    assert loaded.config.rope_parameters["partial_rotary_factor"] == 0.5
    ids = torch.randint(0, 60, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


def _target_law(model, prompt, n, temperature, top_p, top_k=0):
    """Exact law of the target's first n sampled tokens, by enumerating every prefix."""
    law = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in law.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double()
            p = verify.process_logits(logits, temperature, top_k, top_p)
            for t in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (t,)] = pr * float(p[t])
        law = nxt
    return law


def _loop_tv(model, target, drafter, method, rows=20000, n=2, max_batch=None, temperature=1.0, top_k=0,
             top_p=0.9, block_size=None, results_out=None, policy="fixed", **generate_kwargs):
    """TV between the loop's outputs of `rows` requests and the target's exact law, and its bound; every step
    verifies the whole block unless a policy is passed."""
    prompt = [5, 3, 9]
    results = sd.generate(target, drafter, [prompt] * rows, method=method, max_new_tokens=n,
                          temperature=temperature, top_k=top_k, top_p=top_p, seed=11, max_batch=max_batch,
                          block_size=block_size, policy=policy, **generate_kwargs)
    if results_out is not None:
        results_out.extend(results)
    counts = {}
    for r in results:
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    law = _target_law(model, prompt, n, temperature, top_p, top_k)
    keys = set(law) | set(counts)
    tv = 0.5 * sum(abs(counts.get(k, 0) / rows - law.get(k, 0.0)) for k in keys)
    # E[TV] <= 0.5 * sum sqrt(p/N); the extra term bounds the fluctuation (McDiarmid, failure prob e^-30).
    bound = 0.5 * sum((p / rows) ** 0.5 for p in law.values()) + (30 / (2 * rows)) ** 0.5
    return tv, bound


def _sampling_pair():
    """A small vocabulary so the law of two tokens can be enumerated; the drafter proposes over
    top-4 candidates, so its q differs from P and rejections with residual draws really happen."""
    model = tiny_target("llama", vocab=12, seed=3)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.25)  # flatter P: several tokens in the nucleus
    drafter = tiny_drafter(model, block_size=4, top_k=4)
    return model, Target(model, drafter.config.target_layer_ids), drafter


@pytest.mark.parametrize("method,max_batch", [("dflash2", None), ("dflash", None), ("dflash2", 6000)])
def test_sampling_loop_preserves_target_distribution(method, max_batch):
    """Monte Carlo through the real loop (drafter walk, verify_sampled, bookkeeping) vs the exact law;
    with max_batch, most requests are admitted into rows that other requests finished."""
    model, target, drafter = _sampling_pair()
    tv, bound = _loop_tv(model, target, drafter, method, max_batch=max_batch)
    assert tv < bound, (tv, bound)


def test_greedy_walk_at_temperature_preserves_target_distribution():
    """--walk greedy (vLLM's default proposal): at T = 1 the walk takes the argmax and q is one-hot; the loop's
    output keeps the target's law, and every draft it verified is the argmax path (q one-hot at the draft)."""
    model, target, drafter = _sampling_pair()
    tv, bound = _loop_tv(model, target, drafter, "dflash2", walk="greedy")
    assert tv < bound, (tv, bound)
    steps = []
    sd.generate(target, drafter, [[5, 3, 9]] * 4, max_new_tokens=6, temperature=1.0, top_p=0.9, seed=1, walk="greedy",
                trace=steps.append)
    assert all(((r["q"] == 0) | (r["q"] == 1)).all() and (r["q"].sum(-1) == 1).all() for r in steps)


@pytest.mark.parametrize("mutant", ["forgets_residual", "always_accepts"])
def test_sampling_loop_catches_a_broken_verifier(monkeypatch, mutant):
    """Negative controls: the same check fails when the loop's verifier is broken."""
    model, target, drafter = _sampling_pair()
    if mutant == "forgets_residual":  # on rejection, sample from P instead of max(P - q, 0)
        monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    else:
        monkeypatch.setattr(verify, "acceptance_probability", lambda p, q: torch.ones_like(p))
    tv, bound = _loop_tv(model, target, drafter, "dflash2")
    assert tv > 2 * bound, (tv, bound)


def _sharp_pair():
    """vocab 12 again, a less flat P, and a drafter with 3 candidates and draft logits sharpened 3x, so
    that at T = 0.3 its q is far from its T = 1 softmax: a walk that draws at one temperature and
    reports q at another moves the law well past the bound."""
    model = tiny_target("llama", vocab=12, seed=3)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.5)
    drafter = tiny_drafter(model, block_size=4, top_k=3)
    drafter.config.output_multiplier = 3.0
    return model, Target(model, drafter.config.target_layer_ids), drafter


def _fitted_pair():
    """The same vocab-12 target and a drafter fitted briefly with the real training loss (make_golden.fit):
    drafts are often accepted, so the residual after an accepted prefix is drawn often."""
    import make_golden

    model = tiny_target("llama", vocab=12, seed=3)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.5)
    model.requires_grad_(False)
    drafter = make_golden.fit(model, tiny_drafter(model, block_size=4, top_k=3), steps=150)
    return model, Target(model, drafter.config.target_layer_ids), drafter


@pytest.mark.parametrize("make_pair, min_accepted", [(_sharp_pair, 0.0), (_fitted_pair, 0.2)])
def test_sampling_loop_keeps_the_law_of_several_steps_at_low_temperature(make_pair, min_accepted):
    """Monte Carlo through the real loop at T = 0.3 with top-k and top-p together: the law of four
    tokens, made by the prefill and then several verification steps of two drafts each (so the
    residual after an accepted prefix and the anchors that follow a residual draw are in it).
    The sharp random drafter is where a walk drawing at the wrong temperature shows most; the fitted
    one is where a wrong residual after an accepted prefix does."""
    model, target, drafter = make_pair()
    results = []
    tv, bound = _loop_tv(model, target, drafter, "dflash2", rows=30000, n=4, temperature=0.3, top_k=3,
                         top_p=0.9, block_size=3, results_out=results)
    assert tv < bound, (tv, bound)
    steps = [len(r.accepted) for r in results]
    assert sum(steps) / len(steps) > 2 and min(steps) >= 1
    assert sum(sum(r.accepted) for r in results) / sum(steps) > min_accepted
