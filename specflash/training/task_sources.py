"""Templated user requests, so drafter data covers what people ask a chat model, not only the
three text sources of sources.py.

The held-out prompts ask for Python functions, short pieces of writing, worked arithmetic and
rewrites of a given text; the stdlib, Shakespeare and arithmetic sources alone under-cover the
first two and the last. These generators combine small hand-written lists (tasks x languages,
forms x topics x audiences, rewrite asks x English paragraphs from stdlib docstrings) under a
seed, so every machine builds the same jobs. None of the lists is taken from the prompt files.
"""

from __future__ import annotations

import ast
import functools
import random
import textwrap

from .sources import Job, stdlib_files

_CODE_TASKS = (
    "reverses the words in a sentence", "returns the n-th Fibonacci number", "merges two sorted lists",
    "checks whether a number is prime", "counts the vowels in a string", "flattens a nested list",
    "removes duplicates from a list while keeping the order", "computes the factorial of n",
    "finds the longest word in a sentence", "converts Celsius to Fahrenheit", "sums the digits of an integer",
    "returns the second largest number in a list", "checks whether two strings are anagrams",
    "groups a list of words by their first letter", "computes the mean and median of a list",
    "parses a date string in YYYY-MM-DD format", "transposes a matrix given as a list of lists",
    "counts word frequencies in a text", "validates an email address with a regular expression",
    "reads a CSV file and returns its rows as dictionaries", "implements a stack with push and pop",
    "rotates a list by k positions", "finds the greatest common divisor of two numbers",
    "generates all subsets of a set", "checks whether brackets in a string are balanced",
    "converts a Roman numeral to an integer", "chunks a list into pieces of size n",
    "returns the running total of a list", "capitalises the first letter of every word",
    "finds the missing number in a list of 1 to n", "implements bubble sort",
    "computes the dot product of two vectors", "counts the lines in a text file",
    "implements a simple LRU cache", "returns the intersection of two lists",
    "converts a binary string to an integer", "checks whether a year is a leap year",
    "finds all pairs in a list that sum to a target", "compresses a string with run-length encoding",
    "returns the indices of the maximum values in a list", "implements a queue with two stacks",
)
_CODE_ASKS = (
    "Write a Python function that {task}.", "Write a function in Python that {task}, with a docstring.",
    "Show me Python code that {task}, and explain it briefly.", "Write a short Python program that {task}.",
    "Implement a Python function that {task}. Include an example call.",
    "How would you write a Python function that {task}?",
)
_FORMS = (
    "a short poem", "a haiku", "a limerick", "a short story", "a friendly email", "a product description",
    "a diary entry", "a short speech", "a thank-you note", "a news headline and a two-sentence summary",
    "a short dialogue", "an encouraging message", "a recipe introduction", "a short blog post",
    "a motivational quote with one line of explanation", "a bedtime story",
)
_TOPICS = (
    "the ocean at night", "a lost umbrella", "learning to ride a bike", "a rainy Monday", "a city garden",
    "the first day at a new job", "a cat who loves boxes", "autumn leaves", "a trip to the mountains",
    "a broken clock", "friendship", "a library after closing time", "a robot learning to cook",
    "the smell of fresh bread", "a train journey", "a small village festival", "the moon", "a lighthouse keeper",
    "a forgotten letter", "a dragon who is afraid of the dark", "coffee in the morning", "a summer storm",
)
_AUDIENCES = ("", " for children", " for a friend", " in a cheerful tone", " in a calm tone", " in under 100 words")
_REWRITE_ASKS = (
    "Summarise the following text in one sentence:", "Rewrite this text in simpler words:",
    "Rewrite this paragraph so that it sounds more friendly:", "List the main points of this text as bullet points:",
    "Explain this text to a beginner:", "Make this text shorter without losing its meaning:",
    "Rewrite this text in the passive voice where possible:", "Give this text a title and a one-line summary:",
)


def code_task_jobs(n: int, seed: int) -> list[Job]:
    """Requests for small Python functions: every task under every phrasing, shuffled."""
    rng = random.Random(f"{seed}-code-tasks")
    combos = [ask.format(task=task) for task in _CODE_TASKS for ask in _CODE_ASKS]
    rng.shuffle(combos)
    return [Job(f"codetask-{i:05d}", "code", "code-tasks", text) for i, text in enumerate(combos[:n])]


def writing_task_jobs(n: int, seed: int) -> list[Job]:
    """Requests for short pieces of writing: form x topic x audience, sampled without repeats."""
    rng = random.Random(f"{seed}-writing-tasks")
    combos = [(f, t, a) for f in _FORMS for t in _TOPICS for a in _AUDIENCES]
    rng.shuffle(combos)
    return [Job(f"writingtask-{i:05d}", "writing", "writing-tasks", f"Write {f} about {t}{a}.")
            for i, (f, t, a) in enumerate(combos[:n])]


@functools.lru_cache(maxsize=4)
def docstring_paragraphs(min_words: int = 30, max_words: int = 120) -> tuple[str, ...]:
    """English paragraphs from the standard library's module and class docstrings (prose, no
    code); parsing the whole library takes seconds, so the result is kept per process."""
    paragraphs = []
    for path in stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree, *(n for n in tree.body if isinstance(n, ast.ClassDef))]
        for node in nodes:
            doc = ast.get_docstring(node) or ""
            for para in doc.split("\n\n"):
                words = para.split()
                if min_words <= len(words) <= max_words and not any(c in para for c in ">>>{}[]|"):
                    paragraphs.append(textwrap.fill(" ".join(words), 100))
    return tuple(paragraphs)


def rewrite_task_jobs(n: int, seed: int) -> list[Job]:
    """Rewrite, summarise or explain a stdlib docstring paragraph."""
    rng = random.Random(f"{seed}-rewrite-tasks")
    paragraphs = docstring_paragraphs()
    if not paragraphs:
        return []
    return [Job(f"rewritetask-{i:05d}", "rewrite", "rewrite-tasks", f"{rng.choice(_REWRITE_ASKS)}\n\n{rng.choice(paragraphs)}")
            for i in range(n)]
