"""dflash2-tree through the real loop is lossless: greedy output equals the target's for every batch
shape, budget, block size and score mode; a one-candidate tree decodes as the chain; sampling keeps
the target's law over several steps; the drafter's context holds exactly the accepted nodes; and
planted bugs in the mask, the positions, the compaction and the context are each caught.
(The tree math itself, with exact enumeration of the sampled law: tests/test_tree.py.)"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dflash2 import proposers, spec_decode as sd
from dflash2.target import SlotCache, Target
from dflash2.settings import InputError
from targets import TREE_ARCHS, reference_greedy, tiny_drafter, tiny_target
from test_spec_decode import _loop_tv, _sampling_pair, uncached_draft

_cache = {}


def pair(arch, top_k=4):
    if (arch, top_k) not in _cache:
        model = tiny_target(arch)
        drafter = tiny_drafter(model, 8, top_k=top_k)
        _cache[arch, top_k] = (model, Target(model, drafter.config.target_layer_ids), drafter)
    return _cache[arch, top_k]


prompts_st = st.lists(st.lists(st.integers(0, 62), min_size=1, max_size=12), min_size=1, max_size=3)
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("arch", TREE_ARCHS)
@SETTINGS
@given(prompts=prompts_st, budget=st.integers(1, 64), block_size=st.integers(2, 8),
       scores=st.sampled_from(["selector", "marginal"]), n=st.integers(1, 14))
def test_tree_greedy_matches_target(arch, prompts, budget, block_size, scores, n):
    model, target, drafter = pair(arch)
    results = sd.generate(target, drafter, prompts, method="dflash2-tree", max_new_tokens=n, block_size=block_size,
                          tree_budget=budget, tree_scores=scores)
    for prompt, res in zip(prompts, results):
        assert res.tokens == reference_greedy(model, prompt, n)
        assert all(0 <= a <= block_size - 1 for a in res.accepted)


def test_tree_accepts_more_than_the_chain_where_candidates_hold_the_target():
    """Not a vacuous pass: with a generous budget the tree accepts drafts on these tiny targets."""
    model, target, drafter = pair("llama")
    prompts = [[1, 2, 3], list(range(5, 20)), [7]]
    tree = sd.generate(target, drafter, prompts, method="dflash2-tree", max_new_tokens=20, tree_budget=64,
                       tree_scores="marginal", policy="fixed")
    assert sum(sum(r.accepted) for r in tree) > 0


@pytest.mark.parametrize("max_batch", [None, 2])
def test_tree_continuous_batching_equals_each_alone(max_batch):
    model, target, drafter = pair("llama")
    prompts = [[1, 2, 3], list(range(5, 20)), [7], [9, 9, 8, 8, 7, 7, 6]]
    batch = sd.generate(target, drafter, prompts, method="dflash2-tree", policy="fixed", max_new_tokens=15, tree_budget=12,
                        max_batch=max_batch, stop_ids=[reference_greedy(model, prompts[0], 15)[6]])
    for p, res in zip(prompts, batch):
        alone = sd.generate(target, drafter, [p], method="dflash2-tree", policy="fixed", max_new_tokens=15, tree_budget=12,
                            stop_ids=[reference_greedy(model, prompts[0], 15)[6]])[0]
        assert res.tokens == alone.tokens and res.accepted == alone.accepted


@pytest.mark.parametrize("block_size", [2, 5, 8])
def test_single_chain_tree_decodes_as_the_chain(block_size):
    """With one candidate per slot the tree is the walk's path: same tokens, same acceptance per step."""
    model, target, drafter = pair("llama", top_k=1)
    prompts = [[1, 2, 3], list(range(5, 20)), [7]]
    chain = sd.generate(target, drafter, prompts, max_new_tokens=20, block_size=block_size, policy="fixed")
    tree = sd.generate(target, drafter, prompts, method="dflash2-tree", policy="fixed", max_new_tokens=20, block_size=block_size,
                       tree_budget=block_size - 1)
    assert [(r.tokens, r.accepted) for r in tree] == [(r.tokens, r.accepted) for r in chain]


def test_block_sparse_target_is_refused_with_a_clear_error():
    model = tiny_target("minimax_m3")
    drafter = tiny_drafter(model)
    with pytest.raises(InputError, match="dense attention"):
        sd.generate(Target(model, drafter.config.target_layer_ids), drafter, [[1, 2]], method="dflash2-tree")


@pytest.mark.parametrize("budget, scores", [(6, "selector"), (10, "marginal")])
def test_tree_sampling_loop_preserves_target_distribution(budget, scores):
    """Monte Carlo through the real loop (tree build, one forward with the tree mask, draws at every
    node, compaction, context) against the exact law of four tokens: several tree steps each."""
    model, target, drafter = _sampling_pair()
    tv, bound = _loop_tv(model, target, drafter, "dflash2-tree", rows=20000, n=4, temperature=0.8, top_k=0,
                         top_p=0.9, tree_budget=budget, tree_scores=scores)
    assert tv < bound, (tv, bound)


# --- planted bugs, each caught ---


def golden_pair():
    """The golden pair: a drafter fitted to its target, so trees are accepted deep (a random drafter's
    rarely pass depth 1, where a missing grandparent or a wrong position cannot show)."""
    from dflash2.pair import load_pair
    from test_spec_decode import GOLDEN

    if "golden" not in _cache:
        p = load_pair(str(GOLDEN / "target"), str(GOLDEN / "draft"), "cpu", torch.float32)
        _cache["golden"] = (p.target.model, p.target, p.drafter)
    return _cache["golden"]


GOLDEN_PROMPTS = [[3, 5, 53, 7, 0, 4], [3, 32, 11, 12, 13, 34, 35, 0, 4], [3, 0, 4], [3, 9, 4, 20]]


def _greedy_fails():
    model, target, drafter = golden_pair()
    results = sd.generate(target, drafter, GOLDEN_PROMPTS, method="dflash2-tree", policy="fixed", max_new_tokens=24, tree_budget=16)
    assert sum(a >= 2 for r in results for a in r.accepted) >= 4  # deep paths were accepted
    return any(r.tokens != reference_greedy(model, p, 24) for p, r in zip(GOLDEN_PROMPTS, results))


def _node_logits_wrong(arch="llama", steps=6, deep=None):
    """Whether any tree node's target logits differ from an uncached forward over the committed tokens
    followed by the node's own path (what the tree mask and positions must reproduce), in the first
    `steps` steps of a ragged batch. arch "golden": the golden pair, whose trees are accepted deep;
    deep (a list) then gets each step's count of rows that accepted two nodes or more."""
    model, target, drafter = golden_pair() if arch == "golden" else pair(arch)
    prompts = GOLDEN_PROMPTS[:3] if arch == "golden" else [[1, 2, 3], list(range(5, 20)), [7]]
    emitted, seen, forward = {r: [] for r in range(len(prompts))}, [], target.forward

    def spy(ids, positions, cache, view_len, slots=None, visible=None, last=None):
        logits, feats = forward(ids, positions, cache, view_len, slots, visible, last)
        seen.append(logits)
        return logits, feats

    def trace(rec):
        if rec["steps"][0] > steps:
            return
        if deep is not None:
            deep.append(int((rec["num_accepted"] >= 2).sum()))
        tree, logits = rec["tree"], seen[-1]
        for r, req in enumerate(rec["requests"]):
            committed = prompts[req] + emitted[req]
            for i in range(tree.tokens.shape[1] + 1):
                if i and not tree.valid[r, i - 1]:
                    continue
                path, j = [], i
                while j:
                    path.insert(0, int(tree.tokens[r, j - 1]))
                    j = int(tree.parents[r, j - 1])
                with torch.no_grad():
                    want = model(torch.tensor([committed + path])).logits[0, -1]
                if not torch.allclose(logits[r, i], want, atol=1e-4, rtol=1e-4):
                    wrong.append((req, i))

    wrong = []
    target.forward = spy
    try:
        sd.generate(target, drafter, prompts, method="dflash2-tree", policy="fixed", max_new_tokens=16, tree_budget=12,
                    tree_scores="marginal", trace=trace, on_emit=lambda req, toks: emitted[req].extend(toks))
    finally:
        del target.forward
    return bool(wrong)


@pytest.mark.parametrize("arch", TREE_ARCHS + ("golden",))
def test_every_node_sees_exactly_its_path(arch):
    """The target's logits at every tree node equal a plain forward over the committed tokens and that
    node's path: the mask shows a node its ancestors and nothing else, at positions anchor + depth, over
    a context the previous steps compacted correctly. (Greedy output alone can miss this: a small
    model's argmax often survives a wrong position.) On the golden pair, paths of two nodes and more are
    accepted, so the compaction of an accepted path is exercised, not only the anchor's."""
    deep = []
    assert not _node_logits_wrong(arch, deep=deep)
    if arch == "golden":
        assert sum(deep) >= 3, deep


def test_accepted_path_moved_one_slot_off_is_caught_by_node_logits(monkeypatch):
    """commit_path moving the accepted path's K/V one slot off (planted): the next steps' nodes see a
    wrong context, and the node logits name it, on a pair that accepts deep paths."""
    def off_by_one(rows, feats, path, B):
        entries = torch.cat([torch.zeros_like(path[:, :1]), path.clamp(min=0)], 1)
        block_pos = rows.pos[:, None] + torch.arange(B)
        rows.cache.move(rows.pos[:, None] + entries, block_pos + 1)  # one slot late
        rows.ctx.write(feats.gather(1, entries[:, :, None].expand(-1, -1, feats.shape[-1])), block_pos)

    assert not _node_logits_wrong("golden")
    monkeypatch.setattr(sd, "commit_path", off_by_one)
    assert _node_logits_wrong("golden")


def test_position_by_node_index_is_caught_by_node_logits(monkeypatch):
    model, target, _ = pair("llama")
    forward = Target.forward

    def by_index(self, ids, positions, cache, view_len, slots=None, visible=None, last=None):
        return forward(self, ids, positions if slots is None else slots, cache, view_len, slots, visible, last)

    monkeypatch.setattr(Target, "forward", by_index)
    assert _node_logits_wrong()


def test_missing_ancestor_in_the_mask_is_caught(monkeypatch):
    def parent_only(parents):  # self and parent, no closure: grandparents are invisible
        b, N = parents.shape
        par = torch.cat([parents.new_zeros(b, 1), parents], 1)
        return torch.eye(N + 1, dtype=torch.bool).expand(b, -1, -1) | torch.nn.functional.one_hot(par, N + 1).bool()

    assert not _greedy_fails()
    monkeypatch.setattr(sd, "tree_ancestors", parent_only)
    assert _greedy_fails()


def test_wrong_kv_kept_after_compaction_is_caught(monkeypatch):
    monkeypatch.setattr(SlotCache, "move", lambda self, src, dst: None)  # nodes' K/V stay in scratch order
    assert _greedy_fails()


def _context_of_node_order(rows, feats, path, B):
    """Mutant commit_path: the right K/V move, but the drafter's context gets the first B entries in node
    order, rejected nodes' features among them."""
    entries = torch.cat([torch.zeros_like(path[:, :1]), path.clamp(min=0)], 1)
    block_pos = rows.pos[:, None] + torch.arange(B)
    rows.cache.move(rows.pos[:, None] + entries, block_pos)
    rows.ctx.write(feats[:, :B], block_pos)


@pytest.mark.parametrize("mutant", [None, "rejected_features"])
def test_tree_context_holds_exactly_the_accepted_nodes(monkeypatch, mutant):
    """At every tree step of the golden pair (a fitted drafter, so paths are accepted), each row's
    drafter context in slots 0..pos-1 equals context_kv of features recomputed without any cache, and
    its h and U equal a drafter pass over them. A context fed a rejected node's features keeps greedy
    output exact, so only this check can see it: the mutant must fail it."""
    model, target, drafter = golden_pair()
    if mutant:
        monkeypatch.setattr(sd, "commit_path", _context_of_node_order)
    prompts = GOLDEN_PROMPTS
    n, emitted, calls, mismatches, checked = 20, {r: [] for r in range(len(prompts))}, [], [], []
    real_draft = proposers.draft

    def spy(drafter_, target_, ctx, anchor, pos, ctx_len, block_size, sizes=None):
        calls.append(dict(ctx=ctx, pos=pos, block_size=block_size, sizes=sizes))
        h, U = real_draft(drafter_, target_, ctx, anchor, pos, ctx_len, block_size, sizes)
        calls[-1].update(h=h, U=U)
        return h, U

    def trace(rec):
        call = calls[-1]
        for r, req in enumerate(rec["requests"]):
            tokens, pos = prompts[req] + emitted[req], int(call["pos"][r])
            size = int(call["sizes"][r])
            kv, h, U = uncached_draft(model, target, drafter, tokens, size)
            same = all(torch.allclose(k[r, :, :pos], k_ref[0], atol=1e-4, rtol=1e-4)
                       and torch.allclose(v[r, :, :pos], v_ref[0], atol=1e-4, rtol=1e-4)
                       for (k, v), (k_ref, v_ref) in zip(call["ctx"].kv, kv))
            same = same and torch.allclose(call["U"][r, : size - 1], U[0], atol=1e-4, rtol=1e-4)
            (checked if same else mismatches).append((req, pos))

    monkeypatch.setattr(proposers, "draft", spy)
    results = sd.generate(target, drafter, prompts, method="dflash2-tree", policy="fixed", max_new_tokens=n, tree_budget=12,
                          trace=trace, on_emit=lambda req, toks: emitted[req].extend(toks))
    assert sum(sum(r.accepted) for r in results) > 0  # paths were accepted, so the context had nodes to hold
    if mutant:
        assert mismatches
    else:
        assert not mismatches and len(checked) > 10
