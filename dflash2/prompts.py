"""Training prompts for self-distillation: benchmark training splits and synthetic prompt sets.

`training_prompts(data_dir, sources, seed)` is the one entry point; `python -m dflash2.train data`
has the target answer these prompts. The synthetic sets (templates, word lists, made-up coding
tasks) are written here, not taken from any benchmark; no evaluation set is read (tests/test_train.py
checks every source against them). The same sources and seed give the same prompts in the same order.
"""
import inspect
import json
import random
import re
from pathlib import Path

# the model card's prompt formats (SPEC §8), shared with bench.py
GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_WRAP = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"


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


_CODE_TASKS_2 = [  # (name, arguments, what it does, example call, its result): made up here, not from any benchmark
    # strings
    ("swap_halves", "s", "swap the first and second halves of a string, leaving the middle character of an odd-length string in place",
     "swap_halves('abcde')", "'decab'"),
    ("mask_card_number", "number", "hide all but the last four digits of a card number string behind '*' characters",
     "mask_card_number('4111222233334444')", "'************4444'"),
    ("longest_vowel_run", "s", "return the length of the longest run of consecutive vowels in a string",
     "longest_vowel_run('beautiful day')", "3"),
    ("title_except_small", "s", "title-case a sentence but keep the words 'a', 'an', 'the', 'of' and 'and' in lower case unless they come first",
     "title_except_small('the lord of the rings')", "'The Lord of the Rings'"),
    ("alternate_case", "s", "make the letters of a string alternate between upper and lower case, starting with upper case and skipping over non-letters",
     "alternate_case('hello world')", "'HeLlO wOrLd'"),
    ("most_common_letter", "text", "return the letter that occurs most often in a text, ignoring case and breaking ties alphabetically",
     "most_common_letter('Banana bread')", "'a'"),
    ("is_pangram", "s", "check whether a sentence uses every letter of the English alphabet at least once",
     "is_pangram('The quick brown fox jumps over the lazy dog')", "True"),
    ("char_positions", "s", "map each character of a string to the list of positions where it occurs",
     "char_positions('abca')", "{'a': [0, 3], 'b': [1], 'c': [2]}"),
    ("wrap_text", "text, width", "break a text into lines of at most width characters without splitting words",
     "wrap_text('the cat sat on the mat', 10)", "['the cat', 'sat on the', 'mat']"),
    ("acronym", "phrase", "build an upper-case acronym from the first letters of the words of a phrase, treating hyphens as word breaks",
     "acronym('portable network graphics')", "'PNG'"),
    ("vowel_consonant_split", "word", "return a pair of strings holding the vowels and the consonants of a word, each in their original order",
     "vowel_consonant_split('python')", "('o', 'pythn')"),
    ("rle_decode", "s", "decode a run-length encoded string such as 'x2y1z3' back into 'xxyzzz'",
     "rle_decode('x2y1z3')", "'xxyzzz'"),
    ("is_rotation", "a, b", "check whether one string can be obtained by rotating the characters of another",
     "is_rotation('waterbottle', 'erbottlewat')", "True"),
    ("pig_latin", "word", "translate a word into Pig Latin: move the leading consonants to the end and add 'ay', or add 'way' to a word that starts with a vowel",
     "pig_latin('string')", "'ingstray'"),
    ("longest_repeated_char", "s", "return the character with the longest run of repeats in a string together with the length of that run",
     "longest_repeated_char('aabbbbcc')", "('b', 4)"),
    ("kebab_case", "s", "convert a phrase into kebab-case: lower-case words joined by hyphens, with punctuation removed",
     "kebab_case('Hello, World Again!')", "'hello-world-again'"),
    ("initials", "full_name", "return the initials of a full name, each followed by a dot",
     "initials('ada lovelace king')", "'A.L.K.'"),
    ("first_unique_word", "text", "return the first word of a text that appears only once, ignoring case",
     "first_unique_word('the cat and the hat and')", "'cat'"),
    ("censor", "text, banned", "replace each banned word in a text with as many asterisks as it has letters",
     "censor('a bad bad day', ['bad'])", "'a *** *** day'"),
    ("is_subsequence", "a, b", "check whether string a can be formed by deleting some characters of string b",
     "is_subsequence('ace', 'abcde')", "True"),
    ("look_and_say", "n", "return the n-th term of the look-and-say sequence, whose first term is '1'",
     "look_and_say(5)", "'111221'"),
    ("anagram_groups", "words", "group words that are anagrams of each other, keeping the groups in order of first appearance",
     "anagram_groups(['eat', 'tea', 'tan', 'ate', 'nat'])", "[['eat', 'tea', 'ate'], ['tan', 'nat']]"),
    ("validate_password", "pw", "check that a password has at least 8 characters, an upper-case letter, a lower-case letter and a digit",
     "validate_password('Secret123')", "True"),
    ("scrabble_score", "word", "compute the Scrabble score of a word using the standard English letter values",
     "scrabble_score('quiz')", "22"),
    # lists
    ("split_on_value", "items, sep", "split a list into sub-lists wherever a separator value appears",
     "split_on_value([1, 0, 2, 3, 0, 4], 0)", "[[1], [2, 3], [4]]"),
    ("sliding_max", "nums, k", "return the maximum of every window of k consecutive numbers",
     "sliding_max([1, 3, 2, 5, 4], 2)", "[3, 3, 5, 5]"),
    ("find_peaks", "nums", "return the indices of the elements that are strictly greater than both of their neighbours",
     "find_peaks([1, 3, 2, 4, 1, 5])", "[1, 3]"),
    ("leaders", "nums", "return the elements that are greater than every element to their right",
     "leaders([16, 17, 4, 3, 5, 2])", "[17, 5, 2]"),
    ("move_zeros", "nums", "move all zeros of a list to the end while keeping the order of the other elements",
     "move_zeros([0, 1, 0, 3, 12])", "[1, 3, 12, 0, 0]"),
    ("longest_increasing_run", "nums", "return the longest strictly increasing run of consecutive elements of a list",
     "longest_increasing_run([5, 1, 2, 3, 1, 4])", "[1, 2, 3]"),
    ("majority_element", "nums", "return the element that fills more than half of a list, or None if there is none",
     "majority_element([2, 2, 1, 2, 3])", "2"),
    ("missing_number", "nums", "find the one number missing from a list that should hold every integer from 0 to n",
     "missing_number([3, 0, 1])", "2"),
    ("product_except_self", "nums", "return a list where each element is the product of all the other elements, without using division",
     "product_except_self([1, 2, 3, 4])", "[24, 12, 8, 6]"),
    ("dedupe_adjacent", "items", "collapse each run of equal adjacent elements of a list into a single element",
     "dedupe_adjacent([1, 1, 2, 2, 2, 1])", "[1, 2, 1]"),
    ("partition_by", "nums, pivot", "reorder numbers so that those below a pivot come first, then those equal to it, then larger ones, keeping the relative order within each group",
     "partition_by([5, 1, 7, 5, 2], 5)", "[1, 2, 5, 5, 7]"),
    ("fill_gaps", "items", "replace each None in a list with the most recent non-None value before it",
     "fill_gaps([1, None, None, 4, None])", "[1, 1, 1, 4, 4]"),
    ("histogram_bins", "nums, width", "count how many non-negative numbers fall into each bin of the given width, keyed by the bin's lower edge",
     "histogram_bins([1, 3, 4, 9, 11], 5)", "{0: 3, 5: 1, 10: 1}"),
    ("running_balance", "transactions", "given deposits (positive) and withdrawals (negative), return the balance after each one and the lowest balance reached",
     "running_balance([50, -20, -40, 30])", "([50, 30, -10, 20], -10)"),
    ("k_closest", "nums, target, k", "return the k numbers of a list that are closest to a target, in ascending order",
     "k_closest([1, 5, 9, 12, 20], 10, 2)", "[9, 12]"),
    ("sum_pairs_count", "nums, target", "count the pairs of positions i < j whose values add up to a target",
     "sum_pairs_count([1, 5, 7, -1, 5], 6)", "3"),
    ("running_median", "nums", "return, as floats, the median of the numbers seen so far after each new number of a list arrives",
     "running_median([5, 15, 1, 3])", "[5.0, 10.0, 5.0, 4.0]"),
    ("rank_scores", "scores", "assign dense ranks to a list of scores, where the highest score gets rank 1",
     "rank_scores([50, 80, 80, 70])", "[3, 1, 1, 2]"),
    ("max_profit", "prices", "return the best profit from buying a share on one day and selling it on a later day, or 0",
     "max_profit([7, 1, 5, 3, 6, 4])", "5"),
    ("trap_rain_water", "heights", "compute how many units of rain water are trapped between bars of the given heights",
     "trap_rain_water([0, 1, 0, 2, 1, 0, 1, 3, 2, 1, 2, 1])", "6"),
    # dictionaries
    ("merge_counts", "a, b", "merge two dictionaries of counts, adding the values of keys they share",
     "merge_counts({'x': 1, 'y': 2}, {'y': 3, 'z': 4})", "{'x': 1, 'y': 5, 'z': 4}"),
    ("group_by_first_letter", "words", "group words into a dictionary keyed by their lower-case first letter",
     "group_by_first_letter(['apple', 'Avocado', 'banana'])", "{'a': ['apple', 'Avocado'], 'b': ['banana']}"),
    ("nested_get", "d, path", "look up a dotted key path such as 'a.b.c' in nested dictionaries, returning None when any key is missing",
     "nested_get({'a': {'b': {'c': 5}}}, 'a.b.c')", "5"),
    ("flatten_dict", "d", "flatten nested dictionaries into a single level whose keys are joined with dots",
     "flatten_dict({'a': 1, 'b': {'c': 2, 'd': {'e': 3}}})", "{'a': 1, 'b.c': 2, 'b.d.e': 3}"),
    ("unflatten_dict", "d", "turn a dictionary with dotted keys back into nested dictionaries",
     "unflatten_dict({'a.b': 1, 'a.c': 2, 'd': 3})", "{'a': {'b': 1, 'c': 2}, 'd': 3}"),
    ("top_k_keys", "d, k", "return the k keys of a dictionary with the largest values, largest first",
     "top_k_keys({'a': 3, 'b': 7, 'c': 5}, 2)", "['b', 'c']"),
    ("dict_diff", "old, new", "report which keys were added, removed and changed between two versions of a dictionary",
     "dict_diff({'a': 1, 'b': 2}, {'b': 3, 'c': 4})", "{'added': ['c'], 'removed': ['a'], 'changed': ['b']}"),
    ("invert_multi", "d", "invert a dictionary whose values may repeat, mapping each value to the sorted list of keys that had it",
     "invert_multi({'a': 1, 'b': 2, 'c': 1})", "{1: ['a', 'c'], 2: ['b']}"),
    ("count_by", "items, key", "count the items of a list by the result of a key function",
     "count_by(['one', 'two', 'three'], len)", "{3: 2, 5: 1}"),
    ("deep_merge", "a, b", "recursively merge two nested dictionaries, letting the values of b win on conflicts",
     "deep_merge({'x': {'y': 1, 'z': 2}}, {'x': {'z': 3}})", "{'x': {'y': 1, 'z': 3}}"),
    ("leaderboard", "scores", "turn a dictionary of player scores into (player, score) pairs ranked by score, highest first, with ties broken alphabetically",
     "leaderboard({'bo': 2, 'al': 2, 'cy': 5})", "[('cy', 5), ('al', 2), ('bo', 2)]"),
    ("shopping_total", "cart, prices", "total a shopping cart given as a dictionary of item quantities and a dictionary of unit prices",
     "shopping_total({'egg': 6, 'milk': 1}, {'egg': 0.25, 'milk': 1.2})", "2.7"),
    ("tally_votes", "ballots", "return the winner of a vote given as a list of names, breaking a tie in favour of the name that reached the winning count first",
     "tally_votes(['ann', 'bo', 'bo', 'ann'])", "'bo'"),
    # numbers
    ("digital_root", "n", "repeatedly sum the digits of a non-negative integer until a single digit remains",
     "digital_root(9875)", "2"),
    ("is_perfect_number", "n", "check whether a positive integer equals the sum of its proper divisors",
     "is_perfect_number(28)", "True"),
    ("collatz_steps", "n", "count the steps the Collatz process needs to reach 1 from n",
     "collatz_steps(6)", "8"),
    ("prime_factors_dict", "n", "return the prime factorisation of n as a dictionary from each prime to its exponent",
     "prime_factors_dict(360)", "{2: 3, 3: 2, 5: 1}"),
    ("lcm_list", "nums", "return the least common multiple of a list of positive integers",
     "lcm_list([4, 6, 10])", "60"),
    ("is_armstrong", "n", "check whether a number equals the sum of its digits, each raised to the power of the number of digits",
     "is_armstrong(153)", "True"),
    ("totient", "n", "compute Euler's totient of n, the count of integers from 1 to n that are coprime with n",
     "totient(12)", "4"),
    ("next_prime", "n", "return the smallest prime strictly greater than n",
     "next_prime(14)", "17"),
    ("happy_number", "n", "check whether repeatedly replacing a number by the sum of the squares of its digits eventually reaches 1",
     "happy_number(19)", "True"),
    ("pascal_row", "n", "return row n of Pascal's triangle, counting the top row as row 0",
     "pascal_row(4)", "[1, 4, 6, 4, 1]"),
    ("mod_pow", "base, exp, mod", "compute base to the power exp modulo mod by repeated squaring",
     "mod_pow(3, 13, 7)", "3"),
    ("egyptian_fraction", "num, den", "write a fraction between 0 and 1 as a sum of distinct unit fractions with the greedy method and return their denominators",
     "egyptian_fraction(4, 13)", "[4, 18, 468]"),
    ("continued_fraction", "num, den", "return the continued fraction terms of a positive rational number num / den",
     "continued_fraction(415, 93)", "[4, 2, 6, 7]"),
    ("sum_of_multiples", "n, factors", "sum all the numbers below n that are multiples of at least one of the given factors",
     "sum_of_multiples(10, [3, 5])", "23"),
    ("goldbach_pair", "n", "return two primes p <= q that add up to an even number n greater than 2, with p as small as possible",
     "goldbach_pair(28)", "(5, 23)"),
    ("nth_ugly_number", "n", "return the n-th positive integer whose only prime factors are 2, 3 and 5, counting 1 as the first",
     "nth_ugly_number(10)", "12"),
    ("fraction_reduce", "num, den", "reduce a fraction to lowest terms, keeping any minus sign on the numerator",
     "fraction_reduce(6, -8)", "(-3, 4)"),
    ("catalan", "n", "return the n-th Catalan number, counting from catalan(0) = 1",
     "catalan(5)", "42"),
    ("sqrt_floor", "n", "return the integer square root of a non-negative integer using binary search",
     "sqrt_floor(50)", "7"),
    ("spell_number", "n", "spell out an integer from 0 to 99 in English words",
     "spell_number(42)", "'forty-two'"),
    # dates and times
    ("day_of_week", "date", "return the weekday name of a date given as 'YYYY-MM-DD'",
     "day_of_week('2024-07-04')", "'Thursday'"),
    ("add_days", "date, n", "add n days to a 'YYYY-MM-DD' date and return the new date in the same form",
     "add_days('2023-12-30', 5)", "'2024-01-04'"),
    ("age_on", "birth, today", "compute a person's age in whole years on a given day, with both dates as 'YYYY-MM-DD'",
     "age_on('2000-05-20', '2024-05-19')", "23"),
    ("minutes_between", "start, end", "return the minutes from one 'HH:MM' time of day to a later one, wrapping past midnight",
     "minutes_between('23:30', '01:15')", "105"),
    ("to_12_hour", "t", "convert a 24-hour time 'HH:MM' into 12-hour form with AM or PM",
     "to_12_hour('18:05')", "'6:05 PM'"),
    ("format_duration", "seconds", "format a number of seconds as 'H:MM:SS'",
     "format_duration(3725)", "'1:02:05'"),
    ("day_of_year", "date", "return the position of a 'YYYY-MM-DD' date within its year, with 1 January as day 1",
     "day_of_year('2023-03-01')", "60"),
    ("weekdays_between", "start, end", "count the weekdays (Monday to Friday) from start up to but not including end, both 'YYYY-MM-DD'",
     "weekdays_between('2024-01-01', '2024-01-15')", "10"),
    ("quarter_of", "date", "return the calendar quarter, 'Q1' to 'Q4', of a 'YYYY-MM-DD' date",
     "quarter_of('2022-08-17')", "'Q3'"),
    ("parse_duration", "text", "parse a duration written like '1h30m15s' into a number of seconds",
     "parse_duration('1h30m15s')", "5415"),
    # geometry
    ("polygon_area", "points", "compute the area of a simple polygon from its vertices with the shoelace formula",
     "polygon_area([(0, 0), (4, 0), (4, 3), (0, 3)])", "12.0"),
    ("point_in_rect", "point, rect", "check whether a point (x, y) lies inside or on the border of a rectangle given as (x1, y1, x2, y2)",
     "point_in_rect((2, 3), (0, 0, 4, 4))", "True"),
    ("rect_overlap_area", "a, b", "return the overlapping area of two axis-aligned rectangles given as (x1, y1, x2, y2)",
     "rect_overlap_area((0, 0, 4, 4), (2, 2, 6, 5))", "4"),
    ("closest_pair_distance", "points", "return the smallest Euclidean distance between any two points of a list",
     "closest_pair_distance([(0, 0), (5, 5), (3, 4), (6, 5)])", "1.0"),
    ("triangle_kind", "a, b, c", "classify a triangle by its side lengths as 'equilateral', 'isosceles', 'scalene' or 'invalid'",
     "triangle_kind(3, 4, 4)", "'isosceles'"),
    ("circles_touch", "c1, c2", "check whether two circles given as (x, y, r) touch or overlap",
     "circles_touch((0, 0, 2), (3, 0, 1))", "True"),
    ("centroid", "points", "return the centroid of a list of 2D points",
     "centroid([(0, 0), (4, 0), (2, 6)])", "(2.0, 2.0)"),
    ("angle_between", "u, v", "return the angle in degrees between two 2D vectors",
     "angle_between((1, 0), (0, 2))", "90.0"),
    ("rotate_point", "point, quarter_turns", "rotate an integer point about the origin counter-clockwise by a number of quarter turns",
     "rotate_point((2, 1), 1)", "(-1, 2)"),
    ("convex_hull", "points", "return the convex hull of a set of 2D points in counter-clockwise order, starting from the point with the smallest x (then smallest y)",
     "convex_hull([(0, 0), (2, 0), (1, 1), (2, 2), (0, 2)])", "[(0, 0), (2, 0), (2, 2), (0, 2)]"),
    ("bounding_box", "points", "return the smallest axis-aligned box (min_x, min_y, max_x, max_y) that contains all the points",
     "bounding_box([(1, 5), (-2, 3), (4, 0)])", "(-2, 0, 4, 5)"),
    # parsing
    ("parse_key_values", "s", "parse a string like 'a=1; b=two' into a dictionary of strings",
     "parse_key_values('a=1; b=two')", "{'a': '1', 'b': 'two'}"),
    ("parse_query_string", "url", "return the query parameters of a URL as a dictionary",
     "parse_query_string('https://x.org/p?q=cat&page=2')", "{'q': 'cat', 'page': '2'}"),
    ("evaluate_rpn", "tokens", "evaluate an expression in reverse Polish notation given as a list of tokens",
     "evaluate_rpn(['2', '1', '+', '3', '*'])", "9"),
    ("tokenize_expression", "expr", "split an arithmetic expression into number, operator and parenthesis tokens",
     "tokenize_expression('12+(3*45)')", "['12', '+', '(', '3', '*', '45', ')']"),
    ("parse_version", "v", "parse a version string like '1.10.3' into a tuple of integers so that versions compare correctly",
     "parse_version('1.10.3')", "(1, 10, 3)"),
    ("compare_versions", "a, b", "compare two dotted version strings and return -1, 0 or 1",
     "compare_versions('1.2', '1.10')", "-1"),
    ("parse_ini", "lines", "parse the lines of an INI file into a dictionary of sections, each a dictionary of string values",
     "parse_ini(['[db]', 'host = local', 'port = 5432'])", "{'db': {'host': 'local', 'port': '5432'}}"),
    ("extract_hashtags", "text", "return the hashtags of a text in lower case, without duplicates, in order of first appearance",
     "extract_hashtags('Love #Python and #python tips #AI')", "['python', 'ai']"),
    ("extract_numbers", "text", "return every integer and decimal number that appears in a text, as floats",
     "extract_numbers('Paid 12.5 for 3 items')", "[12.5, 3.0]"),
    ("parse_time_log", "entries", "add up time entries written like '2h' and '45m' into a total number of minutes",
     "parse_time_log(['2h', '45m', '1h'])", "225"),
    ("is_valid_ipv4", "s", "check whether a string is a valid dotted IPv4 address",
     "is_valid_ipv4('192.168.1.300')", "False"),
    ("hex_to_rgb", "color", "convert a colour written like '#ff8800' into an (r, g, b) tuple",
     "hex_to_rgb('#ff8800')", "(255, 136, 0)"),
    ("csv_to_dicts", "lines", "turn CSV lines that start with a header row into a list of dictionaries",
     "csv_to_dicts(['name,age', 'Ann,31', 'Bo,4'])", "[{'name': 'Ann', 'age': '31'}, {'name': 'Bo', 'age': '4'}]"),
    ("luhn_valid", "number", "check a card number string with the Luhn checksum",
     "luhn_valid('4539578763621486')", "True"),
    ("isbn10_valid", "code", "check whether a 10-character ISBN, whose last character may be 'X', has a valid checksum",
     "isbn10_valid('0306406152')", "True"),
    # classes
    ("MinStack", "", "keep a stack with push, pop and a min method that returns the smallest element in constant time",
     "s = MinStack(); s.push(3); s.push(1); s.push(2); s.min()", "1"),
    ("BankAccount", "balance", "model a bank account with deposit and withdraw methods, where withdraw raises ValueError when funds are insufficient",
     "a = BankAccount(100); a.deposit(50); a.withdraw(30); a.balance", "120"),
    ("LRUCache", "capacity", "build a least-recently-used cache with get and put methods, where get returns -1 for a missing key",
     "c = LRUCache(2); c.put('a', 1); c.put('b', 2); c.put('c', 3); c.get('a')", "-1"),
    ("Vector2", "x, y", "represent a 2D vector that supports + and - between vectors, * by a number, and a length method",
     "(Vector2(1, 2) + Vector2(2, 2)).length()", "5.0"),
    ("Temperature", "celsius", "store a temperature in Celsius and expose it in Fahrenheit and Kelvin through properties",
     "Temperature(100).fahrenheit", "212.0"),
    ("Inventory", "", "track item quantities with add and remove methods and a total method that returns the number of items held",
     "inv = Inventory(); inv.add('apple', 3); inv.add('pear', 2); inv.remove('apple', 1); inv.total()", "4"),
    ("TwoStackQueue", "", "implement a first-in first-out queue with enqueue and dequeue methods on top of two lists used as stacks",
     "q = TwoStackQueue(); q.enqueue(1); q.enqueue(2); q.dequeue()", "1"),
    ("RunningStats", "", "keep running statistics with an add method and mean and maximum properties, storing only a few numbers",
     "r = RunningStats(); r.add(4); r.add(8); r.add(6); r.mean", "6.0"),
    ("Polynomial", "coeffs", "represent a polynomial by its coefficients, lowest degree first, with an evaluate method",
     "Polynomial([1, 0, 2]).evaluate(3)", "19"),
    ("TodoList", "", "keep a to-do list with add, complete and pending methods, where pending returns the unfinished tasks in order",
     "t = TodoList(); t.add('wash'); t.add('cook'); t.complete('wash'); t.pending()", "['cook']"),
    # recursion and dynamic programming
    ("hanoi_moves", "n, src, dst, via", "return the moves that solve the Towers of Hanoi with n discs, each move a (from, to) pair",
     "hanoi_moves(2, 'A', 'C', 'B')", "[('A', 'B'), ('A', 'C'), ('B', 'C')]"),
    ("nested_depth", "items", "return the maximum nesting depth of a nested list, where a flat list has depth 1",
     "nested_depth([1, [2, [3]], 4])", "3"),
    ("count_grid_paths", "rows, cols", "count the paths from the top-left to the bottom-right cell of a grid that only move right or down",
     "count_grid_paths(3, 3)", "6"),
    ("generate_parentheses", "n", "return every string of n balanced pairs of parentheses in lexicographic order",
     "generate_parentheses(3)", "['((()))', '(()())', '(())()', '()(())', '()()()']"),
    ("subset_sums", "nums", "return the sorted distinct sums of all subsets of a list of numbers",
     "subset_sums([1, 2, 4])", "[0, 1, 2, 3, 4, 5, 6, 7]"),
    ("binary_strings", "n", "return all binary strings of length n that have no two consecutive 1s, in sorted order",
     "binary_strings(3)", "['000', '001', '010', '100', '101']"),
    ("ackermann", "m, n", "compute the Ackermann function recursively",
     "ackermann(2, 3)", "9"),
    ("count_change", "amount, coins", "count the ways to make an amount from an unlimited supply of the given coin values",
     "count_change(10, [1, 5, 10])", "4"),
    ("palindrome_partitions", "s", "return every way to split a string into pieces that are all palindromes",
     "palindrome_partitions('aab')", "[['a', 'a', 'b'], ['aa', 'b']]"),
    ("tree_height", "tree", "return the height of a binary tree given as nested (value, left, right) tuples, with None for an empty tree",
     "tree_height((1, (2, None, None), (3, (4, None, None), None)))", "3"),
    ("inorder", "tree", "return the in-order traversal of a binary tree given as nested (value, left, right) tuples",
     "inorder((2, (1, None, None), (3, None, None)))", "[1, 2, 3]"),
    ("min_coins", "amount, coins", "return the fewest coins needed to make an amount, or -1 if it cannot be made",
     "min_coins(11, [1, 2, 5])", "3"),
    ("edit_distance", "a, b", "compute the Levenshtein edit distance between two strings",
     "edit_distance('kitten', 'sitting')", "3"),
    ("lcs_length", "a, b", "return the length of the longest common subsequence of two strings",
     "lcs_length('abcde', 'ace')", "3"),
    ("knapsack", "weights, values, capacity", "return the best total value of the 0/1 knapsack problem",
     "knapsack([1, 3, 4], [15, 20, 30], 4)", "35"),
    ("climb_stairs", "n", "count the ways to climb n stairs taking one or two steps at a time",
     "climb_stairs(5)", "8"),
    ("longest_unique_substring", "s", "return the length of the longest substring without repeating characters",
     "longest_unique_substring('abcabcbb')", "3"),
    # sorting and searching
    ("sort_by_frequency", "nums", "sort numbers by how often they occur, most frequent first, breaking ties by the smaller value",
     "sort_by_frequency([4, 6, 4, 2, 6, 6])", "[6, 6, 6, 4, 4, 2]"),
    ("first_occurrence", "items, target", "return the index of the first occurrence of a target in a sorted list with duplicates, or -1, in logarithmic time",
     "first_occurrence([1, 2, 2, 2, 3], 2)", "1"),
    ("search_rotated", "nums, target", "find the index of a target in a sorted list that has been rotated, or return -1",
     "search_rotated([4, 5, 6, 7, 0, 1, 2], 0)", "4"),
    ("kth_smallest", "nums, k", "return the k-th smallest element of a list using quickselect",
     "kth_smallest([7, 10, 4, 3, 20, 15], 3)", "7"),
    ("natural_sort", "names", "sort strings so that embedded numbers compare by value, putting 'file2' before 'file10'",
     "natural_sort(['file10', 'file2', 'file1'])", "['file1', 'file2', 'file10']"),
    ("merge_intervals", "intervals", "merge overlapping intervals given as [start, end] pairs",
     "merge_intervals([[1, 3], [2, 6], [8, 10]])", "[[1, 6], [8, 10]]"),
    ("find_duplicate", "nums", "return the first value that turns out to be a repeat when scanning a list from the left",
     "find_duplicate([3, 1, 4, 1, 3])", "1"),
    ("sort_words_by_length", "words", "sort words by length, keeping words of the same length in their original order",
     "sort_words_by_length(['pear', 'fig', 'apple', 'kiwi'])", "['fig', 'pear', 'kiwi', 'apple']"),
    ("search_matrix", "m, target", "check whether a target is present in a matrix whose rows and columns are both sorted in ascending order",
     "search_matrix([[1, 4, 7], [2, 5, 8], [3, 6, 9]], 5)", "True"),
    ("lower_bound", "items, x", "return the first index at which x could be inserted into a sorted list while keeping it sorted",
     "lower_bound([1, 3, 3, 5], 3)", "1"),
    ("schedule_meetings", "meetings", "return the largest number of non-overlapping (start, end) meetings one person can attend, where a meeting may start when another ends",
     "schedule_meetings([(1, 3), (2, 4), (3, 5), (6, 7)])", "3"),
    ("first_fit_bins", "sizes, capacity", "pack item sizes into bins of a given capacity with the first-fit rule and return the number of bins used",
     "first_fit_bins([4, 8, 1, 4, 2, 1], 10)", "2"),
    # matrices and grids
    ("rotate_matrix", "m", "rotate a square matrix 90 degrees clockwise",
     "rotate_matrix([[1, 2], [3, 4]])", "[[3, 1], [4, 2]]"),
    ("diagonal_sums", "m", "return the sums of the main diagonal and the anti-diagonal of a square matrix",
     "diagonal_sums([[1, 2, 3], [4, 5, 6], [7, 8, 9]])", "(15, 15)"),
    ("determinant", "m", "compute the determinant of a square matrix by cofactor expansion",
     "determinant([[2, 0, 1], [1, 3, 2], [1, 1, 2]])", "6"),
    ("is_symmetric", "m", "check whether a square matrix equals its own transpose",
     "is_symmetric([[1, 7], [7, 2]])", "True"),
    ("saddle_points", "m", "return the (row, column) positions of values that are the largest in their row and the smallest in their column",
     "saddle_points([[9, 8, 7], [5, 3, 2], [6, 6, 7]])", "[(1, 0)]"),
    ("life_step", "grid", "compute the next generation of Conway's Game of Life on a grid of 0s and 1s, treating cells beyond the edges as dead",
     "life_step([[0, 1, 0], [0, 1, 0], [0, 1, 0]])", "[[0, 0, 0], [1, 1, 1], [0, 0, 0]]"),
    ("flood_fill", "grid, r, c, color", "flood-fill the region of equal values connected to cell (r, c) of a grid with a new colour and return the grid",
     "flood_fill([[1, 1, 0], [1, 0, 0], [1, 1, 1]], 0, 0, 2)", "[[2, 2, 0], [2, 0, 0], [2, 2, 2]]"),
    ("shortest_path_grid", "grid", "return the fewest steps from the top-left to the bottom-right cell of a grid of 0s (open) and 1s (walls), or -1",
     "shortest_path_grid([[0, 0, 0], [1, 1, 0], [0, 0, 0]])", "4"),
    ("set_zeroes", "m", "set the whole row and column of every zero in a matrix to zero",
     "set_zeroes([[1, 2, 3], [4, 0, 6], [7, 8, 9]])", "[[1, 0, 3], [0, 0, 0], [7, 0, 9]]"),
    ("row_with_most_ones", "m", "return the index of the row with the most 1s in a matrix of 0s and 1s, the first such row on ties",
     "row_with_most_ones([[0, 1, 1], [1, 1, 1], [0, 0, 1]])", "1"),
    ("spiral_matrix", "n", "build an n by n matrix filled with the numbers 1 to n * n in clockwise spiral order",
     "spiral_matrix(3)", "[[1, 2, 3], [8, 9, 4], [7, 6, 5]]"),
    ("tic_tac_toe_winner", "board", "return the winner, 'X' or 'O', of a tic-tac-toe board given as three strings, or None",
     "tic_tac_toe_winner(['XOX', 'OXO', 'OOX'])", "'X'"),
    ("sudoku_row_ok", "row", "check whether a row of nine sudoku cells, with 0 for an empty cell, has no repeated digit",
     "sudoku_row_ok([5, 3, 0, 0, 7, 0, 0, 0, 5])", "False"),
    ("knight_moves", "square", "return the squares a chess knight can reach from a square such as 'b1', in sorted order",
     "knight_moves('b1')", "['a3', 'c3', 'd2']"),
    ("queens_attack", "a, b", "check whether two queens on a chessboard, at (row, col) positions a and b, attack each other",
     "queens_attack((2, 3), (5, 6))", "True"),
    # graphs
    ("topological_order", "graph", "return a topological order of a directed acyclic graph given as a dictionary of adjacency lists, taking nodes alphabetically when there is a choice",
     "topological_order({'a': ['c'], 'b': ['c'], 'c': []})", "['a', 'b', 'c']"),
    ("has_cycle", "graph", "check whether a directed graph given as a dictionary of adjacency lists contains a cycle",
     "has_cycle({1: [2], 2: [3], 3: [1]})", "True"),
    ("bfs_distances", "graph, start", "return the number of edges on a shortest path from start to every reachable node of an unweighted graph",
     "bfs_distances({'a': ['b', 'c'], 'b': ['d'], 'c': [], 'd': []}, 'a')", "{'a': 0, 'b': 1, 'c': 1, 'd': 2}"),
    ("connected_components", "n, edges", "count the connected components of an undirected graph with nodes 0 to n - 1 and the given edges",
     "connected_components(5, [(0, 1), (1, 2), (3, 4)])", "2"),
    # bits
    ("reverse_bits", "n, width", "reverse the order of the lowest width bits of an integer",
     "reverse_bits(3, 4)", "12"),
    ("hamming_distance", "a, b", "count the bit positions at which two non-negative integers differ",
     "hamming_distance(1, 4)", "2"),
    ("gray_code", "n", "return the n-bit reflected Gray code sequence as a list of integers",
     "gray_code(2)", "[0, 1, 3, 2]"),
    ("swap_adjacent_bits", "n", "swap every even-positioned bit of a non-negative integer with the odd-positioned bit just above it",
     "swap_adjacent_bits(11)", "7"),
    ("total_set_bits", "n", "count the set bits in all the integers from 1 to n together",
     "total_set_bits(5)", "7"),
    ("bit_parity", "n", "return 1 if a non-negative integer has an odd number of set bits and 0 otherwise",
     "bit_parity(7)", "1"),
    ("pack_flags", "flags", "pack a list of booleans into an integer, with the first boolean as the lowest bit",
     "pack_flags([True, False, True, True])", "13"),
    ("unpack_flags", "n, width", "unpack the lowest width bits of an integer into a list of booleans, lowest bit first",
     "unpack_flags(13, 4)", "[True, False, True, True]"),
    # text processing
    ("sentence_split", "text", "split a paragraph into sentences that end in '.', '!' or '?'",
     "sentence_split('Hi there. How are you? Great!')", "['Hi there.', 'How are you?', 'Great!']"),
    ("average_word_length", "text", "return the average length of the words of a text, ignoring punctuation, rounded to two decimals",
     "average_word_length('I love green tea!')", "3.25"),
    ("top_words", "text, n", "return the n most frequent words of a text in lower case, with ties broken alphabetically",
     "top_words('b a c b a b', 2)", "['b', 'a']"),
    ("justify_line", "words, width", "spread words over a line of exactly width characters by widening the gaps, giving any extra spaces to the leftmost gaps",
     "justify_line(['a', 'bb', 'c'], 9)", "'a   bb  c'"),
    ("ngrams", "words, n", "return the n-grams of a list of words, each joined with a space",
     "ngrams(['to', 'be', 'or', 'not'], 2)", "['to be', 'be or', 'or not']"),
    ("reading_time", "text, wpm", "estimate the reading time of a text in whole minutes, rounding up, at a given number of words per minute",
     "reading_time('word ' * 450, 200)", "3"),
    ("highlight", "text, word", "wrap every whole-word occurrence of a word in a text with asterisks, ignoring case",
     "highlight('Cat and cat toys', 'cat')", "'*Cat* and *cat* toys'"),
    ("remove_duplicate_words", "text", "remove repeated words from a sentence, keeping the first occurrence of each and ignoring case",
     "remove_duplicate_words('the cat The dog cat')", "'the cat dog'"),
    ("one_letter_apart", "a, b", "check whether two words of equal length differ in exactly one letter",
     "one_letter_apart('cold', 'cord')", "True"),
    ("longest_sentence", "text", "return the sentence of a paragraph that has the most words",
     "longest_sentence('I ran. Then I sat down. Done.')", "'Then I sat down.'"),
    ("mask_emails", "text", "replace the user part of every email address in a text with '***'",
     "mask_emails('mail bob@x.com now')", "'mail ***@x.com now'"),
    # everyday arithmetic
    ("tip_split", "bill, tip_percent, people", "split a restaurant bill plus a percentage tip evenly between people, rounded to cents",
     "tip_split(80, 15, 4)", "23.0"),
    ("compound_interest", "principal, rate, years", "return the balance after compounding a yearly interest rate given in percent, rounded to two decimals",
     "compound_interest(1000, 5, 2)", "1102.5"),
    ("bmi_category", "weight, height", "compute the body mass index from kilograms and metres and return 'under', 'normal', 'over' or 'obese'",
     "bmi_category(70, 1.75)", "'normal'"),
    ("mean_and_stdev", "nums", "return the mean and the population standard deviation of a list of numbers",
     "mean_and_stdev([2, 4, 4, 4, 5, 5, 7, 9])", "(5.0, 2.0)"),
    ("percentile", "nums, p", "return the p-th percentile of a list of numbers with the nearest-rank method",
     "percentile([15, 20, 35, 40, 50], 40)", "20"),
    ("linear_regression", "xs, ys", "fit a least-squares line through points and return its slope and intercept",
     "linear_regression([1, 2, 3], [2, 4, 6])", "(2.0, 0.0)"),
]

def _code2_prompts() -> list[str]:
    """Three prompts per task above: the MBPP shape, a HumanEval-shaped stub whose docstring carries the
    example as a doctest, and either the MBPP shape with an assert test or a typed version with complexity."""
    out = []
    for i, (name, args, what, call, result) in enumerate(_CODE_TASKS_2):
        noun = "class" if name[0].isupper() else "function"
        out.append(f"Write a {'python ' if i % 2 else ''}{noun} to {what}.")
        doc = f'    """ {what[0].upper() + what[1:]}.\n    >>> {call}\n    {result}\n    """\n'
        if noun == "class":  # the example is a few statements on one doctest line
            out.append(HUMANEVAL_WRAP.format(prompt=f"class {name}:\n{doc}\n    def __init__(self{', ' * bool(args)}{args}):\n"))
        else:
            out.append(HUMANEVAL_WRAP.format(prompt=f"def {name}({args}):\n{doc}"))
        if i % 2:
            *setup, last = call.split("; ") if noun == "class" else [call]
            test = "\n".join(setup + [f"assert {last} == {result}"])
            out.append(f"Write a {noun} to {what}. Your code should pass this test:\n\n{test}")
        else:
            sig, cost = (name, "the time and space complexity of each method") if noun == "class" else (
                f"{name}({args})", "its time and space complexity")
            out.append(f"Write a Python {noun} `{sig}` with type hints to {what}. Then state {cost}.")
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

def _talk2_prompts(n: int, rng: random.Random) -> list[str]:
    """More open-ended chat in MT-Bench's eight categories (writing, roleplay, reasoning, math, coding,
    extraction, STEM, humanities): larger word lists and several templates per category, made up here."""
    pick = rng.choice
    names = ["Amara", "Ben", "Carla", "Dmitri", "Elena", "Felix", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Luca",
             "Maya", "Nikhil", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Ximena",
             "Yusuf", "Zoe", "Aiko", "Bruno", "Chloe", "Diego"]
    surnames = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Silva", "Novak", "Haddad", "Kowalski", "Fischer", "Mensah",
                "Rossi", "Park", "Costa", "Ivanova", "Byrne", "Sato"]
    cities = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Lima", "Melbourne", "Cairo", "Oslo", "Hanoi",
              "Bogota", "Dublin", "Pune", "Seville", "Tbilisi", "Auckland"]
    paragraphs = [
        "Our team spent three months testing the new app. Users liked the clean design, but many found the sign-up "
        "process confusing, and about a third gave up before finishing it.",
        "The town library will close for renovations from March to June. During this time, books can be borrowed "
        "from a mobile van that will visit the market square every Tuesday and Friday.",
        "I tried the new noodle bar on Elm Street yesterday. The broth was rich and the service was quick, "
        "although the room was loud and the prices were a little high for the portion size.",
        "Scientists measured the temperature of the lake every week for ten years. They found that the water is "
        "warming faster in spring than in autumn, which may change when fish lay their eggs.",
        "The quarterly results were mixed. Sales grew by eight percent, but shipping costs rose even faster, so "
        "profits fell slightly compared with the same period last year.",
        "Many people think that houseplants need water every day. In fact, most common plants prefer to dry out a "
        "little between waterings, and too much water is the most frequent cause of failure.",
        "The festival starts at noon with a parade, followed by food stalls and live music in the park. Fireworks "
        "begin at nine, weather permitting, and the last bus home leaves at eleven.",
        "Learning the piano as an adult is slow at first. Fingers feel clumsy and reading music is tiring, but "
        "short daily practice sessions make a clear difference within a few weeks.",
        "The startup promises to deliver groceries within fifteen minutes. To do this, it runs small warehouses in "
        "every neighbourhood, which critics say take space away from ordinary shops.",
        "After the storm, volunteers cleared fallen branches from the trail and rebuilt two small bridges. The "
        "path reopened on Saturday, and rangers ask hikers to stay on the marked routes.",
        "Our school started a breakfast club in September. Attendance in the first lesson has improved, teachers "
        "report calmer classrooms, and the club now serves around sixty pupils a day.",
        "The museum's new exhibition brings together 120 maps drawn between 1500 and 1800. Visitors can zoom into "
        "digital copies, and a small room shows how the printing plates were engraved.",
    ]

    # writing: emails, rewrites, pieces, brainstorming, itineraries, recipes, headlines
    recipients = ["my landlord", "a former teacher", "the hiring manager at a design studio", "my team at work",
                  "a neighbour", "the organiser of a local marathon", "a customer whose parcel arrived damaged",
                  "my professor", "a potential business partner", "the city council", "an old friend I lost touch with",
                  "the school's parent association", "a hotel manager", "a supplier who delivered late",
                  "a new colleague who starts next week"]
    purposes = ["asking to postpone our meeting by a week", "thanking them for their help last month",
                "proposing a small change to the schedule", "explaining why a project is running late",
                "requesting a refund", "inviting them to a charity dinner", "asking for a letter of recommendation",
                "reporting a broken heater", "following up on an unanswered message",
                "suggesting a community clean-up day", "announcing that I am leaving the company",
                "asking for feedback on a draft report", "politely declining an invitation",
                "apologising for a billing mistake", "introducing a new volunteer programme",
                "asking to split a shared cost fairly"]
    tones = ["polite but firm", "warm and friendly", "short and professional", "formal", "upbeat",
             "apologetic but confident"]
    styles = ["as a formal business memo", "for a ten-year-old reader", "in a more persuasive tone",
              "in the voice of a sports commentator", "as a short rhyming poem", "in plain language without jargon",
              "as a friendly text message", "in half as many words", "as a news headline plus one lead sentence",
              "in the style of a fairy tale", "with a more optimistic tone", "in the second person"]
    forms = ["a travel blog post", "a short story", "a poem in free verse", "an opinion column",
             "a newsletter introduction", "a bedtime story for children", "a radio advert script",
             "a speech for a school assembly", "a wedding toast", "a short film synopsis", "a letter to my future self",
             "a sonnet", "a social media post", "a museum placard", "a podcast episode outline"]
    subjects = ["a week spent sailing between Greek islands", "a grandmother's secret recipe",
                "the first snowfall of the year", "a robot that works as a gardener", "a city without cars",
                "learning to swim at forty", "a forgotten train station", "a friendship between a fox and a crow",
                "the night the power went out", "a small town's pumpkin contest", "moving to a new country",
                "a street musician", "the joy of repairing old things", "a lighthouse keeper's last shift",
                "a weekend planting trees", "a rival bakery opening across the street",
                "an astronaut's first morning on the Moon", "a dog who hates walks", "growing up with many siblings",
                "cycling across the Netherlands", "a library that lends tools", "an unusual family tradition",
                "the first day of retirement", "a market in Marrakesh at dusk", "a student who fails and tries again",
                "a garden on a city rooftop", "a chess game in a park", "a mountain village in winter",
                "the smell of rain", "an inventor whose ideas keep failing"]
    angles = ["", " in under 200 words", " with a surprising ending", " from the point of view of a child",
              " using vivid sensory details", " with a hopeful tone", " in exactly three paragraphs",
              " that ends with a question to the reader"]
    idea_kinds = ["creative names", "slogans", "fundraising ideas", "party themes", "gift ideas",
                  "icebreaker questions", "blog post titles", "low-cost activities", "marketing ideas"]
    contexts = ["a neighbourhood coffee shop", "a school science fair", "a bicycle repair business",
                "a company team-building day", "a podcast about local history", "a charity fun run",
                "a vegan food truck", "a board game cafe", "a children's summer camp", "a small online bookshop",
                "a retirement party", "a community garden", "an app that reminds people to drink water",
                "a rainy weekend with teenagers", "a pottery studio"]
    travellers = ["a family with two young children", "a solo traveller on a tight budget",
                  "a couple celebrating an anniversary", "two friends who love hiking",
                  "retired parents who prefer a slow pace", "a group of university students"]
    places = ["Kyoto", "Lisbon", "Mexico City", "Cape Town", "Edinburgh", "Vancouver", "Istanbul", "Hanoi",
              "Buenos Aires", "the south coast of Iceland", "the Amalfi Coast", "Marrakesh", "Seoul", "Prague",
              "New Zealand's South Island"]
    focuses = ["with a focus on local food", "including one day-long excursion", "avoiding the busiest tourist spots",
               "with indoor options for rainy days", "using only public transport", "with a rough budget for each day"]
    dishes = ["a vegetable curry", "banana bread", "a lentil soup", "pizza dough from scratch", "a summer salad",
              "fluffy pancakes", "a tofu stir-fry", "oat cookies", "a mushroom risotto", "a chickpea stew",
              "fish tacos", "a quiche", "roasted root vegetables", "a simple loaf of bread", "a tomato pasta sauce",
              "an apple crumble"]
    diets = ["serves four", "takes less than 30 minutes", "uses no dairy", "a beginner can follow", "is gluten-free",
             "can be made a day ahead", "needs only one pot", "children will enjoy"]
    news = ["a city that turned its car parks into parks", "a new battery that charges in five minutes",
            "a teenager who discovered a comet", "a village that runs entirely on solar power",
            "scientists teaching bees to count", "the return of wolves to a European forest",
            "a library open around the clock", "a study showing that naps improve memory",
            "a startup recycling old clothes into insulation", "a record-breaking heatwave in the Arctic",
            "a robot that sorts recycling", "a town that banned phones at dinner time"]
    writing = [
        lambda: f"Write an email to {pick(recipients)} {pick(purposes)}. The tone should be {pick(tones)}.",
        lambda: f"Rewrite the following paragraph {pick(styles)}:\n\n{pick(paragraphs)}",
        lambda: f"Compose {pick(forms)} about {pick(subjects)}{pick(angles)}.",
        lambda: f"Brainstorm {pick([5, 6, 8, 10])} {pick(idea_kinds)} for {pick(contexts)}, with a short reason for each.",
        lambda: f"Plan a {rng.randint(2, 7)}-day trip to {pick(places)} for {pick(travellers)}, {pick(focuses)}.",
        lambda: f"Give me a recipe for {pick(dishes)} that {pick(diets)}. List the ingredients first, then the steps.",
        lambda: f"Suggest {pick([3, 4, 5])} catchy headlines for an article about {pick(news)}, and say which one you prefer.",
    ]

    # roleplay: characters, situations with the user, advice from a figure
    roles = ["a ship's captain during a storm", "a detective who has just solved a case", "a personal trainer",
             "a travel agent", "a grumpy museum guard", "a kind primary-school teacher",
             "a famous chef judging a cooking contest", "a startup mentor", "a medieval innkeeper", "a park ranger",
             "a sommelier", "a time traveller from the year 2300", "a job interviewer at a tech company",
             "a dentist calming a nervous patient", "a football coach at half-time with the team losing",
             "a film director on the first day of shooting", "a career counsellor", "a flight attendant", "a zookeeper",
             "a merchant in ancient Rome", "a wedding planner", "a mountain guide", "an estate agent",
             "a village fortune teller", "a debate moderator", "a marine biologist", "an art critic",
             "a financial adviser", "a lighthouse keeper", "a radio DJ on a night shift"]
    role_asks = ["Stay in character and greet me as I walk in.",
                 "Tell me what you love and what you dislike about your work.",
                 "Describe the most memorable day of your career.", "Give me three pieces of advice in your own voice.",
                 "Explain what you expect from me today.", "Answer in character: what makes a good day?",
                 "Describe your surroundings as I would see them.",
                 "Tell me a short story about something that happened last week."]
    scenes = [("a hotel receptionist", "I arrive late at night and my booking has been lost."),
              ("a car salesperson", "I want a cheap, reliable car but I keep changing my mind."),
              ("a doctor", "I have come in with a cough that will not go away, and I am worried."),
              ("a landlord", "I am calling to complain about a leaking roof."),
              ("a bank clerk", "I have forgotten my PIN and need cash today."),
              ("a tour guide in Venice", "I have just joined your walking tour twenty minutes late."),
              ("a waiter", "my soup is cold and I am in a hurry."),
              ("a tech support agent", "my laptop will not start after an update."),
              ("a neighbour", "my dog barked all night and you are exhausted."),
              ("a pharmacist", "I need advice about a mild pollen allergy."),
              ("a librarian", "I need sources for an essay on ocean plastic."),
              ("a shoe shop assistant", "I want to return shoes I have already worn once."),
              ("a museum guide", "I am a bored teenager on a school trip."),
              ("a ship's captain", "I am a stowaway who has just been discovered."),
              ("a driving instructor", "I have failed my driving test for the third time."),
              ("a customs officer", "I am bringing a large wheel of cheese into the country.")]
    moods = ["", " I am quite impatient.", " I am very shy.", " I am polite but sceptical.", " I am in a great mood.",
             " I only speak in short sentences."]
    figures = ["Marie Curie", "Leonardo da Vinci", "Ada Lovelace", "a Viking explorer", "Sherlock Holmes", "Socrates",
               "a 1950s radio host", "a retired superhero", "Cleopatra", "Charles Darwin", "Frida Kahlo",
               "a pirate quartermaster"]
    audiences = ["a group of new university students", "a nervous first-time parent", "a young inventor",
                 "someone starting their first job", "a team that has just lost an important match"]
    themes = ["taking risks", "dealing with criticism", "finding a purpose", "working with difficult people",
              "learning from failure", "staying curious", "making hard decisions", "managing time"]
    roleplay = [
        lambda: f"Act as {pick(roles)}. {pick(role_asks)}",
        lambda: "Let's do a role-play. You are {}, and the situation is this: {}{} Start the conversation.".format(*pick(scenes), pick(moods)),
        lambda: f"Imagine you are {pick(figures)}. Give {pick(audiences)} your advice on {pick(themes)}.",
    ]

    # reasoning: small puzzles with random names and numbers
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    groups = [("cats", "animals", "pets"), ("roses", "flowers", "red things"), ("pilots", "people who can fly a plane", "teachers"),
              ("violins", "instruments", "old objects"), ("squares", "rectangles", "blue shapes"),
              ("novels", "books", "bestsellers"), ("apples", "fruits", "green things"), ("whales", "mammals", "fast swimmers")]
    def ages():
        a, b, c, d = rng.sample(names, 4)
        return (f"{a} is older than {b}, {c} is younger than {b}, and {d} is older than {a}. Who is the second "
                f"oldest of the four? Explain your reasoning.")
    def race():
        a, b, c, d = rng.sample(names, 4)
        return (f"Four runners finish a race. {a} finished ahead of {b} but behind {c}, and {d} crossed the line "
                f"right after {b}. What was the finishing order? Explain how you know.")
    def family():
        a, b, c, d = rng.sample(names, 4)
        return f"{a} is {b}'s mother, {c} is {a}'s father, and {d} is {c}'s only son. How is {d} related to {b}?"
    def liars():
        a, b, c = rng.sample(names, 3)
        return (f"{a} says that {b} is lying. {b} says that {c} is lying. {c} says that both {a} and {b} are lying. "
                f"Who is telling the truth? Show your reasoning.")
    def seats():
        a, b, c, d, e = rng.sample(names, 5)
        return (f"{a}, {b}, {c}, {d} and {e} sit in a row of five chairs. {a} sits at one end, {d} sits in the middle, "
                f"{e} sits next to {a}, and {b} sits next to {c}. Give a valid seating order and explain each step.")
    def syllogism():
        x, y, z = pick(groups)
        return f"All {x} are {y}. Some {y} are {z}. Does it follow that some {x} are {z}? Explain why or why not."
    def stickers():
        a, b, c = rng.sample(names, 3)
        return (f"{a} has {6 * rng.randint(2, 9)} stickers and gives a third of them to {b}, who then gives half of "
                f"those to {c}. How many stickers does each of them end up with?")
    reasoning = [
        ages, race, family, liars, seats, syllogism, stickers,
        lambda: (f"If today is {pick(days)}, what day of the week will it be {rng.randint(10, 1000)} days from now? "
                 f"Explain how you worked it out."),
        lambda: (f"A clock shows {rng.randint(1, 12)}:{pick(['05', '10', '15', '20', '30', '40', '45', '50'])}. What is "
                 f"the smaller angle between the hour and minute hands? Think step by step."),
        lambda: (f"You have {pick([8, 9, 12, 13, 27, 30])} coins that look identical, but one is slightly "
                 f"{pick(['heavier', 'lighter'])} than the rest. With a balance scale, what is the smallest number of "
                 f"weighings that always finds it? Describe the strategy."),
    ]

    # math: word problems with random numbers
    def shop():
        x, p, y, q = rng.randint(2, 6), rng.randint(2, 6), rng.randint(2, 8), rng.randint(1, 3)
        return (f"{pick(names)} buys {x} notebooks at ${p} each and {y} pens at ${q} each, and pays with a "
                f"${50 if x * p + y * q < 50 else 100} note. How much change is given?")
    def ages_math():
        k, b = rng.randint(3, 5), rng.randint(2, 12)
        a, c = rng.sample(names, 2)
        return (f"{a} is {k} times as old as {c}. In {b * (k - 2)} years, {a} will be twice as old as {c}. How old are "
                f"they now?")
    def sum_product():
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        return f"The sum of two numbers is {a + b} and their product is {a * b}. What are the two numbers? Show your steps."
    def mixture():
        b, c, a = sorted(rng.sample(range(5, 60, 5), 3))
        return (f"How many litres of a {a}% salt solution must be added to {rng.randint(2, 20)} litres of a {b}% "
                f"solution to get a {c}% solution?")
    def sequence():
        a, d, kind = rng.randint(1, 9), rng.randint(2, 7), rng.randrange(3)
        seq = [[a + d * i, a * d ** i, (a + i) ** 2 + d][kind] for i in range(5)]
        return f"What is the next number in the sequence {', '.join(map(str, seq))}? Explain the pattern."
    def painters():
        a, b = rng.sample(names, 2)
        return (f"{a} can paint a fence in {rng.randint(2, 9)} hours and {b} can paint it in {rng.randint(3, 12)} hours. "
                f"How long does it take if they work together?")
    def average():
        k, m = rng.randint(3, 6), rng.randint(60, 85)
        return (f"After {k} tests, {pick(names)}'s average score is {m}. What score is needed on the next test to raise "
                f"the average to {m + rng.randint(1, 3)}?")
    def triangle():
        (x1, y1), (x2, y2), (x3, y3) = ((rng.randint(-5, 5), rng.randint(-5, 5)) for _ in range(3))
        return (f"Find the area of the triangle with corners at ({x1}, {y1}), ({x2}, {y2}) and ({x3}, {y3}), and explain "
                f"the method you used.")
    def flour():
        p = rng.randint(2, 6)
        return (f"A recipe needs {rng.randint(2, 9) * 50} grams of flour for {p} people. How much flour is needed for "
                f"{p + rng.randint(3, 20)} people, and how many 500-gram bags should I buy?")
    maths = [
        shop, ages_math, sum_product, mixture, sequence, painters, average, triangle, flour,
        lambda: (f"A train covers {rng.randint(4, 30) * 10} km at {rng.randint(6, 12) * 10} km/h and then "
                 f"{rng.randint(4, 30) * 10} km at {rng.randint(6, 12) * 10} km/h. What is its average speed for the "
                 f"whole journey?"),
        lambda: (f"A jacket costs ${rng.randint(40, 200)}. It is reduced by {pick([10, 15, 20, 25, 30])}% and then by a "
                 f"further {pick([5, 10, 20])}% at the till. What is the final price, and what single discount would "
                 f"give the same result?"),
        lambda: (f"A rectangular garden measures {rng.randint(5, 30)} m by {rng.randint(5, 30)} m, and a path "
                 f"{pick([1, 1.5, 2])} m wide runs all the way around the outside. What is the area of the path?"),
        lambda: (f"A box holds {rng.randint(2, 8)} red, {rng.randint(2, 8)} green and {rng.randint(2, 8)} blue balls. "
                 f"Two are drawn without replacement. What is the probability that they have different colours?"),
        lambda: (f"If you invest ${rng.randint(5, 50) * 100} at {pick([2, 3, 4, 5, 6, 8])}% interest compounded yearly, "
                 f"how much will you have after {rng.randint(2, 15)} years? Roughly how long until the money doubles?"),
    ]

    # coding: programs, concept comparisons, complexity, SQL, design, regular expressions
    langs = ["Python", "JavaScript", "TypeScript", "Java", "C++", "Go", "Rust", "C#"]
    programs = ["reads a CSV file of expenses and prints the total for each category",
                "logs every new file that appears in a folder",
                "checks whether every link in a Markdown file still works",
                "simulates rolling two dice ten thousand times and prints how often each sum appears",
                "renames all photos in a folder by the date they were taken",
                "counts the lines of code in a project, skipping blank lines and comments",
                "converts a JSON file of users into a CSV file",
                "finds duplicate files in a directory by comparing their contents",
                "keeps a command-line to-do list saved in a file",
                "merges two sorted files of numbers into one sorted file",
                "plays tic-tac-toe against the user in the terminal", "generates random passwords of a chosen length",
                "reports the ten most frequent IP addresses in a web server log",
                "solves a sudoku puzzle with backtracking",
                "implements a binary search tree with insert, search and delete",
                "finds the shortest route between two cities in a weighted graph",
                "allows at most N requests per minute for each user",
                "checks that an email address, phone number and postcode are well formed",
                "compresses a text file with Huffman coding",
                "computes a moving average over a stream of sensor readings",
                "converts every Roman numeral in a text into a number", "prints a calendar for any month and year"]
    differences = [("a list and a tuple", "Python"), ("== and is", "Python"), ("let, const and var", "JavaScript"),
                   ("an abstract class and an interface", "Java"), ("a pointer and a reference", "C++"),
                   ("a goroutine and an operating-system thread", "Go"), ("ownership and borrowing", "Rust"),
                   ("a deep copy and a shallow copy", "Python"), ("promises and callbacks", "JavaScript"),
                   ("a struct and a class", "C#"), ("INNER JOIN and LEFT JOIN", "SQL"), ("a HashMap and a TreeMap", "Java"),
                   ("a generator and a list", "Python"), ("stack and heap memory", "C++"),
                   ("interfaces and type aliases", "TypeScript")]
    algorithms = ["merge sort", "binary search", "building a heap from a list", "breadth-first search on a graph",
                  "inserting into a balanced binary search tree", "looking up a key in a hash table",
                  "quicksort in the worst case", "Dijkstra's algorithm with a binary heap",
                  "computing Fibonacci numbers with memoisation", "checking every pair in a list for duplicates"]
    tables = [("orders(id, customer_id, amount, created_at)", ["lists the five customers who spent the most in 2023",
               "shows the average order value for each month", "finds customers who have not ordered in the last 90 days"]),
              ("employees(id, name, department, salary, manager_id)", ["finds the highest-paid employee in each department",
               "lists every employee together with their manager's name", "counts employees per department, largest first"]),
              ("rentals(id, bike_id, start_time, end_time, station)", ["finds the busiest station on weekends",
               "computes the average rental length per bike", "lists bikes that were never rented in March"])]
    systems = ["a URL shortener", "a chat app for small teams", "a parking-garage booking system",
               "a library loan tracker", "a leaderboard for an online game",
               "a notification service that sends emails and text messages", "a photo-sharing site",
               "an online shop's shopping cart", "a ride-sharing app's driver matching",
               "a system that stores sensor readings from thousands of devices"]
    patterns = ["a UK postcode", "a time in 24-hour HH:MM format", "a hex colour code like #1a2b3c",
                "a date written as DD/MM/YYYY", "an IPv4 address",
                "a strong password with letters, digits and a symbol", "a simple email address",
                "a US phone number with optional dashes", "a price such as $12.99",
                "a semantic version number such as 2.10.3"]
    coding = [
        lambda: f"Write a {pick(langs)} program that {pick(programs)}. Add brief comments explaining the key steps.",
        lambda: "Explain the difference between {} in {}, with a short code example.".format(*pick(differences)),
        lambda: (f"What is the time complexity of {pick(algorithms)}? Explain why, and illustrate it with a small example "
                 f"in {pick(langs)}."),
        lambda: "Given a table {}, write a SQL query that {}. Explain the query briefly.".format(
            (t := pick(tables))[0], pick(t[1])),
        lambda: f"How would you design {pick(systems)}? Describe the main components, the data model and the trade-offs.",
        lambda: f"Write a regular expression that matches {pick(patterns)}, and explain each part of it.",
    ]

    # extraction: a made-up text or table to read
    jobs = ["a nurse", "an architect", "a chef", "a software engineer", "a teacher", "a pilot", "a journalist",
            "a carpenter", "a biologist"]
    companies = ["Northwind", "Bluepeak", "Sunfield Labs", "Harbor & Co", "Quillworks", "Greenline Energy"]
    products = ["a pair of wireless earbuds", "a standing desk", "a rice cooker", "a hiking backpack", "a smart watch",
                "an electric kettle", "a robot vacuum", "a yoga mat", "a phone case", "a coffee grinder"]
    opinions = ["works perfectly and arrived a day early", "broke after two weeks and support never replied",
                "is fine for the price, though the instructions were confusing",
                "is the best purchase I made this year", "looks great but is louder than I expected",
                "does the job, nothing more", "was missing a part, but the replacement came quickly",
                "feels cheap and I would not buy it again", "exceeded every expectation I had"]
    events = ["team meeting", "book club", "quarterly review", "volunteer briefing", "design workshop",
              "parent evening"]
    def people():
        rows = [(f"{p} {pick(surnames)}", pick(jobs), pick(cities), rng.randint(1995, 2024))
                for p in rng.sample(names, rng.randint(3, 4))]
        text = " ".join(f"{p}, {j} from {c}, joined {pick(companies)} in {y}." for p, j, c, y in rows)
        return f"Extract each person's name, job, city and starting year from the text below as a JSON list.\n\n{text}"
    def reviews():
        text = "\n".join(f"Review {i + 1}: I bought {pick(products)}. It {pick(opinions)}." for i in range(3))
        return (f"Rate each of the following reviews from 1 (very negative) to 5 (very positive), answering as a JSON "
                f"array of integers.\n\n{text}")
    def sales():
        stores, months = rng.sample(cities, 3), ["January", "February", "March", "April"]
        rows = "\n".join(f"| {m} | " + " | ".join(str(rng.randint(20, 99) * 10) for _ in stores) + " |" for m in months)
        return (f"Using the table below, which store had the highest total sales, and in which month were combined "
                f"sales lowest?\n\n| Month | {' | '.join(stores)} |\n|---|---|---|---|\n{rows}")
    def message():
        d1, d2 = rng.sample(days[:5], 2)
        bring = pick(["your laptop", "a printed agenda", "snacks to share", "the latest figures"])
        text = (f"Hi all, the {pick(events)} has moved from {d1} to {d2} at {rng.randint(9, 17)}:{pick(['00', '30'])} in "
                f"room {rng.randint(101, 420)}. Please bring {bring}. Thanks, {pick(names)}")
        return (f"Extract the event, the new day, the time, the room and what to bring from this message as a JSON "
                f"object.\n\n{text}")
    reads = ["List every number in the following text and what it refers to.",
             "Summarise the following text in one sentence of at most 20 words.",
             "Identify the main claim in the following text and the evidence given for it.",
             "Extract the key facts from the following text as a bulleted list.",
             "Write three questions that can be answered from the following text, with their answers."]
    extraction = [people, reviews, sales, message, lambda: f"{pick(reads)}\n\n{pick(paragraphs)}"]

    # STEM: step-by-step explanations, hypotheticals, experiments, comparisons, quick physics
    concepts = ["how vaccines train the immune system", "why the sky is blue", "how a refrigerator moves heat",
                "how batteries store energy", "how GPS works out your position", "how antibiotic resistance develops",
                "nuclear fission and fusion", "how a transistor works", "the Doppler effect",
                "how the heart pumps blood", "why ice floats", "how noise-cancelling headphones work",
                "how a compiler turns code into machine instructions", "the carbon cycle",
                "how earthquakes are measured", "how the eye focuses light", "how solar panels make electricity",
                "how DNA is copied", "why the Moon has phases", "how aeroplane wings create lift",
                "how search engines rank pages", "how tides form", "what causes the seasons",
                "how a microwave oven heats food", "how enzymes speed up reactions",
                "how a rocket accelerates in empty space", "how encryption keeps online payments safe",
                "how sound travels", "how the kidneys filter blood", "what pH measures",
                "how memories are stored in the brain", "how 3D printers build objects",
                "how suspension bridges carry heavy loads", "what causes lightning",
                "how fibre-optic cables carry data", "how rainbows form",
                "how the immune system remembers an infection", "how a neural network learns from examples"]
    levels = ["", " for a high-school student", " using an everyday analogy", " in under 150 words",
              " for someone with no science background", ", and mention one common misconception"]
    whatifs = ["the Earth stopped rotating", "the Moon were twice as close to the Earth",
               "humans could photosynthesise", "all insects disappeared", "water got denser as it froze",
               "the Earth had no magnetic field", "gravity on Earth doubled overnight", "the Sun suddenly disappeared",
               "the oceans were fresh water", "you boiled water at the top of Mount Everest",
               "the Earth's axis were not tilted", "copper stopped conducting electricity"]
    hypotheses = ["plants grow faster with music", "salt water freezes more slowly than fresh water",
                  "bread goes mouldy faster in the dark", "dark colours absorb more heat",
                  "caffeine improves short-term memory",
                  "paper towels of different brands absorb different amounts of water", "ants prefer sugar to salt",
                  "a ball bounces higher when it is warm"]
    pairs = ["mitosis and meiosis", "AC and DC electricity", "speed and velocity", "viruses and bacteria",
             "RAM and disk storage", "comets and asteroids", "conduction and convection", "DNA and RNA", "TCP and UDP",
             "acids and bases", "ionic and covalent bonds", "weather and climate", "stars and planets",
             "kinetic and potential energy"]
    stem = [
        lambda: f"Explain {pick(concepts)} step by step{pick(levels)}.",
        lambda: f"What would happen if {pick(whatifs)}? Explain the science behind your answer.",
        lambda: (f"Design a simple experiment to test whether {pick(hypotheses)}. Describe the variables, the method and "
                 f"the result that would support the idea."),
        lambda: f"Compare {pick(pairs)}: how are they similar, and how do they differ?",
        lambda: (f"A ball is dropped from a height of {rng.randint(2, 80)} m. Ignoring air resistance, how long does it "
                 f"take to reach the ground, and how fast is it going? Show your working."),
        lambda: (f"How much energy does it take to heat {rng.randint(1, 5)} litres of water from {rng.randint(5, 25)} to "
                 f"{rng.randint(60, 100)} degrees Celsius? Explain the formula you use."),
    ]

    # humanities: history, debates, philosophy, social science, literature and art, reading lists
    histories = ["the invention of the printing press", "the fall of the Western Roman Empire", "the Meiji Restoration",
                 "the abolition of the transatlantic slave trade", "the Silk Road trade routes",
                 "the Protestant Reformation", "the Harlem Renaissance", "the partition of India",
                 "the Apollo programme", "the Black Death", "the Marshall Plan", "the Magna Carta",
                 "the founding of the United Nations", "decolonisation in Africa", "the invention of the telegraph",
                 "the Green Revolution in agriculture", "the fall of the Berlin Wall", "the women's suffrage movement",
                 "the Great Depression", "the Columbian exchange"]
    areas = ["politics", "everyday life", "the economy", "art and culture", "science", "education",
             "international relations"]
    motions = ["primary schools should abolish homework", "social media does more harm than good",
               "museums should return artefacts to their countries of origin", "voting should be compulsory",
               "space exploration is worth its cost", "city centres should be car-free",
               "every adult should receive a basic income", "zoos should be phased out",
               "art made with AI should be allowed to win prizes", "university should be free",
               "the four-day working week should become standard",
               "tourism harms small islands more than it helps them"]
    thinkers = ["Aristotle", "Confucius", "Immanuel Kant", "John Stuart Mill", "Simone de Beauvoir",
                "Friedrich Nietzsche", "David Hume", "Hannah Arendt", "Epicurus", "Thomas Hobbes", "Laozi",
                "Jean-Paul Sartre"]
    questions = ["what makes an action right?", "what is a good life?", "is it ever acceptable to lie?",
                 "where does a government's authority come from?", "what is freedom?",
                 "should happiness be our main goal?", "what do we owe to strangers?",
                 "can we know anything for certain?", "what makes a true friend?"]
    ideas = ["comparative advantage", "the tragedy of the commons", "moral hazard", "diminishing returns",
             "price elasticity", "the prisoner's dilemma", "public goods", "the bystander effect", "confirmation bias",
             "soft power", "gentrification", "the sunk cost fallacy", "network effects", "the social contract",
             "cultural relativism"]
    works = ["Homer's Odyssey", "Shakespeare's Macbeth", "Orwell's Nineteen Eighty-Four", "Achebe's Things Fall Apart",
             "Mary Shelley's Frankenstein", "Cervantes' Don Quixote", "Austen's Pride and Prejudice",
             "Garcia Marquez's One Hundred Years of Solitude", "The Tale of Genji", "Picasso's Guernica",
             "Beethoven's Ninth Symphony", "Dostoevsky's Crime and Punishment", "The Epic of Gilgamesh",
             "Tolstoy's War and Peace"]
    fields = ["how economies grow", "the history of medicine", "why empires rise and fall", "how languages change",
              "the ethics of technology", "the history of mathematics", "modern architecture", "how democracy works"]
    humanities = [
        lambda: f"Discuss {pick(histories)} and its lasting impact on {pick(areas)}.",
        lambda: pick(["Write short opening statements for both sides of the debate: {m}.",
                      "Give the three strongest arguments for and against the claim that {m}, then say which side "
                      "convinces you more.",
                      "Argue in one persuasive paragraph that {m}."]).format(m=pick(motions)),
        lambda: "How would {} and {} each answer the question: {} Compare their views.".format(
            *rng.sample(thinkers, 2), pick(questions)),
        lambda: f"What is meant by {pick(ideas)}? Illustrate the idea with a real-world example.",
        lambda: f"Analyse the main themes of {pick(works)} and explain why it still matters today.",
        lambda: (f"Recommend {pick([3, 4, 5])} books for someone who wants to understand {pick(fields)}, with one "
                 f"sentence on each."),
    ]
    categories = [writing, roleplay, reasoning, maths, coding, extraction, stem, humanities]
    return _unique(lambda: pick(pick(categories))(), n)


# Modules of Python's standard library whose docstrings `docs` turns into requests: the documentation of
# installed code, as users paste it to an assistant. Read from the running interpreter, so no text is stored here.
DOC_MODULES = ("argparse", "bisect", "base64", "calendar", "collections", "contextlib", "copy", "csv", "dataclasses",
               "datetime", "decimal", "difflib", "enum", "fnmatch", "fractions", "functools", "glob", "gzip",
               "hashlib", "heapq", "html", "io", "ipaddress", "itertools", "json", "logging", "math", "operator",
               "os", "os.path", "pathlib", "pickle", "pprint", "queue", "random", "re", "secrets", "shlex",
               "shutil", "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "tempfile",
               "textwrap", "threading", "time", "typing", "unicodedata", "urllib.parse", "uuid", "zipfile", "zlib")

_DOC_ASKS = (  # {name}: the documented object, {doc}: its docstring (first paragraphs), {other}: a sibling
    "Explain in plain words what `{name}` does, with a short example.\n\n{doc}",
    "Summarize this Python documentation in two or three sentences:\n\n{doc}",
    "Rewrite this documentation so that a beginner can follow it:\n\n{doc}",
    "Here is the documentation of `{name}`:\n\n{doc}\n\nWrite a small program that uses it.",
    "Turn this documentation of `{name}` into a bulleted list of the key points:\n\n{doc}",
    "What does `{name}` in Python do, and when would I use it?",
    "What is the difference between `{name}` and `{other}`?",
    "Give three common mistakes people make when using `{name}`, and how to avoid them.",
    "I read this in the Python docs and don't understand it. Can you help?\n\n{doc}",
    "Write a function that uses `{name}` to solve a practical problem, and explain each line.",
    "Write unit tests that show how `{name}` behaves, based on its documentation:\n\n{doc}",
    "Is `{name}` the right tool for parsing user input? Explain when it is and when it isn't.",
)


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
    """Requests about the documentation of installed code: explain, summarize, rewrite, use this API."""
    named = _documented_names()
    if not named:
        return []

    def make():
        name, doc = rng.choice(named)
        mod = name.rsplit(".", 1)[0]
        siblings = [m for m, _ in named if m.rsplit(".", 1)[0] == mod and m != name] or [m for m, _ in named]
        return rng.choice(_DOC_ASKS).format(name=name, doc=doc, other=rng.choice(siblings))
    return _unique(make, n)


# Follow-up turns for multi-turn prompts (`python -m dflash2.train prompts --kind multi-turn`).
FOLLOW_UPS = (
    "Can you make that shorter?", "Give me a concrete example.", "Explain that like I'm ten years old.",
    "Why is that?", "What are the downsides?", "Can you put that in a table?", "Now say it as a short poem.",
    "Can you turn that into a checklist?", "What would an expert add to this?", "Which part is the most important?",
    "Can you write that more formally?", "Make it friendlier, please.", "What's a common misconception about this?",
    "How would I explain this to my manager in two sentences?", "Can you give me three alternatives?",
    "What should I do first?", "Is there anything wrong in your answer? Check it.", "Summarize that in one line.",
    "Can you add a short code example?", "What questions should I ask next?", "Rewrite it as a numbered list.",
    "How long would that take, roughly?", "What if I only had half the budget?", "Thanks! One more thing: why does it matter?",
)

# Topics and request kinds the target writes its own questions from (`prompts --kind self-instruct`).
SELF_INSTRUCT_TOPICS = (
    "cooking dinner on a budget", "baking bread", "vegetable gardening", "houseplants", "keeping a dog", "cats",
    "bird watching", "running a first marathon", "strength training", "yoga", "sleep habits", "stress at work",
    "job interviews", "writing a resume", "asking for a raise", "starting a small business", "personal budgeting",
    "saving for retirement", "buying a used car", "renting an apartment", "moving to a new city", "learning guitar",
    "learning to draw", "photography", "writing a novel", "poetry", "public speaking", "negotiation",
    "time management", "studying for exams", "learning Spanish", "teaching kids to read", "parenting teenagers",
    "planning a wedding", "hosting a party", "board games", "video game design", "chess", "travel in Japan",
    "a road trip across the United States", "camping", "hiking safety", "the history of ancient Rome",
    "the Industrial Revolution", "World War I", "the Renaissance", "the Silk Road", "the Cold War",
    "the solar system", "black holes", "evolution", "the human immune system", "nutrition", "the brain and memory",
    "climate and weather", "volcanoes", "the oceans", "renewable energy", "electric cars", "recycling",
    "how the internet works", "smartphones", "cybersecurity at home", "passwords", "spreadsheets", "SQL databases",
    "Python programming", "JavaScript", "web design", "Linux command line", "git", "machine learning",
    "statistics", "probability puzzles", "geometry", "algebra homework", "philosophy of mind", "ethics",
    "economics of inflation", "the stock market", "taxes", "law and contracts", "customer service",
    "marketing a product", "team management", "remote work", "email etiquette", "writing a speech", "movies",
    "music theory", "jazz", "architecture", "interior design", "fashion", "car maintenance", "home repair",
    "first aid", "mental health", "friendship", "dating", "volunteering", "city planning", "public transport",
)
SELF_INSTRUCT_KINDS = (
    "an explanation of how something works", "practical advice for their situation", "step-by-step instructions",
    "a comparison of two options", "a short story", "a poem", "a list of ideas", "a summary of a topic",
    "a definition and an example", "pros and cons", "a plan or schedule", "a short piece of code",
    "help fixing a mistake", "a recommendation", "an email or letter written for them", "an opinion with reasons",
)


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


def chat_ids(tokenizer, prompt, system: str | None = None) -> list[int]:
    """Token ids of a prompt through the target's chat template, with the generation prompt. `prompt` is one
    user turn (a string) or a conversation (a list of {"role", "content"} messages ending with a user turn)."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    msgs = ([{"role": "system", "content": system}] if system else []) + turns
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return list(ids)
