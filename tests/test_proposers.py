"""Every proposer answers one interface, and what a cut reads is a stopping rule: slot k's confidence does not
change when d_k or any later draft is redrawn (SPEC §10), for DFlash 2's walk, DFlash 1, DSpark with and without
its confidence head, a test's forced proposals and no drafts. Planted confidences that read the draft they judge
are caught. The drafter's context writes are deferred and then projected together: n one-token writes read back
as one batched write."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dflash2 import model, proposers, spec_decode as sd
from dflash2.target import Target
from dflash2.verify import Sampling
from targets import synthetic_costs, tiny_drafter, tiny_target
from test_dspark import tiny_dspark

_made = {}


def made(kind):
    """(target, proposer) of each kind over one tiny llama target (vocab 64)."""
    if kind not in _made:
        m = tiny_target("llama")
        d = tiny_drafter(m, block_size=6)
        target = Target(m, d.config.target_layer_ids)
        if kind == "dflash2":
            p = proposers.DFlash2Walk(target, d, 6)
        elif kind == "dflash":
            p = proposers.DFlash1Walk(target, d, 6)
        elif kind in ("dspark", "dspark-no-head"):
            p = proposers.DSparkWalk(target, tiny_dspark(m, block_size=5, head=kind == "dspark"), 5)
        elif kind == "forced":
            def propose(anchor, pos):  # q depends on the anchor and the position only; drafts drawn from it
                logits = torch.sin(anchor[:, None, None] * 0.7 + pos[:, None, None] + torch.arange(5 * 64).view(5, 64))
                q = logits.mul(3).softmax(-1)
                return torch.multinomial(q.view(-1, 64), 1).view(-1, 5), q

            p = proposers.Forced(propose, 6)
        else:
            p = proposers.NoDrafts(64)
        _made[kind] = (target, p)
    return _made[kind]


KINDS = ["dflash2", "dflash", "dspark", "dspark-no-head", "forced", "ar"]


def prefilled(target, proposer, prompts):
    sampling = Sampling(1.0, 0, 1.0, torch.Generator().manual_seed(0))
    return sd._prefill(target, proposer, prompts, 64, 16, proposer.width, False, sampling)


def redraws_keep_earlier_confidences(target, proposer, rows, seeds):
    """Draw the block once per seed at T = 1; for every pair of draws and every row, the confidences of the slots
    up to and including the first whose draft differs must agree. Returns (violations, the first differing slot of
    each redraw that differs)."""
    ctx_len = int(rows.pos.max())
    sizes = sd.block_sizes(rows.end, rows.pos, proposer.width)
    draws = []
    for seed in seeds:
        if isinstance(proposer, proposers.Forced):
            torch.manual_seed(seed)  # a test's proposals draw from the global generator
        d = proposer.draft(rows.ctx, rows.anchor, rows.pos, sizes, ctx_len,
                           Sampling(1.0, 0, 1.0, torch.Generator().manual_seed(seed)))
        draws.append((d.tokens, d.confidence))
    bad, firsts = [], []
    base_tokens, base_conf = draws[0]
    for tokens, conf in draws[1:]:
        for r in range(tokens.shape[0]):
            differ = (tokens[r] != base_tokens[r]).nonzero()
            if not len(differ):  # the same block again: nothing to compare
                continue
            k = int(differ[0])
            firsts.append(k)
            if not torch.allclose(conf[r, : k + 1], base_conf[r, : k + 1], atol=1e-6, rtol=0):
                bad.append((r, k))
    return bad, firsts


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompts=st.lists(st.lists(st.integers(0, 62), min_size=1, max_size=9), min_size=1, max_size=3),
       seed=st.integers(0, 2**20))
def test_a_slots_confidence_ignores_its_own_and_later_drafts(kind, prompts, seed):
    target, proposer = made(kind)
    rows = prefilled(target, proposer, prompts)
    bad, firsts = redraws_keep_earlier_confidences(target, proposer, rows, range(seed, seed + 6))
    assert not bad, bad
    d = proposer.draft(rows.ctx, rows.anchor, rows.pos, sd.block_sizes(rows.end, rows.pos, proposer.width),
                       int(rows.pos.max()), Sampling(1.0, 0, 1.0, torch.Generator().manual_seed(seed)))
    n = proposer.width - 1
    assert d.tokens.shape == (len(prompts), n) and d.q.shape == (len(prompts), n, 64)
    assert d.confidence.shape == (len(prompts), n) and ((d.confidence >= 0) & (d.confidence <= 1)).all()
    if n:  # some redraw differed, so some confidence was compared against a changed draft
        assert firsts


@pytest.mark.parametrize("kind, plant", [("dspark", "head_reads_d_k"), ("dspark-no-head", "head_reads_d_k"),
                                         ("dflash2", "confidence_is_q_of_d_k"), ("dflash", "confidence_is_q_of_d_k")])
def test_a_confidence_that_reads_its_own_draft_is_caught(monkeypatch, kind, plant):
    """Planted: DSpark's confidence fed [d_1 .. d_B] instead of [anchor, d_1 .. d_{B-1}] (its head, or the no-head
    fallback, reads d_k); DFlash's confidence taken as q_k(d_k), the draft's own probability. The redraw property
    finds both."""
    target, proposer = made(kind)
    if plant == "head_reads_d_k":
        monkeypatch.setattr(proposers, "walk_prev_ids", lambda anchor, drafts: drafts)
    else:
        real = proposer.draft

        def draft(*args, **kwargs):
            d = real(*args, **kwargs)
            return proposers.Draft(d.tokens, d.q, lambda: d.q.gather(-1, d.tokens[..., None]).squeeze(-1), d.candidates)

        monkeypatch.setattr(proposer, "draft", draft)
    rows = prefilled(target, proposer, [[1, 2, 3], [9, 8, 7, 6, 5]])
    bad, _ = redraws_keep_earlier_confidences(target, proposer, rows, range(8))
    assert bad


def test_dspark_without_a_head_falls_back_to_its_walks_law():
    """A DSpark drafter with no confidence head: its confidence is the largest probability of the walk's law at
    T = 1 given the previous draft (dspark_logits), the auto policy cuts on it, greedy output stays the target's,
    and DeepSpec's threshold, which needs the head, is refused in one line."""
    from dflash2.dspark import dspark_logits, walk_prev_ids
    from dflash2.policy import Policy
    from dflash2.settings import SettingError
    from targets import reference_greedy

    target, proposer = made("dspark-no-head")
    drafter = proposer.drafter
    assert drafter.confidence_head is None and not proposer.confidence_head
    rows = prefilled(target, proposer, [[4, 5, 6]])
    ctx_len = int(rows.pos.max())
    d = proposer.draft(rows.ctx, rows.anchor, rows.pos, None, ctx_len, Sampling(0.0, 0, 1.0, None))
    slots = torch.arange(ctx_len)
    h = drafter(drafter.embed_block(rows.anchor, target.embed_tokens, 5), rows.pos[:, None] + torch.arange(5),
                rows.ctx.view(ctx_len), slots[None] < rows.pos[:, None])
    law = dspark_logits(drafter, h, walk_prev_ids(rows.anchor, d.tokens), target.lm_head_weight).softmax(-1)
    torch.testing.assert_close(d.confidence, law.amax(-1))
    prompts = [[1, 2, 3], list(range(5, 17))]
    results = sd.generate(target, drafter, prompts, method="dspark", max_new_tokens=16, policy="auto",
                          policy_override=Policy(synthetic_costs(0.002, 0.0, 0.0), 5))
    for p, res in zip(prompts, results):
        assert res.tokens == reference_greedy(target.model, p, 16)
    assert {w for r in results for w in r.widths} & {2, 3, 4, 5}  # the fallback confidence cut blocks short
    with pytest.raises(SettingError, match="dspark_threshold needs a drafter with a confidence head"):
        sd.generate(target, drafter, prompts, method="dspark", dspark_threshold=0.5)


# --- the drafter's context: deferred one-token writes ---


def projected(drafter, features, positions, one_by_one, planted=None):
    """A DraftContext after writing features [b, n, F] at positions [b, n] one token at a time (deferred, then
    flushed by a read) or in one batched write. planted: a broken flush (for the negative controls)."""
    ctx = model.DraftContext(drafter, features.shape[0], 32, "cpu", defer=True)
    if one_by_one:
        for j in range(features.shape[1]):
            ctx.write(features[:, j : j + 1], positions[:, j : j + 1])
    else:
        ctx.write(features, positions)
    if planted == "drops_last":
        ctx.pending = ctx.pending[:-1]
    elif planted == "one_late":
        ctx.pending = [(f, p + 1) for f, p in ctx.pending]
    return [tuple(t.clone() for t in kv) for kv in ctx.view(32)]


@pytest.mark.parametrize("planted", [None, "drops_last", "one_late"])
def test_one_token_writes_read_back_as_one_batched_write(planted):
    """n deferred one-token writes, flushed by the next read, leave the context a single write of the n tokens
    leaves (each row at its own positions); a flush that drops the last pending write, or writes every pending one a
    position late, is caught."""
    target, proposer = made("dflash2")
    drafter = proposer.drafter
    g = torch.Generator().manual_seed(0)
    n, F = 5, drafter.fc.in_features
    features = torch.randn(2, n, F, generator=g)
    positions = torch.stack([torch.arange(3, 3 + n), torch.arange(10, 10 + n)])
    one = projected(drafter, features, positions, True, planted)
    batch = projected(drafter, features, positions, False)
    same = all(torch.allclose(a, b, atol=1e-6, rtol=1e-6) for kv, kv_ref in zip(one, batch) for a, b in zip(kv, kv_ref))
    assert same == (planted is None)


def test_every_method_has_a_proposer():
    from dflash2.settings import METHODS

    assert set(proposers.PROPOSERS) == set(METHODS)
    assert proposers.proposer_kind("dflash2", propose=lambda a, p: None) is proposers.Forced
    assert proposers.proposer_kind("ar", propose=lambda a, p: None) is proposers.NoDrafts


@pytest.mark.parametrize("block", [2, 5, 8])
def test_the_width_checked_before_loading_is_the_built_proposers(block):
    """check_prompt_length reads kind.width_of(block) before any weights load (the CLI); the proposer built later
    verifies proposer.width tokens: the two must agree for every method's proposer."""
    lm = tiny_target("llama")
    target = Target(lm, (0, 1))
    drafters = {proposers.DFlash2Walk: tiny_drafter(lm, block_size=block), proposers.DSparkWalk: tiny_dspark(lm, block)}
    drafters[proposers.DFlash1Walk] = drafters[proposers.DFlash2Walk]
    for kind in set(proposers.PROPOSERS.values()) | {proposers.Forced}:
        built = proposers.make_proposer(kind, target, drafters.get(kind), block, propose=lambda a, p: None)
        assert built.width == kind.width_of(block), kind
