"""AWQ artifacts in their consumer: transformers + GPTQModel on the CPU must read every linear as quantkit's
own reader does, and agree with quantkit's dequantized model (the reader `quantkit eval` uses)."""
import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import TINY_TEXT, WIKI_TEST, WIKI_VALID, make_checkpoint, needs_shared_data
from quantkit import api
from quantkit.backends.awq import consumer
from quantkit.backends.awq.reader import AWQCheckpoint
from quantkit.eval.harness import load_windows, window_logits

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None,
                                reason="gptqmodel is not installed (pip install -e '.[gptq]' && pip install --no-deps gptqmodel)")


def _agreement(folder: Path, tokens: torch.Tensor) -> float:
    ours = window_logits(AWQCheckpoint(folder), tokens)
    theirs = consumer.window_logits(folder, tokens)
    same = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ours, theirs))
    return same / tokens.numel()


def test_every_linear_is_read_as_quantkit_reads_it(tmp_path):
    """GPTQModel's AWQ module inside the transformers model dequantizes to quantkit's reader's weights (up to
    its half-precision arithmetic), for each group size; and the fitted tiny model's predictions agree."""
    src = make_checkpoint(tmp_path / "src", hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=64,
                          train_steps=100)
    text = tmp_path / "calib.txt"
    text.write_text(TINY_TEXT * 3)
    variants = ["4bit-g32", "4bit-g64", "4bit-g128", "4bit-gnone"]
    folders = api.convert(str(src), [f"awq:{v}" for v in variants], tmp_path / "out",
                          options={"calib": str(text), "calib_samples": 4, "calib_seqlen": 32, "device": "cpu"})
    from quantkit.model.checkpoint import Checkpoint
    tokens = Checkpoint(src).tokenizer(TINY_TEXT, return_tensors="pt")["input_ids"][:, :128].view(4, 32)
    for v, folder in zip(variants, folders):
        model, ours = consumer.load(folder), AWQCheckpoint(folder)
        checked = 0
        for name, module in model.named_modules():
            if hasattr(module, "qweight"):
                from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
                theirs = dequantize_gemm(module.qweight, module.qzeros, module.scales, 4,
                                         module.group_size).float().T          # (in, out) -> (out, in)
                assert torch.allclose(theirs, ours.linear_weight(name), rtol=1e-3, atol=1e-5), (v, name)
                checked += 1
        assert checked == 2 * 7, v
        assert _agreement(folder, tokens) >= 0.97, v


@pytest.mark.slow
@needs_shared_data(WIKI_VALID)
@needs_shared_data(WIKI_TEST)
def test_demo_4bit_g64_loads_in_transformers_and_agrees(tmp_path):
    """The issue's check: the demo at awq 4-bit g64, 128 × 512 calibration tokens, top-1 ≥ 99.5 % (float32)."""
    (folder,) = api.convert("demo:smollm2-135m", ["awq:4bit-g64"], tmp_path,
                            options={"calib": str(WIKI_VALID), "calib_samples": 128, "calib_seqlen": 512,
                                     "device": "cpu"})
    tokens = load_windows(AWQCheckpoint(folder).tokenizer, WIKI_TEST, 512, 4)
    assert _agreement(folder, tokens) >= 0.995


@pytest.mark.slow
def test_synthetic_llama_at_g128_loads_in_transformers_and_agrees(tmp_path):
    """A llama whose in-features are multiples of 128, fitted to the tiny text so that its predictions on it are
    decisive (a random model's near-ties would measure float16 rounding, not the artifact)."""
    src = make_checkpoint(tmp_path / "src", hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=64,
                          train_steps=200, layers=2)
    text = tmp_path / "calib.txt"
    text.write_text(TINY_TEXT * 3)
    (folder,) = api.convert(str(src), ["awq:4bit-g128"], tmp_path / "out",
                            options={"calib": str(text), "calib_samples": 8, "calib_seqlen": 64, "device": "cpu"})
    from quantkit.model.checkpoint import Checkpoint
    tokens = Checkpoint(src).tokenizer(TINY_TEXT, return_tensors="pt")["input_ids"][:, :256].view(4, 64)
    assert _agreement(folder, tokens) >= 0.995
