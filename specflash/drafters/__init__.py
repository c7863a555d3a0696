"""The method registry: every decoding method by name, what it needs, and how to build it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..config import DraftModelConfig, NoConfig, PromptLookupConfig
from ..errors import MethodConfigError, UnknownMethodError
from .base import Draft, Drafter

__all__ = ["Draft", "Drafter", "METHODS", "MethodInfo", "method_info", "build_drafter"]


def _build_ar(target, cfg, drafter_path, **_):
    return Drafter()


def _build_pld(target, cfg, drafter_path, **_):
    from .prompt_lookup import PromptLookupDrafter

    return PromptLookupDrafter(cfg)


def _build_draft(target, cfg, drafter_path, cache_dir=None, **_):
    from ..models.loading import load_causal_lm
    from .draft_model import DraftModelDrafter, check_same_vocabulary

    if not drafter_path:
        raise MethodConfigError(
            "method 'draft' needs a drafter: pass --drafter PATH_OR_PRESET (a small causal LM that shares "
            "the target's tokenizer)"
        )
    model, tokenizer = load_causal_lm(drafter_path, device=target.device, dtype=target.dtype, cache_dir=cache_dir)
    check_same_vocabulary(target.tokenizer, tokenizer, target.name, drafter_path)
    return DraftModelDrafter(model, cfg, target.vocab_size)


@dataclass(frozen=True)
class MethodInfo:
    name: str
    summary: str
    needs: str
    config: type
    build: Callable[..., Drafter]


METHODS: dict[str, MethodInfo] = {
    info.name: info
    for info in (
        MethodInfo("ar", "plain autoregressive decoding: the baseline", "the target only", NoConfig, _build_ar),
        MethodInfo(
            "draft",
            "classic speculative decoding with a small draft LM",
            "a draft model sharing the target's tokenizer (--drafter)",
            DraftModelConfig,
            _build_draft,
        ),
        MethodInfo(
            "pld", "prompt lookup: n-gram drafts copied from the text so far", "the target only", PromptLookupConfig, _build_pld
        ),
    )
}


def method_info(name: str) -> MethodInfo:
    if name not in METHODS:
        raise UnknownMethodError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    return METHODS[name]


def method_config(name: str, options: dict[str, Any] | None) -> Any:
    """The method's validated config from loose options; an unknown knob is an error, not ignored."""
    info = method_info(name)
    try:
        return info.config(**(options or {}))
    except TypeError as exc:
        raise MethodConfigError(f"bad option for method {name!r}: {exc}") from None


def build_drafter(name: str, target, options: dict[str, Any] | None = None, drafter: str | None = None, **kw) -> Drafter:
    """A ready drafter for `name` on `target`."""
    info = method_info(name)
    return info.build(target, method_config(name, options), drafter, **kw)
