"""Batched decoding: each row equals its own greedy decoding (ar, dflash, every adaflash rule, on
several tiny models); rows stop on their own; the shared cache stays right while rows keep
different counts; sampling per row equals the single engine at seed + row; the batch's common
cut; padding counted as verified; bad input; the bench's batch sweep."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import LOSSLESS_ARCHS, hf_greedy
from test_dflash import _fit, random_drafter
from specflash.api import generate, generate_batch
from specflash.batch import BatchDrafter, batch_drafter
from specflash.batch.target import BatchCache, compact_index
from specflash.bench_batch import BatchSample, parse_variants, summarize_batch
from specflash.cli import main
from specflash.config import PromptLookupConfig, SamplingConfig
from specflash.drafters.adaflash import RULES, AdaFlashConfig, AdaFlashDrafter
from specflash.drafters.base import Draft, Drafter
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.drafters.prompt_lookup import PromptLookupDrafter
from specflash.errors import (
    ContextLengthError,
    EmptyPromptError,
    MethodConfigError,
    UnbatchableMethodError,
    UnknownMethodError,
)
from specflash.models.dflash_io import save_drafter
from specflash.tree import DraftTree
from specflash.verify_cost import best_common_cut, best_cut, cached_verify_cost

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick brown", "What is 12 * 7?", "Once"]
STEEP = [1.0 + 0.5 * i for i in range(16)]
N = 24
VARIANTS = ["ar", "dflash"] + [f"adaflash:{rule}" for rule in RULES]


def single_drafter(target, variant: str, model=None) -> Drafter:
    """The single-sequence drafter of a variant, on a random (or the given) DFlash network."""
    method, _, rule = variant.partition(":")
    if method == "ar":
        return Drafter()
    model = model or random_drafter(target, block=8, feature_layers=(0, 1))
    if method == "dflash":
        return DFlashEngineDrafter(model, DFlashConfig(gate=False, tree=False))  # batches draft chains
    head = None
    if rule == "head":
        from specflash.models.length_head import LengthHead

        torch.manual_seed(0)
        head = LengthHead(model.spec.hidden_size, bottleneck=16)
    # min_len 1: a random drafter's drafts are seldom worth verifying, and these tests need drafts
    cfg = AdaFlashConfig(gate=False, rule=rule, threshold=0.3 if rule == "confidence" else 2.0, fixed_len=2,
                         min_len=1, tree=False)  # batches draft chains
    return AdaFlashDrafter(model, cfg, STEEP[:8], head)


@pytest.fixture(scope="module")
def reference(tiny_targets):
    """hf_greedy of each (arch, prompt) alone, computed once."""
    memo: dict[tuple, list[int]] = {}

    def get(arch: str, ids: list[int], n: int = N) -> list[int]:
        key = (arch, tuple(ids), n)
        if key not in memo:
            memo[key] = hf_greedy(tiny_targets[arch], ids, n)
        return memo[key]

    return get


def encode(target, prompts=PROMPTS) -> list[list[int]]:
    return [target.tokenizer(p).input_ids for p in prompts]


def check_steps(batch) -> None:
    """Per forward, every row in it verified the same T positions (padding included), T - 1 the
    longest draft, and fed_tokens counted them."""
    by_step: dict[int, list] = {}
    for run in batch.runs:
        for step in run.steps:
            by_step.setdefault(step.step, []).append(step)
    for index, steps in by_step.items():
        width = max(len(s.tokens) for s in steps) + 1
        if index == 0:
            width = max(s.context_len for s in steps)
        assert all(s.verified == width for s in steps)
        assert batch.fed_tokens[index] == width * len(steps)


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_equal_their_own_greedy(tiny_targets, reference, arch, variant):
    target = tiny_targets[arch]
    prompts = encode(target)
    drafter = single_drafter(target, variant)
    batch = generate_batch(target, prompts, drafter=drafter, max_new_tokens=N, stop_on_eos=False)
    assert [r.output_ids for r in batch.runs] == [reference(arch, p) for p in prompts]
    assert all(r.finish_reason == "length" and r.prompt_ids == p for r, p in zip(batch.runs, prompts))
    assert batch.new_tokens == N * len(prompts) and batch.throughput > 0
    check_steps(batch)
    if variant != "ar":
        step = batch.runs[0].steps[1]
        assert step.extras["dflash"] == {"block_size": 8}
    if variant.startswith("adaflash"):
        assert set(step.extras["adaflash"]) == {"rule", "score", "verify_len", "cut_tokens", "cut_q"}


def test_cost_rule_cuts_the_whole_batch_at_the_common_cut(tiny_targets):
    target = tiny_targets["qwen3"]
    gentle = [1.0 + 0.005 * i for i in range(8)]  # the batch's own curve, passed in place of the drafter's
    batch = generate_batch(target, encode(target), drafter=single_drafter(target, "adaflash:cost"), max_new_tokens=N,
                           stop_on_eos=False, batch_cost=gentle)
    steps_at: dict[int, list] = {}
    for run in batch.runs:
        for step in run.steps[1:]:
            if "adaflash" in step.extras:
                steps_at.setdefault(step.step, []).append((step, step.q + step.extras["adaflash"]["cut_q"]))
    cuts, own_differs = [], False
    for pairs in steps_at.values():
        confidences = [conf for _, conf in pairs]
        common = best_common_cut(confidences, gentle)  # min_len 0: no floor
        assert [len(step.tokens) for step, _ in pairs] == [min(common, len(conf)) for conf in confidences]
        cuts.append(common)
        own_differs |= any(best_cut(conf, gentle) != common for conf in confidences)
    assert max(cuts) > 1 and own_differs  # the cut moved, and some row alone would have cut elsewhere


def test_a_batch_records_the_chains_it_drafted(tiny_targets):
    """A single drafter configured for trees (the default) drafts chains in a batch, and the
    batch's runs say so."""
    target = tiny_targets["llama"]
    drafter = DFlashEngineDrafter(random_drafter(target, block=8, feature_layers=(0, 1)), DFlashConfig(gate=False))
    batch = generate_batch(target, encode(target)[:2], drafter=drafter, max_new_tokens=6, stop_on_eos=False)
    assert all(r.config["tree"] is False for r in batch.runs)
    assert all(s.parents == list(range(-1, len(s.tokens) - 1)) for r in batch.runs for s in r.steps)


def test_batch_of_one_drafts_what_the_single_engine_drafts(tiny_targets):
    target = tiny_targets["llama"]
    ids = encode(target)[1]
    for variant in ("dflash", "adaflash:cost", "adaflash:heuristic"):
        model = random_drafter(target, block=8, feature_layers=(0, 1))
        single = generate(target, ids, drafter=single_drafter(target, variant, model), max_new_tokens=N)
        batch = generate_batch(target, [ids], drafter=single_drafter(target, variant, model), max_new_tokens=N)
        mine = batch.runs[0]
        assert [(s.tokens, s.accepted, s.verified) for s in mine.steps] == \
               [(s.tokens, s.accepted, s.verified) for s in single.steps]
        # the same extras; draft probabilities to float rounding (a 1-row verify runs other kernels)
        assert all(_close(a.extras, b.extras) for a, b in zip(mine.steps, single.steps))


def test_a_draft_not_worth_verifying_is_dropped_whole_alone_and_in_a_batch(tiny_targets, reference):
    """AdaFlash's default floor is 0: where the cost rule finds no cut worth verifying, the step
    feeds the root alone, and the trace still holds the drafted block as cut tokens."""
    target = tiny_targets["llama"]
    ids = encode(target)[1]
    model = random_drafter(target, block=8, feature_layers=(0, 1))
    runs = []
    for run_batch in (False, True):
        drafter = AdaFlashDrafter(model, AdaFlashConfig(gate=False), STEEP[:8])
        runs.append(generate_batch(target, [ids], drafter=drafter, max_new_tokens=N).runs[0] if run_batch
                    else generate(target, ids, drafter=drafter, max_new_tokens=N))
    single, batched = runs
    assert single.output_ids == batched.output_ids == reference("llama", ids)
    dropped = [s for s in single.steps[1:] if not s.tokens and "adaflash" in s.extras]  # not the last: no room
    assert dropped and all(s.extras["adaflash"]["cut_tokens"] and s.verified == 1 for s in dropped)
    assert [(s.tokens, s.verified) for s in batched.steps] == [(s.tokens, s.verified) for s in single.steps]
    assert all(_close(a.extras, b.extras) for a, b in zip(batched.steps, single.steps))


def _close(a, b) -> bool:
    """Equal structures, floats compared to a relative 1e-5."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_close, a, b))
    return a == b


@pytest.mark.parametrize("variant", ["dflash", "adaflash:confidence"])
def test_every_row_drafts_what_the_single_engine_drafts(tiny_targets, variant):
    """At temperature 0 each row follows its single-engine trajectory, so a right batched drafter
    cache (padded prompts, rows with different new context) drafts the same full blocks."""
    target = tiny_targets["qwen2"]
    prompts = encode(target)
    model = random_drafter(target, block=8, feature_layers=(0, 1))
    batch = generate_batch(target, prompts, drafter=single_drafter(target, variant, model), max_new_tokens=N)

    def blocks(run):
        return [s.tokens + s.extras.get("adaflash", {}).get("cut_tokens", []) for s in run.steps]

    for ids, run in zip(prompts, batch.runs):
        alone = generate(target, ids, drafter=single_drafter(target, variant, model), max_new_tokens=N)
        assert blocks(run) == blocks(alone)


class OracleDrafter(BatchDrafter):
    """Drafts each row's known greedy continuation, wrong from a position that varies with the row
    and the step, so the rows of one forward keep different counts (and leave holes)."""

    def __init__(self, prompts, references, vocab: int, depth: int = 6) -> None:
        self.prompts, self.references, self.vocab, self.depth = prompts, references, vocab, depth

    def begin(self, rows, sampling) -> None:
        super().begin(rows, sampling)
        self.live, self.calls = list(range(rows)), 0

    def propose(self, roots, root_pos, max_lens):
        self.calls += 1
        drafts = []
        for b, (pos, room) in enumerate(zip(root_pos, max_lens)):
            row = self.live[b]
            done = pos + 1 - len(self.prompts[row])
            truth = self.references[row][done : done + min(self.depth, room)]
            wrong = (3 * row + 2 * self.calls) % (self.depth + 2)
            tokens = [t if i < wrong else (t + 1) % self.vocab for i, t in enumerate(truth)]
            drafts.append(Draft(DraftTree.chain(tokens)) if tokens else Draft.empty())
        return drafts

    def select_rows(self, rows) -> None:
        self.live = [self.live[i] for i in rows.tolist()]


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
def test_rows_keeping_different_counts_keep_a_correct_cache(tiny_targets, reference, arch, monkeypatch):
    target = tiny_targets[arch]
    prompts = encode(target)
    refs = [reference(arch, p, 40) for p in prompts]
    compactions = []
    original = BatchCache.compact
    monkeypatch.setattr(BatchCache, "compact", lambda self: (compactions.append(self.length), original(self))[1])
    batch = generate_batch(target, prompts, drafter=OracleDrafter(prompts, refs, target.vocab_size), max_new_tokens=40,
                           stop_on_eos=False)
    assert [r.output_ids for r in batch.runs] == refs
    kept = [[len(s.accepted) for s in run.steps[1:4]] for run in batch.runs]
    assert any(len({row[i] for row in kept}) > 1 for i in range(3))  # rows kept different counts in one forward
    assert compactions  # holes were reclaimed, and the output stayed exact
    check_steps(batch)
    padded = [s for run in batch.runs for s in run.steps[1:] if s.verified > len(s.tokens) + 1]
    assert padded  # rows near their budget fed fewer tokens than the forward computed, and paid for all


def test_compact_index_on_a_hand_built_mask():
    valid = torch.tensor([[False, True, False, True, True], [True, False, False, False, True]])
    index, new_valid = compact_index(valid)
    assert index.tolist() == [[1, 3, 4], [3, 0, 4]]  # row 1's first slot is a hole (it gathers a hole)
    assert new_valid.tolist() == [[True, True, True], [False, True, True]]


def test_rows_stop_on_eos_at_different_times(tiny_targets, reference, monkeypatch):
    target = tiny_targets["qwen3"]
    prompts = encode(target)
    refs = [reference("qwen3", p) for p in prompts]
    stops = {refs[0][3], refs[2][12]}
    monkeypatch.setattr(target.model.generation_config, "eos_token_id", sorted(stops | set(target.eos_ids)))
    eos = target.eos_ids

    def cut(ref):
        return next((ref[: i + 1] for i, t in enumerate(ref) if t in eos), ref)

    for variant in ("ar", "dflash", "adaflash:cost"):
        batch = generate_batch(target, prompts, drafter=single_drafter(target, variant), max_new_tokens=N)
        assert [r.output_ids for r in batch.runs] == [cut(r) for r in refs]
        assert len({len(r.output_ids) for r in batch.runs}) > 1
        assert {r.finish_reason for r in batch.runs} == {"eos", "length"}
        assert [r.metrics["new_tokens"] for r in batch.runs] == [len(r.output_ids) for r in batch.runs]
        check_steps(batch)


@pytest.mark.parametrize("variant", ["ar", "dflash", "adaflash:fixed"])
def test_sampled_rows_equal_the_single_engine_at_seed_plus_row(tiny_targets, variant):
    target = tiny_targets["llama"]
    prompts = encode(target, [PROMPTS[2]] * 3 + [PROMPTS[0]])
    model = random_drafter(target, block=8, feature_layers=(0, 1))
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=5)
    batch = generate_batch(target, prompts, drafter=single_drafter(target, variant, model), sampling=sampling,
                           max_new_tokens=N, stop_on_eos=False)
    again = generate_batch(target, prompts, drafter=single_drafter(target, variant, model), sampling=sampling,
                           max_new_tokens=N, stop_on_eos=False)
    outputs = [r.output_ids for r in batch.runs]
    assert outputs == [r.output_ids for r in again.runs]
    for b, ids in enumerate(prompts):
        alone = generate(target, ids, drafter=single_drafter(target, variant, model), max_new_tokens=N,
                         sampling=SamplingConfig(temperature=0.9, top_p=0.95, seed=5 + b), stop_on_eos=False)
        assert outputs[b] == alone.output_ids
    assert len({tuple(o) for o in outputs[:3]}) > 1  # identical prompts, own random streams


def test_trained_drafter_accepts_in_a_batch(tiny_targets, reference):
    """A drafter fitted to the target's own text accepts tokens, so the batched drafter cache's
    commit path (rows with different new context) is exercised; every row stays exact."""
    target = tiny_targets["qwen3"]
    prompts = encode(target)
    refs = [reference("qwen3", p, 40) for p in prompts]
    model = random_drafter(target, std=0.02, block=4, feature_layers=(0, 1)).train()
    _fit(target, model, prompts[0] + refs[0], len(prompts[0]), steps=60)
    model.eval()
    for variant in ("dflash", "adaflash:cost", "adaflash:confidence"):
        batch = generate_batch(target, prompts, drafter=single_drafter(target, variant, model), max_new_tokens=40,
                               stop_on_eos=False)
        assert [r.output_ids for r in batch.runs] == refs
        assert sum(len(s.accepted) for s in batch.runs[0].steps) > 0


def test_common_cut_on_hand_built_rows():
    sure, hopeless = [0.99] * 3, [0.1] * 3
    for conf in (sure, hopeless, [0.9, 0.05, 0.05]):
        assert best_common_cut([conf], STEEP) == best_cut(conf, STEEP)
    assert best_cut(sure, STEEP) == 3 and best_cut(hopeless, STEEP) == 0
    # (1.99 + 1.1) / 1.5 = 2.06 beats 2 / 1 (no drafts) and (2.9701 + 1.11) / 2 = 2.04
    assert best_common_cut([sure, hopeless], STEEP) == 1
    # a row with one draft stops gaining: (1.99 + 1.99) / 1.5 = 2.65 beats (1.99 + 2.9701) / 2 = 2.48
    assert best_common_cut([[0.99], sure], STEEP) == 1
    assert best_common_cut([sure, sure], STEEP) == 3
    assert best_common_cut([sure, hopeless], [1.0] * 8) == 3  # free verification: everything


def test_verify_cost_per_batch_size_is_cached_apart(tiny_targets, tmp_path):
    target = tiny_targets["qwen2"]
    wide = cached_verify_cost(target, 3, tmp_path, batch=3)
    one = cached_verify_cost(target, 3, tmp_path)
    stem = f"{Path(target.name).name}-cpu-t{torch.get_num_threads()}-float32"
    assert sorted(p.name for p in (tmp_path / "verify-cost").iterdir()) == [f"{stem}-b3-rounds.json", f"{stem}-rounds.json"]
    for curve in (wide, one):
        assert len(curve) == 3 and curve[0] == 1.0 and curve == sorted(curve)


def test_verify_cost_times_every_length_in_each_round(tiny_targets, monkeypatch):
    """Rounds over all lengths (the first warming up), not all repeats of one length and then
    the next: a burst of load then weighs on every length alike."""
    from specflash import verify_cost

    target = tiny_targets["qwen2"]
    fed = []
    real = verify_cost._forward

    def recorded(target, ids, cache, start, batch, last_only=False):
        if start:  # the timed block, fed on top of the prefix
            fed.append(len(ids))
        return real(target, ids, cache, start, batch, last_only=last_only)

    monkeypatch.setattr(verify_cost, "_forward", recorded)
    curve = verify_cost.measure_verify_cost(target, 3, repeats=2, prefix_len=5)
    assert fed == [1, 2, 3] * 3 and len(curve) == 3 and curve[0] == 1.0


def test_verify_cost_per_cpu_thread_count_is_cached_apart(tiny_targets, tmp_path):
    target = tiny_targets["qwen2"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cached_verify_cost(target, 3, tmp_path)
        torch.set_num_threads(2)
        cached_verify_cost(target, 3, tmp_path)
    finally:
        torch.set_num_threads(threads)
    names = sorted(p.name for p in (tmp_path / "verify-cost").iterdir())
    assert [n.split("-cpu-")[1].split("-")[0] for n in names] == ["t1", "t2"]


def test_bad_input(tiny_targets):
    target = tiny_targets["llama"]
    with pytest.raises(EmptyPromptError):
        generate_batch(target, [])
    with pytest.raises(EmptyPromptError):
        generate_batch(target, ["def f():", ""])
    with pytest.raises(UnbatchableMethodError, match="pld"):
        generate_batch(target, PROMPTS[:2], "pld")
    with pytest.raises(UnknownMethodError):
        generate_batch(target, PROMPTS[:2], "magic")
    with pytest.raises(ContextLengthError):
        generate_batch(target, [[5] * 4, [5] * (target.context_length - 3)], max_new_tokens=4)
    with pytest.raises(UnbatchableMethodError):
        batch_drafter(PromptLookupDrafter(PromptLookupConfig()))
    drafter = single_drafter(target, "adaflash:head")
    drafter.head = None
    with pytest.raises(MethodConfigError, match="head"):
        batch_drafter(drafter)


def test_bench_rejects_bad_batch_input(capsys):
    for extra in (["--batch-sizes", "0,4"], ["--batch-sizes", "four"], ["--batch-sizes", "2", "--methods", "ar,pld"]):
        assert main(["bench", "--model", "tiny-qwen3", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and err.count("\n") == 1


def test_batch_summary_rows():
    def s(method, repeat, wall, outputs, steps, committed, verified):
        return BatchSample(method, 2, repeat, wall, sum(map(len, outputs)), outputs, steps, committed, verified)

    samples = [
        s("ar", 0, 4.0, [[1, 2], [3, 4]], 4, 4, 4), s("ar", 1, 2.0, [[1, 2], [3, 4]], 4, 4, 4),
        s("dflash", 0, 2.0, [[1, 2], [3, 4]], 2, 4, 16), s("dflash", 1, 2.0, [[1, 2], [3, 4]], 2, 4, 16),
        s("adaflash", 0, 1.0, [[1, 2], [3, 5]], 2, 4, 8), s("adaflash", 1, 0.5, [[1, 2], [3, 4]], 2, 4, 8),
    ]
    rows = {r["method"]: r for r in summarize_batch(samples, ["ar", "dflash", "adaflash"])}
    assert rows["ar"]["vs_ar"] == 1.0 and rows["ar"]["tokens_per_s"] == 1.5  # median of 1.0 and 2.0
    assert rows["dflash"]["vs_ar"] == 1.5  # median of the paired ratios 2.0 and 1.0
    assert rows["adaflash"]["vs_dflash"] == 3.0  # ratios 2.0 and 4.0
    assert rows["adaflash"]["mean_acceptance_length"] == 2.0 and rows["adaflash"]["verified_per_committed"] == 2.0
    assert rows["adaflash"]["identical_to_ar"] is False and rows["dflash"]["identical_to_ar"] is True


def test_variants_name_rules_and_take_their_own_options():
    per = {"adaflash": {"rate": 0.5}, "adaflash:tight": {"rule": "confidence", "threshold": 0.9}}
    variants = parse_variants("dflash,adaflash,adaflash:fixed,adaflash:tight", per)
    assert list(variants) == ["ar", "dflash", "adaflash", "adaflash:fixed", "adaflash:tight"]
    assert variants["adaflash:fixed"] == ("adaflash", {"rate": 0.5, "rule": "fixed"})
    assert variants["adaflash:tight"] == ("adaflash", {"rate": 0.5, "rule": "confidence", "threshold": 0.9})
    with pytest.raises(UnbatchableMethodError):
        parse_variants("ar,pld", {})


def test_bench_sweeps_batch_sizes(tiny_targets, tiny_dirs, tmp_path, capsys):
    target = tiny_targets["qwen3"]
    folder = tmp_path / "drafter"
    save_drafter(random_drafter(target, block=4, feature_layers=(1,)), folder)
    out = tmp_path / "batch.json"
    code = main(["bench", "--model", str(tiny_dirs["qwen3"]), "--methods", "ar,dflash,adaflash:fixed",
                 "--batch-sizes", "1,3", "--domains", "math,code", "--prompts-per-domain", "1",
                 "--max-new-tokens", "6", "--repeats", "2", "--drafter", str(folder), "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "batch 1 |" in printed and "batch 3 |" in printed and "adaflash:fixed" in printed
    data = json.loads(out.read_text())
    assert data["batch_sizes"] == [1, 3]
    for rows in data["results"].values():
        assert [r["method"] for r in rows] == ["ar", "dflash", "adaflash:fixed"]
        assert all(r["identical_to_ar"] for r in rows) and all(r["samples"] == 2 for r in rows)
    assert {len(s["outputs"]) for s in data["samples"]} == {1, 3}


def test_bench_batch_variant_runs_its_own_drafter(tiny_targets, tiny_dirs, tmp_path):
    wide, narrow = tmp_path / "wide", tmp_path / "narrow"
    save_drafter(random_drafter(tiny_targets["qwen3"], block=4, feature_layers=(1,)), wide)
    save_drafter(random_drafter(tiny_targets["qwen3"], seed=1, block=2, feature_layers=(1,)), narrow)
    out = tmp_path / "batch.json"
    code = main(["bench", "--model", str(tiny_dirs["qwen3"]), "--methods", "ar,dflash,dflash:narrow",
                 "-o", f"dflash:narrow.drafter={narrow}", "--batch-sizes", "2", "--domains", "code",
                 "--prompts-per-domain", "2", "--max-new-tokens", "6", "--repeats", "1", "--drafter", str(wide),
                 "--out", str(out)])
    assert code == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]["2"]}
    assert rows["dflash"]["identical_to_ar"] and rows["dflash:narrow"]["identical_to_ar"]
    # block 2 verifies 2 tokens a row a step, block 4 verifies 4: the variant ran its own drafter
    assert rows["dflash:narrow"]["verified_per_committed"] < rows["dflash"]["verified_per_committed"]
