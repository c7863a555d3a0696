"""DeLS-Spec: local head IO and training pieces, the fusion rule, and lossless decoding."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import LOSSLESS_ARCHS, hf_greedy
from test_dflash import random_drafter
from specflash.api import generate
from specflash.config import SamplingConfig
from specflash.drafters.dels import DeLSConfig, DeLSDrafter, Fusion, fuse_block, fused_tree
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.errors import CheckpointError, DrafterMismatchError, MethodConfigError, SpecFlashError
from specflash.models import row_kernels
from specflash.models.local_head import LocalHeadSpec, build_local_head, load_local_head, save_local_head
from specflash.training.data import Sample
from specflash.training.local_head import anchored_blocks, block_loss, unigram_log_prior
from specflash.tree import DraftTree

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick brown"]


def random_head(target, seed=0, hidden=32, std=0.3):
    head = build_local_head(LocalHeadSpec(target.vocab_size, target.hidden_size, hidden, 8), target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
        head.log_prior.copy_(torch.log_softmax(torch.randn(target.vocab_size, generator=g), -1))
    return head.eval()


@pytest.mark.parametrize("table,packed", [(False, False), (True, False), (True, True)])
def test_one_token_steps_are_the_heads_forward(tiny_targets, request, table, packed):
    """Drafting steps the head one token at a time (models/local_head.py TokenStep: input products
    and readout rows from tables for a token set, the GRU cell written out, its recurrent product
    on the packed kernel where the head's row plan says so); token by token it must give the
    logits and state the module's forward gives over the whole sequence, tokens in the table or
    not, and a readout over a few tokens their entries of the full logits."""
    target = tiny_targets["qwen3"]
    head = random_head(target, seed=3)
    if packed:
        request.getfixturevalue("packed_built")
        head.row_plan = row_kernels.PACKED_EVERYWHERE
    ids = [5, 17, 3, 17, 40, 9]
    tokens = torch.tensor([3, 9, 17, 60]) if table else None  # 5 and 40 are outside it
    step = head.token_step(tokens)
    assert (step.table is not None) == table and head.token_step(tokens) is step
    assert (step.w_hh_panels is not None) == packed
    with torch.no_grad():
        expected, _ = head(torch.tensor([ids]))
        state, got = None, []
        for token in ids:
            logits, state = step(token, state)
            got.append(logits)
    torch.testing.assert_close(torch.stack(got), expected[0], rtol=1e-5, atol=1e-5)
    rows = torch.tensor([2, 0])  # positions in the token set, or target ids without one
    ids = tokens[rows] if table else rows
    with torch.no_grad():
        full, _ = step(17, state)
        few, _ = step(17, state, step.readout(rows))
        every, _ = step(17, state, step.readout(None))
    torch.testing.assert_close(few, full[ids], rtol=1e-5, atol=1e-5)  # the readout table's rows, or the head's
    torch.testing.assert_close(every, full[tokens] if table else full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("tree", [False, True])
def test_dels_greedy_equals_transformers(tiny_targets, arch, tree):
    """Greedy either way. A chain records every position; a tree records its fused chain (the
    root's likeliest child, then that node's, ...) as far as the tree expanded it, a path of it."""
    target = tiny_targets[arch]
    cfg = DeLSConfig(gate=False, alpha=0.7, beta=0.3, tree=tree)
    drafter = DeLSDrafter(random_drafter(target, block=8, feature_layers=(0, 1)), cfg, random_head(target))
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt).input_ids
        run = generate(target, ids, drafter=drafter, max_new_tokens=33, stop_on_eos=False)
        assert run.output_ids == hf_greedy(target, ids, 33)
        step = run.steps[1]
        dels = step.extras["dels"]
        assert len(dels["long"]) == len(dels["flipped"]) == len(dels["chain"]) and len(step.tokens) == 7
        held = len(DraftTree(tuple(step.tokens), tuple(step.parents)).follow(dels["chain"]))
        if tree:  # every chain token is a node, but perhaps the last: its parent's record named it, unpopped
            assert 1 <= held and held in (len(dels["chain"]), len(dels["chain"]) - 1)
        else:
            assert held == len(dels["chain"]) == 7
    assert any(any(s.extras["dels"]["flipped"]) for s in run.steps[1:] if s.tokens), "the short expert should change something"


def test_a_tree_scores_each_branch_with_the_head_after_its_own_path(tiny_targets):
    """Against brute force: every path of up to 4 positions, each node branching into its 2
    likeliest fused successors, its probability the product along it of the fused softmax with the
    local head having read that path's own tokens; the tree's 5 nodes are the 5 likeliest."""
    target = tiny_targets["qwen3"]
    fusion = Fusion(random_head(target, seed=2), alpha=0.9, beta=0.2, width=2)
    long = torch.randn(4, target.vocab_size, generator=torch.Generator().manual_seed(6)) * 2
    prior = fusion.prior(long.device)
    paths = {}  # tokens -> probability

    def grow(tokens: tuple[int, ...], state, p: float) -> None:
        if len(tokens) == len(long):
            return
        position, after = fusion.step(fusion.slot(long[len(tokens)], prior), tokens[-1] if tokens else 7, state)
        for q, token in zip(*position.top):
            paths[tokens + (token,)] = p * q
            grow(tokens + (token,), after, p * q)

    with torch.no_grad():
        grow((), None, 1.0)
        tree, q, chain = fused_tree(long, fusion, 7, 5)
    best = sorted(paths, key=paths.get, reverse=True)[:5]
    got = [tuple(tree.tokens[n] for n in tree.path_to(node)) for node in range(len(tree))]
    assert sorted(got) == sorted(best)
    assert [position.token for position in chain][:1] == [max((t for t in paths if len(t) == 1), key=paths.get)[0]]


def test_fusion_over_a_draft_vocabulary_equals_the_full_one(tiny_targets):
    """Over a drafter's draft vocabulary the fusion sees only those tokens; since every other
    token's long logit is -inf, it must choose, score and trace exactly what the full fusion does."""
    from specflash.drafters.dels import fuse_block

    target = tiny_targets["qwen3"]
    head = random_head(target, seed=4)
    g = torch.Generator().manual_seed(5)
    vocab = torch.randperm(target.vocab_size, generator=g)[:40].sort().values
    small = torch.randn(7, len(vocab), generator=g) * 3
    full = torch.full((7, target.vocab_size), float("-inf"))
    full[:, vocab] = small
    a = fuse_block(full, head, root=11, alpha=0.7, beta=0.3)
    b = fuse_block(small, head, root=11, alpha=0.7, beta=0.3, vocab=vocab)
    assert a["tokens"] == b["tokens"] and set(a["tokens"]) <= set(vocab.tolist())
    assert a["q"] == pytest.approx(b["q"], abs=1e-6)
    assert a["trace"]["flipped"] == b["trace"]["flipped"] and any(a["trace"]["flipped"])
    for key in ("long", "short", "prior"):
        assert a["trace"][key] == pytest.approx(b["trace"][key], abs=1e-5)
    assert [[x["token"] for x in alts] for alts in a["trace"]["alternatives"]] == \
        [[x["token"] for x in alts] for alts in b["trace"]["alternatives"]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("native", [False, True])
def test_dels_with_a_draft_vocabulary_drafts_inside_it_and_equals_greedy(tiny_targets, request, arch, native):
    """Either way a node is fused: PyTorch's ops, or the native fused node (the packed library)."""
    from test_draft_vocab import spread_ids, vocab_drafter

    if native:
        request.getfixturevalue("packed_built")
    target = tiny_targets[arch]
    ids = spread_ids(target, 60)
    drafter = DeLSDrafter(vocab_drafter(target, ids, feature_layers=(1, 0)), DeLSConfig(gate=False, alpha=0.7, beta=0.3),
                          random_head(target))
    step = drafter.head.token_step(drafter.model.draft_ids)
    step.native = step.native and native
    assert step.native == native
    for prompt in PROMPTS:
        prompt_ids = target.tokenizer(prompt).input_ids
        run = generate(target, prompt_ids, drafter=drafter, max_new_tokens=24, stop_on_eos=False)
        assert run.output_ids == hf_greedy(target, prompt_ids, 24)
        assert all(set(step.tokens) <= set(ids) for step in run.steps)
        assert any(step.tokens for step in run.steps)


@pytest.mark.parametrize("candidates", [0, 3, 8])
def test_zero_alpha_beta_breaks_ties_as_dflash_does(tiny_targets, candidates):
    """Drafter logits in bf16 tie at the top often (a few percent of SmolLM2's slots): with the
    experts off, the fused choice must be DFlash's argmax, the first of the tied tokens."""
    from specflash.drafters.dels import fuse_block

    target = tiny_targets["qwen3"]
    g = torch.Generator().manual_seed(2)
    long = (torch.randn(6, 40, generator=g) * 2).round()  # whole numbers: many ties
    long[:, [30, 7, 19]] = long.max(dim=1, keepdim=True).values + 1.0  # a three-way tie at the top, in every row
    fused = fuse_block(long, random_head(target), root=3, alpha=0.0, beta=0.0, vocab=torch.arange(40) * 2 + 1,
                       candidates=candidates)
    assert fused["tokens"] == [2 * 7 + 1] * 6 == [2 * int(i) + 1 for i in long.argmax(dim=1)]
    assert not any(fused["trace"]["flipped"])


@pytest.mark.parametrize("tree", [False, True])
def test_zero_alpha_beta_is_exactly_dflash(tiny_targets, tree):
    """Chains, and trees too when the fusion reads every token (its probabilities then are
    DFlash's own: a pool of candidates renormalises them, which can reorder paths)."""
    target = tiny_targets["qwen3"]
    model = random_drafter(target, block=8, feature_layers=(1,))
    ids = target.tokenizer(PROMPTS[1]).input_ids
    base = generate(target, ids, drafter=DFlashEngineDrafter(model, DFlashConfig(gate=False, tree=tree)), max_new_tokens=30)
    cfg = DeLSConfig(gate=False, alpha=0.0, beta=0.0, tree=tree, candidates=0 if tree else 64)
    dels = generate(target, ids, drafter=DeLSDrafter(model, cfg, random_head(target)), max_new_tokens=30)
    assert [(s.tokens, s.parents) for s in dels.steps] == [(s.tokens, s.parents) for s in base.steps]
    assert dels.config["tree"] is tree and any(list(s.parents) != list(range(-1, len(s.tokens) - 1)) for s in dels.steps) is tree
    assert not any(f for s in dels.steps[1:] if s.tokens for f in s.extras["dels"]["flipped"])


def test_one_local_head_serves_two_dflash_drafters(tiny_targets):
    target = tiny_targets["llama"]
    head = random_head(target)
    ids = target.tokenizer(PROMPTS[0]).input_ids
    for drafter in (random_drafter(target, seed=1, block=4, feature_layers=(1,)),
                    random_drafter(target, seed=2, layers=2, block=16, feature_layers=(0, 1, 1))):
        run = generate(target, ids, drafter=DeLSDrafter(drafter, DeLSConfig(gate=False, alpha=0.5), head), max_new_tokens=20,
                       stop_on_eos=False)
        assert run.output_ids == hf_greedy(target, ids, 20)


def test_dels_sampling_is_reproducible(tiny_targets):
    target = tiny_targets["qwen2"]
    drafter = DeLSDrafter(random_drafter(target, block=4), DeLSConfig(gate=False), random_head(target))
    ids = target.tokenizer(PROMPTS[0]).input_ids
    cfg = SamplingConfig(temperature=0.9, top_p=0.95, seed=5)
    a, b = (generate(target, ids, drafter=drafter, max_new_tokens=24, sampling=cfg).output_ids for _ in range(2))
    assert a == b and all(0 <= t < target.vocab_size for t in a)


def test_fusion_rule_on_hand_built_logits(tiny_targets):
    """Contributions add up to the fused logit of the chosen token, and a strong short expert flips."""
    target = tiny_targets["qwen3"]
    head = random_head(target, std=1.0)
    long = torch.randn(3, target.vocab_size, generator=torch.Generator().manual_seed(0))
    out = fuse_block(long, head, root=5, alpha=50.0, beta=0.5)
    trace = out["trace"]
    state, last = None, 5
    for i, token in enumerate(out["tokens"]):
        with torch.no_grad():
            short, state = head(torch.tensor([[last]]), state)
        fused = long[i] + 50.0 * short[0, -1] - 0.5 * head.log_prior
        assert token == int(fused.argmax())
        total = trace["long"][i] + trace["short"][i] + trace["prior"][i]
        assert abs(total - float(fused[token])) < 1e-3
        assert trace["flipped"][i] == (token != int(long[i].argmax()))
        last = token
    assert any(trace["flipped"])


def test_fusing_the_long_experts_top_candidates(tiny_targets):
    """With `candidates` = K, each token is the fused argmax over the K tokens ranked highest by
    long - beta * prior (checked by hand, step by step); K at or above the vocabulary is the full rule."""
    target = tiny_targets["qwen3"]
    head = random_head(target, std=1.0)
    long = torch.randn(5, target.vocab_size, generator=torch.Generator().manual_seed(3))
    alpha, beta, k = 50.0, 0.5, 6
    full = fuse_block(long, head, root=5, alpha=alpha, beta=beta)
    assert fuse_block(long, head, root=5, alpha=alpha, beta=beta, candidates=target.vocab_size)["tokens"] == full["tokens"]
    out = fuse_block(long, head, root=5, alpha=alpha, beta=beta, candidates=k)
    state, last = None, 5
    for i, token in enumerate(out["tokens"]):
        with torch.no_grad():
            short, state = head(torch.tensor([[last]]), state)
        base = long[i] - beta * head.log_prior
        pool = base.topk(k).indices
        fused = base[pool] + alpha * short[0, -1][pool]
        assert token == int(pool[fused.argmax()])
        assert abs(out["trace"]["short"][i] - alpha * float(short[0, -1][token])) < 1e-3
        assert [a["token"] for a in out["trace"]["alternatives"][i]] == pool[fused.topk(3).indices].tolist()
        last = token
    assert out["tokens"] != full["tokens"], "a short expert this strong should pick outside the long expert's top 6"


def test_config_validation():
    with pytest.raises(MethodConfigError):
        DeLSConfig(alpha=-1)
    with pytest.raises(MethodConfigError):
        DeLSConfig(beta="x")
    for bad in (-1, 2.5, True):
        with pytest.raises(MethodConfigError, match="candidates"):
            DeLSConfig(candidates=bad)


def test_local_head_round_trip_and_errors(tiny_targets, tmp_path, monkeypatch):
    target = tiny_targets["qwen3"]
    head = random_head(target)
    save_local_head(head, tmp_path / "head", dtype=torch.float32)
    again = load_local_head(tmp_path / "head", target)
    ids = torch.tensor([[5, 6, 7]])
    assert torch.allclose(head(ids)[0], again(ids)[0])
    assert torch.equal(head.log_prior, again.log_prior)
    monkeypatch.setattr(target, "row_plan", row_kernels.PACKED_EVERYWHERE)  # the target's kernels, for drafting
    assert load_local_head(tmp_path / "head", target).row_plan == row_kernels.PACKED_EVERYWHERE
    with pytest.raises(DrafterMismatchError):
        load_local_head(tmp_path / "head", tiny_targets["random-drafter"])  # other hidden size
    (tmp_path / "head" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_local_head(tmp_path / "head", target)


def test_training_pieces(tiny_targets):
    target = tiny_targets["llama"]
    samples = [Sample([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4, "code", "t", "a"), Sample([3, 3, 3, 3, 9], 1, "math", "t", "b")]
    prior = unigram_log_prior(samples, 12)
    counts = torch.ones(12)
    for t in [5, 6, 7, 8, 9, 10, 3, 3, 3, 9]:
        counts[t] += 1
    assert torch.allclose(prior, (counts / counts.sum()).log())
    blocks = anchored_blocks(samples, 4, per_sample=10, rng=random.Random(0))
    for row in blocks.tolist():  # first token is context; the rest are response tokens
        assert row in [[3, 4, 5, 6], [4, 5, 6, 7], [5, 6, 7, 8], [6, 7, 8, 9], [7, 8, 9, 10], [3, 3, 3, 3], [3, 3, 3, 9]]
    head = random_head(target, std=0.05).train()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    batch = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]] * 4)
    first = block_loss(head, batch, gamma=4.0).item()
    for _ in range(20):
        loss = block_loss(head, batch, gamma=4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first * 0.7


def test_local_head_training_run_logs_every_step(tiny_dirs, tmp_path):
    """The CLI's train(): a tiny run on a one-shard data folder writes its loss curve and the head."""
    from specflash.training.data import MANIFEST, write_shard
    from specflash.training.local_head import parse_args, train

    data = tmp_path / "data"
    data.mkdir()
    samples = [Sample(list(range(3, 3 + 20)), 4, "code", "t", f"s{i}") for i in range(3)]
    write_shard(data / "shard-00000.safetensors", samples, "generate")
    (data / MANIFEST).write_text('{"shards": [{"file": "shard-00000.safetensors", "ids": ["s0", "s1", "s2"]}]}')
    args = parse_args(["--model", str(tiny_dirs["llama"]), "--data", str(data), "--out", str(tmp_path / "run"),
                       "--export", str(tmp_path / "head"), "--steps", "6", "--batch", "4", "--block-size", "4",
                       "--hidden", "16", "--anchors-per-sample", "4"])
    train(args)
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    assert log["losses"]["first_step"] == 0 and len(log["losses"]["loss"]) == 6
    assert (tmp_path / "head" / "config.json").is_file()
    train(args)  # the same command again, e.g. to export: nothing left to train, the run's log stands
    assert json.loads((tmp_path / "run" / "train_log.json").read_text()) == log
    exported = json.loads((tmp_path / "head" / "config.json").read_text())
    assert exported["training"]["final_loss"] == log["final_loss"] is not None


def test_local_head_holds_out_shards_and_scores_them(tiny_dirs, tiny_targets, tmp_path):
    """--hold-out keeps a shard's samples out of training and reports the head's loss on them."""
    from specflash.training.data import MANIFEST, write_shard
    from specflash.training.local_head import block_loss, held_out_blocks, parse_args, split_by_shard, train

    data = tmp_path / "data"
    data.mkdir()
    seen = [Sample(list(range(3, 3 + 20)), 4, "code", "t", f"s{i}") for i in range(3)]
    unseen = [Sample(list(range(40, 40 + 12)) * 2, 4, "code", "t", f"u{i}") for i in range(2)]
    write_shard(data / "shard-00000.safetensors", seen, "generate")
    write_shard(data / "shard-00001.safetensors", unseen, "generate")
    (data / MANIFEST).write_text(json.dumps({"shards": [{"file": "shard-00000.safetensors", "ids": ["s0", "s1", "s2"]},
                                                         {"file": "shard-00001.safetensors", "ids": ["u0", "u1"]}]}))
    train_part, held = split_by_shard([data], ["shard-00001.safetensors"])
    assert [s.sample_id for s in train_part] == ["s0", "s1", "s2"] and [s.sample_id for s in held] == ["u0", "u1"]
    with pytest.raises(SpecFlashError, match="hold-out"):
        split_by_shard([data], ["shard-00009.safetensors"])

    args = parse_args(["--model", str(tiny_dirs["llama"]), "--data", str(data), "--out", str(tmp_path / "run"),
                       "--export", str(tmp_path / "head"), "--hold-out", "shard-00001.safetensors", "--steps", "4",
                       "--batch", "4", "--block-size", "4", "--hidden", "16", "--anchors-per-sample", "4", "--seed", "3"])
    train(args)
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    assert log["samples"] == 3 and log["held_out_samples"] == 2
    head = load_local_head(tmp_path / "head", tiny_targets["llama"]).float()
    blocks = anchored_blocks(held, 4, 4, random.Random(3))
    assert torch.equal(held_out_blocks(held, 4, 4, 1000, 3), blocks)  # under the limit: every block, in order
    fewer = held_out_blocks(held, 4, 4, 3, 3)
    assert len(fewer) == 3 and all(row in blocks.tolist() for row in fewer.tolist())
    with torch.no_grad():
        expected = block_loss(head, blocks, args.gamma).item()
    assert log["held_out_loss"] == pytest.approx(expected, rel=2e-2)  # the export is fp16

    again = ["--model", str(tiny_dirs["llama"]), "--data", str(data), "--hold-out", "shard-00001.safetensors",
             "--baseline", str(tmp_path / "head"), "--steps", "2", "--batch", "4", "--hidden", "16",
             "--anchors-per-sample", "4", "--seed", "3"]
    train(parse_args([*again, "--out", str(tmp_path / "run2"), "--block-size", "4"]))
    scored = json.loads((tmp_path / "run2" / "train_log.json").read_text())["baseline_held_out_loss"]
    assert scored == {str(tmp_path / "head"): pytest.approx(expected, rel=1e-5)}  # same blocks, same head
    with pytest.raises(SpecFlashError, match="block size"):
        train(parse_args([*again, "--out", str(tmp_path / "run3"), "--block-size", "6"]))


def reference_fused_node(gi, state, w_hh, reads, bias, scores, alpha):
    """PyTorch's GRU cell (no biases), the readout and the fusion, op by op."""
    i_r, i_z, i_n = gi.chunk(3)
    h_r, h_z, h_n = (w_hh @ state if state is not None else torch.zeros_like(gi)).chunk(3)
    z, n = torch.sigmoid(i_z + h_z), torch.tanh(i_n + torch.sigmoid(i_r + h_r) * h_n)
    new = n + z * ((state if state is not None else torch.zeros_like(n)) - n)
    short = reads @ new + (0 if bias is None else bias)
    return new, short, scores + alpha * short


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_native_fused_node_is_the_cell_readout_and_fusion(packed_built, with_state, with_bias):
    """fused_node.cpp against the op-by-op computation: a hidden size and pool that are no
    multiple of the vector width, state or none, bias or none; its argmax is the first maximal
    position and its top ones are ordered by probability, then position, on exact ties."""
    from specflash.models import packed_kernel

    g = torch.Generator().manual_seed(11)
    G, P = 45, 37
    gi, w_hh = torch.randn(3 * G, generator=g), torch.randn(3 * G, G, generator=g) * 0.3
    reads, scores = torch.randn(P, G, generator=g), torch.randn(P, generator=g) * 2
    state = torch.randn(G, generator=g) if with_state else None
    bias = torch.randn(P, generator=g) if with_bias else None
    new, short, fused, at, values = packed_kernel.fused_node(gi, state, w_hh, reads, bias, None, scores, 0.6, 4)
    want_state, want_short, want_fused = reference_fused_node(gi, state, w_hh, reads, bias, scores, 0.6)
    torch.testing.assert_close(new, want_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(short, want_short, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused, want_fused, rtol=1e-5, atol=1e-4)
    probs = torch.softmax(want_fused, -1)
    assert at.tolist() == [int(want_fused.argmax()), *probs.topk(4).indices.tolist()]
    torch.testing.assert_close(values, probs[at], rtol=1e-5, atol=1e-6)

    rows = torch.randperm(3 * P, generator=g)[:P]  # the pool's rows of a larger table, read in place
    table = torch.randn(3 * P, G, generator=g)
    table[rows] = reads
    big_bias = None if bias is None else torch.randn(3 * P, generator=g).index_put((rows,), bias)
    in_place = packed_kernel.fused_node(gi, state, w_hh, table, big_bias, rows, scores, 0.6, 4)
    assert all(torch.equal(a, b) for a, b in zip(in_place, (new, short, fused, at, values)))

    flat = torch.zeros(3 * G)  # every fused score equal: the first position wins, the top run in order
    _, _, _, at, values = packed_kernel.fused_node(flat, None, w_hh, torch.zeros(P, G), None, None, torch.zeros(P), 1.0,
                                                   3)
    assert at.tolist() == [0, 0, 1, 2] and values.tolist() == pytest.approx([1 / P] * 4)


def test_the_native_fused_node_reads_float16_weights_exactly(packed_built):
    """A recurrent weight that holds float16 values gives the same bits read as float16 (half the
    bytes) as read as float32; a head whose weights are not float16 values keeps float32."""
    from specflash.models import packed_kernel

    g = torch.Generator().manual_seed(12)
    G, P = 70, 20
    w_hh = (torch.randn(3 * G, G, generator=g) * 0.3).half()
    gi, state = torch.randn(3 * G, generator=g), torch.randn(G, generator=g)
    reads, scores = torch.randn(P, G, generator=g), torch.randn(P, generator=g)
    wide = packed_kernel.fused_node(gi, state, w_hh.float(), reads, None, None, scores, 0.5, 3)
    half = packed_kernel.fused_node(gi, state, w_hh, reads, None, None, scores, 0.5, 3)
    assert all(torch.equal(a, b) for a, b in zip(wide, half))


@pytest.mark.parametrize("in_float16", [True, False])
def test_a_token_step_streams_float16_only_when_exact(tiny_targets, packed_built, in_float16):
    head = random_head(tiny_targets["qwen3"], seed=5)
    if in_float16:
        with torch.no_grad():
            head.gru.weight_hh_l0.copy_(head.gru.weight_hh_l0.half().float())
    step = head.token_step(torch.tensor([3, 9, 17]))
    assert step.native and step.w_hh_native.dtype == (torch.float16 if in_float16 else torch.float32)


def test_a_native_tree_drafts_what_the_ops_draft(tiny_targets, packed_built):
    """Over a draft vocabulary with a candidate pool, the fused tree built with the native node
    holds the same paths, probabilities (to float rounding) and fused chain as the op-by-op one."""
    target = tiny_targets["qwen3"]
    head = random_head(target, seed=8)
    g = torch.Generator().manual_seed(9)
    vocab = torch.randperm(target.vocab_size, generator=g)[:50].sort().values
    long = torch.randn(6, len(vocab), generator=g) * 3
    fusion = Fusion(head, alpha=0.8, beta=0.3, vocab=vocab, candidates=12, width=3)
    step = head.token_step(vocab)
    trees = {}
    for native in (True, False):
        step.native = native
        trees[native] = fused_tree(long, fusion, 7, 6)
    (tree_n, q_n, chain_n), (tree_o, q_o, chain_o) = trees[True], trees[False]
    assert (tree_n.tokens, tree_n.parents) == (tree_o.tokens, tree_o.parents)
    assert q_n == pytest.approx(q_o, rel=1e-5, abs=1e-6)
    assert len(chain_n) > 1 and [p.token for p in chain_n] == [p.token for p in chain_o]
    for a, b in zip(chain_n, chain_o):  # the trace reads the same terms off either
        a, b = a.record(), b.record()
        assert [x["token"] for x in a["alternatives"]] == [x["token"] for x in b["alternatives"]]
        assert a["flipped"] == b["flipped"] and a["short"] == pytest.approx(b["short"], rel=1e-4, abs=1e-5)
