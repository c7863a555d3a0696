"""DFlash 2 training from a DFlash drafter, on a tiny target and a tiny harvest: the converted
drafter starts exactly where DFlash is, the teacher-forced selector scores are the inference
lattice's, the losses fall, a run resumes sample for sample, and the export decodes losslessly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import specflash
from specflash.drafters import build_drafter
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.drafters.dflash2 import DFlash2Config, DFlash2EngineDrafter
from specflash.metrics import decode_steps
from specflash.models.dflash import loss_weights
from specflash.models.dflash2 import DFlash2Drafter, from_dflash
from specflash.models.dflash_io import load_drafter, new_drafter, save_drafter
from specflash.training import dflash2, evaluate_dflash2, harvest
from specflash.training.dflash2_objective import combine, sequence_terms, teacher_forced_scores
from specflash.training.draft_vocab import frequent_tokens
from specflash.training.dflash_objective import block_forward, make_sequence, sample_anchors
from test_dflash import make_spec, random_drafter

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick brown"]
SHAPE = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=6)
DRAFT_VOCAB = 40  # the most frequent target tokens of the tiny harvest


def dflash_drafter(target, draft_ids: torch.Tensor):
    """A random DFlash drafter (block 8, one layer, feature layer 1) with a draft vocabulary."""
    model = new_drafter(make_spec(target, layers=1, block=8, feature_layers=(1,)), target, draft_ids)
    model.init_weights(torch.Generator().manual_seed(3), std=0.2)
    return model.eval()


def convert(model, seed: int = 0) -> DFlash2Drafter:
    return from_dflash(model, torch.Generator().manual_seed(seed), **SHAPE)


@pytest.fixture(scope="module")
def setup(tiny_dirs, tiny_targets, tmp_path_factory):
    """The tiny qwen3 target, a saved DFlash drafter, and a tiny harvest of 8 greedy answers."""
    tmp = tmp_path_factory.mktemp("dflash2-train")
    target = tiny_targets["qwen3"]
    argv = ["--model", str(tiny_dirs["qwen3"]), "--out", str(tmp / "data"), "--sources", "prompts,arithmetic",
            "--layers", "0,1", "--max-new-tokens", "16", "--batch-size", "4", "--shard-size", "4", "--per-source", "5",
            "--limit", "8"]
    harvest.harvest(harvest.parse_args(argv))
    draft_ids = frequent_tokens([tmp / "data" / "shard-00000.safetensors"], DRAFT_VOCAB, target.vocab_size)
    save_drafter(dflash_drafter(target, draft_ids), tmp / "dflash", dtype=torch.float32)
    return tmp, target, tiny_dirs["qwen3"]


def start(setup):
    """The saved DFlash drafter, loaded."""
    return load_drafter(setup[0] / "dflash", setup[1])


def test_identity_start_drafts_what_dflash_drafts(setup):
    _, target, _ = setup
    dflash = start(setup)
    engines = [DFlashEngineDrafter(dflash, DFlashConfig(gate=False, tree=False)),
               DFlash2EngineDrafter(convert(dflash).eval(), DFlash2Config(gate=False, tree=False))]
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        runs = [specflash.generate(target, ids, e.name, drafter=e, max_new_tokens=24, stop_on_eos=False)
                for e in engines]
        assert [s.tokens for s in runs[0].steps] == [s.tokens for s in runs[1].steps]
        assert runs[0].output_ids == runs[1].output_ids


def _batch(setup, n=2):
    """The first n harvested sequences with their stored features."""
    tmp, target, _ = setup
    from specflash.training.data import read_shard
    from specflash.training.dflash_features import harvested_features

    shard = tmp / "data" / "shard-00000.safetensors"
    samples = read_shard(shard)
    feats = harvested_features(shard, (1,), len(samples))
    return [(make_sequence(s.token_ids, s.prompt_len, s.labels), f.float()) for s, f in zip(samples[:n], feats)]


def test_teacher_forced_scores_are_the_lattice_rows(setup):
    """The training scores S_k(label predecessor, .) are rows of the lattice inference walks."""
    _, target, _ = setup
    model = convert(start(setup))
    with torch.no_grad():
        model.candidate_selector.hidden_projection.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        seq, feats = _batch(setup, 1)[0]
        anchor = seq.first_anchor
        hidden = block_forward(model, seq, feats, torch.tensor([anchor]))[0, 1:]  # [T, H]
        lattice = model.lattice(hidden, anchor=int(seq.tokens[anchor]))
        labels = seq.next_ids[anchor : anchor + len(hidden)]
        predecessors = torch.cat([seq.tokens[anchor : anchor + 1], labels[:-1]])
        rows = teacher_forced_scores(model.candidate_selector, hidden, predecessors, lattice.candidates, lattice.unary)
    for t in range(len(labels)):
        previous = (lattice.candidates[t - 1] == labels[t - 1]).nonzero() if t else torch.tensor([[0]])
        if len(previous):  # the label predecessor is one of the lattice's rows
            torch.testing.assert_close(rows[t], lattice.scores[t, int(previous[0, 0])], rtol=1e-5, atol=1e-5)


def _fit(model, batch, train: str, steps: int, lr: float) -> list[dict]:
    """`steps` AdamW steps of `train` (dflash2.trainable_groups) on a fixed batch: the figures per step."""
    opt = torch.optim.AdamW(dflash2.trainable_groups(model, train, lr, lr / 10))
    anchors = [sample_anchors(seq, 16, torch.Generator().manual_seed(0)) for seq, _ in batch]
    unary_weight, history = (0.0 if train == "selector" else 1.0), []
    for _ in range(steps):
        terms = [sequence_terms(model, seq, f, a, loss_weights(8, 4.0), unary_weight, train != "selector")
                 for (seq, f), a in zip(batch, anchors)]
        loss, stats = combine(terms, unary_weight)
        history.append(stats)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return history


def test_losses_fall_on_a_fixed_batch(setup):
    batch = _batch(setup)
    before = {k: v.clone() for k, v in start(setup).state_dict().items()}
    selector = from_dflash(start(setup), torch.Generator().manual_seed(0), codebook_std=0.5, **SHAPE)
    history = _fit(selector, batch, "selector", 15, 1e-2)  # fixed candidates: only the selector moves
    assert history[0]["tau_selector"] == history[0]["tau_unary"] <= history[0]["tau_oracle"]  # identity start
    assert history[-1]["selector_loss"] < 0.5 * history[0]["selector_loss"]
    assert history[-1]["tau_selector"] > history[0]["tau_selector"] and history[-1]["tau_unary"] == history[0]["tau_unary"]
    convs = convert(start(setup))
    history = _fit(convs, batch, "convs", 8, 3e-3)
    assert history[-1]["loss"] < 0.9 * history[0]["loss"]
    assert all(torch.equal(before[k], v) for k, v in convs.state_dict().items() if k in before)  # DFlash frozen


def _train(setup, out, steps, *extra):
    tmp, _, model_dir = setup
    argv = ["--model", str(model_dir), "--data", str(tmp / "data"), "--init-from", str(tmp / "dflash"),
            "--out", str(out), "--steps", str(steps), "--epochs", "9", "--anchors", "8", "--seqs-per-step", "2",
            "--save-every", "1", "--log-every", "1", "--lr", "3e-3", "--no-feature-cache",
            *[f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()], *extra]
    assert dflash2.main(argv) == 0


def test_training_resumes_and_exports_a_lossless_drafter(setup, tmp_path, monkeypatch):
    _, target, _ = setup
    _train(setup, tmp_path / "straight", 6)
    finished = dflash2.TrainLoop.finished
    with monkeypatch.context() as patch:  # stopped after step 3, as --minutes would stop it
        patch.setattr(dflash2.TrainLoop, "finished", lambda run: finished(run) or run.progress.step >= 3)
        _train(setup, tmp_path / "resumed", 6)
    _train(setup, tmp_path / "resumed", 6)  # the same command again: resumes at step 3
    straight, resumed = (load_file(str(tmp_path / d / "checkpoint" / "model.safetensors")) for d in ("straight", "resumed"))
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    log = [json.loads(line) for line in (tmp_path / "resumed" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    start = load_file(str(setup[0] / "dflash" / "model.safetensors"))
    assert all(torch.equal(start[k], resumed[k]) for k in start)  # --train convs: DFlash weights frozen

    export = tmp_path / "straight" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["dflash_config"]["selector_top_k"] == 6 and (export / "d2t.safetensors").is_file()
    drafter = build_drafter("dflash2", target, {"gate": False}, str(export))
    assert isinstance(drafter.model, DFlash2Drafter) and drafter.model.draft_ids is not None
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        ar = specflash.generate(target, ids, "ar", max_new_tokens=20, stop_on_eos=False)
        run = specflash.generate(target, ids, "dflash2", drafter=str(export), options={"gate": False},
                                 max_new_tokens=20, stop_on_eos=False)
        assert run.output_ids == ar.output_ids


def test_dflash_trainer_resumes_where_it_stopped(setup, tmp_path, monkeypatch):
    """The DFlash trainer runs the same loop: stopped after step 3 and resumed, it ends with the
    weights of a run that never stopped, and logs every step once."""
    from specflash.training import dflash

    tmp, target, model_dir = setup

    def train(out):
        argv = ["--model", str(model_dir), "--data", str(tmp / "data"), "--draft-vocab", str(DRAFT_VOCAB),
                "--out", str(out), "--steps", "6", "--epochs", "9", "--anchors", "8", "--seqs-per-step", "2",
                "--save-every", "1", "--log-every", "1", "--lr", "3e-3", "--no-feature-cache", "--target-layer-ids", "1"]
        assert dflash.main(argv) == 0

    train(tmp_path / "straight")
    finished = dflash.TrainLoop.finished
    with monkeypatch.context() as patch:
        patch.setattr(dflash.TrainLoop, "finished", lambda run: finished(run) or run.progress.step >= 3)
        train(tmp_path / "resumed")
    train(tmp_path / "resumed")
    straight, resumed = (load_file(str(tmp_path / d / "checkpoint" / "model.safetensors")) for d in ("straight", "resumed"))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    log = [json.loads(line) for line in (tmp_path / "resumed" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6] and all(r["loss"] > 0 for r in log)
    assert log == [json.loads(line) | {"seconds": r["seconds"]} for line, r in
                   zip((tmp_path / "straight" / "log.jsonl").read_text().splitlines(), log)]  # the same losses
    assert (tmp_path / "resumed" / "export" / "d2t.safetensors").is_file()


def test_resume_refuses_another_shape(setup, tmp_path, capsys):
    _train(setup, tmp_path / "run", 1)
    tmp, _, model_dir = setup
    argv = ["--model", str(model_dir), "--data", str(tmp / "data"), "--init-from", str(tmp / "dflash"),
            "--out", str(tmp_path / "run"), "--steps", "2", "--selector-rank", "4"]
    assert dflash2.main(argv) == 2
    assert "selector_rank" in capsys.readouterr().err


def test_evaluation_reports_headroom_and_is_lossless(setup):
    tmp, target, _ = setup
    drafters = evaluate_dflash2.engines(target, str(tmp / "dflash"), [str(tmp / "dflash")], ["start"])
    result = evaluate_dflash2.evaluate(target, drafters, ["code"], per_domain=1, max_new_tokens=12)
    assert result["greedy_outputs_equal_ar"]
    greedy = result["acceptance"]
    assert greedy["dflash"]["0.0"] == greedy["start"]["0.0"]  # the identity start is DFlash
    room = result["headroom"]["start"]
    assert room["walk_acceptance"] == room["unary_acceptance_same_steps"] <= room["oracle_acceptance"]
    assert all(0 <= x <= 1 for x in room["in_top_k_by_slot"])
    assert "oracle τ" in evaluate_dflash2.format_report(result)
    run = specflash.generate(target, target.tokenizer(PROMPTS[0]).input_ids, "dflash2", drafter=drafters["start"],
                             max_new_tokens=12)
    full = run.prompt_ids + run.output_ids  # headroom reads slot t's target token at context_len + t
    assert all(s.committed == full[s.context_len : s.context_len + len(s.committed)] for s in decode_steps(run))


def test_dflash_trainer_grows_a_shallower_drafter(setup, tmp_path):
    """`--layers 2 --init-from` a one-layer drafter: the new layer starts with zeroed output
    projections (copying the target's next layer where the shapes allow), so before any step the grown drafter's block states equal the
    shallow one's; one step later it trains and exports a lossless two-layer drafter."""
    from specflash.training import dflash
    from specflash.training.dflash_init import grow_from, source_layers

    tmp, target, model_dir = setup
    cfg = target.config
    like_target = dict(block=8, feature_layers=(1,), num_heads=cfg.num_attention_heads,
                       num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                       intermediate_size=cfg.intermediate_size)
    shallow = random_drafter(target, seed=2, layers=1, **like_target).eval()
    grown = new_drafter(make_spec(target, layers=2, **like_target), target).eval()
    (copied,) = grow_from(grown, shallow.state_dict(), target, "tiny")
    assert copied == source_layers(grown, target.num_layers)[1]
    assert torch.equal(grown.layers[1].self_attn.q_proj.weight, target.layers[copied].self_attn.q_proj.weight.float())
    assert not grown.layers[1].self_attn.o_proj.weight.any() and not grown.layers[1].mlp.down_proj.weight.any()
    generator = torch.Generator().manual_seed(0)
    block = torch.randint(0, target.vocab_size, (1, 8), generator=generator)
    features = torch.randn(1, 5, target.hidden_size, generator=generator)
    args = (block, torch.arange(5, 13)[None], features, torch.arange(5)[None])
    with torch.no_grad():
        assert torch.allclose(grown(*args), shallow(*args), atol=1e-6)

    def train(out, *extra):
        argv = ["--model", str(model_dir), "--data", str(tmp / "data"), "--target-layer-ids", "1", "--out", str(out),
                "--steps", "1", "--epochs", "9", "--anchors", "8", "--seqs-per-step", "2", "--no-feature-cache", *extra]
        assert dflash.main(argv) == 0

    train(tmp_path / "one", "--draft-vocab", str(DRAFT_VOCAB))
    train(tmp_path / "grow", "--layers", "2", "--init-from", str(tmp_path / "one" / "export"))
    export = tmp_path / "grow" / "export"
    assert json.loads((export / "config.json").read_text())["num_hidden_layers"] == 2
    # continuing it takes its shape from its config; a flag given still wins
    base = ["--model", str(model_dir), "--data", str(tmp / "data"), "--init-from", str(export)]
    adopted = dflash.parse_args(base)
    assert (adopted.layers, adopted.target_layer_ids, adopted.block_size) == (2, [1], 8)
    assert dflash.parse_args([*base, "--layers", "3", "--feature-layers", "2"]).layers == 3
    assert dflash.parse_args([*base, "--feature-layers", "2"]).target_layer_ids is None
    assert dflash.parse_args(base[:4]).layers == 1  # no drafter to start from: the defaults
    train(tmp_path / "again", "--init-from", str(export))  # no --layers: it had failed on the shape
    assert json.loads((tmp_path / "again" / "export" / "config.json").read_text())["num_hidden_layers"] == 2
    ids = target.tokenizer(PROMPTS[0]).input_ids
    ar = specflash.generate(target, ids, "ar", max_new_tokens=16, stop_on_eos=False)
    run = specflash.generate(target, ids, "dflash", drafter=str(export), options={"gate": False},
                             max_new_tokens=16, stop_on_eos=False)
    assert run.output_ids == ar.output_ids


def test_dflash_trainer_retrains_a_drafter_at_another_block_size(setup, tmp_path):
    """`--init-from` a block-8 drafter with `--block-size 4`: the block size shapes no weight, so
    the weights carry over unchanged (one step at learning rate 0), the export is a block-4 drafter that decodes
    losslessly; resuming a run's own checkpoint at another block size is still refused."""
    from specflash.training import dflash

    tmp, target, model_dir = setup

    def train(out, *extra):
        argv = ["--model", str(model_dir), "--data", str(tmp / "data"), "--target-layer-ids", "1", "--out", str(out),
                "--epochs", "9", "--anchors", "8", "--seqs-per-step", "2", "--no-feature-cache", *extra]
        return dflash.main(argv)

    assert train(tmp_path / "eight", "--steps", "1", "--draft-vocab", str(DRAFT_VOCAB)) == 0
    source = tmp_path / "eight" / "export"
    assert train(tmp_path / "four", "--steps", "1", "--lr", "0", "--block-size", "4", "--init-from", str(source)) == 0
    export = tmp_path / "four" / "export"
    assert json.loads((source / "config.json").read_text())["block_size"] == 8
    assert json.loads((export / "config.json").read_text())["block_size"] == 4
    before, after = load_file(str(source / "model.safetensors")), load_file(str(export / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    ids = target.tokenizer(PROMPTS[0]).input_ids
    ar = specflash.generate(target, ids, "ar", max_new_tokens=16, stop_on_eos=False)
    run = specflash.generate(target, ids, "dflash", drafter=str(export), options={"gate": False},
                             max_new_tokens=16, stop_on_eos=False)
    assert run.output_ids == ar.output_ids
    assert max(len(s.tokens) for s in decode_steps(run)) == 3
    assert train(tmp_path / "eight", "--steps", "2", "--block-size", "4") == 2


def test_drafter_starts_from_the_targets_next_layers(setup):
    """`--init target`: each draft layer is a copy of the target layer after the deepest feature
    layer, `fc` passes that layer's features through (plus a tenth of its random start), and a
    drafter whose shapes differ from the target's is refused by name."""
    from specflash.training.dflash_init import init_from_target, source_layers

    _, target, _ = setup
    cfg = target.config
    like_target = dict(block=8, feature_layers=(0,), num_heads=cfg.num_attention_heads,
                       num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                       intermediate_size=cfg.intermediate_size)
    model = new_drafter(make_spec(target, layers=1, **like_target), target)
    before = model.fc.weight.detach().clone()
    assert init_from_target(model, target) == source_layers(model, target.num_layers) == [1]
    source = target.layers[1]
    for block, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            assert torch.equal(getattr(getattr(model.layers[0], block), name).weight,
                               getattr(getattr(source, block), name).weight.float())
    assert torch.equal(model.layers[0].input_layernorm.weight, source.input_layernorm.weight.float())
    assert torch.equal(model.hidden_norm.weight, source.input_layernorm.weight.float())
    h = target.hidden_size
    assert torch.allclose(model.fc.weight, 0.1 * before + torch.eye(h))

    narrow = new_drafter(make_spec(target, layers=1, **{**like_target, "intermediate_size": 24}), target)
    with pytest.raises(ValueError, match=r"layer 1 mlp.gate_proj has shape"):
        init_from_target(narrow, target)


def test_held_out_shards_are_never_trained_on_and_feed_the_length_head(setup, tmp_path, monkeypatch):
    """`--hold-out`: the loop never opens the shard, the export records it, a run continued from
    that export inherits it, and the length head fits on exactly that unseen shard."""
    import argparse

    from specflash.training import dflash, length_head

    tmp, _, model_dir = setup
    opened = []
    train_shard = dflash.TrainLoop._train_shard
    monkeypatch.setattr(dflash.TrainLoop, "_train_shard", lambda run, shard: opened.append(shard.name) or
                        train_shard(run, shard))

    def train(out, *extra):
        argv = ["--model", str(model_dir), "--data", str(tmp / "data"), "--target-layer-ids", "1", "--out", str(out),
                "--steps", "6", "--epochs", "9", "--anchors", "8", "--seqs-per-step", "2", "--no-feature-cache", *extra]
        assert dflash.main(argv) == 0
        return json.loads((out / "export" / "config.json").read_text())["specflash_training"]

    held = "shard-00001.safetensors"
    assert train(tmp_path / "first", "--draft-vocab", str(DRAFT_VOCAB), "--hold-out", held)["held_out"] == [held]
    assert opened and set(opened) == {"shard-00000.safetensors"}  # 6 steps: more than one epoch of shard 0
    assert train(tmp_path / "next", "--init-from", str(tmp_path / "first" / "export"))["held_out"] == [held]
    args = argparse.Namespace(data=[tmp / "data"], drafter=str(tmp_path / "next" / "export"), max_shards=None)
    shards, unseen = length_head.pick_shards(args)
    assert [p.name for p in shards] == [held] and unseen
    args.drafter = str(tmp / "dflash")  # trained without a hold-out: the first shards, flagged as seen
    assert [p.name for p in length_head.pick_shards(args)[0]] == ["shard-00000.safetensors", held]
    assert not length_head.pick_shards(args)[1]


def test_steps_set_the_run_length_unless_epochs_are_given(setup, tmp_path):
    """8 answers at 2 per step make a 4-step pass: `--steps 6` alone runs all 6 steps (its schedule
    is sized for 6), and an explicit `--epochs 1` still stops it after the pass."""
    from specflash.training import dflash

    tmp, _, model_dir = setup

    def steps_run(out, *extra):
        argv = ["--model", str(model_dir), "--data", str(tmp / "data"), "--target-layer-ids", "1", "--out", str(out),
                "--steps", "6", "--anchors", "8", "--seqs-per-step", "2", "--no-feature-cache", *extra]
        assert dflash.main(argv) == 0
        return json.loads((out / "export" / "config.json").read_text())["specflash_training"]["steps"]

    assert steps_run(tmp_path / "by-steps") == 6
    assert steps_run(tmp_path / "one-pass", "--epochs", "1") == 4
