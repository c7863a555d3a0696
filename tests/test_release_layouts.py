"""The released DFlash drafters of the new presets, in their own config layouts, on tiny targets of
their families: what our loader (models/dflash_io.py) accepts today, and what it still needs.

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

The strict xfails name each missing piece and start failing (XPASS) once the loader has it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import hf_greedy
from test_dflash import random_drafter
from specflash.api import generate
from specflash.drafters.dflash import DFlashConfig, build
from specflash.errors import CheckpointError
from specflash.models.dflash_io import load_drafter, save_drafter


def _qwen35_layout(cfg: dict) -> dict:
    dflash = cfg["dflash_config"]
    return {
        **{k: v for k, v in cfg.items() if k not in ("block_size", "rope_theta", "rope_scaling", "torch_dtype")},
        "layer_types": ["sliding_attention"] * (cfg["num_hidden_layers"] - 1) + ["full_attention"],
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


def _edit_config(folder, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **changes}))


def _add_attention_biases(folder) -> None:
    """gpt-oss drafters have q/k/v/o biases (`attention_bias` true)."""
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [k for k in tensors if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))]:
        tensors[name.removesuffix("weight") + "bias"] = torch.zeros(tensors[name].shape[0])
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.xfail(strict=True, raises=CheckpointError,
                   reason="dflash_io.spec_from_config reads block_size only at the top level of config.json")
def test_qwen35_release_layout_loads(family_target, tmp_path):
    target = family_target("qwen3_5")
    load_drafter(_checkpoint(tmp_path, target, _qwen35_layout, 16, (0, 1, 2, 3)), target)


def test_qwen35_layout_needs_only_a_top_level_block_size(family_target, tmp_path):
    """With block_size copied to the top level the Qwen3.5 layout loads (8 feature layers over 2
    draft layers, rope_parameters, tied embeddings), and DFlash on the hybrid target stays exact."""
    target = family_target("qwen3_5")
    folder = _checkpoint(tmp_path, target, _qwen35_layout, 16, (0, 1, 2, 3))
    _edit_config(folder, block_size=16)
    drafter = build(target, DFlashConfig(gate=False), str(folder))
    spec = drafter.model.spec
    assert (spec.block_size, spec.target_layer_ids, spec.rope_theta) == (16, (0, 1, 2, 3), 10_000_000)
    ids = target.tokenizer("The quick brown fox jumps over the lazy dog. The quick brown").input_ids
    assert generate(target, ids, drafter=drafter, max_new_tokens=30).output_ids == hf_greedy(target, ids, 30)


@pytest.mark.xfail(strict=True, reason="DFlashSpec (DFlash 1) has no sliding window: the Qwen3.5 drafters' "
                                       "sliding_attention layers load as full attention")
def test_qwen35_draft_layers_keep_their_window(family_target, tmp_path):
    target = family_target("qwen3_5")
    folder = _checkpoint(tmp_path, target, _qwen35_layout, 16, (0, 1, 2, 3))
    _edit_config(folder, block_size=16)
    assert getattr(load_drafter(folder, target).spec, "sliding_window", None) == 8


@pytest.mark.xfail(strict=True, raises=CheckpointError,
                   reason="dflash_io needs num_target_layers (absent from the gpt-oss release) and has no "
                          "attention biases (attention_bias true)")
def test_gpt_oss_release_layout_loads(family_target, tmp_path):
    target = family_target("gpt_oss")
    folder = _checkpoint(tmp_path, target, _gpt_oss_layout, 8)
    _add_attention_biases(folder)
    load_drafter(folder, target)


def test_gpt_oss_layout_blockers_are_exactly_two(family_target, tmp_path):
    """Each of the two gaps alone stops the load; with num_target_layers given and no biases the
    rest of the layout (model_type gpt_oss, a top-level block_size 8, rope_theta) loads."""
    target = family_target("gpt_oss")
    folder = _checkpoint(tmp_path, target, _gpt_oss_layout, 8)
    with pytest.raises(CheckpointError, match="num_target_layers"):
        load_drafter(folder, target)
    _edit_config(folder, num_target_layers=target.num_layers)
    spec = load_drafter(folder, target).spec
    assert (spec.block_size, spec.rope_theta, spec.num_target_layers) == (8, 150000, 2)
    _add_attention_biases(folder)
    with pytest.raises(CheckpointError, match="unexpected .*q_proj.bias"):
        load_drafter(folder, target)
