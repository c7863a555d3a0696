"""The project's prompt sets (math, code, writing, rewrite), split once into train and held-out.

Drafters are trained on the target's answers to prompts and then benchmarked on prompts; if the
two overlapped, acceptance numbers would measure memorisation, not drafting. So the split is
fixed in the files (assets/prompts/*.jsonl, see its DATA_CARD.md) and this module is the only
reader: training code calls `training_prompts()`, benchmarks and the app call `heldout_prompts()`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specflash.errors import SpecFlashError

DOMAINS: tuple[str, ...] = ("math", "code", "writing", "rewrite")
SPLITS: tuple[str, ...] = ("train", "heldout", "dev")


@dataclass(frozen=True)
class Prompt:
    """One prompt: `id` is stable ("math-001"), `text` is what the user would type."""

    id: str
    domain: str
    split: str
    text: str


def default_root() -> Path:
    """assets/prompts of this checkout, found next to the package rather than the working dir."""
    return Path(__file__).resolve().parent.parent / "assets" / "prompts"


def _check_choice(value: str | None, allowed: tuple[str, ...], what: str) -> None:
    if value is not None and value not in allowed:
        raise SpecFlashError(f"unknown prompt {what} {value!r}; choose from {', '.join(allowed)}")


def _read_domain(path: Path, domain: str) -> list[Prompt]:
    """Parse one domain file, rejecting records that disagree with the file they sit in."""
    if not path.is_file():
        raise SpecFlashError(f"prompt file {path} is missing; the {domain!r} prompt set cannot be read")
    prompts = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompt = Prompt(record["id"], record["domain"], record["split"], record["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise SpecFlashError(f"{path}:{line_no}: not a prompt record ({exc})") from exc
        if prompt.domain != domain or prompt.split not in SPLITS:
            raise SpecFlashError(
                f"{path}:{line_no}: domain {prompt.domain!r} / split {prompt.split!r} do not fit "
                f"file {path.name} (splits: {', '.join(SPLITS)})"
            )
        prompts.append(prompt)
    return prompts


def load_prompts(
    domain: str | None = None, split: str | None = None, root: Path | None = None
) -> list[Prompt]:
    """Prompts of one domain (or all, in DOMAINS order) and one split (or both), in file order."""
    _check_choice(domain, DOMAINS, "domain")
    _check_choice(split, SPLITS, "split")
    root = default_root() if root is None else Path(root)
    prompts: list[Prompt] = []
    for name in DOMAINS if domain is None else (domain,):
        prompts += [p for p in _read_domain(root / f"{name}.jsonl", name) if split in (None, p.split)]
    return prompts


def training_prompts(domain: str | None = None) -> list[Prompt]:
    """The train split: the only prompts that training code may read."""
    return load_prompts(domain, split="train")


def heldout_prompts(domain: str | None = None) -> list[Prompt]:
    """The held-out split, for benchmarks and the app; never for training."""
    return load_prompts(domain, split="heldout")


def dev_prompts(domain: str | None = None) -> list[Prompt]:
    """The dev split: requests written like the held-out ones but apart from them and from every
    harvest recipe, to choose knobs and weights on (the tuning requests come from the recipe's
    own templates, which favour whatever was trained on that recipe); never for training."""
    return load_prompts(domain, split="dev")
