"""The benchmark's arithmetic: paired speedups, pooled acceptance, identical-output check; and
the PTD sweep (specflash.bench_ptd) on a tiny model."""

from __future__ import annotations

import pytest

from specflash import bench_ptd
from specflash.bench import Sample, format_table, summarize_samples


def _s(method, prompt, repeat, wall, out, steps=None, mal=None, vpc=None, lookup=0):
    metrics = {} if steps is None else {"decode_steps": steps, "mean_acceptance_length": mal, "verified_per_committed": vpc,
                                        "lookup_steps": lookup}
    return Sample(method, "code", prompt, repeat, wall, len(out), out, metrics)


def test_summary_rows():
    samples = [
        _s("ar", "a", 0, 2.0, [1, 2, 3, 4], 4, 1.0, 1.0),
        _s("pld", "a", 0, 1.0, [1, 2, 3, 4], 2, 2.0, 2.0),
        _s("ar", "b", 0, 4.0, [5, 6], 2, 1.0, 1.0),
        _s("pld", "b", 0, 1.0, [5, 7], 1, 2.0, 1.5),
        _s("hf-pld", "a", 0, 4.0, [1, 2, 3, 4]),
        _s("dflash", "a", 0, 1.0, [1, 2, 3, 4], 2, 2.0, 1.5, lookup=1),
        _s("dflash", "b", 0, 2.0, [5, 6], 2, 1.0, 1.0, lookup=0),
    ]
    rows = {r["method"]: r for r in summarize_samples(samples, ["ar", "pld", "hf-pld", "dflash"])}
    assert rows["dflash"]["lookup_step_share"] == 0.25  # 1 of 4 decode steps drafted by prompt lookup
    assert rows["pld"]["lookup_step_share"] is None and "   25%     2.00" in format_table(list(rows.values()), "cpu")
    assert rows["ar"]["speedup"] == 1.0
    assert rows["pld"]["speedup"] == 3.0  # median of the paired ratios 2.0 and 4.0
    assert rows["pld"]["mean_acceptance_length"] == 2.0  # 6 tokens over 3 steps
    assert rows["pld"]["verified_per_committed"] == (2 * 2 * 2.0 + 1.5 * 2 * 1) / 6
    assert rows["pld"]["identical_to_ar"] is False
    assert rows["hf-pld"]["identical_to_ar"] is True and rows["hf-pld"]["mean_acceptance_length"] is None
    assert list(rows) == ["ar", "pld", "hf-pld", "dflash"]


def test_ptd_sweep_gives_one_lossless_row_per_shape(tiny_targets, capsys):
    target = tiny_targets["qwen3"]
    prompts = {"count": target.tokenizer("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,").input_ids}
    shapes = [(4, 0, 0, 3, 2), (8, 4, 2, 2, 2)]
    rows = bench_ptd.sweep(target, prompts, shapes, 8)
    assert len(rows) == len(shapes) and all(r.items() >= bench_ptd.options_of(s).items() for r, s in zip(rows, shapes))
    assert all(r["identical_to_ar"] and r["mean_acceptance_length"] >= 1.0 for r in rows)
    assert rows[0]["lookahead_per_forward"] == 0.0 < rows[1]["lookahead_per_forward"]
    assert capsys.readouterr().out.splitlines() == [bench_ptd.format_row(r) for r in rows]


def test_bench_runs_labelled_variants_with_their_own_knobs(tiny_targets, tiny_dirs, tmp_path, capsys):
    import json

    from specflash.cli import main
    from specflash.models.dflash_io import save_drafter
    from test_dflash import random_drafter

    folder = tmp_path / "drafter"
    save_drafter(random_drafter(tiny_targets["qwen3"], block=4, feature_layers=(1,)), folder)
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", str(tiny_dirs["qwen3"]), "--methods", "ar,dflash,dflash:short",
                 "-o", "dflash.gate=false", "-o", "dflash:short.max_draft=1", "--domains", "code",
                 "--prompts-per-domain", "1", "--max-new-tokens", "6", "--repeats", "1", "--drafter", str(folder),
                 "--compare", "dflash/short:dflash", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "dflash:short" in printed and "dflash:short vs dflash" in printed
    data = json.loads(out.read_text())
    assert data["prompt_set"] == "heldout"
    assert data["options"] == {"dflash": {"gate": False}, "dflash:short": {"gate": False, "max_draft": 1}}
    rows = {r["method"]: r for r in data["rows"]}
    assert all(r["identical_to_ar"] for r in rows.values())
    # max_draft=1 reached the variant's drafter: it verifies 2 tokens a step where dflash verifies 4
    assert rows["dflash:short"]["verified_per_committed"] < rows["dflash"]["verified_per_committed"]
    compared = data["comparisons"][0]  # over every prompt, then the one domain
    assert (compared["a"], compared["b"], compared["domain"], compared["prompts"]) == ("dflash:short", "dflash", "all", 1)
    assert main(["bench", "--model", str(tiny_dirs["qwen3"]), "--methods", "ar,dflash", "--compare", "dels:dflash",
                 "--out", str(tmp_path / "never.json")]) == 2
    assert "--compare names dels, which this run does not bench" in capsys.readouterr().err
    assert not (tmp_path / "never.json").exists()


def test_a_variant_with_its_own_drafter_runs_it_beside_the_default_one(tiny_targets, tiny_dirs, tmp_path, capsys):
    import json

    from specflash.cli import main
    from specflash.models.dflash_io import save_drafter
    from test_dflash import random_drafter

    wide, narrow = tmp_path / "wide", tmp_path / "narrow"
    save_drafter(random_drafter(tiny_targets["qwen3"], block=4, feature_layers=(1,)), wide)
    save_drafter(random_drafter(tiny_targets["qwen3"], seed=1, block=2, feature_layers=(1,)), narrow)
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", str(tiny_dirs["qwen3"]), "--methods", "ar,dflash,dflash:narrow",
                 "-o", "dflash.gate=false", "-o", "dflash.tree=false", "-o", f"dflash:narrow.drafter={narrow}",
                 "--domains", "code", "--prompts-per-domain", "1", "--max-new-tokens", "6", "--repeats", "1",
                 "--drafter", str(wide), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["weights"]["dflash"]["drafter"]["weights"] != data["weights"]["dflash:narrow"]["drafter"]["weights"]
    assert data["options"]["dflash:narrow"]["drafter"] == str(narrow)
    rows = {r["method"]: r for r in data["rows"]}
    assert all(r["identical_to_ar"] for r in rows.values())
    # a chain of block 2 verifies at most 2 tokens a step, block 4's 4: each variant ran its own drafter
    assert rows["dflash:narrow"]["verified_per_committed"] < rows["dflash"]["verified_per_committed"]
    assert main(["bench", "--model", str(tiny_dirs["qwen3"]), "--methods", "ar,pld:x", "-o", f"pld:x.drafter={narrow}",
                 "--out", str(tmp_path / "never.json")]) == 2
    assert "method 'pld' runs no drafter" in capsys.readouterr().err and not (tmp_path / "never.json").exists()


def test_bench_builds_each_drafter_once_outside_the_timed_samples(tiny_targets, tiny_dirs, tmp_path, monkeypatch):
    from specflash import api, drafters
    from specflash.cli import main
    from specflash.models.dflash_io import save_drafter
    from test_dflash import random_drafter

    built = []
    real = drafters.build_drafter
    counted = lambda name, *a, **k: built.append(name) or real(name, *a, **k)  # noqa: E731
    for module in (drafters, api):  # the bench's own builds and any a request would make
        monkeypatch.setattr(module, "build_drafter", counted)
    folder = tmp_path / "drafter"
    save_drafter(random_drafter(tiny_targets["qwen3"], block=4, feature_layers=(1,)), folder)
    code = main(["bench", "--model", str(tiny_dirs["qwen3"]), "--methods", "ar,dflash,adaflash", "--domains", "code",
                 "--prompts-per-domain", "2", "--max-new-tokens", "6", "--repeats", "2", "--drafter", str(folder),
                 "--out", str(tmp_path / "bench.json")])
    assert code == 0
    assert sorted(built) == ["adaflash", "ar", "dflash"]  # one each, for a warm-up and 4 timed samples


def test_bench_tuning_prompts_come_from_the_tuning_requests(monkeypatch, tmp_path):
    from specflash import bench
    from specflash.training import harvest
    from specflash.training.sources import Job

    def fake(per_domain, cache):
        return [Job(f"{d}-{i}", d, "src", f"{d} request {i}") for d in ("code", "math") for i in range(per_domain)]

    monkeypatch.setattr(harvest, "tuning_jobs", fake)
    assert bench.bench_prompts("tuning", ["math"], 2, tmp_path) == [("math", "math-0", "math request 0"),
                                                                    ("math", "math-1", "math request 1")]


def test_the_json_names_the_weights_each_method_ran(tmp_path):
    import hashlib

    from specflash.bench import measured_weights
    from specflash.models.presets import REPO_ROOT, weights_fingerprint

    drafter = REPO_ROOT / "assets" / "drafters" / "smollm2-135m-dflash"
    head = REPO_ROOT / "assets" / "heads" / "smollm2-135m-local-head"

    def digest(folder):
        h = hashlib.sha256()
        for f in sorted(folder.glob("*.safetensors")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
        return h.hexdigest()[:16]

    recorded = measured_weights("smollm2-135m", "dels", str(drafter), {"datastore": False}, None)
    assert recorded == {"drafter": {"path": "assets/drafters/smollm2-135m-dflash", "weights": digest(drafter)},
                        "local_head": {"path": "assets/heads/smollm2-135m-local-head", "weights": digest(head)}}
    with_store = measured_weights("smollm2-135m", "dflash", str(drafter), {}, None)
    assert list(with_store) == ["drafter", "datastore"]
    assert with_store["datastore"]["path"] == "data/harvests/smollm2-135m-instruct"
    assert list(measured_weights("smollm2-135m", "dflash", str(drafter), {"tree": False}, None)) == ["drafter"]
    assert measured_weights("some/path", "pld", None, {}, None) == {}
    assert measured_weights("smollm2-135m", "dflash", str(tmp_path), {"datastore": False}, None) == {}  # none there
    # a folder's digest covers its subfolders' files, each named by its path inside it
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.safetensors").write_bytes(b"1")
    first = weights_fingerprint(tmp_path)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.safetensors").write_bytes(b"1")
    assert first is not None and weights_fingerprint(tmp_path) != first


def test_a_pair_with_a_skipped_row_is_left_out_and_the_run_still_written(tiny_dirs, tmp_path, capsys):
    import json

    from specflash.cli import main

    out = tmp_path / "bench.json"
    code = main(["bench", "--model", str(tiny_dirs["qwen3"]), "--methods", "ar,hf-assisted,pld", "--domains", "code",
                 "--prompts-per-domain", "1", "--max-new-tokens", "4", "--repeats", "1",
                 "--compare", "hf-assisted:ar,pld:ar", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "skipping hf-assisted" in printed
    compared = json.loads(out.read_text())["comparisons"]
    assert {(c["a"], c["b"]) for c in compared} == {("pld", "ar")}


def test_own_drafter_goes_to_methods_that_run_one_and_only_those():
    from specflash.bench import own_drafter
    from specflash.errors import MethodConfigError

    assert own_drafter("hf-assisted", {"drafter": "D", "x": 1}) == ("D", {"x": 1})
    assert own_drafter("dflash", {"drafter": "D", "gate": False}) == ("D", {"gate": False})
    assert own_drafter("pld", {"k": 3}) == (None, {"k": 3})
    for method in ("hf-pld", "pld", "ar"):
        with pytest.raises(MethodConfigError, match=f"method '{method}' runs no drafter"):
            own_drafter(method, {"drafter": "D"})
