"""Int8 weights for a drafter's few-row products on a CPU (draft_dtype int8; "auto" on CPUs without bf16 units).

Why: a drafter block is a handful of rows through its layers' ~7 M weights and its draft head,
and at so few rows a float32 product costs the time it takes to stream its weights from memory.
On the project's 2-core AVX2 CPU a SmolLM2 block took 9.6 ms, 22% of a target step, which is
what the draft gate weighs each look and each draft against. PyTorch's fbgemm dynamic int8
linear (weights int8 per output channel, activations quantized per call) reads a quarter of the
bytes: a block cost 4.8 ms against 9.4 ms, at 1.769 tokens per step on the tuning requests
against 1.789 in float32. Opt-in while verifying was dear here, the default ("auto",
dflash_io.drafter_int8) since verifying got cheap and the block became a larger share of a step
(docs/dflash.md, the drafter's own dtype).

The fusion layer `fc` stays float: the target's features carry most of their energy in one or
two dimensions (docs/dflash.md, preconditioning), which one activation scale per call would
crush; quantizing it too cost 12% of the committed tokens per step. Only drafting changes:
verification is the target's own, so every output stays exact.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn as nn


@functools.cache
def available() -> bool:
    """Whether this PyTorch build can run Int8Linear: an x86 int8 engine and the quantized
    tensors it packs from, which PyTorch has deprecated; where a later release drops them, the
    drafter simply keeps float weights."""
    if not any(engine in torch.backends.quantized.supported_engines for engine in ("x86", "fbgemm")):
        return False
    try:
        Int8Linear(torch.ones(2, 2), None)(torch.ones(1, 2))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 per output channel; x stays float and is quantized
    per call (fbgemm's dynamic linear, with the reduced activation range its AVX2 kernel needs)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().to("cpu", torch.float32)
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
        zeros = torch.zeros(len(w), dtype=torch.long)
        with warnings.catch_warnings():  # the deprecation of quantized tensors: see available()
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(quantized, None if bias is None else bias.detach().float())
        self.out_features, self.in_features = w.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        out = torch.ops.quantized.linear_dynamic(flat, self.packed, True)
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_layers(layers: nn.ModuleList) -> int:
    """Swap the attention and MLP products of each decoder layer for Int8Linear (in place);
    returns how many were swapped."""
    swapped = 0
    for layer in layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear(child.weight, child.bias))
                    swapped += 1
    return swapped
