"""Above temperature 0 on a hybrid and on a sliding-window target: emitted tokens follow the
target's own distribution (the method and bounds of tests/test_lossless_sampling.py: an 8-token
vocabulary, the exact joint of three new tokens by enumeration, 1,500 runs, total variation of
tokens 2-3 under 0.16 and of token 3 under 0.07).

Hybrid: a draft model that is itself hybrid, so rejections restore and replay both the target's
recurrent states and the drafter's. Windowed: point-mass trees on a gpt-oss-style target whose
window (3) is shorter than the prompt, so the tree mask carries the window.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from test_lossless_sampling import PROMPT, RUNS, SAMPLING, V, _exact, _tv
from specflash.config import DraftModelConfig, SamplingConfig
from specflash.drafters.base import Draft, Drafter
from specflash.drafters.draft_model import DraftModelDrafter
from specflash.engine import Decoding
from specflash.models.target import TargetModel
from specflash.tree import DraftTree

_COMMON = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
               head_dim=8, max_position_embeddings=64, initializer_range=0.6, eos_token_id=None, bos_token_id=None,
               pad_token_id=None)
FAMILIES = {
    "qwen3_5_text": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                         linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=1,
                         linear_num_value_heads=2),
    "gpt_oss": dict(num_hidden_layers=2, sliding_window=3, num_local_experts=2, num_experts_per_tok=1),
}


class SiblingTree(Drafter):
    """Point-mass trees from the first step on: three candidates for the next token, and a child
    under two of them when there is room (a chain of one would never need a tree mask)."""

    name = "sibling-tree"

    def propose(self, context, max_len):
        a, b, c = ((context[-1] + d) % V for d in (1, 3, 6))
        if max_len >= 2:
            return Draft(DraftTree((a, b, c, (a + 1) % V, (b + 2) % V), (-1, -1, -1, 0, 1)))
        return Draft(DraftTree((a, b, c), (-1, -1, -1))) if max_len == 1 else Draft.empty()


def _model(family: str, seed: int):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **_COMMON, **FAMILIES[family])
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_output_follows_target(family):
    target = TargetModel(_model(family, 0))
    if family == "gpt_oss":
        assert target.sliding_window == 3 < len(PROMPT)
        build = SiblingTree
    else:
        assert target.family.recurrent
        other = _model(family, 1)
        build = lambda: DraftModelDrafter(other, DraftModelConfig(k=2), V)  # noqa: E731
    exact = _exact(target)
    joint23: dict = {}
    marg3: dict = {}
    for key, prob in exact.items():
        joint23[key[1:]] = joint23.get(key[1:], 0.0) + prob
        marg3[key[2]] = marg3.get(key[2], 0.0) + prob
    seen23: dict = {}
    seen3: dict = {}
    drafted = rejected = 0
    for seed in range(RUNS):
        dec = Decoding(target, build(), PROMPT, SamplingConfig(seed=seed, **SAMPLING), max_new_tokens=3)
        steps = list(dec)
        drafted += sum(len(s.tokens) for s in steps)
        rejected += sum(len(s.accepted) < len(s.tokens) for s in steps)
        out = tuple(dec.output)
        assert len(out) == 3
        seen23[out[1:]] = seen23.get(out[1:], 0) + 1
        seen3[out[2]] = seen3.get(out[2], 0) + 1
    assert drafted > RUNS // 2 and rejected > RUNS // 10, "drafts should be made, and some rejected"
    assert _tv(seen23, joint23, RUNS) < 0.16
    assert _tv(seen3, marg3, RUNS) < 0.07
