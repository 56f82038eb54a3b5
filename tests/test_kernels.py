import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from dflash2 import kernels
from dflash2.kernels import attention_backends, drafter_attention


@st.composite
def attention_case(draw, max_ctx=24, batches=(1, 2, 3), kv_head_counts=(1, 2, 4), block_sizes=(2, 4, 8)):
    """Block queries over [context, block] keys (4 query heads), each row with its own context length and its
    own number of block slots in use (a block cut short at the end of a budget); causal or not."""
    b = draw(st.sampled_from(batches))
    heads, kv_heads = 4, draw(st.sampled_from(kv_head_counts))
    T = draw(st.sampled_from(block_sizes))
    S_ctx = draw(st.integers(0, max_ctx))
    window = draw(st.one_of(st.none(), st.integers(1, 20)))
    ctx_len = torch.tensor([draw(st.integers(0, S_ctx)) for _ in range(b)])
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    hd = 16
    q = torch.randn(b, heads, T, hd, generator=g)
    k = torch.randn(b, kv_heads, S_ctx + T, hd, generator=g)
    v = torch.randn(b, kv_heads, S_ctx + T, hd, generator=g)
    ctx_pos = torch.arange(S_ctx).expand(b, S_ctx)
    q_pos = ctx_len[:, None] + torch.arange(T)  # the block starts right after each row's context
    k_pos = torch.cat([ctx_pos, q_pos], 1)
    used = torch.tensor([draw(st.integers(1, T)) for _ in range(b)])
    k_valid = torch.cat([ctx_pos < ctx_len[:, None], torch.arange(T) < used[:, None]], 1)
    return q, k, v, q_pos, k_pos, k_valid, window, draw(st.booleans())


def naive_attention(q, k, v, q_pos, k_pos, k_valid, window, causal=False):
    """Loop over batch, heads and queries: softmax over the keys the rule admits (and always the query's own)."""
    b, heads, T, hd = q.shape
    group = heads // k.shape[1]
    out = torch.zeros_like(q)
    for n in range(b):
        for h in range(heads):
            for i in range(T):
                keys = [j for j in range(k.shape[2])
                        if (k_valid[n, j] and (window is None or abs(q_pos[n, i] - k_pos[n, j]) < window)
                            and (not causal or k_pos[n, j] <= q_pos[n, i])) or j == k.shape[2] - T + i]
                scores = torch.stack([q[n, h, i] @ k[n, h // group, j] for j in keys]) / math.sqrt(hd)
                out[n, h, i] = torch.softmax(scores, 0) @ v[n, h // group, keys]
    return out


@settings(max_examples=25, deadline=None)
@given(attention_case(max_ctx=10))
def test_sdpa_matches_naive_attention(case):
    *args, window, causal = case
    torch.testing.assert_close(drafter_attention(*args, sliding_window=window, causal=causal), naive_attention(*case),
                               atol=1e-5, rtol=1e-5)


# FlexAttention compiles per shape on CPU (seconds each): few examples over a few shapes
# (context lengths and windows vary freely, they do not recompile).
@settings(max_examples=8, deadline=None)
@given(attention_case(max_ctx=40, batches=(3,), kv_head_counts=(1, 4), block_sizes=(3, 8)))
def test_flex_matches_sdpa(case):
    *args, window, causal = case
    sdpa = drafter_attention(*args, sliding_window=window, backend="sdpa", causal=causal)
    flex = drafter_attention(*args, sliding_window=window, backend="flex", causal=causal)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)


@settings(max_examples=5, deadline=None)
@given(attention_case(max_ctx=6))
def test_sdpa_supports_backward(case):
    q, k, v, q_pos, k_pos, k_valid, window, causal = case
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    drafter_attention(q, k, v, q_pos, k_pos, k_valid, window, causal=causal).sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


def test_backends_listed():
    assert attention_backends()[0] == "sdpa" and "flex" in attention_backends()


# --- oneDNN linears with pre-packed weights (CPU) ---

from dflash2.machine import machine  # noqa: E402

needs_onednn = pytest.mark.skipif(not kernels.can_prepack(torch.zeros(1)), reason="this torch has no oneDNN")


@needs_onednn
@settings(max_examples=30, deadline=None)
@given(in_f=st.integers(1, 80), out_f=st.integers(1, 80), lead=st.lists(st.integers(1, 9), min_size=1, max_size=2),
       bias=st.booleans(), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([d for d in (torch.float32, torch.bfloat16) if machine().packs(d)]))  # bf16: where native
def test_packed_linear_equals_f_linear(in_f, out_f, lead, bias, dtype, seed):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=bias).to(dtype)
    x = torch.randn(*lead, in_f).to(dtype)
    packed = kernels.PackedLinear(lin.weight, lin.bias)
    with torch.no_grad():
        got = packed(x)
        exact = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    assert got.shape == exact.shape and got.dtype == dtype
    # float32: summation-order rounding only; bfloat16: float32 accumulation, one rounding of the output
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.double(), exact, **tol)


@needs_onednn
def test_packed_linear_trains_through_f_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(12, 5)
    packed = kernels.PackedLinear(lin.weight, lin.bias)
    x = torch.randn(3, 12)
    packed(x).square().sum().backward()
    grad = lin.weight.grad.clone()
    lin.weight.grad = None
    F.linear(x, lin.weight, lin.bias).square().sum().backward()
    assert torch.equal(grad, lin.weight.grad)


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "minimax_m3"])
def test_prepacked_target_decodes_the_unpacked_targets_greedy_output(arch):
    import copy

    from dflash2 import spec_decode as sd
    from dflash2.target import Target, fix_partial_rotary
    from targets import reference_greedy, tiny_drafter, tiny_target

    model = tiny_target(arch)
    fix_partial_rotary(model)  # what Target does to a MiniMax-M3 model: the reference must run the same RoPE
    drafter = tiny_drafter(model)
    packed = copy.deepcopy(model)
    assert kernels.prepack_linears(packed) > 0
    target = Target(packed, drafter.config.target_layer_ids)
    assert target.prepacked and isinstance(target.lm_head_as(torch.float32), kernels.PackedLinear)
    prompts = [[1, 2, 3], [5, 8, 13, 21, 34, 55]]
    for method in ("dflash2", "ar"):
        results = sd.generate(target, drafter, prompts, method=method, max_new_tokens=24)
        for prompt, res in zip(prompts, results):
            assert res.tokens == reference_greedy(model, prompt, 24)


def test_prepack_skips_what_it_cannot_pack():
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4).double())
    assert kernels.prepack_linears(lin) == 0 and type(lin[0]) is torch.nn.Linear
