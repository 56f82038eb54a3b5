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
divergent step, slot and field. The last part does the same for the serving engines' sampled
verification (SGLang's and vLLM's rules, ported from their Triton and CUDA in a few lines): the exact
law of a verification step on a tiny vocabulary, or compare_traces given the same uniforms, names each.
"""
import dataclasses
import importlib
import importlib.util
import json
import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from dflash2 import model as ours_model
from dflash2 import spec_decode as sd
from dflash2 import verify
from dflash2.checkpoint import DFlash2Config
from dflash2.model import CandidateSelector, DFlash2Drafter, DynamicConv
from dflash2.settings import DecodeSettings
from dflash2.trace import check_trace, compare_traces, step_record
from targets import tiny_glm_config
from test_verify import (all_prefixes, brute_force_process_logits, max_error_against_target, toy_proposal,
                         verify_sampled_law)

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


def write_trace(path, draft, on_pair=None, target=GOLDEN / "target", **settings):
    """A trace of the golden prompts as one ragged batch (the one place this file runs the loop), written
    by our loop with whatever the caller planted; on_pair(pair) may change the loaded pair first."""
    from dflash2.pair import load_pair, stop_token_ids
    from dflash2.trace import run

    pair = load_pair(str(target), str(draft), torch.device("cpu"), torch.float32)
    if on_pair is not None:
        on_pair(pair)
    full = DecodeSettings(max_new_tokens=12, stop_ids=stop_token_ids(pair.target.model, pair.tokenizer),
                          block_size=pair.drafter.config.block_size, policy="fixed")
    run(pair, golden_prompts(), dataclasses.replace(full, **settings), trace_path=path)
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def divergence(tmp_path, draft, plant, on_pair=None, target=GOLDEN / "target", **settings):
    """check_trace's line for a trace written with `plant` applied."""
    with pytest.MonkeyPatch.context() as mp:
        plant(mp)
        write_trace(tmp_path / "port.jsonl", draft, on_pair, target, **settings)
    agree, line = check_trace(tmp_path / "port.jsonl", str(target), str(draft))
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


def test_planted_window_without_use_sliding_window_is_named_where_the_context_first_reaches_w(tmp_path):
    """vLLM with `dflash_config.swa_window_size` (its own key) windows a sliding layer although
    use_sliding_window is false, where the authors' model reads no window (transformers' Qwen3Config drops
    sliding_window). Planted as a window of W = the config's sliding_window on every sliding layer."""
    draft = golden_draft(tmp_path, use_sliding_window=False)
    W = json.loads((draft / "config.json").read_text())["sliding_window"]
    good = write_trace(tmp_path / "good.jsonl", draft)
    windowed = lambda self, i: self.sliding_window if self.layer_types[i] == "sliding_attention" else None  # noqa: E731
    line = divergence(tmp_path, draft, lambda mp: mp.setattr(DFlash2Config, "layer_window", windowed))
    # no window sees every context key; a window of W drops key p + t - W from slot t once p + t >= W
    assert line.startswith("divergence: " + first_step(good, lambda r: r["anchor_pos"] + len(r["drafts"]) >= W)), line


def test_full_end_blocks_trimmed_at_the_budget_keep_the_greedy_tokens_and_verify_more(tmp_path, monkeypatch):
    """vLLM and SGLang never shrink the block near max_tokens: they verify a full block and trim the accepted
    run at the budget (docs/PORTS.md). Greedy, that commits the same tokens as the authors' shrunk blocks; it
    verifies more drafts, and the last steps' drafts differ (tests/test_conformance.py names the first
    shortened step with --check-trace)."""
    good = write_trace(tmp_path / "good.jsonl", GOLDEN / "draft")
    B = good[0]["block_size"]
    assert any(len(r["drafts"]) < B - 1 for r in good if r["type"] == "step")  # the budget shrank some blocks
    monkeypatch.setattr(sd, "block_sizes", lambda end, pos, block_size: torch.full_like(pos, block_size))
    full = write_trace(tmp_path / "full.jsonl", GOLDEN / "draft")
    results = lambda records: {r["request"]: r["tokens"] for r in records if r["type"] == "result"}  # noqa: E731
    drafts = lambda records: sum(len(r["drafts"]) for r in records if r["type"] == "step")  # noqa: E731
    assert results(full) == results(good)
    assert all(len(r["drafts"]) == B - 1 for r in full if r["type"] == "step")
    assert drafts(full) > drafts(good)


# --- the serving engines' sampled verification (read in their wheels, docs/PORTS.md), planted ---
# SGLang 0.5.23 and vLLM 0.33.0 verify in Triton and CUDA, so their rules are ported here in a few lines each
# (docs/PORTS.md cites the script that ran SGLang's kernels themselves in Triton's interpreter). Each port is planted
# into verify.py, and the check that names it is run on the reference (it passes) and on the port (it fails).

OUR_PROCESS_LOGITS = verify.process_logits  # the ports below call it; the tests monkeypatch the module's name


def sglang_top_k_process_logits(logits, temperature, top_k=0, top_p=1.0):
    """SGLang's sparse top-k for verification (srt/speculative/dflash_utils.py:1073-1090): z = logits / T, keep the
    top_k entries a descending sort lists first (exactly k: of the ties with the k-th, the lower ids here; on CUDA
    whatever order torch.topk gives), softmax over those. top_p then as ours (not a lead)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if 0 < top_k < z.shape[-1]:
        dropped = z.sort(dim=-1, descending=True, stable=True).indices[..., top_k:]
        z = z.scatter(-1, dropped, float("-inf"))
    return OUR_PROCESS_LOGITS(z, 1.0, 0, top_p)


def emitted_law(logits, Q, vocab, n, temperature, top_k):
    """The exact law of one verification step (test_verify.verify_sampled_law: verify_sampled at the midpoint
    of every cell of its uniforms) with P built by whatever verify.process_logits is at call time."""
    P = verify.process_logits(logits, temperature, top_k)
    return verify_sampled_law(P, Q, vocab, n)


def defined_target(logits, temperature, top_k):
    """P by the definition, row by row (test_verify.brute_force_process_logits: ties with the k-th kept)."""
    return torch.tensor([brute_force_process_logits(row, temperature, top_k, 1.0)[0] for row in logits.tolist()],
                        dtype=torch.float64)


def test_planted_exactly_k_top_k_is_caught_by_the_law_on_tied_logits(monkeypatch):
    """Lead "SGLang's sparse top-k keeps exactly k". SPEC §5 keeps every token tied with the k-th largest
    logit (as transformers' TopKLogitsWarper does); the port keeps k. On 4 tokens whose logits tie at the
    k-th place (a permutation of [2, 1, 1, 0] per prefix, k = 2), the exact law of a 2-draft step equals the
    definition's target for the reference, and is off by the dropped tied token's mass for the port. Without
    ties the two agree, so the property test on continuous logits (test_verify) cannot see this."""
    vocab, n, T, k = 4, 2, 0.7, 2
    gen = torch.Generator().manual_seed(3)
    rows = len(all_prefixes(vocab, n))
    logits = torch.stack([torch.tensor([2.0, 1.0, 1.0, 0.0], dtype=torch.float64)[torch.randperm(vocab, generator=gen)]
                          for _ in range(rows)])
    Q = toy_proposal(vocab, n, "sampled", 3, gen)
    target = defined_target(logits, T, k)
    assert ((target > 0).sum(-1) == 3).all()  # the definition keeps the tie: 3 tokens for k = 2
    assert max_error_against_target(emitted_law(logits, Q, vocab, n, T, k), target, vocab, n) < 1e-9
    monkeypatch.setattr(verify, "process_logits", sglang_top_k_process_logits)
    port = verify.process_logits(logits, T, k)
    assert ((port > 0).sum(-1) == 2).all()
    law = emitted_law(logits, Q, vocab, n, T, k)
    error = max_error_against_target(law, target, vocab, n)
    assert error > 0.05, error
    # the first token alone: the port never emits the tied token it dropped, which the target gives > 0.1
    dropped = int(((target[0] > 0) & (port[0] == 0)).int().argmax())
    assert sum(prob for seq, prob in law.items() if seq[0] == dropped) == 0 and target[0, dropped] > 0.1


def golden_target_with_tied_logits(tmp_path):
    """The golden target with lm_head rows 2m + 1 set to rows 2m: its logits come in tied pairs at every
    position, so a top-k with k odd always cuts a tie (the k-th and the (k+1)-th largest are equal)."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / "tied_target"
    target.mkdir()
    for f in (GOLDEN / "target").iterdir():
        target.joinpath(f.name).write_bytes(f.read_bytes())
    state = load_file(target / "model.safetensors")
    state["lm_head.weight"][1::2] = state["lm_head.weight"][0::2]
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_planted_exactly_k_top_k_is_named_on_a_target_with_tied_logits(tmp_path):
    """The same lead through the loop: on a target whose logits tie in pairs, at T = 0.8 and top_k = 3,
    the reference's own trace replays exactly, and the port's is named at the first step where its P
    (3 tokens where SPEC §5 keeps 4) changes a draw: the first token (anchor), num_accepted or out."""
    target = golden_target_with_tied_logits(tmp_path)
    settings = dict(temperature=0.8, top_k=3)
    write_trace(tmp_path / "ours.jsonl", GOLDEN / "draft", target=target, **settings)
    agree, line = check_trace(tmp_path / "ours.jsonl", str(target), str(GOLDEN / "draft"))
    assert agree, line
    line = divergence(tmp_path, GOLDEN / "draft", lambda mp: mp.setattr(sd, "process_logits", sglang_top_k_process_logits),
                      target=target, **settings)
    assert re.match(r"divergence: request \d+ step \d+ field (anchor|num_accepted|out)\b", line), line


def vllm_draft_vocab_process_logits(draft_vocab):
    """vLLM's probabilistic rejection with draft logits (v1/worker/gpu/spec_decode/rejection_sampler_utils.py:1166):
    vocab_size = min(target, draft), and every later pass reads only tokens below it (the target's softmax
    statistics, `mask = block_offsets < vocab_size` at :255; the residual and bonus draw, `block < vocab_size` at
    :878). So P is the target's softmax over its first draft_vocab tokens; the rest get 0."""
    def process_logits(logits, temperature, top_k=0, top_p=1.0):
        p = OUR_PROCESS_LOGITS(logits[..., :draft_vocab], temperature, top_k, top_p)
        return torch.nn.functional.pad(p, (0, logits.shape[-1] - draft_vocab))
    return process_logits


def test_planted_vocabulary_cut_to_the_drafters_is_caught_by_the_law(monkeypatch):
    """Lead "vLLM's probabilistic mode uses vocab_size = min(target, draft)". A target of 5 tokens and a drafter
    of 4 (q never proposes token 4): the reference's exact law is the target's; the port's never emits
    token 4 and is off by its mass. Lossless only when the target's extra rows carry no mass (padding)."""
    vocab, n, T, draft_vocab = 5, 2, 1.0, 4
    gen = torch.Generator().manual_seed(4)
    logits = 2 * torch.randn(len(all_prefixes(vocab, n)), vocab, generator=gen, dtype=torch.float64)
    logits[:, 4] += 2  # token 4 carries real mass: not padding
    Q = toy_proposal(vocab, n, "sampled", 3, gen)
    Q[:, 4] = 0  # the drafter's vocabulary stops at 4 tokens
    Q = Q / Q.sum(-1, keepdim=True)
    target = verify.process_logits(logits, T)
    assert max_error_against_target(emitted_law(logits, Q, vocab, n, T, 0), target, vocab, n) < 1e-9
    monkeypatch.setattr(verify, "process_logits", vllm_draft_vocab_process_logits(draft_vocab))
    law = emitted_law(logits, Q, vocab, n, T, 0)
    error = max_error_against_target(law, target, vocab, n)
    assert error > 0.05, error
    assert not any(4 in seq for seq in law) and (target[:, 4] > 0).all()


def verified_step(drafts, q, p, u_accept, u_emit):
    """One request's step record from verify.verify_sampled as it is at call time (planted or not), with
    the uniforms given: drafts [n], q [n, V] (row i-1 is q_i), p [n+1, V], u_accept [n], u_emit a float."""
    n = len(drafts)
    d = torch.tensor([drafts])
    a, out = verify.verify_sampled(d, q[None], p[None], torch.tensor([u_accept]).view(1, n), torch.tensor([u_emit]))
    a = int(a[0])
    return step_record(request=0, step=1, anchor_pos=3, anchor=1, drafts=drafts, candidates=None, cand_logits=None,
                       q=None, q_draft=q.gather(-1, d.T).flatten().tolist(), target_argmax=p.argmax(-1).tolist(),
                       u_accept=list(u_accept), u_emit=u_emit, num_accepted=a, out=out[0, : a + 1].tolist())


def sglang_walk_index(q, u):
    """SGLang's walk draw (kernels/ops/speculative/dflash.py:288-291; its CPU path srt/models/dflash.py:1224-1239):
    the index #{j : u >= cumsum_j(q)}, clamped to K - 1. A float32 row whose mass ends below u yields the last
    candidate, whatever its q."""
    return (u[..., None] >= q.cumsum(-1)).sum(-1).clamp(max=q.shape[-1] - 1)


def sglang_acceptance_probability(p_draft, q_draft):
    """SGLang's chain rejection (kernels/ops/speculative/reject_sampling.py:147-149): accept iff 0 < q <= 1 and
    u * q < P, so alpha = min(1, P/q) for q in (0, 1] and 0 otherwise."""
    ok = (q_draft > 0) & (q_draft <= 1)
    return torch.where(ok, p_draft / torch.where(ok, q_draft, 1.0), 0.0).clamp(max=1.0)


def test_planted_zero_q_rejection_is_named_at_num_accepted(monkeypatch):
    """Lead "SGLang always rejects a draft with q(d) = 0". Where such a draft comes from: a float32 softmax
    row over K = 4 candidates, two of them underflowed to 0, whose mass is 1 - 2^-24; SGLang's walk with
    u = 1 - 2^-24 (the largest float32 below 1) clamps to candidate 3, q = 0; our sample_from scales u by the
    row's own sum and stays on tokens with mass. SPEC §5 then accepts d when P(d) > 0 (alpha = 1, the limit of
    min(1, P/q) as q -> 0; the clamp really draws d with probability 2^-24 here, so 1 is also the exact
    alpha whenever P(d) >= 2^-24). The port rejects it for every u. The replayed uniforms being the same,
    compare_traces names the step's num_accepted."""
    q = torch.tensor([[0.75, 0.25 - 2.0**-24, 0.0, 0.0]])
    u = torch.tensor([1 - 2.0**-24])
    assert sglang_walk_index(q, u).tolist() == [3] and q[0, 3] == 0
    assert verify.sample_from(q, u).tolist() == [1]
    p = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
    for u_accept in (0.0, 0.5, 0.99):
        ref = verified_step([3], q, p, [u_accept], 0.5)
        assert ref["num_accepted"] == 1 and compare_traces([ref], [ref], 1e-4) is None
        with monkeypatch.context() as mp:
            mp.setattr(verify, "acceptance_probability", sglang_acceptance_probability)
            port = verified_step([3], q, p, [u_accept], 0.5)
        assert compare_traces([ref], [port], 1e-4) == "request 0 step 1 field num_accepted: reference 1 vs trace 0"


def sglang_final_draw(weights, coin, block=4096):
    """SGLang's residual and bonus draw (kernels/ops/speculative/reject_sampling.py:175-239) from one row of
    weights >= 0 [V]: pass 1 sets norm to the sum of the block sums (tl.sum); pass 2 scans each block
    (tl.cumsum) and returns the first token whose running total exceeds coin * norm, else token V - 1. A
    pairwise tree stands in for tl.sum and a left-to-right scan for tl.cumsum, float32 throughout (Triton
    fixes neither order; they are the orders its interpreter uses, docs/PORTS.md's kernel script)."""
    def tree_sum(x):
        while len(x) > 1:
            x = torch.nn.functional.pad(x, (0, len(x) % 2))
            x = x[0::2] + x[1::2]
        return x[0]

    w = weights.float()
    V = len(w)
    blocks = [w[i:i + block] for i in range(0, V, block)]
    norm = torch.tensor(0.0)
    for b in blocks:
        norm = norm + tree_sum(b)
    target_u, total = torch.tensor(coin, dtype=torch.float32) * norm, torch.tensor(0.0)
    for start, b in zip(range(0, V, block), blocks):
        prefix = torch.tensor(0.0)
        for j, x in enumerate(b):
            prefix = prefix + x
            if total + prefix > target_u:
                return start + j
        total = total + tree_sum(b)
    return V - 1


def plant_sglang_residual_draw(mp):
    """SGLang's residual (max(P - q, 0), no fallback: the kernel normalises by its own pass-1 sum) and its draw."""
    mp.setattr(verify, "residual_distribution", lambda p, q: (p - q).clamp(min=0))
    mp.setattr(verify, "sample_from", lambda w, u: torch.tensor([sglang_final_draw(r, c) for r, c in zip(w, u.tolist())]))
    mp.setattr(verify, "acceptance_probability", sglang_acceptance_probability)


def test_planted_residual_fall_through_to_the_last_token_is_named_at_out(monkeypatch):
    """Lead "SGLang's residual and bonus kernel can fall through to token V - 1". Two ways, both with a
    token the target gives probability 0 emitted:
    1. a zero residual: P = q = [1/2, 1/2, 0, 0] and a draft with q(d) = P(d) = 0 (the clamp above):
       rejected on both sides; max(P - q, 0) is 0 everywhere, so the port emits token 3 for every u, while
       SPEC §5 draws from P itself (verify.residual_distribution);
    2. rounding: the bonus row P = [1, a, a, a, 0, 0, 0, 0], a = 2^-24, at u = 1 - 2^-24. The tree sums it to
       1 + 2^-23, the scan never passes 1 (each a is half an ulp of 1, rounded away), u * norm rounds to 1,
       so no running total exceeds it and the port emits token 7. Our sample_from takes u * total from its
       own cumulative sum, and never steps past the last token with mass.
    The replayed uniforms being the same, compare_traces names the emitted token (out)."""
    half = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25] * 4])
    a = 2.0**-24
    bonus = torch.tensor([[1.0] + [0.0] * 7, [1.0, a, a, a, 0.0, 0.0, 0.0, 0.0]])
    one_hot = torch.tensor([[1.0] + [0.0] * 7])
    cases = [([2], half, p, 0.5, u, "out[0]") for u in (0.0, 0.3, 0.9)] + [([0], one_hot, bonus, 0.5, 1 - a, "out[1]")]
    for drafts, q, p, u_accept, u_emit, field in cases:
        ref = verified_step(drafts, q, p, [u_accept], u_emit)
        emitted = ref["out"][-1]
        assert p[len(ref["out"]) - 1, emitted] > 0
        with monkeypatch.context() as mp:
            plant_sglang_residual_draw(mp)
            port = verified_step(drafts, q, p, [u_accept], u_emit)
        last = p.shape[-1] - 1
        assert port["out"][-1] == last and p[len(port["out"]) - 1, last] == 0
        assert compare_traces([ref], [port], 1e-4) == (
            f"request 0 step 1 field {field}: reference {emitted} vs trace {last}")
