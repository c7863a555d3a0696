"""Few-row matmul kernels: W @ x^T gives F.linear's numbers up to rounding, installing it copies
no weight, the choice follows the measured timings (cached), and decoding through it stays
lossless: every method equals plain greedy decoding on the same runtime, which equals the stock
kernels' greedy decoding."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import LOSSLESS_ARCHS, hf_greedy, load_target
from specflash.api import generate
from specflash.config import DraftModelConfig, PromptLookupConfig
from specflash.drafters.draft_model import DraftModelDrafter
from specflash.drafters.prompt_lookup import PromptLookupDrafter
from specflash.models import row_kernels
from specflash.verify_cost import cached_verify_cost

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef", "The quick brown fox jumps over the lazy dog. The quick"]
ALL_ROWS = {n: n for n in range(1, row_kernels.MAX_ROWS + 1)}
PADDED = {n: max(n, 4) if n <= 4 else 8 if n <= 8 else 16 for n in ALL_ROWS}  # 1-3 -> 4, 5-7 -> 8, 9-15 -> 16


@pytest.mark.parametrize("plan", [ALL_ROWS, PADDED])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (1, 5, 24), (2, 7, 24), (40, 24)])
def test_weight_left_product_is_linear_up_to_rounding(shape, bias, plan):
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    expected = F.linear(x, layer.weight, layer.bias)
    assert row_kernels.install(layer, plan) == 1
    weight = layer.weight
    got = layer(x)
    assert layer.weight is weight and isinstance(layer, row_kernels.RowKernelLinear)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert got.is_contiguous()  # row-major, so the next product is not fed a transposed operand


def test_choice_keeps_only_clear_wins():
    timings = {"stock": [1.0, 1.6, 2.0, 1.5], "weight_left": [0.6, 0.84, 1.97, 2.1]}
    assert row_kernels.choose(timings) == {1: 1, 2: 2}  # row 3 is within noise, row 4 slower


def test_choice_pads_a_row_count_to_a_clearly_faster_one():
    timings = {"stock": [1.0, 1.6, 2.0, 1.5], "weight_left": [0.6, 0.84, 1.97, 1.2]}
    assert row_kernels.choose(timings) == {1: 1, 2: 2, 3: 4, 4: 4}  # 3 rows computed as 4
    close = {"stock": [1.0, 1.6, 2.0, 1.5], "weight_left": [0.6, 0.84, 1.25, 1.2]}
    assert row_kernels.choose(close) == {1: 1, 2: 2, 3: 3, 4: 4}  # 4 within noise of 3: no padding


def test_measuring_alternates_the_two_ways_at_each_row_count(tiny_dirs, monkeypatch):
    """Side by side, so a change of load while measuring weighs on both ways alike."""
    target = load_target(tiny_dirs["llama"])
    order = []
    real = row_kernels.install

    def recorded(model, rows):
        order.append("left" if rows else "stock")
        return real(model, rows)

    monkeypatch.setattr(row_kernels, "install", recorded)
    timings = row_kernels.measure(target.model, target.vocab_size, max_rows=3, repeats=2)
    assert order == ["stock", "left"] * (3 * (2 + 1))  # 3 row counts, a warm-up and 2 repeats each
    assert len(timings["stock"]) == len(timings["weight_left"]) == 3
    assert all(t > 0 for way in timings.values() for t in way)


def test_tune_measures_once_per_machine_then_reads_the_cache(tiny_dirs, tmp_path, monkeypatch):
    target = load_target(tiny_dirs["llama"])
    calls = []
    real = row_kernels.measure

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(row_kernels, "measure", counted)
    first = target.tune_row_kernels(tmp_path)
    (saved,) = (tmp_path / "row-kernels").iterdir()
    timings = json.loads(saved.read_text())
    assert len(timings["stock"]) == len(timings["weight_left"]) == row_kernels.MAX_ROWS
    assert first == row_kernels.choose(timings)
    again = load_target(tiny_dirs["llama"]).tune_row_kernels(tmp_path)
    assert again == first and len(calls) == 1
    assert all(type(m) is row_kernels.RowKernelLinear for m in target.model.modules() if isinstance(m, torch.nn.Linear))


def test_half_precision_and_recurrent_models_keep_the_stock_kernels(tiny_dirs, family_target, tmp_path):
    half = load_target(tiny_dirs["llama"])
    half.model.to(torch.bfloat16)
    assert half.tune_row_kernels(tmp_path) == {} and half.kernel_tag == ""
    assert not any(type(m) is row_kernels.RowKernelLinear for m in half.model.modules())
    hybrid = family_target("qwen3_5")
    assert hybrid.tune_row_kernels(tmp_path) == {}


def test_the_kernel_choice_keys_the_verify_cost_cache(tiny_dirs, tmp_path):
    target = load_target(tiny_dirs["llama"])
    cached_verify_cost(target, 3, tmp_path)
    for plan in ({1: 1, 2: 2}, {1: 2, 2: 2}):
        target.row_plan = plan
        row_kernels.install(target.model, plan)
        cached_verify_cost(target, 3, tmp_path)
    names = sorted(p.name for p in (tmp_path / "verify-cost").iterdir())
    assert len(names) == 3 and any("-wl1.2-" in n for n in names) and any("-wl1p2.2-" in n for n in names)


@pytest.mark.parametrize("plan", [ALL_ROWS, PADDED])
@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
def test_decoding_through_the_weight_left_kernels_is_lossless(tiny_dirs, arch, plan):
    stock = load_target(tiny_dirs[arch])
    target = load_target(tiny_dirs[arch])
    row_kernels.install(target.model, plan)
    target.row_plan = plan
    for prompt, n in zip(PROMPTS, (24, 32)):
        ids = target.tokenizer(prompt).input_ids
        ref = hf_greedy(stock, ids, n)
        assert generate(target, ids, "ar", max_new_tokens=n).output_ids == ref
        for drafter in (PromptLookupDrafter(PromptLookupConfig(k=5, max_ngram=3)),
                        DraftModelDrafter(target.model, DraftModelConfig(k=4), target.vocab_size)):
            run = generate(target, ids, "ar", max_new_tokens=n, drafter=drafter)
            assert run.output_ids == ref, f"{arch}: {type(drafter).__name__} diverged on {prompt!r}"


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
def test_a_dflash_drafter_loads_with_the_targets_kernels_and_stays_lossless(tiny_dirs, tmp_path, arch):
    from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter, load_dflash_model
    from specflash.models.dflash_io import load_drafter, save_drafter
    from test_draft_vocab import spread_ids, vocab_drafter

    stock = load_target(tiny_dirs[arch])
    target = load_target(tiny_dirs[arch])
    row_kernels.install(target.model, PADDED)
    target.row_plan = PADDED
    save_drafter(vocab_drafter(target, spread_ids(target, 60), feature_layers=(1, 0)), tmp_path)
    model, plain = load_dflash_model(target, str(tmp_path), "dflash"), load_drafter(tmp_path, target)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is row_kernels.RowKernelLinear for m in linears)
    assert all(m.row_plan == PADDED for m in linears) and model.row_plan == PADDED
    hidden = torch.randn(7, target.hidden_size)
    assert torch.allclose(model.draft_logits(hidden), plain.draft_logits(hidden), atol=1e-5, rtol=1e-5)
    drafter = DFlashEngineDrafter(model, DFlashConfig(gate=False))
    for prompt, n in zip(PROMPTS, (24, 32)):
        ids = target.tokenizer(prompt).input_ids
        run = generate(target, ids, max_new_tokens=n, drafter=drafter, stop_on_eos=False)
        assert run.output_ids == hf_greedy(stock, ids, n)
        assert sum(len(s.tokens) for s in run.steps) > 0
