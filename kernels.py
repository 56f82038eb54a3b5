"""Attention kernels for the drafter, each beside the plain SDPA reference it must equal."""
import functools

import torch
import torch.nn.functional as F


def drafter_mask(q_pos, k_pos, k_valid, sliding_window=None):
    """[b, 1, T, S] bool: query i sees key j iff k_valid[j] and |q_pos_i - k_pos_j| < sliding_window.

    Not causal: the block is bidirectional and the context lies before it by construction.
    """
    mask = k_valid[:, None, :].expand(-1, q_pos.shape[1], -1)
    if sliding_window is not None:
        mask = mask & ((q_pos[:, :, None] - k_pos[:, None, :]).abs() < sliding_window)
    return mask[:, None]


FLEX_BLOCK = 128  # FlexAttention's tile: keys are padded to a multiple so a growing context reuses kernels


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    # Fused flex kernels exist only under torch.compile (required on CPU). Static shapes: the CPU
    # inductor template miscompiles dynamic key lengths with index-dependent masks (torch 2.13).
    return torch.compile(flex_attention, dynamic=False)


def _flex_attention(q, k, v, q_pos, k_pos, k_valid, sliding_window, kernel_options=None):
    from torch.nn.attention.flex_attention import create_block_mask

    pad = -k.shape[2] % FLEX_BLOCK
    if pad:
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        k_pos, k_valid = F.pad(k_pos, (0, pad)), F.pad(k_valid, (0, pad), value=False)
    # The window is a tensor, not a Python int, so every window value shares one compiled graph.
    window = torch.tensor(torch.iinfo(torch.long).max if sliding_window is None else sliding_window,
                          device=q.device)

    def mask_mod(b, h, i, j):
        return k_valid[b, j] & ((q_pos[b, i] - k_pos[b, j]).abs() < window)

    block_mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    return _compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1],
                                      kernel_options=kernel_options)


def drafter_attention(q, k, v, q_pos, k_pos, k_valid, sliding_window=None, backend="sdpa"):
    """softmax(q k^T / sqrt(hd) + mask) v with the drafter mask (see drafter_mask), GQA.

    q [b, heads, T, hd]; k, v [b, kv_heads, S, hd] (context slots, then block slots);
    q_pos [b, T], k_pos [b, S] absolute positions; k_valid [b, S] bool.
    backend "sdpa" is the reference (and supports backward); "flex" is compiled FlexAttention
    (Triton on CUDA, C++ on CPU); "flash" is FlexAttention lowered to the FlashAttention-4 CuTe
    kernel (Hopper/Blackwell with the flash-attn-4 package).
    """
    if backend == "sdpa":
        mask = drafter_mask(q_pos, k_pos, k_valid, sliding_window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    if backend == "flex":
        return _flex_attention(q, k, v, q_pos, k_pos, k_valid, sliding_window)
    if backend == "flash":
        return _flex_attention(q, k, v, q_pos, k_pos, k_valid, sliding_window, {"BACKEND": "FLASH"})
    raise ValueError(f"unknown attention backend {backend!r}; available: {attention_backends()}")


def _has_fa4(device):
    """FA4's CuTe kernels target sm90 (Hopper) and sm100 (Blackwell) and need the flash-attn-4 package."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] not in (9, 10):
        return False
    try:
        import flash_attn.cute  # noqa: F401  (the module flash-attn-4 installs)
    except ImportError:
        return False
    return True


def attention_backends(device=None):
    """Backends drafter_attention can run on this device, fastest last."""
    device = torch.device(device or "cpu")
    backends = ["sdpa"]
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return backends
    backends.append("flex")
    if _has_fa4(device):
        backends.append("flash")
    return backends


def default_backend(device):
    """Chosen once per device: FA4 on sm90/sm100 when installed, Flex (Triton) on other GPUs, SDPA on
    CPU. CPU Flex runs standalone ("flex") but torch 2.13's CPU inductor cannot lower it inside the
    compiled drafter graph (NoValidChoicesError), and eager it would compile a kernel per shape."""
    device = torch.device(device)
    if device.type == "cpu":
        return "sdpa"
    return attention_backends(device)[-1]
