"""The low-bit GGUF file types (the IQ2/IQ3 lattices, TQ, Q2_K_S) end to end: quantkit's files hold the bytes
llama-quantize writes from the same weights and the same importance matrix, they run in llama.cpp, and the
types that need a matrix refuse to run without one."""
import gguf
import numpy as np
import pytest
import torch

from conftest import run_cli
from quantkit import api
from quantkit.backends.gguf import imatrix_file as imf
from quantkit.backends.gguf import llamacpp
from quantkit.backends.gguf.reader import GGUFModel
from quantkit.backends.gguf.tensors import gguf_tensors
from quantkit.eval.harness import window_logits
from quantkit.model.source import open_model

needs_llama_cpp = pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python not installed")
OPTS = {"tokenizer_pre": "gpt-2", "device": "cpu"}
# every new file type whose tensors all have lattice, ternary or K-quant types on this model's rows of 256
FILE_TYPES = ["IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S",
              "Q2_K_S", "TQ1_0", "TQ2_0"]


@pytest.fixture(scope="module")
def matrix_file(tiny_gguf_source, tmp_path_factory):
    """An importance matrix with a realistic spread for every linear of the model, as llama-imatrix writes it."""
    rng = np.random.default_rng(7)
    model = open_model(str(tiny_gguf_source))
    entries = {t.name: imf.Entry((rng.lognormal(0, 2, (1, t.shape[-1])) * 64).astype(np.float32), np.array([64]))
               for t in gguf_tensors(model) if len(t.shape) == 2 and t.name != "token_embd.weight"}
    path = tmp_path_factory.mktemp("imatrix") / "m.imatrix.gguf"
    imf.save(imf.Imatrix(entries, ["calib.txt"], 1, 64), str(path), "gguf")
    return path


@pytest.fixture(scope="module")
def f32_file(tiny_gguf_source, tmp_path_factory):
    (path,) = api.convert(str(tiny_gguf_source), ["gguf:F32"], tmp_path_factory.mktemp("f32"), options=OPTS)
    return path


def _tensor_bytes(path):
    return {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


@needs_llama_cpp
@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_same_bytes_as_llama_quantize_with_the_same_matrix(tiny_gguf_source, matrix_file, f32_file, tmp_path,
                                                           file_type):
    (ours,) = api.convert(str(tiny_gguf_source), [f"gguf:{file_type}"], tmp_path / "qk",
                          options={**OPTS, "imatrix_file": str(matrix_file)})
    theirs = tmp_path / "llama.gguf"
    llamacpp.quantize(f32_file, theirs, int(gguf.LlamaFileType[f"MOSTLY_{file_type}"]), threads=2,
                      imatrix=imf.load(matrix_file).vectors())
    a, b = _tensor_bytes(ours), _tensor_bytes(theirs)
    assert {n: t for n, (t, _) in a.items()} == {n: t for n, (t, _) in b.items()}
    differing = [n for n in a if a[n] != b[n]]
    assert not differing, f"{len(differing)}/{len(a)} tensors differ, e.g. {differing[:4]}"


@needs_llama_cpp
@pytest.mark.parametrize("file_type", ["IQ2_M", "IQ3_XXS", "IQ1_M", "TQ2_0"])
def test_runs_in_llama_cpp_with_the_logits_of_quantkits_reader(tiny_gguf_source, matrix_file, tmp_path, file_type):
    """The random model's logits are nearly flat, so a few top-1 flips are expected; a wrong decoding of any
    type would put the mean difference near the logits' spread, not at a few hundredths of it."""
    (path,) = api.convert(str(tiny_gguf_source), [f"gguf:{file_type}"], tmp_path,
                          options={**OPTS, "imatrix_file": str(matrix_file)})
    base = open_model(str(tiny_gguf_source))
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    theirs = torch.stack(list(llamacpp.window_logits(path, tokens, threads=2)))
    mine = torch.stack(list(window_logits(GGUFModel(path, base=base, activations="llama.cpp"), tokens)))
    full = torch.stack(list(window_logits(base, tokens)))
    assert (mine.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
    assert (mine - theirs).abs().mean() < 0.05 * theirs.std()
    assert (mine - theirs).abs().mean() < 0.3 * (full - theirs).abs().mean()      # the quantization is visible


def test_lattice_file_types_refuse_without_a_matrix(tiny_gguf_source, tmp_path):
    r = run_cli("convert", str(tiny_gguf_source), "-f", "gguf:IQ2_XXS", "-o", str(tmp_path), "--device", "cpu",
                "--tokenizer-pre", "gpt-2", "--no-preflight")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "importance matrix" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())
    # IQ3_S and the ternary types need none
    (path,) = api.convert(str(tiny_gguf_source), ["gguf:IQ3_S"], tmp_path / "s", options=OPTS)
    assert "IQ3_S" in {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
