"""Tiny randomly initialised causal LMs of several architectures, built from configs.

Tests need real Hugging Face models (real attention, real caches, real `from_pretrained`) that
load in a second and run in milliseconds. These are built once into a folder from a config plus
a small byte-level BPE tokenizer trained on a fixed text, so every architecture shares one
vocabulary and any of them can draft for any other.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedTokenizerFast,
)

TINY_ARCHS: tuple[str, ...] = ("llama", "qwen3", "qwen2", "mistral")
# Families whose caches are not plain KV, built on demand only (tests of hybrid and windowed targets):
# name -> (transformers model type, config overrides). Windows of 8 are shorter than any test prompt.
_FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen3_5": ("qwen3_5_text", dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                                     linear_num_key_heads=2, linear_num_value_heads=4)),
    "qwen3_next": ("qwen3_next", dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                                      linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32)),
    "gpt_oss": ("gpt_oss", dict(head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),
    "mistral_window": ("mistral", dict(sliding_window=8)),
}
FAMILY_ARCHS: tuple[str, ...] = tuple(_FAMILIES)
_VOCAB_SIZE = 384
_SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. ",
    "What is 12 * 7? The answer is 84. What is 3 + 4? The answer is 7. ",
    "Speculative decoding drafts tokens cheaply and verifies them with the target model. ",
    "for i in range(10):\n    print(i * i)\n",
    "Once upon a time there was a small model that wanted to be fast. ",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?()[]{}=+-*/<>'\"#\n",
)
_MARKER = "specflash-tiny.json"


def _tokenizer() -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE tokenizer with chat specials."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(list(_CORPUS) * 20, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token="<|endoftext|>",
        mask_token="<|mask|>",
    )
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def tiny_config(arch: str, vocab_size: int, layers: int = 2, hidden: int = 64, **special_ids: int):
    """A small config of the given architecture; `initializer_range` is large so logits are peaked,
    which keeps greedy argmax far from ties (ties would make fp-rounding flip tokens)."""
    if arch not in TINY_ARCHS + FAMILY_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {', '.join(TINY_ARCHS + FAMILY_ARCHS)}")
    model_type, overrides = _FAMILIES.get(arch, (arch, {}))
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=arch in ("qwen3", "qwen2"),
        **special_ids,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = hidden // 4
    if "linear_num_key_heads" in overrides:  # hybrid: linear attention first, full attention every second layer
        kwargs["layer_types"] = ["full_attention" if i % 2 else "linear_attention" for i in range(layers)]
    return AutoConfig.for_model(model_type, **{**kwargs, **overrides})


def build_tiny_model(arch: str, out_dir: Path, seed: int = 0, layers: int = 2, hidden: int = 64) -> Path:
    """Build and save a tiny model + tokenizer into `out_dir` (atomically: temp folder, then rename)."""
    tok = _tokenizer()
    cfg = tiny_config(
        arch,
        vocab_size=len(tok),
        layers=layers,
        hidden=hidden,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / _MARKER).write_text(json.dumps({"arch": arch, "seed": seed, "layers": layers, "hidden": hidden}))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def ensure_tiny_model(arch: str, cache_dir: Path, seed: int = 0, layers: int = 2, hidden: int = 64) -> Path:
    """The folder of a tiny model in `cache_dir`, built on first use and reused after."""
    out = Path(cache_dir) / "tiny" / f"{arch}-L{layers}-H{hidden}-s{seed}"
    if not (out / _MARKER).exists():
        build_tiny_model(arch, out, seed=seed, layers=layers, hidden=hidden)
    return out
