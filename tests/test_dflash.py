"""DFlash: lossless decoding with random drafters, checkpoint IO, cache rollback, masks, training."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import LOSSLESS_ARCHS, hf_greedy
from specflash.api import generate
from specflash.config import SamplingConfig
from specflash.drafters.adaflash import AdaFlashConfig
from specflash.drafters.dels import DeLSConfig
from specflash.drafters.dflash2 import DFlash2Config
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter, build, candidate_tree, drafter_folder
from specflash.errors import CheckpointError, DrafterMismatchError, MethodConfigError
from specflash.models.dflash import (
    DFlashCache,
    DFlashSpec,
    block_inputs,
    default_target_layers,
    loss_weights,
    training_block_mask,
)
from specflash.models.dflash_io import load_drafter, new_drafter, pick_mask_token, save_drafter
from specflash.tree import DraftTree
from specflash.training.dflash_objective import (
    acceptance_weights,
    block_labels,
    make_sequence,
    sample_anchors,
    sequence_loss,
)

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick brown", "What is 12 * 7?"]
# (architecture, draft layers, block size, target feature layers)
SHAPES = [("llama", 1, 4, (1,)), ("qwen3", 2, 8, (0, 1, 1)), ("qwen2", 1, 16, (1, 0, 1)), ("llama", 2, 16, (0,))]


def make_spec(target, layers=1, block=8, feature_layers=(1,), **overrides) -> DFlashSpec:
    cfg = target.config
    fields = dict(
        hidden_size=target.hidden_size, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=target.vocab_size, block_size=block, num_target_layers=target.num_layers,
        target_layer_ids=tuple(feature_layers), mask_token_id=pick_mask_token(target.tokenizer),
        rope_theta=float(cfg.rope_parameters["rope_theta"]),
    )
    return DFlashSpec(**{**fields, **overrides})


def random_drafter(target, seed=0, std=0.2, **shape):
    model = new_drafter(make_spec(target, **shape), target)
    model.init_weights(torch.Generator().manual_seed(seed), std=std)
    return model.eval()


def test_default_target_layers_follow_z_lab():
    assert default_target_layers(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layers(28, 5) == (1, 7, 13, 19, 25)
    assert default_target_layers(30, 1) == (14,)


@pytest.mark.parametrize("arch,layers,block,features", SHAPES)
def test_greedy_equals_transformers(tiny_targets, arch, layers, block, features):
    target = tiny_targets[arch]
    drafter = DFlashEngineDrafter(random_drafter(target, layers=layers, block=block, feature_layers=features),
                                  DFlashConfig(gate=False))
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt).input_ids
        run = generate(target, ids, "dflash", drafter=drafter, max_new_tokens=37, stop_on_eos=False)
        assert run.output_ids == hf_greedy(target, ids, 37)
        step = run.steps[1]
        assert step.q is not None and len(step.q) == len(step.tokens) == block - 1
        assert step.extras["dflash"] == {"block_size": block}


def test_candidate_tree_takes_the_most_probable_paths():
    """Paths score the product of their slots' probabilities; the best 4 here, worked by hand:
    (a) 0.6, (a, a) 0.6 * 0.7 = 0.42, (b) 0.3, (b, a) 0.3 * 0.7 = 0.21, ahead of (a, b) 0.12."""
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.7, 0.2, 0.1]])
    tree, q = candidate_tree(probs, None, 4)
    assert tree == DraftTree((0, 0, 1, 0), (-1, 0, -1, 2))
    assert q == pytest.approx([0.6, 0.7, 0.3, 0.7])
    ids = torch.tensor([11, 12, 13])  # a draft vocabulary's columns name target ids
    assert candidate_tree(probs, ids, 2)[0] == DraftTree((11, 11), (-1, 0))
    assert candidate_tree(probs, None, 1)[0] == DraftTree((0,), (-1,))
    assert candidate_tree(probs, None, 2, width=1)[0] == DraftTree.chain([0, 0])  # one token per slot: the chain


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tree_drafts_stay_greedy_and_branch(tiny_targets, arch):
    """tree=true verifies the drafter's best paths as a tree (as many nodes as the chain had
    tokens): the output is still plain greedy decoding, and the drafts do branch."""
    target = tiny_targets[arch]
    drafter = DFlashEngineDrafter(random_drafter(target, block=5, feature_layers=(0, 1)), DFlashConfig(gate=False, tree=True))
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt).input_ids
        run = generate(target, ids, "dflash", drafter=drafter, max_new_tokens=30, stop_on_eos=False)
        assert run.output_ids == hf_greedy(target, ids, 30)
        decode = [s for s in run.steps if s.phase == "decode" and len(s.tokens) == 4]
        assert decode and any(s.parents != [-1, 0, 1, 2] for s in decode)


def test_tree_is_a_knob_of_the_methods_that_draft_trees():
    """Every DFlash-family method drafts trees by default, each scoring its paths its own way."""
    assert DFlashConfig().tree is True and DFlashConfig(tree=False).tree is False
    assert AdaFlashConfig().tree is True and DeLSConfig().tree is True and DFlash2Config().tree is True
    with pytest.raises(MethodConfigError, match="tree must be"):
        DFlashConfig(tree="yes")
    with pytest.raises(MethodConfigError, match="tree_width must be"):
        AdaFlashConfig(tree_width=0)
    with pytest.raises(MethodConfigError, match="tree_width must be"):
        DeLSConfig(tree_width=True)
    with pytest.raises(MethodConfigError, match="graft_lookup must be"):
        DFlash2Config(graft_lookup=None)


def test_greedy_with_accepted_drafts(tiny_targets):
    """A drafter trained for a few steps on the target's own greedy text accepts some tokens, so
    the commit path of the drafter cache is exercised, and output stays exactly greedy."""
    target = tiny_targets["qwen3"]
    ids = target.tokenizer(PROMPTS[0]).input_ids
    reference = hf_greedy(target, ids, 60)
    model = random_drafter(target, std=0.02, block=4, feature_layers=(0, 1)).train()
    _fit(target, model, ids + reference, len(ids), steps=60)
    run = generate(target, ids, "dflash", drafter=DFlashEngineDrafter(model.eval(), DFlashConfig(gate=False)),
                   max_new_tokens=60, stop_on_eos=False)
    assert run.output_ids == reference
    assert sum(len(s.accepted) for s in run.steps) > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_drafter_in_its_own_dtype_stays_greedy(tiny_targets, tmp_path, dtype):
    """A drafter computing in bfloat16 beside the float32 target (what "auto" picks on a CPU with
    bf16 matrix units) drafts, gets accepted, and the output is still exactly greedy."""
    target = tiny_targets["qwen3"]
    ids = target.tokenizer(PROMPTS[0]).input_ids
    reference = hf_greedy(target, ids, 60)
    model = random_drafter(target, std=0.02, block=4, feature_layers=(0, 1)).train()
    _fit(target, model, ids + reference, len(ids), steps=60)
    folder = save_drafter(model.eval(), tmp_path / "drafter", dtype=torch.float32)
    drafter = build(target, DFlashConfig(gate=False, draft_dtype=dtype), str(folder))
    assert drafter.model.compute_dtype == getattr(torch, dtype)
    assert target.dtype == torch.float32 and target.model.get_output_embeddings().weight.dtype == torch.float32
    run = generate(target, ids, "dflash", drafter=drafter, max_new_tokens=60, stop_on_eos=False)
    assert run.output_ids == reference
    assert sum(len(s.accepted) for s in run.steps) > 0
    assert all(isinstance(q, float) and 0 < q <= 1 for s in run.steps for q in s.q or [])


def test_drafter_dtype_choice(tiny_targets, monkeypatch):
    from specflash.models import dflash_io

    target = tiny_targets["llama"]
    assert target.dtype == torch.float32
    monkeypatch.setattr(dflash_io, "bf16_matrix_units", lambda: True)
    assert dflash_io.drafter_dtype(target, "auto") == torch.bfloat16
    monkeypatch.setattr(target, "row_plan", {1: "packed", 2: 2})  # the target runs the packed kernel
    assert dflash_io.drafter_dtype(target, "auto") == torch.float32  # which the drafter then shares
    monkeypatch.setattr(target, "row_plan", {})
    monkeypatch.setattr(dflash_io, "bf16_matrix_units", lambda: False)
    assert dflash_io.drafter_dtype(target, "auto") == torch.float32
    assert dflash_io.drafter_dtype(target, "target") == torch.float32
    assert dflash_io.drafter_dtype(target, "float16") == torch.float16
    assert dflash_io.drafter_dtype(target, "int8") == torch.float32  # float around int8 weights
    with pytest.raises(ValueError, match="drafter dtype"):
        dflash_io.drafter_dtype(target, "int4")
    with pytest.raises(MethodConfigError, match="draft_dtype"):
        DFlashConfig(draft_dtype="int4")


def test_int8_weights_are_taken_when_asked_for_or_auto_without_bf16_units(tiny_targets, monkeypatch):
    from specflash.models import dflash_io, int8_linear

    target = tiny_targets["llama"]
    monkeypatch.setattr(int8_linear, "available", lambda: True)
    monkeypatch.setattr(dflash_io, "bf16_matrix_units", lambda: False)
    assert dflash_io.drafter_int8(target, "int8") and dflash_io.drafter_int8(target, "auto")
    assert not any(dflash_io.drafter_int8(target, c) for c in ("target", "float32", "bfloat16"))
    monkeypatch.setattr(dflash_io, "bf16_matrix_units", lambda: True)
    assert not dflash_io.drafter_int8(target, "auto")  # bfloat16 there
    monkeypatch.setattr(int8_linear, "available", lambda: False)
    assert not dflash_io.drafter_int8(target, "auto")
    with pytest.raises(MethodConfigError, match="int8 engine"):
        dflash_io.drafter_int8(target, "int8")


def _features(target, model, token_ids):
    target.capture_layers(model.spec.target_layer_ids)
    return target.forward(token_ids, target.new_cache(), 0, last_only=True).features.clone()


def _fit(target, model, token_ids, prompt_len, steps, tau_weight=0.0):
    feats = _features(target, model, token_ids)
    seq = make_sequence(token_ids, prompt_len, None)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    weights = loss_weights(model.spec.block_size, 2.0)
    losses = []
    for i in range(steps):
        anchors = sample_anchors(seq, 16, torch.Generator().manual_seed(i))
        stats = sequence_loss(model, seq, feats, anchors, weights, tau_weight=tau_weight)
        loss = stats.loss / stats.weight
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_sampling_runs_and_is_reproducible(tiny_targets):
    target = tiny_targets["llama"]
    drafter = DFlashEngineDrafter(random_drafter(target, block=8), DFlashConfig(gate=False))
    sampling = SamplingConfig(temperature=0.8, seed=11)
    runs = [generate(target, PROMPTS[2], "dflash", drafter=drafter, sampling=sampling, max_new_tokens=30,
                     stop_on_eos=False) for _ in range(2)]
    assert runs[0].output_ids == runs[1].output_ids
    assert len(runs[0].output_ids) == 30
    assert all(0 <= t < target.vocab_size for t in runs[0].output_ids)


def test_max_len_zero_and_max_draft(tiny_targets):
    target = tiny_targets["llama"]
    drafter = DFlashEngineDrafter(random_drafter(target, block=8), DFlashConfig(gate=False, max_draft=3))
    drafter.begin([1, 2, 3], SamplingConfig(), None)
    assert drafter.propose([1, 2, 3], 0).tree.tokens == ()
    drafter.observe(_features(target, drafter.model, [1, 2]))
    assert len(drafter.propose([1, 2, 3], 10).tree.tokens) == 3
    run = generate(target, PROMPTS[0], "dflash", drafter=drafter, max_new_tokens=1)
    assert len(run.output_ids) == 1
    with pytest.raises(MethodConfigError):
        DFlashConfig(max_draft=0)


def test_cache_rollback_equals_recompute(tiny_targets):
    target = tiny_targets["qwen3"]
    model = random_drafter(target, layers=2, block=4, feature_layers=(0, 1))
    feats = torch.randn(1, 12, model.fc.in_features)
    block, block_pos = torch.tensor([[7, 4, 4, 4]]), torch.arange(10, 14)[None]

    def run(cache, lo, hi):
        return model(block, block_pos, feats[:, lo:hi], torch.arange(lo, hi)[None], None, cache)

    with torch.no_grad():
        rolled = DFlashCache(2)
        run(rolled, 0, 12)
        rolled.crop(6)
        assert len(rolled) == 6
        out_rolled = run(rolled, 6, 10)
        fresh = DFlashCache(2)
        run(fresh, 0, 3)
        out_fresh = run(fresh, 3, 10)
        out_none = run(None, 0, 10)
    torch.testing.assert_close(out_rolled, out_fresh)
    torch.testing.assert_close(out_rolled, out_none)


def test_training_block_mask_hand_built():
    mask = training_block_mask(torch.tensor([[1, 3]]), torch.tensor([[True, False]]), ctx_len=4, block_size=2)
    T, F = True, False
    expected = torch.tensor([
        # ctx 0..3        block0   block1
        [T, F, F, F, T, T, F, F],  # block 0 (anchor 1), slot 0
        [T, F, F, F, T, T, F, F],  # block 0, slot 1
        [F, F, F, F, F, F, F, F],  # block 1 is padding: sees nothing
        [F, F, F, F, F, F, F, F],
    ])
    assert mask.shape == (1, 1, 4, 8)
    assert torch.equal(mask[0, 0], expected)
    mask = training_block_mask(torch.tensor([[0, 2]]), torch.tensor([[True, True]]), ctx_len=3, block_size=2)
    assert torch.equal(mask[0, 0, 2:], torch.tensor([[T, T, F, F, F, T, T]] * 2))
    ids, pos = block_inputs(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[1, 2]]), 3, mask_id=0)
    assert ids.tolist() == [[6, 0, 0, 7, 0, 0]] and pos.tolist() == [[1, 2, 3, 2, 3, 4]]


def test_training_forward_equals_inference(tiny_targets):
    """A block under the training mask sees exactly what inference with a cache of ctx < anchor sees."""
    target = tiny_targets["llama"]
    model = random_drafter(target, layers=2, block=4)
    tokens = torch.tensor([[3, 9, 12, 20, 33, 41, 50, 61]])
    feats = torch.randn(1, 8, model.fc.in_features)
    anchors = torch.tensor([[2, 5]])
    ids, pos = block_inputs(tokens, anchors, 4, model.spec.mask_token_id)
    mask = training_block_mask(anchors, torch.ones(1, 2, dtype=torch.bool), 8, 4)
    with torch.no_grad():
        train_out = model(ids, pos, feats, torch.arange(8)[None], mask)
        for n, a in enumerate(anchors[0].tolist()):
            infer = model(ids[:, 4 * n : 4 * n + 4], pos[:, 4 * n : 4 * n + 4], feats[:, :a], torch.arange(a)[None],
                          None, DFlashCache(2))
            torch.testing.assert_close(train_out[:, 4 * n : 4 * n + 4], infer)


def test_block_labels_and_anchors():
    seq = make_sequence([10, 11, 12, 13, 14], prompt_len=2, labels=None)
    anchors = sample_anchors(seq, 10, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [2, 3]  # response positions with at least one next token
    labels, valid = block_labels(seq.next_ids, anchors, 3)
    assert labels[valid].tolist() == [13, 14, 14] and valid.tolist() == [[True, True], [True, False]]
    forced = make_sequence([10, 11, 12], prompt_len=0, labels=[20, 21, 22])
    labels, valid = block_labels(forced.next_ids, torch.tensor([0, 2]), 3)
    assert labels[valid].tolist() == [20, 21, 22]
    assert loss_weights(4, 2.0).tolist() == pytest.approx([1.0, 0.6065307, 0.3678794])


def test_acceptance_weights_give_the_gradient_of_expected_acceptance():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 4, 7, generator=g, requires_grad=True)
    labels = torch.randint(0, 7, (5, 4), generator=g)
    reachable = torch.ones(5, 4, dtype=torch.bool)
    reachable[1, 2] = False  # an undraftable label: nothing after it can be accepted
    p = logits.softmax(-1).gather(-1, labels[..., None])[..., 0] * reachable
    expected = p.cumprod(dim=1).sum()
    (want,) = torch.autograd.grad(-expected, logits)
    unscaled = float((p.cumprod(dim=1) * torch.arange(1, 5)).sum())  # sum_j W_j = sum_k k P_k: no rescaling
    w = acceptance_weights(logits, labels, reachable, total=unscaled)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(5, 4)
    (got,) = torch.autograd.grad((ce * w).sum(), logits)
    assert torch.allclose(got, want, atol=1e-6)
    assert w[1, 2:].abs().sum() == 0
    assert torch.allclose(acceptance_weights(logits, labels, reachable, total=10.0).sum(), torch.tensor(10.0))


def test_training_step_with_acceptance_weights_reduces_loss(tiny_targets):
    target = tiny_targets["llama"]
    model = random_drafter(target, std=0.02, block=4, feature_layers=(1,)).train()
    ids = target.tokenizer(PROMPTS[0]).input_ids
    losses = _fit(target, model, ids + hf_greedy(target, ids, 24), len(ids), steps=8, tau_weight=0.5)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("flag, weight", [("--tau-weight", "-0.5"), ("--tau-weight", "1.01"),
                                          ("--soft-labels", "-0.1"), ("--soft-labels", "1.5")])
def test_loss_weights_outside_zero_to_one_are_refused(flag, weight, capsys):
    from specflash.training import dflash

    with pytest.raises(SystemExit) as stop:
        dflash.parse_args(["--model", "m", "--data", "d", flag, weight])
    assert stop.value.code == 2
    assert f"{flag} must be between 0 and 1" in capsys.readouterr().err


def test_training_step_reduces_loss(tiny_targets):
    target = tiny_targets["qwen2"]
    model = random_drafter(target, std=0.02, block=8, feature_layers=(0, 1)).train()
    ids = target.tokenizer(PROMPTS[1]).input_ids
    losses = _fit(target, model, ids + hf_greedy(target, ids, 24), len(ids), steps=8)
    assert losses[-1] < losses[0]
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ---- checkpoint IO ---------------------------------------------------------------------------


@pytest.fixture()
def saved(tiny_targets, tmp_path):
    target = tiny_targets["qwen3"]
    model = random_drafter(target, layers=2, block=8, feature_layers=(0, 1))
    return target, model, save_drafter(model, tmp_path / "drafter", dtype=torch.float32)


def test_checkpoint_round_trip(saved):
    target, model, folder = saved
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == target.num_layers
    assert cfg["dflash_config"] == {"mask_token_id": model.spec.mask_token_id, "target_layer_ids": [0, 1]}
    names = set(load_file(str(folder / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.mlp.down_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    loaded = load_drafter(folder, target)
    assert loaded.spec == model.spec
    feats = torch.randn(1, 5, model.fc.in_features)
    args = (torch.tensor([[3] + [model.spec.mask_token_id] * 7]), torch.arange(5, 13)[None], feats, torch.arange(5)[None])
    with torch.no_grad():
        torch.testing.assert_close(loaded.logits(loaded(*args)), model.logits(model(*args)), rtol=0, atol=0)
    ids = target.tokenizer(PROMPTS[0]).input_ids
    built = build(target, DFlashConfig(), str(folder))
    assert generate(target, ids, "dflash", drafter=built, max_new_tokens=12).output_ids == hf_greedy(target, ids, 12)


def test_fp16_checkpoint_loads(saved, tmp_path):
    target, model, _ = saved
    folder = save_drafter(model, tmp_path / "half", dtype=torch.float16)
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float16"
    assert load_drafter(folder, target).fc.weight.dtype == torch.float32  # the target's dtype


def test_strict_keys(saved):
    target, _, folder = saved
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    save_file({**tensors, "thresh_head.weight": torch.zeros(2)}, str(path))
    load_drafter(folder, target)  # thresh_head_* is ignored
    save_file({**tensors, "extra.weight": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointError, match="unexpected"):
        load_drafter(folder, target)
    save_file({k: v for k, v in tensors.items() if k != "layers.1.mlp.up_proj.weight"}, str(path))
    with pytest.raises(CheckpointError, match="missing"):
        load_drafter(folder, target)
    save_file({**tensors, "norm.weight": torch.zeros(3)}, str(path))
    with pytest.raises(CheckpointError, match="shape"):
        load_drafter(folder, target)


def test_missing_and_corrupt_files(saved):
    target, _, folder = saved
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_drafter(folder, target)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="not found"):
        load_drafter(folder, target)
    (folder / "config.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="JSON"):
        load_drafter(folder, target)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="not found"):
        load_drafter(folder, target)
    with pytest.raises(CheckpointError):
        build(target, DFlashConfig(), str(folder / "nowhere"))
    for name in ("runs/s1//export", "~/no-such-drafter-here", "a/b/c"):  # neither a folder nor a repo id
        with pytest.raises(CheckpointError, match="not found"):
            drafter_folder(name)
    with pytest.raises(MethodConfigError):
        build(target, DFlashConfig(), None)


def test_a_drafter_folder_under_home_is_found_with_its_tilde(saved, monkeypatch):
    _, _, folder = saved
    monkeypatch.setenv("HOME", str(folder.parent))
    assert drafter_folder(f"~/{folder.name}") == folder


@pytest.mark.parametrize("key,value,match", [
    ("hidden_size", 32, "hidden size"),
    ("vocab_size", 1000, "vocab size"),
    ("num_target_layers", 5, "layer"),
    ("dflash_config", {"mask_token_id": 10**6, "target_layer_ids": [0, 1]}, "mask token"),
    ("dflash_config", {"mask_token_id": 4, "target_layer_ids": [0, 7]}, "layer ids"),
])
def test_mismatch_errors(saved, key, value, match):
    target, _, folder = saved
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterMismatchError, match=match):
        load_drafter(folder, target)


def test_bad_config_key(saved):
    target, _, folder = saved
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["block_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="block_size"):
        load_drafter(folder, target)


def test_lossless_archs_cover_three():
    assert {a for a, *_ in SHAPES} >= set(LOSSLESS_ARCHS)
