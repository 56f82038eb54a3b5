"""Drafter checkpoints in the published layout: config.json (read as transformers' Qwen3Config reads
it, docs/SPEC.md §2) and model.safetensors (single or sharded), loaded and saved with one clear error
for every problem."""
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .settings import is_hub_id

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(kw_only=True)
class DrafterConfig:
    """What every drafter's config.json holds: a Qwen3 config (read as transformers' Qwen3Config reads it)
    plus the target layers it taps and its mask token. Subclasses add their method's keys, their layer
    rule (layer_causal) and how they nest those keys in the file (from_dict's read_own_keys, to_dict)."""

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
    layer_types: list[str] | None = None  # None: the subclass's default_layer_types
    sliding_window: int | None = None
    use_sliding_window: bool = False  # transformers' Qwen3 default: windows off unless enabled
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    NAME: ClassVar[str]  # in error messages: "<NAME> config ..."
    ARCHITECTURE: ClassVar[str]

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = self.default_layer_types()
        self.target_layer_ids, self.layer_types = list(self.target_layer_ids), list(self.layer_types)

    def default_layer_types(self):
        return ["full_attention"] * self.num_hidden_layers

    def layer_window(self, i):
        """Sliding window of layer i, None for full attention (transformers' Qwen3 rule: no window
        unless use_sliding_window)."""
        if self.use_sliding_window and self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    def checks(self):
        """(field, ok, why) for every rule the config must keep; subclasses add theirs."""
        return [
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
            ("target_layer_ids", len(self.target_layer_ids) >= 1
             and all(0 <= i < self.num_target_layers for i in self.target_layer_ids),
             f"{self.target_layer_ids} must be non-empty ids in [0, num_target_layers={self.num_target_layers})"),
            ("mask_token_id", 0 <= self.mask_token_id < self.vocab_size,
             f"{self.mask_token_id} must lie in [0, vocab_size={self.vocab_size})"),
        ]

    def validate(self):
        """Raise ValueError naming the first inconsistent field."""
        for name, ok, why in self.checks():
            if not ok:
                raise ValueError(f"{type(self).__name__}.{name}: {why}")
        return self

    @classmethod
    def from_dict(cls, d):
        """Read a config.json dict as transformers' Qwen3Config does: absent keys take its defaults
        (head_dim 128, num_key_value_heads 32, null: = heads); then the subclass's own keys."""
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cls.NAME} config: hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("attention_bias"):
            raise ValueError(f"{cls.NAME} config: attention_bias true is not supported (the published drafters "
                             f"have none)")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        rope = d.get("rope_parameters") or {}
        kwargs.update({k: rope[k] for k in ("rope_theta", "rope_type") if k in rope})
        kwargs.setdefault("head_dim", 128)
        kwargs.setdefault("num_key_value_heads", 32)  # Qwen3Config's class default; null means "= heads"
        if kwargs["num_key_value_heads"] is None:
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads")
        if "dtype" not in d and "torch_dtype" in d:
            kwargs["dtype"] = d["torch_dtype"]
        cls.read_own_keys(d, kwargs)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{cls.NAME} config is missing required keys: {missing}")
        return cls(**kwargs).validate()

    @classmethod
    def read_own_keys(cls, d, kwargs):
        """The subclass's reading of its own keys from d into kwargs (nesting, defaults, refusals)."""

    def qwen3_dict(self):
        """The leading keys of config.json, the same for every drafter."""
        return {
            "architectures": [self.ARCHITECTURE],
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
        }

    def engine_draft_tokens(self):
        """(SGLang's --speculative-num-draft-tokens, vLLM's num_speculative_tokens) for this block."""
        raise NotImplementedError

    def for_engines(self, target_layers=None, target_vocab=None):
        """This config as vLLM 0.33.0 and SGLang 0.5.23 read it the way we do: (config, note). Sliding layers
        with no window, which both engines refuse, are rewritten as full attention with their causality made
        explicit (the note says so); ValueError names any field the engines would misread. target_layers /
        target_vocab: the served target's layer count and vocabulary, when known."""
        name = type(self).__name__
        layers = self.num_target_layers if target_layers is None else target_layers
        vocab = self.vocab_size if target_vocab is None else target_vocab
        bad = [i for i in self.target_layer_ids if not 0 <= i < layers]
        if self.num_target_layers != layers or bad:  # the engines capture hidden_states[id + 1], layer id's output
            raise ValueError(f"{name}.target_layer_ids: {self.target_layer_ids} (for num_target_layers="
                             f"{self.num_target_layers}) are not layers of the target, which has {layers}")
        if self.vocab_size != vocab:
            raise ValueError(f"{name}.vocab_size: {self.vocab_size}, but the target's vocabulary has {vocab} tokens "
                             f"(the drafter shares its embedding and LM head)")
        if not 0 <= self.mask_token_id < vocab:
            raise ValueError(f"{name}.mask_token_id: {self.mask_token_id} (vocab_size {self.vocab_size}) is not a "
                             f"token of the target's vocabulary of {vocab}")
        sglang, vllm = self.engine_draft_tokens()
        if vllm < 1:
            raise ValueError(f"{name}.block_size: {self.block_size} gives vLLM num_speculative_tokens {vllm} and "
                             f"SGLang --speculative-num-draft-tokens {sglang}; both need at least one draft")
        self.validate()
        windowless = [i for i, t in enumerate(self.layer_types) if t == "sliding_attention" and self.layer_window(i) is None]
        if not windowless:
            return self, None
        return self.without_windowless_sliding(windowless)

    def without_windowless_sliding(self, layers):
        """(config, note): sliding layers with no window rewritten as full attention, each layer's causality kept."""
        raise NotImplementedError

    def set_keys(self, d, keys):
        """d with those of keys whose value is not None (keys absent from the file stay absent)."""
        d.update({k: getattr(self, k) for k in keys if getattr(self, k) is not None})
        return d


@dataclass(kw_only=True)
class DFlash2Config(DrafterConfig):
    """DFlash 2's config.json (SPEC §2): the Qwen3 keys and a nested `dflash_config`."""

    sliding_window: int | None = 4096  # transformers' Qwen3 default
    max_window_layers: int | None = 28  # only read when layer_types is absent; None: absent from the file (28)
    is_causal: bool | None = False  # the published value; None (key absent): causal iff the layer is sliding
    # dflash_config
    block_size: int = 8
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    NAME: ClassVar[str] = "DFlash2"
    ARCHITECTURE: ClassVar[str] = "DFlash2DraftModel"
    DFLASH_KEYS: ClassVar[tuple] = ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank",
                                    "selector_top_k", "target_layer_ids", "mask_token_id", "input_embedding_scale",
                                    "output_multiplier", "final_logit_softcapping")

    def default_layer_types(self):
        """transformers' Qwen3Config: layers from max_window_layers on slide, if windows are on."""
        slide = self.use_sliding_window and self.sliding_window is not None
        first = 28 if self.max_window_layers is None else self.max_window_layers
        return ["sliding_attention" if slide and i >= first else "full_attention" for i in range(self.num_hidden_layers)]

    def layer_causal(self, i):
        """Whether layer i's block attends only to itself and earlier slots: is_causal when the config
        sets it, else whether the layer is sliding (how the authors' Qwen3DFlashAttention reads it)."""
        return self.layer_types[i] == "sliding_attention" if self.is_causal is None else bool(self.is_causal)

    def checks(self):
        return super().checks() + [
            ("hidden_size", self.hidden_size >= 1 and self.hidden_size % self.conv_group_size == 0,
             f"{self.hidden_size} must be a positive multiple of conv_group_size {self.conv_group_size}"),
            ("conv_group_size", self.conv_group_size >= 1, f"{self.conv_group_size} must be >= 1"),
            ("conv_kernel_size", self.conv_kernel_size >= 1, f"{self.conv_kernel_size} must be >= 1"),
            ("block_size", self.block_size >= 2, f"{self.block_size} must be >= 2 (anchor + at least one draft)"),
            ("selector_rank", self.selector_rank >= 1, f"{self.selector_rank} must be >= 1"),
            ("selector_top_k", 1 <= self.selector_top_k <= self.vocab_size,
             f"{self.selector_top_k} must lie in [1, vocab_size={self.vocab_size}]"),
            ("final_logit_softcapping", self.final_logit_softcapping is None or self.final_logit_softcapping > 0,
             f"{self.final_logit_softcapping} must be None or > 0"),
        ]

    @classmethod
    def read_own_keys(cls, d, kwargs):
        """As the authors' DFlash2DraftModel: dflash keys from `dflash_config` (or top level in older files),
        block_size 16 and taps spread over the target when absent, softcap 0 read as none; absent or null
        `is_causal` makes sliding layers causal (layer_causal)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs.update({k: v for k, v in (d.get("dflash_config") or {}).items() if k in names})
        kwargs["is_causal"] = d.get("is_causal")
        kwargs["max_window_layers"] = d.get("max_window_layers")
        kwargs.setdefault("block_size", 16)
        if "target_layer_ids" not in kwargs and {"num_target_layers", "num_hidden_layers"} <= kwargs.keys():
            kwargs["target_layer_ids"] = spread_target_layer_ids(kwargs["num_target_layers"], kwargs["num_hidden_layers"])
        if kwargs.get("final_logit_softcapping") == 0:  # the authors' model reads 0 as "no softcap"
            kwargs["final_logit_softcapping"] = None

    def engine_draft_tokens(self):
        return self.block_size, self.block_size - 1  # SGLang verifies the whole block; vLLM counts the drafts

    def without_windowless_sliding(self, layers):
        causal = {self.layer_causal(i) for i in range(self.num_hidden_layers)}
        if len(causal) > 1:
            raise ValueError(f"DFlash2Config.use_sliding_window: layers {layers} are sliding with no window, which "
                             f"vLLM and SGLang refuse, and one is_causal cannot keep both causal and bidirectional "
                             f"layers if they become full attention; set use_sliding_window and sliding_window")
        types = ["full_attention" if i in layers else t for i, t in enumerate(self.layer_types)]
        config = dataclasses.replace(self, layer_types=types, is_causal=causal.pop())
        return config, (f"layers {layers} slide with no window (use_sliding_window is {self.use_sliding_window}), "
                        f"which vLLM and SGLang refuse: written as full_attention with is_causal {config.is_causal}, "
                        f"which both read as we run them")

    def to_dict(self):
        """Qwen3-style config.json dict with a nested `dflash_config`."""
        d = self.set_keys(self.qwen3_dict(), ["max_window_layers"])
        d |= {"num_target_layers": self.num_target_layers, "vocab_size": self.vocab_size}
        self.set_keys(d, ["is_causal"])  # absent means "sliding layers are causal"
        d |= {"attention_bias": False, "tie_word_embeddings": False, "dtype": self.dtype}
        self.set_keys(d, ["bos_token_id", "eos_token_id", "pad_token_id"])
        d["dflash_config"] = {k: getattr(self, k) for k in self.DFLASH_KEYS}
        return d


def spread_target_layer_ids(num_target_layers, num_draft_layers):
    """The authors' default taps when a config names none: evenly from layer 1 to num_target_layers - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class CheckpointError(ValueError):
    pass


def read_checkpoint(path_or_hub_id):
    """(DFlash2Config, state dict of CPU tensors, directory) of a checkpoint: config.json + model.safetensors
    (or a sharded index) in a directory or a hub id. model.DFlash2Drafter.from_pretrained builds the model."""
    path = resolve_checkpoint(path_or_hub_id)
    return DFlash2Config.from_dict(read_json(path / "config.json")), read_safetensors(path), path


def write_checkpoint(directory, config, state, target_layers=None, target_vocab=None):
    """Write config.json and model.safetensors in the published layout, as the serving engines will read
    them (config.for_engines: refuses what they would misread, warns once of a faithful rewrite)."""
    import warnings

    from safetensors.torch import save_file

    config, note = config.for_engines(target_layers, target_vocab)
    if note:
        warnings.warn(note, stacklevel=2)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    return config


def resolve_checkpoint(path_or_hub_id):
    """A checkpoint directory: the path itself, or a hub id's snapshot (json and safetensors only)."""
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_hub_id)
    if not is_hub_id(name):
        raise FileNotFoundError(f"{name}: not a checkpoint directory (expected config.json + model.safetensors)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:
        raise OSError(f"cannot fetch {name!r} from the Hugging Face Hub (offline, or not a repo?): {e}") from e


def read_json(path):
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def read_safetensors(path):
    """All tensors of model.safetensors, or of the shards named by model.safetensors.index.json."""
    from safetensors.torch import load_file

    index, single = path / "model.safetensors.index.json", path / "model.safetensors"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
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


def check_state_dict(expected, got, path):
    """One CheckpointError listing every missing, unexpected and mis-shaped tensor."""
    problems = [f"missing {k} {list(v.shape)}" for k, v in expected.items() if k not in got]
    problems += [f"unexpected {k} {list(v.shape)}" for k, v in got.items() if k not in expected]
    problems += [f"shape mismatch {k}: expected {list(v.shape)}, got {list(got[k].shape)}"
                 for k, v in expected.items() if k in got and got[k].shape != v.shape]
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match the config:\n  " + "\n  ".join(problems))
