"""DFlash 2: the DFlash drafter plus a two-tap dynamic convolution around every sublayer and a
candidate path selector on top of its block.

Written from the reference, not copied from it. Sources read: the z-lab release's test fixtures
(`z-lab/dflash` tests/fixtures/dflash2-config.json and dflash2-safetensors-header.json: every key
and tensor shape), vLLM's port (vllm/model_executor/models/qwen3_dflash2.py and
v1/worker/gpu/spec_decode/dflash2/speculator.py), vLLM speculators' training port, which names
z-lab/dflash@07ebd93 dflash/model.py as its source (src/speculators/models/dflash2/*), and SGLang's
config parser (srt/speculative/dflash_utils.py). z-lab's own model.py at that commit was not
reachable; where the ports agree we follow them.

The convolution (`GroupedDynamicConv`, one before-and-after pair per attention and per MLP
sublayer). Per block slot t and channel c in group g(c) = c // conv_group_size:

    coef_t = kernel_projection(x_t)                     [2 sides, K taps, G groups]
    prepare: x'_t = sum_j (base_kernel[0, j, c] + coef_t[0, j, g(c)]) * x_{t-j, c}
    finish:  y'_t = sum_j (base_kernel[1, j, c] + coef_t[1, j, g(c)]) * y_{t-j, c}

where x is the sublayer's normed input, y = sublayer(x') its output, and h += y'. Taps never
cross the block boundary: x_{t-j} is zero when t - j is before the block's slot 0 (the anchor).
Both sides' coefficients come from the one projection of the input. Identity initialisation
(base_kernel[:, 0] = 1, other taps 0, kernel_projection 0) makes the layer a DFlash layer, so a
DFlash drafter is a DFlash 2 drafter's starting point. Only the block goes through the
convolutions; the injected context keys/values are DFlash's, unchanged.

The selector (`CandidateSelector`). Slot t (t = 1..L-1 of the block, the t-th drafted token)
keeps the top-K of its logits: candidates c_t[0..K-1] ranked by unary score U_t (the logit,
times `output_multiplier`, soft-capped by `final_logit_softcapping` when the config sets them).
An edge from candidate a of the previous slot to candidate b of this one scores

    S_t(a, b) = U_t(b) + < A[a] * (W h_t), B[b] >

with A = predecessor_codebook [V, r], B = successor_codebook [V, r], W = hidden_projection
[r, H] and h_t the drafter's final-normed hidden state at slot t (the one its logits come from).
Slot 1's predecessor is the anchor (the last verified token). Greedy walks the argmax of
S_t(previous choice, .) slot by slot (first index on ties, i.e. the higher unary); at
temperature T > 0 each slot draws from q_t = softmax(S_t(previous choice, .) / T) over its K
candidates (inverse CDF), and q_t is returned so verification stays exact.

Attention: DFlash's rule (models/dflash.py, `DFlashSpec.layer_attention`): `layer_types`
"sliding_attention" layers see only context positions within `sliding_window` of each query;
causality inside the block is the top-level `is_causal` (or `dflash_config.causal`) when set, else
causal exactly on sliding layers. The published drafter sets is_causal false (bidirectional
blocks, windowed context).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from .dflash import DFlashDrafter, DFlashLayer, DFlashSpec


@dataclass(frozen=True)
class DFlash2Spec(DFlashSpec):
    """A DFlash spec plus the DFlash 2 keys of `dflash_config`."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.conv_kernel_size < 1 or self.conv_kernel_size > self.block_size:
            problems.append(f"conv_kernel_size {self.conv_kernel_size} must be in [1, block_size {self.block_size}]")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            problems.append(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if self.selector_rank < 1 or not 1 <= self.selector_top_k <= self.vocab_size:
            problems.append(f"selector_rank {self.selector_rank} and selector_top_k {self.selector_top_k} "
                            f"must be >= 1, top_k at most vocab_size {self.vocab_size}")
        if self.output_multiplier <= 0:
            problems.append(f"output_multiplier must be positive, got {self.output_multiplier}")
        if problems:
            raise ValueError("; ".join(problems))


class GroupedDynamicConv(nn.Module):
    """The two-tap (K-tap) grouped dynamic depthwise convolution of one sublayer (module docstring)."""

    def __init__(self, hidden: int, taps: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.taps, self.group_size, self.groups, self.block_size = taps, group_size, hidden // group_size, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)  # -> [side, tap, group]
        self.reset_identity()

    def reset_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, Q, H] (Q: whole blocks) -> the convolved input, and the output side's coefficients."""
        coef = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))  # [B, Q, 2, K, G]
        return self._convolve(x, coef[..., 0, :, :], 0), coef[..., 1, :, :]

    def finish(self, y: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, coef, 1)

    def _convolve(self, x: torch.Tensor, coef: torch.Tensor, side: int) -> torch.Tensor:
        q = x.shape[1]
        slot = torch.arange(q, device=x.device) % self.block_size
        grouped = x.unflatten(-1, (self.groups, self.group_size))  # [B, Q, G, S]
        base = self.base_kernel[side].to(x.dtype).unflatten(-1, (self.groups, self.group_size))  # [K, G, S]
        out = torch.zeros_like(grouped)
        for j in range(self.taps):
            shifted = F.pad(grouped, (0, 0, 0, 0, j, 0))[:, :q]  # x_{t-j}, zero before position 0
            inside = (slot >= j).to(x.dtype)[:, None, None]  # and zero across the block boundary
            out = out + (base[j] + coef[:, :, j, :, None]) * shifted * inside
        return out.flatten(-2)


class DFlash2Layer(DFlashLayer):
    """A DFlash layer whose attention and MLP each sit between a convolution's prepare and finish."""

    def __init__(self, spec: DFlash2Spec) -> None:
        super().__init__(spec)
        args = (spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size, spec.block_size)
        self.attention_conv = GroupedDynamicConv(*args)
        self.mlp_conv = GroupedDynamicConv(*args)

    def forward(self, h, rope, ctx_k, ctx_v, mask) -> torch.Tensor:
        x, coef = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, rope, ctx_k, ctx_v, mask), coef)
        x, coef = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), coef)


class CandidateSelector(nn.Module):
    """Scores edges between adjacent slots' top-K candidates (module docstring)."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))  # A
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))  # B
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)  # W

    def scores(self, hidden: torch.Tensor, candidates: torch.Tensor, unary: torch.Tensor, anchor: int) -> torch.Tensor:
        """S [T, K, K]: S[t, a, b] = unary[t, b] + <A[pred(t, a)] * W h_t, B[candidates[t, b]]>, where
        pred(0, .) = anchor and pred(t, a) = candidates[t - 1, a]. hidden [T, H]; candidates,
        unary [T, K]."""
        first = torch.full_like(candidates[:1], int(anchor))
        predecessors = torch.cat([first, candidates[:-1]])  # [T, K]
        context = self.predecessor_codebook[predecessors].float() * self.hidden_projection(hidden).float()[:, None]
        successors = self.successor_codebook[candidates].float()  # [T, K, r]
        return unary.float()[:, None, :] + context @ successors.transpose(1, 2)


@dataclass
class Lattice:
    """One block's selector input: candidates [T, K] ranked by unary score [T, K], edge scores
    S [T, K, K] (from the previous slot's candidate a to this slot's b), and the anchor."""

    candidates: torch.Tensor
    unary: torch.Tensor
    scores: torch.Tensor
    anchor: int


@dataclass
class Walk:
    """A path through the lattice: the candidate index chosen per slot, the score row each choice
    was made from (S_t(previous choice, .)) and the distribution q_t it was drawn from (softmax of
    the row / T; at T = 0, softmax of the row, for the trace only)."""

    ranks: list[int]
    rows: torch.Tensor  # [T, K]
    q: torch.Tensor  # [T, K]


def walk(scores: torch.Tensor, temperature: float, uniforms: torch.Tensor | None = None) -> Walk:
    """Walk S [T, K, K] from the anchor: argmax per slot at temperature 0, else inverse-CDF draws
    from softmax(row / temperature) with `uniforms` [T] in [0, 1)."""
    ranks, rows, qs, previous = [], [], [], 0
    for t in range(scores.shape[0]):
        row = scores[t, previous]
        if temperature == 0:
            q = torch.softmax(row, dim=-1)
            choice = int(torch.argmax(row))
        else:
            q = torch.softmax(row / temperature, dim=-1)
            choice = int(torch.searchsorted(torch.cumsum(q, 0), uniforms[t].to(q.dtype), right=True))
            if choice >= len(q):  # u above a cumulative sum that rounded below 1
                choice = int((q > 0).nonzero()[-1])
        ranks.append(choice)
        rows.append(row)
        qs.append(q)
        previous = choice
    return Walk(ranks, torch.stack(rows), torch.stack(qs))


class DFlash2Drafter(DFlashDrafter):
    """A DFlash drafter with DFlash 2 layers and a candidate selector. Without the selector (its
    `logits`, as DFlash uses them) it drafts independent per-slot argmaxes, like DFlash."""

    def __init__(self, spec: DFlash2Spec, embed: nn.Module, lm_head: nn.Module,
                 draft_ids: torch.Tensor | None = None) -> None:
        super().__init__(spec, embed, lm_head, draft_ids)
        self.layers = nn.ModuleList(DFlash2Layer(spec) for _ in range(spec.num_layers))
        self.candidate_selector = CandidateSelector(spec.hidden_size, spec.vocab_size, spec.selector_rank,
                                                    spec.selector_top_k)

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """DFlash's init, identity convolutions, normal(0, std) codebooks."""
        super().init_weights(generator, std)
        for layer in self.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        with torch.no_grad():
            for book in (self.candidate_selector.predecessor_codebook, self.candidate_selector.successor_codebook):
                book.copy_(torch.randn(book.shape, generator=generator) * std)

    def logits(self, hidden: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """DFlash's logits, times output_multiplier and soft-capped when the config says so."""
        return self.unary(super().logits(hidden, vocab))

    def unary(self, logits: torch.Tensor) -> torch.Tensor:
        """LM-head logits -> unary scores: times output_multiplier, soft-capped when the config says
        so (training scores the draft vocabulary's logits with this, not the full `logits`)."""
        spec = self.spec
        if spec.output_multiplier != 1.0:
            logits = logits * spec.output_multiplier
        if spec.final_logit_softcapping:
            cap = spec.final_logit_softcapping
            logits = torch.where(torch.isfinite(logits), torch.tanh(logits / cap) * cap, logits)  # -inf stays -inf
        return logits

    def lattice(self, hidden: torch.Tensor, anchor: int) -> Lattice:
        """The selector's lattice for slots with final-normed hidden states [T, H]."""
        unary, candidates = self.logits(hidden).float().topk(self.spec.selector_top_k, dim=-1)
        scores = self.candidate_selector.scores(hidden, candidates, unary, anchor)
        return Lattice(candidates, unary, scores, int(anchor))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's embeddings times `input_embedding_scale`: what DFlash 2's block reads."""
        h = super().embed(ids)
        return h if self.spec.input_embedding_scale == 1.0 else h * self.spec.input_embedding_scale


def from_dflash(drafter: DFlashDrafter, generator: torch.Generator, *, conv_kernel_size: int = 2,
                conv_group_size: int = 16, selector_rank: int = 256, selector_top_k: int = 16,
                codebook_std: float = 0.02) -> DFlash2Drafter:
    """The DFlash 2 drafter that starts where `drafter` is: its weights, its borrowed embedding,
    head and draft vocabulary, identity convolutions (so every hidden state is DFlash's, bit for
    bit) and a selector whose transition term is zero (hidden_projection 0), so every walk is the
    unary argmax path DFlash drafts. The codebooks start normal(0, codebook_std), as the
    reference's initializer_range: with one factor of the trilinear term at zero the start is
    exact, and the other two give it a gradient."""
    if drafter.draft_ids is not None and selector_top_k > len(drafter.draft_ids):
        raise ValueError(f"selector_top_k {selector_top_k} exceeds the {len(drafter.draft_ids)}-token draft vocabulary")
    base = drafter.spec
    spec = DFlash2Spec(**{f.name: getattr(base, f.name) for f in fields(DFlashSpec)},
                       conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                       selector_rank=selector_rank, selector_top_k=selector_top_k)
    weight = next(drafter.parameters())
    model = DFlash2Drafter(spec, *drafter._borrowed, drafter.draft_ids).to(weight.device, weight.dtype)
    missing, unexpected = model.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
    selector = model.candidate_selector
    with torch.no_grad():
        for book in (selector.predecessor_codebook, selector.successor_codebook):
            book.copy_(torch.randn(book.shape, generator=generator) * codebook_std)
        selector.hidden_projection.weight.zero_()
    return model.train(drafter.training)
