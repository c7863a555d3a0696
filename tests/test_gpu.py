"""The lossless checks on CUDA (run by scripts/gpu_check.sh on a GPU host; skipped elsewhere).

fp32, because bf16 batched verification and one-token decoding round differently, so greedy
equality is only a fair test at full precision.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import HYBRID_ARCHS, LOSSLESS_ARCHS, WINDOW_ARCHS, hf_greedy
from specflash.api import generate
from specflash.config import DraftModelConfig, PromptLookupConfig, SamplingConfig
from specflash.drafters.draft_model import DraftModelDrafter
from specflash.drafters.prompt_lookup import PromptLookupDrafter
from specflash.models.target import TargetModel
from specflash.models.tiny import ensure_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda_targets(tiny_dirs):
    out = {}
    for arch in LOSSLESS_ARCHS:
        model = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).to("cuda")
        out[arch] = TargetModel(model, AutoTokenizer.from_pretrained(tiny_dirs[arch]), name=arch)
    return out


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
def test_cuda_greedy_equals_transformers(cuda_targets, arch):
    target = cuda_targets[arch]
    ids = target.tokenizer("The quick brown fox jumps over the lazy dog. The quick brown").input_ids
    ref = hf_greedy(target, ids, 40)
    for drafter in (
        PromptLookupDrafter(PromptLookupConfig()),
        DraftModelDrafter(target.model, DraftModelConfig(k=4), target.vocab_size),
    ):
        assert generate(target, ids, max_new_tokens=40, drafter=drafter).output_ids == ref


def test_cuda_sampling_is_reproducible(cuda_targets):
    target = cuda_targets["qwen3"]
    ids = target.tokenizer("def add(a, b):").input_ids
    runs = [generate(target, ids, method="pld", max_new_tokens=24, sampling=SamplingConfig(temperature=0.8, seed=3))
            for _ in range(2)]
    assert runs[0].output_ids == runs[1].output_ids
    assert runs[0].device.startswith("cuda")


@pytest.mark.parametrize("method", ["ar", "dflash", "adaflash"])
def test_cuda_batched_rows_equal_their_own_greedy(cuda_targets, method):
    from specflash.api import generate_batch
    from specflash.drafters.adaflash import AdaFlashConfig, AdaFlashDrafter
    from specflash.drafters.base import Drafter
    from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
    from test_dflash import random_drafter

    target = cuda_targets["llama"]
    texts = ["The quick brown fox", "def add(a, b):", "Once upon a time there was a"]
    prompts = [target.tokenizer(t).input_ids for t in texts]
    model = random_drafter(target, block=8, feature_layers=(1,))
    drafter = {"ar": Drafter(), "dflash": DFlashEngineDrafter(model, DFlashConfig(gate=False)),
               "adaflash": AdaFlashDrafter(model, AdaFlashConfig(gate=False, rule="fixed", fixed_len=2))}[method]
    batch = generate_batch(target, prompts, method=method, drafter=drafter, max_new_tokens=24, stop_on_eos=False)
    assert [run.output_ids for run in batch.runs] == [hf_greedy(target, ids, 24) for ids in prompts]


@pytest.mark.parametrize("arch", HYBRID_ARCHS + WINDOW_ARCHS)
def test_cuda_hybrid_and_windowed_targets_equal_transformers(tiny_root, arch):
    """Recurrent-state rollback (hybrids) and windowed tree masks (ptd) on CUDA, far past the
    window, alone and in a left-padded batch."""
    path = ensure_tiny_model(arch, tiny_root, layers=4 if arch in HYBRID_ARCHS else 2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda")
    target = TargetModel(model, AutoTokenizer.from_pretrained(path), name=arch)
    ids = target.tokenizer("The quick brown fox jumps over the lazy dog. " * 3).input_ids
    ref = hf_greedy(target, ids, 40)
    drafters = [PromptLookupDrafter(PromptLookupConfig()), DraftModelDrafter(target.model, DraftModelConfig(k=4), target.vocab_size)]
    for drafter in drafters:
        assert generate(target, ids, max_new_tokens=40, drafter=drafter).output_ids == ref
    if arch in WINDOW_ARCHS:
        assert generate(target, ids, method="ptd", max_new_tokens=40).output_ids == ref
    from specflash.api import generate_batch

    prompts = [ids, target.tokenizer("def add(a, b):").input_ids]
    batch = generate_batch(target, prompts, max_new_tokens=24)
    assert [run.output_ids for run in batch.runs] == [hf_greedy(target, p, 24) for p in prompts]
