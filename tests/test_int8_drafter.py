"""Int8 drafter weights (models/int8_linear.py): the products stay close to float, the layers
that carry the target's features stay float, and decoding with an int8 drafter is still exactly
the target's greedy output."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy
from specflash.api import generate
from specflash.drafters import build_drafter
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter, load_dflash_model
from specflash.models import dflash_io, int8_linear
from specflash.models.dflash import INT8_RESCORED
from specflash.models.dflash_io import save_drafter
from test_draft_vocab import spread_ids, vocab_drafter

pytestmark = pytest.mark.skipif(not int8_linear.available(), reason="this PyTorch build has no CPU int8 engine")


def test_int8_linear_matches_the_float_product_to_quantization_error():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    x = torch.randn(3, 5, 64)
    ref = layer(x)
    out = int8_linear.Int8Linear(layer.weight, layer.bias)(x)
    assert out.shape == ref.shape
    assert 0 < (out - ref).abs().max() < 0.02 * ref.abs().max()  # quantized (not exact), but close


@pytest.mark.parametrize("prompt", ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick brown"])
def test_an_int8_drafter_drafts_like_the_float_one_and_decodes_losslessly(tiny_targets, tmp_path, prompt):
    target = tiny_targets["llama"]
    save_drafter(vocab_drafter(target, spread_ids(target, 60), layers=2), tmp_path)
    float_model = load_dflash_model(target, str(tmp_path), "dflash", "float32")
    int8_model = load_dflash_model(target, str(tmp_path), "dflash", "int8")
    assert not float_model.int8_head and int8_model.int8_head
    swapped = [m for m in int8_model.modules() if isinstance(m, int8_linear.Int8Linear)]
    assert len(swapped) == 2 * 7  # q, k, v, o and the three MLP products of both layers
    assert isinstance(int8_model.fc, torch.nn.Linear)  # the features' outlier dimensions stay float
    ids = target.tokenizer(prompt)["input_ids"]
    runs = {}
    for name, model in (("float", float_model), ("int8", int8_model)):
        runs[name] = generate(target, ids, drafter=DFlashEngineDrafter(model, DFlashConfig(gate=False)),
                              max_new_tokens=24, stop_on_eos=False)
    assert runs["int8"].output_ids == runs["float"].output_ids == hf_greedy(target, ids, 24)
    hidden = torch.randn(16, target.hidden_size, generator=torch.Generator().manual_seed(0))
    a, b = float_model.draft_logits(hidden), int8_model.draft_logits(hidden)
    assert a.shape == b.shape and 0 < (a - b).abs().max() < 0.05 * a.abs().max()
    # the int8 head's leaders are rescored in float: the drafted token and its logit are the float head's
    assert torch.equal(b.argmax(-1), a.argmax(-1))
    assert torch.allclose(b.max(-1).values, a.max(-1).values, atol=1e-5)
    assert (b != a).sum(-1).min() > 0 and (b == a).sum(-1).max() <= INT8_RESCORED


def test_dflash_drafters_take_int8_weights_by_default_where_bf16_is_not_native(tiny_targets, tmp_path, monkeypatch):
    target = tiny_targets["llama"]
    save_drafter(vocab_drafter(target, spread_ids(target, 60), layers=2), tmp_path)
    monkeypatch.setattr(dflash_io, "bf16_matrix_units", lambda: False)
    plain = {"rule": "fixed", "gate": False}  # neither needs the verify-cost curve
    adaflash = build_drafter("adaflash", target, plain, str(tmp_path))
    assert adaflash.model.int8_head and adaflash.config_dict()["drafter_precision"] == "int8"
    dflash = build_drafter("dflash", target, {"gate": False}, str(tmp_path))
    assert dflash.model.int8_head and dflash.config_dict()["drafter_precision"] == "int8"
    for method, options in (("adaflash", plain), ("dflash", {"gate": False})):
        asked = build_drafter(method, target, {**options, "draft_dtype": "float32"}, str(tmp_path))
        assert not asked.model.int8_head and asked.config_dict()["drafter_precision"] == "float32"
    ids = target.tokenizer("def add(a, b):")["input_ids"]
    for drafter in (adaflash, dflash):
        run = generate(target, ids, drafter=drafter, max_new_tokens=24, stop_on_eos=False)
        assert run.output_ids == hf_greedy(target, ids, 24)
    monkeypatch.setattr(dflash_io, "bf16_matrix_units", lambda: True)  # there "auto" means bfloat16
    native = build_drafter("dflash", target, {"gate": False}, str(tmp_path))
    assert not native.model.int8_head and native.config_dict()["drafter_precision"] == "bfloat16"
