"""DFlash checkpoints in the z-lab format: config.json + model.safetensors, read with no remote code.

DFlash 2 checkpoints (`architectures` ["DFlash2DraftModel"]) share the folder layout: their
config moves `block_size` under `dflash_config`, gives rope as `rope_parameters` and adds the
convolution and selector keys; their tensors add `layers.N.{attention,mlp}_conv.*` and
`candidate_selector.*` (models/dflash2.py). `load_drafter` and `save_drafter` dispatch on the
architecture; a DFlash 1 folder loads exactly as before.

The format is what z-lab releases and what vLLM and SGLang load for `dflash` speculation: a
Qwen3 config (`model_type` "qwen3", `architectures` ["DFlashDraftModel"]) plus `block_size`,
`num_target_layers` and `dflash_config {mask_token_id, target_layer_ids}`, and the drafter's own
tensors only (no embedding / LM head). We parse config.json ourselves, check every tensor name
strictly (only the optional `thresh_head_*` tensors of some releases are ignored) and check the
drafter against the target before any weight is used, so a mismatch fails with a clear message.

Released layouts read beside ours: `block_size` only under `dflash_config` (Qwen3.5-4B-DFlash),
`layer_types` with `sliding_attention` layers and their `sliding_window` (and `is_causal`), no
`num_target_layers` (gpt-oss-20b-DFlash: the target's layer count is assumed), and
`attention_bias` true (q/k/v/o biases, so `*_proj.bias` tensors are expected). Our own drafters
write only the keys their spec needs: a full-attention, bias-free drafter saves as before.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError, DrafterMismatchError, MethodConfigError
from . import int8_linear, row_kernels
from .dflash import FULL, SLIDING, DFlashDrafter, DFlashSpec, default_target_layers
from .dflash2 import DFlash2Drafter, DFlash2Spec

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
D2T_FILE = "d2t.safetensors"
ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE_2 = "DFlash2DraftModel"
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_IGNORED_PREFIXES = ("thresh_head",)


def spec_from_config(cfg: dict[str, Any]) -> DFlashSpec:
    """A DFlashSpec from a parsed config.json (either rope_theta/rope_scaling or rope_parameters;
    block_size at the top level or under dflash_config; num_target_layers optional)."""
    try:
        dflash = cfg.get("dflash_config") or {}
        n_layers = int(cfg["num_hidden_layers"])
        n_target = None if cfg.get("num_target_layers") is None else int(cfg["num_target_layers"])
        layer_ids = dflash.get("target_layer_ids")
        if not layer_ids:
            if n_target is None:
                raise CheckpointError("DFlash config.json gives neither dflash_config.target_layer_ids nor "
                                      "num_target_layers to derive them from")
            layer_ids = default_target_layers(n_target, n_layers)
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(cfg.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0)
        rope.pop("rope_theta", None)
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layer_types = tuple(cfg.get("layer_types") or ())
        if SLIDING not in layer_types:  # all full attention: no layout, and no window to keep
            layer_types = ()
        window = cfg.get("sliding_window") if layer_types else None
        causal = cfg.get("is_causal", dflash.get("causal"))
        return DFlashSpec(
            hidden_size=hidden, num_layers=n_layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            block_size=_block_size(cfg, dflash), num_target_layers=n_target,
            target_layer_ids=tuple(int(i) for i in layer_ids), mask_token_id=int(dflash["mask_token_id"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            layer_types=layer_types, sliding_window=None if window is None else int(window),
            is_causal=None if causal is None else bool(causal),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"DFlash config.json is missing or has a bad key: {exc!r}") from None


def _block_size(cfg: dict[str, Any], dflash: dict[str, Any]) -> int:
    """The top-level block_size, else dflash_config's (DFlash 2, Qwen3.5-4B-DFlash); both must agree."""
    outer, inner = cfg.get("block_size"), dflash.get("block_size")
    if outer is None and inner is None:
        raise CheckpointError("DFlash config.json has no block_size (top level or under dflash_config)")
    if outer is not None and inner is not None and int(outer) != int(inner):
        raise CheckpointError(f"DFlash config.json gives block_size {outer} and dflash_config.block_size {inner}")
    return int(outer if outer is not None else inner)


def config_from_spec(spec: DFlashSpec, dtype: torch.dtype, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The z-lab config.json of a drafter; `extra` adds keys (e.g. how it was trained). Keys a
    spec may lack (num_target_layers, is_causal) are written only when it has them."""
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "max_position_embeddings": spec.max_position_embeddings,
        "attention_bias": spec.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": spec.sliding_window is not None,
        "sliding_window": spec.sliding_window,
        "layer_types": list(spec.layer_types) or [FULL] * spec.num_layers,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": spec.block_size,
        "num_target_layers": spec.num_target_layers,
        "dflash_config": {"mask_token_id": spec.mask_token_id, "target_layer_ids": list(spec.target_layer_ids)},
    }
    if spec.num_target_layers is None:
        del cfg["num_target_layers"]
    if spec.is_causal is not None:
        cfg["is_causal"] = spec.is_causal
    return {**cfg, **(extra or {})}


def is_dflash2(cfg: dict[str, Any]) -> bool:
    return ARCHITECTURE_2 in (cfg.get("architectures") or ())


def dflash2_spec_from_config(cfg: dict[str, Any]) -> DFlash2Spec:
    """A DFlash2Spec from a DFlash 2 config.json: the DFlash keys (block_size under dflash_config
    or, as SGLang also accepts, at the top level; the attention layout) plus the convolution and
    selector keys."""
    dflash = cfg.get("dflash_config") or {}
    missing = [k for k in DFLASH2_KEYS if dflash.get(k) is None]
    if missing:
        raise CheckpointError(
            f"DFlash 2 config.json (architectures {ARCHITECTURE_2}) has no dflash_config.{', '.join(missing)}: "
            "a DFlash 2 drafter needs its convolutions (conv_kernel_size, conv_group_size) and its candidate "
            "selector (selector_rank, selector_top_k)"
        )
    base = spec_from_config(cfg)
    try:
        return DFlash2Spec(
            **{f.name: getattr(base, f.name) for f in fields(base)},
            **{k: int(dflash[k]) for k in DFLASH2_KEYS},
            output_multiplier=float(dflash.get("output_multiplier", 1.0)),
            final_logit_softcapping=float(dflash["final_logit_softcapping"]) if dflash.get("final_logit_softcapping") else None,
            input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"DFlash 2 config.json has a bad key: {exc}") from None


def dflash2_config_from_spec(spec: DFlash2Spec, dtype: torch.dtype, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DFlash 2 release config.json: DFlash's (with its attention layout), with the release's
    differences (z-lab's dflash2-config.json): block_size under dflash_config, rope as
    rope_parameters, `dtype`, and the convolution and selector keys."""
    cfg = config_from_spec(spec, dtype)
    cfg["architectures"] = [ARCHITECTURE_2]
    cfg["rope_parameters"] = {**(spec.rope_scaling or {"rope_type": "default"}), "rope_theta": spec.rope_theta}
    for key in ("rope_theta", "rope_scaling", "block_size", "torch_dtype"):
        del cfg[key]
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    dflash = cfg["dflash_config"]
    dflash["block_size"] = spec.block_size
    dflash.update({k: getattr(spec, k) for k in DFLASH2_KEYS})
    for key, default in (("output_multiplier", 1.0), ("final_logit_softcapping", None), ("input_embedding_scale", 1.0)):
        if getattr(spec, key) != default:
            dflash[key] = getattr(spec, key)
    cfg["dflash_config"] = dict(sorted(dflash.items()))
    return {**cfg, **(extra or {})}


def d2t_offsets(draft_ids: torch.Tensor) -> torch.Tensor:
    """Sorted target ids [N] -> EAGLE-3 offsets d2t [N] (target id = draft id + d2t[draft id])."""
    return draft_ids.long().cpu() - torch.arange(len(draft_ids))


def draft_ids_from_d2t(d2t: torch.Tensor, vocab_size: int, name: str) -> torch.Tensor:
    """The target ids [N] of a d2t map, checked: in the target's vocabulary and all distinct."""
    ids = torch.arange(len(d2t)) + d2t.long()
    if len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise DrafterMismatchError(f"{name}: its draft vocabulary maps outside the target's [0, {vocab_size})")
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise CheckpointError(f"{name}: {D2T_FILE} must map draft ids to increasing target ids (EAGLE-3 order)")
    return ids


def save_drafter(model: DFlashDrafter, folder: Path | str, dtype: torch.dtype = torch.float16,
                 extra: dict[str, Any] | None = None) -> Path:
    """Write config.json + model.safetensors (own tensors only, in `dtype`) into `folder`, and
    d2t.safetensors when the drafter has a reduced draft vocabulary.

    A DFlash 2 drafter with a draft vocabulary stores its successor codebook for those tokens only
    ([N, r], in draft-id order): only draft tokens are ever a slot's candidates, so its other rows
    are never read, and for SmolLM2 at rank 64 they were 5 of the folder's 22 MB. The predecessor
    codebook keeps every row (the anchor, the last verified token, can be any token)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    if isinstance(model, DFlash2Drafter) and model.draft_ids is not None:
        tensors[SUCCESSOR_CODEBOOK] = tensors[SUCCESSOR_CODEBOOK][model.draft_ids.cpu()].contiguous()
    tmp = folder / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / WEIGHTS_FILE)
    extra = dict(extra or {})
    if model.draft_ids is not None:
        save_file({"d2t": d2t_offsets(model.draft_ids)}, str(folder / D2T_FILE))
        extra["draft_vocab_size"] = len(model.draft_ids)
    else:
        (folder / D2T_FILE).unlink(missing_ok=True)
    write_config = dflash2_config_from_spec if isinstance(model.spec, DFlash2Spec) else config_from_spec
    text = json.dumps(write_config(model.spec, dtype, extra), indent=2) + "\n"
    (folder / CONFIG_FILE).write_text(text, encoding="utf-8")
    return folder


def read_config(folder: Path | str) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a DFlash drafter folder needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def check_fits(spec: DFlashSpec, target, name: str) -> None:
    """Raise DrafterMismatchError unless the drafter can run on this target."""
    problems = []
    if spec.hidden_size != target.hidden_size:
        problems.append(f"hidden size {spec.hidden_size} != target's {target.hidden_size}")
    if spec.vocab_size != target.vocab_size:
        problems.append(f"vocab size {spec.vocab_size} != target's {target.vocab_size}")
    if spec.num_target_layers not in (None, target.num_layers):  # None: assume it was trained on this target
        problems.append(f"trained on a {spec.num_target_layers}-layer target, this one has {target.num_layers}")
    if not 0 <= spec.mask_token_id < target.vocab_size:
        problems.append(f"mask token id {spec.mask_token_id} outside the target's vocabulary [0, {target.vocab_size})")
    bad = [i for i in spec.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"target layer ids {bad} out of range")
    if problems:
        raise DrafterMismatchError(f"DFlash drafter {name} does not fit target {target.name!r}: " + "; ".join(problems))


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a DFlash drafter folder needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None


def load_state(model: DFlashDrafter, tensors: dict[str, torch.Tensor], name: str) -> None:
    """Strict load: every expected tensor present with its shape, nothing unknown (but thresh_head_*)."""
    expected = model.state_dict()
    given = {k: v for k, v in tensors.items() if not k.startswith(_IGNORED_PREFIXES)}
    missing, unexpected = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{name}: tensors do not match its config: missing {missing[:6]}, unexpected {unexpected[:6]}")
    shapes = [k for k in expected if tuple(given[k].shape) != tuple(expected[k].shape)]
    if shapes:
        k = shapes[0]
        raise CheckpointError(f"{name}: tensor {k} has shape {tuple(given[k].shape)}, config says {tuple(expected[k].shape)}")
    model.load_state_dict(given, strict=True)


_SELECTOR, _CONVS = ("candidate_selector.",), (".attention_conv.", ".mlp_conv.")
SUCCESSOR_CODEBOOK = "candidate_selector.successor_codebook"


def _full_successor_rows(tensors: dict[str, torch.Tensor], spec: DFlashSpec,
                         draft_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The tensors with a successor codebook stored for the draft vocabulary only (save_drafter)
    put back at its tokens' rows of a [V, r] one; the other rows are zero and never read. A full
    [V, r] codebook, as the release stores it, passes unchanged."""
    book = tensors.get(SUCCESSOR_CODEBOOK)
    if (not isinstance(spec, DFlash2Spec) or draft_ids is None or book is None or book.dim() != 2
            or book.shape[0] != len(draft_ids) or len(draft_ids) == spec.vocab_size):
        return tensors
    full = book.new_zeros(spec.vocab_size, book.shape[1])
    full[draft_ids] = book
    return {**tensors, SUCCESSOR_CODEBOOK: full}


def check_generation(model: DFlashDrafter, tensors: dict[str, torch.Tensor], name: str) -> None:
    """A clear error when the tensors belong to the other DFlash generation than config.json says:
    a DFlash 2 checkpoint without its selector or convolutions, or DFlash 2 tensors under a DFlash 1
    config."""
    expected = set(model.state_dict())
    if isinstance(model, DFlash2Drafter):
        for part, marks in (("candidate selector", _SELECTOR), ("convolutions", _CONVS)):
            gone = sorted(k for k in expected - set(tensors) if any(m in k for m in marks))
            if gone:
                raise CheckpointError(f"{name}: a DFlash 2 checkpoint ({ARCHITECTURE_2}) without its {part}: "
                                      f"missing {gone[:6]}")
    elif any(m in k for k in tensors for m in _SELECTOR + _CONVS):
        raise CheckpointError(f"{name}: has DFlash 2 tensors (candidate_selector.*, *_conv.*) but config.json "
                              f"declares {ARCHITECTURE}; a DFlash 2 drafter declares {ARCHITECTURE_2}")


def load_drafter(folder: Path | str, target) -> DFlashDrafter:
    """A drafter from a z-lab-format folder, on the target's device and dtype, borrowing its
    embedding and LM head; raises CheckpointError or DrafterMismatchError."""
    folder = Path(folder)
    config = read_config(folder)
    spec = dflash2_spec_from_config(config) if is_dflash2(config) else spec_from_config(config)
    check_fits(spec, target, str(folder))
    tensors = _read_weights(folder / WEIGHTS_FILE)
    draft_ids = read_draft_ids(folder, config, target.vocab_size)
    if isinstance(spec, DFlash2Spec) and draft_ids is not None and spec.selector_top_k > len(draft_ids):
        raise CheckpointError(f"{folder}: selector_top_k {spec.selector_top_k} exceeds its {len(draft_ids)}-token "
                              f"draft vocabulary ({D2T_FILE})")
    model = new_drafter(spec, target, draft_ids)
    check_generation(model, tensors, str(folder))
    load_state(model, _full_successor_rows(tensors, spec, draft_ids), str(folder))
    return model.to(target.device, target.dtype).eval()


DRAFTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DRAFTER_DTYPE_CHOICES = ("auto", "target", *DRAFTER_DTYPES, "int8")


def bf16_matrix_units() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX tiles or AVX-512 BF16). Where it does,
    a SmolLM2 drafter block took 4.2 ms in bf16 against 5.3 ms in float32 (docs/dflash.md);
    elsewhere bf16 is emulated and slower."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(check is not None and bool(check()) for check in checks)


def drafter_dtype(target, choice: str = "auto") -> torch.dtype:
    """The dtype a drafter computes in beside `target`: `choice` "auto" is bfloat16 for a float32
    target on a CPU with bf16 matrix units, unless the target's few-row products run on the packed
    kernel (models/packed_kernel.py), which the drafter then shares in float32 (a SmolLM2 block
    3.1 ms against 3.9 in bfloat16, one thread); float32 around int8 weights where drafter_int8
    picks them; and the target's dtype everywhere else. "target" is always the target's; "int8"
    float32 around int8 weights; or a dtype by name.
    Only drafting changes: verification is the target's, so every output stays exact."""
    if choice == "target":
        return target.dtype
    if choice == "int8":
        return torch.float32
    if choice == "auto":
        cpu_fp32 = torch.device(target.device).type == "cpu" and target.dtype == torch.float32
        packed = row_kernels.PACKED in getattr(target, "row_plan", {}).values()
        return torch.bfloat16 if cpu_fp32 and bf16_matrix_units() and not packed else target.dtype
    if choice not in DRAFTER_DTYPES:
        raise ValueError(f"drafter dtype must be one of {', '.join(DRAFTER_DTYPE_CHOICES)}, got {choice!r}")
    return DRAFTER_DTYPES[choice]


def drafter_int8(target, choice: str = "auto") -> bool:
    """Whether the drafter's decoder layers and draft head hold int8 weights (models/int8_linear.py).
    `choice` "int8" asks for them and needs a CPU with an int8 engine; "auto" picks them beside a
    float32 target on such a CPU without bf16 matrix units (where "auto" means bfloat16). Once
    verifying got cheap there (the seventeenth session's kernel fix), the block's cost was a larger
    share of a step, and int8 weights, which halve it for 1.2% fewer accepted drafts, paid: replayed
    on the same recorded acceptance and verify costs, `dflash` 1.33x `ar` against 1.30x, `adaflash`
    1.37x against 1.32x; side by side in the bench, at or above float32 in every run (docs/dflash.md,
    the drafter's own dtype)."""
    on_cpu = torch.device(target.device).type == "cpu"
    if choice == "int8":
        if not on_cpu or not int8_linear.available():
            raise MethodConfigError(f"draft_dtype int8 needs a CPU with an int8 engine (this target runs on "
                                    f"{target.device}); use auto")
        return True
    if choice != "auto":
        return False
    return on_cpu and target.dtype == torch.float32 and int8_linear.available() and not bf16_matrix_units()


def read_draft_ids(folder: Path, config: dict[str, Any], vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary of a drafter folder (None = the full vocabulary), checked against
    config.json's `draft_vocab_size` and the target's vocabulary."""
    path, size = folder / D2T_FILE, config.get("draft_vocab_size")
    if not path.is_file():
        if size is not None and int(size) != vocab_size:
            raise CheckpointError(f"{folder}: config.json says draft_vocab_size {size} but {D2T_FILE} is missing")
        return None
    d2t = _read_weights(path).get("d2t")
    if d2t is None or d2t.dim() != 1:
        raise CheckpointError(f"{path}: expected one 1-D tensor named d2t")
    if size is not None and int(size) != len(d2t):
        raise CheckpointError(f"{path}: {len(d2t)} draft ids, config.json says draft_vocab_size {size}")
    return draft_ids_from_d2t(d2t, vocab_size, str(folder))


def new_drafter(spec: DFlashSpec, target, draft_ids: torch.Tensor | None = None) -> DFlashDrafter:
    """An untrained drafter on the target's device/dtype, with the target's frozen embedding and
    head (only the rows `draft_ids` of it when given)."""
    embed, head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    for p in (*embed.parameters(), *head.parameters()):
        p.requires_grad_(False)
    cls = DFlash2Drafter if isinstance(spec, DFlash2Spec) else DFlashDrafter
    return cls(spec, embed, head, draft_ids).to(target.device, target.dtype)


# Named special tokens that chat models never emit, tried in order when a tokenizer has no mask
# token (SmolLM2: "<empty_output>", id 16, a StarCoder-era Jupyter marker).
_FALLBACK_MASKS = ("<|MASK|>", "<|mask|>", "<mask>", "<empty_output>")


def pick_mask_token(tokenizer) -> int:
    """The tokenizer's mask token if it has one, else the first unused special of _FALLBACK_MASKS."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    vocab = tokenizer.get_vocab()
    for name in _FALLBACK_MASKS:
        if name in vocab:
            return int(vocab[name])
    raise DrafterMismatchError(
        "the tokenizer has no mask token and none of " + ", ".join(_FALLBACK_MASKS) + "; pass --mask-token-id"
    )
