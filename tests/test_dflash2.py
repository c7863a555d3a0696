"""DFlash 2: the network and the selector against an independent implementation of the reference
equations, the release checkpoint layout (strict keys, what vLLM and SGLang read), and lossless
decoding through the engine on three tiny architectures."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import LOSSLESS_ARCHS, hf_greedy
from specflash.api import generate
from specflash.config import SamplingConfig
from specflash.drafters import build_drafter
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.drafters.dflash2 import DFlash2Config, DFlash2EngineDrafter, build, lattice_tree
from specflash.engine import Decoding
from specflash.errors import CheckpointError, MethodConfigError
from specflash.models.dflash import DFlashCache, DFlashDrafter, DFlashSpec, loss_weights
from specflash.models.dflash2 import DFlash2Drafter, DFlash2Spec, Lattice, walk
from specflash.models.dflash_io import load_drafter, new_drafter, pick_mask_token, save_drafter
from specflash.models.target import TargetModel
from specflash.sampling import probabilities
from specflash.training.dflash_objective import make_sequence, sample_anchors, sequence_loss

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick brown", "What is 12 * 7?"]


def make_spec(target, layers=1, block=8, feature_layers=(1,), **overrides) -> DFlash2Spec:
    fields = dict(
        hidden_size=target.hidden_size, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=target.vocab_size, block_size=block, num_target_layers=target.num_layers,
        target_layer_ids=tuple(feature_layers), mask_token_id=pick_mask_token(target.tokenizer),
        rope_theta=float(target.config.rope_parameters["rope_theta"]),
        conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=6,
    )
    return DFlash2Spec(**{**fields, **overrides})


def random_drafter(target, seed=0, std=0.2, conv_std=0.3, book_std=1.0, **shape) -> DFlash2Drafter:
    """A DFlash 2 drafter with every part random: convolutions away from identity and a selector
    whose transition scores outweigh the unary ones, so the walk leaves the argmax path."""
    model = new_drafter(make_spec(target, **shape), target)
    gen = torch.Generator().manual_seed(seed)
    model.init_weights(gen, std=std)
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(torch.randn(conv.base_kernel.shape, generator=gen) * conv_std)
                conv.kernel_projection.weight.copy_(torch.randn(conv.kernel_projection.weight.shape, generator=gen) * conv_std)
        sel = model.candidate_selector
        for book in (sel.predecessor_codebook, sel.successor_codebook):
            book.copy_(torch.randn(book.shape, generator=gen) * book_std)
        sel.hidden_projection.weight.copy_(torch.randn(sel.hidden_projection.weight.shape, generator=gen) * 0.3)
    return model.eval()


def _features(target, model, token_ids):
    target.capture_layers(model.spec.target_layer_ids)
    return target.forward(token_ids, target.new_cache(), 0, last_only=True).features.clone()


# ---- an independent implementation, written from the equations (models/dflash2.py docstring) ----------


def _rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x [n, heads, d] at integer positions pos [n]; rotate-half convention."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def _conv(x, coef, base, group):
    """out[t, c] = sum_j [t - j >= 0] (base[j, c] + coef[t, j, c // group]) x[t - j, c], one block."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(base.shape[0]):
            if t - j >= 0:
                for c in range(x.shape[1]):
                    out[t, c] += (base[j, c] + coef[t, j, c // group]) * x[t - j, c]
    return out


def reference_hidden(sd, spec, embed, block_ids, block_pos, feats, ctx_pos):
    """Final-normed hidden states [L, H] of one block, from the state dict."""
    eps, hd, nh, nkv = spec.rms_norm_eps, spec.head_dim, spec.num_heads, spec.num_kv_heads
    ctx = _rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    h = embed[block_ids]
    key_pos = torch.cat([ctx_pos, block_pos])
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        window, causal = spec.layer_attention(i)

        def convolve(x, name, side, coef):
            return _conv(x, coef[:, side], sd[p + name + ".base_kernel"][side], spec.conv_group_size)

        def coefficients(x, name):
            return (x @ sd[p + name + ".kernel_projection.weight"].T).view(len(x), 2, spec.conv_kernel_size, -1)

        x = _rms(h, sd[p + "input_layernorm.weight"], eps)
        coef = coefficients(x, "attention_conv")
        x = convolve(x, "attention_conv", 0, coef)
        q = _rms((x @ sd[p + "self_attn.q_proj.weight"].T).view(-1, nh, hd), sd[p + "self_attn.q_norm.weight"], eps)
        q = _rope(q, block_pos, spec.rope_theta)
        kv_in = torch.cat([ctx, x])
        k = _rms((kv_in @ sd[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), sd[p + "self_attn.k_norm.weight"], eps)
        k = _rope(k, key_pos, spec.rope_theta)
        v = (kv_in @ sd[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        att = torch.zeros(len(x), nh, hd)
        for a in range(len(x)):
            seen = [j for j in range(len(key_pos))
                    if (window is None or key_pos[j] > block_pos[a] - window)
                    and (not causal or j < len(ctx) or key_pos[j] <= block_pos[a])]
            for head in range(nh):
                g = head // (nh // nkv)
                w = torch.softmax(torch.stack([q[a, head] @ k[j, g] for j in seen]) / math.sqrt(hd), 0)
                att[a, head] = sum(w[n] * v[j, g] for n, j in enumerate(seen))
        y = att.flatten(1) @ sd[p + "self_attn.o_proj.weight"].T
        h = h + convolve(y, "attention_conv", 1, coef)
        x = _rms(h, sd[p + "post_attention_layernorm.weight"], eps)
        coef = coefficients(x, "mlp_conv")
        x = convolve(x, "mlp_conv", 0, coef)
        gate, up = x @ sd[p + "mlp.gate_proj.weight"].T, x @ sd[p + "mlp.up_proj.weight"].T
        y = (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
        h = h + convolve(y, "mlp_conv", 1, coef)
    return _rms(h, sd["norm.weight"], eps)


def reference_lattice(sd, head, hidden, anchor, top_k):
    """Candidates [T][K] (by logit, descending), unary [T][K] and S[t][a][b] by explicit sums."""
    logits = hidden @ head.T
    order = torch.sort(logits, dim=-1, descending=True, stable=True)
    cands, unary = order.indices[:, :top_k], order.values[:, :top_k]
    A, B = sd["candidate_selector.predecessor_codebook"], sd["candidate_selector.successor_codebook"]
    proj = hidden @ sd["candidate_selector.hidden_projection.weight"].T
    S = torch.zeros(len(hidden), top_k, top_k)
    for t in range(len(hidden)):
        for a in range(top_k):
            prev = anchor if t == 0 else int(cands[t - 1, a])
            for b in range(top_k):
                S[t, a, b] = unary[t, b] + sum(A[prev, r] * proj[t, r] * B[cands[t, b], r] for r in range(A.shape[1]))
    return cands, unary, S


def reference_walk(S, temperature=0.0, uniforms=None):
    """Ranks and q rows: argmax of S[t][previous] (first on ties), or the smallest rank whose
    cumulative softmax(S[t][previous] / T) exceeds u_t."""
    ranks, qs, prev = [], [], 0
    for t in range(len(S)):
        row = S[t, prev]
        if temperature == 0:
            choice, q = max(range(len(row)), key=lambda b: (float(row[b]), -b)), torch.softmax(row, 0)
        else:
            q = torch.softmax(row / temperature, 0)
            total, choice = 0.0, len(row) - 1
            for b in range(len(row)):
                total += float(q[b])
                if total > float(uniforms[t]):
                    choice = b
                    break
        ranks.append(choice)
        qs.append(q)
        prev = choice
    return ranks, torch.stack(qs)


# ---- the network -------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", [
    {},  # all full attention, bidirectional block
    {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3},  # sliding layer causal (vLLM rule)
    {"layer_types": ("sliding_attention", "sliding_attention"), "sliding_window": 4, "is_causal": False},  # release
])
def test_forward_equals_reference(tiny_targets, attention):
    target = tiny_targets["qwen3"]
    model = random_drafter(target, layers=2, block=4, feature_layers=(0, 1), **attention)
    feats = torch.randn(1, 6, model.fc.in_features, generator=torch.Generator().manual_seed(5))
    block = torch.tensor([[7, *[model.spec.mask_token_id] * 3]])
    block_pos, ctx_pos = torch.arange(6, 10)[None], torch.arange(6)[None]
    sd = {k: v.float() for k, v in model.state_dict().items()}
    embed = target.model.get_input_embeddings().weight.detach()
    with torch.no_grad():
        ours = model(block, block_pos, feats, ctx_pos, None, DFlashCache(2))[0]
        cached = DFlashCache(2)
        model(block, block_pos, feats[:, :4], ctx_pos[:, :4], None, cached)  # 4 positions cached first
        cached.crop(4)
        rolled = model(block, block_pos, feats[:, 4:], ctx_pos[:, 4:], None, cached)[0]
        ref = reference_hidden(sd, model.spec, embed, block[0], block_pos[0], feats[0], ctx_pos[0])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rolled, ours, rtol=1e-5, atol=1e-5)


def test_identity_init_is_the_dflash_drafter(tiny_targets):
    """Identity convolutions (the init) make a DFlash 2 backbone compute exactly DFlash's."""
    target = tiny_targets["llama"]
    spec2 = make_spec(target, layers=2, block=8, feature_layers=(0, 1))
    base = DFlashSpec(**{f: getattr(spec2, f) for f in DFlashSpec.__dataclass_fields__})
    dflash = new_drafter(base, target)
    dflash.init_weights(torch.Generator().manual_seed(1), std=0.2)
    dflash2 = new_drafter(spec2, target)
    dflash2.init_weights(torch.Generator().manual_seed(2))
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
    args = (torch.tensor([[3] + [spec2.mask_token_id] * 7]), torch.arange(5, 13)[None],
            torch.randn(1, 5, dflash.fc.in_features), torch.arange(5)[None])
    with torch.no_grad():
        torch.testing.assert_close(dflash2(*args), dflash(*args), rtol=0, atol=0)
    assert type(dflash) is DFlashDrafter


def test_lattice_and_greedy_walk_equal_reference(tiny_targets):
    target = tiny_targets["qwen2"]
    model = random_drafter(target, layers=1, block=8, feature_layers=(1,))
    ids = target.tokenizer(PROMPTS[1]).input_ids
    drafter = DFlash2EngineDrafter(model, DFlash2Config(gate=False, tree=False))
    drafter.begin(ids, SamplingConfig(), torch.Generator().manual_seed(0))
    feats = _features(target, model, ids[:-1])
    drafter.observe(feats)
    draft = drafter.propose(ids, 100)
    with torch.no_grad():
        block = torch.tensor([[ids[-1]] + [model.spec.mask_token_id] * 7])
        hidden = model(block, torch.arange(len(ids) - 1, len(ids) + 7)[None], feats[None],
                       torch.arange(len(ids) - 1)[None], None, DFlashCache(1))[0, 1:]
    head = target.model.get_output_embeddings().weight.detach()
    cands, unary, S = reference_lattice(model.state_dict(), head, hidden, ids[-1], 6)
    ranks, q = reference_walk(S)
    tokens = [int(cands[t, r]) for t, r in enumerate(ranks)]
    assert list(draft.tree.tokens) == tokens and draft.q is None
    lattice = draft.extras["dflash2"]
    assert lattice["candidates"] == cands.tolist() and lattice["path"] == ranks
    assert lattice["path_tokens"] == tokens and lattice["argmax_tokens"] == cands[:, 0].tolist()
    assert lattice["anchor"] == ids[-1] and lattice["top_k"] == 6 and lattice["sampled"] is False
    torch.testing.assert_close(torch.tensor(lattice["unary"]), unary, atol=1e-4, rtol=0)
    walked = torch.stack([S[t, ranks[t - 1] if t else 0] for t in range(len(S))])
    torch.testing.assert_close(torch.tensor(lattice["scores"]), walked, atol=2e-4, rtol=0)
    assert draft.q_token == pytest.approx([float(q[t, r]) for t, r in enumerate(ranks)], abs=1e-5)
    assert tokens != lattice["argmax_tokens"], "the selector should leave the argmax path here"
    json.dumps(lattice)  # plain JSON


def test_sampled_walk_equals_reference(tiny_targets):
    target = tiny_targets["llama"]
    model = random_drafter(target, layers=1, block=8, feature_layers=(1,))
    ids = target.tokenizer(PROMPTS[2]).input_ids
    feats = _features(target, model, ids[:-1])
    head = target.model.get_output_embeddings().weight.detach()
    sampling = SamplingConfig(temperature=0.7, seed=3)
    for seed in range(4):
        drafter = DFlash2EngineDrafter(model, DFlash2Config(gate=False))
        drafter.begin(ids, sampling, torch.Generator().manual_seed(seed))
        drafter.observe(feats)
        draft = drafter.propose(ids, 5)  # five slots walked
        drafter.begin(ids, sampling, None)  # the same block forward again, for the reference
        drafter.observe(feats)
        with torch.no_grad():
            hidden = drafter.block_hidden(ids)[1:6]
        cands, _, S = reference_lattice(model.state_dict(), head, hidden, ids[-1], 6)
        uniforms = torch.rand(5, generator=torch.Generator().manual_seed(seed))  # what the drafter drew
        ranks, q = reference_walk(S, 0.7, uniforms)
        lattice = draft.extras["dflash2"]
        assert lattice["path"] == ranks and lattice["sampled"] is True
        assert list(draft.tree.tokens) == [int(cands[t, r]) for t, r in enumerate(ranks)]
        torch.testing.assert_close(draft.q, torch.zeros(5, target.vocab_size).scatter(1, cands, q), rtol=0, atol=1e-5)
        assert draft.q_token == pytest.approx([float(q[t, r]) for t, r in enumerate(ranks)], abs=1e-5)


def test_walk_draws_from_softmax():
    """One slot, many uniforms: the empirical choice frequencies follow softmax(row / T)."""
    row = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])
    u = torch.rand(4000, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor([walk(row, 0.5, u[i : i + 1]).ranks[0] for i in range(4000)]), minlength=4)
    torch.testing.assert_close(counts / 4000, torch.softmax(row[0, 0] / 0.5, 0), atol=0.025, rtol=0)
    assert walk(row, 0.0).ranks == [0]
    tie = torch.tensor([[[1.0, 3.0, 3.0]]])
    assert walk(tie, 0.0).ranks == [1]  # first index on ties: the higher unary rank


# ---- the engine ---------------------------------------------------------------------------------


def test_lattice_tree_holds_the_most_probable_paths():
    """Against brute force: every path of up to 4 slots through a random lattice (K = 3), each
    node branching into its 2 likeliest successors, its probability the product of
    softmax(S_t(previous, .)) along it; the tree's 6 nodes are the 6 likeliest such paths, and each
    node's q is its probability given its parent."""
    gen = torch.Generator().manual_seed(5)
    T, K = 4, 3
    scores = torch.randn(T, K, K, generator=gen) * 2
    candidates = torch.arange(T * K).reshape(T, K) + 100
    lattice = Lattice(candidates=candidates, unary=torch.zeros(T, K), scores=scores, anchor=7)
    probs = torch.softmax(scores, dim=-1)
    paths = {}  # ranks -> probability

    def grow(ranks: tuple[int, ...], p: float) -> None:
        if len(ranks) == T:
            return
        row = probs[len(ranks), ranks[-1] if ranks else 0]
        for r in row.topk(2).indices.tolist():
            paths[ranks + (r,)] = p * float(row[r])
            grow(ranks + (r,), p * float(row[r]))

    grow((), 1.0)
    best = sorted(paths, key=paths.get, reverse=True)[:6]
    tree, q = lattice_tree(lattice, 6, 2)
    got = []
    for node in range(len(tree)):
        nodes = tree.path_to(node)
        got.append(tuple(tree.tokens[n] - 100 - 3 * depth for depth, n in enumerate(nodes)))
    assert sorted(got) == sorted(best)
    for node, ranks in enumerate(got):
        previous = ranks[-2] if len(ranks) > 1 else 0
        assert q[node] == pytest.approx(float(probs[len(ranks) - 1, previous, ranks[-1]]))


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_equals_transformers(tiny_targets, arch, tree):
    """The walk as a chain, or the lattice's most probable paths as a tree: greedy either way."""
    target = tiny_targets[arch]
    drafter = DFlash2EngineDrafter(random_drafter(target, layers=2, block=8, feature_layers=(0, 1)),
                                   DFlash2Config(gate=False, tree=tree))
    branched = False
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt).input_ids
        run = generate(target, ids, "dflash2", drafter=drafter, max_new_tokens=29, stop_on_eos=False)
        assert run.output_ids == hf_greedy(target, ids, 29)
        step = run.steps[1]
        assert len(step.tokens) == 7 and len(step.q) == 7
        is_chain = step.parents == list(range(-1, 6))
        assert (step.extras["dflash2"]["path_tokens"] == step.tokens) if not tree else step.tokens[0] in (
            step.extras["dflash2"]["candidates"][0])
        branched |= not is_chain
        assert run.config["tree"] is tree
        json.dumps(run.to_dict())
    assert branched is tree


def _fit(target, model, token_ids, prompt_len, steps):
    target.capture_layers(model.spec.target_layer_ids)
    feats = target.forward(token_ids, target.new_cache(), 0, last_only=True).features.clone()
    seq = make_sequence(token_ids, prompt_len, None)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    weights = loss_weights(model.spec.block_size, 2.0)
    for i in range(steps):
        stats = sequence_loss(model, seq, feats, sample_anchors(seq, 16, torch.Generator().manual_seed(i)), weights)
        opt.zero_grad()
        (stats.loss / stats.weight).backward()
        opt.step()


def test_greedy_with_accepted_drafts_and_the_gate(tiny_targets, monkeypatch):
    """A backbone fitted to the target's own text gets drafts accepted (the cache commit path),
    with the draft gate on; the output stays exactly greedy, and `dflash` on the same checkpoint
    (the selector-off ablation) too."""
    target = tiny_targets["qwen3"]
    ids = target.tokenizer(PROMPTS[0]).input_ids
    reference = hf_greedy(target, ids, 48)
    model = random_drafter(target, std=0.02, conv_std=0.05, book_std=0.05, block=4, feature_layers=(0, 1)).train()
    _fit(target, model, ids + reference, len(ids), steps=60)
    model.eval()
    import functools

    import specflash.drafters.dflash as dflash_module
    from specflash.drafters.gate import DraftGate

    # decide from the flat curve and a fixed drafter cost, not from timings of a machine under load
    monkeypatch.setattr(dflash_module, "DraftGate", functools.partial(DraftGate, draft_cost=0.1))
    gated = DFlash2EngineDrafter(model, DFlash2Config(probe_every=2), cost=[1.0] * 8)
    run = generate(target, ids, "dflash2", drafter=gated, max_new_tokens=48, stop_on_eos=False)
    assert run.output_ids == reference
    assert sum(len(s.accepted) for s in run.steps) > 0
    assert all("gate" in s.extras for s in run.steps[1:])
    plain = DFlashEngineDrafter(model, DFlashConfig(gate=False))
    assert generate(target, ids, "dflash", drafter=plain, max_new_tokens=48, stop_on_eos=False).output_ids == reference


def test_sampling_runs_and_is_reproducible(tiny_targets):
    target = tiny_targets["llama"]
    drafter = DFlash2EngineDrafter(random_drafter(target, block=8), DFlash2Config(gate=False))
    sampling = SamplingConfig(temperature=0.8, seed=11)
    runs = [generate(target, PROMPTS[2], "dflash2", drafter=drafter, sampling=sampling, max_new_tokens=30,
                     stop_on_eos=False) for _ in range(2)]
    assert runs[0].output_ids == runs[1].output_ids and len(runs[0].output_ids) == 30
    assert all(s.extras["dflash2"]["sampled"] for s in runs[0].steps[1:] if s.tokens)


def test_sampled_output_follows_target():
    """T > 0 end to end: a tiny 8-token Llama with a broad distribution, a DFlash 2 drafter whose
    selector proposes 2 tokens per step from 4 candidates with strong transitions; the emitted
    tokens 2 and 3 (drafted at slots 1 and 2, slot 2's q conditioned on slot 1's choice) follow the
    target's exact joint within sampling noise (measured TV 0.044 and 0.019 at 2,000 runs; q uniform
    over the candidates instead of the walked softmax gives 0.62 and 0.47). A subtler error, q at
    the wrong temperature, moves them only to 0.070 and 0.032: the exact q is checked against the
    reference walk in test_sampled_walk_equals_reference."""
    V, prompt, sampling = 8, [1, 2, 3, 1, 2], dict(temperature=0.7)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.3, eos_token_id=None,
                      bos_token_id=None, pad_token_id=None)
    target = TargetModel(LlamaForCausalLM(cfg).eval())

    @torch.no_grad()
    def dist(prefix):
        return probabilities(target.model(torch.tensor([prompt + list(prefix)])).logits[0, -1], SamplingConfig(**sampling))

    joint23: dict = {}  # P(token 2, token 3), token 1 (from the prefill) summed out
    d1 = dist(())
    for a in range(V):
        d2 = dist((a,))
        for b in range(V):
            d3 = dist((a, b))
            for c in range(V):
                joint23[(b, c)] = joint23.get((b, c), 0.0) + float(d1[a] * d2[b] * d3[c])
    spec = DFlash2Spec(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                       vocab_size=V, block_size=3, num_target_layers=1, target_layer_ids=(0,), mask_token_id=V - 1,
                       conv_kernel_size=2, conv_group_size=4, selector_rank=4, selector_top_k=4)
    model = new_drafter(spec, target)
    gen = torch.Generator().manual_seed(3)
    model.init_weights(gen, std=0.5)
    with torch.no_grad():
        for p in (*(c.kernel_projection.weight for layer in model.layers for c in (layer.attention_conv, layer.mlp_conv)),
                  model.candidate_selector.predecessor_codebook, model.candidate_selector.successor_codebook):
            p.copy_(torch.randn(p.shape, generator=gen) * 2.0)
    drafter = DFlash2EngineDrafter(model.eval(), DFlash2Config(gate=False))
    runs, seen23, seen2, drafted = 2000, {}, {}, 0
    for seed in range(runs):
        dec = Decoding(target, drafter, prompt, SamplingConfig(seed=seed, **sampling), max_new_tokens=4)
        drafted += sum(len(s.tokens) for s in dec)
        out = tuple(dec.output)
        seen23[out[1:3]] = seen23.get(out[1:3], 0) + 1
        seen2[out[1]] = seen2.get(out[1], 0) + 1
    marg2 = {b: sum(joint23[(b, c)] for c in range(V)) for b in range(V)}
    assert drafted > 2 * runs
    tv23 = 0.5 * sum(abs(seen23.get(k, 0) / runs - v) for k, v in joint23.items())
    tv2 = 0.5 * sum(abs(seen2.get(k, 0) / runs - v) for k, v in marg2.items())
    assert tv23 < 0.1 and tv2 < 0.05, (tv23, tv2)


# ---- checkpoints --------------------------------------------------------------------------------


@pytest.fixture()
def saved(tiny_targets, tmp_path):
    target = tiny_targets["qwen3"]
    model = random_drafter(target, layers=2, block=8, feature_layers=(0, 1),
                           layer_types=("sliding_attention", "sliding_attention"), sliding_window=16, is_causal=False)
    return target, model, save_drafter(model, tmp_path / "drafter2", dtype=torch.float32)


def test_round_trip_and_build(saved):
    target, model, folder = saved
    loaded = load_drafter(folder, target)
    assert isinstance(loaded, DFlash2Drafter) and loaded.spec == model.spec
    args = (torch.tensor([[3] + [model.spec.mask_token_id] * 7]), torch.arange(5, 13)[None],
            torch.randn(1, 5, model.fc.in_features), torch.arange(5)[None])
    with torch.no_grad():
        torch.testing.assert_close(loaded(*args), model(*args), rtol=0, atol=0)
    ids = target.tokenizer(PROMPTS[0]).input_ids
    built = build_drafter("dflash2", target, {"gate": False}, str(folder))
    assert isinstance(built, DFlash2EngineDrafter)
    assert generate(target, ids, "dflash2", drafter=built, max_new_tokens=12).output_ids == hf_greedy(target, ids, 12)


def test_a_draft_vocabulary_stores_only_its_successor_rows(tiny_targets, tmp_path):
    """With a d2t draft vocabulary the successor codebook is saved for those tokens only, and the
    loaded drafter scores every lattice exactly as the saved one did."""
    target = tiny_targets["llama"]
    draft_ids = torch.arange(3, target.vocab_size, 2)
    model = new_drafter(make_spec(target), target, draft_ids)
    gen = torch.Generator().manual_seed(1)
    model.init_weights(gen, std=0.2)
    with torch.no_grad():
        model.candidate_selector.hidden_projection.weight.copy_(
            torch.randn(model.candidate_selector.hidden_projection.weight.shape, generator=gen))
    folder = save_drafter(model.eval(), tmp_path / "compact", dtype=torch.float32)
    stored = load_file(str(folder / "model.safetensors"))
    book = model.candidate_selector.successor_codebook.detach()
    assert tuple(stored["candidate_selector.successor_codebook"].shape) == (len(draft_ids), 8)
    assert torch.equal(stored["candidate_selector.successor_codebook"], book[draft_ids])
    assert tuple(stored["candidate_selector.predecessor_codebook"].shape) == (target.vocab_size, 8)
    loaded = load_drafter(folder, target)
    hidden = torch.randn(7, target.hidden_size)
    anchor = int(torch.arange(target.vocab_size)[~torch.isin(torch.arange(target.vocab_size), draft_ids)][0])
    with torch.no_grad():
        want, got = model.lattice(hidden, anchor), loaded.lattice(hidden, anchor)
    assert torch.equal(got.candidates, want.candidates) and bool(torch.isin(got.candidates, draft_ids).all())
    torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=0)
    ids = target.tokenizer(PROMPTS[0]).input_ids
    drafter = DFlash2EngineDrafter(loaded, DFlash2Config(gate=False))
    assert generate(target, ids, "dflash2", drafter=drafter, max_new_tokens=16).output_ids == hf_greedy(target, ids, 16)


def test_release_layout_loads(tiny_targets, tmp_path):
    """A folder written by hand in the layout of z-lab's release (dflash2-config.json: block_size
    only under dflash_config, rope_parameters, sliding layers with is_causal false, the unary
    multiplier and soft cap) loads with every key honoured."""
    target = tiny_targets["llama"]
    model = random_drafter(target, layers=2, block=8, feature_layers=(0, 1))
    folder = tmp_path / "release"
    folder.mkdir()
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    config = {
        "architectures": ["DFlash2DraftModel"], "attention_bias": False, "attention_dropout": 0.0, "is_causal": False,
        "dflash_config": {"block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2, "final_logit_softcapping": 20.0,
                          "mask_token_id": model.spec.mask_token_id, "output_multiplier": 0.5, "selector_rank": 8,
                          "selector_top_k": 6, "target_layer_ids": [0, 1]},
        "dtype": "bfloat16", "head_dim": 16, "hidden_act": "silu", "hidden_size": target.hidden_size,
        "initializer_range": 0.02, "intermediate_size": 96, "layer_types": ["sliding_attention"] * 2,
        "max_position_embeddings": 4096, "max_window_layers": 2, "model_type": "qwen3", "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "num_target_layers": target.num_layers, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": model.spec.rope_theta, "rope_type": "default"}, "sliding_window": 5,
        "tie_word_embeddings": False, "use_cache": False, "use_sliding_window": True, "vocab_size": target.vocab_size,
    }
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_drafter(folder, target)
    spec = loaded.spec
    assert (spec.block_size, spec.sliding_window, spec.is_causal, spec.layer_attention(1)) == (8, 5, False, (5, False))
    assert (spec.output_multiplier, spec.final_logit_softcapping, spec.rope_theta) == (0.5, 20.0, model.spec.rope_theta)
    hidden = torch.randn(3, target.hidden_size)
    raw = hidden @ target.model.get_output_embeddings().weight.T
    torch.testing.assert_close(loaded.logits(hidden), torch.tanh(raw * 0.5 / 20.0) * 20.0)
    ids = target.tokenizer(PROMPTS[1]).input_ids
    drafter = DFlash2EngineDrafter(loaded, DFlash2Config(gate=False))
    assert generate(target, ids, "dflash2", drafter=drafter, max_new_tokens=20).output_ids == hf_greedy(target, ids, 20)


def _rewrite(folder, drop=(), add=None):
    path = folder / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(path)).items() if not any(k.startswith(d) for d in drop)}
    save_file({**tensors, **(add or {})}, str(path))


def test_strict_keys(saved):
    target, _, folder = saved
    original = load_file(str(folder / "model.safetensors"))
    _rewrite(folder, drop=("candidate_selector.successor_codebook",))
    with pytest.raises(CheckpointError, match="without its candidate selector"):
        load_drafter(folder, target)
    save_file(original, str(folder / "model.safetensors"))
    _rewrite(folder, drop=("layers.1.mlp_conv.base_kernel",))
    with pytest.raises(CheckpointError, match="without its convolutions"):
        load_drafter(folder, target)
    save_file(original, str(folder / "model.safetensors"))
    _rewrite(folder, add={"extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="unexpected"):
        load_drafter(folder, target)
    save_file({**original, "candidate_selector.hidden_projection.weight": torch.zeros(3, 3)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="shape"):
        load_drafter(folder, target)
    save_file(original, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("selector_top_k", "conv_group_size"):
        broken = {**cfg, "dflash_config": {k: v for k, v in cfg["dflash_config"].items() if k != key}}
        (folder / "config.json").write_text(json.dumps(broken))
        with pytest.raises(CheckpointError, match=key):
            load_drafter(folder, target)
    for bad, match in (({"conv_group_size": 24}, "conv_group_size"), ({"selector_top_k": 10**6}, "selector_top_k"),
                       ({"block_size": 4}, None)):
        broken = {**cfg, "dflash_config": {**cfg["dflash_config"], **bad}}
        if match is None:  # a top-level block_size that contradicts dflash_config's
            broken = {**cfg, "block_size": 16}
        (folder / "config.json").write_text(json.dumps(broken))
        with pytest.raises(CheckpointError, match=match or "block_size"):
            load_drafter(folder, target)
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlashDraftModel"], "block_size": 8}))
    with pytest.raises(CheckpointError, match="DFlash 2 tensors"):
        load_drafter(folder, target)


def test_dflash1_checkpoints_unchanged(tiny_targets, tmp_path):
    """A DFlash 1 folder still writes and loads exactly as before: same config keys, same class;
    dflash2 refuses it, and with no drafter at all says what it needs."""
    target = tiny_targets["qwen3"]
    spec = make_spec(target, layers=1, block=8)
    base = DFlashSpec(**{f: getattr(spec, f) for f in DFlashSpec.__dataclass_fields__})
    model = new_drafter(base, target)
    folder = save_drafter(model, tmp_path / "dflash1", dtype=torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8 and "rope_theta" in cfg
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    loaded = load_drafter(folder, target)
    assert type(loaded) is DFlashDrafter and loaded.spec == base
    with pytest.raises(MethodConfigError, match="DFlash 2 drafter"):
        build(target, DFlash2Config(gate=False), str(folder))
    with pytest.raises(MethodConfigError, match="--drafter"):
        build(target, DFlash2Config(gate=False), None)


# ---- export: what vLLM and SGLang read ------------------------------------------------------------

# vLLM, vllm/model_executor/models/qwen3_dflash2.py (commit 030da624) and qwen3_dflash.py (036a00d1):
# the config keys its DFlash2 classes read, and the tensor names its weight loader maps (q/k/v and
# gate/up are stacked into qkv_proj and gate_up_proj by name, so the per-matrix names must be there).
VLLM_CONFIG = {
    "top": ["architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "max_position_embeddings",
            "attention_bias", "rope_parameters", "vocab_size", "layer_types"],
    "dflash_config": ["conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "mask_token_id",
                      "target_layer_ids"],
}
VLLM_ARCHITECTURE = "DFlash2DraftModel"  # registry: ("qwen3_dflash2", "DFlash2Qwen3ForCausalLM")
VLLM_TENSORS = ["fc.weight", "hidden_norm.weight", "norm.weight",
                "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                "candidate_selector.hidden_projection.weight"]
VLLM_LAYER_TENSORS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                      "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                      "input_layernorm.weight", "post_attention_layernorm.weight",
                      "attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
                      "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight"]
# SGLang, python/sglang/srt/speculative/dflash_utils.py parse_dflash_draft_config (commit 00731f0b):
# block_size, num_target_layers, target_layer_ids and mask_token_id from dflash_config first, then
# the top level; the conv pair and the selector pair each all-or-nothing; output_multiplier > 0.
SGLANG_CONFIG = {
    "top": ["num_hidden_layers", "num_target_layers", "layer_types"],
    "dflash_config": ["block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                      "target_layer_ids", "mask_token_id"],
}


def test_export_matches_what_vllm_and_sglang_read(saved):
    target, model, folder = saved
    spec = model.spec
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == [VLLM_ARCHITECTURE] and cfg["model_type"] == "qwen3"
    for reader in (VLLM_CONFIG, SGLANG_CONFIG):
        for key in reader["top"]:
            assert key in cfg, key
        for key in reader["dflash_config"]:
            assert key in cfg["dflash_config"], key
    d = cfg["dflash_config"]
    assert (d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"], d["selector_top_k"]) == (2, 16, 8, 6)
    assert d["block_size"] == 8 and "block_size" not in cfg  # as the release: only under dflash_config
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": spec.rope_theta} and "rope_theta" not in cfg
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == 16 and cfg["is_causal"] is False
    assert cfg["num_target_layers"] == target.num_layers and cfg["hidden_size"] % d["conv_group_size"] == 0
    assert "output_multiplier" not in d and "final_logit_softcapping" not in d  # defaults stay implicit
    tensors = load_file(str(folder / "model.safetensors"))
    expected = set(VLLM_TENSORS) | {f"layers.{i}.{n}" for i in range(spec.num_layers) for n in VLLM_LAYER_TENSORS}
    assert set(tensors) == expected
    H, V, r, taps, groups = spec.hidden_size, spec.vocab_size, 8, 2, spec.hidden_size // 16
    shapes = {  # [V, r] codebooks as plain parameters, [r, H] projection, [2, taps, H] base, [2*taps*groups, H]
        "candidate_selector.predecessor_codebook": (V, r), "candidate_selector.successor_codebook": (V, r),
        "candidate_selector.hidden_projection.weight": (r, H), "layers.0.attention_conv.base_kernel": (2, taps, H),
        "layers.1.mlp_conv.kernel_projection.weight": (2 * taps * groups, H),
        "fc.weight": (H, 2 * H),
    }
    for name, shape in shapes.items():
        assert tuple(tensors[name].shape) == shape, name
