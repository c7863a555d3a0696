"""How well a DFlash drafter's confidence predicts acceptance, on held-out harvest blocks.

AdaFlash's cost rule (drafters/adaflash.py) reads each drafted position's top probability as the
chance it is accepted once the positions before it were; `rate` scales that reading. This prints,
for every slot reached (all earlier slots right), the mean confidence against how often the slot
was right, by confidence bin and by slot: where the two part, the cut is too eager or too timid.

With `--curve`, a verify-cost curve c(1..L), it also models what the cut is worth: committed
tokens per unit cost, sum(1 + accepted) / sum(c(m + 1) + d), over the held-out blocks, verifying
a fixed width m on every block against the cost rule's cut over the whole block at several
rates (d, `--draft-cost`, is the drafter's block in units of one target step; plain decoding,
m = 0, pays no d). A model, not a timing: it leaves out the gate and prompt lookup.

    source scripts/env.sh && python scripts/draft_calibration.py --model <target folder> \
        --drafter assets/drafters/smollm2-135m-dflash --data <harvest folders> --samples 42 \
        --curve 1,1.077,1.442,1.603,1.841,1.958,2.110,2.110 --draft-cost 0.2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specflash.models.dflash_io import load_drafter
from specflash.training.data import load_training_target
from specflash.training.dflash_objective import block_forward, block_labels
from specflash.training.validation import held_out_blocks
from specflash.verify_cost import best_cut

EDGES = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001]


Slots = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per sequence: confidence, right, labelled [n, k]


@torch.no_grad()
def drafted_slots(drafter, blocks) -> Slots:
    """Each sequence's blocks drafted once: every slot's confidence (top probability), whether its
    argmax is the target's token, and whether the slot has a label at all. A target token outside
    the draft vocabulary is a slot drafted wrong, as at inference."""
    out = []
    for seq, feats, anchors in blocks:
        hidden = block_forward(drafter, seq, feats.float(), anchors)[:, 1:]
        labels, valid = block_labels(seq.next_ids, anchors, drafter.spec.block_size)
        if drafter.draft_ids is None:
            top, arg = drafter.logits(hidden).float().softmax(-1).max(-1)
        else:
            top, arg = drafter.draft_logits(hidden).softmax(-1).max(-1)
            arg = drafter.draft_ids[arg]
        out.append((top, (arg == labels) & valid, valid))
    return out


def reached_slots(slots: Slots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(confidence, right, slot index) of every slot whose earlier slots were all right."""
    conf, right, slot = [], [], []
    for top, ok, valid in slots:
        before = torch.cat([torch.ones_like(ok[:, :1]), ok.long().cumprod(1)[:, :-1].bool()], 1)
        keep = before & valid
        conf.append(top[keep])
        right.append(ok[keep].float())
        slot.append(torch.arange(ok.shape[1]).expand_as(ok)[keep])
    return torch.cat(conf), torch.cat(right), torch.cat(slot)


def block_runs(slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
    """(confidence [n, k] of every drafted slot, accepted run [n]) of the blocks whose slots all
    have a label (a block cut off by its sequence's end is left out)."""
    confs, runs = [], []
    for top, ok, valid in slots:
        full = valid.all(1)
        confs.append(top[full])
        runs.append(ok[full].long().cumprod(1).sum(1))
    return torch.cat(confs), torch.cat(runs)


def cut_values(conf: torch.Tensor, run: torch.Tensor, curve: list[float], draft_cost: float,
               rates: list[float]) -> dict[str, dict[str, float]]:
    """Committed tokens per unit cost of verifying each fixed width on every block, and of the cost
    rule's cut at each rate (`acceptance_estimate`: confidence times rate, at most 1), which pays
    for the drafted block even where it verifies none of it."""
    def value(widths: torch.Tensor, always_drafted: bool = False) -> dict[str, float]:
        cost = sum(curve[m] + (draft_cost if m or always_drafted else 0.0) for m in widths.tolist())
        return {"value": float((1 + torch.minimum(run, widths)).sum()) / cost, "mean_width": float(widths.float().mean())}

    out = {f"fixed {m}": value(torch.full_like(run, m)) for m in range(conf.shape[1] + 1)}
    for rate in rates:
        cuts = [best_cut([min(1.0, c * rate) for c in row], curve) for row in conf.tolist()]
        out[f"cut, rate {rate:g}"] = value(torch.tensor(cuts, dtype=run.dtype), always_drafted=True)  # cut after drafting
    return out


def table(conf: torch.Tensor, right: torch.Tensor, slot: torch.Tensor) -> dict:
    bins = []
    for lo, hi in zip(EDGES, EDGES[1:]):
        m = (conf >= lo) & (conf < hi)
        if m.any():
            bins.append({"from": lo, "to": min(hi, 1.0), "n": int(m.sum()), "confidence": float(conf[m].mean()),
                         "accepted": float(right[m].mean())})
    slots = [{"slot": k + 1, "n": int((slot == k).sum()), "confidence": float(conf[slot == k].mean()),
              "accepted": float(right[slot == k].mean())} for k in range(int(slot.max()) + 1) if (slot == k).any()]
    return {"slots_reached": len(conf), "bins": bins, "per_slot": slots}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local Hugging Face folder of the target")
    p.add_argument("--drafter", required=True)
    p.add_argument("--data", required=True, help="comma list of harvest folders")
    p.add_argument("--hold-out", default="shard-00001.safetensors")
    p.add_argument("--samples", type=int, default=42, help="held-out sequences, spread over the folders")
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--curve", default=None, help="comma list c(1)=1, c(2), ..., c(L): also model the cut's worth")
    p.add_argument("--draft-cost", type=float, default=0.2, help="the drafter's block, in target steps")
    p.add_argument("--rates", default="0.8,1,1.15,1.3,1.5")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_training_target(Path(args.model), "cpu")
    drafter = load_drafter(args.drafter, target).float().eval()
    dirs = [Path(d) for d in args.data.split(",") if d]
    blocks = held_out_blocks(target, dirs, args.hold_out.split(","), tuple(drafter.spec.target_layer_ids), None,
                             args.samples, args.anchors)
    slots = drafted_slots(drafter, blocks)
    result = table(*reached_slots(slots))
    for b in result["bins"]:
        print(f"confidence {b['from']:.1f}-{b['to']:.1f}  n {b['n']:5d}  mean {b['confidence']:.3f}  "
              f"accepted {b['accepted']:.3f}")
    for s in result["per_slot"]:
        print(f"slot {s['slot']}  n {s['n']:5d}  confidence {s['confidence']:.3f}  accepted {s['accepted']:.3f}")
    if args.curve:
        curve = [float(c) for c in args.curve.split(",")]
        conf, run = block_runs(slots)
        result["cut_values"] = cut_values(conf, run, curve, args.draft_cost, [float(r) for r in args.rates.split(",")])
        print(f"{len(run)} whole blocks, the full chain's tau {1 + float(run.float().mean()):.3f}")
        for name, v in result["cut_values"].items():
            print(f"{name:14s} tokens per unit cost {v['value']:.3f}  mean verified drafts {v['mean_width']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
