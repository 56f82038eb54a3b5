"""Training prompts for self-distillation: benchmark training splits and synthetic prompt sets.

`training_prompts(data_dir, sources, seed)` is the one entry point; `python -m dflash2.train data`
has the target answer these prompts. The synthetic sets (templates, word lists, made-up coding tasks) are the
data files of prompt_data/, written for this project, not taken from any benchmark; this module reads and fills
them (`_make` describes a template). No evaluation set is read (tests/test_train.py checks every source against
them). The same sources and seed give the same prompts in the same order.
"""
import ast
import functools
import gzip
import inspect
import json
import operator
import random
import re
import string
from pathlib import Path

from .settings import InputError

_DATA = Path(__file__).parent / "prompt_data"


def _load(name: str):
    """One file of prompt_data/."""
    return json.loads((_DATA / f"{name}.json").read_text(encoding="utf-8"))


_FORMATS = _load("formats")
# the model card's prompt formats (SPEC §8), shared with bench.py
GSM8K_SUFFIX = _FORMATS["gsm8k_suffix"]
HUMANEVAL_WRAP = _FORMATS["humaneval_wrap"]

# Modules of Python's standard library whose docstrings `docs` turns into requests: the documentation of
# installed code, as users paste it to an assistant. Read from the running interpreter, so no text is stored.
DOC_MODULES = tuple(_load("docs")["modules"])
# Follow-up turns for multi-turn prompts (`python -m dflash2.train prompts --kind multi-turn`).
FOLLOW_UPS = tuple(_load("multi_turn")["follow_ups"])
# Topics and request kinds the target writes its own questions from (`prompts --kind self-instruct`).
_SELF_INSTRUCT = _load("self_instruct")
SELF_INSTRUCT_TOPICS = tuple(_SELF_INSTRUCT["topics"])
SELF_INSTRUCT_KINDS = tuple(_SELF_INSTRUCT["kinds"])

# --------------------------------------------------------------------------- filling templates

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.Lt: operator.lt}


@functools.cache  # a template is filled thousands of times: parse each expression once
def _parse(expression: str) -> ast.expr:
    return ast.parse(expression, mode="eval").body


def _value(node: ast.expr, env: dict):
    """Value of a template expression: a small part of Python (literals, names, arithmetic, calls of env's
    functions, f-strings, one-loop comprehensions), evaluated left to right as Python would, so that the draws
    from the random generator come in the order the templates' authors wrote them."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e, env) for e in node.elts]
    if isinstance(node, ast.BinOp):
        return _OPS[type(node.op)](_value(node.left, env), _value(node.right, env))
    if isinstance(node, ast.UnaryOp):
        return _OPS[type(node.op)](_value(node.operand, env))
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        return _OPS[type(node.ops[0])](_value(node.left, env), _value(node.comparators[0], env))
    if isinstance(node, ast.IfExp):
        return _value(node.body if _value(node.test, env) else node.orelse, env)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return env[node.func.id](*[_value(a, env) for a in node.args])
    if isinstance(node, ast.Subscript):
        return _value(node.value, env)[_value(node.slice, env)]
    if isinstance(node, ast.Slice):
        return slice(*[part and _value(part, env) for part in (node.lower, node.upper, node.step)])
    if isinstance(node, ast.JoinedStr):
        return "".join(_value(part, env) for part in node.values)
    if isinstance(node, ast.FormattedValue):
        return format(_value(node.value, env), _value(node.format_spec, env) if node.format_spec else "")
    if isinstance(node, ast.ListComp) and len(node.generators) == 1 and not node.generators[0].ifs:
        loop, out = node.generators[0], []
        for item in _value(loop.iter, env):
            inner = dict(env)
            _bind(loop.target, item, inner)
            out.append(_value(node.elt, inner))
        return out
    raise ValueError(f"template expression not supported: {ast.unparse(node)}")


def _bind(target: ast.expr, value, env: dict):
    """Assign value to a name or unpack it into a tuple of names, as `a, (b, c) = value`."""
    if isinstance(target, ast.Name):
        env[target.id] = value
    else:
        for t, v in zip(target.elts, value, strict=True):
            _bind(t, v, env)


def _fill(template: str, env: dict) -> str:
    """A template's text with each {expression} or {expression:spec} replaced, as an f-string would."""
    out = []
    for literal, field, spec, _ in string.Formatter().parse(template):
        out.append(literal)
        if field is not None:
            out.append(format(_value(_parse(field), env), spec))
    return "".join(out)


def _make(maker, env: dict) -> str:
    """One prompt from a maker of prompt_data/: a template; a list of makers, of which one is drawn; or
    {"let": {names: expression, ...}, "text": maker}, whose names are bound in order before the text is made."""
    if isinstance(maker, str):
        return _fill(maker, env)
    if isinstance(maker, list):
        return _make(env["pick"](maker), env)
    env = dict(env)
    for target, expression in maker.get("let", {}).items():
        _bind(_parse(target), _value(_parse(expression), env), env)
    return _make(maker["text"], env)


def _maker_env(words: dict, rng: random.Random) -> dict:
    """What templates may name: the file's word lists, draws from rng and a few pure helpers."""
    return {**words, "pick": rng.choice, "randint": rng.randint, "randrange": rng.randrange, "sample": rng.sample,
            "range": range, "min": min, "sorted": sorted, "join": lambda sep, items: sep.join(map(str, items))}


def _unique(make, n: int, tries: int = 20) -> list[str]:
    """Up to n distinct prompts from a random generator (stops after n * tries draws)."""
    seen = {}
    for _ in range(n * tries):
        seen.setdefault(make(), None)
        if len(seen) == n:
            break
    return list(seen)


# --------------------------------------------------------------------------- prompt sources

def _mbpp_function_stub(row) -> str | None:
    """HumanEval-shaped prompt from an MBPP row: its first `def` line plus the task as docstring."""
    for line in row["code"].splitlines():
        if line.startswith("def "):
            return _FORMATS["mbpp_stub"].format(signature=line.rstrip(), task=row["prompt"].strip())
    return None


def _mbpp_training_rows(data_dir: str) -> list[dict]:
    """MBPP rows outside the test split (task ids 11-510), minus any whose text repeats a test task
    (row 569 duplicates test task 104 word for word)."""
    rows = json.loads((Path(data_dir) / "mbpp" / "sanitized-mbpp.json").read_text())
    test = {r["prompt"].strip() for r in rows if 11 <= r["task_id"] <= 510}
    return [r for r in rows if not 11 <= r["task_id"] <= 510 and r["prompt"].strip() not in test]


def _general_prompts() -> list[str]:
    """Open-ended chat prompts (`chat`) for MT-Bench-like replies: every kind of piece about every topic, every
    ask about every concept."""
    data = _load("chat")
    out = [data["write"].format(kind=k, topic=t) for k in data["kinds"] for t in data["topics"]]
    out += [a.format(concept=c) for a in data["asks"] for c in data["concepts"]]
    return out


def _code_prompts(data_dir: str) -> list[str]:
    """Coding prompts in the MBPP and HumanEval shapes for code.json's tasks, plus 'explain this code' for
    MBPP's training rows (their reference solutions, never the test split)."""
    data = _load("code")
    templates, tasks = data["templates"], data["tasks"]
    out = []
    for name, args, what in tasks:
        fields = {"name": name, "args": args, "what": what, "What": what[0].upper() + what[1:]}
        out.append(templates["mbpp"].format(**fields))
        out.append(templates["signature"].format(**fields))
        out.append(HUMANEVAL_WRAP.format(prompt=templates["stub"].format(**fields)))
    for name, args, what in tasks[::2]:
        out.append(templates["tests"].format(name=name, args=args, what=what))
    for row in _mbpp_training_rows(data_dir):
        out.append(templates["explain"].format(code=row["code"].strip()))
    return out


def _code2_prompts() -> list[str]:
    """Three prompts per task of code2.json: the MBPP shape, a HumanEval-shaped stub whose docstring carries the
    example as a doctest, and either the MBPP shape with an assert test or a typed version with complexity."""
    data = _load("code2")
    templates = data["templates"]
    tasks = [task for group in data["tasks"].values() for task in group]
    out = []
    for i, (name, args, what, call, result) in enumerate(tasks):
        noun = "class" if name[0].isupper() else "function"
        out.append(templates["mbpp"].format(python="python " if i % 2 else "", noun=noun, what=what))
        doc = templates["docstring"].format(What=what[0].upper() + what[1:], call=call, result=result)
        if noun == "class":  # the example is a few statements on one doctest line
            stub = templates["class_stub"].format(name=name, doc=doc, args=", " * bool(args) + args)
        else:
            stub = templates["function_stub"].format(name=name, args=args, doc=doc)
        out.append(HUMANEVAL_WRAP.format(prompt=stub))
        if i % 2:
            *setup, last = call.split("; ") if noun == "class" else [call]
            test = "\n".join(setup + [templates["assert"].format(call=last, result=result)])
            out.append(templates["with_test"].format(noun=noun, what=what, test=test))
        else:
            signature = name if noun == "class" else f"{name}({args})"
            out.append(templates["typed"].format(noun=noun, signature=signature, what=what,
                                                 cost=templates["cost"][noun]))
    return out


def _math_prompts(n: int, rng: random.Random) -> list[str]:
    """Competition-style problems with LaTeX (random numbers in math.json's templates), in the MATH-500 format."""
    data = _load("math")
    env = _maker_env({}, rng)
    return _unique(lambda: _make(data["makers"], env) + GSM8K_SUFFIX, n)


def _talk_prompts(n: int, rng: random.Random) -> list[str]:
    """Open-ended chat in MT-Bench's categories (writing, roleplay, reasoning, extraction, STEM,
    humanities, advice), from talk.json's templates and word lists."""
    data = _load("talk")
    env = _maker_env(data["words"], rng)
    return _unique(lambda: _make(data["makers"], env), n)


def _talk2_prompts(n: int, rng: random.Random) -> list[str]:
    """More open-ended chat in MT-Bench's eight categories (writing, roleplay, reasoning, math, coding,
    extraction, STEM, humanities) from talk2.json: a category is drawn, then one of its templates."""
    data = _load("talk2")
    env = _maker_env(data["words"], rng)
    categories = list(data["makers"].values())
    return _unique(lambda: _make(categories, env), n)


def _documented_names() -> list[tuple[str, str]]:
    """(qualified name, docstring) of the public functions and classes of DOC_MODULES, in a fixed order."""
    import importlib
    import warnings

    out = []
    for mod_name in DOC_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # a trimmed interpreter may lack one (sqlite3, ...)
            continue
        for attr in sorted(vars(mod)):
            with warnings.catch_warnings():  # typing.io and the like warn when touched
                warnings.simplefilter("ignore", DeprecationWarning)
                obj = getattr(mod, attr)
                doc = inspect.getdoc(obj) or ""
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            if getattr(obj, "__module__", mod_name) not in (mod_name, None) and not mod_name.startswith("os"):
                continue  # re-exported from elsewhere
            if len(doc) < 60:
                continue
            paras = doc.split("\n\n")
            text = paras[0]
            for para in paras[1:]:
                if len(text) + len(para) > 700:
                    break
                text += "\n\n" + para
            out.append((f"{mod_name}.{attr}", text[:900]))
    return out


def _docs_prompts(n: int, rng: random.Random) -> list[str]:
    """Requests about the documentation of installed code: explain, summarize, rewrite, use this API (docs.json's
    asks, where {name} is the documented object, {doc} its docstring's first paragraphs, {other} a sibling)."""
    named = _documented_names()
    if not named:
        return []
    asks = _load("docs")["asks"]

    def make():
        name, doc = rng.choice(named)
        mod = name.rsplit(".", 1)[0]
        siblings = [m for m, _ in named if m.rsplit(".", 1)[0] == mod and m != name] or [m for m, _ in named]
        return rng.choice(asks).format(name=name, doc=doc, other=rng.choice(siblings))
    return _unique(make, n)


# --------------------------------------------------------------------------- filtering and the chat template

def normalized_words(text: str) -> frozenset[str]:
    """Lower-case word set, for near-duplicate checks."""
    return frozenset(re.findall(r"[a-z0-9]+", text.lower()))


def near_duplicate(a: frozenset, b: frozenset, threshold: float = 0.6) -> bool:
    """Jaccard overlap of two word sets at or above the threshold."""
    return bool(a and b) and len(a & b) / len(a | b) >= threshold


def evaluation_texts(data_dir: str) -> list[str]:
    """Every evaluation prompt: GSM8K test, MATH-500, HumanEval, MBPP test (11-510), MT-Bench turns, and our own
    held-out chat set (`bench --tasks chat-heldout`). Generated training prompts are filtered against these."""
    import gzip

    root = Path(data_dir)
    out = [json.loads(line)["question"] for line in open(root / "gsm8k" / "test.jsonl")]
    out += [json.loads(line)["question"] for line in open(root / "math500" / "test.jsonl")]
    out += [json.loads(line)["prompt"] for line in gzip.open(root / "humaneval" / "HumanEval.jsonl.gz", "rt")]
    rows = json.loads((root / "mbpp" / "sanitized-mbpp.json").read_text())
    out += [r["prompt"] for r in rows if 11 <= r["task_id"] <= 510]
    for line in open(root / "mt_bench" / "question.jsonl"):
        out += json.loads(line)["turns"]
    out += [h for h in (Path(__file__).parent / "heldout" / "chat.txt").read_text().splitlines() if h.strip()]
    return out


def filter_generated(candidates: list[str], data_dir: str, threshold: float = 0.6) -> list[str]:
    """Keep generated prompts that are neither near-duplicates of an earlier kept one nor of any evaluation
    prompt (word-set Jaccard >= threshold, or one contains the other's first 60 characters)."""
    evals = evaluation_texts(data_dir)
    eval_words = [normalized_words(e) for e in evals]
    eval_heads = [e.strip()[:60].lower() for e in evals]
    kept, kept_words = [], []
    for c in candidates:
        w = normalized_words(c)
        low = c.lower()
        if any(near_duplicate(w, k, threshold) for k in kept_words):
            continue
        if any(h in low for h in eval_heads) or any(near_duplicate(w, e, threshold) for e in eval_words):
            continue
        kept.append(c)
        kept_words.append(w)
    return kept


PROMPT_SOURCES = ("gsm8k", "mbpp", "chat", "math", "code", "talk", "code2", "talk2", "docs")


def training_prompts(data_dir: str, sources=("gsm8k", "mbpp", "chat"), seed: int = 0,
                     num_math: int = 1000, num_talk: int = 1000, num_docs: int = 1000) -> list[str]:
    """Training prompts only: GSM8K train, MBPP train/validation/prompt splits, generated chat prompts
    (`chat`, the small set of stages 1-2), the templated sets `math`, `code`, `talk`, and their later
    additions `code2` (more coding tasks with examples), `talk2` (more chat; `num_talk` prompts, as `talk`) and
    `docs` (requests about the docstrings of Python's standard library; `num_docs` prompts). Prompts the target
    writes itself (self-instruct, multi-turn) come from `python -m dflash2.train prompts` and `data --prompts-file`.
    New sources draw from `rng` after the older ones, so adding one never changes the older sources' prompts.

    Evaluation sets (GSM8K test, MATH-500, HumanEval, MBPP test 11-510, MT-Bench) are never read here.
    """
    unknown = set(sources) - set(PROMPT_SOURCES)
    if unknown:
        raise ValueError(f"unknown prompt source(s) {sorted(unknown)}; choose from {', '.join(PROMPT_SOURCES)}")
    root = Path(data_dir)
    rng = random.Random(seed)
    prompts = []
    if "gsm8k" in sources:
        with open(root / "gsm8k" / "train.jsonl") as f:
            prompts += [json.loads(line)["question"] + GSM8K_SUFFIX for line in f]
    if "mbpp" in sources:
        for row in _mbpp_training_rows(data_dir):
            prompts.append(row["prompt"])
            stub = _mbpp_function_stub(row)
            if stub:
                prompts.append(HUMANEVAL_WRAP.format(prompt=stub))
    if "chat" in sources:
        prompts += _general_prompts()
    if "math" in sources:
        prompts += _math_prompts(num_math, rng)
    if "code" in sources:
        prompts += _code_prompts(data_dir)
    if "talk" in sources:
        prompts += _talk_prompts(num_talk, rng)
    if "code2" in sources:
        prompts += _code2_prompts()
    if "talk2" in sources:
        prompts += _talk2_prompts(num_talk, rng)
    if "docs" in sources:
        prompts += _docs_prompts(num_docs, rng)
    return prompts


def encode_prompt(tokenizer, prompt, system: str | None = None, chat: bool = True) -> list[int]:
    """Token ids of a prompt through the target's chat template, with the generation prompt. `prompt` is one user
    turn (a string) or a conversation (a list of {"role", "content"} messages ending with a user turn); system, if
    given, goes first. chat=False: the tokenizer's ids of the raw text (its special tokens included).

    The template is rendered to text and the text tokenized without added special tokens, as transformers does
    for apply_chat_template(tokenize=True); on SmolLM2 the two give the same ids."""
    if not chat:
        if not isinstance(prompt, str):
            raise InputError("a conversation needs the chat template")
        return list(tokenizer(prompt)["input_ids"])
    if not tokenizer.chat_template:
        raise InputError("the target's tokenizer has no chat template; pass --no-chat-template")
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + turns
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


# --- the evaluation prompts (the bench reads them; training never does) ---

# task: (file under --data-dir, hub (path, config, split), the prompt text of one row)
SOURCES = {
    "gsm8k": ("gsm8k/test.jsonl", ("openai/gsm8k", "main", "test"), lambda r: r["question"]),
    # The local copy names the field `question`, the hub `problem`.
    "math500": ("math500/test.jsonl", ("HuggingFaceH4/MATH-500", None, "test"),
                lambda r: r.get("problem", r.get("question"))),
    "humaneval": ("humaneval/HumanEval.jsonl.gz", ("openai/openai_humaneval", None, "test"), lambda r: r["prompt"]),
    "mbpp": ("mbpp/sanitized-mbpp.json", ("google-research-datasets/mbpp", "sanitized", "test"), lambda r: r["prompt"]),
    # MT-Bench: the first turn only. Local rows say `turns`, the hub `prompt`.
    "mt-bench": ("mt_bench/question.jsonl", ("HuggingFaceH4/mt_bench_prompts", None, "train"),
                 lambda r: (r.get("turns") or r["prompt"])[0]),
}
TASKS = tuple(SOURCES)  # the five tasks of the model card, the default
# Prompt sets shipped with the package, one prompt per line; not in the default --tasks, named explicitly.
# chat-heldout: 100 hand-written chat prompts no training source reads (dflash2/heldout/README.md).
PACKAGED = {"chat-heldout": "heldout/chat.txt"}
ALL_TASKS = TASKS + tuple(PACKAGED)


def _read_rows(path):
    if path.suffix == ".json":
        return json.loads(path.read_text())
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def _hub_rows(task):
    hub_path, config, split = SOURCES[task][1]
    try:
        from datasets import load_dataset
    except ImportError:
        raise SystemExit(f"{task}: no local copy under --data-dir and the optional `datasets` package is missing "
                         "(pip install datasets, or point --data-dir at a copy of the data)") from None
    try:
        return list(load_dataset(hub_path, config, split=split))
    except Exception as e:
        raise SystemExit(f"{task}: no local copy under --data-dir and {hub_path} cannot be loaded from the hub: {e}") from e


def load_tasks(tasks, data_dir, num_prompts):
    """{task: the first num_prompts prompt texts}, from data_dir (../shared/data layout) or the hub."""
    out = {}
    for task in tasks:
        if task in PACKAGED:
            lines = (Path(__file__).parent / PACKAGED[task]).read_text(encoding="utf-8").splitlines()
            out[task] = [line for line in lines if line.strip()][:num_prompts]
            continue
        path = Path(data_dir) / SOURCES[task][0]
        rows = _read_rows(path) if path.is_file() else _hub_rows(task)
        if task == "mbpp":  # test split only; the rest may train drafters
            rows = [r for r in rows if 11 <= r["task_id"] <= 510]
        out[task] = [SOURCES[task][2](r) for r in rows[:num_prompts]]
    return out


def format_prompt(task, text):
    """The user turn of SPEC §8 (z-lab/dflash benchmark formats)."""
    if task in ("gsm8k", "math500"):
        return text + GSM8K_SUFFIX
    if task == "humaneval":
        return HUMANEVAL_WRAP.format(prompt=text)
    return text  # mbpp: the problem text as is; mt-bench: the first turn; chat-heldout: the line as typed
