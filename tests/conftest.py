"""Shared fixtures: tiny random models of several architectures, built once per test session."""

from __future__ import annotations

import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specflash.models import packed_kernel
from specflash.models.target import TargetModel
from specflash.models.tiny import FAMILY_ARCHS, TINY_ARCHS, ensure_tiny_model

# Tiny models are all per-op overhead: one thread is 3x faster than two fighting over 2 cores.
torch.set_num_threads(1)

LOSSLESS_ARCHS = ("llama", "qwen3", "qwen2")
HYBRID_ARCHS = ("qwen3_5", "qwen3_next")  # Gated DeltaNet layers interleaved with full attention
WINDOW_ARCHS = ("gpt_oss", "mistral_window")  # sliding windows of 8, shorter than the test prompts


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_dirs(tiny_root):
    """Folder of each tiny architecture (seed 0), and an unrelated drafter (seed 1)."""
    dirs = {arch: ensure_tiny_model(arch, tiny_root) for arch in TINY_ARCHS}
    dirs["random-drafter"] = ensure_tiny_model("qwen2", tiny_root, seed=1, layers=1, hidden=32)
    return dirs


@pytest.fixture(scope="session")
def tiny_targets(tiny_dirs):
    """A TargetModel per architecture, fp32 on CPU."""
    out = {}
    for arch, path in tiny_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        out[arch] = TargetModel(model, AutoTokenizer.from_pretrained(path), name=str(path))
    return out


@pytest.fixture(scope="session")
def packed_built(tmp_path_factory):
    """The packed kernel, built once for the session (skipped, saying why, with no C++ compiler)."""
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler on PATH: the packed kernel cannot be built here")
    assert packed_kernel.load(tmp_path_factory.mktemp("cache")), "the packed kernel failed to build"
    return True


def load_target(path) -> TargetModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return TargetModel(model, AutoTokenizer.from_pretrained(path), name=str(path))


@pytest.fixture(scope="session")
def family_target(tiny_root):
    """family_target(arch, seed=0): a hybrid or sliding-window target (FAMILY_ARCHS), built on
    first use; hybrids get 4 layers (linear, full, linear, full)."""
    made: dict[tuple[str, int], TargetModel] = {}

    def get(arch: str, seed: int = 0) -> TargetModel:
        assert arch in FAMILY_ARCHS, arch
        if (arch, seed) not in made:
            layers = 4 if arch in HYBRID_ARCHS else 2
            made[arch, seed] = load_target(ensure_tiny_model(arch, tiny_root, seed=seed, layers=layers))
        return made[arch, seed]

    return get


def hf_greedy(target: TargetModel, ids: list[int], max_new_tokens: int) -> list[int]:
    """The reference: transformers' own greedy generate, new tokens only."""
    inputs = torch.tensor([ids], device=target.device)
    out = target.model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=target.tokenizer.pad_token_id,
    )
    return out[0, len(ids) :].tolist()
