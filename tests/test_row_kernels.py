"""Few-row matmul kernels: W @ x^T and the packed kernel give F.linear's numbers up to rounding
(the packed kernel the same bits for a row whatever rows share the product), installing them
copies no weight (the packed kernel adds one packed copy), the choice follows the measured
timings (cached), and decoding through them stays lossless: every method equals plain greedy
decoding on the same runtime, which equals the stock kernels' greedy decoding."""

from __future__ import annotations

import json
from types import MappingProxyType

import pytest
import torch
import torch.nn.functional as F

from conftest import LOSSLESS_ARCHS, hf_greedy, load_target
from specflash.api import generate
from specflash.config import DraftModelConfig, PromptLookupConfig
from specflash.drafters.draft_model import DraftModelDrafter
from specflash.drafters.prompt_lookup import PromptLookupDrafter
from specflash.models import packed_kernel, row_kernels
from specflash.verify_cost import cached_verify_cost

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef", "The quick brown fox jumps over the lazy dog. The quick"]
ALL_ROWS = {n: n for n in range(1, row_kernels.MAX_ROWS + 1)}
PADDED = {n: max(n, 4) if n <= 4 else 8 if n <= 8 else 16 for n in ALL_ROWS}  # 1-3 -> 4, 5-7 -> 8, 9-15 -> 16
ALL_PACKED = {n: row_kernels.PACKED for n in range(1, row_kernels.WIDE_ROWS[-1] + 1)}  # prefills too
MIXED = {1: row_kernels.PACKED, 2: 2, 3: 4, 4: 4, 5: row_kernels.PACKED, 9: row_kernels.PACKED}


@pytest.fixture(params=["all_rows", "padded", "packed", "mixed"])
def plan(request):
    """Each kind of row plan; those with packed rows need the kernel built."""
    if request.param in ("packed", "mixed"):
        request.getfixturevalue("packed_built")
    return {"all_rows": ALL_ROWS, "padded": PADDED, "packed": ALL_PACKED, "mixed": MIXED}[request.param]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (1, 5, 24), (2, 7, 24), (40, 24)])
def test_few_row_products_are_linear_up_to_rounding(shape, bias, plan):
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

    def recorded(model, rows, **kwargs):
        order.append("left" if rows else "stock")
        return real(model, rows, **kwargs)

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


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
def test_decoding_through_the_few_row_kernels_is_lossless(tiny_dirs, arch, plan):
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
def test_a_dflash_drafter_loads_with_the_targets_kernels_and_stays_lossless(tiny_dirs, tmp_path, arch, plan):
    from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter, load_dflash_model
    from specflash.models.dflash_io import load_drafter, save_drafter
    from test_draft_vocab import spread_ids, vocab_drafter

    stock = load_target(tiny_dirs[arch])
    target = load_target(tiny_dirs[arch])
    row_kernels.install(target.model, plan)
    target.row_plan = MappingProxyType(plan)
    save_drafter(vocab_drafter(target, spread_ids(target, 60), feature_layers=(1, 0)), tmp_path)
    model = load_dflash_model(target, str(tmp_path), "dflash", "float32")
    plain = load_drafter(tmp_path, target)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is row_kernels.RowKernelLinear for m in linears)
    assert all(m.row_plan == plan for m in linears) and model.row_plan == plan
    hidden = torch.randn(7, target.hidden_size)
    assert torch.allclose(model.draft_logits(hidden), plain.draft_logits(hidden), atol=1e-5, rtol=1e-5)
    drafter = DFlashEngineDrafter(model, DFlashConfig(gate=False))
    for prompt, n in zip(PROMPTS, (24, 32)):
        ids = target.tokenizer(prompt).input_ids
        run = generate(target, ids, max_new_tokens=n, drafter=drafter, stop_on_eos=False)
        assert run.output_ids == hf_greedy(stock, ids, n)
        assert sum(len(s.tokens) for s in run.steps) > 0


@pytest.mark.parametrize("n_out, k", [(64, 24), (40, 13), (7, 24), (96, 50)])
def test_packing_keeps_every_weight_in_panels_of_32_rows(n_out, k):
    weight = torch.randn(n_out, k)
    panels = packed_kernel.pack(weight)
    assert panels.shape == (-(-n_out // 32), k, 32) and panels.is_contiguous()
    rows = panels.transpose(1, 2).reshape(-1, k)
    assert torch.equal(rows[:n_out], weight) and not rows[n_out:].any()


@pytest.mark.parametrize("n_out, k", [(64, 24), (40, 13), (7, 24), (96, 50)])
def test_the_packed_kernel_gives_each_row_the_same_bits_alone_or_beside_others(packed_built, n_out, k):
    """Each output is one chain over k, whatever rows share the product (up to 12 per tile, more
    in chunks): a verified row reproduces the plain step's product exactly."""
    weight, bias = torch.randn(n_out, k), torch.randn(n_out)
    panels = packed_kernel.pack(weight)
    x = torch.randn(30, k)
    together = packed_kernel.packed_linear(x, panels, n_out, bias)
    assert torch.allclose(together, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    for i in range(30):
        assert torch.equal(packed_kernel.packed_linear(x[i : i + 1], panels, n_out, bias)[0], together[i])
    for rows in (2, 5, 12, 13, 25):
        assert torch.equal(packed_kernel.packed_linear(x[:rows], panels, n_out, bias), together[:rows])


def test_installing_a_packed_plan_adds_panels_and_follows_weight_updates(packed_built):
    layer = torch.nn.Linear(24, 40, bias=False)
    weight = layer.weight
    row_kernels.install(layer, ALL_PACKED)
    assert layer.weight is weight and layer.packed is not None
    x = torch.randn(3, 24)
    assert torch.allclose(layer(x), F.linear(x, weight), atol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(2)  # a drafter in training: the panels must follow
    assert torch.allclose(layer(x), F.linear(x, layer.weight), atol=1e-5)
    row_kernels.install(layer, PADDED)
    assert layer.packed is None  # a plan without packed rows frees the copy


def test_a_layer_in_training_keeps_its_gradients_under_a_packed_plan(packed_built):
    """The packed kernel has no backward: where autograd records, the product is PyTorch's."""
    layer = torch.nn.Linear(24, 40)
    reference = torch.nn.Linear(24, 40)
    reference.load_state_dict(layer.state_dict())
    row_kernels.install(layer, ALL_PACKED)
    x = torch.randn(3, 24)
    layer(x).square().sum().backward()
    F.linear(x, reference.weight, reference.bias).square().sum().backward()
    assert torch.allclose(layer.weight.grad, reference.weight.grad) and torch.allclose(layer.bias.grad, reference.bias.grad)
    with torch.no_grad():
        assert torch.allclose(layer(x), F.linear(x, reference.weight, reference.bias), atol=1e-5)


def test_a_packed_row_without_panels_falls_back_to_the_stock_product():
    weight, x = torch.randn(40, 24), torch.randn(2, 24)
    assert torch.equal(row_kernels.linear(x, weight, None, ALL_PACKED), F.linear(x, weight))


def test_an_autocast_region_keeps_pytorchs_product(packed_built):
    """Under CPU autocast a layer's input may arrive in bfloat16; the float32-only kernel steps aside."""
    layer = torch.nn.Linear(24, 40, bias=False)
    row_kernels.install(layer, ALL_PACKED)
    x = torch.randn(3, 24)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x.bfloat16())
        expected = F.linear(x.bfloat16(), layer.weight)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_choice_takes_the_packed_kernel_where_it_is_fastest():
    timings = {"stock": [1.0, 1.6, 2.0, 1.5], "weight_left": [0.6, 0.84, 1.97, 1.2], "packed": [0.5, 0.9, 1.0, 2.0]}
    packed = row_kernels.PACKED
    assert row_kernels.choose(timings) == {1: packed, 2: 2, 3: packed, 4: 4}
    assert row_kernels.tag(row_kernels.choose(timings)) == f"-wl2.4-pk1.3-{row_kernels.KERNELS}"
    assert row_kernels.tag(ALL_PACKED) == f"-pk1-{row_kernels.WIDE_ROWS[-1]}-{row_kernels.KERNELS}"
    assert row_kernels.tag({1: 1, 2: row_kernels.PACKED, 3: row_kernels.PACKED, 5: row_kernels.PACKED}) == \
        f"-wl1-pk2-3.5-{row_kernels.KERNELS}"


def test_each_wide_row_count_decides_for_the_counts_up_to_it():
    """Above the few rows only a handful of widths are timed; each covers the counts from the one
    below it, only a clear win takes the packed kernel, and the widest decides for all wider."""
    few = {"stock": [1.0, 1.0], "weight_left": [2.0, 2.0], "packed": [0.5, 0.5]}
    wide = {"wide_rows": [4, 8, 16], "wide_stock": [1.0, 1.0, 1.0], "wide_packed": [0.5, 0.97, 0.5]}
    plan = row_kernels.choose(few | wide)
    packed = row_kernels.PACKED
    assert plan == {1: packed, 2: packed, 3: packed, 4: packed, **dict.fromkeys(range(9, 17), packed),
                    row_kernels.ANY_ROWS: packed}
    assert 5 not in plan  # 5-8: within noise at 8, stock
    assert row_kernels.tag(plan) == f"-pk1-4.9-16.all-{row_kernels.KERNELS}"
    lost_widest = wide | {"wide_packed": [0.5, 0.5, 0.97]}
    assert row_kernels.ANY_ROWS not in row_kernels.choose(few | lost_widest)


def test_rows_past_the_listed_counts_follow_the_any_rows_entry(packed_built, monkeypatch):
    """A plan's ANY_ROWS entry routes every unlisted row count (a long prompt) to the packed
    kernel, whose rows are then the same bits as the same rows computed alone; without it they
    go to PyTorch's product."""
    calls = []
    real = packed_kernel.packed_linear
    monkeypatch.setattr(packed_kernel, "packed_linear", lambda x, *a: calls.append(len(x)) or real(x, *a))
    layer = torch.nn.Linear(40, 70)
    x = torch.randn(300, 40)
    with torch.inference_mode():
        expected = F.linear(x, layer.weight, layer.bias)
        row_kernels.install(layer, {1: row_kernels.PACKED})
        assert torch.equal(layer(x), expected) and calls == []
        row_kernels.install(layer, row_kernels.PACKED_EVERYWHERE)
        wide = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in (0, 150, 299)])
    assert calls == [300, 1, 1, 1]
    assert torch.allclose(wide, expected, atol=1e-5)
    assert torch.equal(wide[[0, 150, 299]], alone)


def test_measuring_alternates_three_ways_when_the_packed_kernel_is_built(packed_built, tiny_dirs, monkeypatch):
    target = load_target(tiny_dirs["llama"])
    order = []
    real = row_kernels.install

    def recorded(model, rows, **kwargs):
        order.append("packed" if row_kernels.PACKED in rows.values() else "left" if rows else "stock")
        return real(model, rows, **kwargs)

    monkeypatch.setattr(row_kernels, "install", recorded)
    timings = row_kernels.measure(target.model, target.vocab_size, max_rows=2, repeats=1, packed=True, wide=(4, 6))
    assert order == ["stock", "left", "packed"] * (2 * (1 + 1)) + ["stock", "packed"] * (2 * (2 + 1))
    assert sorted(timings) == ["packed", "stock", "weight_left", "wide_packed", "wide_rows", "wide_stock"]
    assert len(timings["packed"]) == 2 and timings["wide_rows"] == [4, 6] and len(timings["wide_packed"]) == 2


def test_a_machine_that_cannot_build_the_kernel_says_why_and_keeps_pytorchs(tiny_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(packed_kernel, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    target = load_target(tiny_dirs["llama"])
    plan = target.tune_row_kernels(tmp_path)
    assert "packed few-row kernel is unavailable" in capsys.readouterr().err
    (saved,) = (tmp_path / "row-kernels").iterdir()
    assert "packed" not in json.loads(saved.read_text()) and row_kernels.PACKED not in plan.values()


def test_packed_copies_are_made_only_where_they_fit_in_memory(monkeypatch, tmp_path):
    layer = torch.nn.Linear(64, 64)  # 16 kB of weights
    unlimited, limit = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    unlimited.write_text("max\n")
    monkeypatch.setattr(row_kernels, "MEMORY_LIMITS", (str(unlimited), str(tmp_path / "absent")))
    monkeypatch.setattr(row_kernels.os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else 1 << 20)
    assert row_kernels.packed_fits(layer)  # 4 GB of RAM, no container limit
    limit.write_text("40000\n")
    monkeypatch.setattr(row_kernels, "MEMORY_LIMITS", (str(unlimited), str(limit)))
    assert not row_kernels.packed_fits(layer)  # a 40 kB container: the copy would take over a quarter
    monkeypatch.setattr(row_kernels, "MEMORY_LIMITS", ())
    monkeypatch.setattr(row_kernels.os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else 10)
    assert not row_kernels.packed_fits(layer)  # 40 kB of RAM


def test_cached_packed_timings_are_ignored_where_the_kernel_cannot_load(tiny_dirs, tmp_path, monkeypatch):
    """Timings written where the kernel built (a shared cache, a compiler since removed) must not
    route any row count, wide ones included, to an op this process never loaded."""
    target = load_target(tiny_dirs["llama"])
    path = row_kernels.timings_path(target.row_kernel_key, tmp_path)
    path.parent.mkdir(parents=True)
    few = row_kernels.MAX_ROWS
    path.write_text(json.dumps({"stock": [1.0] * few, "weight_left": [2.0] * few, "packed": [0.5] * few,
                                "wide_rows": [32], "wide_stock": [1.0], "wide_packed": [0.5]}))
    monkeypatch.setattr(packed_kernel, "_state", {"loaded": False})
    plan = target.tune_row_kernels(tmp_path)
    assert plan == {} and row_kernels.PACKED not in plan.values()
