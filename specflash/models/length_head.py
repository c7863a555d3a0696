"""AdaFlash's adaptive length head: from one drafted block, how much of it will the target accept?

The head reads the DFlash drafter's final-normed block hidden states (the same tensor the LM head
reads), so it costs one small MLP per step and no extra drafter pass. Shape as AdaFlash's
`ThreshHeadTwoModel` (research/methods.md §2.1): [mean over the block ; last position] -> down to
a bottleneck -> one residual SiLU layer -> sigmoid r, read directly as (verify length) / L.

It lives inside the drafter's checkpoint folder, under AdaFlash's own tensor names
(`thresh_head_two_model.*`) and config keys (`dflash_config.use_thresh_head_two_model`,
`thresh_head_bottleneck_dim`, `thresh_head_direct_len`), so AdaFlash releases load here and a
plain DFlash loader (ours, vLLM's, SGLang's) still loads the drafter and ignores the head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import CheckpointError

PREFIX = "thresh_head_two_model."
CONFIG_KEYS = ("use_thresh_head_two_model", "thresh_head_bottleneck_dim", "thresh_head_direct_len")  # in dflash_config
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class LengthHead(nn.Module):
    """hidden [B, L, H] -> r [B] in (0, 1): the predicted verify length over the block size."""

    def __init__(self, hidden_size: int, bottleneck: int = 256) -> None:
        super().__init__()
        self.down = nn.Linear(2 * hidden_size, bottleneck)
        self.res = nn.Sequential(nn.Linear(bottleneck, bottleneck))
        self.out = nn.Linear(bottleneck, 1)

    @property
    def hidden_size(self) -> int:
        return self.down.in_features // 2

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.down.weight.dtype)
        feat = torch.cat([hidden.mean(dim=1), hidden[:, -1]], dim=-1)  # [B, 2H]
        z = F.silu(self.down(feat))
        z = z + F.silu(self.res(z))
        return torch.sigmoid(self.out(z)).squeeze(-1)  # [B]


def verify_len(score: float, block_size: int, rate: float, min_len: int) -> int:
    """AdaFlash's rule: the target verifies clamp(round(r * L * rate), min_len, L) positions,
    the root's own token included (so verify_len - 1 drafted tokens)."""
    return max(max(1, min_len), min(block_size, round(score * block_size * rate)))


def length_labels(accepted: torch.Tensor, block_size: int, lookahead: int = 1) -> torch.Tensor:
    """Training target r* = clamp((accepted + lookahead) / L, 0, 1): with lookahead 1 this is the
    verify length that would have sufficed (the accepted drafts plus the target's own token)."""
    return ((accepted.float() + lookahead) / block_size).clamp(0.0, 1.0)


def save_length_head(head: LengthHead, folder: Path | str, dtype: torch.dtype = torch.float16) -> None:
    """Add the head's tensors and config keys to an existing drafter folder (rewrites both files)."""
    folder = Path(folder)
    config = _read_json(folder / CONFIG_FILE)
    tensors = {k: v for k, v in load_file(str(folder / WEIGHTS_FILE)).items() if not k.startswith(PREFIX)}
    tensors.update({PREFIX + k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()})
    tmp = folder / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / WEIGHTS_FILE)
    config.setdefault("dflash_config", {}).update(dict(zip(CONFIG_KEYS, (True, head.down.out_features, True))))
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def load_length_head(folder: Path | str, hidden_size: int) -> LengthHead | None:
    """The head stored in a drafter folder, or None when its config declares none."""
    folder = Path(folder)
    dflash = _read_json(folder / CONFIG_FILE).get("dflash_config") or {}
    if not dflash.get("use_thresh_head_two_model"):
        return None
    if dflash.get("thresh_head_direct_len") is False:
        raise CheckpointError(f"{folder}: only direct-length heads (thresh_head_direct_len) are supported")
    head = LengthHead(hidden_size, int(dflash.get("thresh_head_bottleneck_dim", 256)))
    tensors = {k[len(PREFIX):]: v for k, v in load_file(str(folder / WEIGHTS_FILE)).items() if k.startswith(PREFIX)}
    expected = head.state_dict()
    if set(tensors) != set(expected) or any(tensors[k].shape != expected[k].shape for k in expected):
        raise CheckpointError(
            f"{folder}: its length head tensors do not match a head of hidden size {hidden_size} "
            f"(found {sorted(tensors)[:6]})"
        )
    head.load_state_dict(tensors)
    return head.eval()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
