"""Records -> the AdaFlash tab: where each step's draft was cut, what the rule expected, what
the target accepted, and what the cut saved.

AdaFlash (specflash/drafters/adaflash.py) drafts a full block, then a cut rule decides how many
drafted tokens the target verifies. `extras["adaflash"]` holds the `rule`, the length head's
`score` r (None without a head), `verify_len` (the drafted tokens kept plus the target's own next
token, so one more than the drafted tokens verified), the `cut_tokens` never verified, their
draft probabilities `cut_q` and, in analysis mode at temperature 0, `cut_would_accept`: how
many of them greedy verification would have accepted. The rule's estimate options (`estimate`,
`rate`, `threshold`, `fixed_len`) live in the run's config. Pure: plotly figures and HTML.
"""

from __future__ import annotations

import dataclasses
import html
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go

from specflash.drafters.adaflash import AdaFlashConfig, path_probabilities
from specflash.drafters.lookup_graft import own_nodes, own_share
from specflash.trace import RunRecord, StepRecord
from specflash.tree import DraftTree

from .views import (ORIGINS, STATUS_COLOURS, draft_tree, gate_idle_share, leaf_count, lookup_note, lookup_share,
                    node_status, token_text)

DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(AdaFlashConfig)}
WHAT_IT_SHOWS = (
    "This tab shows, step by step, how many drafted tokens AdaFlash's cut rule sent to the target, "
    "how many the rule expected to be accepted and how many were, and how many it cut (never verified: "
    "the verify work it saved), with the rule's meaning in words."
)
CUT_COLOURS = {"accepted": STATUS_COLOURS["accepted"], "refused": "#f2aeab", "would": "#f0ad4e", "saved": "#d5d5d5"}


@dataclass(frozen=True)
class Cut:
    """One step's cut: drafted tokens verified and cut, the accepted run, the rule's estimate."""

    step: int
    rule: str
    verified: int  # the drafter's tokens the target verified (its nodes of step.tokens), not verify_len
    accepted: int  # of those, on the accepted path
    cut: int  # drafted tokens never verified: what the cut saved
    would_accept: int | None  # of the cut, how many greedy verification would have accepted (hindsight)
    predicted: float | None  # the rule's expected accepted run among the verified tokens
    score: float | None  # the length head's r, only where the rule reads it
    grafted: int = 0  # prompt lookup's nodes verified beside the drafter's (lookup_graft.py), not the cut's
    grafted_accepted: int = 0


def _settings(config: Mapping[str, Any]) -> dict[str, Any]:
    return {**DEFAULTS, **config}


def uses_score(rule: str, config: Mapping[str, Any]) -> bool:
    """Whether the rule reads the length head's score r (otherwise r, if recorded, played no part)."""
    return rule == "head" or (rule == "cost" and _settings(config)["estimate"] == "head")


def rule_meaning(rule: str, config: Mapping[str, Any]) -> str:
    """What the rule does, in words, with the run's own settings."""
    c = _settings(config)
    reads = "the length head's predicted run" if c["estimate"] == "head" else "the drafter's own token probabilities"
    meanings = {
        "cost": "verify the prefix that maximises expected accepted tokens per unit of this device's measured "
                f"verify cost, reading acceptance from {reads}",
        "fixed": f"always verify {c['fixed_len']} drafted tokens",
        "heuristic": "transformers' assisted-generation schedule: verify 2 more after a fully accepted draft, "
                     "1 fewer otherwise",
        "confidence": f"stop before the first drafted token whose draft probability is below {c['threshold']}",
        "entropy": f"stop before the first position whose draft entropy exceeds {c['threshold']} nats",
        "head": "the learned length head reads the drafter's hidden states and predicts r = verify length / block "
                "size; verify round(r · block size · rate) − 1 drafted tokens",
    }
    return meanings.get(rule, "a cut rule this app does not describe")


def predicted_run(step: StepRecord, rule: str, config: Mapping[str, Any]) -> float | None:
    """The accepted run the rule expected among the tokens it verified: the head's run
    r·L·rate − 1 for score rules; for the cost rule, each drafted node's chance that its path is
    accepted (its path's confidences chained), summed: a chain's run, or a tree's; None for rules
    that make no estimate (fixed, heuristic, confidence, entropy). Grafted prompt-lookup nodes are
    not the rule's and are left out."""
    c, ada = _settings(config), step.extras["adaflash"]
    n = own_nodes(len(step.tokens), step.extras)
    if uses_score(rule, config):
        block = (step.extras.get("dflash") or {}).get("block_size") or c.get("block_size")
        if ada.get("score") is None or not block:
            return None
        return min(max(0.0, ada["score"] * block * c["rate"] - 1), n)
    if rule != "cost" or step.q is None:
        return None
    return sum(path_probabilities(DraftTree(tuple(step.tokens[:n]), tuple(step.parents[:n])), step.q[:n], c["rate"]))


def step_cut(step: StepRecord, config: Mapping[str, Any]) -> Cut | None:
    """The step's cut, or None when the step has no AdaFlash record (prefill, gate off)."""
    ada = step.extras.get("adaflash")
    if not ada:
        return None
    rule = ada.get("rule") or config.get("rule", DEFAULTS["rule"])
    own = own_nodes(len(step.tokens), step.extras)
    _, accepted = own_share(draft_tree(step), step.extras, step.accepted)
    return Cut(step.step, rule, own, accepted, len(ada.get("cut_tokens", [])), ada.get("cut_would_accept"),
               predicted_run(step, rule, config), ada.get("score") if uses_score(rule, config) else None,
               len(step.tokens) - own, step.accepted_len - accepted)


def run_cuts(steps: Sequence[StepRecord], config: Mapping[str, Any]) -> list[Cut]:
    return [cut for cut in (step_cut(s, config) for s in steps) if cut is not None]


def has_adaflash(steps: Sequence[StepRecord]) -> bool:
    return any(s.extras.get("adaflash") for s in steps)


def _bar(name: str, x: list[int], y: list[float], colour: str, **kw: Any) -> go.Bar:
    return go.Bar(x=x, y=y, name=name, marker_color=colour, hovertemplate=f"step %{{x}}: %{{y}} {name}<extra></extra>",
                  **kw)


def _cut_bars(cuts: list[Cut]) -> list[go.Bar]:
    """The drafted block of each step stacked bottom-up: accepted, sent but not accepted, then
    above the cut the tokens never verified; where hindsight is known, the cut tokens greedy
    verification would have accepted sit right above the cut (the run the cut lost)."""
    x = [c.step for c in cuts]
    bars = [_bar("accepted", x, [c.accepted for c in cuts], CUT_COLOURS["accepted"]),
            _bar("sent to verification, not accepted", x, [c.verified - c.accepted for c in cuts], CUT_COLOURS["refused"])]
    if any(c.would_accept is not None for c in cuts):
        bars.append(_bar("cut, though greedy would have accepted it (hindsight)", x, [c.would_accept or 0 for c in cuts],
                         CUT_COLOURS["would"]))
    bars.append(_bar("cut, never verified (saved)", x, [c.cut - (c.would_accept or 0) for c in cuts], CUT_COLOURS["saved"],
                     marker_pattern_shape="/"))
    return bars


def _rule_title(cuts: list[Cut], config: Mapping[str, Any]) -> str:
    rules = sorted({c.rule for c in cuts})
    return "; ".join(f"rule <b>{html.escape(r)}</b>: {html.escape(rule_meaning(r, config))}" for r in rules)


def adaflash_figure(steps: Sequence[StepRecord], config: Mapping[str, Any]) -> go.Figure:
    """Per step, the drafted block as a stacked bar split at the cut (accepted, refused, cut),
    the rule's predicted accepted run as a diamond, and the head's score on a 0–1 axis only
    when the rule reads it. The legend sits above the plot so it covers no data or ticks."""
    cuts = run_cuts(steps, config)
    x = [c.step for c in cuts]
    fig = go.Figure(_cut_bars(cuts))
    fig.add_scatter(x=x, y=[c.verified for c in cuts], mode="markers", name="the cut (drafted tokens sent to verification)",
                    marker=dict(symbol="line-ew-open", size=16, color="#222", line=dict(width=3, color="#222")),
                    hovertemplate="step %{x}: verified %{y} drafted tokens<extra></extra>")
    if any(c.predicted is not None for c in cuts):
        fig.add_scatter(x=x, y=[c.predicted for c in cuts], mode="markers", name="predicted accepted run",
                        marker=dict(symbol="diamond", size=8, color="#1f4e9e"),
                        hovertemplate="step %{x}: the rule expected %{y:.2f} accepted<extra></extra>")
    layout: dict[str, Any] = {}
    top = max((c.verified + c.cut for c in cuts), default=1)
    if any(c.score is not None for c in cuts):
        fig.add_scatter(x=x, y=[c.score for c in cuts], mode="markers", name="length-head score r (right axis)",
                        yaxis="y2", marker=dict(symbol="circle-open", size=7, color="#7a5cc9"),
                        hovertemplate="step %{x}: r = %{y:.3f}<extra></extra>")
        layout["yaxis2"] = dict(title="score r = verify length / block size", overlaying="y", side="right",
                                range=[0, 1], tickmode="linear", dtick=0.25, showgrid=False)
    fig.update_layout(
        title=dict(text=f"AdaFlash: each step's drafted tokens, split at the cut<br><sup>{_rule_title(cuts, config)}</sup>",
                   y=0.97, yanchor="top"),
        template="plotly_white", barmode="stack", bargap=0.15, height=440,
        xaxis=dict(title="step"), yaxis=dict(title="drafted tokens", dtick=1, range=[0, top + 0.5]),
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0, traceorder="normal"),
        margin=dict(l=50, r=60, t=130, b=45), **layout,
    )
    return fig


def _sum(cuts: list[Cut], key: str) -> int:
    return sum(getattr(c, key) for c in cuts)


def adaflash_note(run: RunRecord | None) -> str:
    """What the tab says above its plot: with no AdaFlash run, what it will show and which method
    fills it; with one, the rule and the run's totals."""
    fill = "Generate with method `adaflash` (or import an AdaFlash run) to fill it."
    if run is None:
        return f"**No run yet.** {WHAT_IT_SHOWS} {fill}"
    if not has_adaflash(run.steps):
        return f"**This run (method `{run.method}`) has no AdaFlash record.** {WHAT_IT_SHOWS} {fill}"
    cuts = run_cuts(run.steps, run.config)
    known = [c for c in cuts if c.would_accept is not None]
    hindsight = (f" Of the cut tokens, greedy verification would have accepted {_sum(known, 'would_accept')}."
                 if known else " No hindsight on the cut tokens was recorded (it exists for greedy runs only).")
    rules = ", ".join(sorted({f"`{c.rule}`" for c in cuts}))
    grafted = _sum(cuts, "grafted")
    beside = (f" Beside them the target verified {grafted} nodes of continuations grafted onto the drafter's trees "
              f"(prompt lookup's, the datastore's; {_sum(cuts, 'grafted_accepted')} accepted; not the cut's, and not "
              "in the plot)."
              if grafted else "")
    return (f"Cut rule {rules} (what it does is under the plot title). "
            f"Over {len(cuts)} drafted steps: {_sum(cuts, 'verified') + _sum(cuts, 'cut')} tokens drafted, "
            f"{_sum(cuts, 'verified')} verified ({_sum(cuts, 'accepted')} accepted), {_sum(cuts, 'cut')} cut "
            f"and never verified.{beside}{hindsight}{lookup_share(run.steps, 'cut')}{gate_idle_share(run.steps)}")


def _chip(text: str, colour: str, css_class: str, extra: str = "") -> str:
    return (f'<span class="{css_class}" style="background:{colour};border-radius:3px;padding:1px 3px;'
            f'margin:0 2px;{extra}">{html.escape(text)}</span>')


def _cut_sentence(cut: Cut) -> str:
    """The step in words: verified vs cut, expected vs actual run, hindsight."""
    plural = "s" if cut.verified != 1 else ""
    expected = "" if cut.predicted is None else f"the rule expected {cut.predicted:.2f} accepted, "
    score = "" if cut.score is None else f" (length-head score r = {cut.score:.3f})"
    would = ("" if cut.would_accept is None
             else f" Of the cut tokens, greedy verification would have accepted {cut.would_accept}.")
    beside = (f" Continuations grafted onto the tree (prompt lookup's, the datastore's) were verified beside them, "
              f"{cut.grafted} grafted node"
              f"{'s' if cut.grafted != 1 else ''} ({cut.grafted_accepted} accepted), after the ⇢ below"
              " (the Step inspector shows where each hangs)."
              if cut.grafted else "")
    return (f"The target verified {cut.verified} drafted token{plural} and the cut saved {cut.cut} (never verified): "
            f"{expected}the target accepted {cut.accepted}{score}.{would}{beside}")


def _tree_sentence(step: StepRecord, texts: Mapping[int, str]) -> str:
    """For a step verified as a tree: how many paths, and which chain the cut tokens continue."""
    chain = step.extras["adaflash"].get("chain")
    paths = leaf_count(step.parents[: own_nodes(len(step.tokens), step.extras)])  # the drafter's own tree
    if chain is None or paths == 1:
        return ""
    words = " ".join(html.escape(repr(token_text(texts, t))) for t in chain)
    return (f" The verified tokens were a tree of {paths} paths, listed node by node below (the Step inspector "
            f"gives each one's parent); the cut tokens continue the drafter's argmax chain {words}.")


def adaflash_cut_html(step: StepRecord, texts: Mapping[int, str], config: Mapping[str, Any]) -> str:
    """The step's draft as verified, a ✂ where the rule cut it, then the tokens it cut; then,
    after a ⇢, prompt lookup's nodes grafted beside the drafter's."""
    cut = step_cut(step, config)
    if cut is None:
        why = lookup_note(step) or "no draft this step"
        return f"<p>Step {step.step} has no AdaFlash record ({html.escape(why)}).</p>"
    colours = {"accepted": ORIGINS["accepted"][1], "rejected": ORIGINS["resample"][1], "unverified": "#eee"}
    chips = [_chip(repr(token_text(texts, t)), colours[s], f"draft-{s}") for t, s in zip(step.tokens, node_status(step))]
    kept = "".join(chips[: cut.verified])
    grafted = ('<span class="graft-mark" style="font-size:1.3em;margin-left:8px" title="prompt lookup, grafted">⇢</span>'
               + "".join(chips[cut.verified:])) if cut.grafted else ""
    dropped = "".join(_chip(repr(token_text(texts, t)), "#f4f4f4", "draft-cut", "text-decoration:line-through;color:#888")
                      for t in step.extras["adaflash"].get("cut_tokens", []))
    return (
        f'<div class="adaflash-cut"><p>Step {step.step}, rule <code>{html.escape(cut.rule)}</code> '
        f"({html.escape(rule_meaning(cut.rule, config))}). {_cut_sentence(cut)}{_tree_sentence(step, texts)}</p>"
        f'<div style="font-family:monospace">{kept}<span class="cut-mark" style="font-size:1.3em;color:#d9534f">✂</span>'
        f"{dropped}{grafted}</div></div>"
    )
