"""Preset registry, target/drafter resolution, and the errors of load_causal_lm.

Every bad input must fail at once with its own error: nothing here may wait on the network.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from huggingface_hub import try_to_load_from_cache

from specflash.errors import ModelNotFoundError, PresetUnavailableError, UnknownPresetError
from specflash.models.loading import load_causal_lm
from specflash.models.presets import (
    DEFAULT_PRESET,
    PRESETS,
    REPO_ROOT,
    get_preset,
    resolve_drafter,
    resolve_target,
)


def test_registry_has_the_documented_presets():
    expected = {"smollm2-135m", "tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-mistral",
                "qwen3-4b", "qwen3-8b"}  # fmt: skip
    assert expected <= set(PRESETS)
    assert DEFAULT_PRESET == "smollm2-135m" and PRESETS[DEFAULT_PRESET].offline
    assert get_preset("qwen3-8b").target == "Qwen/Qwen3-8B"
    assert get_preset("qwen3-8b").drafters["dflash"] == "z-lab/Qwen3-8B-DFlash-b16"
    assert get_preset("qwen3-4b").drafters["dflash"] == "z-lab/Qwen3-4B-DFlash-b16"
    assert not get_preset("qwen3-4b").offline
    for name, preset in PRESETS.items():
        assert preset.name == name and preset.description and preset.source


@pytest.mark.parametrize("name,target,dflash,block", [
    ("qwen3.5-4b", "Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash", "block 16"),
    ("gpt-oss-20b", "openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", "block 8"),
])
def test_hybrid_and_windowed_presets(name, target, dflash, block):
    preset = get_preset(name)
    assert preset.target == target and preset.drafters["dflash"] == dflash and not preset.offline
    assert block in preset.description
    assert f"hf download {target}" in preset.source and f"hf download {dflash}" in preset.source
    _skip_if_cached(target)
    start = time.perf_counter()
    with pytest.raises(PresetUnavailableError, match=f"hf download {target}"):
        resolve_target(name)
    assert time.perf_counter() - start < 2.0
    _skip_if_cached(dflash)
    with pytest.raises(PresetUnavailableError, match=f"hf download {dflash}"):
        resolve_drafter(name, "dflash")


def test_unknown_preset_lists_the_known_names():
    with pytest.raises(UnknownPresetError) as info:
        get_preset("no-such-model")
    for name in PRESETS:
        assert name in str(info.value)


def test_paths_and_hub_ids_pass_through_unchanged(tmp_path: Path):
    assert resolve_target(str(tmp_path)) == str(tmp_path)
    assert resolve_target("someone/some-model") == "someone/some-model"


def test_asset_drafters_resolve_against_the_repo_root():
    assert resolve_drafter("smollm2-135m", "dflash") == REPO_ROOT / "assets/drafters/smollm2-135m-dflash"
    assert resolve_drafter(get_preset("smollm2-135m"), "local_head").parent == REPO_ROOT / "assets/heads"
    assert resolve_drafter("smollm2-135m", "no-such-role") is None


def _skip_if_cached(repo_id: str) -> None:
    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        pytest.skip(f"{repo_id} is in the local hub cache on this machine")


def test_hub_preset_not_in_cache_fails_fast_with_instructions():
    _skip_if_cached("Qwen/Qwen3-8B")
    start = time.perf_counter()
    with pytest.raises(PresetUnavailableError) as info:
        resolve_target("qwen3-8b")
    assert time.perf_counter() - start < 2.0
    assert "hf download Qwen/Qwen3-8B" in str(info.value) and "local model folder" in str(info.value)


def test_hub_drafter_not_in_cache_fails_fast():
    _skip_if_cached("z-lab/Qwen3-4B-DFlash-b16")
    start = time.perf_counter()
    with pytest.raises(PresetUnavailableError, match="z-lab/Qwen3-4B-DFlash-b16"):
        resolve_drafter("qwen3-4b", "dflash")
    assert time.perf_counter() - start < 2.0


def test_tiny_presets_resolve_to_model_folders(tiny_root: Path):
    pytest.importorskip("specflash.models.tiny", reason="tiny models are not written yet")
    path = Path(resolve_target("tiny-llama", tiny_root))
    assert (path / "config.json").is_file()
    draft = resolve_drafter("tiny-llama", "draft", tiny_root)
    assert draft is not None and (draft / "config.json").is_file() and draft != path


def test_load_causal_lm_loads_a_tiny_preset(tiny_root: Path):
    pytest.importorskip("specflash.models.tiny", reason="tiny models are not written yet")
    model, tokenizer = load_causal_lm("tiny-qwen3", cache_dir=tiny_root)
    assert model.config.model_type == "qwen3" and not model.training
    assert model.config.vocab_size >= len(tokenizer)


def test_missing_path_raises_model_not_found(tmp_path: Path):
    missing = tmp_path / "nowhere" / "model"
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_causal_lm(str(missing))


def test_folder_without_config_raises_model_not_found(tmp_path: Path):
    (tmp_path / "weights.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="config.json") as info:
        load_causal_lm(str(tmp_path))
    assert "convert_gguf" in str(info.value)  # points at the fix for a bare GGUF


def test_unknown_hub_id_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        load_causal_lm("no-such-org/no-such-model-xyz")
    assert time.perf_counter() - start < 5.0


def test_a_transformers_that_ignores_cache_is_refused_at_load(tiny_root: Path, monkeypatch):
    """Older transformers take the KV cache as `past_key_values` and swallow `cache=`: loading
    must refuse such a model instead of decoding every step without its context."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM

    from specflash.errors import SpecFlashError
    from specflash.models.loading import check_cache_keyword

    model, _ = load_causal_lm("tiny-qwen3", cache_dir=tiny_root)
    check_cache_keyword(model)  # the pinned transformers: accepted

    def old_forward(self, input_ids=None, attention_mask=None, past_key_values=None, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(Qwen3ForCausalLM, "forward", old_forward)
    with pytest.raises(SpecFlashError, match="does not take the KV cache as `cache=`"):
        load_causal_lm("tiny-qwen3", cache_dir=tiny_root)
