"""Kernels: attention for the drafter, each beside the plain SDPA reference it must equal; and
pre-packed oneDNN linears for CPU."""
import functools
import importlib.util
import itertools
import weakref
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .machine import machine


def drafter_mask(q_pos, k_pos, k_valid, sliding_window=None, causal=False):
    """[b, 1, T, S] bool: query i sees key j iff k_valid[j], |q_pos_i - k_pos_j| < sliding_window, and,
    in a causal layer, k_pos_j <= q_pos_i. The last T keys are the block's own, and a query always
    sees its own key: a slot left out of a short block (k_valid false) still has a finite output.

    Published drafters are not causal: the block is bidirectional and the context lies before it.
    """
    mask = k_valid[:, None, :].expand(-1, q_pos.shape[1], -1)
    if sliding_window is not None:
        mask = mask & ((q_pos[:, :, None] - k_pos[:, None, :]).abs() < sliding_window)
    if causal:
        mask = mask & (k_pos[:, None, :] <= q_pos[:, :, None])
    T, S = q_pos.shape[1], k_pos.shape[1]
    own = torch.arange(S, device=q_pos.device)[None, :] == torch.arange(S - T, S, device=q_pos.device)[:, None]
    return (mask | own)[:, None]


FLEX_BLOCK = 128  # FlexAttention's tile: keys are padded to a multiple so a growing context reuses kernels


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    # Fused flex kernels exist only under torch.compile (required on CPU). Static shapes: the CPU
    # inductor template miscompiles dynamic key lengths with index-dependent masks (torch 2.13).
    return torch.compile(flex_attention, dynamic=False)


def _flex_block_mask(q_pos, k_pos, k_valid, sliding_window, causal):
    """drafter_mask as a FlexAttention BlockMask over keys padded to a multiple of FLEX_BLOCK."""
    from torch.nn.attention.flex_attention import create_block_mask

    T, S = q_pos.shape[1], k_pos.shape[1]
    block_start = torch.tensor(S - T, device=q_pos.device)  # a tensor: one graph for every length
    pad = -S % FLEX_BLOCK
    if pad:
        k_pos, k_valid = F.pad(k_pos, (0, pad)), F.pad(k_valid, (0, pad), value=False)
    # The window is a tensor, not a Python int, so every window value shares one compiled graph.
    window = torch.tensor(torch.iinfo(torch.long).max if sliding_window is None else sliding_window,
                          device=q_pos.device)

    def mask_mod(b, h, i, j):
        seen = k_valid[b, j] & ((q_pos[b, i] - k_pos[b, j]).abs() < window)
        if causal:
            seen = seen & (k_pos[b, j] <= q_pos[b, i])
        return seen | (j == block_start + i)

    return create_block_mask(mask_mod, q_pos.shape[0], None, T, S + pad, device=q_pos.device)


class AttentionMask(NamedTuple):
    """The drafter mask in the form a backend takes: a bool tensor (sdpa) or a BlockMask (flex, flash)."""

    backend: str
    mask: object


def attention_mask(q_pos, k_pos, k_valid, sliding_window=None, causal=False, backend="sdpa"):
    """Build the drafter mask once (see drafter_mask) for every layer of that kind in a forward."""
    if backend == "sdpa":
        return AttentionMask(backend, drafter_mask(q_pos, k_pos, k_valid, sliding_window, causal))
    if backend in ("flex", "flash"):
        return AttentionMask(backend, _flex_block_mask(q_pos, k_pos, k_valid, sliding_window, causal))
    raise ValueError(f"unknown attention backend {backend!r}; available: {attention_backends()}")


def attend(q, k, v, mask):
    """softmax(q k^T / sqrt(hd) + mask) v, GQA; q [b, heads, T, hd], k, v [b, kv_heads, S, hd] (context
    slots, then block slots). "sdpa" is the reference (and supports backward); "flex" is compiled
    FlexAttention (Triton on CUDA, C++ on CPU); "flash" is FlexAttention lowered to the FlashAttention-4
    CuTe kernel (Hopper/Blackwell with the flash-attn-4 package)."""
    gqa = q.shape[1] != k.shape[1]
    if mask.backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.mask, enable_gqa=gqa)
    pad = -k.shape[2] % FLEX_BLOCK
    if pad:
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
    options = {"BACKEND": "FLASH"} if mask.backend == "flash" else None
    return _compiled_flex_attention()(q, k, v, block_mask=mask.mask, enable_gqa=gqa, kernel_options=options)


def drafter_attention(q, k, v, q_pos, k_pos, k_valid, sliding_window=None, backend="sdpa", causal=False):
    """attend(q, k, v) under the drafter mask, built for this one call; q_pos [b, T], k_pos [b, S]
    absolute positions, k_valid [b, S] bool."""
    return attend(q, k, v, attention_mask(q_pos, k_pos, k_valid, sliding_window, causal, backend))


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
    # found, not imported: importing it brings in torch._dynamo (most of a second), which only its use needs
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return backends
    backends.append("flex")
    if _has_fa4(device):
        backends.append("flash")
    return backends


def check_attn_backend(backend, device, compiled=False):
    """The drafter attention backend to use on device: backend if it can run there (inside a compiled
    drafter when compiled), the device's default when None; else a clear error."""
    device = torch.device(device)
    if backend is None:
        return default_backend(device)
    available = attention_backends(device)
    if backend not in available:
        raise ValueError(f"attention backend {backend!r} cannot run on {device}; available there: "
                         f"{', '.join(available)} (flash needs an sm90/sm100 GPU and the flash-attn-4 package)")
    if compiled and backend == "flex" and device.type == "cpu":
        raise ValueError("attention backend 'flex' cannot be compiled into the drafter on CPU (torch 2.13's CPU "
                         "inductor has no lowering for it there); use sdpa with --compile")
    return backend


def default_backend(device):
    """Chosen once per device: FA4 on sm90/sm100 when installed, Flex (Triton) on other GPUs, SDPA on
    CPU. CPU Flex runs standalone ("flex") but torch 2.13's CPU inductor cannot lower it inside the
    compiled drafter graph (NoValidChoicesError), and eager it would compile a kernel per shape."""
    device = torch.device(device)
    if device.type == "cpu":
        return "sdpa"
    return attention_backends(device)[-1]


# --- CPU linears: oneDNN with weights packed once ---
#
# On CPU, aten's float32 linear goes to MKL, which repacks the weight on every call once there is
# more than one row: on this project's 2-core AMD machine a [8, 576] x [576, 1536] product costs
# 3x a single row, so verifying an 8-token block cost 1.6-1.9x a one-token decode step. oneDNN
# with the weight reordered once into its blocked layout costs about 1.5x for 8 rows, and is faster
# at 1 row too. The packed weight is an opaque mkldnn tensor that dynamo cannot trace, so the call
# is a custom op that looks the weight up by key: compiled graphs treat it as one extern call.

_PACKED = weakref.WeakValueDictionary()  # key -> packed weight; the PackedLinear holds the only strong ref
_KEYS = itertools.count()


@torch.library.custom_op("dflash2_ref::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, bias: Optional[torch.Tensor], out_features: int, key: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _PACKED[key], bias, "none", [], "")


@packed_linear.register_fake
def _(x, bias, out_features, key):
    return x.new_empty(x.shape[:-1] + (out_features,))


class PackedLinear(torch.nn.Module):
    """A bias-optional linear for inference on CPU (float32 or bfloat16), through oneDNN with the weight
    packed once.

    Keeps the original weight and bias (tied embeddings and state dicts stay as they were); with
    autograd on, or an input of another dtype, it falls back to F.linear, so training through it
    still works. Results agree with F.linear to rounding (the summation order differs); for most
    shapes a row's output does not depend on the other rows of the batch, which MKL does not offer.
    The packed copy doubles the memory of the weights it covers; weights changed after packing are
    not seen (pack after loading, as load_target does).
    """

    def __init__(self, weight, bias=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias
        self._bias = None if bias is None else bias.detach()  # what the inference path passes, made once
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)  # 8: the block's rows
        self._key = next(_KEYS)
        _PACKED[self._key] = self._packed

    def forward(self, x):
        if torch.is_grad_enabled() or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return packed_linear(x, self._bias, self.out_features, self._key)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN packed"


def can_prepack(weight):
    """Whether PackedLinear applies: a CPU weight in float32, or in bfloat16 where oneDNN has bf16 kernels
    (machine.Machine.packs: on an AVX2-only CPU oneDNN's bf16 reorder raises)."""
    return weight.device.type == "cpu" and machine().packs(weight.dtype)


def prepack_linears(model):
    """Swap every nn.Linear of a CPU model that can_prepack for a PackedLinear, in place; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and can_prepack(child.weight)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    return len(swaps)
