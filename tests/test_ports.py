"""Other DFlash 2 implementations as witnesses (docs/PORTS.md).

vLLM's speculators==0.9.0 (`speculators/models/dflash2/`, a trainer's model, pure PyTorch) gets our
weights and runs on CPU beside this reference. Where the two agree, every stage is compared: the
fused context, the backbone hidden states, the draft logits, the top-K candidates and the selector's
edge scores (teacher-forced on the same predecessors). Where they differ, the difference is pinned:
a minimal input shows it, and ours with speculators' rule planted in reproduces theirs exactly, so
the difference is the rule named and nothing else. An unexplained mismatch fails.

speculators is installed with `pip install --no-deps speculators==0.9.0`; its package imports
`openai`, `datasets` and `hs_connectors` (for its data pipeline, never for the model), which the
fixture stubs in sys.modules for these tests only.

The second half plants each difference, and the four classes of port bug reported so far, into a
copy of our loop or drafter and shows that --check-trace (dflash2.trace.check_trace) names the first
divergent step, slot and field.
"""
import dataclasses
import importlib
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from dflash2 import model as ours_model
from dflash2 import spec_decode as sd
from dflash2.checkpoint import DFlash2Config
from dflash2.model import CandidateSelector, DFlash2Drafter, DynamicConv
from dflash2.settings import DecodeSettings
from dflash2.trace import check_trace, compare_traces, step_record
from targets import tiny_glm_config

GOLDEN = Path(__file__).resolve().parent / "golden"
ATOL = 1e-9  # float64 on both sides, and speculators run with SDPA: agreement to rounding
STUBBED = ("openai", "openai.types", "openai.types.chat", "openai.types.completion", "datasets", "hs_connectors")

# --- speculators, imported with its data-pipeline dependencies stubbed ---


def _stub(name):
    """A package whose every attribute is a fresh placeholder class (enough for import-time annotations)."""
    module = types.ModuleType(name)
    module.__path__ = []
    module.__getattr__ = lambda attr: type(attr, (), {})
    return module


@pytest.fixture(scope="module")
def spec():
    """speculators' DFlash 2 modules, imported with STUBBED in sys.modules; on teardown sys.modules is put
    back as it was (the stubs and every speculators module removed)."""
    if importlib.util.find_spec("speculators") is None:
        pytest.skip("speculators is not installed (pip install --no-deps speculators==0.9.0)")
    before = set(sys.modules)
    with pytest.MonkeyPatch.context() as mp:
        for name in STUBBED:
            if name not in sys.modules:
                mp.setitem(sys.modules, name, _stub(name))
        try:
            core = importlib.import_module("speculators.models.dflash2.core")
            defs = importlib.import_module("speculators.models.dflash2.model_definitions")
            config = importlib.import_module("speculators.models.dflash2.config")
        except ImportError as e:  # a stub too few: say which module broke the import
            pytest.fail(f"speculators does not import with {STUBBED} stubbed: {e}")
        yield types.SimpleNamespace(core=core, defs=defs, config=config)
        for name in set(sys.modules) - before:
            if name.split(".")[0] == "speculators":
                del sys.modules[name]


def their_config(spec, cfg, is_causal_ignored=True):
    """DFlash2SpeculatorConfig for our DFlash2Config: the Qwen3 layer config, the dflash keys, and
    aux_hidden_state_layer_ids in speculators' numbering (hidden_states index, ours + 1)."""
    from transformers import Qwen3Config

    layer = Qwen3Config(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"},
        max_position_embeddings=cfg.max_position_embeddings, layer_types=cfg.layer_types,
        sliding_window=cfg.sliding_window, use_sliding_window=cfg.use_sliding_window)
    layer._attn_implementation = "sdpa"  # a boolean mask and float64 softmax (eager's softmax is float32)
    return spec.config.DFlash2SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=cfg.vocab_size, block_size=cfg.block_size,
        aux_hidden_state_layer_ids=[l + 1 for l in cfg.target_layer_ids], mask_token_id=cfg.mask_token_id,
        conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
        selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k)


def randomize(drafter, seed):
    """Every weight live (no identity convolutions, no zero codebook), so no term of the forward is zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * r)
            elif name.endswith("base_kernel"):
                p.copy_(0.6 * r)
            else:
                p.copy_(r / math.sqrt(p.shape[-1]))
    return drafter


def their_model(spec, ours, embed, head):
    """speculators' DFlash2DraftModel holding our drafter's weights and the target's embedding and head."""
    theirs = spec.core.DFlash2DraftModel(their_config(spec, ours.config)).to(head.dtype)
    state = dict(ours.state_dict(), **{"embed_tokens.weight": embed, "lm_head.weight": head,
                                       "verifier_lm_head.weight": head,
                                       "verifier_norm.weight": torch.ones(head.shape[1], dtype=head.dtype)})
    theirs.load_state_dict(state, strict=True)  # same names: their layout is the published one
    return theirs.eval()


@dataclasses.dataclass
class Stages:
    ctx: torch.Tensor  # [L, H] fused context hidden_norm(fc(features))
    h: torch.Tensor  # [n_blocks, B, H] backbone output after the final norm, every slot
    U: torch.Tensor  # [n_blocks, B-1, V] draft logits of slots 1..B-1


def their_stages(theirs, features, ids, anchors):
    """speculators' training forward on one packed sequence, with exactly these anchors: the loss mask
    is 1 only at them, so select_anchors picks them all (sorted), and nothing is random."""
    T, B = ids.shape[1], theirs.block_size
    loss_mask = torch.zeros(1, T)
    loss_mask[0, anchors] = 1
    fused = []
    hook = theirs.hidden_norm.register_forward_hook(lambda m, i, o: fused.append(o))
    try:
        with torch.no_grad():
            hidden, logits, *_ = theirs._backbone_forward(
                features, ids, loss_mask, torch.zeros(1, T, features.shape[-1] // len(theirs.target_layer_ids),
                                                      dtype=features.dtype),
                torch.zeros(1, T, dtype=torch.long), max_anchors=len(anchors))
    finally:
        hook.remove()
    h = hidden.view(len(anchors), B, -1)
    return Stages(fused[0][0], h, logits.view(len(anchors), B, -1)[:, 1:])


def our_stages(ours, features, ids, anchors, embed, head):
    """This reference on the same blocks: anchor ids[p] at position p, context = every position before p."""
    cfg, B = ours.config, ours.config.block_size
    hs = []
    with torch.no_grad():
        ctx = ours.hidden_norm(ours.fc(features[0]))
        for p in anchors:
            block = ours.embed_block(ids[:, p], torch.nn.Embedding.from_pretrained(embed))
            kv = ours.context_kv(features[:, :p], torch.arange(p)[None])
            hs.append(ours(block, torch.arange(p, p + B)[None], kv, torch.ones(1, p, dtype=torch.bool)))
        h = torch.cat(hs)
        U = ours.draft_logits(h[:, 1:], head)
    assert U.dtype == torch.float32 and cfg is ours.config
    return Stages(ctx, h, U)


def inputs(cfg, T, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    H, V, n = cfg.hidden_size, cfg.vocab_size, len(cfg.target_layer_ids)
    features = torch.randn(1, T, n * H, generator=g, dtype=dtype)
    ids = torch.randint(0, V, (1, T), generator=g)
    embed = torch.randn(V, H, generator=g, dtype=dtype)
    head = torch.randn(V, H, generator=g, dtype=dtype) * 0.5
    return features, ids, embed, head


def assert_selector_agrees(ours, theirs, h, U, ids, anchors):
    """Top-K candidates, then every edge score S_t(a, b): theirs teacher-forced with predecessor
    C_{t-1}[a] (the anchor for t = 1), one call per a, against our batched einsum."""
    sel, K = ours.candidate_selector, ours.config.selector_top_k
    anchor = ids[0, anchors]
    cand, _ = sel.candidates(U, K)
    their_cand, _ = theirs.candidate_selector.select(U, h[:, 1:], torch.zeros_like(U[..., 0], dtype=torch.long))
    assert cand.tolist() == their_cand.tolist()  # both torch.topk(sorted=True) of the same logits
    with torch.no_grad():
        S = sel.edge_scores(h[:, 1:], U, cand, anchor)
        prev = torch.cat([anchor[:, None, None].expand(-1, 1, K), cand[:, :-1]], dim=1)
        for a in range(K):
            theirs_row = theirs.candidate_selector.score_candidates(U, h[:, 1:], prev[:, :, a], cand)
            torch.testing.assert_close(theirs_row.double(), S[:, :, a].double(), rtol=0, atol=1e-5)
        # the walk's own rows: their scores with the predecessors our greedy walk chose pick the same path
        path, _ = sel.walk(S, cand)
        walked_prev = torch.cat([anchor[:, None], path[:, :-1]], 1)
        greedy = cand.gather(-1, theirs.candidate_selector.score_candidates(U, h[:, 1:], walked_prev, cand)
                             .argmax(-1, keepdim=True)).squeeze(-1)
    assert greedy.tolist() == path.tolist()


CONFIGS = {  # context never longer than the window, is_causal false: the published reading
    "glm-shaped": dict(),
    "full-attention": dict(layer_types=["full_attention"] * 5),
    "sliding-types-no-window": dict(use_sliding_window=False),  # transformers drops the window: both full
    "conv-3-taps": dict(conv_kernel_size=3, conv_group_size=8, num_hidden_layers=2, layer_types=["sliding_attention"] * 2),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_speculators_agrees_where_the_window_is_not_reached(spec, name):
    """Fused context, hidden states (every slot of three blocks packed in one sequence), draft logits,
    candidates and every edge score agree to rounding (float64; logits float32 on our side)."""
    cfg = tiny_glm_config(is_causal=False, **CONFIGS[name])
    ours = randomize(DFlash2Drafter(cfg), seed=1).double()
    features, ids, embed, head = inputs(cfg, T=cfg.sliding_window + 1, seed=2)
    theirs = their_model(spec, ours, embed, head)
    anchors = [1, 5, cfg.sliding_window - cfg.block_size]  # the last slot p + B - 1 still sees position 0
    a, b = our_stages(ours, features, ids, anchors, embed, head), their_stages(theirs, features, ids, anchors)
    torch.testing.assert_close(a.ctx, b.ctx, rtol=0, atol=ATOL)
    torch.testing.assert_close(a.h, b.h, rtol=0, atol=ATOL)
    torch.testing.assert_close(a.U.double(), b.U, rtol=0, atol=1e-5)  # ours is float32 by design (SPEC §3)
    assert_selector_agrees(ours, theirs, a.h, a.U, ids, anchors)


# --- the differences, each pinned: theirs equals ours with their rule planted ---


def speculators_window_mask(q_pos, k_pos, k_valid, sliding_window=None, causal=False, backend="sdpa"):
    """speculators' drafter mask (dflash/attention.py create_anchor_block_mask_mod): a context key is seen
    iff anchor - W <= k < anchor, whatever the query's slot; the block sees all of itself."""
    from dflash2.kernels import AttentionMask

    T = q_pos.shape[1]
    anchor = q_pos[:, :1, None]
    ctx = k_valid[:, None, :].expand(-1, T, -1).clone()
    if sliding_window is not None:
        ctx &= k_pos[:, None, :] >= anchor - sliding_window
    ctx[:, :, -T:] = True
    if causal:
        ctx[:, :, -T:] &= torch.ones(T, T, dtype=torch.bool).tril()
    return AttentionMask(backend, ctx[:, None])


def test_speculators_window_reaches_anchor_minus_w_from_every_slot(spec, monkeypatch):
    """Ours: query at p + t sees context keys k with p + t - k < W (SPEC §3), so slot 0 sees W - 1 of them
    and slot t fewer. speculators: every slot sees anchor - W <= k < anchor, W keys. With a context of
    W + 4 positions the hidden states differ at every slot; with their mask planted in ours they agree."""
    cfg = tiny_glm_config(is_causal=False)
    ours = randomize(DFlash2Drafter(cfg), seed=3).double()
    W, B = cfg.sliding_window, cfg.block_size
    features, ids, embed, head = inputs(cfg, T=W + 4 + B + 1, seed=4)
    theirs = their_model(spec, ours, embed, head)
    anchors = [W + 4]
    b = their_stages(theirs, features, ids, anchors)
    a = our_stages(ours, features, ids, anchors, embed, head)
    assert ((a.h - b.h).abs().amax(-1) > 1e-3).all()  # every slot of the block differs
    monkeypatch.setattr(ours_model, "attention_mask", speculators_window_mask)
    a = our_stages(ours, features, ids, anchors, embed, head)
    torch.testing.assert_close(a.h, b.h, rtol=0, atol=ATOL)


@pytest.mark.parametrize("is_causal", [None, True])
def test_speculators_attention_is_always_bidirectional(spec, monkeypatch, is_causal):
    """The authors' reading (SPEC §3): is_causal absent makes sliding layers causal, is_causal true makes
    every layer causal. speculators ignores is_causal (its DFlash 2 config sets sliding_window_non_causal,
    and full layers are always bidirectional): its block attends to all of itself. Planting "never
    causal" in ours reproduces it."""
    cfg = tiny_glm_config(is_causal=is_causal)
    ours = randomize(DFlash2Drafter(cfg), seed=5).double()
    assert all(layer.self_attn.causal for layer in ours.layers)
    features, ids, embed, head = inputs(cfg, T=8 + cfg.block_size + 1, seed=6)
    theirs = their_model(spec, ours, embed, head)
    b = their_stages(theirs, features, ids, [8])
    a = our_stages(ours, features, ids, [8], embed, head)
    assert ((a.h - b.h).abs().amax(-1)[0, :-1] > 1e-3).all()  # the last slot sees everything either way
    for layer in ours.layers:
        monkeypatch.setattr(layer.self_attn, "causal", False)
    torch.testing.assert_close(our_stages(ours, features, ids, [8], embed, head).h, b.h, rtol=0, atol=ATOL)


def test_speculators_ignores_embedding_scale_output_multiplier_and_softcap(spec):
    """speculators' config has no input_embedding_scale, output_multiplier or final_logit_softcapping: its
    block is embed(ids) and its logits lm_head(h). On a config that sets all three (the published third
    drafter sets the last two, SPEC §2) theirs equals ours with the three at their defaults."""
    scaled = dict(input_embedding_scale=1.7, output_multiplier=0.19611613513818404, final_logit_softcapping=20.0)
    cfg = tiny_glm_config(is_causal=False, **scaled)
    ours = randomize(DFlash2Drafter(cfg), seed=7).double()
    features, ids, embed, head = inputs(cfg, T=8 + cfg.block_size + 1, seed=8)
    theirs = their_model(spec, ours, embed, head)
    b = their_stages(theirs, features, ids, [8])
    a = our_stages(ours, features, ids, [8], embed, head)
    assert (a.h - b.h).abs().max() > 1e-3 and (a.U - b.U).abs().max() > 1e-3
    plain = randomize(DFlash2Drafter(tiny_glm_config(is_causal=False)), seed=7).double()
    a = our_stages(plain, features, ids, [8], embed, head)
    torch.testing.assert_close(a.h, b.h, rtol=0, atol=ATOL)
    torch.testing.assert_close(a.U.double(), b.U, rtol=0, atol=1e-5)


def test_speculators_convolution_leaks_across_rows_of_short_blocks(spec):
    """speculators zeroes a tap by the flat row index modulo block_size (grouped_dynamic_conv). For full
    blocks that is the slot; for a batch of blocks shorter than block_size (a block cut at the end of a
    budget) row 1's slot 0 takes tap 1 from row 0's last slot. Ours zeroes by the slot (SPEC §3)."""
    H, B, G = 32, 6, 8
    ours = DynamicConv(H, 2, G).double()
    theirs = spec.defs.GroupedDynamicCausalConv(H, block_size=B, kernel_size=2, group_size=G).double()
    with torch.no_grad():
        ours.base_kernel.copy_(torch.randn(2, 2, H, dtype=torch.float64))
        ours.kernel_projection.weight.copy_(torch.randn_like(ours.kernel_projection.weight) / 4)
        theirs.load_state_dict(ours.state_dict())
        for T in (B, 4):  # a full block, then a short one
            u = torch.randn(2, T, H, dtype=torch.float64)
            a, coef = ours.prepare(u)
            b, _ = theirs.prepare(u)
            if T == B:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
                continue
            torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-12)  # row 0: flat index = slot
            leak = coef[1, 0, 0, 1] * u[0, T - 1]  # side 0, tap 1 of row 1 slot 0, times row 0's last input
            torch.testing.assert_close(b[1, 0] - a[1, 0], leak, rtol=0, atol=1e-12)


def test_speculators_adds_selector_scores_in_the_logits_dtype(spec):
    """speculators' score_candidates adds the unary logit and the bilinear term in the logits' dtype;
    with a bf16 head that rounds S to 8 bits of mantissa. Ours adds in float32 (draft logits are float32).
    Two candidates whose float32 scores differ by less than a bf16 step tie in theirs: their argmax takes
    the first (the higher unary logit), ours the true maximum."""
    cfg = DFlash2Config(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1,
                        num_key_value_heads=1, head_dim=16, vocab_size=8, num_target_layers=1, target_layer_ids=[0],
                        mask_token_id=0, selector_rank=1, selector_top_k=2, conv_group_size=8)
    ours = CandidateSelector(cfg)
    theirs = spec.defs.CandidateSelector(vocab_size=8, hidden_size=16, rank=1, top_k=2)
    with torch.no_grad():  # bilinear term = h . w * A[prev] * Bc[cand]: 0 for token 2, 0.1 for token 5
        ours.hidden_projection.weight.copy_(torch.eye(1, 16))
        ours.predecessor_codebook.fill_(1.0)
        ours.successor_codebook.zero_()
        ours.successor_codebook[5] = 0.1
        theirs.load_state_dict(ours.state_dict())
        ours, theirs = ours.bfloat16(), theirs.bfloat16()
    h = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    h[..., 0] = 1.0
    U = torch.full((1, 1, 8), -10.0, dtype=torch.bfloat16)
    U[0, 0, 2], U[0, 0, 5] = 16.0, 15.9375  # bf16 steps: 0.0625 below 16, 0.125 above
    anchor = torch.zeros(1, dtype=torch.long)
    cand, _ = ours.candidates(U.float(), 2)
    assert cand.tolist() == [[[2, 5]]]
    S = ours.edge_scores(h, U.float(), cand, anchor)
    S_theirs = theirs.score_candidates(U, h, anchor[:, None], cand)
    assert S.dtype == torch.float32 and S_theirs.dtype == torch.bfloat16
    assert S[0, 0, 0].tolist() == pytest.approx([16.0, 16.0376], abs=1e-4)  # 0.1 is 0.10009765625 in bf16
    assert S_theirs[0, 0].tolist() == [16.0, 16.0]  # 16.0376 rounds to 16 in bf16: a tie
    assert ours.walk(S, cand)[0].tolist() == [[5]]  # ours: the true maximum
    assert cand[0, 0, S_theirs[0, 0].float().argmax()].item() == 2  # theirs: the first of the tie


def test_speculators_selector_has_no_walk(spec):
    """speculators' CandidateSelector scores candidates for given predecessor ids (training, teacher-forced);
    nothing walks from slot to slot: a port built on it must write the walk (SPEC §4) itself."""
    cls = spec.defs.CandidateSelector
    assert {"select", "score_candidates", "transition_scores"} <= set(vars(cls))
    assert not any(n in vars(cls) for n in ("walk", "propose", "decode", "generate"))
    assert not hasattr(spec.core.DFlash2DraftModel, "propose")


@pytest.mark.slow
def test_speculators_agrees_on_the_embedded_pair(spec):
    """The embedded drafter over the embedded SmolLM2-135M target, float32: the target's own tapped
    features of a chat prompt, blocks anchored at four of its tokens (contexts far inside the 2048
    window). Every stage agrees within float32 rounding, and the selector's greedy path too."""
    from dflash2.pair import load_pair
    from dflash2.prompts import encode_prompt

    pair = load_pair(None, None, "cpu", torch.float32, draft_dtype=torch.float32, prepack=False)
    ours, lm = pair.drafter, pair.target.model
    taps = ours.config.target_layer_ids
    ids = torch.tensor([encode_prompt(pair.tokenizer, "Natalia sold clips to 48 of her friends in April, and "
                                      "then she sold half as many clips in May. How many clips did she sell?")])
    with torch.no_grad():
        out = lm(input_ids=ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[l + 1] for l in taps], dim=-1)
    embed, head = lm.get_input_embeddings().weight.detach(), lm.get_output_embeddings().weight.detach()
    theirs = their_model(spec, ours, embed, head)
    T, B = ids.shape[1], ours.config.block_size
    anchors = [5, T // 3, T // 2, T - B - 1]
    a, b = our_stages(ours, features, ids, anchors, embed, head), their_stages(theirs, features, ids, anchors)
    torch.testing.assert_close(a.ctx, b.ctx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.h, b.h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.U, b.U, rtol=1e-4, atol=1e-4)
    assert_selector_agrees(ours, theirs, a.h, a.U, ids, anchors)


# --- planted port bugs: --check-trace names the first divergent step, slot and field ---
# Each case plants one difference found above, or one class of bug reported in ports, into our drafter or
# loop (monkeypatched for the run that writes the trace only), then replays the trace with check_trace.


def golden_prompts():
    from transformers import AutoTokenizer

    from dflash2.prompts import encode_prompt

    tok = AutoTokenizer.from_pretrained(GOLDEN / "target")
    return [encode_prompt(tok, p) for p in ("the time of day", "what is it that we can make", "long")]


def golden_draft(tmp_path, **edits):
    """The golden drafter, its config.json edited (dflash_config keys go inside it; None deletes a key)."""
    draft = tmp_path / "draft"
    draft.mkdir(exist_ok=True)
    for f in (GOLDEN / "draft").iterdir():
        draft.joinpath(f.name).write_bytes(f.read_bytes())
    config = json.loads((draft / "config.json").read_text())
    for key, value in edits.items():
        where = config["dflash_config"] if key in DFlash2Config.DFLASH_KEYS else config
        if value is None:
            del where[key]
        else:
            where[key] = value
    (draft / "config.json").write_text(json.dumps(config))
    return draft


def write_trace(path, draft, on_pair=None, **settings):
    """A trace of the golden prompts as one ragged batch (the one place this file runs the loop), written
    by our loop with whatever the caller planted; on_pair(pair) may change the loaded pair first."""
    from dflash2.pair import load_pair, stop_token_ids
    from dflash2.trace import run

    pair = load_pair(str(GOLDEN / "target"), str(draft), torch.device("cpu"), torch.float32)
    if on_pair is not None:
        on_pair(pair)
    full = DecodeSettings(max_new_tokens=12, stop_ids=stop_token_ids(pair.target.model, pair.tokenizer),
                          block_size=pair.drafter.config.block_size)
    run(pair, golden_prompts(), dataclasses.replace(full, **settings), trace_path=path)
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def divergence(tmp_path, draft, plant, on_pair=None, **settings):
    """check_trace's line for a trace written with `plant` applied."""
    with pytest.MonkeyPatch.context() as mp:
        plant(mp)
        write_trace(tmp_path / "port.jsonl", draft, on_pair, **settings)
    agree, line = check_trace(tmp_path / "port.jsonl", str(GOLDEN / "target"), str(draft))
    assert not agree, line
    return line


def first_step(records, where):
    """'request r step s' of the first step record (file order) for which where(record) holds."""
    r = next(r for r in records if r["type"] == "step" and where(r))
    return f"request {r['request']} step {r['step']} "


def plant_no_anchor(mp):
    """hipfire #483: the block is [MASK x B], the anchor missing from slot 0."""
    embed_block = DFlash2Drafter.embed_block

    def masked(self, anchor_ids, embed_tokens, block_size=None):
        return embed_block(self, torch.full_like(anchor_ids, self.config.mask_token_id), embed_tokens, block_size)
    mp.setattr(DFlash2Drafter, "embed_block", masked)


def test_planted_missing_anchor_is_named_at_step_1_slot_1(tmp_path):
    line = divergence(tmp_path, GOLDEN / "draft", plant_no_anchor)
    assert line.startswith("divergence: request 0 step 1 slot 1 field candidates"), line


class _SharedNoise:
    """vLLM #54282: the uniforms that drew the walk's drafts are reused as the acceptance uniforms. The
    walk's sample_index records its uniforms; the loop's next torch.rand of shape [b, B-1] returns them."""

    def __init__(self, mp):
        from dflash2.verify import sample_from

        self.used = []

        def sample_index(probs, generator=None):
            u = torch.rand(probs.shape[:-1], generator=generator, device=probs.device)
            self.used.append(u)
            return sample_from(probs, u)

        mp.setattr(ours_model, "sample_index", sample_index)
        mp.setattr(sd, "torch", self)

    def rand(self, *size, **kwargs):
        if self.used and len(size) == 2 and tuple(size) == (self.used[0].shape[0], len(self.used)):
            u, self.used = torch.stack(self.used, 1), []
            return u
        self.used = []
        return torch.rand(*size, **kwargs)

    def __getattr__(self, name):
        return getattr(torch, name)


def test_planted_shared_noise_is_named_at_the_first_acceptance_uniform(tmp_path):
    line = divergence(tmp_path, GOLDEN / "draft", _SharedNoise, temperature=0.8)
    assert line.startswith("divergence: request 0 step 1 slot 1 field u_accept"), line


def test_planted_zero_probability_acceptance_at_u_0_is_named_at_num_accepted():
    """SGLang #35771: accept d when u <= P(d)/q(d), so u = 0 accepts a token the target gives probability 0.
    A replay draws its own uniforms, so a trace reaches this only when u = 0 is drawn (2^-24 per float32
    draw); given the same uniforms, the checker names the step's num_accepted."""
    from dflash2.verify import acceptance_probability, verify_sampled

    V = 5
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]]])  # P_0(d_1 = 0) = 0
    q = torch.zeros(1, 1, V)
    q[0, 0, 0] = 1.0
    drafts, u_accept, u_emit = torch.tensor([[0]]), torch.zeros(1, 1), torch.tensor([0.3])
    a, out = verify_sampled(drafts, q, p, u_accept, u_emit)
    assert a.tolist() == [0]  # the reference: u < alpha, and 0 < 0 is false
    alpha = acceptance_probability(p[0, 0, 0], q[0, 0, 0])
    planted_accepts = bool(u_accept[0, 0] <= alpha)
    assert planted_accepts

    def record(num_accepted, emitted):
        return step_record(request=0, step=1, anchor_pos=3, anchor=1, drafts=[0], candidates=[[0]], cand_logits=[[1.0]],
                           q=[[1.0]], q_draft=[1.0], target_argmax=[1, 0], u_accept=[0.0], u_emit=0.3,
                           num_accepted=num_accepted, out=emitted)
    ref = [record(0, out[0, :1].tolist())]
    port = [record(1, [0, int(torch.multinomial(p[0, 1], 1))])]
    assert compare_traces(ref, port, 1e-4) == "request 0 step 1 field num_accepted: reference 0 vs trace 1"


def test_planted_off_by_one_taps_are_named_at_step_1(tmp_path):
    """One way to the acceptance-length gaps of z-lab/dflash #170: features from hidden_states[l] (the
    input of layer l, speculators' and SGLang's capture point) read with our ids, which mean the output
    of layer l. Planted by shifting the target's tap ids down by one."""
    def shift(pair):
        pair.target.layer_ids = [l - 1 for l in pair.target.layer_ids]
    line = divergence(tmp_path, GOLDEN / "draft", lambda mp: None, on_pair=shift)
    assert line.startswith("divergence: request 0 step 1 slot 1 field candidates"), line


def test_planted_speculators_window_is_named_where_the_context_first_reaches_w(tmp_path):
    W = json.loads((GOLDEN / "draft" / "config.json").read_text())["sliding_window"]
    good = write_trace(tmp_path / "good.jsonl", GOLDEN / "draft")
    line = divergence(tmp_path, GOLDEN / "draft",
                      lambda mp: mp.setattr(ours_model, "attention_mask", speculators_window_mask))
    # the masks differ once a block slot p + t >= W: ours then drops context key p + t - W, theirs keeps p - W..
    assert line.startswith("divergence: " + first_step(good, lambda r: r["anchor_pos"] + len(r["drafts"]) >= W)), line
    assert " slot " in line and " field cand" in line, line


@pytest.mark.parametrize("edits", [dict(is_causal=True), dict(is_causal=None)])
def test_planted_bidirectional_layers_are_named_at_step_1(tmp_path, edits):
    """speculators (and SGLang without layer_types) run a bidirectional block whatever is_causal says."""
    draft = golden_draft(tmp_path, **edits)
    line = divergence(tmp_path, draft, lambda mp: mp.setattr(DFlash2Config, "layer_causal", lambda self, i: False))
    assert line.startswith("divergence: request 0 step 1 slot 1 field cand"), line


def test_planted_ignored_embedding_scale_is_named_at_step_1(tmp_path):
    """speculators, SGLang and vLLM's beam model embed the block without input_embedding_scale."""
    draft = golden_draft(tmp_path, input_embedding_scale=1.5)
    embed_block = DFlash2Drafter.embed_block

    def unscaled(self, anchor_ids, embed_tokens, block_size=None):
        return embed_block(self, anchor_ids, embed_tokens, block_size) / self.config.input_embedding_scale
    line = divergence(tmp_path, draft, lambda mp: mp.setattr(DFlash2Drafter, "embed_block", unscaled))
    assert line.startswith("divergence: request 0 step 1 slot 1 field cand"), line


def test_planted_ignored_output_multiplier_and_softcap_are_named_at_the_first_logit(tmp_path):
    """speculators and vLLM's beam model (multiplier) leave the draft logits unscaled: the candidates keep
    their order (both maps are increasing), their logits do not."""
    draft = golden_draft(tmp_path, output_multiplier=0.5, final_logit_softcapping=5.0)

    def plain_logits(self, h, lm_head):
        head = getattr(lm_head, "weight", lm_head)
        return torch.nn.functional.linear(h.reshape(-1, h.shape[-1]).to(head.dtype), head).float().view(*h.shape[:-1], -1)
    line = divergence(tmp_path, draft, lambda mp: mp.setattr(DFlash2Drafter, "draft_logits", plain_logits))
    assert line.startswith("divergence: request 0 step 1 slot 1 field cand_logits[0]"), line


def test_planted_bf16_selector_sum_is_named_at_q(tmp_path):
    """speculators adds unary and bilinear scores in the logits' dtype; with bf16 logits the sampled walk's
    proposal rows q move by a bf16 rounding of S (planted: S rounded to bf16)."""
    edge_scores = CandidateSelector.edge_scores

    def rounded(self, h, U, cand_ids, anchor_ids):
        return edge_scores(self, h, U, cand_ids, anchor_ids).bfloat16().float()
    line = divergence(tmp_path, GOLDEN / "draft", lambda mp: mp.setattr(CandidateSelector, "edge_scores", rounded),
                         temperature=0.8)
    assert line.startswith("divergence: request 0 step 1 slot 1 field q"), line


def test_planted_flat_index_convolution_is_named_at_the_second_row(tmp_path):
    """speculators (and vLLM's qwen3_dflash2 conv) zero taps by flat row % block_size with the model's
    block size. Run with blocks shorter than the drafter's (block_size 4 of 6), row 1's slot 0 takes
    row 0's last slot: request 0 agrees, request 1 is named at its first step."""
    def flat_conv(z, coef, B=6):
        b, T, H = z.shape
        flat, c = z.reshape(b * T, H), coef.reshape(b * T, *coef.shape[2:])
        slot = torch.arange(b * T) % B
        out = c[:, 0] * flat
        for j in range(1, c.shape[1]):
            out = out + c[:, j] * torch.nn.functional.pad(flat, (0, 0, j, 0))[: b * T] * (slot >= j)[:, None]
        return out.view(b, T, H)
    line = divergence(tmp_path, GOLDEN / "draft", lambda mp: mp.setattr(DynamicConv, "conv", staticmethod(flat_conv)),
                         block_size=4)
    assert line.startswith("divergence: request 1 step 1 slot "), line


def test_planted_greedy_walk_at_temperature_is_named_at_step_1(tmp_path):
    """vLLM's default draft_sample_method 'greedy': the walk takes argmax at every temperature (lossless,
    with one-hot q, but not the authors' sampled walk). The first sampled step shows it."""
    walk = CandidateSelector.walk

    def greedy(self, S, cand_ids, temperature=0.0, generator=None):
        return walk(self, S, cand_ids, 0.0, generator)
    line = divergence(tmp_path, GOLDEN / "draft", lambda mp: mp.setattr(CandidateSelector, "walk", greedy),
                         temperature=0.8)
    assert line.startswith("divergence: request 0 step 1 slot 1 field "), line
