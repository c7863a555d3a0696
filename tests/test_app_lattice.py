"""The DFlash 2 lattice view: hand-built steps whose agreements are worked out by hand below, and
one real dflash2 run on a tiny target whose drawn paths and target marks are read back from the
figure and checked against the trace."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app import views_lattice as vl
from conftest import hf_greedy, load_target
from specflash.api import generate
from specflash.drafters.dflash2 import DFlash2Config, DFlash2EngineDrafter
from specflash.models.tiny import ensure_tiny_model
from specflash.trace import StepRecord
from test_dflash2 import PROMPTS, _fit, random_drafter

K = 3
CANDIDATES = [[10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42]]  # slot s, rank r: 10 * (s + 1) + r
TEXTS = {t: f"t{t}" for row in CANDIDATES for t in row} | {5: "anchor", 77: "far", 99: "bonus"}


def lattice_step(path: list[int], accepted: int, correction: int, kind: str = "resample", sampled: bool = False,
                 candidates: list[list[int]] = CANDIDATES, step: int = 1) -> StepRecord:
    """A chain step drafted along `path` (ranks) whose first `accepted` tokens the target took."""
    tokens = [row[r] for row, r in zip(candidates, path)]
    k = len(candidates[0])
    lattice = {
        "block_size": len(candidates) + 1, "top_k": k, "anchor": 5, "sampled": sampled, "candidates": candidates,
        "unary": [[2.0 - r for r in range(k)] for _ in candidates],
        "scores": [[2.0 - r + (1.5 if r == chosen else 0.0) for r in range(k)] for chosen in path],
        "path": path, "path_tokens": tokens, "argmax_tokens": [row[0] for row in candidates],
    }
    committed = tokens[:accepted] + [correction]
    return StepRecord(step=step, phase="decode", context_len=10, tokens=tokens,
                      parents=list(range(-1, len(tokens) - 1)), q=None, p=[0.5] * len(tokens),
                      accepted=list(range(accepted)), correction=correction, correction_kind=kind, correction_p=1.0,
                      committed=committed, verified=len(tokens), draft_time=0.0, verify_time=0.0,
                      extras={"dflash2": lattice})


PREFILL = StepRecord(step=0, phase="prefill", context_len=9, tokens=[], parents=[], q=None, p=[], accepted=[],
                     correction=5, correction_kind="target", correction_p=1.0, committed=[5], verified=0,
                     draft_time=0.0, verify_time=0.0)

# (walked ranks, accepted, correction, kind) -> (walked agreed, argmax agreed, argmax only a lower bound,
# slot where the paths part, winner); worked out by hand from CANDIDATES (argmax = 10, 20, 30, 40):
CASES = {
    # walk 10 21 30 40, target 10 21 30 41: argmax leaves the target at slot 2 (20 vs 21)
    "walked_further": (([0, 1, 0, 0], 3, 41, "resample"), (3, 1, False, 1, "walked")),
    # walk 11 ..., target 10: argmax matches the only known target token, more is unknown
    "argmax_bound": (([1, 0, 0, 0], 0, 10, "resample"), (0, 1, True, 0, "argmax")),
    # the same path, all accepted, a bonus after the block: every slot known, exact
    "same_path": (([0, 0, 0, 0], 4, 99, "bonus"), (4, 4, False, None, "tie")),
    # walk 10 20 32 40, target 10 21: the paths part at slot 3, after the rejection at slot 2
    "parts_late": (([0, 0, 2, 0], 1, 21, "resample"), (1, 1, False, 2, "tie")),
    # walk 10 22 ..., target 10 21: they part at the rejected slot, neither matches the target there
    "parts_at_rejection": (([0, 2, 0, 0], 1, 21, "resample"), (1, 1, False, 1, "tie")),
}


@pytest.mark.parametrize("case", CASES)
def test_compare_hand_built(case):
    (path, accepted, correction, kind), (walked, argmax, bound, parts, winner) = CASES[case]
    c = vl.compare(lattice_step(path, accepted, correction, kind))
    assert (c.walked, c.argmax, c.argmax_bound, c.parts, c.winner) == (walked, argmax, bound, parts, winner)
    assert c.walked == accepted  # the walked path's agreement is its acceptance
    assert c.mattered == (parts is not None and parts <= accepted)


def test_target_tokens_stop_where_the_target_stopped():
    assert vl.target_tokens(lattice_step([0, 1, 0, 0], 3, 41)) == [10, 21, 30, 41]
    assert vl.target_tokens(lattice_step([1, 0, 0, 0], 0, 10)) == [10]
    assert vl.target_tokens(lattice_step([0, 0, 0, 0], 4, 99, "bonus")) == [10, 20, 30, 40]  # bonus: after the block
    assert vl.target_tokens(PREFILL) == [] and vl.compare(PREFILL) is None


def test_summary_says_what_is_known():
    walked = vl.lattice_summary_html(lattice_step([0, 1, 0, 0], 3, 41), TEXTS)
    assert "agreed with the target for 3 slot(s); at slot 4 it drafted <code>t40</code>" in walked
    assert "exactly 1 slot(s)" in walked and "the selector's path went further" in walked
    bound = vl.lattice_summary_html(lattice_step([1, 0, 0, 0], 0, 10), TEXTS)
    assert "at least 1 slot(s)" in bound and "(slot 1)" in bound and "never computed" in bound
    assert "the argmax path would have gone further" in bound
    assert bound.count("?</td>") == 3  # slots 2-4: the target's token unknown
    same = vl.lattice_summary_html(lattice_step([0, 0, 0, 0], 4, 99, "bonus"), TEXTS)
    assert "all 4 slots, and the target added <code>bonus</code> after the block" in same
    assert "Both paths are the same" in same and "?</td>" not in same
    late = vl.lattice_summary_html(lattice_step([0, 0, 2, 0], 1, 21), TEXTS)
    assert "part at slot 3, after the walked path's first rejection: no difference" in late
    far = vl.lattice_summary_html(lattice_step([0, 0, 0, 0], 0, 77), TEXTS)
    assert "produced <code>far</code>, which is not among that slot's 3 candidates" in far
    sampled = vl.lattice_summary_html(lattice_step([0, 1, 0, 0], 3, 41, sampled=True), TEXTS)
    assert "Sampled run" in sampled and "Sampled run" not in walked
    assert "has no lattice: it is the prefill" in vl.lattice_summary_html(PREFILL, TEXTS)


def test_run_summary():
    """Over the first four cases: walked 3, 0, 4, 1 (mean 2.00); argmax 1, >=1, 4, 1 (mean >= 1.75,
    exact on 3); the paths differ in 3 steps, 2 of them at or before the rejection (one win each)."""
    steps = [PREFILL] + [lattice_step(*CASES[c][0], step=i + 1)
                         for i, c in enumerate(["walked_further", "argmax_bound", "same_path", "parts_late"])]
    text = vl.lattice_run_summary(steps)
    assert "4 drafted steps" in text and "walked path **2.00**" in text
    assert "at least **1.75** (exact on 3 steps; on 1 it matched" in text
    assert "differ in 3 of 4 steps" in text and "Of the 2 where" in text
    assert "went further in 1, the argmax path in 1, and they tied in 0; in the other 1" in text
    assert "Sampled" not in text
    exact = vl.lattice_run_summary([lattice_step(*CASES["walked_further"][0])])
    assert "exactly **1.00**" in exact and "Accepted draft tokens" in exact
    sampled = vl.lattice_run_summary([lattice_step([0, 1, 0, 0], 3, 41, sampled=True)])
    assert "Sampled run" in sampled and "sampled tokens" in sampled
    assert vl.lattice_run_summary([PREFILL]) == ""


def test_has_lattice_ids_and_empty_state():
    step = lattice_step([0, 1, 0, 0], 3, 41)
    assert vl.has_lattice([PREFILL, step]) and not vl.has_lattice([PREFILL])
    assert vl.lattice_ids(step) == [5, *(t for row in CANDIDATES for t in row)] and vl.lattice_ids(PREFILL) == []
    assert "dflash2" in vl.NO_LATTICE and "DFlash 2 drafter" in vl.NO_LATTICE
    assert vl.lattice_figure(PREFILL, TEXTS).layout.annotations[0].text.startswith("Step 0 has no lattice")


def test_cell_label():
    texts = {1: " the", 2: "\ufffd", 3: "<s>", 4: "\n", 5: "abcdefghijk", 6: "", 7: "\x01"}
    assert [vl.cell_label(texts, t) for t in range(1, 9)] == [
        "␣the", "⟨2⟩", "&lt;s&gt;", "⏎", "abcdefg…", "⟨6⟩", "⟨7⟩", "⟨8⟩"]


def test_softmax_ignores_missing_scores():
    assert vl.softmax([0.0, 0.0, None]) == [0.5, 0.5, 0.0]
    assert vl.softmax([None, None]) == [0.0, 0.0]


# ---- the figure, read back ----------------------------------------------------------------------


def trace(fig, name: str, axis: str = "x"):
    return next(t for t in fig.data if t.name == name and t.xaxis == axis)


def drawn_ranks(fig, name: str, axis: str = "x") -> list[int]:
    """The grid row of each slot a path is drawn through (one point at each side of a slot's cell)."""
    return [round(y) for y in trace(fig, name, axis).y[1::2]]


def written(fig, axis: str = "x") -> dict[tuple[int, int], str]:
    """(slot, row) -> text of the text-only traces (the anchor, tokens outside the top-K)."""
    return {(x, y): text for t in fig.data if t.type == "scatter" and t.mode == "text" and t.xaxis == axis
            for x, y, text in zip(t.x, t.y, t.text)}


def framed_cells(fig, axis: str = "x") -> list[tuple[int, int]]:
    """(slot, row) of every target frame in one panel, in slot order."""
    frames = [s for s in fig.layout.shapes if s.line.color == vl.COLOURS["target"] and s.xref == axis]
    return sorted((round((s.x0 + s.x1) / 2), round((s.y0 + s.y1) / 2)) for s in frames)


def test_figure_draws_both_paths_and_the_target():
    step = lattice_step([0, 1, 2, 0], 2, 31)  # walk 10 21 32 40; target 10 21 31 (slot 4 unknown)
    fig = vl.lattice_figure(step, TEXTS)
    for axis in ("x", "x2"):
        assert drawn_ranks(fig, "the selector's walk", axis) == [0, 1, 2, 0]
        assert drawn_ranks(fig, "independent argmaxes (rank 0)", axis) == [0, 0, 0, 0]
        assert framed_cells(fig, axis) == [(1, 0), (2, 1), (3, 1)]  # no frame where the target is unknown
    top = fig.data[0]
    assert top.text[1][0] == "t11" and top.z[0][0] == pytest.approx(vl.softmax([2.0, 1.0, 0.0])[0])
    assert trace(fig, "walked token accepted").x == (1, 2) and trace(fig, "walked token rejected").x == (3,)
    assert trace(fig, "walked token unverified").x == (4,)
    assert "+1.50" in fig.data[[t.xaxis for t in fig.data].index("x2")].text[2][2]  # the transition S - U
    title = fig.layout.title.text
    assert "agreed with the target for 2 of 4 slots, independent argmaxes would have agreed for 1" in title


def test_figure_rows_deep_ranks_and_outside():
    """Top 8 by default, widened to the deepest rank used; the rest summarised; a target token
    outside the K gets its own row."""
    k = 12
    candidates = [[100 * (s + 1) + r for r in range(k)] for s in range(3)]
    step = lattice_step([9, 0, 0], 1, 777, candidates=candidates)
    fig = vl.lattice_figure(step, TEXTS)
    labels = list(fig.layout.yaxis.ticktext)
    assert labels == [f"rank {r}" for r in range(10)] + ["ranks 10–11", "not in top-K"]
    assert drawn_ranks(fig, "the selector's walk") == [9, 0, 0]
    assert framed_cells(fig) == [(1, 9), (2, 11)]  # slot 2's target token, 777, on the "not in top-K" row
    assert written(fig)[2, 11] == "⟨777⟩"
    assert fig.data[0].text[10][0].startswith("+2 · ")
    shallow = vl.lattice_figure(lattice_step([0, 0, 0], 3, 99, "bonus", candidates=candidates), TEXTS)
    assert list(shallow.layout.yaxis.ticktext) == [f"rank {r}" for r in range(8)] + ["ranks 8–11"]


def marked_labels(fig, lattice, texts) -> list[str]:
    """The label of every cell the figure frames as the target's token, in slot order: the framed
    candidate's, or the text written on the "not in top-K" row."""
    labels = list(fig.layout.yaxis.ticktext)
    outside = written(fig)
    return [vl.cell_label(texts, lattice["candidates"][slot - 1][row]) if labels[row].startswith("rank ")
            else outside[slot, row] for slot, row in framed_cells(fig)]


# ---- a real run ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_run(tiny_root):
    """A dflash2 run on a tiny qwen3 whose DFlash 2 drafter was fitted briefly to the target's own
    text (so drafts get accepted) and whose selector leaves the argmax path."""
    torch.manual_seed(0)
    target = load_target(ensure_tiny_model("qwen3", tiny_root))
    ids = target.tokenizer(PROMPTS[0]).input_ids
    model = random_drafter(target, std=0.02, conv_std=0.05, book_std=0.3, block=8, feature_layers=(0, 1),
                           selector_top_k=12).train()
    _fit(target, model, ids + hf_greedy(target, ids, 40), len(ids), steps=40)
    drafter = DFlash2EngineDrafter(model.eval(), DFlash2Config(gate=False, tree=False))  # the walk verified as it is
    run = generate(target, ids, "dflash2", drafter=drafter, max_new_tokens=40, stop_on_eos=False)
    texts = {t: target.tokenizer.decode([t]) for s in run.steps for t in (*vl.lattice_ids(s), *s.committed)}
    return run, texts


def test_real_run(real_run):
    run, texts = real_run
    drafted = [s for s in run.steps if vl.step_lattice(s)]
    assert vl.has_lattice(run.steps) and drafted == [s for s in run.steps if s.tokens]  # not the prefill
    assert any(s.accepted for s in drafted), "the fitted drafter should get drafts accepted"
    assert any(vl.compare(s).parts is not None for s in drafted), "the selector should leave the argmax path"
    for step in drafted:
        lattice = step.extras["dflash2"]
        fig = vl.lattice_figure(step, texts)
        walked = drawn_ranks(fig, "the selector's walk")
        assert [row[r] for row, r in zip(lattice["candidates"], walked)] == lattice["path_tokens"] == step.tokens
        marked = marked_labels(fig, lattice, texts)
        assert len(marked) == len(vl.target_tokens(step)) == min(len(step.accepted) + 1, len(step.tokens))
        committed = step.committed[: len(step.tokens)]  # the bonus, after the block, is not in the lattice
        assert marked[: len(committed)] == [vl.cell_label(texts, t) for t in committed]
        assert vl.compare(step).walked == len(step.accepted)
        assert vl.lattice_summary_html(step, texts).startswith('<div class="lattice-summary">')
    summary = vl.lattice_run_summary(run.steps)
    mean = sum(len(s.accepted) for s in drafted) / len(drafted)
    assert f"walked path **{mean:.2f}**" in summary and f"{len(drafted)} drafted steps" in summary


def test_a_tree_step_maps_the_walk_onto_its_nodes():
    """The walk 10 21 30 40 drafted as a tree: 10 -> 21 -> 30 (the walk's first three slots) and
    10 -> 20 -> 31 -> 41 (another path). The target took 10 20 31 41 and a bonus: slot 1 of the walk
    accepted, slot 2 (21) refused, slot 3 (30) below a refusal, slot 4 (40) in no node. Slot 2's
    target token is 20, a token of the other path, which went on past it."""
    chain = lattice_step([0, 1, 0, 0], 4, 99, kind="bonus")
    tree = dataclasses.replace(chain, tokens=[10, 21, 20, 30, 31, 41], parents=[-1, 0, 0, 1, 2, 4],
                               p=[0.5] * 6, accepted=[0, 2, 4, 5], committed=[10, 20, 31, 41, 99])
    assert vl.walked_status(tree, 4) == ["accepted", "rejected", "unverified", "unverified"]
    c = vl.compare(tree)
    assert (c.walked, c.known) == (1, 4)
    summary = vl.lattice_summary_html(tree, TEXTS)
    assert "at slot 2 it drafted" in summary and "the target produced" in summary and "t20" in summary
    assert "Another path of the step" in summary and "tree went on from there" in summary
    run_summary = vl.lattice_run_summary([PREFILL, tree])
    assert "1 of the steps verified a tree" in run_summary and "accepting **4.00** draft tokens" in run_summary
    assert run_summary.startswith("**DFlash 2 lattice, 1 drafted steps.** Draft tokens agreeing with the target")
