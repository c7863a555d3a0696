"""Would verifying a tree of a DFlash drafter's top candidates beat its chain? Measured on
held-out harvest blocks, without decoding.

Why: a block-diffusion drafter scores every slot at once, so each slot offers its top-k tokens
for free, and a tree of them (Medusa-style: a fixed set of rank paths) accepts more per step than
the argmax chain. Whether that pays depends on what verifying the extra rows costs. For each
held-out block this records the rank of the target's token among each slot's top-k; a tree of n
nodes is then best chosen as the n most frequent rank prefixes (a prefix is at least as frequent as
any extension, so they form a tree), and its acceptance length is 1 + the sum of their
frequencies, exactly what greedy tree verification would accept on those blocks (the chain is the
all-rank-0 path). With `--curve` (c(1) = 1, c(2), ... verifying n tokens in plain steps) and the
drafter's cost per block, each size's modeled value (acceptance / cost, plain decoding = 1).

    python scripts/dflash_tree_headroom.py --model ~/.cache/specflash/models/smollm2-135m-instruct \
        --data DIR,DIR --hold-out shard-00001.safetensors --drafter assets/drafters/smollm2-135m-dflash \
        --curve 1,1.048,1.121,1.121,1.296,1.471,1.596,1.596 --draft-cost 0.11 --out tree.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from specflash.models.dflash_io import load_drafter
from specflash.training.data import load_training_target
from specflash.training.dflash_objective import block_forward, block_labels, slot_logits
from specflash.training.validation import held_out_blocks


@torch.no_grad()
def label_ranks(model, blocks, top_k: int) -> list[list[int]]:
    """Per block, per drafted slot: the rank of the target's token in the slot's top_k (top_k = not there)."""
    out = []
    for seq, feats, anchors in blocks:
        hidden = block_forward(model, seq, feats.float(), anchors)
        logits, labels, valid = slot_logits(model, hidden, *block_labels(seq.next_ids, anchors, model.spec.block_size))
        hit = logits.topk(top_k, -1).indices == labels[..., None]
        rank = torch.where(hit.any(-1) & valid, hit.float().argmax(-1), torch.full_like(labels, top_k))
        out.extend(rank.tolist())
    return out


def prefix_counts(ranks: list[list[int]], top_k: int) -> Counter:
    """How many blocks accept each rank path: every prefix of a block's ranks before its first miss."""
    counts: Counter = Counter()
    for row in ranks:
        for depth, rank in enumerate(row):
            if rank >= top_k:
                break
            counts[tuple(row[: depth + 1])] += 1
    return counts


def headroom(ranks: list[list[int]], top_k: int, max_nodes: int) -> dict:
    """Acceptance length of the chain of depth n and of the best n-node tree, n = 0 .. max_nodes."""
    counts, blocks = prefix_counts(ranks, top_k), max(len(ranks), 1)
    best = sorted(counts.values(), reverse=True)
    depth = len(ranks[0]) if ranks else 0
    chain = [1 + sum(counts[(0,) * d] for d in range(1, n + 1)) / blocks for n in range(min(max_nodes, depth) + 1)]
    tree = [1 + sum(best[:n]) / blocks for n in range(max_nodes + 1)]
    slot1 = Counter(row[0] for row in ranks)
    return {"blocks": len(ranks), "chain": chain, "tree": tree,
            "slot1_rank_share": [slot1[r] / blocks for r in range(top_k + 1)],
            "tree_paths": [list(p) for p, _ in counts.most_common(max_nodes)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, type=lambda s: [Path(x) for x in s.split(",") if x])
    p.add_argument("--hold-out", required=True, type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--drafter", required=True)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--max-nodes", type=int, default=15)
    p.add_argument("--curve", type=lambda s: [float(x) for x in s.split(",")], default=None)
    p.add_argument("--draft-cost", type=float, default=0.0, help="a drafted block, in plain steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_training_target(args.model, "cpu")
    model = load_drafter(args.drafter, target).float().eval()
    blocks = held_out_blocks(target, args.data, args.hold_out, tuple(model.spec.target_layer_ids), None,
                             args.samples, args.anchors)
    result = headroom(label_ranks(model, blocks, args.top_k), args.top_k, args.max_nodes)
    result.update(drafter=args.drafter, top_k=args.top_k, curve=args.curve, draft_cost=args.draft_cost)

    def value(tau: float, n: int) -> str:
        if not args.curve or n >= len(args.curve):
            return "-"
        return f"{tau / (args.curve[n] + (args.draft_cost if n else 0.0)):.3f}"

    print(f"{result['blocks']} held-out blocks; slot 1 rank shares (last = not in top {args.top_k}):",
          " ".join(f"{x:.3f}" for x in result["slot1_rank_share"]))
    print("nodes  chain τ  value   tree τ  value")
    for n, tau in enumerate(result["tree"]):
        chain = (f"{result['chain'][n]:7.3f}  {value(result['chain'][n], n):>5}" if n < len(result["chain"])
                 else f"{'-':>7}  {'-':>5}")
        print(f"{n:5d}  {chain}  {tau:7.3f}  {value(tau, n):>5}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
