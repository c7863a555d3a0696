"""The released DFlash drafters of the new presets, in their own config layouts, on tiny targets of
their families: our loader (models/dflash_io.py) reads each layout and DFlash stays exact with it.

Layouts, from the public config.json files:

- z-lab/Qwen3.5-4B-DFlash: `model_type` qwen3, 6 draft layers (5 `sliding_attention` with
  `sliding_window` 4096, then 1 `full_attention`; `use_sliding_window`, `max_window_layers` 6),
  `block_size` 16 *inside* `dflash_config` (no top-level key), `mask_token_id` 248077, 8
  `target_layer_ids` [1, 5, ..., 29] of a 32-layer target, rope as `rope_parameters`
  (theta 1e7), `tie_word_embeddings` true.
- z-lab/gpt-oss-20b-DFlash: `model_type` gpt_oss, 8 draft layers, `block_size` 8 at the top level,
  `mask_token_id` 200000, `target_layer_ids` [1, 6, 11, 16, 21] of the 24-layer target,
  `attention_bias` true (q/k/v/o biases), `rope_theta` 150000 (YaRN in some copies), and no
  `num_target_layers`, `layer_types` or `sliding_window` keys.

What each layout needs from the loader: `block_size` under `dflash_config`; sliding draft layers
that see only their window of the context (and, with no `is_causal` key, are causal inside the
block: vLLM's and z-lab's rule, the one DFlash 2 uses), in inference, in a batch and in training;
the target's layer count when `num_target_layers` is absent; q/k/v/o biases. Our own drafters still
save exactly as before.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import hf_greedy
from test_dflash import random_drafter
from specflash.api import generate, generate_batch
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter, build
from specflash.errors import CheckpointError, DrafterMismatchError
from specflash.models.dflash import FULL, SLIDING, DFlashCache, block_inputs, training_block_mask
from specflash.models.dflash_io import load_drafter, save_drafter

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown", "def add(a, b):\n    return a + b"]


def _qwen35_layout(cfg: dict) -> dict:
    dflash = cfg["dflash_config"]
    return {
        **{k: v for k, v in cfg.items() if k not in ("block_size", "rope_theta", "rope_scaling", "torch_dtype")},
        "layer_types": [SLIDING] * (cfg["num_hidden_layers"] - 1) + [FULL],
        "sliding_window": 8, "use_sliding_window": True, "max_window_layers": cfg["num_hidden_layers"],
        "rope_parameters": {"rope_theta": 10_000_000, "rope_type": "default"},
        "tie_word_embeddings": True, "dtype": "bfloat16",
        "dflash_config": {"block_size": cfg["block_size"], **dflash},
    }


def _gpt_oss_layout(cfg: dict) -> dict:
    drop = ("num_target_layers", "layer_types", "sliding_window", "use_sliding_window", "rope_scaling", "torch_dtype")
    return {**{k: v for k, v in cfg.items() if k not in drop}, "model_type": "gpt_oss", "attention_bias": True,
            "rope_theta": 150000, "initial_context_length": 4096, "dtype": "bfloat16"}


def _checkpoint(tmp_path, target, layout, block: int, layers=(0, 1)):
    """A random drafter for `target` saved by us, its config.json then rewritten to `layout`."""
    folder = tmp_path / layout.__name__.strip("_")
    save_drafter(random_drafter(target, layers=2, block=block, feature_layers=layers), folder, dtype=torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(layout(cfg)))
    return folder


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def _edit_config(folder, **changes) -> None:
    (folder / "config.json").write_text(json.dumps({**_config(folder), **changes}))


def _add_attention_biases(folder, std: float = 0.1) -> dict[str, torch.Tensor]:
    """gpt-oss drafters have q/k/v/o biases (`attention_bias` true): random ones, so they matter."""
    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name in [k for k in tensors if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))]:
        tensors[name.removesuffix("weight") + "bias"] = torch.randn(tensors[name].shape[0], generator=g) * std
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


# ---- z-lab/Qwen3.5-4B-DFlash ----------------------------------------------------------------------


def test_qwen35_release_layout_loads_and_stays_exact(family_target, tmp_path):
    """block_size only under dflash_config, 8 feature layers over 2 draft layers (a sliding one of
    window 8, causal inside the block, then a full one), rope_parameters, tied embeddings; DFlash on
    the hybrid target stays exact with output running far past the window."""
    target = family_target("qwen3_5")
    folder = _checkpoint(tmp_path, target, _qwen35_layout, 16, (0, 1, 2, 3))
    drafter = build(target, DFlashConfig(gate=False), str(folder))
    spec = drafter.model.spec
    assert (spec.block_size, spec.target_layer_ids, spec.rope_theta) == (16, (0, 1, 2, 3), 10_000_000)
    assert (spec.layer_types, spec.sliding_window, spec.is_causal) == ((SLIDING, FULL), 8, None)
    assert [spec.layer_attention(i) for i in range(2)] == [(8, True), (None, False)]
    ids = target.tokenizer(PROMPTS[0]).input_ids
    assert generate(target, ids, drafter=drafter, max_new_tokens=30).output_ids == hf_greedy(target, ids, 30)


def test_qwen35_top_level_block_size_must_agree(family_target, tmp_path):
    target = family_target("qwen3_5")
    folder = _checkpoint(tmp_path, target, _qwen35_layout, 16, (0, 1, 2, 3))
    _edit_config(folder, block_size=16)
    assert load_drafter(folder, target).spec.block_size == 16
    _edit_config(folder, block_size=8)
    with pytest.raises(CheckpointError, match="block_size 8 and dflash_config.block_size 16"):
        load_drafter(folder, target)


def test_sliding_layers_see_only_their_window(tiny_targets):
    """Queries at positions 12..15 with a window of 4 see no context before position 9: changing
    those features changes nothing, with or without a cache; a full layer beside them sees them."""
    target = tiny_targets["qwen3"]
    feats = torch.randn(1, 12, 2 * target.hidden_size)
    changed = feats.clone()
    changed[:, :9] += 1.0
    block, block_pos = torch.tensor([[7, 4, 4, 4]]), torch.arange(12, 16)[None]

    def run(model, features, cache=None):
        if cache is None:
            return model(block, block_pos, features, torch.arange(12)[None])
        model(block, block_pos, features[:, :5], torch.arange(5)[None], None, cache)  # 5 positions cached first
        return model(block, block_pos, features[:, 5:], torch.arange(5, 12)[None], None, cache)

    sliding = random_drafter(target, layers=2, block=4, feature_layers=(0, 1), layer_types=(SLIDING, SLIDING),
                             sliding_window=4)
    mixed = random_drafter(target, layers=2, block=4, feature_layers=(0, 1), layer_types=(SLIDING, FULL),
                           sliding_window=4)
    with torch.no_grad():
        base = run(sliding, feats)
        torch.testing.assert_close(run(sliding, changed), base)
        torch.testing.assert_close(run(sliding, changed, DFlashCache(2)), base)
        inside = feats.clone()
        inside[:, 10] += 1.0  # seen by the queries at 12 and 13
        assert not torch.allclose(run(sliding, inside), base)
        assert not torch.allclose(run(mixed, changed), run(mixed, feats))


def test_sliding_layers_are_causal_in_the_block_unless_the_config_says_not(tiny_targets):
    """A later block slot changes the earlier slots' output only when the sliding layer is not causal."""
    target = tiny_targets["qwen3"]
    feats = torch.randn(1, 6, 2 * target.hidden_size)
    block_pos, ctx_pos = torch.arange(6, 10)[None], torch.arange(6)[None]
    for is_causal, later_slots_seen in ((None, False), (True, False), (False, True)):
        model = random_drafter(target, layers=1, block=4, feature_layers=(0, 1), layer_types=(SLIDING,),
                               sliding_window=16, is_causal=is_causal)
        with torch.no_grad():
            a = model(torch.tensor([[7, 4, 4, 4]]), block_pos, feats, ctx_pos)
            b = model(torch.tensor([[7, 4, 4, 9]]), block_pos, feats, ctx_pos)
        assert (not torch.allclose(a[:, :3], b[:, :3])) == later_slots_seen


def test_training_forward_equals_inference_with_sliding_layers(tiny_targets):
    """Under the training mask a sliding layer's block sees exactly the window inference sees."""
    target = tiny_targets["llama"]
    model = random_drafter(target, layers=2, block=4, layer_types=(SLIDING, FULL), sliding_window=3)
    tokens = torch.tensor([[3, 9, 12, 20, 33, 41, 50, 61, 70, 71]])
    feats = torch.randn(1, 10, model.fc.in_features)
    anchors = torch.tensor([[2, 7]])
    ids, pos = block_inputs(tokens, anchors, 4, model.spec.mask_token_id)
    mask = training_block_mask(anchors, torch.ones(1, 2, dtype=torch.bool), 10, 4)
    with torch.no_grad():
        train_out = model(ids, pos, feats, torch.arange(10)[None], mask)
        for n, a in enumerate(anchors[0].tolist()):
            infer = model(ids[:, 4 * n : 4 * n + 4], pos[:, 4 * n : 4 * n + 4], feats[:, :a], torch.arange(a)[None],
                          None, DFlashCache(2))
            torch.testing.assert_close(train_out[:, 4 * n : 4 * n + 4], infer)


def test_sliding_drafter_in_a_batch_drafts_what_the_single_engine_drafts(family_target, tmp_path):
    """Left-padded rows: the batched cache's slots are not positions, and the window follows positions."""
    target = family_target("qwen3_5")
    model = load_drafter(_checkpoint(tmp_path, target, _qwen35_layout, 16, (0, 1, 2, 3)), target)
    prompts = [target.tokenizer(p).input_ids for p in PROMPTS]
    batch = generate_batch(target, prompts, drafter=DFlashEngineDrafter(model, DFlashConfig(gate=False)),
                           max_new_tokens=24)
    for ids, run in zip(prompts, batch.runs):
        alone = generate(target, ids, drafter=DFlashEngineDrafter(model, DFlashConfig(gate=False)), max_new_tokens=24)
        assert run.output_ids == alone.output_ids == hf_greedy(target, ids, 24)
        assert [s.tokens for s in run.steps] == [s.tokens for s in alone.steps]


# ---- z-lab/gpt-oss-20b-DFlash ---------------------------------------------------------------------


def test_gpt_oss_release_layout_loads_and_stays_exact(family_target, tmp_path):
    """No num_target_layers (the target's count is assumed), q/k/v/o biases, model_type gpt_oss, a
    top-level block_size 8, rope_theta; DFlash on the windowed target stays exact past its window."""
    target = family_target("gpt_oss")
    folder = _checkpoint(tmp_path, target, _gpt_oss_layout, 8)
    tensors = _add_attention_biases(folder)
    drafter = build(target, DFlashConfig(gate=False, draft_dtype="target"), str(folder))  # as stored, to compare
    spec = drafter.model.spec
    assert (spec.block_size, spec.rope_theta, spec.num_target_layers, spec.attention_bias) == (8, 150000, None, True)
    assert spec.layer_types == () and spec.sliding_window is None
    torch.testing.assert_close(drafter.model.layers[1].self_attn.o_proj.bias, tensors["layers.1.self_attn.o_proj.bias"])
    ids = target.tokenizer(PROMPTS[0]).input_ids
    reference = hf_greedy(target, ids, 30)
    assert generate(target, ids, drafter=drafter, max_new_tokens=30).output_ids == reference
    own_dtype = build(target, DFlashConfig(gate=False, draft_dtype="bfloat16"), str(folder))
    assert generate(target, ids, drafter=own_dtype, max_new_tokens=30).output_ids == reference


def test_gpt_oss_layout_is_still_checked(family_target, tmp_path):
    """attention_bias decides which tensors are expected, both ways; feature layers are checked
    against the target's layer count; a config with neither num_target_layers nor target_layer_ids
    says so."""
    target = family_target("gpt_oss")
    folder = _checkpoint(tmp_path, target, _gpt_oss_layout, 8)
    with pytest.raises(CheckpointError, match="missing .*_proj.bias"):
        load_drafter(folder, target)
    _add_attention_biases(folder)
    _edit_config(folder, attention_bias=False)
    with pytest.raises(CheckpointError, match="unexpected .*q_proj.bias"):
        load_drafter(folder, target)
    cfg = _config(folder)
    _edit_config(folder, attention_bias=True, dflash_config={**cfg["dflash_config"], "target_layer_ids": [0, 5]})
    with pytest.raises(DrafterMismatchError, match=r"target layer ids \[5\] out of range"):
        load_drafter(folder, target)
    _edit_config(folder, dflash_config={"mask_token_id": cfg["dflash_config"]["mask_token_id"]})
    with pytest.raises(CheckpointError, match="target_layer_ids nor num_target_layers"):
        load_drafter(folder, target)


# ---- our own format -------------------------------------------------------------------------------


def test_save_writes_only_the_keys_a_spec_needs(tiny_targets, family_target, tmp_path):
    """A full-attention, bias-free drafter saves exactly the keys it always did; a sliding or
    biased one adds its layout, and one without num_target_layers leaves the key out; each loads
    back to the same spec and output."""
    target = tiny_targets["qwen3"]
    cfg = _config(save_drafter(random_drafter(target, layers=2), tmp_path / "ours", dtype=torch.float32))
    assert list(cfg) == [
        "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "hidden_act", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
        "max_position_embeddings", "attention_bias", "attention_dropout", "tie_word_embeddings", "use_sliding_window",
        "sliding_window", "layer_types", "torch_dtype", "block_size", "num_target_layers", "dflash_config"]
    assert (cfg["layer_types"], cfg["sliding_window"], cfg["use_sliding_window"]) == ([FULL] * 2, None, False)
    assert (cfg["attention_bias"], cfg["num_target_layers"], "is_causal" in cfg) == (False, target.num_layers, False)
    for arch, layout, block in (("qwen3_5", _qwen35_layout, 16), ("gpt_oss", _gpt_oss_layout, 8)):
        target = family_target(arch)
        folder = _checkpoint(tmp_path, target, layout, block)
        if arch == "gpt_oss":
            _add_attention_biases(folder)
        model = load_drafter(folder, target)
        again = save_drafter(model, tmp_path / f"{arch}-again", dtype=torch.float32)
        cfg = _config(again)
        if arch == "qwen3_5":
            assert (cfg["layer_types"], cfg["sliding_window"], cfg["use_sliding_window"]) == ([SLIDING, FULL], 8, True)
        else:
            assert cfg["attention_bias"] is True and "num_target_layers" not in cfg
        reloaded = load_drafter(again, target)
        assert reloaded.spec == model.spec
        args = (torch.tensor([[3] + [model.spec.mask_token_id] * (block - 1)]), torch.arange(12, 12 + block)[None],
                torch.randn(1, 12, model.fc.in_features), torch.arange(12)[None])
        with torch.no_grad():
            torch.testing.assert_close(reloaded(*args), model(*args), rtol=0, atol=0)
