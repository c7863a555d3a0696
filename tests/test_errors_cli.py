"""Each bad input raises its own error; the CLI prints one line on stderr and exits 2."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from specflash.api import generate, stream
from specflash.config import DraftModelConfig, PromptLookupConfig, SamplingConfig
from specflash.drafters import build_drafter, method_config
from specflash.errors import (
    ContextLengthError,
    DrafterMismatchError,
    EmptyPromptError,
    MethodConfigError,
    ModelNotFoundError,
    SamplingConfigError,
    UnknownMethodError,
)
from specflash.drafters.draft_model import check_same_vocabulary


def test_empty_prompt(tiny_targets):
    with pytest.raises(EmptyPromptError):
        generate(tiny_targets["qwen3"], "   ")
    with pytest.raises(EmptyPromptError):
        generate(tiny_targets["qwen3"], [])


def test_prompt_beyond_context(tiny_targets):
    target = tiny_targets["qwen3"]
    ids = [5] * (target.context_length - 10)
    with pytest.raises(ContextLengthError, match="at most 10 new tokens"):
        generate(target, ids, max_new_tokens=11)
    with pytest.raises(ContextLengthError):
        generate(target, [5] * target.context_length, max_new_tokens=1)


@pytest.mark.parametrize("n", [0, -3])
def test_bad_token_limit(tiny_targets, n):
    from specflash.errors import TokenLimitError

    with pytest.raises(TokenLimitError):
        generate(tiny_targets["qwen3"], "hi", max_new_tokens=n)


@pytest.mark.parametrize("method", ["dflash", "adaflash", "dels"])
def test_dflash_family_needs_a_drafter_and_says_who(tiny_targets, method):
    with pytest.raises(MethodConfigError, match=f"method '{method}' needs a DFlash drafter"):
        build_drafter(method, tiny_targets["qwen3"], {}, None)


def test_unknown_method(tiny_targets):
    with pytest.raises(UnknownMethodError, match="known methods: ar"):
        stream(tiny_targets["qwen3"], "hi", method="medusa")


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_sampling(kwargs):
    with pytest.raises(SamplingConfigError):
        SamplingConfig(**kwargs)


def test_bad_method_options():
    with pytest.raises(MethodConfigError):
        DraftModelConfig(k=0)
    with pytest.raises(MethodConfigError):
        PromptLookupConfig(max_ngram=1, min_ngram=2)
    with pytest.raises(MethodConfigError, match="unexpected keyword"):
        method_config("pld", {"depth": 3})


def test_draft_needs_a_drafter(tiny_targets):
    with pytest.raises(MethodConfigError, match="--drafter"):
        build_drafter("draft", tiny_targets["qwen3"], {}, None)


def test_drafter_with_another_vocabulary(tiny_targets):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")))
    with pytest.raises(DrafterMismatchError, match="different vocabulary"):
        check_same_vocabulary(tiny_targets["qwen3"].tokenizer, other, "target", "drafter")


def test_missing_model_path(tmp_path):
    from specflash.api import load

    with pytest.raises(ModelNotFoundError):
        load(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError):
        load(str(tmp_path))  # exists, holds no model
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError):
        load("someone/not-a-cached-model")
    assert time.perf_counter() - start < 5, "an uncached hub id must fail at once, offline"


def _cli(*args: str, cache_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specflash", *args, "--cache-dir", str(cache_dir)] if args[0] in ("generate",) else
        [sys.executable, "-m", "specflash", *args],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "nope"], "unknown method"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--prompt", ""], "prompt is empty"),
        (["--max-new-tokens", "100000"], "context"),
        (["--model", "/definitely/not/here"], "does not exist"),
        (["-o", "k"], "KEY=VALUE"),
    ],
)
def test_cli_bad_input_one_line_exit_2(tiny_root, args, message):
    base = {"--model": "tiny-qwen2", "--prompt": "def add(a, b):", "--method": "pld"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = [x for kv in base.items() for x in kv]
    if args[0] == "-o":
        argv += args
    proc = _cli("generate", *argv, "--max-new-tokens", base.get("--max-new-tokens", "8"), cache_dir=tiny_root)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_generate_json_equals_greedy(tiny_root, tiny_targets):
    from conftest import hf_greedy

    proc = _cli("generate", "--model", "tiny-qwen3", "--method", "pld", "--prompt", "def add(a, b):", "--raw",
                "--max-new-tokens", "20", "--json", cache_dir=tiny_root)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert {"output_ids", "text", "steps", "stats"} <= set(data)
    assert {"mean_acceptance_length", "draft_acceptance_rate", "tokens_per_s", "verified_per_committed"} <= set(data["stats"])
    target = tiny_targets["qwen3"]
    ids = target.tokenizer("def add(a, b):").input_ids
    assert data["output_ids"] == hf_greedy(target, ids, 20)
    assert data["text"] == target.tokenizer.decode(data["output_ids"], skip_special_tokens=True)


def test_cli_methods_lists_every_method():
    from specflash.drafters import METHODS

    proc = _cli("methods", cache_dir=None)
    assert proc.returncode == 0
    assert [line.split()[0] for line in proc.stdout.splitlines()] == list(METHODS)
