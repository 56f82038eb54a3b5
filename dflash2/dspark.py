"""DSpark drafter (DeepSeek-AI, arXiv 2607.05147), read from DeepSpec's deepspec/modeling/dspark and
deepspec/eval/dspark (docs/DSPARK.md cites the lines). DFlash's backbone without convolutions or
selector: [anchor, MASK x (B-1)] through bidirectional layers over the target's fused features. Every
slot proposes (slot k drafts the token after position p+k), a rank-r Markov head conditions slot k's
logits on the previous token of the walk, and a confidence head may cut the block before verification."""
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from .checkpoint import (DrafterConfig, check_state_dict, read_json, read_safetensors, resolve_checkpoint,
                         write_checkpoint)
from .model import MLP, Attention, DFlash2Drafter, RMSNorm
from .verify import sample_index

ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_HEAD_TYPES = ("vanilla",)  # DeepSpec also defines "gated" and "rnn"; no published config uses them


@dataclass(kw_only=True)
class DSparkConfig(DrafterConfig):
    """DeepSpec's draft config.json: the target's Qwen3 config with the DSpark keys at top level
    (deepspec/modeling/dspark/qwen3/config.py, build_draft_config)."""

    block_size: int
    markov_rank: int
    enable_confidence_head: bool
    markov_head_type: str | None = None  # required when markov_rank > 0
    confidence_head_with_markov: bool = False  # required when enable_confidence_head
    num_anchors: int | None = None  # training only (anchors sampled per sequence)

    NAME: ClassVar[str] = "DSpark"
    ARCHITECTURE: ClassVar[str] = ARCHITECTURE
    # What DFlash2Drafter's borrowed methods read; DSpark has no such keys.
    input_embedding_scale: ClassVar[float] = 1.0
    output_multiplier: ClassVar[float] = 1.0
    final_logit_softcapping: ClassVar[float | None] = None
    REQUIRED: ClassVar[tuple] = ("target_layer_ids", "mask_token_id", "block_size", "markov_rank",
                                 "enable_confidence_head")  # DeepSpec asserts these (qwen3/modeling.py)

    def layer_causal(self, i):
        """Never: DeepSpec drafts with is_causal=False (eval/dspark/draft_ops.py)."""
        return False

    def checks(self):
        return super().checks() + [
            ("block_size", self.block_size >= 1, f"{self.block_size} must be >= 1"),
            ("markov_rank", self.markov_rank >= 0, f"{self.markov_rank} must be >= 0"),
            ("markov_head_type", self.markov_rank == 0 or self.markov_head_type in MARKOV_HEAD_TYPES,
             f"{self.markov_head_type!r} is not supported (only {MARKOV_HEAD_TYPES})"),
            ("confidence_head_with_markov", not (self.enable_confidence_head and self.confidence_head_with_markov)
             or self.markov_rank > 0, "true needs markov_rank > 0"),
        ]

    @classmethod
    def read_own_keys(cls, d, kwargs):
        """DeepSpec's keys, all at top level: the architecture must be DSpark's, the REQUIRED keys present
        (and the heads' type keys when the heads are on); the window is dropped unless use_sliding_window,
        as transformers' Qwen3Config does."""
        arch = (d.get("architectures") or [ARCHITECTURE])[0]
        if arch != ARCHITECTURE:
            raise ValueError(f"DSpark config: architecture {arch!r} is not supported (only {ARCHITECTURE!r})")
        missing = [k for k in cls.REQUIRED if k not in d]
        if int(d.get("markov_rank", 0)) > 0 and "markov_head_type" not in d:
            missing.append("markov_head_type")
        if d.get("enable_confidence_head") and "confidence_head_with_markov" not in d:
            missing.append("confidence_head_with_markov")
        if missing:
            raise ValueError(f"DSpark config is missing required keys: {missing}")
        if not kwargs.get("use_sliding_window"):
            kwargs["sliding_window"] = None
        kwargs["markov_head_type"] = (kwargs.get("markov_head_type") or "").lower() or None

    def engine_draft_tokens(self):
        return self.block_size + 1, self.block_size  # SGLang counts the anchor too; vLLM one draft per slot

    def for_engines(self, target_layers=None, target_vocab=None):
        if any(self.layer_window(i) is not None for i in range(self.num_hidden_layers)):
            raise ValueError(f"DSparkConfig.layer_types: {self.layer_types}: vLLM and SGLang run sliding DSpark layers "
                             f"causal (no is_causal in DeepSpec's config), while DSpark drafts bidirectionally")
        return super().for_engines(target_layers, target_vocab)

    def without_windowless_sliding(self, layers):
        config = dataclasses.replace(self, layer_types=["full_attention"] * self.num_hidden_layers)
        return config, (f"layers {layers} slide with no window, which vLLM and SGLang refuse: written as "
                        f"full_attention (bidirectional, as DSpark runs them)")

    def to_dict(self):
        d = self.qwen3_dict() | {
            "vocab_size": self.vocab_size, "attention_bias": False, "tie_word_embeddings": False,
            "dtype": self.dtype, "num_target_layers": self.num_target_layers,
            "target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
            "block_size": self.block_size, "markov_rank": self.markov_rank,
            "enable_confidence_head": self.enable_confidence_head,
        }
        if self.markov_rank > 0:
            d["markov_head_type"] = self.markov_head_type
        if self.enable_confidence_head:
            d["confidence_head_with_markov"] = self.confidence_head_with_markov
        return self.set_keys(d, ["num_anchors", "bos_token_id", "eos_token_id", "pad_token_id"])


class DSparkLayer(nn.Module):
    """Pre-norm attention over [context, block] and a SwiGLU MLP; DFlash 2's layer without convolutions."""

    def __init__(self, config, layer_idx):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Low-rank bigram bias on the logits: bias(prev) = W2 W1[prev], W1 [V, r] (an embedding), W2 [V, r]."""

    def __init__(self, vocab_size, rank):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, prev_ids):
        return self.markov_w2(self.markov_w1(prev_ids))


class ConfidenceHead(nn.Module):
    """A logit per slot, sigma of which estimates the slot's acceptance probability."""

    def __init__(self, input_dim):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features):
        return self.proj(features).squeeze(-1)


class DSparkDrafter(nn.Module):
    """fc + hidden_norm fuse the tapped target features; bidirectional layers map [anchor, MASK x (B-1)]
    at positions p..p+B-1 to h [b, B, H]. State names are DeepSpec's (Qwen3DSparkModel).

    own_embeddings: the checkpoint carries copies of the target's embed_tokens and lm_head (DeepSpec
    saves them); without them the caller passes the target's.
    """

    # The backbone is DFlash 2's minus the convolutions: the same context K/V, block embedding, mask
    # and forward, borrowed rather than subclassed so that a DSparkDrafter is never a DFlash2Drafter.
    rope = DFlash2Drafter.rope
    context_kv = DFlash2Drafter.context_kv
    embed_block = DFlash2Drafter.embed_block
    forward = DFlash2Drafter.forward
    draft_logits = DFlash2Drafter.draft_logits

    def __init__(self, config, attn_backend="sdpa", own_embeddings=False):
        super().__init__()
        config.validate()
        self.config = config
        self.attn_backend = attn_backend
        H, V, n = config.hidden_size, config.vocab_size, len(config.target_layer_ids)
        if own_embeddings:
            self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList(DSparkLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.fc = nn.Linear(n * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        if own_embeddings:
            self.lm_head = nn.Linear(H, V, bias=False)
        self.markov_head = MarkovHead(V, config.markov_rank) if config.markov_rank > 0 else None
        self.confidence_head = None
        if config.enable_confidence_head:
            self.confidence_head = ConfidenceHead(H + (config.markov_rank if config.confidence_head_with_markov else 0))

    @property
    def own_embeddings(self):
        return hasattr(self, "lm_head")

    def markov_bias(self, prev_ids):
        """W2 W1[prev] [..., V] in float32, zero without a Markov head."""
        if self.markov_head is None:
            return torch.zeros((), device=prev_ids.device)
        return self.markov_head(prev_ids).float()

    def confidence_logits(self, h, prev_ids):
        """c_k = proj([h_k, W1[prev_k]]) [b, T] float32 (or proj(h_k) without the Markov input); None
        without a head. sigma(c_k) estimates the acceptance of slot k's draft; it reads the previous
        token, never the slot's own draft, so a cut on it is a stopping rule (lossless, docs/DSPARK.md)."""
        if self.confidence_head is None:
            return None
        x = h
        if self.config.confidence_head_with_markov:
            x = torch.cat([h, self.markov_head.markov_w1(prev_ids).to(h.dtype)], dim=-1)
        return self.confidence_head(x).float()

    @classmethod
    def from_pretrained(cls, path_or_hub_id, device=None, dtype=None, attn_backend=None):
        return load_dspark(path_or_hub_id, device, dtype, attn_backend)

    def save_pretrained(self, directory, dtype=None, with_embeddings=None):
        save_dspark(self, directory, dtype, with_embeddings)


def dspark_logits(drafter, h, prev_ids, lm_head=None):
    """z_k = lm_head(h_k) + W2 W1[prev_k] [b, T, V] float32, for given previous tokens prev_ids [b, T]
    (teacher forcing: the anchor then the gold tokens; or the anchor then a walk's drafts)."""
    U = drafter.draft_logits(h, drafter.lm_head if lm_head is None else lm_head)
    return U + drafter.markov_bias(prev_ids)


def dspark_walk(drafter, h, anchor_ids, lm_head=None, temperature=0.0, generator=None):
    """Left-to-right walk over all B slots: slot k's logits z_k = lm_head(h_k) + W2 W1[d_k] with
    d_0 = the anchor; greedy d_{k+1} = argmax z_k, else d_{k+1} ~ softmax(z_k / T) over the vocabulary.

    h [b, B, H] from DSparkDrafter.forward; anchor_ids [b]; lm_head: the target's weight [V, H] or a
    linear module (default: the drafter's own copy). Returns drafts [b, B] (d_1..d_B, positions
    p+1..p+B) and q [b, B, V] float32: the law each draft was drawn from (one-hot when greedy), the
    proposal verify_sampled divides by.
    """
    U = drafter.draft_logits(h, drafter.lm_head if lm_head is None else lm_head)
    b, n, V = U.shape
    drafts = torch.empty(b, n, dtype=torch.long, device=U.device)
    q = torch.zeros(b, n, V, device=U.device)
    prev = anchor_ids
    for k in range(n):
        z = U[:, k] + drafter.markov_bias(prev)
        if temperature == 0:
            prev = z.argmax(-1)
            q[:, k].scatter_(-1, prev[:, None], 1.0)
        else:
            q[:, k] = torch.softmax(z / temperature, dim=-1)
            prev = sample_index(q[:, k], generator)
        drafts[:, k] = prev
    return drafts, q


def walk_prev_ids(anchor_ids, drafts):
    """prev_k for every slot: [anchor, d_1 .. d_{B-1}] [b, B]."""
    return torch.cat([anchor_ids[:, None], drafts[:, :-1]], dim=1)


def confident_prefix(conf_logits, threshold):
    """Drafts to verify per row [b]: the slots before the first with sigma(c_k) < threshold; every
    slot when threshold <= 0 (DeepSpec's default, the cut off) or when there is no head (None)."""
    if conf_logits is None or threshold <= 0:
        return None
    return (conf_logits.sigmoid() >= threshold).long().cumprod(-1).sum(-1)


def load_dspark(path_or_hub_id, device=None, dtype=None, attn_backend=None):
    """DSparkDrafter from DeepSpec's layout: config.json + model.safetensors (or a sharded index).
    embed_tokens / lm_head copies are loaded when the file has them (both or neither)."""
    from .checkpoint import CheckpointError
    from .kernels import check_attn_backend

    attn_backend = check_attn_backend(attn_backend, device or "cpu")
    path = resolve_checkpoint(path_or_hub_id)
    config = DSparkConfig.from_dict(read_json(path / "config.json"))
    state = read_safetensors(path)
    copies = {"embed_tokens.weight", "lm_head.weight"} & state.keys()
    if len(copies) == 1:
        raise CheckpointError(f"{path}: has {copies.pop()} but not its pair (embed_tokens and lm_head go together)")
    dtype = dtype or getattr(torch, config.dtype)
    with torch.device("meta"):
        model = DSparkDrafter(config, attn_backend, own_embeddings=bool(copies))
    check_state_dict(model.state_dict(), state, path)
    model.load_state_dict({k: v.to(device=device or "cpu", dtype=dtype) for k, v in state.items()}, assign=True)
    return model.eval()


def save_dspark(drafter, directory, dtype=None, with_embeddings=None):
    """Write config.json and model.safetensors in DeepSpec's layout (checkpoint.write_checkpoint);
    with_embeddings (default: when the drafter has them) keeps the embed_tokens / lm_head copies."""
    dtype = dtype or next(drafter.parameters()).dtype
    with_embeddings = drafter.own_embeddings if with_embeddings is None else with_embeddings
    config = dataclasses.replace(drafter.config, dtype=str(dtype).removeprefix("torch."))
    state = {k: v.to(dtype) for k, v in drafter.state_dict().items()
             if with_embeddings or k not in ("embed_tokens.weight", "lm_head.weight")}
    return write_checkpoint(directory, config, state)
