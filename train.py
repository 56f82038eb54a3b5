"""Train a DFlash 2 drafter for a target model by self-distillation.

    python train.py data  --data-dir ../shared/data --out runs/smollm2      # target writes its own responses
    python train.py train --out runs/smollm2 --steps 2000                   # fit the drafter on them

Data: the target answers training prompts greedily; we keep the token ids and the
target's tapped hidden states (the drafter's context features), so training never
runs the target again. Loss (SPEC §6): position-decayed cross-entropy over the draft
slots plus the selector's cross-entropy over its K candidates.
"""
import argparse
import gzip
import itertools
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from model import DFlash2Config, DFlash2Drafter, load_target, stop_token_ids

GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_WRAP = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"

# --------------------------------------------------------------------------- data

def _mbpp_function_stub(row) -> str | None:
    """HumanEval-shaped prompt from an MBPP row: its first `def` line plus the task as docstring."""
    for line in row["code"].splitlines():
        if line.startswith("def "):
            return f'{line.rstrip()}\n    """ {row["prompt"].strip()}\n    """\n'
    return None


def _mbpp_training_rows(data_dir: str) -> list[dict]:
    """MBPP rows outside the test split (task ids 11-510), minus any whose text repeats a test task
    (row 569 duplicates test task 104 word for word)."""
    rows = json.loads((Path(data_dir) / "mbpp" / "sanitized-mbpp.json").read_text())
    test = {r["prompt"].strip() for r in rows if 11 <= r["task_id"] <= 510}
    return [r for r in rows if not 11 <= r["task_id"] <= 510 and r["prompt"].strip() not in test]


def _general_prompts() -> list[str]:
    """Open-ended chat prompts made up here (no benchmark text), for MT-Bench-like replies."""
    kinds = ["a short story", "a poem", "a blog post", "a product description", "an email to a colleague",
             "a speech", "a short essay", "a dialogue", "a list of tips", "a news summary"]
    topics = ["the ocean", "learning a new language", "a rainy day in the city", "climate change",
              "a robot that learns to paint", "healthy breakfast habits", "the history of the bicycle",
              "working from home", "a trip to the mountains", "saving money", "friendship", "space travel",
              "the importance of sleep", "a small bakery", "electric cars", "time management"]
    asks = ["Explain {t} to a ten-year-old.", "What are the pros and cons of {t}?",
            "Give me three interesting facts about {t}.", "How would you describe {t} in one paragraph?"]
    concepts = ["photosynthesis", "inflation", "machine learning", "gravity", "the water cycle", "democracy",
                "recursion in programming", "supply and demand", "vaccines", "the internet", "black holes",
                "compound interest", "a hash table", "plate tectonics", "the French revolution", "prime numbers"]
    out = [f"Write {k} about {t}." for k in kinds for t in topics]
    out += [a.format(t=c) for a in asks for c in concepts]
    return out


def _unique(make, n: int, tries: int = 20) -> list[str]:
    """Up to n distinct prompts from a random generator (stops after n * tries draws)."""
    seen = {}
    for _ in range(n * tries):
        seen.setdefault(make(), None)
        if len(seen) == n:
            break
    return list(seen)


def _math_prompts(n: int, rng: random.Random) -> list[str]:
    """Competition-style problems with LaTeX (random numbers in fixed templates), in the MATH-500 format."""
    def quadratic():
        r, s = rng.randint(-9, 9), rng.randint(-9, 9)
        return f"Find the sum of all solutions of $x^2 {-(r + s):+d}x {r * s:+d} = 0$."
    def linear():
        a, c = rng.sample(range(2, 12), 2)
        return f"Solve for $x$: ${a}x {rng.randint(-20, 20):+d} = {c}x {rng.randint(-20, 20):+d}$."
    def sqrt():
        return f"Simplify $\\sqrt{{{rng.randint(2, 12) ** 2 * rng.choice([2, 3, 5, 6, 7])}}}$."
    def marbles():
        r, b = rng.randint(2, 9), rng.randint(2, 9)
        return (f"A bag holds {r} red marbles and {b} blue marbles. Two marbles are drawn at random without "
                f"replacement. What is the probability that both are red? Express your answer as a common fraction.")
    def compose():
        a, b, c, d, k = (rng.choice([-1, 1]) * rng.randint(2, 6) for _ in range(5))
        return f"Let $f(x) = {a}x {b:+d}$ and $g(x) = {c}x^2 {d:+d}$. What is $f(g({k}))$?"
    def crt():
        m1, m2 = rng.choice([(3, 5), (4, 7), (5, 6), (7, 9), (8, 11)])
        return (f"What is the smallest positive integer that leaves a remainder of {rng.randrange(m1)} when divided "
                f"by {m1} and a remainder of {rng.randrange(m2)} when divided by {m2}?")
    def circle():
        h, k, r = rng.randint(-7, 7), rng.randint(-7, 7), rng.randint(1, 9)
        return f"Find the radius of the circle with equation $x^2 {-2 * h:+d}x + y^2 {-2 * k:+d}y {h * h + k * k - r * r:+d} = 0$."
    templates = [
        quadratic, linear, sqrt, marbles, compose, crt, circle,
        lambda: f"What is the remainder when ${rng.randint(2, 13)}^{{{rng.randint(20, 300)}}}$ is divided by {rng.randint(3, 13)}?",
        lambda: f"How many positive divisors does ${rng.choice([2, 3, 4, 6, 8, 12]) * rng.choice([5, 9, 10, 15, 25, 30, 49])}$ have?",
        lambda: f"Compute $\\dbinom{{{(n := rng.randint(5, 20))}}}{{{rng.randint(2, min(6, n - 1))}}}$.",
        lambda: f"What is the greatest common divisor of ${rng.randint(12, 999)}$ and ${rng.randint(12, 999)}$?",
        lambda: f"What is the least common multiple of ${rng.randint(4, 60)}$ and ${rng.randint(4, 60)}$?",
        lambda: f"What is the units digit of ${rng.randint(2, 29)}^{{{rng.randint(10, 2025)}}}$?",
        lambda: f"Evaluate $\\log_{{{(b := rng.choice([2, 3, 4, 5, 10]))}}} {b ** rng.randint(2, 6)}$.",
        lambda: f"What is the slope of the line through $({rng.randint(-9, 9)}, {rng.randint(-9, 9)})$ and $({rng.randint(10, 19)}, {rng.randint(-9, 9)})$?",
        lambda: f"Find the distance between the points $({rng.randint(-9, 9)}, {rng.randint(-9, 9)})$ and $({rng.randint(-9, 9)}, {rng.randint(-9, 9)})$.",
        lambda: f"What is the sum of the first ${rng.randint(10, 60)}$ terms of the arithmetic sequence ${(a := rng.randint(-5, 9))}, {a + (d := rng.randint(2, 7))}, {a + 2 * d}, \\ldots$?",
        lambda: f"In how many ways can the letters of the word {rng.choice(['MATH', 'ALGEBRA', 'BANANA', 'CIRCLE', 'PRIME', 'LEVEL', 'NUMBER', 'COOKIE'])} be arranged?",
        lambda: f"What is the measure, in degrees, of each interior angle of a regular polygon with ${rng.randint(5, 20)}$ sides?",
        lambda: f"Convert ${rng.randint(20, 999)}_{{10}}$ to base ${rng.randint(2, 9)}$.",
        lambda: f"If $x + \\frac{{1}}{{x}} = {rng.randint(2, 9)}$, what is the value of $x^2 + \\frac{{1}}{{x^2}}$?",
        lambda: f"Find the vertex of the parabola $y = {rng.randint(1, 5)}x^2 {rng.randint(-12, 12):+d}x {rng.randint(-9, 9):+d}$.",
        lambda: f"How many integers between ${rng.randint(1, 50)}$ and ${rng.randint(100, 999)}$ are multiples of ${rng.randint(3, 17)}$?",
        lambda: f"Compute $i^{{{rng.randint(5, 999)}}} + i^{{{rng.randint(5, 999)}}}$, where $i^2 = -1$.",
        lambda: f"The sum of two numbers is ${rng.randint(30, 99)}$ and their difference is ${rng.randint(2, 29)}$. What is the larger number?",
        lambda: f"Find the area of the triangle with vertices $(0, 0)$, $({rng.randint(1, 12)}, {rng.randint(0, 9)})$ and $({rng.randint(-9, 9)}, {rng.randint(1, 12)})$.",
        lambda: f"Expand and simplify $({rng.randint(2, 5)}x {rng.choice([-1, 1]) * rng.randint(1, 9):+d})({rng.randint(2, 5)}x {rng.choice([-1, 1]) * rng.randint(1, 9):+d})$.",
        lambda: f"For what value of $k$ does the equation $x^2 + kx + {rng.randint(1, 12) ** 2} = 0$ have exactly one solution with $k > 0$?",
        lambda: f"What is the sum of the digits of the product ${rng.randint(11, 99)} \\times {rng.randint(11, 99)}$?",
        lambda: f"Simplify $\\frac{{{rng.randint(2, 30)}}}{{{rng.randint(31, 90)}}} + \\frac{{{rng.randint(1, 9)}}}{{{rng.randint(10, 30)}}}$.",
        lambda: f"A geometric sequence starts ${(a := rng.randint(1, 6))}, {a * (q := rng.randint(2, 4))}, {a * q * q}, \\ldots$. What is its ${rng.randint(6, 12)}$th term?",
        lambda: f"What is the probability of rolling a sum of ${rng.randint(3, 11)}$ with two fair six-sided dice? Express your answer as a common fraction.",
        lambda: f"If ${rng.randint(2, 9)}^{{x}} = {rng.choice([8, 16, 27, 32, 64, 81, 125, 243])}$, what is $x$? Express your answer in simplest form.",
        lambda: f"Find all real $x$ such that $|{rng.randint(1, 5)}x {rng.randint(-9, 9):+d}| = {rng.randint(1, 20)}$.",
    ]
    return _unique(lambda: rng.choice(templates)() + GSM8K_SUFFIX, n)


_CODE_TASKS = [  # (function name, arguments, what it does): made up here, not from any benchmark
    ("reverse_words", "s", "reverse the order of the words in a sentence"),
    ("is_palindrome", "s", "check whether a string is a palindrome, ignoring case and spaces"),
    ("count_vowels", "s", "count the vowels in a string"),
    ("flatten", "nested", "flatten an arbitrarily nested list of integers"),
    ("running_sum", "nums", "return the running sums of a list of numbers"),
    ("second_largest", "nums", "return the second largest distinct number in a list, or None"),
    ("merge_sorted", "a, b", "merge two sorted lists into one sorted list"),
    ("chunk", "items, size", "split a list into chunks of a given size"),
    ("word_frequencies", "text", "return a dictionary mapping each word in a text to its count"),
    ("is_anagram", "a, b", "check whether two strings are anagrams of each other"),
    ("fizzbuzz", "n", "return the FizzBuzz sequence from 1 to n as a list of strings"),
    ("gcd", "a, b", "compute the greatest common divisor of two integers"),
    ("is_prime", "n", "check whether an integer is prime"),
    ("primes_below", "n", "return all prime numbers less than n"),
    ("fibonacci", "n", "return the n-th Fibonacci number"),
    ("binary_search", "items, target", "return the index of target in a sorted list, or -1"),
    ("rotate", "items, k", "rotate a list to the right by k positions"),
    ("dedupe", "items", "remove duplicates from a list while keeping the original order"),
    ("capitalize_words", "s", "capitalize the first letter of every word in a string"),
    ("digit_sum", "n", "return the sum of the digits of a non-negative integer"),
    ("to_binary", "n", "convert a non-negative integer to its binary representation as a string"),
    ("matrix_transpose", "m", "transpose a matrix given as a list of lists"),
    ("longest_common_prefix", "words", "return the longest common prefix of a list of strings"),
    ("balanced_brackets", "s", "check whether the brackets (), [] and {} in a string are balanced"),
    ("roman_to_int", "s", "convert a Roman numeral to an integer"),
    ("int_to_roman", "n", "convert an integer between 1 and 3999 to a Roman numeral"),
    ("count_islands", "grid", "count the islands of 1s in a 2D grid of 0s and 1s"),
    ("max_subarray", "nums", "return the largest sum of a contiguous sub-list"),
    ("two_sum", "nums, target", "return the indices of two numbers that add up to target"),
    ("pairwise_diffs", "nums", "return the differences between consecutive elements of a list"),
    ("median", "nums", "return the median of a list of numbers"),
    ("mode", "nums", "return the most common element of a list"),
    ("caesar_cipher", "text, shift", "shift every letter of a text by a fixed amount, wrapping around the alphabet"),
    ("compress", "s", "run-length encode a string, e.g. 'aaabb' becomes 'a3b2'"),
    ("is_sorted", "items", "check whether a list is sorted in non-decreasing order"),
    ("factorial", "n", "compute n factorial"),
    ("power_set", "items", "return all subsets of a list"),
    ("permutations", "s", "return all permutations of a string"),
    ("celsius_to_fahrenheit", "c", "convert a temperature from Celsius to Fahrenheit"),
    ("leap_year", "year", "check whether a year is a leap year"),
    ("count_words_longer", "text, n", "count the words in a text that are longer than n characters"),
    ("common_elements", "a, b", "return the elements that appear in both lists"),
    ("nth_largest", "nums, n", "return the n-th largest element of a list"),
    ("snake_to_camel", "name", "convert a snake_case identifier to camelCase"),
    ("camel_to_snake", "name", "convert a camelCase identifier to snake_case"),
    ("valid_email", "s", "check whether a string looks like a valid email address"),
    ("sum_of_squares", "n", "return the sum of the squares of the integers from 1 to n"),
    ("triangle_area", "a, b, c", "return the area of a triangle given its three side lengths"),
    ("group_by_length", "words", "group words into a dictionary keyed by word length"),
    ("interleave", "a, b", "interleave the elements of two lists"),
    ("zigzag", "nums", "reorder a list so that it alternates between smaller and larger values"),
    ("count_bits", "n", "count the set bits in the binary form of an integer"),
    ("unique_chars", "s", "check whether all characters of a string are distinct"),
    ("matrix_multiply", "a, b", "multiply two matrices given as lists of lists"),
    ("dict_invert", "d", "swap the keys and values of a dictionary"),
    ("clamp", "x, lo, hi", "clamp a number to the range [lo, hi]"),
    ("parse_csv_line", "line", "split one line of CSV into fields, honouring double quotes"),
    ("days_between", "d1, d2", "return the number of days between two dates given as 'YYYY-MM-DD' strings"),
    ("moving_average", "nums, k", "return the moving averages of a list over windows of size k"),
    ("spiral_order", "m", "return the elements of a matrix in spiral order"),
]


def _code_prompts(data_dir: str) -> list[str]:
    """Coding prompts in the MBPP and HumanEval shapes for the tasks above, plus 'explain this code' for
    MBPP's training rows (their reference solutions, never the test split)."""
    out = []
    for name, args, what in _CODE_TASKS:
        out.append(f"Write a python function to {what}.")
        out.append(f"Write a function `{name}({args})` that {what}. Include a docstring and an example.")
        stub = f'def {name}({args}):\n    """ {what[0].upper() + what[1:]}.\n    """\n'
        out.append(HUMANEVAL_WRAP.format(prompt=stub))
    for name, args, what in _CODE_TASKS[::2]:
        out.append(f"Write unit tests with pytest for a function `{name}({args})` that should {what}.")
    for row in _mbpp_training_rows(data_dir):
        out.append(f"Explain what the following Python code does, step by step:\n```python\n{row['code'].strip()}\n```")
    return out


def _talk_prompts(n: int, rng: random.Random) -> list[str]:
    """Open-ended chat in MT-Bench's categories (writing, roleplay, reasoning, extraction, STEM,
    humanities, advice), built from templates and word lists made up here."""
    topics = ["a city at night", "an old lighthouse", "the first day at a new job", "a lost dog finding home",
              "a village festival", "a summer storm", "the last bookshop in town", "a journey by train",
              "a chess tournament", "a garden in winter", "an unexpected letter", "a kitchen experiment",
              "renewable energy", "remote islands", "artificial intelligence in schools", "urban cycling",
              "a museum of forgotten inventions", "coffee culture", "volunteering", "a marathon"]
    kinds = ["a persuasive essay", "a haiku sequence", "a limerick", "a short mystery story", "a travel blog post",
             "a cover letter", "a product review", "a motivational speech", "a diary entry", "a press release",
             "a fable with a moral", "a formal complaint letter", "a song chorus", "a two-paragraph summary"]
    constraints = ["", " Keep it under 150 words.", " Use a humorous tone.", " Write it for teenagers.",
                   " Start every sentence with a different letter.", " Use a formal tone.", " End with a question."]
    roles = ["a pirate captain", "a medieval knight", "a detective from the 1920s", "a friendly tour guide in Rome",
             "a strict chess coach", "a nutritionist", "a startup founder pitching to investors", "an astronaut on Mars",
             "a museum curator", "a stand-up comedian", "a wise old librarian", "a car mechanic"]
    role_asks = ["Introduce yourself and describe a typical day.", "Give me advice on starting a new hobby.",
                 "Explain why I should visit your favourite place.", "Tell me about the hardest problem you solved.",
                 "Answer my question: what makes a good leader?"]
    concepts = ["entropy", "natural selection", "the Pythagorean theorem", "opportunity cost", "quantum entanglement",
                "the greenhouse effect", "neural networks", "the Renaissance", "the Cold War", "stoicism",
                "the scientific method", "cognitive dissonance", "the separation of powers", "CRISPR gene editing",
                "the Silk Road", "public key cryptography", "the placebo effect", "Keynesian economics",
                "impressionist painting", "the theory of relativity", "game theory", "the nitrogen cycle",
                "existentialism", "the Industrial Revolution", "blockchains", "sorting algorithms"]
    concept_asks = ["Explain {c} in simple terms.", "What are common misconceptions about {c}?",
                    "Describe the history of {c} in a few paragraphs.", "How does {c} affect everyday life?",
                    "Give an example that illustrates {c}, then explain it.", "Write a short lesson plan about {c}."]
    goals = ["sleep better", "learn to cook", "manage stress at work", "save for a house", "improve my public speaking",
             "learn a programming language", "become a better listener", "run my first 10 km", "read more books",
             "organise a small wedding", "negotiate a higher salary", "keep houseplants alive"]
    pairs = [("cats", "dogs as pets"), ("Python", "JavaScript"), ("solar", "wind power"), ("renting", "buying a home"),
             ("e-books", "paper books"), ("trains", "planes for travel in Europe"), ("tea", "coffee"),
             ("remote", "office work"), ("capitalism", "socialism"), ("classical", "operant conditioning")]
    people = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana"]
    def reasoning():
        a, b, c = rng.sample(people, 3)
        return rng.choice([
            f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
            f"If {a} has twice as many books as {b}, and together they have {3 * rng.randint(4, 30)}, how many does {a} have?",
            f"{a}, {b} and {c} each own one pet: a cat, a fish or a parrot. {a} does not own the cat, and {b} owns "
            f"the parrot. Who owns the fish?",
            f"A train leaves at {rng.randint(1, 11)}:{rng.choice(['00', '15', '30', '45'])} and the trip takes "
            f"{rng.randint(2, 9)} hours and {rng.randint(5, 55)} minutes. When does it arrive?"])
    def extraction():
        rows = [(rng.choice(people), rng.randint(21, 65), rng.choice(["Paris", "Lagos", "Osaka", "Lima", "Oslo"]))
                for _ in range(3)]
        text = " ".join(f"{p} is {y} years old and lives in {c}." for p, y, c in rows)
        return rng.choice([f"Extract the names and ages from this text as JSON: {text}",
                           f"From the following text, list every city mentioned in alphabetical order: {text}",
                           f"Summarise this text in one sentence: {text}"])
    makers = [
        lambda: f"Write {rng.choice(kinds)} about {rng.choice(topics)}.{rng.choice(constraints)}",
        lambda: f"Pretend you are {rng.choice(roles)}. {rng.choice(role_asks)}",
        lambda: rng.choice(concept_asks).format(c=rng.choice(concepts)),
        lambda: f"How can I {rng.choice(goals)}? Give me a practical plan.",
        lambda: "Compare {} and {}. Which would you recommend, and why?".format(*rng.choice(pairs)),
        reasoning, extraction,
    ]
    return _unique(lambda: rng.choice(makers)(), n)


PROMPT_SOURCES = ("gsm8k", "mbpp", "chat", "math", "code", "talk")


def training_prompts(data_dir: str, sources=("gsm8k", "mbpp", "chat"), seed: int = 0,
                     num_math: int = 1000, num_talk: int = 1000) -> list[str]:
    """Training prompts only: GSM8K train, MBPP train/validation/prompt splits, generated chat prompts
    (`chat`, the small set of stages 1-2), and the templated sets `math`, `code`, `talk`.

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
    return prompts


def chat_ids(tokenizer, prompt: str, system: str | None = None) -> list[int]:
    """Token ids of one user turn through the target's chat template, with the generation prompt."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return list(ids)


@torch.no_grad()
def generate_with_features(model, prompts: list[list[int]], taps: list[int], max_new_tokens: int,
                           stop_ids: set[int], pad_id: int):
    """Greedy batched generation (left padded) that also returns the tapped hidden states of every
    token fed to the target: features[i] is [len_i - 1, n*H] for sequence i (the last token is never fed)."""
    from transformers import DynamicCache
    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    cache = DynamicCache()
    seqs = [list(p) for p in prompts]
    feats = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    inp, pos = ids, (mask.cumsum(-1) - 1).clamp(min=0)
    for _ in range(max_new_tokens):
        out = model(input_ids=inp, attention_mask=mask, position_ids=pos, cache=cache,
                    use_cache=True, output_hidden_states=True)
        tapped = torch.cat([out.hidden_states[l + 1] for l in taps], dim=-1).to(torch.bfloat16)
        nxt = out.logits[:, -1].argmax(-1)
        for i in range(b):
            if done[i]:
                continue
            row = tapped[i, -inp.shape[1]:]
            feats[i].append(row[mask[i, -inp.shape[1]:].bool()] if inp.shape[1] > 1 else row)
            seqs[i].append(int(nxt[i]))
            if int(nxt[i]) in stop_ids:
                done[i] = True
        if done.all():
            break
        inp = nxt[:, None]
        pos = pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
    return [(torch.tensor(s), torch.cat(f)) for s, f in zip(seqs, feats)]


def make_data(args):
    model, tok = load_target(args.target, dtype=getattr(torch, args.dtype))
    taps = [int(t) for t in args.taps.split(",")]
    out = Path(args.out) / "data"
    out.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(args.data_dir, sources=args.sources.split(","), seed=args.seed)
    random.Random(args.seed).shuffle(prompts)
    prompts = prompts[: args.max_prompts]
    encoded = [chat_ids(tok, p) for p in prompts]
    stop = set(stop_token_ids(model, tok))
    meta = {"target": args.target, "taps": taps, "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts)}
    (out / "meta.json").write_text(json.dumps(meta))
    shards = [list(range(i, min(i + args.batch_size, len(encoded)))) for i in range(0, len(encoded), args.batch_size)]
    torch.set_num_threads(args.threads)
    for k, idx in enumerate(tqdm(shards, desc="self-distillation")):
        path = out / f"shard_{k:05d}.pt"
        if path.exists():
            continue  # resumable
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        rows = generate_with_features(model, [encoded[i] for i in idx], taps, args.max_new_tokens, stop, pad)
        torch.save({"ids": [r[0] for r in rows], "features": [r[1] for r in rows],
                    "prompt_lens": [len(encoded[i]) for i in idx]}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)



# --------------------------------------------------------------------------- training

def load_shards(data_dir: Path):
    """All self-distilled sequences: (token ids [L], features [L-1, n*H] bf16, prompt length)."""
    seqs = []
    for path in sorted(Path(data_dir).glob("shard_*.pt")):
        shard = torch.load(path)
        seqs += [(i, f, p) for i, f, p in zip(shard["ids"], shard["features"], shard["prompt_lens"])
                 if len(i) >= p + 2]
    if not seqs:
        raise FileNotFoundError(f"no training shards in {data_dir}: run `python train.py data` first")
    return seqs


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for draft slots k = 1..B-1 (SPEC §6): early slots matter most."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def default_gamma(block_size: int) -> float:
    """DFlash's decay: 4 for block 8, 5 for 10, 7 for 16 (linear in between)."""
    return {8: 4.0, 10: 5.0, 16: 7.0}.get(block_size, 4.0 + 3.0 * (block_size - 8) / 8)


def make_batch(seqs, block_size, anchors_per_seq, mask_token_id, generator):
    """Random anchors in each response; block = anchor + masks; context = everything before the anchor.

    Returns padded context features [S, L, n*H], per-block (sequence index, anchor position,
    block ids [nb, B], gold ids [nb, B-1] with -100 past the end of the sequence).
    """
    width = max(len(f) for _, f, _ in seqs)
    feats = torch.zeros(len(seqs), width, seqs[0][1].shape[-1])
    seq_idx, anchor_pos, blocks, gold = [], [], [], []
    for s, (ids, f, prompt_len) in enumerate(seqs):
        feats[s, : len(f)] = f.float()
        lo, hi = prompt_len, len(ids) - 2  # the first anchor at inference is the first generated token
        n = min(anchors_per_seq, hi - lo + 1)
        for a in (lo + torch.randperm(hi - lo + 1, generator=generator)[:n]).tolist():
            seq_idx.append(s)
            anchor_pos.append(a)
            blocks.append([int(ids[a])] + [mask_token_id] * (block_size - 1))
            g = ids[a + 1 : a + block_size].tolist()
            gold.append(g + [-100] * (block_size - 1 - len(g)))
    return feats, torch.tensor(seq_idx), torch.tensor(anchor_pos), torch.tensor(blocks), torch.tensor(gold)


def drafter_loss(drafter, embed_tokens, lm_head_weight, batch, weights, selector_weight=1.0):
    """Position-decayed CE over the draft slots + the selector's CE over its K candidates (SPEC §6).

    Blocks never see each other: each block attends to its own sequence's context (slots before its
    anchor) and to itself. Returns (loss, per-slot draft top-1 accuracy [B-1], selector accuracy).
    """
    feats, seq_idx, anchor_pos, blocks, gold = batch
    S, L, _ = feats.shape
    nb, B = blocks.shape
    positions = torch.arange(L).expand(S, L)
    ctx_kv = [(k[seq_idx], v[seq_idx]) for k, v in drafter.context_kv(feats, positions)]
    ctx_valid = torch.arange(L)[None, :] < anchor_pos[:, None]
    block_pos = anchor_pos[:, None] + torch.arange(B)
    embeds = embed_tokens(blocks) * drafter.config.input_embedding_scale
    h = drafter(embeds, block_pos, ctx_kv, ctx_valid)[:, 1:]
    U = drafter.draft_logits(h, lm_head_weight)  # [nb, B-1, V]
    valid = gold >= 0
    ce = F.cross_entropy(U.flatten(0, 1), gold.flatten().clamp(min=0), reduction="none").view(nb, B - 1)
    w = weights[None, :] * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    acc = ((U.argmax(-1) == gold) & valid).sum(0).float() / valid.sum(0).clamp(min=1)

    # Selector: candidates of each slot, gold predecessor teacher-forced (anchor for slot 1).
    selector = drafter.candidate_selector
    cand_ids, _ = selector.candidates(U.detach(), selector.top_k)
    prev = torch.cat([blocks[:, :1], gold[:, :-1].clamp(min=0)], dim=1)  # [nb, B-1]
    wh = selector.hidden_projection(h)
    bilinear = torch.einsum("btr,btr,btkr->btk", wh, selector.predecessor_codebook[prev],
                            selector.successor_codebook[cand_ids])
    scores = U.gather(-1, cand_ids) + bilinear
    hit = cand_ids == gold[..., None]
    in_c = hit.any(-1) & valid
    sel_ce = F.cross_entropy(scores[in_c], hit[in_c].float().argmax(-1)) if in_c.any() else U.sum() * 0
    sel_acc = (scores.argmax(-1)[in_c] == hit[in_c].float().argmax(-1)).float().mean() if in_c.any() else torch.tensor(0.)
    return loss + selector_weight * sel_ce, loss.detach(), sel_ce.detach(), acc, sel_acc


def drafter_config_for(target_config, args) -> DFlash2Config:
    """A drafter shaped after the target: same hidden size, heads and vocab (it shares embedding and LM head)."""
    H = target_config.hidden_size
    head_dim = getattr(target_config, "head_dim", None) or H // target_config.num_attention_heads
    return DFlash2Config(
        hidden_size=H, intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
        num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
        head_dim=head_dim, vocab_size=target_config.vocab_size,
        num_target_layers=target_config.num_hidden_layers, target_layer_ids=args.taps,
        mask_token_id=args.mask_token_id, rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=target_config.rope_parameters["rope_theta"], max_position_embeddings=target_config.max_position_embeddings,
        layer_types=["sliding_attention"] * args.layers, sliding_window=2048, use_sliding_window=True,
        block_size=args.block_size, selector_rank=args.rank, selector_top_k=args.top_k, dtype="bfloat16",
        bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id)


def lr_at(step, total, warmup, peak):
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(args, target=None):
    """Fit a drafter on `args.out`/data; checkpoints to `args.out`/drafter (published format)."""
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    meta = json.loads((out / "data" / "meta.json").read_text())
    args.taps = meta["taps"]
    if target is None:
        target, _ = load_target(meta["target"])
    for p in target.parameters():
        p.requires_grad_(False)  # frozen: the drafter shares its embedding and LM head
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings().weight
    seqs = load_shards(out / "data")
    extra = []
    for d in getattr(args, "extra_data", None) or []:
        other = json.loads((Path(d) / "meta.json").read_text())
        if other["taps"] != meta["taps"] or other["target"] != meta["target"]:
            raise SystemExit(f"error: --extra-data {d} was made from target {other['target']} taps {other['taps']}, "
                             f"but {out / 'data'} from {meta['target']} taps {meta['taps']}")
        extra += load_shards(Path(d))
    ckpt_path = out / "train_state.pt"
    torch.manual_seed(args.seed)
    if getattr(args, "init", None):  # fine-tune a published checkpoint: its config fixes the shape
        drafter = DFlash2Drafter.from_pretrained(args.init).float().train()
        c = drafter.config
        if c.target_layer_ids != list(args.taps):
            raise SystemExit(f"error: --init {args.init} taps target layers {c.target_layer_ids}, but the data in "
                             f"{out / 'data'} was tapped at {list(args.taps)}")
        if c.hidden_size != target.config.hidden_size or c.vocab_size != target.config.vocab_size:
            raise SystemExit(f"error: --init {args.init} has hidden {c.hidden_size} / vocab {c.vocab_size}; the "
                             f"target has {target.config.hidden_size} / {target.config.vocab_size}")
        args.block_size, args.top_k, args.mask_token_id = c.block_size, c.selector_top_k, c.mask_token_id
    else:
        drafter = DFlash2Drafter(drafter_config_for(target.config, args)).float().train()
        with torch.no_grad():  # start the final norm where the shared LM head expects its inputs
            drafter.norm.weight.copy_(target.get_decoder().norm.weight)
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.seed)
    step, history = 0, []
    if args.resume and ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        g.set_state(state["generator"])
        step, history = state["step"], state["history"]
    weights = position_weights(args.block_size, args.gamma or default_gamma(args.block_size))
    n_tokens = sum(len(i) - p for i, _, p in seqs + extra)
    # Each step draws round(extra_share * batch_seqs) sequences from --extra-data, the rest from out/data;
    # by default the share is proportional to the sizes (uniform over all sequences).
    share = args.extra_share if getattr(args, "extra_share", None) is not None else len(extra) / (len(seqs) + len(extra))
    if not 0.0 <= share <= 1.0:
        raise SystemExit(f"error: --extra-share must be between 0 and 1, got {share}")
    n_extra = round(share * args.batch_seqs) if extra else 0
    print(f"{len(seqs)} + {len(extra)} extra sequences ({n_extra} of {args.batch_seqs} per step), "
          f"{n_tokens} response tokens; drafter "
          f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params", flush=True)
    t0 = time.time() - (history[-1]["wall_s"] if history else 0.0)
    bar = tqdm(range(step, args.steps), initial=step, total=args.steps, desc="train")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.warmup, args.lr)
        pick = [seqs[i] for i in torch.randint(len(seqs), (args.batch_seqs - n_extra,), generator=g).tolist()]
        if n_extra:
            pick += [extra[i] for i in torch.randint(len(extra), (n_extra,), generator=g).tolist()]
        batch = make_batch(pick, args.block_size, args.anchors, args.mask_token_id, g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss, ce, sel_ce, acc, sel_acc = drafter_loss(drafter, embed, lm_head, batch, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.clip)
        opt.step()
        rec = {"step": step + 1, "loss": loss.item(), "ce": float(ce), "selector_ce": float(sel_ce),
               "acc": [round(float(a), 4) for a in acc], "selector_acc": float(sel_acc), "wall_s": time.time() - t0}
        history.append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{rec['acc'][0]:.2f}", acc7=f"{rec['acc'][-1]:.2f}",
                        sel=f"{rec['selector_acc']:.2f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "generator": g.get_state(),
                        "step": step + 1, "history": history}, ckpt_path.with_suffix(".tmp"))
            ckpt_path.with_suffix(".tmp").rename(ckpt_path)
            drafter.save_pretrained(out / "drafter", dtype=torch.bfloat16)
            (out / "history.json").write_text(json.dumps(history))
    return drafter, history


def plot_history(history, path, window=50, before=()):
    """Loss and per-slot top-1 accuracy over training (moving averages), saved as an image.

    before: the histories of the runs this one continues (`train --init`), oldest first, drawn first;
    a dotted line marks where each later run begins.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(xs):
        return [sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]

    joined, starts = [], []
    for run in list(before) + [history]:
        offset = joined[-1]["step"] if joined else 0
        if joined:
            starts.append(offset)
        joined += [dict(h, step=h["step"] + offset) for h in run]
    history = joined
    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(steps, smooth([h["ce"] for h in history]), label="draft CE (position-weighted)")
    ax1.plot(steps, smooth([h["selector_ce"] for h in history]), label="selector CE")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.set_yscale("log")
    ax1.legend()
    for k in range(len(history[0]["acc"])):
        ax2.plot(steps, smooth([h["acc"][k] for h in history]), label=f"slot {k + 1}")
    ax2.plot(steps, smooth([h["selector_acc"] for h in history]), "k--", label="selector (gold in C_t)")
    ax2.set_xlabel("step")
    ax2.set_ylabel("top-1 accuracy")
    for start in starts:
        for ax in (ax1, ax2):
            ax.axvline(start, color="gray", linestyle=":", label="_nolegend_")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="self-distil training data from the target")
    d.add_argument("--target", default=None)
    d.add_argument("--data-dir", default="../shared/data")
    d.add_argument("--out", default="runs/smollm2")
    d.add_argument("--taps", default="1,8,14,21,27")
    d.add_argument("--max-prompts", type=int, default=4000)
    d.add_argument("--sources", default="gsm8k,mbpp,chat",
                   help=f"prompt sets, comma separated, from {','.join(PROMPT_SOURCES)} (see training_prompts)")
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", default="bfloat16", help="target dtype for generation (bf16 is ~2x faster on CPU)")
    t = sub.add_parser("train", help="fit a drafter on the self-distilled data")
    t.add_argument("--out", default="runs/smollm2", help="directory holding data/ (from `train.py data`)")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch-seqs", type=int, default=8, help="sequences per step")
    t.add_argument("--anchors", type=int, default=32, help="random anchors (blocks) per sequence")
    t.add_argument("--block-size", type=int, default=8)
    t.add_argument("--gamma", type=float, default=None, help="position decay (default 4 for block 8)")
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--intermediate-size", type=int, default=1536)
    t.add_argument("--rank", type=int, default=24, help="selector rank r")
    t.add_argument("--top-k", type=int, default=16, help="selector candidates K")
    t.add_argument("--mask-token-id", type=int, default=16)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast matmuls")
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--resume", action="store_true")
    t.add_argument("--init", default=None, metavar="DIR",
                   help="start from this published drafter checkpoint (fine-tuning); its config sets the shape")
    t.add_argument("--extra-data", action="append", default=[], metavar="DIR",
                   help="another `train.py data` output (its data/ folder) to mix in; repeatable")
    t.add_argument("--extra-share", type=float, default=None,
                   help="fraction of each step's sequences drawn from --extra-data (default: by size)")
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--seed", type=int, default=0)
    pl = sub.add_parser("plot", help="draw the loss and per-slot accuracy curves (needs matplotlib)")
    pl.add_argument("--out", default="runs/smollm2")
    pl.add_argument("--png", default="docs/training.png")
    pl.add_argument("--before", action="append", default=[], metavar="JSON",
                    help="history.json of a run this one continues (--init), drawn first; repeat, oldest first")
    args = ap.parse_args()
    if args.cmd == "data":
        make_data(args)
    elif args.cmd == "train":
        train(args)
    else:
        before = [json.loads(Path(b).read_text()) for b in args.before]
        plot_history(json.loads((Path(args.out) / "history.json").read_text()), args.png, before=before)


if __name__ == "__main__":
    main()
