"""The default preset end to end (slow: fetches and converts SmolLM2-135M on first run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    import specflash

    torch.set_num_threads(2)
    yield specflash.load("smollm2-135m", device="cpu")
    torch.set_num_threads(1)


def test_cli_generate_equals_plain_greedy(smollm):
    proc = subprocess.run(
        [sys.executable, "-m", "specflash", "generate", "--model", "smollm2-135m", "--method", "ar",
         "--prompt", "What is 12 * 7?", "--max-new-tokens", "24", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    ids = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    assert data["prompt_ids"] == list(ids)
    inputs = torch.tensor([ids])
    ref = smollm.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=24, do_sample=False)
    assert data["output_ids"] == ref[0, len(ids):].tolist()
    assert data["text"].strip()


@pytest.mark.parametrize("method", ["pld", "draft-self"])
def test_speculative_methods_equal_greedy_on_the_real_model(smollm, method):
    from specflash.api import encode_prompt, generate
    from specflash.config import DraftModelConfig
    from specflash.drafters.draft_model import DraftModelDrafter
    from specflash.prompts import heldout_prompts

    for prompt in heldout_prompts("rewrite")[:1] + heldout_prompts("code")[:1]:
        ids = encode_prompt(smollm, prompt.text)
        inputs = torch.tensor([ids])
        ref = smollm.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=32, do_sample=False)
        drafter = (DraftModelDrafter(smollm.model, DraftModelConfig(k=3), smollm.vocab_size)
                   if method == "draft-self" else None)
        run = generate(smollm, ids, "pld" if method == "pld" else "ar", max_new_tokens=32, drafter=drafter)
        assert run.output_ids == ref[0, len(ids):].tolist(), prompt.id


def test_the_api_drafts_with_the_presets_drafter_when_none_is_given(smollm):
    """`generate(load("smollm2-135m"), prompt, "dflash")` needs no drafter argument: the preset ships
    one (and a DFlash 2 one for "dflash2")."""
    from specflash.api import encode_prompt, generate
    from specflash.prompts import heldout_prompts

    ids = encode_prompt(smollm, heldout_prompts("code")[0].text)
    inputs = torch.tensor([ids])
    ref = smollm.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=24, do_sample=False)
    for method in ("dflash", "dflash2", "adaflash", "dels"):
        run = generate(smollm, ids, method, max_new_tokens=24, options={"gate": False})
        assert run.output_ids == ref[0, len(ids):].tolist(), method
        assert sum(len(s.tokens) for s in run.steps) > 0, method
