"""The target: any transformers causal LM behind a per-row slot cache, seen as forward(ids, positions,
cache) -> logits and the tapped hidden states the drafter reads (SPEC §3, §7)."""
import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import kernels
from .settings import InputError


def text_config(config):
    """The text model's config: a VL config keeps it under text_config, a causal LM's is the config itself."""
    return getattr(config, "text_config", config)


class SlotCacheLayer(CacheLayerMixin):
    """Static K/V buffer where slot j always holds absolute position j of that row.

    Rows advance by different amounts each step, so writes go to each row's own positions;
    slots past a row's committed length hold stale drafts, but they always lie in the future
    of every query (causal mask by position), and the next write overwrites them.
    """

    is_compileable = True

    def __init__(self, cache):
        super().__init__()
        self.cache = cache
        self.idx_keys = None

    def lazy_initialization(self, key_states, value_states):
        b, h, _, d = key_states.shape
        shape = (b, h, self.cache.max_len, d)
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros(shape[:3] + (value_states.shape[-1],))
        self.is_initialized = True

    def _write(self, buf, new):
        # buf[r, :, pos[r, t]] = new[r, :, t]: an index_put_, which inductor updates in place (a scatter_
        # into a cache buffer compiles to a copy of the whole buffer, twice, on every forward)
        buf[self.cache.write_rows, :, self.cache.write_positions] = new.transpose(1, 2).to(buf.dtype)
        return buf[:, :, : self.cache.view_len]

    def move(self, src, dst):
        """Slots dst [b, n] take what slots src hold, per row (a tree's accepted path into place)."""
        rows = torch.arange(src.shape[0], device=src.device)[:, None]
        for name in ("keys", "values", "idx_keys"):
            buf = getattr(self, name)
            if buf is not None:
                buf[rows, :, dst] = buf[rows, :, src]  # the right side is gathered first: overlaps are safe

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._write(self.keys, key_states), self._write(self.values, value_states)

    def update_index(self, idx_k):
        """MiniMax-M3 sparse layers also cache their indexer keys."""
        if self.idx_keys is None:
            self.idx_keys = idx_k.new_zeros(idx_k.shape[:2] + (self.cache.max_len, idx_k.shape[-1]))
        return self._write(self.idx_keys, idx_k)

    update_indexer = update_index

    def get_mask_sizes(self, query_length, *args):
        return self.cache.view_len, 0

    def get_seq_length(self):
        return self.cache.view_len

    def get_max_length(self):
        return self.cache.max_len

    def select_rows(self, rows):
        for name in ("keys", "values", "idx_keys"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, rows))

    def copy_rows(self, rows, other):
        """Rows `rows` take over every slot of `other`'s rows (a request admitted into finished rows)."""
        for name in ("keys", "values", "idx_keys"):
            if getattr(self, name) is not None:
                getattr(self, name)[rows] = getattr(other, name)

    def gather(self, parts, groups):
        """Row groups[i] of this (empty) layer take parts[i]'s rows, which are released as they are copied."""
        for name in ("keys", "values", "idx_keys"):
            first = getattr(parts[0], name)
            if first is not None:
                buf = first.new_empty((sum(map(len, groups)),) + first.shape[1:])
                for part, rows in zip(parts, groups):
                    buf[rows] = getattr(part, name)
                    setattr(part, name, None)
                setattr(self, name, buf)
        self.is_initialized = parts[0].is_initialized


class SlotCache(Cache):
    """The target's KV cache for ragged batches: one SlotCacheLayer per decoder layer."""

    def __init__(self, num_layers, max_len):
        self.max_len = max_len
        self.write_positions = None
        self.write_rows = None  # [b, 1] row index for the writes, made once per forward, not per layer
        self.view_len = 0
        super().__init__(layers=[SlotCacheLayer(self) for _ in range(num_layers)])

    def select_rows(self, rows):
        for layer in self.layers:
            layer.select_rows(rows)

    def copy_rows(self, rows, other):
        for layer, src in zip(self.layers, other.layers):
            layer.copy_rows(rows, src)

    def move(self, src, dst):
        for layer in self.layers:
            layer.move(src, dst)

    @classmethod
    def gathered(cls, parts, groups):
        """One cache whose rows groups[i] (index lists covering 0..b-1) hold the rows of caches parts[i] (a batch
        prefilled a group of rows at a time); the parts are emptied, layer by layer, as they are copied."""
        cache = cls(len(parts[0].layers), parts[0].max_len)
        device = next((layer.keys.device for layer in parts[0].layers if layer.keys is not None), "cpu")
        groups = [torch.tensor(g, device=device) for g in groups]
        for i, layer in enumerate(cache.layers):
            layer.gather([p.layers[i] for p in parts], groups)
        return cache


class Target:
    """A causal LM seen as: forward(ids, positions, cache) -> logits and tapped hidden states.

    Tapped features are hidden_states[l + 1] (the output of decoder layer l) for l in layer_ids,
    concatenated on the feature axis: exactly the drafter's context input (SPEC §3).
    """

    def __init__(self, model, layer_ids=()):
        self.model = model.eval()
        fix_partial_rotary(model)
        self.layer_ids = list(layer_ids)
        cfg = text_config(model.config)
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.cache_arg = cache_kwarg(model)
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        # load_target(prepack=True) swapped the linears for oneDNN ones; the draft head follows suit
        self.prepacked = any(isinstance(m, kernels.PackedLinear) for m in model.modules())
        bad = [l for l in self.layer_ids if not 0 <= l < self.num_layers]
        if bad:
            raise InputError(f"drafter target_layer_ids {bad} do not exist in a target with {self.num_layers} layers")

    @property
    def embed_tokens(self):
        return self.model.get_input_embeddings()

    @property
    def lm_head_weight(self):
        return self.model.get_output_embeddings().weight

    def lm_head_as(self, dtype):
        """The LM head for draft logits in the drafter's dtype, built once: a bf16 drafter reads half the
        bytes per draft; on CPU it is a oneDNN-packed linear (a 3x faster read than aten's bf16 matmul)."""
        head = getattr(self, "_draft_head", None)
        if head is None or getattr(head, "weight", head).dtype != dtype:
            weight = self.lm_head_weight if dtype == self.lm_head_weight.dtype else self.lm_head_weight.detach().to(dtype)
            packed = self.prepacked and kernels.can_prepack(weight)
            head = self._draft_head = kernels.PackedLinear(weight.detach()) if packed else weight
        return head

    @property
    def device(self):
        return self.lm_head_weight.device

    def new_cache(self, max_len):
        return SlotCache(self.num_layers, max_len)

    @torch.no_grad()
    def forward(self, ids, positions, cache, view_len, slots=None, visible=None, last=None):
        """ids, positions [b, T]; writes K/V at those positions; keys visible iff slot <= query position.

        A tree passes slots [b, T] (where its K/V go, default positions) and visible [b, T, view_len]
        (default slot <= position). view_len bounds the slots attended (>= max slot + 1). Returns
        logits [b, T, V] (float32) and features [b, T, n*H] (empty when no layers are tapped). A prefill
        passes last [b], each row's last prompt index: its logits are then [b, 1, V], and where the model keeps
        logits (transformers' logits_to_keep) the LM head reads the distinct indices of `last` in each row, not
        every prompt token (32 prompts of 500 tokens: at most 1,024 positions, not 16,000 and a 3 GB tensor).
        """
        cache.write_positions = positions if slots is None else slots
        cache.write_rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        cache.view_len = view_len
        if visible is None:
            visible = torch.arange(view_len, device=ids.device)[None, None, :] <= positions[:, :, None]
        visible = visible[:, None]
        dtype = self.lm_head_weight.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=ids.device).masked_fill(~visible, torch.finfo(dtype).min)
        keep = {}
        if last is not None and self.keeps_logits:  # sorted, distinct: a 1-D index tensor, as every 5.x reads it
            keep["logits_to_keep"] = torch.unique(last)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, **{self.cache_arg: cache},
                         use_cache=True, output_hidden_states=bool(self.layer_ids), **keep)
        if self.layer_ids:
            feats = torch.cat([out.hidden_states[l + 1] for l in self.layer_ids], dim=-1)
        else:
            feats = ids.new_zeros(ids.shape + (0,), dtype=dtype)
        logits = out.logits
        if last is not None:
            at = torch.searchsorted(keep["logits_to_keep"], last) if keep else last
            logits = logits[torch.arange(ids.shape[0], device=ids.device), at][:, None]
        return logits.float(), feats


def cache_kwarg(model):
    """transformers 5.24+ names the KV cache argument `cache`, earlier 5.x (the GPU machine's 5.17) `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def fix_partial_rotary(model):
    """transformers' minimax_m3_vl_text reads only rope_parameters["partial_rotary_factor"] and ignores its
    own rotary_dim field, so a config without the factor silently runs full RoPE (SPEC §7). Restore the
    factor from rotary_dim and rebuild the rotary tables. Returns True when it had to fix something."""
    config = text_config(model.config)
    rotary_dim = getattr(config, "rotary_dim", None)
    rope = getattr(config, "rope_parameters", None)
    if not rotary_dim or not isinstance(rope, dict) or "partial_rotary_factor" in rope:
        return False
    rope["partial_rotary_factor"] = rotary_dim / config.head_dim
    base = model.get_decoder()
    old = base.rotary_emb
    base.rotary_emb = type(old)(config=config).to(old.inv_freq.device)
    return True


def install_output_hooks(model):
    """transformers installs its hidden-state hooks on the first forward that asks for them, under a
    threading lock that dynamo cannot trace: a compiled target met first would break its graph there.
    Install them now, eagerly (top-down, so a submodel is never hooked twice)."""
    try:
        from transformers.modeling_utils import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, maybe_install_capturing_hooks
    except ImportError:  # a transformers without output capturing: nothing to install
        return
    for m in model.modules():
        if isinstance(m, PreTrainedModel) and _CAN_RECORD_REGISTRY.get(m):
            maybe_install_capturing_hooks(m)
