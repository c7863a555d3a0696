"""Start a DFlash drafter from the target's own top layers instead of random weights.

Why: a drafter that begins as the layers the target runs right after its deepest feature layer
already turns those features into next-token-like states, so training only has to teach it the
block (mask slots, several positions ahead) rather than language from scratch. Concretely, with
feature layers (..., d), draft layer i copies target layer d + 1 + i (clamped to the last layer):
its attention and MLP projections and both norms; `fc` starts as the selection of layer d's
features, and `hidden_norm` as the copied layer's input norm, so the context keys and values of
the first draft layer are what target layer d + 1 computes from layer d's output. Qwen3-style
q/k norms with no counterpart in the target (e.g. Llama) stay at one.
"""

from __future__ import annotations

import dataclasses

import torch

from ..models.dflash import DFlashDrafter, DFlashSpec
from ..models.target import TargetModel

_PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
_NORMS = ("input_layernorm", "post_attention_layernorm")


def source_layers(model: DFlashDrafter, num_target_layers: int) -> list[int]:
    """The target layer each draft layer copies."""
    deepest = max(model.spec.target_layer_ids)
    return [min(deepest + 1 + i, num_target_layers - 1) for i in range(model.spec.num_layers)]


@torch.no_grad()
def init_from_target(model: DFlashDrafter, target: TargetModel) -> list[int]:
    """Copy the target's layers into the drafter (shapes must match); returns the copied ids."""
    ids = source_layers(model, target.num_layers)
    for draft_layer, index in zip(model.layers, ids):
        source = target.layers[index]
        for mine, theirs, what in _layer_pairs(draft_layer, source):
            _copy(mine, theirs, f"layer {index} {what}")
        for name in ("q_norm", "k_norm"):
            theirs = getattr(source.self_attn, name, None)
            if theirs is not None:
                _copy(getattr(draft_layer.self_attn, name).weight, theirs.weight, f"layer {index} {name}")
    h, deepest = model.spec.hidden_size, model.spec.target_layer_ids.index(max(model.spec.target_layer_ids))
    model.fc.weight.mul_(0.1)
    model.fc.weight[:, deepest * h : (deepest + 1) * h] += torch.eye(h)
    model.hidden_norm.weight.copy_(model.layers[0].input_layernorm.weight)
    return ids


def _layer_pairs(draft_layer, source) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """(draft weight, target weight, name) of every projection and norm the two layers share."""
    pairs = [(getattr(getattr(draft_layer, block), name).weight, getattr(getattr(source, block), name).weight,
              f"{block}.{name}") for block, names in _PROJECTIONS for name in names]
    return pairs + [(getattr(draft_layer, name).weight, getattr(source, name).weight, name) for name in _NORMS]


def _copy(mine: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    if mine.shape != theirs.shape:
        raise ValueError(f"cannot start the drafter from the target: {what} has shape {tuple(theirs.shape)}, "
                         f"the drafter's {tuple(mine.shape)}")
    mine.copy_(theirs.to(mine.dtype))


def can_grow(saved: DFlashSpec, spec: DFlashSpec) -> bool:
    """True when `spec` is `saved` with more draft layers (and nothing else changed)."""
    return spec.num_layers > saved.num_layers and dataclasses.replace(
        saved, num_layers=spec.num_layers, layer_types=spec.layer_types) == spec


@torch.no_grad()
def grow_from(model: DFlashDrafter, tensors: dict[str, torch.Tensor], target: TargetModel, name: str) -> list[int]:
    """Start a deeper drafter from a trained shallower one (`tensors`); returns the target layers
    the new draft layers copy.

    Why: training a deeper drafter from scratch throws away what the shallow one learned. Here its
    fc, norms and layers are kept as they are, and each new layer is copied from the target (as
    `init_from_target` would, or kept as initialised when the shapes differ, e.g. another MLP
    width) but with its attention and MLP output projections zeroed, so every
    new layer starts as the identity on the residual stream: the grown drafter drafts exactly what
    the shallow one did, and training can only add to it."""
    own = model.state_dict()
    kept = {k: v for k, v in tensors.items() if k in own}
    shallow = {int(k.split(".")[1]) for k in kept if k.startswith("layers.")}
    ids = source_layers(model, target.num_layers)
    new = [i for i in range(model.spec.num_layers) if i not in shallow]
    for i in new:
        draft_layer, source = model.layers[i], target.layers[ids[i]]
        pairs = _layer_pairs(draft_layer, source)
        if all(mine.shape == theirs.shape for mine, theirs, _ in pairs):
            for mine, theirs, what in pairs:
                _copy(mine, theirs, what)
        draft_layer.self_attn.o_proj.weight.zero_()
        draft_layer.mlp.down_proj.weight.zero_()
        kept.update({f"layers.{i}.{k}": v for k, v in draft_layer.state_dict().items()})
    missing = sorted(set(own) - set(kept))
    if missing:
        raise ValueError(f"{name}: cannot grow from it, missing {missing[:6]}")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in kept.items()}, strict=True)
    return [ids[i] for i in new]
