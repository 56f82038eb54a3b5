import itertools
import json

import pytest
import torch
import torch.nn as nn
from hypothesis import example, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from dflash2 import model as model_module
from dflash2.checkpoint import CheckpointError, DFlash2Config
from dflash2.model import CandidateSelector, DFlash2Drafter, DynamicConv, dflash1_walk
from dflash2.proposers import select_path
from targets import tiny_glm_config

FAST = settings(max_examples=20, deadline=None)


def expected_layout(c):
    """SPEC §2 table: every tensor name and shape of a published checkpoint."""
    H, n, hd, I, V = c.hidden_size, len(c.target_layer_ids), c.head_dim, c.intermediate_size, c.vocab_size
    r, k, G = c.selector_rank, c.conv_kernel_size, c.conv_group_size
    heads, kvh = c.num_attention_heads, c.num_key_value_heads
    t = {"fc.weight": [H, n * H], "hidden_norm.weight": [H], "norm.weight": [H],
         "candidate_selector.hidden_projection.weight": [r, H],
         "candidate_selector.predecessor_codebook": [V, r],
         "candidate_selector.successor_codebook": [V, r]}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        t |= {p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H],
              p + "self_attn.q_proj.weight": [heads * hd, H], p + "self_attn.k_proj.weight": [kvh * hd, H],
              p + "self_attn.v_proj.weight": [kvh * hd, H], p + "self_attn.o_proj.weight": [H, heads * hd],
              p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd],
              p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H], p + "mlp.down_proj.weight": [H, I]}
        for conv in ("attention_conv", "mlp_conv"):
            t |= {p + f"{conv}.base_kernel": [2, k, H], p + f"{conv}.kernel_projection.weight": [2 * k * H // G, H]}
    return t


def randomize(model, seed=0):
    """Non-identity weights everywhere (convolutions and successor codebook included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def context_inputs(c, b=2, L=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    target_hidden = torch.randn(b, L, len(c.target_layer_ids) * c.hidden_size, generator=g)
    positions = torch.arange(L).expand(b, L)
    return target_hidden, positions


@pytest.fixture
def config():
    return tiny_glm_config()


# -- config and checkpoint ------------------------------------------------------------------

def test_tiny_config_keeps_published_structure(config):
    assert len(config.target_layer_ids) == 5 and config.num_hidden_layers == 5 and config.block_size == 8
    assert set(config.layer_types) == {"sliding_attention"} and config.use_sliding_window
    assert 0 <= config.mask_token_id < config.vocab_size


def test_state_dict_follows_published_layout(config):
    got = {k: list(v.shape) for k, v in DFlash2Drafter(config).state_dict().items()}
    assert got == expected_layout(config)


def test_config_reads_published_glm_json():
    glm = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": 4096,
           "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
           "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
           "max_position_embeddings": 202752, "layer_types": ["sliding_attention"] * 5,
           "sliding_window": 2048, "use_sliding_window": True, "num_target_layers": 45,
           "vocab_size": 154880, "is_causal": False, "attention_bias": False, "tie_word_embeddings": False,
           "dtype": "bfloat16", "eos_token_id": [154820, 154827],
           "dflash_config": {"block_size": 8, "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                             "selector_top_k": 16, "target_layer_ids": [5, 14, 24, 33, 42],
                             "mask_token_id": 154856}}
    c = DFlash2Config.from_dict(glm)
    assert (c.rope_theta, c.mask_token_id, c.output_multiplier, c.final_logit_softcapping) == (1e4, 154856, 1.0, None)
    assert c.layer_window(0) == 2048
    with torch.device("meta"):
        layout = {k: list(v.shape) for k, v in DFlash2Drafter(c).state_dict().items()}
    assert layout == expected_layout(c)
    assert layout["layers.0.attention_conv.kernel_projection.weight"] == [1024, 4096]
    d = c.to_dict()
    assert DFlash2Config.from_dict(d) == c
    assert d["dflash_config"]["mask_token_id"] == 154856 and d["rope_parameters"]["rope_theta"] == 1e4
    assert (d["is_causal"], d["attention_bias"], d["tie_word_embeddings"]) == (False, False, False)


def test_config_reads_older_top_level_rope_theta(config):
    d = config.to_dict()
    del d["rope_parameters"]
    d["rope_theta"] = 5e5
    assert DFlash2Config.from_dict(d).rope_theta == 5e5


@pytest.mark.parametrize("field,value", [
    ("hidden_size", 72), ("num_key_value_heads", 3), ("selector_top_k", 0), ("selector_top_k", 513),
    ("block_size", 1), ("target_layer_ids", []), ("target_layer_ids", [1, 9]), ("mask_token_id", 512),
    ("mask_token_id", -1), ("conv_kernel_size", 0), ("layer_types", ["sliding_attention"] * 4),
    ("head_dim", 15), ("rope_type", "yarn"), ("final_logit_softcapping", 0.0),
])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"\.{field}:"):
        tiny_glm_config(**{field: value})


def test_config_missing_key_is_named(config):
    d = config.to_dict()
    del d["dflash_config"]["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlash2Config.from_dict(d)


def test_save_load_roundtrip_is_bit_exact(config, tmp_path):
    model = randomize(DFlash2Drafter(config))
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert set(load_file(tmp_path / "model.safetensors")) == set(expected_layout(config))
    loaded = DFlash2Drafter.from_pretrained(tmp_path)
    assert loaded.config == model.config
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and v.dtype == v2.dtype and torch.equal(v, v2), k
    bf16 = DFlash2Drafter.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16


def test_bfloat16_save_records_dtype(config, tmp_path):
    DFlash2Drafter(config).save_pretrained(tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert DFlash2Drafter.from_pretrained(tmp_path).norm.weight.dtype == torch.bfloat16


def test_sharded_checkpoint_loads(config, tmp_path):
    model = randomize(DFlash2Drafter(config))
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / f)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = DFlash2Drafter.from_pretrained(tmp_path)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


def test_bad_tensors_are_all_named(config, tmp_path):
    DFlash2Drafter(config).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["layers.2.mlp_conv.base_kernel"]
    state["layers.0.self_attn.extra.weight"] = torch.zeros(3)
    state["candidate_selector.successor_codebook"] = torch.zeros(512, 8)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        DFlash2Drafter.from_pretrained(tmp_path)
    msg = str(e.value)
    assert "missing layers.2.mlp_conv.base_kernel [2, 2, 64]" in msg
    assert "unexpected layers.0.self_attn.extra.weight [3]" in msg
    assert "candidate_selector.successor_codebook: expected [512, 16], got [512, 8]" in msg
    assert isinstance(e.value, ValueError)


def test_missing_or_corrupt_files_name_the_path(config, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        DFlash2Drafter.from_pretrained(tmp_path)
    DFlash2Drafter(config).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        DFlash2Drafter.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        DFlash2Drafter.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        DFlash2Drafter.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        DFlash2Drafter.from_pretrained(tmp_path / "no_such_dir")


def test_unreachable_hub_id_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(OSError, match="some-org/some-drafter"):
        DFlash2Drafter.from_pretrained("some-org/some-drafter")


# -- dynamic convolution --------------------------------------------------------------------

class NoConv(nn.Module):
    """The drafter with its convolutions removed: prepare and finish pass through."""

    def prepare(self, u):
        return u, None

    def finish(self, a, coef):
        return a


def draft(model, c, b=2, L=11, seed=0):
    target_hidden, positions = context_inputs(c, b, L, seed)
    g = torch.Generator().manual_seed(seed + 1)
    block = torch.randn(b, c.block_size, c.hidden_size, generator=g)
    block_positions = torch.arange(L, L + c.block_size).expand(b, -1)
    valid = torch.ones(b, L, dtype=torch.bool)
    return model(block, block_positions, model.context_kv(target_hidden, positions), valid)


def test_conv_is_identity_at_init(config):
    torch.manual_seed(0)
    model = DFlash2Drafter(config)
    with torch.no_grad():
        h = draft(model, config)
        for layer in model.layers:
            layer.attention_conv, layer.mlp_conv = NoConv(), NoConv()
        assert torch.equal(h, draft(model, config))


def random_conv(H, k, G, seed):
    conv = DynamicConv(H, k, G)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(conv.base_kernel.shape, generator=g))
        conv.kernel_projection.weight.copy_(torch.randn(conv.kernel_projection.weight.shape, generator=g) * 0.2)
    return conv


conv_cases = dict(T=st.integers(1, 8), k=st.integers(1, 3), groups=st.sampled_from([1, 2, 4]),
                  G=st.sampled_from([1, 4]), seed=st.integers(0, 2**16))


@FAST
@given(**conv_cases)
def test_conv_matches_loop_formula(T, k, groups, G, seed):
    H, b = groups * G, 3
    conv = random_conv(H, k, G, seed)
    g = torch.Generator().manual_seed(seed + 1)
    u, a = torch.randn(b, T, H, generator=g), torch.randn(b, T, H, generator=g)
    with torch.no_grad():
        u0, coef = conv.prepare(u)
        out = conv.finish(a, coef)
        delta = conv.kernel_projection(u).view(b, T, 2, k, H // G)
    ref0, ref1 = torch.zeros(b, T, H), torch.zeros(b, T, H)
    for n in range(b):
        for t in range(T):
            for j in range(k):
                if t - j < 0:
                    continue
                for c in range(H):
                    c0 = conv.base_kernel[0, j, c] + delta[n, t, 0, j, c // G]
                    c1 = conv.base_kernel[1, j, c] + delta[n, t, 1, j, c // G]
                    ref0[n, t, c] += c0 * u[n, t - j, c]
                    ref1[n, t, c] += c1 * a[n, t - j, c]
    torch.testing.assert_close(u0, ref0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref1, atol=1e-5, rtol=1e-5)


@FAST
@given(**conv_cases, j=st.integers(0, 7), row=st.integers(0, 2))
def test_conv_never_looks_ahead_or_across_blocks(T, k, groups, G, seed, j, row):
    j = min(j, T - 1)
    H, b = groups * G, 3
    conv = random_conv(H, k, G, seed)
    g = torch.Generator().manual_seed(seed + 1)
    u, a = torch.randn(b, T, H, generator=g), torch.randn(b, T, H, generator=g)
    u2, a2 = u.clone(), a.clone()
    u2[row, j] += torch.randn(H, generator=g)
    a2[row, j] += torch.randn(H, generator=g)
    with torch.no_grad():
        x, coef = conv.prepare(u)
        y = conv.finish(a, coef)
        x2, coef2 = conv.prepare(u2)
        y2 = conv.finish(a2, coef2)
    assert torch.equal(x[row, :j], x2[row, :j]) and torch.equal(y[row, :j], y2[row, :j])
    others = [n for n in range(b) if n != row]
    assert torch.equal(x[others], x2[others]) and torch.equal(y[others], y2[others])


# -- drafter forward ------------------------------------------------------------------------

def test_invalid_context_slots_are_ignored(config):
    model = randomize(DFlash2Drafter(config))
    b, L, B = 2, 9, config.block_size
    target_hidden, positions = context_inputs(config, b, L)
    block = torch.randn(b, B, config.hidden_size)
    block_positions = torch.arange(L, L + B).expand(b, -1)
    with torch.no_grad():
        kv = model.context_kv(target_hidden, positions)
        padded = [(torch.cat([k, torch.randn_like(k)[:, :, :4]], 2), torch.cat([v, torch.randn_like(v)[:, :, :4]], 2))
                  for k, v in kv]
        valid = torch.cat([torch.ones(b, L, dtype=torch.bool), torch.zeros(b, 4, dtype=torch.bool)], 1)
        h = model(block, block_positions, kv, torch.ones(b, L, dtype=torch.bool))
        h_padded = model(block, block_positions, padded, valid)
    torch.testing.assert_close(h, h_padded, atol=1e-5, rtol=1e-5)


def test_context_outside_sliding_window_is_ignored(config):
    model = randomize(DFlash2Drafter(config))
    b, L, B, W = 1, 30, config.block_size, config.sliding_window
    target_hidden, positions = context_inputs(config, b, L)
    block_positions = torch.arange(L, L + B).expand(b, -1)
    block = torch.randn(b, B, config.hidden_size)
    far = L + B - 1 - W  # the last block slot sees positions > far
    changed = target_hidden.clone()
    changed[:, : L - W] += 1.0  # beyond the window of every block slot
    with torch.no_grad():
        valid = torch.ones(b, L, dtype=torch.bool)
        h = model(block, block_positions, model.context_kv(target_hidden, positions), valid)
        h2 = model(block, block_positions, model.context_kv(changed, positions), valid)
        changed[:, far + 1] += 1.0  # inside the window of the last slot
        h3 = model(block, block_positions, model.context_kv(changed, positions), valid)
    assert torch.equal(h, h2)
    assert not torch.allclose(h[:, -1], h3[:, -1])


def test_flex_backend_matches_sdpa(config):
    model = randomize(DFlash2Drafter(config))
    with torch.no_grad():  # FlexAttention has no CPU backward
        h = draft(model, config, L=20)
        model.attn_backend = "flex"
        torch.testing.assert_close(draft(model, config, L=20), h, atol=1e-5, rtol=1e-5)


def test_embed_block_and_draft_logits(config):
    c = tiny_glm_config(input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=3.0)
    model = DFlash2Drafter(c)
    emb = nn.Embedding(c.vocab_size, c.hidden_size)
    anchor = torch.tensor([5, 7])
    x = model.embed_block(anchor, emb)
    assert x.shape == (2, c.block_size, c.hidden_size)
    torch.testing.assert_close(x[:, 0], emb(anchor) * 2.0)
    torch.testing.assert_close(x[:, 1:], emb.weight[c.mask_token_id].expand(2, c.block_size - 1, -1) * 2.0)
    h = torch.randn(2, 7, c.hidden_size)
    U = model.draft_logits(h, emb.weight)
    torch.testing.assert_close(U, 3.0 * torch.tanh((h @ emb.weight.T) * 0.5 / 3.0))


def test_context_kv_shapes(config):
    target_hidden, positions = context_inputs(config, 2, 11)
    kv = DFlash2Drafter(config).context_kv(target_hidden, positions)
    assert len(kv) == config.num_hidden_layers
    assert all(k.shape == v.shape == (2, config.num_key_value_heads, 11, config.head_dim) for k, v in kv)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), ops=st.lists(st.sampled_from(["one", "block", "read", "keep", "swap", "wave"]),
                                                max_size=12), waiting=st.sampled_from([1024, 8]))
def test_deferred_context_writes_land_as_written(seed, ops, waiting):
    """A context that defers its writes (the prefill's, plain steps' one-token ones, a verified block's) and projects
    them at the next read holds what one that projects each write at once holds, whatever came between: ragged
    prompts whose padding later writes overwrite, overlapping blocks, finished rows dropped (select_rows), requests
    admitted into some rows or a whole new wave of them (copy_rows); with few WAITING_POSITIONS, projected early."""
    saved, model_module.WAITING_POSITIONS = model_module.WAITING_POSITIONS, waiting
    try:
        deferred_context_writes(seed, ops)
    finally:
        model_module.WAITING_POSITIONS = saved


def deferred_context_writes(seed, ops):
    config = tiny_glm_config()
    drafter = randomize(DFlash2Drafter(config), seed)
    g = torch.Generator().manual_seed(seed)
    n = len(config.target_layer_ids) * config.hidden_size
    feats = lambda b, L: torch.randn(b, L, n, generator=g)
    b, width, max_len = 3, 6, 40
    DraftContext = model_module.DraftContext
    lazy, eager = (DraftContext(drafter, b, max_len, "cpu", defer=d) for d in (True, False))
    pos = torch.randint(2, width + 1, (b,), generator=g)  # ragged prompts: slots past each one's length are padding
    f = feats(b, width)
    for ctx in (lazy, eager):
        ctx.write(f, torch.arange(width).expand(b, width))
    for op in ops:
        b = pos.shape[0]
        if op in ("one", "block"):
            L = 1 if op == "one" else 4
            f, at = feats(b, L), pos[:, None] + torch.arange(L)
            for ctx in (lazy, eager):
                ctx.write(f, at)
            pos = pos + (1 if op == "one" else torch.randint(1, L + 1, (b,), generator=g))
        elif op == "read":
            lazy.view(max_len)
        elif op == "keep" and b > 1:
            drop = int(torch.randint(0, b, (1,), generator=g))
            keep = torch.tensor([r for r in range(b) if r != drop])
            for ctx in (lazy, eager):
                ctx.select_rows(keep)
            pos = pos[keep]
        elif op in ("swap", "wave"):
            rows = torch.arange(b) if op == "wave" else torch.tensor([b - 1])
            f = feats(len(rows), width)
            new = [DraftContext(drafter, len(rows), max_len, "cpu", defer=d) for d in (True, False)]
            for ctx, other in zip((lazy, eager), new):
                other.write(f, torch.arange(width).expand(len(rows), width))
                ctx.copy_rows(rows, other)
            pos[rows] = width
        assert sum(f.shape[1] for f, _ in lazy.pending) <= max(model_module.WAITING_POSITIONS, width)  # bounded (a prompt may wait whole)
    for (k, v), (k_ref, v_ref) in zip(lazy.view(max_len), eager.view(max_len)):
        torch.testing.assert_close(k, k_ref)
        torch.testing.assert_close(v, v_ref)


# -- candidate selector ---------------------------------------------------------------------

def selector_inputs(b, n, V, H, r, K, seed, u_scale=3.0):
    """A random selector and its inputs; a small u_scale lets the bilinear term decide the walk."""
    c = tiny_glm_config(vocab_size=V, hidden_size=H, selector_rank=r, selector_top_k=K, mask_token_id=0,
                        conv_group_size=H)
    sel = randomize(CandidateSelector(c), seed)
    g = torch.Generator().manual_seed(seed + 1)
    h, U = torch.randn(b, n, H, generator=g), torch.randn(b, n, V, generator=g) * u_scale
    anchor = torch.randint(0, V, (b,), generator=g)
    return sel, h, U, anchor


sel_cases = dict(b=st.integers(1, 3), n=st.integers(1, 7), V=st.integers(8, 40), K=st.integers(1, 8),
                 seed=st.integers(0, 2**16))


@FAST
@given(**sel_cases)
def test_edge_scores_match_double_loop(b, n, V, K, seed):
    H, r = 16, 4
    sel, h, U, anchor = selector_inputs(b, n, V, H, r, K, seed)
    with torch.no_grad():
        cand, logits = sel.candidates(U, K)
        S = sel.edge_scores(h, U, cand, anchor)
        assert S.shape == (b, n, K, K)
        assert torch.equal(logits, U.gather(-1, cand)) and (logits[..., :-1] >= logits[..., 1:]).all()
        A, Bc, W = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
        for i in range(b):
            for t in range(n):
                preds = [anchor[i]] * K if t == 0 else cand[i, t - 1]
                for a in range(K):
                    for c in range(K):
                        succ = cand[i, t, c]
                        ref = U[i, t, succ] + ((A[preds[a]] * (W @ h[i, t])) * Bc[succ]).sum()
                        torch.testing.assert_close(S[i, t, a, c], ref, atol=1e-4, rtol=1e-4)


@FAST
@example(b=2, n=4, V=12, K=4, seed=0, u_scale=0.0)  # the bilinear term alone decides: every seed meets one
@given(**sel_cases, u_scale=st.sampled_from([0.0, 0.05, 3.0]))
def test_greedy_walk_is_stepwise_argmax(b, n, V, K, seed, u_scale):
    """d_t = argmax_b S_t(d_{t-1}, b) with the predecessor the walk itself chose. With u_scale small the
    bilinear term decides, so a walk that scores every slot from one fixed predecessor row differs."""
    sel, h, U, anchor = selector_inputs(b, n, V, 16, 4, K, seed, u_scale)
    with torch.no_grad():
        cand, _ = sel.candidates(U, K)
        S = sel.edge_scores(h, U, cand, anchor)
        path, q = sel.walk(S, cand)
    for i in range(b):
        prev = 0
        for t in range(n):
            best = int(S[i, t, prev].argmax())
            assert path[i, t] == cand[i, t, best]
            prev = best
    assert torch.equal(q, nn.functional.one_hot(path, V).float())


@FAST
@given(**sel_cases, temperature=st.sampled_from([0.5, 1.0, 2.0]))
def test_sampled_walk_proposes_over_candidates(b, n, V, K, seed, temperature):
    sel, h, U, anchor = selector_inputs(b, n, V, 16, 4, K, seed)
    with torch.no_grad():
        cand, _ = sel.candidates(U, K)
        S = sel.edge_scores(h, U, cand, anchor)
        path, q = sel.walk(S, cand, temperature, torch.Generator().manual_seed(seed))
    torch.testing.assert_close(q.sum(-1), torch.ones(b, n))
    outside = torch.ones(b, n, V, dtype=torch.bool).scatter(-1, cand, False)
    assert (q[outside] == 0).all()
    assert (path[..., None] == cand).any(-1).all()
    assert (q.gather(-1, path[..., None]) > 0).all()
    # q_t is softmax(S_t(d_{t-1}, .) / T) with d_{t-1} the sampled predecessor
    prev_idx = torch.cat([torch.zeros(b, 1, dtype=torch.long), (cand[:, :-1] == path[:, :-1, None]).long().argmax(-1)], 1)
    rows = S.gather(2, prev_idx[:, :, None, None].expand(b, n, 1, K)).squeeze(2)
    torch.testing.assert_close(q.gather(-1, cand), torch.softmax(rows / temperature, -1))


@pytest.mark.parametrize("temperature", [0.3, 2.0])
def test_sampled_walk_draws_follow_its_q(temperature):
    """The walk's draws, not only its reported q: the empirical law of whole paths (d_1, d_2, d_3) equals
    prod_t q_t(d_t | d_{t-1}) from softmax(S_t(d_{t-1}, .) / T), at temperatures other than 1. Total
    variation bound as in test_verify: E[TV] <= 1/2 sum sqrt(p / N), plus a McDiarmid term (failure e^-30)."""
    n, K, reps = 3, 4, 20000
    sel, h, U, anchor = selector_inputs(1, n, 12, 16, 4, K, seed=3, u_scale=0.5)
    with torch.no_grad():
        cand, _ = sel.candidates(U, K)
        S = sel.edge_scores(h, U, cand, anchor)[0].double()
        path, q = sel.walk(S[None].float().expand(reps, -1, -1, -1), cand.expand(reps, -1, -1), temperature,
                           torch.Generator().manual_seed(0))
    law = {}
    for idx in itertools.product(range(K), repeat=n):
        prob, prev = 1.0, 0
        for t, i in enumerate(idx):
            prob *= float(torch.softmax(S[t, prev] / temperature, -1)[i])
            prev = i
        law[tuple(int(cand[0, t, i]) for t, i in enumerate(idx))] = prob
    reported = q.gather(-1, path[..., None]).squeeze(-1).double().prod(-1)  # q of each row's own path
    torch.testing.assert_close(reported, torch.tensor([law[tuple(p)] for p in path.tolist()], dtype=torch.float64),
                               atol=1e-5, rtol=1e-4)
    found, counts = torch.unique(path, dim=0, return_counts=True)
    empirical = {tuple(p): c / reps for p, c in zip(found.tolist(), counts.tolist())}
    tv = 0.5 * sum(abs(empirical.get(k, 0.0) - law.get(k, 0.0)) for k in law.keys() | empirical.keys())
    bound = 0.5 * sum((p / reps) ** 0.5 for p in law.values()) + (30 / (2 * reps)) ** 0.5
    assert tv < bound, (tv, bound)


def test_sampled_walk_frequencies_follow_softmax():
    sel, h, U, anchor = selector_inputs(1, 1, 12, 16, 4, 4, seed=3)
    with torch.no_grad():
        cand, _ = sel.candidates(U, 4)
        S = sel.edge_scores(h, U / 3, cand, anchor)
        reps = 4000
        path, q = sel.walk(S.expand(reps, -1, -1, -1), cand.expand(reps, -1, -1), 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(path[:, 0], minlength=12).float() / reps
    torch.testing.assert_close(freq, q[0, 0], atol=0.03, rtol=0)


@FAST
@given(**sel_cases)
def test_top1_selector_path_is_per_slot_argmax(b, n, V, K, seed):
    sel, h, U, anchor = selector_inputs(b, n, V, 16, 4, K, seed)
    with torch.no_grad():
        sel.top_k = 1
        path, q, _, _ = select_path(sel, h, U, anchor, 0.0, None)
        assert torch.equal(path, U.argmax(-1))
        path_v1, q_v1 = dflash1_walk(U)
    assert torch.equal(path_v1, U.argmax(-1)) and torch.equal(q, q_v1)


def test_dflash1_sampled_walk_proposes_softmax():
    U = torch.randn(2, 5, 30)
    path, q = dflash1_walk(U, 0.7, torch.Generator().manual_seed(0))
    torch.testing.assert_close(q, torch.softmax(U / 0.7, -1))
    assert path.shape == (2, 5)


def test_dflash1_sampled_walk_frequencies_follow_its_proposal():
    U = torch.randn(1, 2, 10).expand(6000, -1, -1) * 2
    path, q = dflash1_walk(U, 0.7, torch.Generator().manual_seed(0))
    for t in range(2):
        freq = torch.bincount(path[:, t], minlength=10).float() / len(path)
        torch.testing.assert_close(freq, q[0, t], atol=0.025, rtol=0)


def test_selector_init_follows_training_recipe(config):
    sel = CandidateSelector(tiny_glm_config(vocab_size=4096))
    assert (sel.successor_codebook == 0).all()
    assert abs(sel.predecessor_codebook.std().item() - 0.02) < 0.002


def test_every_block_query_sees_the_anchor_key(monkeypatch):
    """The drafter's mask, as its forward builds it: every query of the block sees the anchor's key
    (slot 0 of the block), in full blocks and in blocks cut short, and no query sees a slot past its block."""
    from dflash2 import kernels, model

    masks = []
    real = kernels.attention_mask

    def spy(*args, **kwargs):
        m = real(*args, **kwargs)
        masks.append(m.mask)
        return m

    monkeypatch.setattr(model, "attention_mask", spy)
    cfg = tiny_glm_config()
    drafter = DFlash2Drafter(cfg).eval()
    b, S, T = 3, 10, cfg.block_size
    ctx_valid = torch.arange(S)[None] < torch.tensor([[10], [4], [7]])
    kv = [(torch.randn(b, cfg.num_key_value_heads, S, cfg.head_dim),) * 2 for _ in range(cfg.num_hidden_layers)]
    sizes = torch.tensor([T, 3, 1])
    block_valid = torch.arange(T)[None] < sizes[:, None]
    positions = torch.tensor([[10], [4], [7]]) + torch.arange(T)
    with torch.no_grad():
        drafter(torch.randn(b, T, cfg.hidden_size), positions, kv, ctx_valid, block_valid)
    assert masks
    for mask in masks:  # [b, 1, T, S + T]
        assert mask[:, 0, :, S].all()  # the anchor's key, seen by every query of every row
        for r in range(b):
            assert not mask[r, 0, : int(sizes[r]), S + int(sizes[r]):].any()
