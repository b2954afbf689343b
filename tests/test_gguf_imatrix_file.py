"""llama.cpp's importance-matrix files: --imatrix-out writes the collected matrix as llama-imatrix does (GGUF or
legacy .dat), --imatrix-file reads one as llama-quantize does, and the two round-trip."""
import struct

import gguf
import numpy as np
import pytest
import torch

from conftest import run_cli
from quantkit import api
from quantkit.backends.gguf import imatrix_file as imf
from quantkit.calibration import CalibrationSpec, load_calibration
from quantkit.calibration.capture import run_capture
from quantkit.calibration.imatrix import ImatrixCollector
from quantkit.errors import UsageError
from quantkit.model.checkpoint import Checkpoint

OPTS = {"tokenizer_pre": "gpt-2", "device": "cpu", "calib_samples": 4, "calib_seqlen": 32, "seed": 0}


def _matrix(ncall_tokens=96, seed=0) -> imf.Imatrix:
    """A dense entry and a stacked one with an expert no token reached, sums of a realistic spread."""
    rng = np.random.default_rng(seed)
    sums = lambda *shape: (rng.lognormal(0, 3, shape) * ncall_tokens).astype(np.float32)  # noqa: E731
    experts = np.concatenate([sums(2, 32), np.zeros((1, 32), np.float32)])
    return imf.Imatrix({"blk.0.attn_q.weight": imf.Entry(sums(1, 64), np.array([ncall_tokens])),
                        "blk.0.ffn_up_exps.weight": imf.Entry(experts, np.array([ncall_tokens - 7, 41, 0]))},
                       ["calib.txt"], 3, 32)


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


def test_gguf_round_trip_is_exact(tmp_path):
    m = _matrix()
    back = imf.load(imf.save(m, tmp_path / "m.gguf"))
    assert not back.legacy and (back.datasets, back.chunk_count, back.chunk_size) == (["calib.txt"], 3, 32)
    for name, e in m.entries.items():
        assert np.array_equal(back.entries[name].sums, e.sums) and np.array_equal(back.entries[name].counts, e.counts)
    want, got = m.vectors(), back.vectors()
    assert all(np.array_equal(got[n].view(np.int32), want[n].view(np.int32)) for n in want)
    # llama-quantize's division: sums / count per matrix, ones for the expert no token reached
    expert = got["blk.0.ffn_up_exps.weight"].reshape(3, 32)
    assert np.array_equal(expert[1], m.entries["blk.0.ffn_up_exps.weight"].sums[1] / np.float32(41))
    assert np.array_equal(expert[2], np.ones(32, np.float32))


def test_dat_holds_llama_imatrix_values_and_round_trips_within_one_ulp(tmp_path):
    """The .dat stores float32(mean · ncall), ncall = ⌈largest count / chunk size⌉; dividing again is exact when
    ncall is a power of two and off by at most one unit in the last place otherwise."""
    m = _matrix(ncall_tokens=96)   # chunk size 32: ncall 3
    path = imf.save(m, tmp_path / "m.dat", "dat")
    data = path.read_bytes()
    (n,), at = struct.unpack_from("<i", data), 4
    entries = {}
    for _ in range(n):   # parsed here independently of the reader
        (length,) = struct.unpack_from("<i", data, at)
        name = data[at + 4:at + 4 + length].decode()
        ncall, nval = struct.unpack_from("<ii", data, at + 4 + length)
        at += 12 + length
        entries[name] = (ncall, np.frombuffer(data, "<f4", nval, at))
        at += 4 * nval
    chunks, length = struct.unpack_from("<ii", data, at)
    assert (chunks, data[at + 8:]) == (3, b"calib.txt") and length == 9
    e = m.entries["blk.0.ffn_up_exps.weight"]
    ncall, values = entries["blk.0.ffn_up_exps.weight"]
    assert ncall == 3
    expect = np.concatenate([e.sums[0] / np.float32(89) * np.float32(3), e.sums[1] / np.float32(41) * np.float32(3),
                             np.full(32, 3, np.float32)])
    assert np.array_equal(values, expect)
    back = imf.load(path)
    assert back.legacy and (back.datasets, back.chunk_count) == (["calib.txt"], 3)
    want, got = m.vectors(), back.vectors()
    assert max(_ulps(got[k], want[k]) for k in want) == 1      # ncall 3: not exact, and no worse than one ulp
    m4 = _matrix(ncall_tokens=128)                               # ncall 4: exact
    got4 = imf.load(imf.save(m4, tmp_path / "m4.dat", "dat")).vectors()
    assert all(np.array_equal(got4[k], v) for k, v in m4.vectors().items())


def test_reads_a_file_laid_out_as_llama_imatrix_writes_it(tmp_path):
    """Built here with gguf-py as imatrix.cpp's save_imatrix lays it out (no architecture; general.type,
    datasets, chunk count and size; per name in sorted order NAME.in_sum2 and NAME.counts, F32, trailing
    dimensions of 1 dropped): quantkit reads it as llama-quantize does, and writes the same bytes."""
    rng = np.random.default_rng(1)
    q = rng.random(64, dtype=np.float32) * 500
    up = rng.random((3, 32), dtype=np.float32) * 90
    w = gguf.GGUFWriter(None, "")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["wiki.train.raw"])
    w.add_uint32("imatrix.chunk_count", 5)
    w.add_uint32("imatrix.chunk_size", 512)
    w.add_tensor("blk.0.attn_q.weight.in_sum2", q)                          # ne [64]
    w.add_tensor("blk.0.attn_q.weight.counts", np.array([2560], np.float32))  # ne [1]
    w.add_tensor("blk.0.ffn_up_exps.weight.in_sum2", up)                    # ne [32, 3]
    w.add_tensor("blk.0.ffn_up_exps.weight.counts", np.array([[900], [0], [1660]], np.float32))  # ne [1, 3]
    path = tmp_path / "hand.gguf"
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = imf.load(path)
    assert (m.datasets, m.chunk_count, m.chunk_size) == (["wiki.train.raw"], 5, 512)
    v = m.vectors()
    assert np.array_equal(v["blk.0.attn_q.weight"], q / np.float32(2560))
    assert np.array_equal(v["blk.0.ffn_up_exps.weight"],
                          np.concatenate([up[0] / np.float32(900), np.ones(32, np.float32), up[2] / np.float32(1660)]))
    assert imf.save(m, tmp_path / "again.gguf").read_bytes() == path.read_bytes()


def test_reads_a_legacy_file_as_llama_quantize_does(tmp_path):
    values = np.arange(1, 9, dtype=np.float32) * np.float32(7)
    name = b"blk.3.ffn_down.weight"
    path = tmp_path / "old.dat"
    path.write_bytes(struct.pack("<ii", 1, len(name)) + name + struct.pack("<ii", 7, 8) + values.tobytes())
    m = imf.load(path)   # without the optional chunk count and dataset
    assert m.legacy and m.datasets == [] and m.chunk_count == 0
    assert np.array_equal(m.vectors()["blk.3.ffn_down.weight"], values / np.float32(7))


def _collected(model, calib_text):
    spec = CalibrationSpec(source=str(calib_text), samples=4, seqlen=32, seed=0)
    collector = ImatrixCollector(model, torch.device("cpu"))
    run_capture(model, load_calibration(spec, model).tokens, [collector], device=torch.device("cpu"))
    return collector


def test_the_collected_matrix_round_trips_to_the_vectors_the_run_uses(tiny_gguf_source, calib_text, tmp_path):
    model = Checkpoint(tiny_gguf_source)
    collector = _collected(model, calib_text)
    matrix = imf.from_collector(model, collector, str(calib_text), 32)
    assert set(matrix.entries) == {f"blk.{i}.{n}.weight" for i in range(2) for n in
                                   ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    assert matrix.entries["blk.1.ffn_down.weight"].counts.tolist() == [4 * 32]
    used = imf.importance_for(model, matrix)
    result = collector.result()
    assert all(torch.equal(used[k], result[k]) for k in result)
    for fmt in imf.FORMATS:    # ncall = 4 chunks: the .dat is exact too
        back = imf.importance_for(model, imf.load(imf.save(matrix, tmp_path / f"m.{fmt}", fmt)))
        assert back.keys() == used.keys() and all(torch.equal(back[k], used[k]) for k in used), fmt


def test_convert_from_the_written_file_gives_the_collecting_runs_bytes(tiny_gguf_source, calib_text, tmp_path,
                                                                       monkeypatch):
    """The file is named the same way in both runs, so that quantize.imatrix.file (the name as given, as
    llama-quantize records it) matches too; the format is told by its magic, so the .dat can take the name."""
    monkeypatch.chdir(tmp_path)
    r = run_cli("convert", str(tiny_gguf_source), "-f", "gguf:Q4_K_M", "-o", "collect", "--imatrix", "--calib",
                str(calib_text), "--calib-samples", "4", "--calib-seqlen", "32", "--tokenizer-pre", "gpt-2",
                "--device", "cpu", "--imatrix-out", "imx", "--imatrix-format", "gguf", "--no-resume", "--no-preflight")
    assert r.returncode == 0, r.stderr
    collected = next((tmp_path / "collect").glob("*.gguf")).read_bytes()
    assert (tmp_path / "imx").read_bytes()[:4] == b"GGUF" and not list(tmp_path.glob(".partial-*"))
    gguf_matrix = imf.load("imx")
    (from_gguf,) = api.convert(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path / "g",
                               options={**OPTS, "imatrix_file": "imx"})
    assert from_gguf.read_bytes() == collected
    imf.save(gguf_matrix, "imx", "dat")
    (from_dat,) = api.convert(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path / "d",
                              options={**OPTS, "imatrix_file": "imx"})
    assert from_dat.read_bytes() == collected
    fields = gguf.GGUFReader(str(from_dat)).fields
    assert fields["quantize.imatrix.file"].contents() == "imx"
    assert fields["quantize.imatrix.dataset"].contents() == str(calib_text)
    assert fields["quantize.imatrix.chunks_count"].contents() == 4
    assert fields["quantize.imatrix.entries_count"].contents() == 14


def _gguf_names_matrix(model, width_of=lambda t: t.shape[-1], names=None) -> imf.Imatrix:
    from quantkit.backends.gguf.tensors import gguf_tensors
    entries = {names(t.name) if names else t.name: imf.Entry(np.ones((1, width_of(t)), np.float32), np.array([1]))
               for t in gguf_tensors(model) if t.name.startswith("blk.") and len(t.shape) == 2}
    return imf.Imatrix(entries, ["x"], 1, 1, source="m.gguf", loaded=True)


def test_a_matrix_that_does_not_fit_the_model_is_refused(tiny_gguf_source):
    model = Checkpoint(tiny_gguf_source)
    with pytest.raises(UsageError, match=r"m.gguf: blk\.0\.\w+\.weight has 255 values, .* reads 256 inputs"):
        imf.importance_for(model, _gguf_names_matrix(model, width_of=lambda t: t.shape[-1] - 1))
    with pytest.raises(UsageError, match="none of its 14 entries .* another model"):
        imf.importance_for(model, _gguf_names_matrix(model, names=lambda n: n.replace("blk.", "layers.")))
    partial = _gguf_names_matrix(model)
    del partial.entries["blk.1.ffn_down.weight"]
    assert "model.layers.1.mlp.down_proj.weight" not in imf.importance_for(model, partial)  # unweighted, as llama.cpp
    iq = {"blk.1.ffn_down.weight": gguf.GGMLQuantizationType.IQ2_XXS}
    with pytest.raises(UsageError, match=r"no entry for blk\.1\.ffn_down\.weight, which IQ2_XXS writes as IQ2_XXS"):
        imf.importance_for(model, partial, iq, "IQ2_XXS")
    bad = _gguf_names_matrix(model)
    bad.entries["blk.0.attn_q.weight"].sums[0, 3] = np.inf
    with pytest.raises(UsageError, match="non-finite"):
        imf.importance_for(model, bad)


def _typed(kind: str) -> bytes:
    """A GGUF of another general.type (a model, say) with one tensor."""
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.gguf"
        w = gguf.GGUFWriter(None, "llama")
        w.add_string("general.type", kind)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


@pytest.mark.parametrize("content,message", [
    (lambda p: b"just some text, no matrix", "not an importance matrix"),
    (lambda p: p.read_bytes()[:-40], "not a readable GGUF"),
    (lambda p: _typed("model"), "not an importance matrix \\(a GGUF file with general.type 'model'"),
    (lambda p: imf.save(_matrix(), p.with_suffix(".dat"), "dat").read_bytes()[:400], "truncated or corrupt after 1"),
])
def test_unreadable_files_are_refused_in_one_line(tmp_path, content, message):
    good = imf.save(_matrix(), tmp_path / "m.gguf")
    bad = tmp_path / "bad"
    bad.write_bytes(content(good))
    with pytest.raises(UsageError, match=message) as e:
        imf.load(bad)
    assert "\n" not in str(e.value) and str(bad) in str(e.value)


@pytest.mark.parametrize("options,message", [
    ({"imatrix": True, "calib": "x.txt", "imatrix_file": "m.gguf"}, "give one of them"),
    ({"imatrix_out": "m.gguf"}, "add --imatrix"),
    ({"imatrix": True, "calib": "x.txt", "imatrix_out": "m", "imatrix_format": "json"}, "'json'"),
])
def test_option_errors(tiny_gguf_source, tmp_path, options, message):
    with pytest.raises(UsageError, match=message):
        api.convert(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path, options={**OPTS, **options})
