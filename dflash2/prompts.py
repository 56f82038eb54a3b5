"""Prompts: the training sources for self-distillation, the evaluation tasks (load_tasks, format_prompt) and the
one chat encoder (encode_prompt).

`training_prompts(data_dir, sources, seed)` gives the prompts `python -m dflash2.train data` has the target answer.
The synthetic sets are the data files of prompt_data/ (str.format templates, word lists, made-up coding tasks),
written for this project, not taken from any benchmark; `fill` fills a template. No generated prompt is a
near-duplicate of an evaluation prompt (evaluation_screen). The same sources and seed give the same prompts.
"""
import collections
import gzip
import inspect
import json
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
#
# math.json, talk.json and talk2.json hold templates: str.format strings whose {fields} are plain names (a format
# spec such as {b:+d} at most). A field is drawn from the pool of its name: a word list (the file's "words" or the
# template's own) or a range of integers (the template's "numbers": [lo, hi] or [lo, hi, step], both ends in).
# Fields that differ only by a number at the end ({name1}, {name2}) draw different items of the same pool. A value
# worked out from drawn ones (a quadratic's coefficients from its roots) comes from the function the template names
# in "compute": its parameters are fields drawn as above, and it returns more fields.

def monic_quadratic(r, s):
    """x^2 + bx + c = (x - r)(x - s)."""
    return {"b": -(r + s), "c": r * s}


def radicand(root, squarefree):
    return {"radicand": root * root * squarefree}


def remainders(prime1, prime2, r1, r2):
    return {"remainder1": r1 % prime1, "remainder2": r2 % prime2}


def circle(h, k, r):
    """x^2 + dx + y^2 + ey + f = 0 for the circle of centre (h, k) and radius r."""
    return {"d": -2 * h, "e": -2 * k, "f": h * h + k * k - r * r}


def product(small, large):
    return {"n": small * large}


def power(base, exponent):
    return {"power": base**exponent}


def arithmetic_start(first, step):
    return {"second": first + step, "third": first + 2 * step}


def geometric_start(first, ratio):
    return {"second": first * ratio, "third": first * ratio * ratio}


def banknote(notebooks, notebook_price, pens, pen_price):
    """The smallest of a $50 and a $100 note that pays the bill."""
    return {"note": 50 if notebooks * notebook_price + pens * pen_price < 50 else 100}


def years_to_twice(times, younger):
    """In (times - 2) * younger years, someone times as old as younger is twice as old."""
    return {"years": (times - 2) * younger}


def sum_and_product(number1, number2):
    return {"total": number1 + number2, "product": number1 * number2}


def mixture(percent1, percent2, percent3):
    """Three strengths: the target lies between the weak and the strong one."""
    weak, target, strong = sorted((percent1, percent2, percent3))
    return {"weak": weak, "target": target, "strong": strong}


def sequence(start, step, rule):
    """The first five terms of an arithmetic, a geometric or a shifted-square sequence."""
    terms = {"arithmetic": lambda i: start + step * i, "geometric": lambda i: start * step**i,
             "square": lambda i: (start + i) ** 2 + step}[rule]
    return {"terms": ", ".join(str(terms(i)) for i in range(5))}


COMPUTE = {f.__name__: f for f in (monic_quadratic, radicand, remainders, circle, product, power, arithmetic_start,
                                   geometric_start, banknote, years_to_twice, sum_and_product, mixture, sequence)}


def template_fields(template: str) -> list[str]:
    """The field names of a str.format template, each once, in order."""
    return list(dict.fromkeys(name for _, name, _, _ in string.Formatter().parse(template) if name is not None))


def template_pools(template: dict, words: dict) -> dict:
    """The pools a template draws from: the file's word lists, its own, and its ranges of integers."""
    numbers = {name: range(lo, hi + 1, *step) for name, (lo, hi, *step) in template.get("numbers", {}).items()}
    return {**words, **template.get("words", {}), **numbers}


def fill(template, words: dict, rng: random.Random) -> str:
    """One prompt from a template of a prompt_data file: a string, or {"text": a string or a list of them, of which
    one is drawn; optional "words", "numbers" and "compute"}."""
    template = {"text": template} if isinstance(template, str) else template
    text = template["text"] if isinstance(template["text"], str) else rng.choice(template["text"])
    pools, used = template_pools(template, words), {}

    def draw(field):
        pool = field.rstrip(string.digits)
        taken = used.setdefault(pool, set())
        if len(taken) == len(pools[pool]):
            raise ValueError(f"{field}: every item of the pool {pool!r} is taken")
        while (item := rng.choice(pools[pool])) in taken:
            pass
        taken.add(item)
        return item

    values = {}
    if "compute" in template:
        compute = COMPUTE[template["compute"]]
        values = {name: draw(name) for name in inspect.signature(compute).parameters}
        values.update(compute(**values))
    for field in template_fields(text):
        if field not in values:
            values[field] = draw(field)
    return text.format(**values)


def _unique(make, n: int, near, tries: int = 20) -> list[str]:
    """Up to n distinct prompts from a random generator, none near an evaluation prompt (n * tries draws at most)."""
    kept, seen = [], set()
    for _ in range(n * tries):
        prompt = make()
        if prompt not in seen and not near(prompt):
            kept.append(prompt)
        seen.add(prompt)
        if len(kept) == n:
            break
    return kept


def _templated(name: str, n: int, rng: random.Random, near) -> list[str]:
    """n prompts from a file of templates: one drawn uniformly (within a category drawn uniformly), then filled."""
    data = _load(name)
    groups = list(data["templates"].values()) if isinstance(data["templates"], dict) else [data["templates"]]
    return _unique(lambda: fill(rng.choice(rng.choice(groups)), data.get("words", {}), rng), n, near)


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
            if attr.startswith("_") or len(doc) < 60 or not (
                    inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            if getattr(obj, "__module__", mod_name) not in (mod_name, None) and not mod_name.startswith("os"):
                continue  # re-exported from elsewhere
            paras = doc.split("\n\n")
            text = paras[0]
            for para in paras[1:]:
                if len(text) + len(para) > 700:
                    break
                text += "\n\n" + para
            out.append((f"{mod_name}.{attr}", text[:900]))
    return out


def _docs_prompts(n: int, rng: random.Random, near) -> list[str]:
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
    return _unique(make, n, near)


# --------------------------------------------------------------------------- filtering and the chat template

def normalized_words(text: str) -> frozenset[str]:
    """Lower-case word set, for near-duplicate checks."""
    return frozenset(re.findall(r"[a-z0-9]+", text.lower()))


def near_duplicate(a: frozenset, b: frozenset, threshold: float = 0.6) -> bool:
    """Jaccard overlap of two word sets at or above the threshold."""
    shared = len(a & b)
    return bool(a and b) and shared / (len(a) + len(b) - shared) >= threshold


def evaluation_texts(data_dir: str) -> list[str]:
    """Every evaluation prompt: GSM8K test, MATH-500, HumanEval, MBPP test (11-510), MT-Bench turns, and our own
    held-out chat set (`bench --tasks chat-heldout`). Generated training prompts are filtered against these."""
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


def evaluation_screen(data_dir: str, threshold: float = 0.6):
    """near(text): whether a text is a near-duplicate of an evaluation prompt: word-set Jaccard >= threshold, or it
    contains the prompt's first 60 characters. A text meets only the few prompts an index finds:

    - Jaccard (prefix filtering): order every word set rarest word first (by how many evaluation prompts hold it);
      two sets with Jaccard >= t share at least t * len words of each, so their rarest common word is among the
      first len - ceil(t * len) + 1 words of both. Prompts are indexed under those words of theirs;
    - heads: indexed under their first k characters, looked up at each position of the text."""
    evals = evaluation_texts(data_dir)
    sets = [normalized_words(e) for e in evals]
    holders = collections.Counter(w for words in sets for w in words)

    def rarest(words):
        return sorted(words, key=lambda w: (holders[w], w))[: len(words) - int(threshold * len(words)) + 1]

    index, heads = collections.defaultdict(list), collections.defaultdict(list)
    for i, words in enumerate(sets):
        for w in rarest(words):
            index[w].append(i)
    starts = {h for h in (e.strip()[:60].lower() for e in evals) if h}
    k = min([8, *map(len, starts)])
    for head in starts:
        heads[head[:k]].append(head)

    def near(text: str) -> bool:
        low, words = text.lower(), normalized_words(text)
        found = {i for w in rarest(words) for i in index.get(w, ())}
        return (any(low.startswith(h, i) for i in range(len(low)) for h in heads.get(low[i:i + k], ()))
                or any(near_duplicate(words, sets[i], threshold) for i in found))
    return near


def filter_generated(candidates: list[str], data_dir: str, threshold: float = 0.6) -> list[str]:
    """Keep generated prompts that are neither near-duplicates of an earlier kept one (word-set Jaccard >= threshold)
    nor of any evaluation prompt (evaluation_screen)."""
    near = evaluation_screen(data_dir, threshold)
    kept, kept_words = [], []
    for c in candidates:
        w = normalized_words(c)
        if any(near_duplicate(w, k, threshold) for k in kept_words) or near(c):
            continue
        kept.append(c)
        kept_words.append(w)
    return kept


PROMPT_SOURCES = ("gsm8k", "mbpp", "chat", "math", "code", "talk", "code2", "talk2", "docs")
GENERATED = PROMPT_SOURCES[2:]  # written for this project: screened against the evaluation prompts


def training_prompts(data_dir: str, sources=("gsm8k", "mbpp", "chat"), seed: int = 0,
                     num_math: int = 1000, num_talk: int = 1000, num_docs: int = 1000) -> list[str]:
    """Training prompts only: GSM8K train, MBPP train/validation/prompt splits, generated chat prompts
    (`chat`, the small set of stages 1-2), the templated sets `math`, `code`, `talk`, and their later
    additions `code2` (more coding tasks with examples), `talk2` (more chat; `num_talk` prompts, as `talk`) and
    `docs` (requests about the docstrings of Python's standard library; `num_docs` prompts). Prompts the target
    writes itself (self-instruct, multi-turn) come from `python -m dflash2.train prompts` and `data --prompts-file`.
    New sources draw from `rng` after the older ones, so adding one never changes the older sources' prompts.

    The evaluation sets (GSM8K test, MATH-500, HumanEval, MBPP test 11-510, MT-Bench, held-out chat) are read only
    to drop every generated prompt that is a near-duplicate of one of theirs (evaluation_screen).
    """
    unknown = set(sources) - set(PROMPT_SOURCES)
    if unknown:
        raise ValueError(f"unknown prompt source(s) {sorted(unknown)}; choose from {', '.join(PROMPT_SOURCES)}")
    root = Path(data_dir)
    rng = random.Random(seed)
    near = evaluation_screen(data_dir) if set(sources) & set(GENERATED) else None
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
        prompts += [p for p in _general_prompts() if not near(p)]
    if "math" in sources:  # the problem is screened, then given the benchmark's suffix
        prompts += [p + GSM8K_SUFFIX for p in _templated("math", num_math, rng, near)]
    if "code" in sources:
        prompts += [p for p in _code_prompts(data_dir) if not near(p)]
    if "talk" in sources:
        prompts += _templated("talk", num_talk, rng, near)
    if "code2" in sources:
        prompts += [p for p in _code2_prompts() if not near(p)]
    if "talk2" in sources:
        prompts += _templated("talk2", num_talk, rng, near)
    if "docs" in sources:
        prompts += _docs_prompts(num_docs, rng, near)
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
