"""What one DFlash block costs on this device, as a fraction of one plain target decoding step.

Why: on a CPU a drafter pays only if its block forward is small next to a target step (the
verify-cost curve is steep here), and the LM head over the full vocabulary is most of a small
drafter's cost. Both figures come from the engine's own trace records, on the same held-out
prompts, side by side: the median `verify_time` of plain decoding's steps and the median
`draft_time` of DFlash's steps (drafting every step, no gate), with the drafter's draft
vocabulary in the dtype the engine picks (models/dflash_io.py drafter_dtype) and, for comparison,
in float32 as the target, with int8 weights (models/int8_linear.py, where this CPU has the engine),
with the target's full LM head and with PyTorch's stock matmuls in place of the row kernels the
target measured (models/row_kernels.py); what the draft gate's shadow draft costs where the
drafter misses (the block forward, the head for its first slot only); and a target step that
drafts nothing but captures the drafter's features, as while the gate is off.

    python -m specflash.training.drafter_cost --model smollm2-135m --drafter FOLDER [--out cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from ..drafters.base import Draft
from ..drafters.dflash import DFlashEngineDrafter
from ..metrics import decode_steps
from ..prompts import DOMAINS, heldout_prompts
from .entry import run_script


def measure(target, drafter: str, prompts_per_domain: int = 1, max_new_tokens: int = 32) -> dict[str, float]:
    """Median milliseconds of a target step and of a drafter block (as the engine loads it; with
    stock matmuls; with the full vocabulary)."""
    from ..api import encode_prompt, generate
    from ..drafters.dflash import DFlashConfig, drafter_folder, load_dflash_model
    from ..models.dflash_io import load_drafter

    model = load_dflash_model(target, drafter, "drafter_cost", "auto")
    same = load_dflash_model(target, drafter, "drafter_cost")
    stock = load_drafter(drafter_folder(drafter), target)
    full = load_dflash_model(target, drafter, "drafter_cost")
    full.draft_ids = None
    from ..models import int8_linear

    engines = {"draft_vocab": DFlashEngineDrafter(model, DFlashConfig(gate=False)),
               "shadow": _ShadowEveryStep(model, DFlashConfig(gate=False)),
               "target_dtype": DFlashEngineDrafter(same, DFlashConfig(gate=False)),
               "stock_kernels": DFlashEngineDrafter(stock, DFlashConfig(gate=False)),
               "full_vocab": DFlashEngineDrafter(full, DFlashConfig(gate=False))}
    if int8_linear.available():
        engines["int8"] = DFlashEngineDrafter(load_dflash_model(target, drafter, "drafter_cost", "int8"),
                                              DFlashConfig(gate=False))
    times: dict[str, list[float]] = {"target_step": [], "off_step": [], **{name: [] for name in engines}}
    prompts = [p for d in DOMAINS for p in heldout_prompts(d)[:prompts_per_domain]]
    for prompt in prompts:  # interleaved, so machine noise hits every column alike
        ids = encode_prompt(target, prompt.text)
        run = generate(target, ids, "ar", max_new_tokens=max_new_tokens, stop_on_eos=False)
        times["target_step"] += [s.verify_time for s in decode_steps(run)]
        for name, engine in engines.items():
            run = generate(target, ids, drafter=engine, max_new_tokens=max_new_tokens, stop_on_eos=False)
            times[name] += [s.draft_time for s in decode_steps(run)][1:]  # the first block warms up
        run = generate(target, ids, drafter=_ObserveOnly(model, DFlashConfig(gate=False)),
                       max_new_tokens=max_new_tokens, stop_on_eos=False)
        times["off_step"] += [s.verify_time for s in decode_steps(run)]
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    vocab = len(model.draft_ids) if model.draft_ids is not None else target.vocab_size
    return {"target_step_ms": ms["target_step"], "block_ms": ms["draft_vocab"], "block_full_vocab_ms": ms["full_vocab"],
            "block_fraction": ms["draft_vocab"] / ms["target_step"], "block_dtype": str(model.compute_dtype),
            "block_target_dtype_ms": ms["target_dtype"],
            "block_target_dtype_fraction": ms["target_dtype"] / ms["target_step"],
            "block_stock_kernels_ms": ms["stock_kernels"],
            "block_stock_kernels_fraction": ms["stock_kernels"] / ms["target_step"],
            "shadow_ms": ms["shadow"], "shadow_fraction": ms["shadow"] / ms["target_step"],
            "off_step_ms": ms["off_step"], "off_step_ratio": ms["off_step"] / ms["target_step"],
            "block_int8_ms": ms.get("int8"),
            "block_int8_fraction": ms["int8"] / ms["target_step"] if "int8" in ms else None,
            "row_plan": {str(n): m for n, m in sorted(target.row_plan.items())},
            "block_full_vocab_fraction": ms["full_vocab"] / ms["target_step"],
            "draft_vocab_size": vocab, "samples": len(times["target_step"]), "threads": torch.get_num_threads()}


class _ShadowEveryStep(DFlashEngineDrafter):
    """Draws a shadow draft every step and verifies nothing: its draft_time is one shadow's cost
    where the drafter misses (the gate reads the first slot, stops there)."""

    def draft_block(self, context: list[int], k: int) -> Draft:
        self.shadow_tokens(context, k)
        return Draft.empty()


class _ObserveOnly(DFlashEngineDrafter):
    """Never drafts but takes the target's features every step, as DFlash does while its gate is
    off: its steps' verify_time against plain decoding's is what the DFlash path costs then."""

    def draft_block(self, context: list[int], k: int) -> Draft:
        return Draft.empty()


def parse_args(argv: Seq[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.drafter_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", required=True, help="DFlash drafter folder")
    p.add_argument("--prompts-per-domain", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def report(args: argparse.Namespace) -> dict:
    from ..api import load

    result = measure(load(args.model, device="cpu", dtype=torch.float32), args.drafter, args.prompts_per_domain,
                     args.max_new_tokens)
    print(f"target step {result['target_step_ms']:.1f} ms | drafter block {result['block_ms']:.1f} ms "
          f"({100 * result['block_fraction']:.0f}% of a step, {result['draft_vocab_size']} draft tokens, "
          f"{result['block_dtype']}) | a shadow that misses {result['shadow_ms']:.1f} ms "
          f"({100 * result['shadow_fraction']:.0f}%) | a step drafting nothing, features captured "
          f"{result['off_step_ms']:.1f} ms ({result['off_step_ratio']:.2f}x) | in the target's dtype {result['block_target_dtype_ms']:.1f} ms "
          f"({100 * result['block_target_dtype_fraction']:.0f}%) | "
          + (f"int8 weights {result['block_int8_ms']:.1f} ms ({100 * result['block_int8_fraction']:.0f}%) | "
             if result["block_int8_ms"] is not None else "") +
          f"stock matmuls {result['block_stock_kernels_ms']:.1f} ms "
          f"({100 * result['block_stock_kernels_fraction']:.0f}%) | "
          f"with the full LM head {result['block_full_vocab_ms']:.1f} ms ({100 * result['block_full_vocab_fraction']:.0f}%)")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "drafter": Path(args.drafter).name, **result}, indent=1) + "\n")
    return result


def main(argv: Seq[str] | None = None) -> int:
    return run_script(parse_args(argv), report, lambda r: f"{r['samples']} target steps measured")


if __name__ == "__main__":
    raise SystemExit(main())
