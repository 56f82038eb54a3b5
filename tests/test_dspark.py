"""The DSpark drafter agrees with DeepSpec (deepseek-ai/DeepSpec, the authors' code): it loads the
checkpoint DeepSpec saved and computes the hidden states, Markov logits, drafts, proposals q,
confidences and confidence cuts that DeepSpec's own eval code computed with it
(tests/fixtures/dspark, written by tests/make_dspark_fixture.py; DeepSpec is not on PyPI)."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash2.dspark import (DSparkConfig, DSparkDrafter, confident_prefix, dspark_logits, dspark_walk, load_dspark,
                            walk_prev_ids)
from dflash2.model import DraftContext
from dflash2.verify import verify_sampled

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "dspark"
META = json.loads((FIXTURE / "meta.json").read_text())
EXPECTED = load_file(FIXTURE / "expected.safetensors")
CASES = range(len(META["cases"]))


@pytest.fixture(scope="module")
def drafter():
    return load_dspark(FIXTURE, dtype=torch.float64)


def expected(name):
    """One fixture tensor for both cases, stacked on a batch axis."""
    return torch.stack([EXPECTED[f"case{i}.{name}"] for i in CASES])


def fixture_context(drafter):
    """Both fixture cases' target features in one DraftContext (contexts of different lengths): the context, each
    case's length, the longest, and the anchors."""
    lengths = torch.tensor([c["context_length"] for c in META["cases"]])
    S = int(lengths.max())
    feats = torch.zeros(len(lengths), S, EXPECTED["case0.target_hidden"].shape[-1], dtype=torch.float64)
    for i in CASES:
        feats[i, : lengths[i]] = EXPECTED[f"case{i}.target_hidden"]
    ctx = DraftContext(drafter, len(lengths), S, "cpu")
    ctx.write(feats, torch.arange(S).expand(len(lengths), S))
    anchors = torch.tensor([c["anchor"] for c in META["cases"]])
    return ctx, lengths, S, anchors


def block_hidden(drafter):
    """Both fixture blocks in one batch: contexts of different lengths in one DraftContext."""
    ctx, lengths, S, anchors = fixture_context(drafter)
    B = drafter.config.block_size
    embeds = drafter.embed_block(anchors, drafter.embed_tokens, B)
    h = drafter(embeds, lengths[:, None] + torch.arange(B), ctx.view(S), torch.arange(S) < lengths[:, None])
    return h, anchors


def test_reads_deepspec_config():
    d = json.loads((FIXTURE / "config.json").read_text())
    cfg = DSparkConfig.from_dict(d)
    assert (cfg.block_size, cfg.markov_rank, cfg.markov_head_type) == (d["block_size"], 8, "vanilla")
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov
    assert cfg.target_layer_ids == d["target_layer_ids"] and cfg.mask_token_id == d["mask_token_id"]
    assert not any(cfg.layer_causal(i) for i in range(cfg.num_hidden_layers))
    for key in DSparkConfig.REQUIRED:
        with pytest.raises(ValueError, match=key):
            DSparkConfig.from_dict({k: v for k, v in d.items() if k != key})


def test_loads_every_tensor_of_the_deepspec_checkpoint(drafter):
    names = set(load_file(FIXTURE / "model.safetensors"))
    assert set(drafter.state_dict()) == names
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "embed_tokens.weight", "lm_head.weight"} <= names


def test_hidden_states_match_deepspec(drafter):
    h, _ = block_hidden(drafter)
    torch.testing.assert_close(h, expected("hidden"), rtol=0, atol=1e-6)


def test_markov_logits_match_deepspec(drafter):
    h, anchors = block_hidden(drafter)
    z = dspark_logits(drafter, h, walk_prev_ids(anchors, expected("greedy_drafts")))
    torch.testing.assert_close(z, expected("greedy_logits").float(), rtol=0, atol=1e-5)


def test_greedy_walk_matches_deepspec(drafter):
    h, anchors = block_hidden(drafter)
    drafts, q = dspark_walk(drafter, h, anchors)
    assert drafts.shape == (len(CASES), drafter.config.block_size)  # every slot proposes: B drafts per block
    assert torch.equal(drafts, expected("greedy_drafts"))
    assert torch.equal(q, expected("greedy_q"))


def test_sampled_proposal_matches_deepspec(drafter):
    """DeepSpec draws with torch.multinomial, we with one uniform per slot, so the draws differ; given
    DeepSpec's drafts, our q (softmax(z / T) at every slot) must equal the q it verified with."""
    h, anchors = block_hidden(drafter)
    T = META["temperature"]
    z = dspark_logits(drafter, h, walk_prev_ids(anchors, expected("sampled_drafts")))
    torch.testing.assert_close(torch.softmax(z / T, dim=-1), expected("sampled_q"), rtol=0, atol=1e-6)


@pytest.mark.parametrize("walk", ["greedy", "sampled"])
def test_confidence_matches_deepspec(drafter, walk):
    h, anchors = block_hidden(drafter)
    conf = drafter.confidence_logits(h, walk_prev_ids(anchors, expected(f"{walk}_drafts")))
    torch.testing.assert_close(conf, expected(f"{walk}_confidence"), rtol=0, atol=1e-5)


def test_confidence_cut_matches_deepspec(drafter):
    h, anchors = block_hidden(drafter)
    drafts, _ = dspark_walk(drafter, h, anchors)
    conf = drafter.confidence_logits(h, walk_prev_ids(anchors, drafts))
    B = drafter.config.block_size
    for j, threshold in enumerate(META["thresholds"]):
        cut = confident_prefix(conf, threshold)
        got = torch.full((len(CASES),), B) if cut is None else cut
        assert torch.equal(got, expected("greedy_cut")[:, j]), threshold


def fixture_proposal(drafter, sampling):
    """The fixture's two blocks through the loop's proposer (proposers.DSparkWalk.draft), contexts in one
    DraftContext."""
    from dflash2.proposers import DSparkWalk

    ctx, lengths, S, anchors = fixture_context(drafter)
    proposer = DSparkWalk(None, drafter, drafter.config.block_size)  # the fixture's drafter has its own tables
    return proposer.draft(ctx, anchors, lengths, None, S, sampling)


def test_the_loops_sampled_walk_matches_deepspec(drafter, monkeypatch):
    """DeepSpec's sampled block, through the loop's proposer: with each draw forced to the token DeepSpec drew
    (its torch.multinomial and our uniforms cannot draw alike), the walk feeds each draw to the next slot as DeepSpec
    does, so every slot's q, every confidence and DeepSpec's drafts come out of our walk."""
    from dflash2 import dspark
    from dflash2.verify import Sampling

    theirs, slot = expected("sampled_drafts"), [0]

    def forced(probs, generator=None):
        d = theirs[:, slot[0]]
        assert (probs.gather(-1, d[:, None]) > 0).all()  # a draw the walk's own law allows
        slot[0] += 1
        return d

    monkeypatch.setattr(dspark, "sample_index", forced)
    d = fixture_proposal(drafter, Sampling(META["temperature"], 0, 1.0, torch.Generator()))
    assert slot[0] == drafter.config.block_size and torch.equal(d.tokens, theirs)
    torch.testing.assert_close(d.q, expected("sampled_q"), rtol=0, atol=1e-6)
    torch.testing.assert_close(d.confidence, expected("sampled_confidence").sigmoid(), rtol=0, atol=1e-6)


def test_the_loops_confidence_cut_matches_deepspec(drafter):
    """DeepSpec's cut at each fixture threshold, as the loop runs it: the proposer's greedy block and confidences,
    cut by policy.ConfidenceThreshold (the drafts it verifies per row, and the forward's width)."""
    from dflash2.policy import ConfidenceThreshold
    from dflash2.verify import Sampling

    d = fixture_proposal(drafter, Sampling(0.0, 0, 1.0, None))
    assert torch.equal(d.tokens, expected("greedy_drafts"))
    B = drafter.config.block_size
    for j, threshold in enumerate(META["thresholds"]):
        if threshold == 0:
            continue  # the cut off: every draft verified (no ConfidenceThreshold is built)
        keep, width = ConfidenceThreshold(threshold).cut_chain(d.confidence, torch.full((len(d.tokens),), B - 1))
        assert torch.equal(keep, expected("greedy_cut")[:, j]) and width == int(keep.max()) + 1 <= B + 1, threshold


def test_drafting_from_slots_1_to_B_minus_1_is_detected(drafter):
    """specforge 0.2.0's spec_generate drafts from slots 1..B-1 with the anchor as slot 1's predecessor,
    although its training makes slot 0 predict the token after the anchor. The comparison catches it."""
    h, anchors = block_hidden(drafter)
    drafts, q = dspark_walk(drafter, h[:, 1:], anchors)
    ref_drafts, ref_q = expected("greedy_drafts")[:, : drafts.shape[1]], expected("greedy_q")[:, : drafts.shape[1]]
    assert not torch.equal(drafts, ref_drafts)
    assert not torch.allclose(q, ref_q)


def test_sampled_walk_draws_each_draft_from_its_q(drafter):
    """Every draft has mass under the q returned for it, and q is softmax(z / T) of the walk's own path."""
    h, anchors = block_hidden(drafter)
    T = 0.9
    drafts, q = dspark_walk(drafter, h, anchors, temperature=T, generator=torch.Generator().manual_seed(3))
    assert (q.gather(-1, drafts[..., None]) > 0).all()
    z = dspark_logits(drafter, h, walk_prev_ids(anchors, drafts))
    torch.testing.assert_close(q, torch.softmax(z / T, dim=-1))
    torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[:2]))


def test_round_trip_with_and_without_embedding_copies(drafter, tmp_path):
    h, anchors = block_hidden(drafter)
    drafter.save_pretrained(tmp_path / "full")
    again = DSparkDrafter.from_pretrained(tmp_path / "full", dtype=torch.float64)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in drafter.state_dict().items())
    read = DSparkConfig.from_dict(json.loads((tmp_path / "full" / "config.json").read_text()))
    assert read == dataclasses.replace(drafter.config, dtype="float64")

    drafter.save_pretrained(tmp_path / "shared", with_embeddings=False)
    shared = load_dspark(tmp_path / "shared", dtype=torch.float64)
    assert not shared.own_embeddings and "lm_head.weight" not in load_file(tmp_path / "shared" / "model.safetensors")
    embeds = shared.embed_block(anchors, drafter.embed_tokens)  # the target's tables, passed in
    assert torch.equal(embeds, drafter.embed_block(anchors, drafter.embed_tokens))
    drafts, q = dspark_walk(shared, h, anchors, lm_head=drafter.lm_head.weight)
    assert torch.equal(drafts, expected("greedy_drafts")) and torch.equal(q, expected("greedy_q"))


def test_a_checkpoint_with_one_copy_only_is_refused(drafter, tmp_path):
    from safetensors.torch import save_file

    from dflash2.checkpoint import CheckpointError

    drafter.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="embed_tokens"):
        load_dspark(tmp_path)


def test_verification_of_a_cut_block_accepts_only_the_kept_drafts(drafter):
    """The walk's drafts and q go straight into verify_sampled; a confidence cut is its num_drafts."""
    h, anchors = block_hidden(drafter)
    drafts, q = dspark_walk(drafter, h, anchors, temperature=1.0, generator=torch.Generator().manual_seed(0))
    B, V = drafts.shape[1], q.shape[-1]
    p = torch.zeros(len(CASES), B + 1, V)
    p[:, :B] = q  # a target that agrees with the drafter accepts every verified draft
    p[:, B, 0] = 1.0
    num_drafts = torch.tensor([2, B])
    accepted, out = verify_sampled(drafts, q, p, torch.rand(len(CASES), B), torch.rand(len(CASES)), num_drafts)
    assert accepted.tolist() == [2, B]
    assert torch.equal(out[1, :B], drafts[1])


# --- DSpark in the loop: generate, the policy's cut by its confidence head, the CLI and traces ---


def tiny_dspark(target_model, block_size=4, head=True, seed=2):
    """A random DSpark drafter shaped for a tiny target (vocab 64, hidden 32, 3 layers)."""
    from dflash2.dspark import DSparkConfig

    cfg = target_model.config
    torch.manual_seed(seed)
    config = DSparkConfig(hidden_size=cfg.hidden_size, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=cfg.vocab_size,
                          num_target_layers=cfg.num_hidden_layers, target_layer_ids=[0, 1],
                          mask_token_id=cfg.vocab_size - 1, block_size=block_size, markov_rank=8,
                          markov_head_type="vanilla", enable_confidence_head=head, confidence_head_with_markov=head,
                          dtype="float32")
    return DSparkDrafter(config).eval()


@pytest.mark.parametrize("arch", ["llama", "minimax_m2"])
@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_dspark_greedy_matches_target(arch, policy):
    from dflash2 import spec_decode as sd
    from dflash2.policy import Policy
    from dflash2.target import Target
    from targets import reference_greedy, synthetic_costs, tiny_target

    model = tiny_target(arch)
    drafter = tiny_dspark(model)
    target = Target(model, drafter.config.target_layer_ids)
    prompts = [[1, 2, 3], list(range(5, 17)), [7]]
    override = Policy(synthetic_costs(0.02, 0.2), 4) if policy == "auto" else None
    for max_batch in (None, 2):
        results = sd.generate(target, drafter, prompts, method="dspark", max_new_tokens=20, max_batch=max_batch,
                              policy=policy, policy_override=override)
        for prompt, res in zip(prompts, results):
            assert res.tokens == reference_greedy(model, prompt, 20)
            assert all(0 <= a <= 4 for a in res.accepted)  # a block of 4 slots verifies up to 4 drafts
            assert all(a <= w - 1 for a, w in zip(res.accepted, res.widths))  # never past the drafts it kept


def test_dspark_sampling_loop_preserves_target_distribution():
    """Monte Carlo through the real loop with the Markov walk's q (vocab 12, law of three tokens)."""
    from dflash2.target import Target
    from targets import tiny_target
    from test_spec_decode import _loop_tv

    model = tiny_target("llama", vocab=12, seed=3)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.25)
    drafter = tiny_dspark(model, block_size=3)
    target = Target(model, drafter.config.target_layer_ids)
    results = []
    tv, bound = _loop_tv(model, target, drafter, "dspark", rows=30000, n=3, results_out=results)
    assert tv < bound, (tv, bound)
    assert sum(sum(r.accepted) for r in results) > 0.05 * sum(len(r.accepted) for r in results)  # drafts accepted


def confident_pair():
    """vocab 12 and a DSpark drafter whose confidence head says sigma(c_k) = 1 - sigmoid(8) after an odd token and
    sigmoid(8) after an even one (through W1[prev]), so a threshold of 0.5 cuts a block at the first odd predecessor."""
    from dflash2.target import Target
    from targets import tiny_target

    model = tiny_target("llama", vocab=12, seed=3)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.25)
    drafter = tiny_dspark(model, block_size=3)
    with torch.no_grad():
        w1 = drafter.markov_head.markov_w1.weight
        w1.zero_()
        w1[:, 0] = torch.tensor([1.0 if t % 2 == 0 else -1.0 for t in range(12)])
        proj = drafter.confidence_head.proj
        proj.weight.zero_()
        proj.bias.zero_()
        proj.weight[0, drafter.config.hidden_size] = 8.0  # the first W1 input
    return model, Target(model, drafter.config.target_layer_ids), drafter


@pytest.mark.parametrize("planted", [False, True])
def test_dspark_threshold_cut_keeps_the_target_distribution(monkeypatch, planted):
    """Monte Carlo through generate at T = 1 with DeepSpec's cut (dspark_threshold): rows are cut at different
    slots, and the law of two tokens is the target's. Negative control: the head fed [d_1 .. d_B] instead of
    [anchor, d_1 .. d_{B-1}], so the cut reads the draft it cuts; the same check finds the law off."""
    from dflash2 import proposers
    from test_spec_decode import _loop_tv

    model, target, drafter = confident_pair()
    if planted:
        monkeypatch.setattr(proposers, "walk_prev_ids", lambda anchor, drafts: drafts)
    results = []
    tv, bound = _loop_tv(model, target, drafter, "dspark", rows=20000, n=2, results_out=results, dspark_threshold=0.5)
    if planted:
        assert tv > 2 * bound, (tv, bound)
        return
    assert tv < bound, (tv, bound)
    widths = [w for r in results for w in r.widths]
    assert min(widths.count(w) for w in (1, 2, 3, 4)) > 0.05 * len(widths)  # every cut happens
    assert all(a <= w - 1 for r in results for a, w in zip(r.accepted, r.widths))


def test_dspark_runs_from_the_command_line_and_its_trace_replays(tmp_path, capsys):
    import dflash2_ref
    from test_cli import GOLDEN

    from dflash2.pair import load_pair

    pair = load_pair(str(GOLDEN / "target"), str(GOLDEN / "draft"))
    tiny_dspark(pair.target.model).save_pretrained(tmp_path / "dspark")
    argv = ["--target", str(GOLDEN / "target"), "--draft", str(tmp_path / "dspark"), "--method", "dspark",
            "--prompt", "the time of day", "--max-new-tokens", "16"]
    assert dflash2_ref.main(argv + ["--baseline", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] is True and report["method"] == "dspark"
    for sampled in ([], ["--temperature", "0.8", "--seed", "3"], ["--temperature", "0.8", "--dspark-threshold", "0.5"]):
        assert dflash2_ref.main(argv + sampled + ["--trace", str(tmp_path / "t.jsonl"), "--json"]) == 0
        capsys.readouterr()
        assert dflash2_ref.main(["--check-trace", str(tmp_path / "t.jsonl")]) == 0
        assert capsys.readouterr().out.startswith("agree:")
    # a DSpark drafter under another method, and the embedded DFlash 2 drafter under dspark: one clear line
    assert dflash2_ref.main(argv[:4] + ["--method", "dflash2", "--prompt", "x"]) == 2
    assert "needs a DFlash 2 drafter" in capsys.readouterr().err
    assert dflash2_ref.main(["--target", str(GOLDEN / "target"), "--draft", str(GOLDEN / "draft"), "--method",
                             "dspark", "--prompt", "x"]) == 2
    assert "'dspark' needs a DSpark drafter" in capsys.readouterr().err


def test_embedded_dspark_drafter_shares_the_targets_tables():
    """The shipped DSpark drafter carries no copy of the target's embedding or LM head (it borrows them)."""
    from safetensors import safe_open

    from dflash2.settings import DEFAULT_DSPARK_DRAFT

    with safe_open(DEFAULT_DSPARK_DRAFT / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert any("markov" in n for n in names) and any("confidence" in n for n in names)
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
