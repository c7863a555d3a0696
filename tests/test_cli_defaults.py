"""Which of a preset's drafters each method gets when the user names none."""

from __future__ import annotations

from specflash.models.presets import REPO_ROOT, default_drafter


def test_dflash_family_uses_the_presets_dflash_drafter():
    expected = str(REPO_ROOT / "assets" / "drafters" / "smollm2-135m-dflash")
    for method in ("dflash", "adaflash", "dels"):
        assert default_drafter("smollm2-135m", method, None) == expected


def test_dflash2_uses_the_presets_dflash2_drafter():
    expected = REPO_ROOT / "assets" / "drafters" / "smollm2-135m-dflash2"
    assert default_drafter("smollm2-135m", "dflash2", None) == str(expected)
    assert (expected / "config.json").is_file() and (expected / "model.safetensors").is_file()


def test_methods_without_a_drafter_get_none(tmp_path):
    assert default_drafter("smollm2-135m", "ar", None) is None
    assert default_drafter("smollm2-135m", "ptd", None) is None
    assert default_drafter(str(tmp_path), "dflash", None) is None  # not a preset
