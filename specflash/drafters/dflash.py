"""DFlash in the engine: one drafter forward per step drafts a block, verified as a tree of its
most probable paths (or as its argmax chain).

The engine hands the drafter the target features of every newly committed position (`observe`);
they wait until the next `propose`, which appends their projected K/V to the drafter's context
cache and runs the block [last committed token, MASK x (L-1)] through the drafter once. The
drafts are the slots' top tokens proposed as point masses (q = None), even at temperature > 0:
the engine's point-mass rule then keeps the output distribution exactly the target's, and
top-token blocks are far more coherent than tokens sampled independently per position
(methods.md §1.2). The drafter's softmax probability of each drafted token goes into the trace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, DrafterMismatchError, MethodConfigError
from ..models import row_kernels
from ..models.dflash import DFlashCache, DFlashDrafter
from ..models.dflash_io import DRAFTER_DTYPE_CHOICES
from ..tree import DraftTree, Successor, best_first_tree
from .base import Draft, Drafter
from .datastore import Datastore
from .gate import DraftGate, GateDecision
from .lookup_graft import branch_point, graft, grafted_value, own_share
from .lookup_source import Continuation, LookupSource


@dataclass(frozen=True)
class DFlashFamilyConfig:
    """The knobs every DFlash-family method shares. The checkpoint fixes the block size L;
    `max_draft` (None = L - 1) caps the number of drafted tokens per step, e.g. to trade
    acceptance for cheaper verification. `gate` lets the
    draft gate (gate.py) shrink the draft, down to none, when recent acceptance does not pay for
    drafting on this device; it probes again every `probe_every` steps or more, and starts drafting
    again once a width is worth `switch_on` times plain decoding. `lookup` adds prompt lookup as a
    second source of drafts (lookup_source.py), chosen over the drafter on steps where the gate's
    estimates value it more; `lookup=false` shows the drafter alone, and so does `gate=false`,
    which drafts the drafter's block every step with nothing to choose between sources;
    `lookup_max_ngram` is the longest match it looks for, each length with its own estimates.
    `draft_dtype` is what the drafter computes in (models/dflash_io.py drafter_dtype and
    drafter_int8: "auto" is bfloat16 beside a float32 target on a CPU with bf16 matrix units, int8
    weights on one without them that has an int8 engine, else the target's dtype); it changes
    drafting speed, never the output. `tree`: verify the block's most probable paths as a tree,
    as many nodes as the chain would have had tokens, instead of one chain (how each method
    scores its paths is its own: candidate_tree for DFlash's slots); on a target with recurrent
    layers, whose state keeps one path, chains all the same (the run's config records what was
    drafted); `tree_width` is how many top tokens per position a tree may branch into.
    `graft_lookup`: where a tree is drafted and prompt lookup is on, its continuation joins the
    tree as a branch, as far as it pays (lookup_graft.py). `datastore`: where a tree is drafted
    with the gate on, the continuation of the context's tail in the target's own earlier answers
    joins it the same way (datastore.py); `datastore_folder` is the folder of harvests it is built
    from (None: the preset's, where the target is a preset that has one), `datastore_min_ngram`
    the shortest tail it matches (a single common token's continuations are close to random)."""

    max_draft: int | None = None
    gate: bool = True
    probe_every: int = 8
    switch_on: float = 1.0
    draft_dtype: str = "auto"
    lookup: bool = True
    lookup_max_ngram: int = 3
    tree: bool = True
    tree_width: int = 4
    graft_lookup: bool = True
    datastore: bool = True
    datastore_folder: str | None = None
    datastore_min_ngram: int = 3

    def __post_init__(self) -> None:
        if self.max_draft is not None and (
            not isinstance(self.max_draft, int) or isinstance(self.max_draft, bool) or self.max_draft < 1
        ):
            raise MethodConfigError(f"max_draft must be an integer >= 1 or None, got {self.max_draft!r}")
        if not isinstance(self.gate, bool):
            raise MethodConfigError(f"gate must be true or false, got {self.gate!r}")
        if not isinstance(self.probe_every, int) or isinstance(self.probe_every, bool) or self.probe_every < 1:
            raise MethodConfigError(f"probe_every must be an integer >= 1, got {self.probe_every!r}")
        if isinstance(self.switch_on, bool) or not isinstance(self.switch_on, (int, float)) or not self.switch_on >= 1:
            raise MethodConfigError(f"switch_on must be a number >= 1 (1 = no margin), got {self.switch_on!r}")
        if not isinstance(self.lookup, bool):
            raise MethodConfigError(f"lookup must be true or false, got {self.lookup!r}")
        if (not isinstance(self.lookup_max_ngram, int) or isinstance(self.lookup_max_ngram, bool)
                or self.lookup_max_ngram < 1):
            raise MethodConfigError(f"lookup_max_ngram must be an integer >= 1, got {self.lookup_max_ngram!r}")
        if self.draft_dtype not in DRAFTER_DTYPE_CHOICES:
            raise MethodConfigError(f"draft_dtype must be one of {', '.join(DRAFTER_DTYPE_CHOICES)}, "
                                    f"got {self.draft_dtype!r}")
        check_tree_knobs(self.tree, self.tree_width, self.graft_lookup)
        if not isinstance(self.datastore, bool):
            raise MethodConfigError(f"datastore must be true or false, got {self.datastore!r}")
        if isinstance(self.datastore_min_ngram, bool) or not isinstance(self.datastore_min_ngram, int) \
                or self.datastore_min_ngram < 1:
            raise MethodConfigError(f"datastore_min_ngram must be an integer >= 1, got {self.datastore_min_ngram!r}")
        if self.datastore_folder is not None and not isinstance(self.datastore_folder, str):
            raise MethodConfigError(f"datastore_folder must be a folder path, got {self.datastore_folder!r}")


@dataclass(frozen=True)
class DFlashConfig(DFlashFamilyConfig):
    """DFlash's knobs: the family's; its tree is the most probable paths through each slot's top
    tokens (candidate_tree), slots scored as if independent."""


class DFlashEngineDrafter(Drafter):
    name = "dflash"

    def __init__(self, model: DFlashDrafter, cfg: DFlashFamilyConfig, cost: list[float] | None = None) -> None:
        """`cost`: the device's verify-cost curve (verify_cost.py), which the draft gate needs."""
        self.model = model.eval()
        self.cfg = cfg
        self.spec = model.spec
        self.feature_layers = tuple(self.spec.target_layer_ids)
        self.device = next(model.parameters()).device
        if cfg.gate and cost is None:
            raise MethodConfigError("the draft gate needs the device's verify-cost curve; pass cost= or gate=False")
        self.cost = cost
        self.trees = cfg.tree
        self.store: Datastore | None = None  # bind's

    def bind(self, target) -> None:
        self.trees = self.cfg.tree and not target.family.recurrent
        self.store = self.datastore_for(target)

    def datastore_for(self, target) -> Datastore | None:
        """The datastore whose continuations join this run's trees: where trees are drafted with
        the gate on (the graft is valued from its estimates) and `datastore` is on, built from
        `datastore_folder` or the preset's harvests; None where there is none."""
        if not (self.cfg.datastore and self.cfg.gate and self.trees):
            return None
        from ..models.presets import preset_datastore  # presets import the methods, this module among them

        folder = self.cfg.datastore_folder or preset_datastore(str(target.name))
        if folder is None or (self.cfg.datastore_folder is None and not Path(folder).is_dir()):
            return None  # a preset's harvests left out of a copy of the project: drafting goes on without them
        store = Datastore.from_harvests(folder)
        other = sorted(store.tokenizers - {target.tokenizer_id}) if target.tokenizer_id else []
        if other:
            raise DrafterMismatchError(
                f"the datastore in {folder} was harvested with another tokenizer (fingerprint {', '.join(other)}; "
                f"the target's is {target.tokenizer_id}): its token ids mean other words; "
                "harvest this target's answers")
        if store.largest_id >= target.vocab_size:
            raise DrafterMismatchError(
                f"the datastore in {folder} holds token id {store.largest_id}, beyond the target's vocabulary of "
                f"{target.vocab_size}: it was harvested from another model; harvest this target's answers")
        return store

    def begin(self, prompt_ids: list[int], sampling, generator) -> None:
        super().begin(prompt_ids, sampling, generator)
        self.cache = DFlashCache(self.spec.num_layers)
        self.pending: list[torch.Tensor] = []  # features [m, n_feat*H] not yet in the cache
        last = getattr(self, "gate", None)  # the gate of this drafter's last run: what it measured of the device
        self.gate = (DraftGate(self.cost, self.draft_len, self.cfg.probe_every, switch_on=self.cfg.switch_on,
                               timings=None if last is None else last.device_timings())
                     if self.cfg.gate else None)
        self.lookups = (LookupSource(self.draft_len, max_ngram=self.cfg.lookup_max_ngram)
                        if self.cfg.lookup and self.cfg.gate else None)
        self.stored = None
        if self.store is not None:
            depth, least = self.store.depth, min(self.cfg.datastore_min_ngram, self.store.depth)
            self.stored = LookupSource(self.draft_len, depth, least,
                                       match=partial(self.store.match, max_ngram=depth, min_ngram=least))

    def observe(self, features: torch.Tensor) -> None:
        self.pending.append(features)

    @property
    def draft_len(self) -> int:
        longest = self.spec.block_size - 1
        return longest if self.cfg.max_draft is None else min(longest, self.cfg.max_draft)

    def step_width(self, context: list[int], max_len: int) -> tuple[int, GateDecision | None]:
        """How many tokens to draft this step: the gate's width, or all that fit without it."""
        k = min(self.draft_len, max_len)
        if self.gate is None:
            return k, None
        self.gate.step_started()
        self.gate.committed(context)
        decision = self.gate.decide(k)
        return decision.width, decision

    def gated(self, draft: Draft, decision: GateDecision | None, started: float) -> Draft:
        """Tell the gate what drafting cost and record its decision in the draft's extras."""
        if decision is not None:
            positions = len(draft.extras.get("shadow", ())) if decision.state == "shadow" else None  # computed so far
            self.gate.drafted(decision, time.perf_counter() - started if decision.width else 0.0, positions)
            draft.extras["gate"] = decision.to_dict()
        return draft

    def verified(self, draft: Draft, logits: torch.Tensor, path: list[int], committed: list[int]) -> None:
        if self.gate is not None:  # the gate estimates the drafter's acceptance: grafted lookup nodes are not its
            self.gate.verified(*own_share(draft.tree, draft.extras, path), rows=len(draft.tree) + 1)

    @torch.inference_mode()
    def propose(self, context: list[int], max_len: int) -> Draft:
        """The gate fixes the width k; `draft_block` drafts it (nothing at all when k is 0), or
        a shadow draft is kept for the gate to score and nothing is verified. Prompt lookup's
        continuation, when there is one, is drafted instead where it is worth more, or grafted
        onto a drafted tree as far as it pays."""
        started = time.perf_counter()
        k, decision = self.step_width(context, max_len)
        found = self.continuation(self.lookups, context, max_len)
        lookup = self.lookup_draft(found, max_len, k, decision) if found is not None else None
        if lookup is not None:
            return self.gated(*lookup, started)
        if decision is not None and decision.state == "shadow":
            draft = self.shadow(context, k)
        else:
            draft = self.draft_block(context, k) if k > 0 else Draft.empty()
        if found is not None and self.trees and self.cfg.graft_lookup:
            draft = self.grafted(draft, found, self.lookups, k, "graft")
        stored = self.continuation(self.stored, context, max_len)
        if stored is not None:
            draft = self.grafted(draft, stored, self.stored, k, "datastore")
        return self.gated(draft, decision, started)

    def continuation(self, source: LookupSource | None, context: list[int], max_len: int) -> Continuation | None:
        """A second source's continuation this step (prompt lookup's, the datastore's), where the
        source is on and the gate does not keep the step plain to time it; found every such step,
        so the source scores it against what is committed, drafted or not."""
        if source is None or self.gate.wants_plain_step:
            return None
        return source.find(context, min(self.draft_len, max_len))

    def grafted(self, draft: Draft, found: Continuation, source: LookupSource, k: int, key: str) -> Draft:
        """`draft` with as much of `found` grafted on as pays (under extras `key`); the source
        hears where the continuation left the tree, for its branch estimate."""
        source.branched(branch_point(draft.tree, found.tokens)[1])
        return graft(draft, found, self.gate.rates(), self.gate.cost, self.gate.drafting_cost(k), key)

    def lookup_draft(self, found: Continuation, max_len: int, k: int,
                     decision: GateDecision | None) -> tuple[Draft, GateDecision] | None:
        """Prompt lookup's draft and the decision that picked it, when its continuation is worth
        more this step than anything the gate would do with the drafter: where the gate drafts k
        tokens and the continuation would be grafted onto the tree, that includes drafting with it
        grafted on."""
        room = min(self.draft_len, max_len)
        against = self.gate.best_value(room)
        if self.trees and self.cfg.graft_lookup and k and decision is not None and decision.state in ("on", "probe"):
            against = max(against, grafted_value(self.gate.rates(), k, found, self.gate.cost,
                                                 self.gate.drafting_cost(k)))
        offer = self.lookups.offer(found, self.gate.cost, against)
        if offer is None:
            return None
        n, width = offer.ngram, len(offer.tokens)
        decision = GateDecision("lookup", width, offer.value,
                                f"the last {n} token(s) occurred earlier: drafting the {width} that followed is worth "
                                f"{offer.value:.2f}x plain decoding, the drafter's best {offer.against:.2f}x")
        return Draft(DraftTree.chain(offer.tokens), extras={"lookup": offer.to_dict()}), decision

    def shadow(self, context: list[int], k: int) -> Draft:
        """Hand the gate a shadow chain of depth k to score later; verify nothing this step. The
        trace keeps the tokens known now (a lazy chain's first)."""
        tokens = self.shadow_tokens(context, k)
        self.gate.shadowed(len(context), tokens)
        known = tokens.read_first() if isinstance(tokens, ShadowChain) else list(tokens)
        return Draft(DraftTree((), ()), extras={"shadow": known} if known else {})

    def shadow_tokens(self, context: list[int], k: int) -> Sequence[int]:
        """The chain a shadow draft hands the gate: DFlash's argmax per slot, each computed when
        the gate reaches its position (methods that draft another chain override this)."""
        hidden = self.block_hidden(context)[1 : k + 1]
        return ShadowChain(k, (argmax_chain(*self.model.draft_probs(row[None]))[0][0] for row in hidden))

    def draft_block(self, context: list[int], k: int) -> Draft:
        """k >= 1 drafted tokens after the context; each DFlash-family method drafts its own way."""
        # Slots 1..k of one block forward predict the next k tokens: k nodes of their best paths, or their argmax chain.
        if self.trees:
            probs, ids = self.model.draft_probs(self.block_hidden(context)[1 : k + 1])
            tree, q = candidate_tree(probs, ids, k, self.cfg.tree_width)
            return Draft(tree, q=None, q_token=q, extras={"dflash": {"block_size": self.spec.block_size}})
        tokens, q = argmax_chain(*self.model.draft_probs(self.block_hidden(context)[1 : k + 1]))
        return Draft(
            DraftTree.chain(tokens),
            q=None,
            q_token=q,
            extras={"dflash": {"block_size": self.spec.block_size}},
        )

    def block_hidden(self, context: list[int]) -> torch.Tensor:
        """The drafter's final-normed hidden states [L, H] of the block after the context, from
        one forward pass; also moves the features observed since the last call into its cache."""
        # 1. New context: the features of positions committed since the last step.
        start = len(self.cache)
        features = torch.cat(self.pending) if self.pending else self._no_features()  # [C, n_feat*H]
        self.pending = []
        if start + len(features) != len(context) - 1:
            raise RuntimeError(
                f"DFlash context out of sync: {start + len(features)} positions observed, the target cache holds "
                f"{len(context) - 1}"
            )
        # 2. One forward of the block [last, MASK x (L-1)] at positions len(context) - 1 ...
        L, root = self.spec.block_size, len(context) - 1
        block = torch.full((1, L), self.spec.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = context[-1]
        block_pos = torch.arange(root, root + L, device=self.device)[None]
        ctx_pos = torch.arange(start, root, device=self.device)[None]
        return self.model(block, block_pos, features[None], ctx_pos, None, self.cache)[0]  # [L, H]

    def _no_features(self) -> torch.Tensor:
        width = self.model.fc.in_features
        return torch.zeros(0, width, device=self.device, dtype=self.model.compute_dtype)

    def config_dict(self) -> dict[str, Any]:
        precision = "int8" if self.model.int8_head else str(self.model.compute_dtype).removeprefix("torch.")
        return {**asdict(self.cfg), "lookup": self.cfg.lookup and self.cfg.gate, "block_size": self.spec.block_size,
                "target_layer_ids": list(self.feature_layers), "draft_layers": self.spec.num_layers,
                "drafter_precision": precision, "tree": self.trees, "datastore": self.store is not None}


def argmax_chain(probs: torch.Tensor, ids: torch.Tensor | None) -> tuple[list[int], list[float]]:
    """Per row of `probs` (draft_probs: columns are `ids`, or target ids when None) the most
    probable target token and its probability."""
    best = probs.max(dim=-1)
    tokens = best.indices if ids is None else ids[best.indices]
    return tokens.tolist(), best.values.tolist()


def check_tree_knobs(tree: object, width: object, graft_lookup: object) -> None:
    """The `tree`, `tree_width` and `graft_lookup` knobs dflash and adaflash share, or a clear error."""
    for name, value in (("tree", tree), ("graft_lookup", graft_lookup)):
        if not isinstance(value, bool):
            raise MethodConfigError(f"{name} must be true or false, got {value!r}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise MethodConfigError(f"tree_width must be an integer >= 1, got {width!r}")


def candidate_tree(probs: torch.Tensor, ids: torch.Tensor | None, nodes: int,
                   width: int = 4) -> tuple[DraftTree, list[float]]:
    """The `nodes` most probable paths through the slots' top `width` tokens, as a draft tree,
    and each node's probability; `probs` [k, V'] has its columns' target ids in `ids` ([V'], or
    [k, V'] per row; None: the columns are target ids). Why: a block's slots are scored in one
    forward, so each offers its runners-up for free, and where the argmax at a slot is doubtful a
    sibling is worth more than one more token deep. A path scores the product of its slots' probabilities (as if the
    slots were independent: a runner-up's successors were scored as if the argmax came first);
    best-first, so a path enters only after its parent, and every kept path's prefix is kept."""
    top = probs.topk(min(width, probs.shape[-1]), dim=-1)
    p = top.values.tolist()
    if ids is None:
        tok = top.indices.tolist()
    else:  # one id per column of probs ([V']), or each row's own ([k, V'])
        tok = (ids[top.indices] if ids.dim() == 1 else ids.gather(1, top.indices)).tolist()

    def successors(node: int, ranks: tuple[int, ...] | None) -> list[Successor]:  # a node's ranks per slot
        prefix = ranks or ()
        depth = len(prefix)
        if depth >= len(p):
            return []
        return [(p[depth][r], (*prefix, r), tok[depth][r], (*prefix, r)) for r in range(len(p[depth]))]

    return best_first_tree(successors, nodes)


class ShadowChain(Sequence[int]):
    """A shadow draft's chain of `length` tokens, each taken from `tokens` only when the gate
    scores its position. Why: the gate stops scoring at the first miss, so where the drafter
    cannot predict the text (where the gate is off, the shadow's only use) it reads one or two of
    the block's positions, and the per-slot work (the head, about half a drafter block on a CPU;
    DeLS's fusion) runs for those only. The block's hidden states are fixed when it is drafted, so
    each token is exactly the one an eager draft would have proposed."""

    def __init__(self, length: int, tokens: Iterator[int]) -> None:
        self.length, self._tokens = length, tokens
        self.known: list[int] = []

    def __len__(self) -> int:
        return self.length

    @torch.inference_mode()
    def __getitem__(self, index: int) -> int:  # type: ignore[override]
        if not 0 <= index < self.length:
            raise IndexError(f"shadow position {index} outside a chain of {self.length}")
        while len(self.known) <= index:
            self.known.append(next(self._tokens))
        return self.known[index]

    def read_first(self) -> list[int]:
        """Compute the first token, which the gate always scores, and return the tokens known
        so far: what the trace of a shadow step can show without computing more."""
        if self.length:
            self[0]
        return list(self.known)


CONFIG = DFlashConfig


def drafter_folder(drafter: str) -> Path:
    """A local folder (`~` expanded, as where no shell did it: a comma-separated list, the app's
    text box), or a hub id found in the local Hugging Face cache (no download). A name that is
    neither gets the same error as a missing folder, not huggingface_hub's complaint about repo ids."""
    path = Path(drafter).expanduser()
    if path.is_dir():
        return path
    if not path.exists() and "/" in drafter and not drafter.startswith((".", "/", "~")):
        from huggingface_hub import try_to_load_from_cache

        try:
            config = try_to_load_from_cache(drafter, "config.json")
        except ValueError:  # not a repo id either (huggingface_hub's HFValidationError)
            config = None
        if isinstance(config, str):
            return Path(config).parent
    raise CheckpointError(
        f"DFlash drafter {drafter!r} not found: pass a folder with config.json + model.safetensors "
        "(train one with python -m specflash.training.dflash) or a hub id already in the local cache"
    )


def build(target, cfg: DFlashConfig, drafter: str | None, cache_dir: Path | None = None) -> DFlashEngineDrafter:
    model = load_dflash_model(target, drafter, "dflash", cfg.draft_dtype)
    return DFlashEngineDrafter(model, cfg, gate_cost(target, cfg, model.spec.block_size, cache_dir))


def gate_cost(target, cfg: DFlashConfig, block_size: int, cache_dir: Path | None) -> list[float] | None:
    """The verify-cost curve the gate reads (measured once per model and device, then cached)."""
    from ..models.acquire import default_cache_dir
    from ..verify_cost import cached_verify_cost

    return cached_verify_cost(target, verify_rows(block_size), cache_dir or default_cache_dir()) if cfg.gate else None


def verify_rows(block_size: int) -> int:
    """The widest forward a DFlash-family step may verify: the root, a block's drafted nodes and
    a grafted lookup continuation as long (lookup_graft.py): the length of cost curve it reads."""
    return 2 * block_size - 1


def load_dflash_model(target, drafter: str | None, method: str, dtype: str = "target") -> DFlashDrafter:
    """The DFlash drafter network for `target`, computing in `dtype` (drafter_dtype's and
    drafter_int8's choices); `method` names who asked, for the error."""
    from ..models.dflash_io import drafter_dtype, drafter_int8, load_drafter

    if not drafter:
        raise MethodConfigError(
            f"method {method!r} needs a DFlash drafter: pass --drafter PATH (a DFlash checkpoint for this "
            "target); the smollm2-135m preset ships one"
        )
    model = load_drafter(drafter_folder(str(drafter)), target).to(drafter_dtype(target, dtype))
    if row_kernels.applies(model):  # the drafter's few-row forwards take the target's measured kernels
        row_kernels.install(model, target.row_plan)
        model.row_plan = target.row_plan
    if drafter_int8(target, dtype):
        model.quantize_int8()
    return model
