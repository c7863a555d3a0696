"""DeLS-Spec's short-context expert: a small GRU that reads only the tokens inside the block.

DFlash predicts each block position from the context alone, so position k cannot see what was
drafted at positions < k. The local head fills that gap: it runs over the frozen target
embeddings of the block's own tokens and predicts the next one, through the target's frozen LM
head (a projection to the target's hidden size, then the LM head: no vocabulary-sized weights
of its own, so it stays a few MB). It never sees the target's hidden states, so it is trained
on plain text with next-token prediction and works with any DFlash drafter of the same target.

Checkpoint: config.json (architectures ["DeLSLocalHead"]) + model.safetensors with
`gru.weight_ih_l0`, `gru.weight_hh_l0`, `proj.weight` and `log_prior` (the log unigram
frequency of the training tokens, the l_prior of the fusion rule).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import CheckpointError, DrafterMismatchError
from . import packed_kernel, row_kernels

_ARCH = "DeLSLocalHead"


@dataclass(frozen=True)
class LocalHeadSpec:
    vocab_size: int
    embed_dim: int  # the target's hidden size (its embeddings in, its LM head out)
    gru_hidden_size: int = 512
    block_size: int = 16


class LocalHead(nn.Module):
    """GRU over block tokens -> logits of the next token. Borrowed embedding and LM head are kept
    out of parameters() and state_dict(), like the DFlash drafter's. `row_plan`: the target's
    measured few-row kernels (models/row_kernels.py), which drafting's one-token steps take
    (`load_local_head` sets it)."""

    row_plan: row_kernels.RowPlan = row_kernels.STOCK

    def __init__(self, spec: LocalHeadSpec, embed: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.spec = spec
        self.gru = nn.GRU(spec.embed_dim, spec.gru_hidden_size, bias=False, batch_first=True)
        self.proj = nn.Linear(spec.gru_hidden_size, spec.embed_dim, bias=False)
        self.register_buffer("log_prior", torch.zeros(spec.vocab_size))
        self._borrowed = (embed, lm_head)

    def token_step(self, tokens: torch.Tensor | None = None) -> TokenStep:
        """The head one token at a time, with the GRU's input products of `tokens` (target ids,
        e.g. a drafter's draft vocabulary) computed once; kept while the weights and tokens stay."""
        weight = self.gru.weight_ih_l0
        key = (weight.data_ptr(), weight.dtype, weight.device, id(self.row_plan),
               None if tokens is None else (tokens.data_ptr(), len(tokens)))
        if getattr(self, "_token_step", (None,))[0] != key:
            self._token_step = (key, TokenStep(self, tokens))
        return self._token_step[1]

    def readout_rows(self, ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """A readout over the tokens `ids` only (the borrowed LM head's rows for them), to pass
        as `readout` when only a few tokens' logits are needed."""
        head = self._borrowed[1]
        bias = None if getattr(head, "bias", None) is None else head.bias.index_select(0, ids)
        rows = head.weight.index_select(0, ids)  # a third of advanced indexing's time on a 49152-row head
        return lambda hidden: nn.functional.linear(hidden, rows, bias)

    def candidate_readout(self, ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """A readout over different tokens at every position: ids [B, T, C] -> logits [B, T, C]
        from hidden [B, T, E]. Training against a drafter (training/local_head_fusion.py) scores
        each slot's own candidates only, as the method does."""
        head = self._borrowed[1]
        rows = head.weight[ids]  # [B, T, C, E]
        bias = None if getattr(head, "bias", None) is None else head.bias[ids]

        def readout(hidden: torch.Tensor) -> torch.Tensor:
            logits = torch.einsum("bte,btce->btc", hidden, rows.to(hidden.dtype))
            return logits if bias is None else logits + bias

        return readout

    def forward(self, ids: torch.Tensor, state: torch.Tensor | None = None,
                readout: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] -> (logits [B, T, V]: position j predicts token j+1, GRU state [1, B, G]).
        `readout` replaces the borrowed LM head, e.g. a DFlash drafter's `draft_logits` (the rows of
        the same head for its draft vocabulary only: the head is most of a step's cost)."""
        out, state = self.gru(self.embedded(ids), state)  # [B, T, G]
        return self.read_out(out, readout), state

    def embedded(self, ids: torch.Tensor) -> torch.Tensor:
        """The borrowed embeddings of `ids`, in the GRU's dtype: [..., E]."""
        return self._borrowed[0](ids).to(self.proj.weight.dtype)

    def read_out(self, out: torch.Tensor, readout: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        """GRU outputs [..., G] -> float32 logits of the next token through `readout`, or the
        borrowed LM head."""
        head = self._borrowed[1]
        return (readout or head)(self.proj(out).to(head.weight.dtype)).float()


class TokenStep:
    """One token through the head: its GRU step and the logits after it, as drafting needs it (a
    tree expands one node at a time). Why not the module: on the 2-core CPU nn.GRU costs ~0.11 ms
    for one token, half of it the input product W_ih x, which depends on the token alone; here the
    products of a fixed token set are a table row (8192 tokens x 3G: 50 MB in float32), other
    tokens are computed as before, and the cell is written out (PyTorch's GRU, no biases). Reading
    a tree's siblings from their shared state in one batch measured no faster in a run: a batch
    computes every sibling, where a tree expands one or two.

    The readout is a table too: the LM head's rows for the token set times the projection,
    (W_lm P) [n, G] (16 MB for 8192 tokens, G = 512), so a node's logits over a few of those
    tokens are one small product with its state, where proj then the rows read P (1.2 MB) and
    cast twice for every node.

    The recurrent product W_hh h (3G x G, 3 MB in float32) is the largest single cost left; where
    the head's row plan uses the packed kernel, it streams a packed copy of W_hh (on the 2-core
    AVX-512 CPU, two threads: 18 against 39 µs a product). Where the native library loaded
    (`native`), `fused` does a DeLS tree node's whole step, cell, readout and fusion, in one call
    (fused_node.cpp: about thirty PyTorch ops otherwise, mostly per-op overhead)."""

    @torch.inference_mode()
    def __init__(self, head: LocalHead, tokens: torch.Tensor | None) -> None:
        self.head = head
        self.w_ih, self.w_hh = head.gru.weight_ih_l0, head.gru.weight_hh_l0
        self.plan, self.w_hh_panels = head.row_plan, row_kernels.panels_for(self.w_hh, head.row_plan)
        self.rows: dict[int, int] = {}
        self.table = self.reads = self.read_bias = None
        if tokens is not None:
            tokens = tokens.to(self.w_ih.device)
            self.rows = {token: i for i, token in enumerate(tokens.tolist())}
            self.table = self.inputs(tokens)
            lm = head._borrowed[1]
            self.reads = lm.weight.index_select(0, tokens).to(self.w_ih.dtype) @ head.proj.weight
            bias = getattr(lm, "bias", None)
            self.read_bias = None if bias is None else bias.index_select(0, tokens).float()
        # the fused node (fused_node.cpp) where the native library loaded: float32 CPU weights
        self.native = (packed_kernel.loaded() and self.reads is not None and self.w_hh.dtype == torch.float32
                       and self.w_hh.device.type == "cpu" and self.w_hh.is_contiguous())
        # which streams W_hh in float16 where that holds it exactly (a head saved in float16 does)
        half = self.w_hh.half() if self.native else None
        self.w_hh_native = half if half is not None and torch.equal(half.float(), self.w_hh) else self.w_hh

    def inputs(self, tokens: torch.Tensor) -> torch.Tensor:
        """W_ih x for the embeddings x of `tokens` [n] -> [n, 3G]."""
        return nn.functional.linear(self.head.embedded(tokens), self.w_ih)

    def readout(self, rows: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """State [G] -> float32 logits of the token set's `rows` (positions in it; None: all of
        it), from the readout table; without a token set, `rows` are target ids (None: every
        token), read through proj and the LM head."""
        if self.reads is None:
            rows_readout = None if rows is None else self.head.readout_rows(rows)
            return lambda state: self.head.read_out(state, rows_readout)
        matrix = self.reads if rows is None else self.reads.index_select(0, rows)
        bias = None if self.read_bias is None else self.read_bias if rows is None else self.read_bias[rows]
        if bias is None:
            return lambda state: torch.mv(matrix, state).float()
        return lambda state: torch.mv(matrix, state).float() + bias

    def input_products(self, token: int) -> torch.Tensor:
        """W_ih x for one token [3G]: its table row, or computed for a token outside the set."""
        row = self.rows.get(token)
        return self.table[row] if row is not None else self.inputs(torch.tensor([token], device=self.w_ih.device))[0]

    @torch.inference_mode()
    def fused(self, token: int, state: torch.Tensor | None, rows: torch.Tensor | None, scores: torch.Tensor,
              alpha: float, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeLS's fusion after reading `token`, in one native call (`native` must be true): the
        GRU step, the readout over the pool `rows` (positions in the token set; None: all of it)
        read in place from the table, fused = scores + alpha * short, and the fused softmax's
        argmax then top `width` -> (state, short, fused, their positions in the pool, their
        probabilities). What __call__ and the fusion's ops compute, to float rounding."""
        return packed_kernel.fused_node(self.input_products(token), state, self.w_hh_native, self.reads, self.read_bias,
                                        rows, scores, alpha, width)

    @torch.inference_mode()
    def __call__(self, token: int, state: torch.Tensor | None,
                 readout: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """After reading `token` from `state` ([G], None at a block's start): the logits of the
        next token (float32: `readout` of the new state, e.g. `self.readout(rows)`; by default
        over every token, as LocalHead.forward) and the GRU state [G]."""
        i_r, i_z, i_n = self.input_products(token).chunk(3)
        if state is None:
            z, n = torch.sigmoid(i_z), torch.tanh(i_n)
            state = n - z * n
        else:
            h_r, h_z, h_n = row_kernels.linear(state[None], self.w_hh, None, self.plan, self.w_hh_panels)[0].chunk(3)
            z, n = torch.sigmoid(i_z + h_z), torch.tanh(i_n + torch.sigmoid(i_r + h_r) * h_n)
            state = n + z * (state - n)
        return (readout or (lambda s: self.head.read_out(s, None)))(state), state


def check_fits(spec: LocalHeadSpec, target) -> None:
    if spec.vocab_size != target.vocab_size or spec.embed_dim != target.hidden_size:
        raise DrafterMismatchError(
            f"local head expects vocab {spec.vocab_size} and hidden size {spec.embed_dim}; the target has "
            f"vocab {target.vocab_size} and hidden size {target.hidden_size}: train a local head for this target"
        )


def build_local_head(spec: LocalHeadSpec, target) -> LocalHead:
    check_fits(spec, target)
    model = target.model
    head = LocalHead(spec, model.get_input_embeddings(), model.get_output_embeddings())
    return head.to(device=target.device, dtype=target.dtype)


def save_local_head(head: LocalHead, folder: Path, dtype: torch.dtype = torch.float16, extra: dict | None = None) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [_ARCH], "head_type": "rnn", **asdict(head.spec), **(extra or {})}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items() if k != "log_prior"}
    tensors["log_prior"] = head.log_prior.detach().float().cpu().contiguous()
    save_file(tensors, str(folder / "model.safetensors"))


def load_local_head(folder: Path | str, target) -> LocalHead:
    """Read a saved local head for `target`, with strict key and shape checks."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
        tensors = load_file(str(folder / "model.safetensors"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"local head checkpoint incomplete in {folder}: {exc.filename} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the local head in {folder}: {exc}") from None
    if _ARCH not in config.get("architectures", []):
        raise CheckpointError(f"{folder} is not a DeLS local head (architectures: {config.get('architectures')})")
    spec = LocalHeadSpec(**{k: config[k] for k in LocalHeadSpec.__dataclass_fields__})
    head = build_local_head(spec, target)
    expected = set(head.state_dict())
    if set(tensors) != expected:
        raise CheckpointError(
            f"local head tensors in {folder} do not match its config: missing {sorted(expected - set(tensors))}, "
            f"unexpected {sorted(set(tensors) - expected)}"
        )
    head.load_state_dict({k: v.to(target.dtype) if k != "log_prior" else v for k, v in tensors.items()})
    head.row_plan = getattr(target, "row_plan", row_kernels.STOCK)
    return head.eval()
