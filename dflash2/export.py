"""Serving-ready drafter directories for SGLang and vLLM (README, "Serve it on a GPU cluster").

    dflash2-export dflash2-smollm2-135m ~/serve/smollm2-dflash2
    dflash2-export dspark-smollm2-135m ~/serve/smollm2-dspark
    dflash2-export runs/smollm2/drafter ~/serve/my-dflash2 --target-config runs/target/config.json

writes config.json in the published layout (through checkpoint.write_checkpoint, which refuses what the
engines would misread), model.safetensors without the target's tables, and a README.md with the target,
the method, the block and the engines' command lines. vLLM guesses the method from the draft's path when
the command names none (config/speculative.py:1445-1468: "eagle-", then "eagle3", then "dflash", tested
on the whole path string, before the architecture); a directory whose path it would read as another method
(or, for DFlash 2, as none) is refused.
"""
import argparse
import json
import sys
from pathlib import Path

from .checkpoint import read_json, resolve_checkpoint, write_checkpoint
from .settings import local_checkpoint

SERVED_TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hugging Face release of the target we train against
TARGET_TABLES = ("embed_tokens.weight", "lm_head.weight")  # the drafter shares them with the target


def vllm_method_from_path(model, architecture):
    """vLLM 0.33.0's guess of the speculative method when the command names none (config/speculative.py:1445-1468),
    for our two architectures: substrings of the lowercased path string first, then the architecture."""
    path = str(model).lower()
    for needle, method in (("eagle-", "eagle"), ("eagle3", "eagle3"), ("dflash", "dflash"), ("dspark", "dspark")):
        if needle in path:
            return method
    return "dspark" if architecture == "Qwen3DSparkModel" else None


def method_of(config):
    return "dspark" if config.ARCHITECTURE == "Qwen3DSparkModel" else "dflash"


def check_served_path(directory, config):
    """ValueError unless vLLM, given the directory's absolute path and no method, takes the drafter's method."""
    path, method = Path(directory).resolve(), method_of(config)
    guess = vllm_method_from_path(path, config.ARCHITECTURE)
    if guess != method:
        need = ("must contain 'dflash' and neither 'eagle-' nor 'eagle3'" if method == "dflash"
                else "must contain none of 'dflash', 'eagle-', 'eagle3'")
        raise ValueError(f"{path}: vLLM reads a drafter under this path as method {guess!r}, not {method!r} (it tests the "
                         f"whole path for 'eagle-', 'eagle3', then 'dflash', then 'dspark'): the path {need}")


def serve_commands(directory, config, target):
    """(SGLang's command, vLLM's command) serving the drafter at directory beside target."""
    sglang_tokens, vllm_tokens = config.engine_draft_tokens()
    path, method = Path(directory).resolve(), method_of(config)
    algorithm = "DSPARK" if method == "dspark" else "DFLASH --speculative-draft-attention-backend fa4"
    sglang = (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
              f"--speculative-draft-model-path {path} --speculative-num-draft-tokens {sglang_tokens}")
    spec = json.dumps({"method": method, "model": str(path), "num_speculative_tokens": vllm_tokens})
    return sglang, f"vllm serve {target} --speculative-config '{spec}'"


def readme(directory, config, target, note):
    sglang, vllm = serve_commands(directory, config, target)
    method = "DSpark" if method_of(config) == "dspark" else "DFlash 2"
    layers = [i + 1 for i in config.target_layer_ids]
    rewrite = f"\nWritten for the engines: {note}.\n" if note else ""
    return f"""# {method} drafter for {target}

Written by `dflash2-export` (dflash2-ref). Method: {method} ({config.ARCHITECTURE}), block size {config.block_size},
{config.num_hidden_layers} layers, taps of target layers {config.target_layer_ids} (the engines capture hidden
states {layers}: index 0 is the embedding), mask token {config.mask_token_id}. The weights hold no copy of the
target's embedding or LM head: the engines share the target's.
{rewrite}
SGLang 0.5.23:

    {sglang}

vLLM 0.33.0:

    {vllm}

The engines verify every draft against the target, so the output follows the target's distribution whatever this
drafter proposes; how often drafts are accepted depends on the target's weights matching those it was trained
against, and on the engine's options (vLLM's default draft_sample_method "greedy" walks greedily at T > 0).
See dflash2-ref's README, "Serve it on a GPU cluster".
"""


def load_source(source):
    """(config, state without the target's tables) of a drafter checkpoint, either method, loaded and checked
    by its model class."""
    from .dspark import DSparkDrafter
    from .model import DFlash2Drafter

    path = resolve_checkpoint(local_checkpoint(source) or source)
    dspark = (read_json(path / "config.json").get("architectures") or [None])[0] == "Qwen3DSparkModel"
    drafter = (DSparkDrafter if dspark else DFlash2Drafter).from_pretrained(path)
    return drafter.config, {k: v for k, v in drafter.state_dict().items() if k not in TARGET_TABLES}


def target_shape(config_path):
    """(num_hidden_layers, vocab_size) from a target's config.json (or its directory)."""
    path = Path(config_path)
    d = read_json(path / "config.json" if path.is_dir() else path)
    d = d.get("text_config", d)
    return d["num_hidden_layers"], d["vocab_size"]


def export(source, out, target=SERVED_TARGET, target_config=None):
    """Write the serving directory out from the drafter checkpoint source; returns the config written."""
    import warnings

    config, state = load_source(source)
    check_served_path(out, config)
    if Path(out).exists() and any(Path(out).iterdir()):
        raise ValueError(f"{out}: exists and is not empty")
    layers, vocab = target_shape(target_config) if target_config else (None, None)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        written = write_checkpoint(out, config, state, layers, vocab)
    note = "; ".join(str(w.message) for w in said) or None
    if note:
        print(f"note: {note}", file=sys.stderr)
    (Path(out) / "README.md").write_text(readme(out, written, target, note))
    return written


def main(argv=None):
    ap = argparse.ArgumentParser(prog="dflash2-export", description="Write a serving-ready directory (config.json, "
                                 "model.safetensors, README.md with the SGLang and vLLM commands) from a drafter.")
    ap.add_argument("source", help="drafter checkpoint: a directory, a hub id, or a shipped name "
                                   "(dflash2-smollm2-135m, dspark-smollm2-135m)")
    ap.add_argument("out", help="the new directory (a DSpark drafter's path must not contain 'dflash': vLLM "
                                "would take it for DFlash)")
    ap.add_argument("--target", default=SERVED_TARGET, help="the target model the commands serve (default: %(default)s)")
    ap.add_argument("--target-config", default=None, metavar="PATH",
                    help="the target's config.json (or its directory): taps and vocabulary are checked against it "
                         "(default: against the drafter's own num_target_layers and vocab_size)")
    args = ap.parse_args(argv)
    try:
        config = export(args.source, args.out, args.target, args.target_config)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    sglang, vllm = serve_commands(args.out, config, args.target)
    print(f"wrote {Path(args.out).resolve()}\nSGLang: {sglang}\nvLLM:   {vllm}")


if __name__ == "__main__":
    main()
