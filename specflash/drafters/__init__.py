"""The method registry: every decoding method by name, what it needs, and where it lives.

Each method is a module in this package that defines `CONFIG` (its frozen, validated config
class) and `build(target, cfg, drafter, cache_dir) -> Drafter`. Modules are imported only when
a method is used, so listing methods loads nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..errors import MethodConfigError, UnknownMethodError
from .base import Draft, Drafter, Lookahead

__all__ = ["Draft", "Drafter", "Lookahead", "METHODS", "MethodInfo", "method_info", "method_config", "build_drafter"]


@dataclass(frozen=True)
class MethodInfo:
    name: str
    summary: str
    needs: str
    module: str
    drafter_role: str | None = None  # which of a preset's drafters the method loads

    def load(self):
        return importlib.import_module(f"{__name__}.{self.module}")


METHODS: dict[str, MethodInfo] = {
    info.name: info
    for info in (
        MethodInfo("ar", "plain autoregressive decoding: the baseline", "the target only", "autoregressive"),
        MethodInfo(
            "draft",
            "classic speculative decoding with a small draft LM",
            "a draft model sharing the target's tokenizer (--drafter)",
            "draft_model",
            "draft",
        ),
        MethodInfo("pld", "prompt lookup: n-gram drafts copied from the text so far", "the target only", "prompt_lookup"),
        MethodInfo(
            "dflash",
            "DFlash: a block-diffusion drafter drafts a whole block in one pass from the target's hidden states; "
            "the target verifies a tree of its most probable paths (tree=false: the argmax chain)",
            "a DFlash drafter checkpoint for the target (--drafter; presets ship one)",
            "dflash",
            "dflash",
        ),
        MethodInfo(
            "dflash2",
            "DFlash 2: DFlash with a dynamic convolution in every layer and a path selector over each slot's top-K",
            "a DFlash 2 drafter checkpoint for the target (--drafter; architectures DFlash2DraftModel)",
            "dflash2",
            "dflash2",
        ),
        MethodInfo(
            "adaflash",
            "AdaFlash: the DFlash draft cut where acceptance is unlikely, so the target verifies fewer tokens (as a tree "
            "of the most probable paths; tree=false: the chain)",
            "a DFlash drafter (--drafter; presets ship one); cut rule -o rule=cost|fixed|heuristic|confidence|entropy",
            "adaflash",
            "dflash",
        ),
        MethodInfo(
            "dels",
            "DeLS-Spec: DFlash (long context) fused with a small local head (short context) inside each block",
            "a DFlash drafter (--drafter) and a local head (-o local_head=PATH; presets ship both)",
            "dels",
            "dflash",
        ),
        MethodInfo(
            "ptd",
            "PTD: training-free progressive tree drafting by the target itself, with tree attention",
            "the target only",
            "ptd",
        ),
    )
}


def method_info(name: str) -> MethodInfo:
    if name not in METHODS:
        raise UnknownMethodError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    return METHODS[name]


def method_config(name: str, options: dict[str, Any] | None) -> Any:
    """The method's validated config from loose options; an unknown knob is an error, not ignored."""
    config_cls = method_info(name).load().CONFIG
    try:
        return config_cls(**(options or {}))
    except TypeError as exc:
        raise MethodConfigError(f"bad option for method {name!r}: {exc}") from None


def build_drafter(name: str, target, options: dict[str, Any] | None = None, drafter: str | None = None, **kw) -> Drafter:
    """A ready drafter for `name` on `target`."""
    return method_info(name).load().build(target, method_config(name, options), drafter, **kw)
