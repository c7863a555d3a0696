"""Trees, masks, positions and cache rollback on hand-built cases, checked against sequential
decoding of the same tokens."""

from __future__ import annotations

import pytest
import torch

from transformers import DynamicCache

from conftest import LOSSLESS_ARCHS
from specflash.kv import GrowingLayer, cache_len, keep_rows, rollback, select_batch_rows, stack_left_padded
from specflash.tree import DraftTree, additive_mask

#        root
#       /    \
#     a(0)   b(1)
#     |       |  \
#    c(2)   d(3) e(4)
#            |
#           f(5)
TREE = DraftTree((10, 11, 12, 13, 14, 15), (-1, -1, 0, 1, 1, 3))


def test_depths_paths_children():
    assert TREE.depths() == [1, 1, 2, 2, 2, 3]
    assert TREE.path_to(5) == [1, 3, 5]
    assert TREE.children(-1) == [0, 1] and TREE.children(1) == [3, 4] and TREE.children(2) == []
    assert TREE.position_ids(7) == [7, 8, 8, 9, 9, 9, 10]
    assert DraftTree.chain([4, 5, 6]).is_chain and not TREE.is_chain


def test_ancestor_mask():
    allow = TREE.ancestor_mask()
    expected = torch.zeros(7, 7, dtype=torch.bool)
    visible = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 2, 5], 6: [0, 2, 4, 6]}
    for row, cols in visible.items():
        expected[row, cols] = True
    assert torch.equal(allow, expected)


def test_additive_mask_is_float_and_sees_prefix():
    mask = additive_mask(TREE.ancestor_mask(), prefix_len=3, dtype=torch.float32)
    assert mask.shape == (1, 1, 7, 10) and mask.dtype == torch.float32
    assert torch.all(mask[0, 0, :, :3] == 0)
    # columns: 3 prefix, then root, a, b, c, d, e, f
    assert mask[0, 0, 1, 5] == torch.finfo(torch.float32).min  # node a cannot see node b
    assert mask[0, 0, 6, 5] == 0  # f sees its grandparent b
    assert mask[0, 0, 6, 4] == torch.finfo(torch.float32).min  # but not a


def test_bad_parent_order_rejected():
    with pytest.raises(ValueError):
        DraftTree((1, 2), (1, -1))


def _sequential_logits(target, ids):
    cache = target.new_cache()
    return target.forward(ids, cache, 0).logits


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
def test_tree_forward_matches_sequential_paths(tiny_targets, arch):
    target = tiny_targets[arch]
    prefix = [5, 6, 7, 8]
    cache = target.new_cache()
    target.forward(prefix[:-1], cache, 0)
    out = target.forward([prefix[-1], *TREE.tokens], cache, len(prefix) - 1, tree=TREE)
    for node in range(len(TREE)):
        path = [TREE.tokens[i] for i in TREE.path_to(node)]
        ref = _sequential_logits(target, prefix + path)[-1]
        assert torch.allclose(out.logits[node + 1], ref, atol=1e-4), f"node {node}"


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
def test_keep_rows_leaves_cache_as_sequential(tiny_targets, arch):
    """After a tree forward, keeping the path b-d-f makes the next step's logits equal to
    decoding prefix + path one token at a time."""
    target = tiny_targets[arch]
    prefix = [5, 6, 7, 8]
    cache = target.new_cache()
    target.forward(prefix[:-1], cache, 0)
    start = len(prefix) - 1
    target.forward([prefix[-1], *TREE.tokens], cache, start, tree=TREE)
    path = TREE.path_to(5)
    keep_rows(cache, start, [0] + [n + 1 for n in path])
    assert cache_len(cache) == len(prefix) + len(path)
    nxt = target.forward([42], cache, cache_len(cache)).logits[-1]
    ref = _sequential_logits(target, prefix + [TREE.tokens[i] for i in path] + [42])[-1]
    assert torch.allclose(nxt, ref, atol=1e-4)


def test_rollback_leaves_cache_as_sequential(tiny_targets):
    target = tiny_targets["qwen3"]
    cache = target.new_cache()
    target.forward([5, 6, 7, 8, 9, 10, 11], cache, 0)
    rollback(cache, 3)
    assert cache_len(cache) == 4
    nxt = target.forward([20], cache, 4).logits[-1]
    assert torch.allclose(nxt, _sequential_logits(target, [5, 6, 7, 8, 20])[-1], atol=1e-5)


def test_feature_hooks_match_hidden_states(tiny_targets):
    """Hooked layer outputs are HF's hidden_states[i + 1]."""
    target = tiny_targets["llama"]
    target.capture_layers((0, 1))
    try:
        out = target.forward([5, 6, 7], target.new_cache(), 0)
        ref = target.model(torch.tensor([[5, 6, 7]]), output_hidden_states=True).hidden_states
        h = target.hidden_size
        assert torch.allclose(out.features[:, :h], ref[1][0], atol=1e-5)
        # the last layer's hook sees the output before the final norm, as hidden_states[-1] does not
        assert out.features.shape == (3, 2 * h)
    finally:
        target.capture_layers(())


def _steps(target, cache) -> list[torch.Tensor]:
    """Logits of a prefill, one-token steps, a rollback, a tree gather and more steps."""
    out = [target.forward(list(range(5, 40)), cache, 0).logits]
    for i in range(3):
        out.append(target.forward([50 + i], cache, cache_len(cache)).logits)
    rollback(cache, 2)
    start = cache_len(cache)
    out.append(target.forward([7, *TREE.tokens], cache, start, tree=TREE).logits)
    keep_rows(cache, start, [0, 2, 4])
    for i in range(90):  # past the first room's size: the layer grows again
        out.append(target.forward([60 + i % 7], cache, cache_len(cache)).logits)
    return out


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
def test_growing_cache_equals_concatenation_and_writes_in_place(tiny_targets, arch):
    """The target's cache writes each step into room behind its keys (no copy of the layer), and
    every logit equals transformers' concatenating cache, through crops, tree gathers and growth."""
    target = tiny_targets[arch]
    grown, plain = target.new_cache(), DynamicCache()
    with torch.inference_mode():
        got = _steps(target, grown)
        expected = _steps(target, plain)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        layer = grown.layers[0]
        assert type(layer) is GrowingLayer and layer.keys.shape[2] == cache_len(grown) == 35 + 1 + 3 + 90
        before = layer.keys.data_ptr()
        target.forward([3], grown, cache_len(grown))
        assert layer.keys.data_ptr() == before and layer.keys.shape[2] == 35 + 1 + 3 + 91
        target.forward([3], plain, cache_len(plain))
    with torch.no_grad():  # outside inference mode the room filled inside it cannot be written: it moves
        a, b = (target.model(input_ids=torch.tensor([[4]]), cache=c, use_cache=True).logits for c in (grown, plain))
    assert torch.equal(a, b) and not layer.keys.is_inference()


def test_growing_cache_keeps_selected_batch_rows(tiny_targets):
    """Dropping batch rows (a harvest's finished answers) leaves the others' next logits as if
    they had decoded alone."""
    target = tiny_targets["qwen3"]
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    with torch.inference_mode():
        cache = target.new_cache()
        target.model(input_ids=ids, cache=cache, use_cache=True)
        select_batch_rows(cache, torch.tensor([0, 2]))
        nxt = target.model(input_ids=torch.tensor([[20], [21]]), position_ids=torch.tensor([[4], [4]]),
                           cache=cache, use_cache=True).logits[:, -1]
    for row, token, got in zip((0, 2), (20, 21), nxt):
        ref = _sequential_logits(target, ids[row].tolist() + [token])[-1]
        assert torch.allclose(got, ref, atol=1e-5)


def test_caches_prefilled_alone_stack_into_a_left_padded_batch(tiny_targets, family_target):
    """Prompts of different lengths prefilled one by one, stacked right-aligned: a batched step
    (padding masked) gives each row the logits it gets decoding alone. Recurrent states refuse."""
    target = tiny_targets["llama"]
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    width = 6
    with torch.inference_mode():
        caches = [target.new_cache() for _ in prompts]
        for p, c in zip(prompts, caches):
            target.model(input_ids=torch.tensor([p]), cache=c, use_cache=True)
        batch = stack_left_padded(caches, width)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * (len(p) + 1) for p in prompts])
        step = target.model(input_ids=torch.tensor([[20], [21], [22]]), attention_mask=mask, cache=batch,
                            position_ids=torch.tensor([[len(p)] for p in prompts]), use_cache=True).logits[:, -1]
    assert cache_len(batch) == width + 1
    for p, token, got in zip(prompts, (20, 21, 22), step):
        assert torch.allclose(got, _sequential_logits(target, p + [token])[-1], atol=1e-5)
    hybrid = family_target("qwen3_5")
    with torch.inference_mode():
        state = hybrid.new_cache()
        hybrid.model(input_ids=torch.tensor([[5, 6]]), cache=state, use_cache=True)
    with pytest.raises(ValueError, match="recurrent"):
        stack_left_padded([state], 2)
