"""The DFlash drafter: a few Qwen3-style decoder layers that draft a whole block in one pass.

Written from the description in research/methods.md §1 (Chen, Liang, Liu 2026). The drafter owns
no embedding and no LM head: it borrows the target's, frozen. What it adds is KV injection: the
target's hidden features of the committed tokens are fused (`fc` + `hidden_norm`) and every draft
layer projects them with its own k/v projections into keys/values that sit *before* the block's.
Queries come from the block only, `[last committed token, MASK x (L-1)]`, which attends to the
context and bidirectionally to itself. So one forward drafts L-1 tokens.

One attention code path serves both uses: inference passes no mask and a `DFlashCache` holding
the projected context; training passes the dense block mask of `training_block_mask` and the
whole teacher-forced context at once. Checkpoint IO (z-lab format) is in models/dflash_io.py.

Attention layout (`DFlashSpec.layer_attention`, one rule for DFlash and DFlash 2, as vLLM's DFlash
model and z-lab's current model.py resolve it): a `sliding_attention` layer's query at position p
sees only keys at positions > p - sliding_window. Every layer is causal inside the block when the
config's `is_causal` (or `dflash_config.causal`) says so; without that key, exactly the sliding
layers are. Full, bidirectional layers get no mask of their own (`layer_mask`), as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from . import row_kernels
from .int8_linear import Int8Linear, quantize_layers

INT8_RESCORED = 16  # per row, the int8 draft head's top logits recomputed in float (DFlash 2's selector reads 16)

FULL, SLIDING = "full_attention", "sliding_attention"


def default_target_layers(num_target_layers: int, n_features: int) -> tuple[int, ...]:
    """z-lab's default: `n_features` ids evenly spaced from 1 to num_target_layers - 3, rounded;
    a single feature layer is the middle of that range."""
    start, end = 1, max(1, num_target_layers - 3)
    if n_features == 1:
        return ((start + end) // 2,)
    step = (end - start) / (n_features - 1)
    return tuple(int(round(start + i * step)) for i in range(n_features))


@dataclass(frozen=True)
class DFlashSpec:
    """Shape of a drafter, mirroring the keys of its config.json."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    num_target_layers: int | None  # None: config.json does not say (gpt-oss release); the target's count is used
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 32768
    layer_types: tuple[str, ...] = ()  # one per layer; () = all full attention
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: causal inside the block exactly on sliding layers
    attention_bias: bool = False  # q/k/v/o biases (gpt-oss drafters)

    def __post_init__(self) -> None:
        problems = []
        if self.layer_types and (len(self.layer_types) != self.num_layers or set(self.layer_types) - {FULL, SLIDING}):
            problems.append(f"layer_types {list(self.layer_types)} must name {FULL} or {SLIDING} for each of "
                            f"{self.num_layers} layers")
        if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            problems.append("sliding_attention layers need a positive sliding_window")
        if problems:
            raise ValueError("; ".join(problems))

    def layer_attention(self, i: int) -> tuple[int | None, bool]:
        """(sliding window or None, causal inside the block) of draft layer i."""
        sliding = bool(self.layer_types) and self.layer_types[i] == SLIDING
        causal = sliding if self.is_causal is None else self.is_causal
        return (self.sliding_window if sliding else None), causal

    @property
    def feature_dim_factor(self) -> int:
        return len(self.target_layer_ids)

    def qwen3_config(self) -> Qwen3Config:
        """The equivalent transformers Qwen3Config (used for RoPE, which honours rope_scaling)."""
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        return Qwen3Config(
            hidden_size=self.hidden_size, num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps, rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings,
        )


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half convention): x [B, heads, T, hd], cos/sin [B, T, hd]."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DFlashCache:
    """Per-layer keys/values [B, kv_heads, S, hd] of the projected context (already rotated), and
    the position of each slot [B, S], which sliding layers need (a batch's slots are not its
    positions). Block keys/values are never stored, so its length is the number of committed
    positions seen."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[2])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new context k/v for `layer`; returns everything cached for it."""
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if old_k is None else torch.cat([old_k, k], dim=2)
        self.values[layer] = v if old_v is None else torch.cat([old_v, v], dim=2)
        return self.keys[layer], self.values[layer]

    def append_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Add the positions [B, C] of one forward's new context; returns those of every slot [B, S]."""
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions], dim=1)
        return self.positions

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (roll back the rest)."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[:, :, :length], v[:, :, :length]
        if self.positions is not None:
            self.positions = self.positions[:, :length]


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [context ; block]; per-head q/k RMSNorm."""

    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.n_heads, self.n_kv, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        bias = spec.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[B, T, n*hd] -> [B, n, T, hd]."""
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def project_kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> rotated keys, values [B, kv_heads, T, hd]."""
        k = self.k_norm(self.k_proj(x).view(*x.shape[:2], self.n_kv, self.head_dim)).transpose(1, 2)
        return _rotate(k, *rope), self._heads(self.v_proj(x), self.n_kv)

    def forward(
        self,
        x: torch.Tensor,  # [B, Q, H] block hidden states (after input_layernorm)
        rope: tuple[torch.Tensor, torch.Tensor],  # block cos/sin [B, Q, hd]
        ctx_k: torch.Tensor,  # [B, kv_heads, C, hd]
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None,  # bool [B, 1, Q, C + Q] (True = attend) or None = see all
    ) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).view(*x.shape[:2], self.n_heads, self.head_dim)).transpose(1, 2)
        q = _rotate(q, *rope)  # [B, heads, Q, hd]
        k_blk, v_blk = self.project_kv(x, rope)
        k, v = torch.cat([ctx_k, k_blk], dim=2), torch.cat([ctx_v, v_blk], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [B, heads, Q, hd]
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashMLP(nn.Module):
    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = DFlashAttention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = DFlashMLP(spec)

    def forward(self, h, rope, ctx_k, ctx_v, mask) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """The drafter's own weights (fc, hidden_norm, layers, norm) plus the target's borrowed,
    frozen embedding and LM head, which are kept out of parameters() and state_dict().

    With `draft_ids` (a reduced draft vocabulary: sorted target ids [N]), the head computes only
    those N rows of the target's LM head and every other token gets logit -inf (q = 0), so
    drafting costs N/V of the full head and verification stays exact.

    `row_plan`: row counts whose products run as W @ x^T (models/row_kernels.py), set
    when the drafter is loaded for a target that measured them.

    The drafter may compute in another dtype than the target (`compute_dtype`, its own weights'):
    a bfloat16 drafter beside a float32 target on a CPU with bf16 matrix units (drafter_dtype in
    models/dflash_io.py). Inputs from the target are cast on the way in; draft-vocabulary logits
    come out in float32 and full-head logits from the target's own head, so callers never see the
    difference; verification stays the target's own. On a CPU its decoder layers and
    draft-vocabulary head may hold int8 weights instead (draft_dtype int8, `int8_head`,
    models/int8_linear.py), `fc` and the norms staying float32."""

    row_plan: row_kernels.RowPlan = row_kernels.STOCK
    int8_head = False  # draft-vocabulary head rows as int8 (models/int8_linear.py), set at load

    def __init__(self, spec: DFlashSpec, embed: nn.Module, lm_head: nn.Module,
                 draft_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.fc = nn.Linear(spec.feature_dim_factor * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(spec.qwen3_config())
        self._borrowed = (embed, lm_head)  # a tuple: not registered as submodules
        self.register_buffer("draft_ids", None if draft_ids is None else draft_ids.long(), persistent=False)

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Qwen-style init: normal(0, std) linears, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                    if module.bias is not None:
                        module.bias.zero_()

    def quantize_int8(self) -> None:
        """Int8 weights for the decoder layers' products and the draft-vocabulary head (in place;
        models/int8_linear.py says why `fc` stays float)."""
        quantize_layers(self.layers)
        self.int8_head = True

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, Q] -> the block's input embeddings [B, Q, H]: the target's."""
        return self._borrowed[0](ids).to(self.compute_dtype)

    def logits(self, hidden: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] (already normed) -> target LM head logits [..., V], or only those of
        the token ids in `vocab` [K] (training: the head is most of a step's cost). With a draft
        vocabulary and no `vocab`, logits [..., V] that are -inf outside it."""
        head = self._borrowed[1]
        if vocab is None and self.draft_ids is None:
            return head(hidden.to(head.weight.dtype))
        if vocab is not None:
            return self._rows(hidden, vocab)
        full = hidden.new_full((*hidden.shape[:-1], head.weight.shape[0]), float("-inf"), dtype=torch.float32)
        full[..., self.draft_ids] = self.draft_logits(hidden)
        return full

    def draft_probs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafter's distribution (float32) for each row of `hidden`: over the draft vocabulary
        when there is one, [..., N] with `draft_ids` (returned beside it) naming its columns, else
        over the target's vocabulary [..., V] (ids None). Every token outside a draft vocabulary has
        probability 0, so this is the same distribution without filling and normalising V - N
        zeros (on the 2-core CPU, a third as much again as the draft head's own product)."""
        if self.draft_ids is None:
            return torch.softmax(self.logits(hidden).float(), dim=-1), None
        return torch.softmax(self.draft_logits(hidden), dim=-1), self.draft_ids

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., N] (float32) over the draft vocabulary, from a copy of its head rows kept
        between calls (the target's head is frozen; the copy follows its device and the drafter's
        compute dtype)."""
        weight, dtype = self._borrowed[1].weight, self.compute_dtype
        bias = getattr(self._borrowed[1], "bias", None)
        bias = None if bias is None else bias[self.draft_ids].to(dtype)
        key = (weight.data_ptr(), dtype, weight.device, self.int8_head, id(self.row_plan))
        if getattr(self, "_draft_head", (None,))[0] != key:
            rows = weight[self.draft_ids].detach().to(dtype)
            self._draft_head = (key, rows, Int8Linear(rows, bias) if self.int8_head else None,
                                row_kernels.panels_for(rows, self.row_plan))
        rows, int8, panels = self._draft_head[1:]
        if int8 is None:
            return row_kernels.linear(hidden.to(dtype), rows, bias, self.row_plan, panels).float()
        # the int8 head ranks the vocabulary; its leaders are recomputed in float, so the drafted
        # argmax is the float head's (int8 alone cost a little acceptance, docs/dflash.md)
        logits = int8(hidden).float()
        top = logits.topk(min(INT8_RESCORED, logits.shape[-1]), dim=-1).indices  # [..., R]
        exact = torch.einsum("...h,...rh->...r", hidden.to(dtype), rows[top])
        return logits.scatter(-1, top, (exact if bias is None else exact + bias[top]).float())

    def _rows(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits [..., K] of the LM head rows `ids` [K]."""
        head = self._borrowed[1]
        bias = head.bias[ids] if getattr(head, "bias", None) is not None else None
        return F.linear(hidden.to(head.weight.dtype), head.weight[ids], bias)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features [B, C, n_feat*H] -> context states [B, C, H]."""
        return self.hidden_norm(self.fc(features.to(self.compute_dtype)))

    def forward(
        self,
        block_ids: torch.Tensor,  # [B, Q] block tokens (anchor, MASK...) of one or more blocks
        block_pos: torch.Tensor,  # [B, Q] absolute positions
        features: torch.Tensor,  # [B, C, n_feat*H] target features of new context positions
        ctx_pos: torch.Tensor,  # [B, C]
        mask: torch.Tensor | None = None,  # bool [B, 1, Q, S + Q]; S = cached + C
        cache: DFlashCache | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states of the block positions [B, Q, H]. With a cache, the new
        context K/V are appended to it and attention sees all of it, narrowed per layer by its
        window and causality (`layer_mask`)."""
        h = self.embed(block_ids)
        rope_blk = self.rotary(h, block_pos)
        ctx = self.fuse(features)
        rope_ctx = self.rotary(ctx, ctx_pos)
        seen = ctx_pos if cache is None else cache.append_positions(ctx_pos)  # every context position [B, S]
        key_pos = torch.cat([seen.expand(len(block_pos), -1), block_pos], dim=1)
        masks: dict[tuple[int | None, bool], torch.Tensor | None] = {}
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, rope_ctx)
            if cache is not None:
                k, v = cache.append(i, k, v)
            rule = self.spec.layer_attention(i)
            if rule not in masks:
                masks[rule] = layer_mask(mask, *rule, block_pos, key_pos)
            h = layer(h, rope_blk, k, v, masks[rule])
        return self.norm(h)


def layer_mask(mask: torch.Tensor | None, window: int | None, causal: bool, block_pos: torch.Tensor,
               key_pos: torch.Tensor) -> torch.Tensor | None:
    """`mask` (bool [B, 1, Q, S + Q] or None = see all) narrowed to keys within `window` of each
    query and, when `causal`, to block slots at or before it; unchanged for a full, bidirectional
    layer. block_pos [B, Q]: query positions; key_pos [B, S + Q]: the context's, then the block's."""
    if window is None and not causal:
        return mask
    query_pos, keys = block_pos[:, :, None], key_pos[:, None, :]  # [B, Q, 1], [B, 1, S + Q]
    allowed = torch.ones(*block_pos.shape, key_pos.shape[1], dtype=torch.bool, device=block_pos.device)
    if window is not None:
        allowed &= keys > query_pos - window
    if causal:
        in_block = torch.arange(key_pos.shape[1], device=block_pos.device) >= key_pos.shape[1] - block_pos.shape[1]
        allowed &= ~in_block | (keys <= query_pos)
    allowed = allowed[:, None]
    return allowed if mask is None else mask & allowed


def training_block_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """The dense training mask, True = attend: bool [B, 1, N*L, S + N*L].

    KV = [context 0..S-1 | block_0 | ... | block_{N-1}], Q = the blocks. Block n (anchor a_n)
    sees context positions j < a_n and its own L slots; other blocks are invisible; an invalid
    block (valid False, padding) sees nothing (SDPA then yields zeros; its loss weight is 0).
    anchors, valid: [B, N].
    """
    b, n = anchors.shape
    q_block = torch.arange(n * block_size, device=anchors.device) // block_size  # [Q]
    ctx = torch.arange(ctx_len, device=anchors.device)[None, None] < anchors[:, q_block, None]  # [B, Q, S]
    own = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)  # [B, Q, Q]
    mask = torch.cat([ctx, own], dim=-1) & valid[:, q_block, None]
    return mask[:, None]


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids and positions for anchored blocks: tokens [B, S], anchors [B, N] ->
    ids [B, N*L] = [token at a_n, MASK x (L-1)] per block, positions a_n + k."""
    b, n = anchors.shape
    slots = torch.arange(block_size, device=anchors.device)
    positions = (anchors[..., None] + slots).reshape(b, n * block_size)
    ids = torch.full((b, n, block_size), mask_id, dtype=tokens.dtype, device=tokens.device)
    ids[..., 0] = tokens.gather(1, anchors)
    return ids.reshape(b, n * block_size), positions


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for slots k = 1..L-1 ([L-1]); slot 0 carries no loss."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma) if math.isfinite(gamma) else torch.ones(block_size - 1)
