"""The target model wrapper: one forward that serves every method.

It feeds a block of tokens at explicit positions on top of a KV cache, as a causal chain or as a
tree (4-D additive mask), and returns float32 logits plus, when asked, the outputs of chosen
decoder layers captured by forward hooks (cheaper than output_hidden_states, and generic over
Hugging Face causal LMs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from ..errors import UnsupportedModelError
from ..kv import Checkpoint, checkpoint, keep_rows, new_cache, restore
from ..tree import DraftTree
from . import row_kernels
from .family import MODEL_ERRORS, Family
from .tokenizer_id import tokenizer_fingerprint


def _decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The list of decoder layers of a causal LM, whatever its attribute path."""
    n = model.config.get_text_config().num_hidden_layers
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == n:
        return layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"cannot find the {n} decoder layers of {type(model).__name__}")


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [T, V] float32
    features: torch.Tensor | None = None  # [T, n_layers * H] concat of hooked layer outputs


@dataclass
class TargetModel:
    """A Hugging Face causal LM with the few operations speculative decoding needs."""

    model: PreTrainedModel
    tokenizer: object | None = None
    name: str = ""
    _captured: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _hooked: tuple[int, ...] = field(default=(), repr=False)
    row_plan: row_kernels.RowPlan = field(default_factory=dict, repr=False)  # row_kernels.py

    def __post_init__(self) -> None:
        self.model.eval()
        self.layers = _decoder_layers(self.model)
        self.family = Family.of(self.model)

    @property
    def config(self):
        return self.model.config.get_text_config()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def context_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 2**31 - 1)

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends generation: the generation config's, the model config's, the tokenizer's."""
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(int(tok_eos))
        return frozenset(int(i) for i in ids)

    @property
    def sliding_window(self) -> int | None:
        """The attention window of sliding-window layers, if the model has any."""
        return self.family.window

    def new_cache(self) -> DynamicCache:
        """An empty cache whose every layer can be rolled back (kv.new_cache)."""
        return new_cache(self.model.config)

    @cached_property
    def tokenizer_id(self) -> str | None:
        """The tokenizer's fingerprint (tokenizer_id.py), computed once; None without a tokenizer."""
        return None if self.tokenizer is None else tokenizer_fingerprint(self.tokenizer)

    @cached_property
    def continues_blocks(self) -> bool:
        """Whether a forward of several tokens on top of a cached recurrent state continues that
        state, as drafts need. Some mixers restart their scan instead (transformers' Jamba and
        Mamba-1 have no initial state for it), which only comparing the two ways can tell:
        4 tokens at once against 2 + 2 on a cache, on this very model."""
        if not self.family.recurrent:
            return True
        ids = torch.arange(4, device=self.device)[None] % self.vocab_size
        with torch.inference_mode():
            whole = self.model(input_ids=ids, cache=self.new_cache(), use_cache=True).logits[0, -1]
            cache = self.new_cache()
            self.model(input_ids=ids[:, :2], position_ids=torch.arange(2, device=self.device)[None], cache=cache,
                       use_cache=True)
            part = self.model(input_ids=ids[:, 2:], position_ids=torch.arange(2, 4, device=self.device)[None],
                              cache=cache, use_cache=True).logits[0, -1]
        self._captured.clear()
        # One path rounds unlike the other (half precision: by a few percent); a lost state changes
        # the logits wholesale.
        tolerance = 1e-3 if self.dtype == torch.float32 else 0.25
        return bool((whole - part).abs().max() <= tolerance * whole.abs().max())

    def check_blocks(self) -> None:
        """Raise the one-line reason when drafts cannot be verified at all (continues_blocks)."""
        if not self.continues_blocks:
            raise UnsupportedModelError(
                f"{self.family.name}'s recurrent layers restart from an empty state when several tokens are fed on "
                f"top of a cache (transformers' {type(self.model).__name__} cannot continue a state over a block), "
                "so no draft can be verified on it; use ar"
            )

    def tune_row_kernels(self, cache_dir: Path | None) -> row_kernels.RowPlan:
        """Pick, by measurement (cached under `cache_dir`), the matmul kernel of each few-row
        forward (row_kernels.py); attention-only models on CPU in float32, else nothing."""
        if self.family.recurrent or not row_kernels.applies(self.model):
            return row_kernels.STOCK
        self.row_plan = row_kernels.tune(self.model, self.vocab_size, self.row_kernel_key, cache_dir)
        return self.row_plan

    @property
    def row_kernel_key(self) -> str:
        """Names this model, device and dtype in the row kernels' timing caches."""
        return f"{Path(str(self.name)).name}-{self.device.type}-{str(self.dtype).split('.')[-1]}"

    @property
    def kernel_tag(self) -> str:
        """Names the row plan in caches of timings that depend on it ("" when stock)."""
        return row_kernels.tag(self.row_plan)

    def checkpoint(self, cache: DynamicCache) -> Checkpoint | None:
        """What `keep` needs to undo a verification forward: recurrent states cannot be cropped,
        so they are copied first; None for attention-only caches, which crop."""
        return checkpoint(cache) if self.family.recurrent else None

    def keep(self, cache: DynamicCache, start: int, fed: list[int], rows: list[int], saved: Checkpoint | None) -> None:
        """After `fed` went in at `start`, keep the entries of `rows` (offsets into `fed`) in order.

        Attention caches gather those rows. Recurrent caches go back to `saved` (taken before the
        forward) and replay the kept tokens, unless every fed token is kept; that replay is a
        chain forward of the accepted length, the price of states that cannot be cropped."""
        if rows == list(range(len(fed))):
            return
        if saved is None:
            keep_rows(cache, start, rows)
            return
        if rows != list(range(len(rows))):
            raise ValueError("a recurrent cache keeps a prefix of a chain; trees cannot be verified on it")
        restore(cache, saved)
        self.forward([fed[r] for r in rows], cache, start, last_only=True)

    def head_logits(self, hidden: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """The target's logits [..., V] from outputs of its last decoder layer [..., H]: its final
        norm, then its LM head. Distillation caches those outputs instead of full-vocab logits.
        `columns` [K] computes only those token ids' logits ([..., K]), the rows a drafter with a
        draft vocabulary is trained over, at K/V of the cost."""
        norm = getattr(self.model.get_decoder(), "norm", None)
        if norm is None:
            raise ValueError(f"cannot find the final norm of {type(self.model).__name__} (decoder.norm)")
        head = self.model.get_output_embeddings()
        normed = norm(hidden.to(head.weight.dtype))
        if columns is None:
            return head(normed)
        bias = head.bias[columns] if getattr(head, "bias", None) is not None else None
        return torch.nn.functional.linear(normed, head.weight[columns], bias)

    def capture_layers(self, layer_ids: tuple[int, ...]) -> None:
        """Hook the given decoder layers (0-based) so forward() returns their outputs."""
        if tuple(layer_ids) == self._hooked:
            return
        for bad in [i for i in layer_ids if not 0 <= i < self.num_layers]:
            raise ValueError(f"layer {bad} out of range: the target has {self.num_layers} layers")
        for handle in getattr(self, "_handles", []):
            handle.remove()
        self._handles = [self.layers[i].register_forward_hook(self._hook(i)) for i in layer_ids]
        self._hooked = tuple(layer_ids)

    def _hook(self, index: int):
        def save(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._captured[index] = hidden.detach()

        return save

    @torch.inference_mode()
    def forward(
        self,
        ids: list[int],
        cache: DynamicCache,
        start: int,
        tree: DraftTree | None = None,
        last_only: bool = False,
        allow: torch.Tensor | None = None,
        positions: list[int] | None = None,
    ) -> TargetOutput:
        """Feed `ids` at positions start.. on top of `cache` (which must hold exactly `start`
        entries). With `tree`, ids = [root] + tree tokens, and each node sees the cache, the
        root and its ancestors, at position start + depth. Instead of a tree, `allow` [T, T]
        and `positions` (absolute) give any visibility pattern inside the fed block. `last_only`
        skips the LM head on all but the last position (prefill)."""
        if tree is not None:
            allow, positions = tree.ancestor_mask(), tree.position_ids(start)
        if start > 0 and len(ids) > 1:
            self.check_blocks()
        device = self.device
        input_ids = torch.tensor([ids], device=device)
        if allow is None:
            position_ids = torch.arange(start, start + len(ids), device=device)[None]
            mask = None
        else:
            mask = self.family.tree_mask(allow, start, positions, self.dtype)
            mask = {k: m.to(device) for k, m in mask.items()} if isinstance(mask, dict) else mask.to(device)
            position_ids = torch.tensor([positions], device=device)
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=mask,
                cache=cache,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
            )
        except MODEL_ERRORS as exc:
            self._captured.clear()
            raise self.family.unsupported(exc) from exc
        features = None
        if self._hooked:
            features = torch.cat([self._captured[i][0] for i in self._hooked], dim=-1)
            self._captured.clear()
        return TargetOutput(out.logits[0].float(), features)
