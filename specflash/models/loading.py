"""Load a causal LM and its tokenizer from a preset name, a local folder or a cached hub id.

Every failure a user can cause becomes a SpecFlashError that says what was wrong: a path that
does not exist or is not a model folder, or a hub id that is not in the local cache. Hub ids are
loaded with `local_files_only=True`, so on a machine without internet they fail at once instead
of retrying downloads for most of a minute.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from ..errors import CheckpointError, ModelNotFoundError, SpecFlashError
from .presets import PRESETS, resolve_target

# "org/name" or "name": letters, digits, '-', '_', '.'; never a path with more than one part.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _check_folder(path: Path) -> None:
    """Raise ModelNotFoundError unless `path` is a folder with a config.json."""
    if path.is_dir():
        if (path / "config.json").is_file():
            return
        problem = (
            f"{path} holds no config.json, so it is not a Hugging Face model folder (expected "
            "config.json, the weights as *.safetensors and the tokenizer files)"
        )
        ggufs = sorted(path.glob("*.gguf"))
    else:
        problem = f"{path} is a file, not a model folder"
        ggufs = [path] if path.suffix == ".gguf" else []
    if ggufs:
        problem += (
            f"; {ggufs[0].name} is a GGUF file: convert it once with "
            "specflash.models.acquire.convert_gguf(gguf_path, out_dir) and pass out_dir"
        )
    raise ModelNotFoundError(problem)


def check_cache_keyword(model: PreTrainedModel) -> None:
    """Raise unless the model's forward takes the KV cache as `cache=`, the name SpecFlash passes.

    Why: transformers releases before the one in requirements.txt name it `past_key_values` and
    swallow an unknown `cache=` into their **kwargs, so every cached step would silently run
    without its context (seen on a GPU host with transformers 5.17: a right first token, then
    '-----' to the end of every answer)."""
    if "cache" not in inspect.signature(model.forward).parameters:
        raise SpecFlashError(
            f"transformers {transformers.__version__} does not take the KV cache as `cache=` "
            f"({type(model).__name__}.forward), so cached decoding would ignore it; install the "
            "transformers version pinned in requirements.txt"
        )


def _load(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer from a folder or the local hub cache; never from the network."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True)
    check_cache_keyword(model)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    return model, tokenizer


def load_causal_lm(
    name_or_path: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode on `device`, tokenizer) for a preset name, a folder or a hub id.

    A preset name wins over a folder of the same name; `cache_dir` is where presets keep their
    converted or built models (default: specflash's user cache folder).
    """
    source = resolve_target(name_or_path, cache_dir)
    path = Path(source).expanduser()
    if path.exists():
        _check_folder(path)
        source = str(path)
    elif not _HUB_ID.match(source):
        raise ModelNotFoundError(
            f"model folder {path} does not exist; pass an existing folder, a cached hub id, or "
            f"one of the presets: {', '.join(PRESETS)}"
        )
    try:
        model, tokenizer = _load(source, dtype)
    except OSError as e:
        if path.exists():
            raise CheckpointError(f"could not load the model in {path}: {e}") from e
        raise ModelNotFoundError(
            f"{source!r} is not a local folder, and as a hub id it is not in the local Hugging "
            "Face cache and this machine cannot download it; on a machine with internet run "
            f"`hf download {source}` and copy the hub cache here, or pass a local model "
            f"folder, or one of the presets: {', '.join(PRESETS)}"
        ) from e
    except ValueError as e:  # e.g. a config that is not a causal LM
        raise CheckpointError(f"could not load {source} as a causal LM: {e}") from e
    return model.to(device).eval(), tokenizer
