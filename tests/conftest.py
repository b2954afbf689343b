"""Shared fixtures: tiny random checkpoints made on the spot, and paths to the shared data."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# the Hub stand-in speaks LFS, not Xet; huggingface_hub reads this once, when it is first imported
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("QUANTKIT_SHARED_DATA", ROOT.parent / "shared" / "data"))
WIKI_TEST = SHARED_DATA / "wikitext2-test.raw.txt"
WIKI_VALID = SHARED_DATA / "wikitext2-valid.txt"

# Llama 3.1's RoPE scaling, with an original context short enough that tiny test windows reach the blend
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

TINY_TEXT = ("the quick brown fox jumps over the lazy dog . " * 40
             + "a stitch in time saves nine ; all that glitters is not gold . " * 40)


def make_tokenizer(folder: Path) -> None:
    """A small word-level tokenizer trained on TINY_TEXT, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TINY_TEXT], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))


def make_bpe_tokenizer(folder: Path, vocab_size: int) -> None:
    """A small byte-level BPE tokenizer (the kind GGUF's "gpt2" tokenizer model carries)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TINY_TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.save_pretrained(str(folder))


def make_checkpoint(folder: Path, model_type: str = "llama", *, hidden=64, layers=2, heads=4, kv_heads=2,
                    intermediate=128, vocab=64, tie=False, dtype=torch.bfloat16, seed=0,
                    max_shard_size=None, tokenizer=True, bpe=False, weight_std=0.3, train_steps=0, **extra) -> Path:
    """A random model of `model_type` saved with transformers itself.  `train_steps` > 0 first fits it to
    TINY_TEXT (needs a tokenizer): a model with decisive predictions, like a real one, so that comparisons of
    top-1 agreement between two runtimes measure the runtimes rather than near-ties of random logits.
    model_type "gemma3": a gemma3_text model saved inside a Gemma 3 image-text-to-text checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    multimodal = model_type == "gemma3"
    model_type = "gemma3_text" if multimodal else model_type

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                               tie_word_embeddings=tie, max_position_embeddings=256, **extra)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    with torch.no_grad():  # default init is tiny; bigger weights give a model with non-trivial outputs
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, weight_std)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if bpe:
        make_bpe_tokenizer(folder, vocab)
    elif tokenizer:
        make_tokenizer(folder)
    if train_steps:
        _fit_to_tiny_text(model, folder, train_steps, seed)
    if multimodal:
        model = _inside_gemma3_multimodal(model)
    model.save_pretrained(str(folder), **kw)
    return folder


def _inside_gemma3_multimodal(text_model):
    """A Gemma3ForConditionalGeneration (a tiny SigLIP tower beside) whose language model is `text_model`: the
    same language model saved as transformers saves the image-text-to-text checkpoints."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    dtype = next(text_model.parameters()).dtype
    cfg = Gemma3Config(text_config=text_model.config.to_dict(), mm_tokens_per_image=4,
                       tie_word_embeddings=text_model.config.tie_word_embeddings,
                       vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                      "intermediate_size": 64, "image_size": 28, "patch_size": 14})
    model = Gemma3ForConditionalGeneration(cfg).to(dtype)
    with torch.no_grad():
        model.model.language_model.load_state_dict(text_model.model.state_dict())
        model.lm_head.weight.copy_(text_model.lm_head.weight)
    return model


def _fit_to_tiny_text(model, folder: Path, steps: int, seed: int) -> None:
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(str(folder))(TINY_TEXT, add_special_tokens=False)["input_ids"]
    data = torch.tensor(ids)
    dtype = next(model.parameters()).dtype
    model.float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 65, (8,), generator=g)
        batch = torch.stack([data[s:s + 64] for s in starts])
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().to(dtype)


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory):
    """A small calibration text file (TINY_TEXT three times), for the calibrated formats' tests."""
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text(TINY_TEXT * 3)
    return p


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_gguf_source(tmp_path_factory) -> Path:
    """Rows of 256 so every K-quant applies without llama.cpp's shape fallback; GQA; untied head."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "llama256", hidden=256, intermediate=512, heads=4,
                           kv_heads=2, layers=2, vocab=320, bpe=True)


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "text.txt"
    p.write_text(TINY_TEXT)
    return p


def run_cli(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run the real console entry point in a subprocess, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "quantkit", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=900)


def needs_shared_data(path: Path):
    return pytest.mark.skipif(not path.is_file(), reason=f"shared data not found at {path} (CI has ../shared/data)")
