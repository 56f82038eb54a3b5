import math

import torch
from hypothesis import given, settings, strategies as st

from kernels import attention_backends, drafter_attention


@st.composite
def attention_case(draw, max_ctx=24, batches=(1, 2, 3), kv_head_counts=(1, 2, 4), block_sizes=(2, 4, 8)):
    """Block queries over [context, block] keys (4 query heads), each row with its own context length."""
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
    k_valid = torch.cat([ctx_pos < ctx_len[:, None], torch.ones(b, T, dtype=torch.bool)], 1)
    return q, k, v, q_pos, k_pos, k_valid, window


def naive_attention(q, k, v, q_pos, k_pos, k_valid, window):
    """Loop over batch, heads and queries: softmax over the keys the rule admits."""
    b, heads, T, hd = q.shape
    group = heads // k.shape[1]
    out = torch.zeros_like(q)
    for n in range(b):
        for h in range(heads):
            for i in range(T):
                keys = [j for j in range(k.shape[2])
                        if k_valid[n, j] and (window is None or abs(q_pos[n, i] - k_pos[n, j]) < window)]
                scores = torch.stack([q[n, h, i] @ k[n, h // group, j] for j in keys]) / math.sqrt(hd)
                out[n, h, i] = torch.softmax(scores, 0) @ v[n, h // group, keys]
    return out


@settings(max_examples=25, deadline=None)
@given(attention_case(max_ctx=10))
def test_sdpa_matches_naive_attention(case):
    torch.testing.assert_close(drafter_attention(*case[:6], sliding_window=case[6]), naive_attention(*case),
                               atol=1e-5, rtol=1e-5)


# FlexAttention compiles per shape on CPU (seconds each): few examples over a few shapes
# (context lengths and windows vary freely, they do not recompile).
@settings(max_examples=8, deadline=None)
@given(attention_case(max_ctx=40, batches=(3,), kv_head_counts=(1, 4), block_sizes=(3, 8)))
def test_flex_matches_sdpa(case):
    *args, window = case
    sdpa = drafter_attention(*args, sliding_window=window, backend="sdpa")
    flex = drafter_attention(*args, sliding_window=window, backend="flex")
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)


@settings(max_examples=5, deadline=None)
@given(attention_case(max_ctx=6))
def test_sdpa_supports_backward(case):
    q, k, v, q_pos, k_pos, k_valid, window = case
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    drafter_attention(q, k, v, q_pos, k_pos, k_valid, window).sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


def test_backends_listed():
    assert attention_backends()[0] == "sdpa" and "flex" in attention_backends()
