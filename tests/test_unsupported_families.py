"""Model families the engine serves only in part: each method either equals greedy decoding or
stops with one line that names the family and what is missing, never a traceback."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from test_batch import OracleDrafter
from test_hybrid import ChainOracle
from specflash.api import generate, generate_batch
from specflash.drafters import build_drafter
from specflash.errors import UnsupportedModelError
from specflash.models.target import TargetModel

V = 128
IDS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 5, 6, 7, 8, 9]
_BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
             pad_token_id=0, eos_token_id=1, bos_token_id=2)
FAMILIES = {
    # Mamba-1 style mixer over a hybrid cache: its scan of a block ignores the cached state
    "jamba": dict(num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                  mamba_dt_rank=8, use_mamba_kernels=False),
    # recurrent layers only: no attention layer to tell the cache's length
    "mamba2": dict(num_heads=8, head_dim=16, state_size=8, n_groups=1, expand=2, chunk_size=16, conv_kernel=4),
    # chunked attention, for which no tree mask is written
    "llama4_text": dict(attention_chunk_size=8, num_local_experts=2, num_experts_per_tok=1, intermediate_size_mlp=128,
                        no_rope_layers=[1, 0], layer_types=["chunked_attention", "full_attention"]),
}


@pytest.fixture(scope="module")
def targets():
    def make(family: str) -> tuple[TargetModel, list[int]]:
        torch.manual_seed(0)
        config = AutoConfig.for_model(family, **{**_BASE, **FAMILIES[family]})
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        inputs = torch.tensor([IDS])
        ref = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=20, do_sample=False,
                             pad_token_id=0)[0, len(IDS):].tolist()
        return TargetModel(model, None, name=family), ref

    return {family: make(family) for family in FAMILIES}


def _one_line(err: pytest.ExceptionInfo, family: str) -> None:
    assert family in str(err.value) and "\n" not in str(err.value)


def test_jamba_decodes_plainly_and_refuses_drafts_in_one_line(targets):
    target, ref = targets["jamba"]
    assert generate(target, IDS, max_new_tokens=20).output_ids == ref
    assert not target.continues_blocks
    with pytest.raises(UnsupportedModelError, match="cannot continue a state over a block.*use ar") as err:
        generate(target, IDS, method="pld", max_new_tokens=20)
    _one_line(err, "jamba")
    with pytest.raises(UnsupportedModelError, match="use ar$"):
        build_drafter("ptd", target)
    prompts = [IDS, IDS[:7]]
    refs = [generate(target, ids, max_new_tokens=12).output_ids for ids in prompts]
    assert [run.output_ids for run in generate_batch(target, prompts, max_new_tokens=12).runs] == refs
    with pytest.raises(UnsupportedModelError, match="use ar$"):
        generate_batch(target, prompts, drafter=OracleDrafter(prompts, refs, V), max_new_tokens=12)


def test_mamba2_without_attention_layers_rolls_back(targets):
    target, ref = targets["mamba2"]
    assert target.family.recurrent and target.continues_blocks
    run = generate(target, IDS, max_new_tokens=20, drafter=ChainOracle(ref, len(IDS), V))
    assert run.output_ids == ref and sum(len(s.accepted) for s in run.steps) > 3
    with pytest.raises(UnsupportedModelError, match="no attention layers beside its recurrent ones") as err:
        generate_batch(target, [IDS, IDS[:7]], max_new_tokens=4)
    _one_line(err, "mamba2")


def test_chunked_attention_has_no_tree_mask(targets):
    target, ref = targets["llama4_text"]
    assert generate(target, IDS, method="pld", max_new_tokens=20).output_ids == ref
    with pytest.raises(UnsupportedModelError, match="chunked_attention layers, for which SpecFlash has no tree mask") as err:
        build_drafter("ptd", target)
    _one_line(err, "llama4_text")


def test_a_forward_that_fails_inside_transformers_names_the_family(targets, monkeypatch):
    target, _ = targets["llama4_text"]

    def refuse(*args, **kwargs):
        raise TypeError("forward() got an unexpected keyword argument 'cache'\nmore detail")

    monkeypatch.setattr(target.model, "forward", refuse)
    with pytest.raises(UnsupportedModelError, match=r"^llama4_text cannot run .*\(TypeError: forward\(\) got an") as err:
        generate(target, IDS, max_new_tokens=4)
    _one_line(err, "llama4_text")
