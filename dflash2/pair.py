"""A target and its drafter, loaded together and checked to fit; prompts through the chat template."""
from dataclasses import dataclass
from pathlib import Path

import torch

from . import model, spec_decode as sd
from .kernels import prepack_linears
from .settings import DEFAULT_DRAFT, DEFAULT_TARGET, InputError, LoadError, local_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def one_line(e):
    return " ".join(str(e).split()) or type(e).__name__


@dataclass
class Pair:
    model: object  # the transformers causal LM
    tokenizer: object
    drafter: model.DFlash2Drafter | None
    target: sd.Target
    target_id: str
    target_dir: Path
    draft_id: str | None
    draft_dir: Path | None
    dtype: torch.dtype
    device: torch.device
    prepacked: bool = False


def resolve_target(name):
    """(id as recorded in traces, local directory) of the embedded default, a directory or a hub id."""
    if name in (None, DEFAULT_TARGET):
        try:
            return DEFAULT_TARGET, model._smollm2_safetensors()
        except Exception as e:
            raise LoadError(f"cannot prepare the embedded target: {one_line(e)}") from e
    path = Path(name).expanduser()
    if path.is_dir():
        return name, path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
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
        return (DEFAULT_DRAFT.name if local == DEFAULT_DRAFT else name), local
    try:
        return name, model._resolve_checkpoint(name)
    except (OSError, FileNotFoundError) as e:
        raise LoadError(f"drafter {name}: {one_line(e)}") from e


def load_pair(target_name=None, draft_name=None, device="cpu", dtype=torch.float32, needs_draft=True,
              draft_dtype=None, prepack=True, attn_backend=None):
    """Load the target (+ tokenizer) and, unless decoding autoregressively, the drafter; check they fit.

    None names the embedded default pair. Raises InputError (a name that points nowhere, a drafter
    that does not fit the target) or LoadError (files that cannot be loaded)."""
    device = torch.device(device)
    # Resolve both before loading either, so a missing drafter fails before the slow target load.
    draft_id, draft_dir = resolve_draft(draft_name) if needs_draft else (None, None)
    target_id, target_dir = resolve_target(target_name)
    try:
        lm, tok = model.load_target(str(target_dir), device, dtype, prepack=prepack)
    except Exception as e:
        raise LoadError(f"cannot load target {target_id}: {one_line(e)}") from e
    drafter = None
    if needs_draft:
        try:
            drafter = model.DFlash2Drafter.from_pretrained(draft_dir, device=device, dtype=draft_dtype,
                                                           attn_backend=attn_backend)
        except Exception as e:  # CheckpointError, bad JSON, unreadable safetensors
            raise LoadError(f"cannot load drafter {draft_id}: {one_line(e)}") from e
        check_pair(lm, drafter)
        if prepack:
            prepack_linears(drafter)
    target = sd.Target(lm, drafter.config.target_layer_ids if drafter is not None else ())
    return Pair(lm, tok, drafter, target, target_id, target_dir, draft_id, draft_dir, dtype, device, target.prepacked)


def check_pair(lm, drafter):
    """The drafter reuses the target's embedding and LM head and reads its layers: shapes must agree."""
    cfg = getattr(lm.config, "text_config", lm.config)
    dc = drafter.config
    rows = lm.get_output_embeddings().weight.shape[0]
    if dc.hidden_size != cfg.hidden_size:
        raise InputError(f"drafter hidden_size {dc.hidden_size} does not match the target's {cfg.hidden_size}")
    if dc.vocab_size != rows:
        raise InputError(f"drafter vocab_size {dc.vocab_size} does not match the target's LM head ({rows} rows)")
    bad = [i for i in dc.target_layer_ids if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise InputError(f"drafter target_layer_ids {bad} do not exist in a target with "
                         f"{cfg.num_hidden_layers} layers")


def encode_prompt(tok, text, system=None, chat=True):
    """Token ids of one user turn through the chat template with the generation prompt, or of raw text."""
    if not chat:
        return tok(text)["input_ids"]
    if not tok.chat_template:
        raise InputError("the target's tokenizer has no chat template; pass --no-chat-template")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(rendered, add_special_tokens=False)["input_ids"]
