"""This reference agrees with the authors' implementation, z-lab's `dflash==0.1.0` (PyPI; install with
`pip install --no-deps dflash==0.1.0`): both load the same checkpoint files, drawn by Hypothesis in the
published layout, and compute the same drafter hidden states, draft logits, candidates, selector
paths and proposals q, and the same greedy generation step by step. The adapter that writes their
steps as a trace passes --check-trace, and ports that drift from them are named at their first
divergent step."""
import contextlib
import functools
import json
import math
import statistics
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import save_file

from dflash2 import model as ours_model, proposers, spec_decode as sd
from dflash2.target import Target
from dflash2.checkpoint import DFlash2Config
from dflash2.model import DFlash2Drafter
from dflash2.pair import stop_token_ids
from dflash2.settings import DecodeSettings
from dflash2.trace import check_trace
from targets import tiny_target

try:
    import dflash.model as reference
except ImportError:
    reference = None

needs_dflash = pytest.mark.skipif(reference is None, reason="the authors' implementation is not installed "
                                  "(pip install --no-deps dflash==0.1.0)")
GOLDEN = Path(__file__).resolve().parent / "golden"
H, V, TARGET_LAYERS = 32, 64, 3  # the tiny Llama target of tests/targets.py


@functools.cache
def target64():
    return tiny_target("llama", vocab=V, hidden=H, layers=TARGET_LAYERS, dtype=torch.float64)


@st.composite
def published_config(draw):
    """A drafter config.json in the published layout (SPEC §2), tiny, with every optional key on or off."""
    layers = draw(st.integers(1, 3))
    kv_heads = draw(st.sampled_from([1, 2]))
    d = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": H,
        "intermediate_size": draw(st.sampled_from([16, 48])), "num_hidden_layers": layers,
        "num_attention_heads": kv_heads * draw(st.sampled_from([1, 2])), "num_key_value_heads": kv_heads,
        "head_dim": draw(st.sampled_from([4, 8])), "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": draw(st.sampled_from([1e4, 1e6])), "rope_type": "default"},
        "max_position_embeddings": 1024, "num_target_layers": TARGET_LAYERS, "vocab_size": V,
        "attention_bias": False, "tie_word_embeddings": False, "dtype": "float64",
    }
    if draw(st.booleans()):  # windows on: transformers keeps sliding_window only with use_sliding_window
        d["use_sliding_window"] = True
        d["sliding_window"] = draw(st.integers(1, 12))
    if draw(st.booleans()):
        d["layer_types"] = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                                         min_size=layers, max_size=layers))
    else:  # absent: Qwen3Config makes layers from max_window_layers on sliding (if windows are on)
        d["max_window_layers"] = draw(st.integers(0, layers))
    causal = draw(st.sampled_from(["absent", True, False]))
    if causal != "absent":
        d["is_causal"] = causal
    dflash = {
        "block_size": draw(st.integers(2, 16)), "conv_kernel_size": draw(st.integers(1, 3)),
        "conv_group_size": draw(st.sampled_from([4, 8, 16, 32])), "selector_rank": draw(st.integers(1, 8)),
        "selector_top_k": draw(st.integers(1, 8)),
        "target_layer_ids": sorted(draw(st.sets(st.integers(0, TARGET_LAYERS - 1), min_size=1))),
        "mask_token_id": draw(st.integers(0, V - 1)),
    }
    for key, values in (("input_embedding_scale", st.floats(0.5, 2.0)), ("output_multiplier", st.floats(0.3, 3.0)),
                        ("final_logit_softcapping", st.floats(4.0, 30.0))):
        if draw(st.booleans()):
            dflash[key] = draw(values)
    d["dflash_config"] = dflash
    # keys that may be absent: Qwen3Config's defaults (head_dim 128, window 4096) and the authors' (block 16,
    # taps spread over the target) apply; null kv heads means "= heads" (absent would be Qwen3Config's 32)
    for keys, key in ((d, "head_dim"), (d, "sliding_window"), (dflash, "block_size"), (dflash, "target_layer_ids")):
        if key in keys and draw(st.integers(0, 4)) == 0:
            del keys[key]
    if d["num_key_value_heads"] == d["num_attention_heads"] and draw(st.booleans()):
        d["num_key_value_heads"] = None
    return d


def write_checkpoint(directory, config_dict, seed):
    """Random float64 weights for config_dict in the published safetensors layout, and the config.json as drawn."""
    torch.manual_seed(seed)
    drafter = DFlash2Drafter(DFlash2Config.from_dict(config_dict)).double()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("base_kernel"):
                p.copy_(0.6 * torch.randn_like(p))
            else:  # every linear and codebook live, so no term of the forward is zero
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    # the drawn config as it is, including what the serving writer (checkpoint.write_checkpoint) would refuse
    save_file(drafter.state_dict(), Path(directory) / "model.safetensors")
    (Path(directory) / "config.json").write_text(json.dumps(config_dict))


@contextlib.contextmanager
def deterministic_walks():
    """Both walks pick argmax of their softmax(S/T) row instead of sampling (so they follow the same
    path and the sampled q rows can be compared); their return_stats timer made CPU-safe."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ours_model, "sample_index", lambda probs, generator=None: probs.argmax(-1))
        mp.setattr(reference, "_sample_probs", lambda probs: probs.argmax(-1))
        mp.setattr(reference, "_cuda_time", __import__("time").perf_counter)
        yield


def scatter_q(q_rows, candidates):
    """Their q rows over their K candidates -> [b, n, V] (zero outside C_t), the shape ours has."""
    return torch.zeros(*candidates.shape[:2], V, dtype=q_rows.dtype).scatter(-1, candidates, q_rows)


@settings(max_examples=100, deadline=None)
@given(config_dict=published_config())
def test_config_is_read_as_qwen3config_reads_it(config_dict):
    """Layer types, windows and the defaults of absent keys as transformers' Qwen3Config derives them
    (the authors' model reads its config through it); runs without dflash."""
    from transformers import Qwen3Config

    ours, qwen3 = DFlash2Config.from_dict(config_dict), Qwen3Config.from_dict(config_dict)
    assert ours.layer_types == qwen3.layer_types
    assert [ours.layer_window(i) for i in range(ours.num_hidden_layers)] == [
        qwen3.sliding_window if t == "sliding_attention" else None for t in qwen3.layer_types]
    assert (ours.head_dim, ours.num_key_value_heads, ours.rms_norm_eps, ours.rope_theta) == (
        qwen3.head_dim, qwen3.num_key_value_heads, qwen3.rms_norm_eps, qwen3.rope_parameters["rope_theta"])


@needs_dflash
@settings(max_examples=20, deadline=None)
@given(config_dict=published_config(), seed=st.integers(0, 2**16), ctx_len=st.integers(1, 20),
       prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=8), max_new_tokens=st.integers(1, 40),
       stop=st.one_of(st.none(), st.integers(0, V - 1)), temperature=st.sampled_from([0.5, 1.0, 2.0]))
def test_agrees_with_the_authors_implementation(config_dict, seed, ctx_len, prompt, max_new_tokens, stop, temperature):
    target = target64()
    with tempfile.TemporaryDirectory() as d:
        write_checkpoint(d, config_dict, seed)
        ours = DFlash2Drafter.from_pretrained(d, dtype=torch.float64)
        theirs = reference.DFlash2DraftModel.from_pretrained(d, dtype=torch.float64).eval()
    B, taps = ours.config.block_size, ours.config.target_layer_ids
    assert theirs.block_size == B and list(theirs.target_layer_ids) == taps
    assert [layer.self_attn.causal for layer in ours.layers] == [layer.self_attn.is_causal for layer in theirs.layers]
    assert ([layer.self_attn.sliding_window for layer in ours.layers]
            == [layer.self_attn.sliding_window for layer in theirs.layers])

    # one draft: random context features at positions 0..L-1, the block at L..L+B-1
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(1, ctx_len, len(taps) * H, dtype=torch.float64, generator=g)
    anchor = torch.randint(0, V, (1,), generator=g)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        block = ours.embed_block(anchor, embed)
        ctx_kv = ours.context_kv(features, torch.arange(ctx_len)[None])
        h = ours(block, torch.arange(ctx_len, ctx_len + B)[None], ctx_kv, torch.ones(1, ctx_len, dtype=torch.bool))
        h_ref = theirs(position_ids=torch.arange(ctx_len + B)[None], noise_embedding=block, target_hidden=features)
        torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)

        U = ours.draft_logits(h[:, 1:], head.weight)  # float32, as the loop uses them
        U_ref = theirs.compute_logits(h_ref[:, 1:], head)
        torch.testing.assert_close(U.double(), U_ref, rtol=1e-6, atol=1e-5)
        sel = ours.candidate_selector
        path, q, cand, _ = proposers.select_path(sel, h[:, 1:], U, anchor, 0.0, None)
        path_ref, cand_ref, _ = theirs.propose(h_ref[:, 1:], anchor, head, 0.0)
        # same members; theirs come unsorted (in another order on CPU too), see test_topk_ties_break_alike
        assert cand.sort(-1).values.tolist() == cand_ref.sort(-1).values.tolist()
        assert path.tolist() == path_ref.tolist()
        with deterministic_walks():
            path, q, _, _ = proposers.select_path(sel, h[:, 1:], U, anchor, temperature, None)
            path_ref, cand_ref, q_ref = theirs.propose(h_ref[:, 1:], anchor, head, temperature)
        assert path.tolist() == path_ref.tolist()
        torch.testing.assert_close(q.double(), scatter_q(q_ref, cand_ref).double(), rtol=1e-6, atol=1e-6)

    # a greedy generation on the tiny Llama target: same tokens, same tokens per step. Their loop cannot
    # run a config with sliding layers but no window (transformers' DynamicCache fails on the None window).
    if "sliding_attention" in theirs.config.layer_types and theirs.config.sliding_window is None:
        return
    stops = [] if stop is None else [stop]
    emitted = []
    (res,) = sd.generate(Target(target, taps), ours, [prompt], max_new_tokens=max_new_tokens, stop_ids=stops,
                         on_emit=lambda request, tokens: emitted.append(len(tokens)), policy="fixed")
    with deterministic_walks():
        stats = reference.dflash_generate(theirs, target, torch.tensor([prompt]), max_new_tokens, stops or None,
                                          return_stats=True)
    assert res.tokens == stats.output_ids[0, len(prompt):].tolist()
    assert emitted[1:] == stats.acceptance_lengths  # the prefill emits the first token
    if stats.acceptance_lengths:
        assert res.acceptance_length == pytest.approx(statistics.mean(stats.acceptance_lengths))
    else:
        assert res.acceptance_length is None


@needs_dflash
def test_topk_ties_break_alike():
    """Their candidates come from topk(sorted=False), ours from topk(sorted=True): the order differs (theirs
    is not descending), the members do not, even when logits tie at the K-th place; and where scores
    tie, a walk's argmax (the first maximum in candidate order) picks the same token in both orders.
    That is torch's CPU topk, checked here on tie-heavy rows; on CUDA the unsorted order is
    unspecified, so tied candidates could be walked differently there."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        V, k = int(torch.randint(20, 300, (1,), generator=g)), int(torch.randint(1, 17, (1,), generator=g))
        U = torch.randint(0, 6, (4, V), generator=g).double()  # six distinct values: ties everywhere
        ids, _ = ours_model.CandidateSelector.candidates(U, k)
        ids_ref = torch.topk(U, k, dim=-1, sorted=False).indices
        assert ids.sort(-1).values.tolist() == ids_ref.sort(-1).values.tolist()
        first_max = [c[u[c].argmax()] for c, u in zip(ids, U)]
        assert first_max == [c[u[c].argmax()] for c, u in zip(ids_ref, U)]
    U = torch.randint(0, 3, (2, 5, 200), generator=g).float()
    config = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                  num_key_value_heads=1, head_dim=8, vocab_size=200, num_target_layers=1, target_layer_ids=[0],
                  mask_token_id=0, selector_rank=4, selector_top_k=16, conv_group_size=8)
    sel = ours_model.CandidateSelector(DFlash2Config(**config))
    ref = reference.CandidateSelector(reference.Qwen3Config(hidden_size=8, vocab_size=200,
                                                            dflash_config={"selector_rank": 4, "selector_top_k": 16}))
    with torch.no_grad():  # zero bilinear term: S_t = U_t, so tied logits are tied scores
        sel.successor_codebook.zero_()
        ref.successor_codebook.weight.zero_()
        h = torch.randn(2, 5, 8, generator=g)
        anchor = torch.zeros(2, dtype=torch.long)
        path, _, _, _ = proposers.select_path(sel, h, U, anchor, 0.0, None)
        path_ref, _, _ = ref.select(h, U, anchor, 0.0)
    assert path.tolist() == path_ref.tolist()


# --- the oracle workflow: their loop written as a trace, checked by --check-trace ---


def golden_prompts():
    from dflash2.prompts import encode_prompt
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(GOLDEN / "target")
    return [encode_prompt(tok, p) for p in ("the time of day", "what is it that we can make", "long")]


@needs_dflash
def test_their_trace_passes_check_trace(tmp_path):
    from dflash2.conformance import write_reference_trace

    path = tmp_path / "theirs.jsonl"
    records = write_reference_trace(path, golden_prompts(), str(GOLDEN / "target"), str(GOLDEN / "draft"),
                                    max_new_tokens=24)
    steps = [r for r in records if r["type"] == "step"]
    assert any(len(s["drafts"]) < records[0]["block_size"] - 1 for s in steps)  # shrunk end blocks are in it
    agree, line = check_trace(path, str(GOLDEN / "target"), str(GOLDEN / "draft"))
    assert agree, line


def first_short_step(records):
    """(request, step) of the first step whose block the budget cut short."""
    B = records[0]["block_size"]
    return next((s["request"], s["step"]) for s in records if s["type"] == "step" and len(s["drafts"]) < B - 1)


def trace_of(tmp_path, name, draft, max_new_tokens=24):
    from dflash2.pair import load_pair
    from dflash2.trace import run

    pair = load_pair(str(GOLDEN / "target"), str(draft), torch.device("cpu"), torch.float32)
    stops = stop_token_ids(pair.target.model, pair.tokenizer)
    settings = DecodeSettings(max_new_tokens=max_new_tokens, stop_ids=stops, block_size=pair.drafter.config.block_size,
                              policy="fixed")
    path = tmp_path / f"{name}.jsonl"
    run(pair, golden_prompts(), settings, trace_path=path)
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def test_port_with_full_end_blocks_is_named_at_its_first_short_block(tmp_path, monkeypatch):
    """A port that drafts full blocks to the end of the budget (this project's old behaviour)."""
    _, good = trace_of(tmp_path, "good", GOLDEN / "draft")
    request, step = first_short_step(good)
    with monkeypatch.context() as mp:  # every row's block stays B wide; emission still stops at the budget
        mp.setattr(sd, "block_sizes", lambda end, pos, B: torch.full_like(pos, B))
        path, _ = trace_of(tmp_path, "full", GOLDEN / "draft")
    agree, line = check_trace(path, str(GOLDEN / "target"), str(GOLDEN / "draft"))
    assert not agree
    assert line.startswith(f"divergence: request {request} step {step} ")


def test_port_reading_is_causal_wrongly_is_named_at_step_1(tmp_path, monkeypatch):
    """A drafter config without is_causal: the authors' reading makes its sliding layers causal; a
    port that reads the absence as "not causal" (this project's old reading) drafts differently."""
    draft = tmp_path / "draft"
    draft.mkdir()
    for f in (GOLDEN / "draft").iterdir():
        draft.joinpath(f.name).write_bytes(f.read_bytes())
    config = json.loads((draft / "config.json").read_text())
    del config["is_causal"]
    (draft / "config.json").write_text(json.dumps(config))
    with monkeypatch.context() as mp:
        mp.setattr(DFlash2Config, "layer_causal", lambda self, i: False)
        path, _ = trace_of(tmp_path, "noncausal", draft)
    agree, line = check_trace(path, str(GOLDEN / "target"), str(draft))
    assert not agree and line.startswith("divergence: request 0 step 1 ")


def test_port_with_the_old_acceptance_length_is_named_at_its_result(tmp_path):
    """acceptance_length counted with the prefill as a step (tokens / (decode steps + 1)) reads lower."""
    path, records = trace_of(tmp_path, "tau", GOLDEN / "draft")
    for r in records:
        if r["type"] == "result":
            r["acceptance_length"] = len(r["tokens"]) / r["verify_steps"]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    agree, line = check_trace(path, str(GOLDEN / "target"), str(GOLDEN / "draft"))
    assert not agree and line.startswith("divergence: request 0 result field acceptance_length: ")
