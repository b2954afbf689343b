"""HF checkpoint -> GGUF: names, permutation, metadata types, plans, one read for many files, bad input."""
import errno
import json
import math

import gguf
import numpy as np
import pytest
import torch

from conftest import make_checkpoint, run_cli
from quantkit import api
from quantkit.backends.gguf import encoders, writer
from quantkit.backends.gguf.reader import GGUFModel
from quantkit.backends.gguf.tensors import permute_qk, unpermute_qk
from quantkit.errors import OutputError
from quantkit.eval.harness import evaluate, load_windows
from quantkit.model.checkpoint import Checkpoint

OPTS = {"tokenizer_pre": "gpt-2", "device": "cpu"}


def convert(src, out, *types, **opts):
    return api.convert(str(src), [f"gguf:{t}" for t in types], out, options={**OPTS, **opts})


def test_permutation_is_llama_cpp_pair_order_and_inverts():
    heads, d = 2, 8
    w = torch.arange(heads * d, dtype=torch.float32)[:, None].repeat(1, 3)
    p = permute_qk(w, heads)
    # within a head, new row 2k+h = old row h*(d/2)+k
    assert p[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert torch.equal(unpermute_qk(p, heads), w)


def test_f32_file_round_trips_every_tensor_exactly(tiny_gguf_source, tmp_path):
    (path,) = convert(tiny_gguf_source, tmp_path, "F32")
    src = Checkpoint(tiny_gguf_source)
    g = GGUFModel(path)
    for i in range(src.num_layers):
        ours, ref = g.layer(i), src.layer(i)
        for name in ref:
            assert torch.equal(ours[name], ref[name].float()), name
    assert torch.equal(g.embed_weight(), src.embed_weight().float())
    assert torch.equal(g.lm_head_weight(), src.lm_head_weight().float())


def test_plain_types_written_in_slices_equal_whole_tensor_encoding(tiny_gguf_source, tmp_path, monkeypatch):
    """F16/BF16/F32 are converted and written a few rows at a time (F32/F16 through one reused buffer);
    with slices of 3 rows, most tensors end in a partial slice, and every byte must still be what
    quantize() makes of the whole tensor."""
    from quantkit.backends.gguf import writer
    monkeypatch.setattr(writer, "_SLICE_ELEMENTS", 3 * 256)
    paths = convert(tiny_gguf_source, tmp_path, "F32", "F16", "BF16")
    f32, f16, bf16 = (gguf.GGUFReader(str(p)) for p in paths)
    QT = gguf.GGMLQuantizationType
    checked = 0
    for a, b, c in zip(f32.tensors, f16.tensors, bf16.tensors):
        if a.tensor_type != QT.F32 or b.tensor_type != QT.F16:
            continue                       # norms stay F32 in every file
        x = torch.from_numpy(np.array(a.data, dtype=np.float32)).reshape(-1, int(a.shape[0]))
        assert x.shape[0] % 3, a.name      # a partial last slice, or pick another slice size
        assert np.array_equal(np.asarray(b.data).view(np.uint8).reshape(-1), encoders.quantize(x, QT.F16).reshape(-1)), a.name
        assert np.array_equal(np.asarray(c.data).view(np.uint8).reshape(-1), encoders.quantize(x, QT.BF16).reshape(-1)), a.name
        checked += 1
    assert checked >= 2 * 7


def test_metadata_has_the_types_llama_cpp_checks(tiny_gguf_source, tmp_path):
    (path,) = convert(tiny_gguf_source, tmp_path, "Q8_0")
    r = gguf.GGUFReader(str(path))
    T = gguf.GGUFValueType
    expect = {"llama.context_length": T.UINT32, "llama.embedding_length": T.UINT32, "llama.block_count": T.UINT32,
              "llama.feed_forward_length": T.UINT32, "llama.attention.head_count": T.UINT32,
              "llama.attention.head_count_kv": T.UINT32, "llama.attention.layer_norm_rms_epsilon": T.FLOAT32,
              "llama.rope.freq_base": T.FLOAT32, "llama.rope.dimension_count": T.UINT32,
              "general.file_type": T.UINT32, "general.quantization_version": T.UINT32,
              "tokenizer.ggml.model": T.STRING, "tokenizer.ggml.pre": T.STRING,
              "tokenizer.ggml.tokens": T.ARRAY, "tokenizer.ggml.token_type": T.ARRAY,
              "tokenizer.ggml.merges": T.ARRAY, "tokenizer.ggml.bos_token_id": T.UINT32}
    for key, typ in expect.items():
        assert key in r.fields, key
        assert r.fields[key].types[0] == typ, key
    assert r.fields["tokenizer.ggml.token_type"].types[1] == T.INT32
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 320
    assert r.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    names = [t.name for t in r.tensors]
    assert names[:4] == ["output.weight", "output_norm.weight", "token_embd.weight", "blk.0.attn_k.weight"]
    assert all(len(n) < 64 for n in names)


def test_file_tensors_are_the_encoders_bytes_and_match_the_plan(tiny_gguf_source, tmp_path):
    (plan,) = api.plan(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path, OPTS)
    (path,) = convert(tiny_gguf_source, tmp_path, "Q4_K_M")
    r = gguf.GGUFReader(str(path))
    src = Checkpoint(tiny_gguf_source)
    by_name = {t.name: t for t in r.tensors}
    assert {row.tensor: row.kind for row in plan.rows} == {t.name: t.tensor_type.name for t in r.tensors}
    assert plan.total_bytes == sum(int(t.n_bytes) for t in r.tensors)
    t = by_name["blk.1.attn_q.weight"]
    w = permute_qk(src.tensor("model.layers.1.self_attn.q_proj.weight").float(), src.config.num_heads)
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_K
    assert np.array_equal(np.asarray(t.data).reshape(-1), encoders.quantize(w, t.tensor_type).reshape(-1))
    # Q4_K_M: attn_v and ffn_down of "more bits" layers go to Q6_K, the rest Q4_K, output Q6_K
    assert by_name["output.weight"].tensor_type.name == "Q6_K"
    # use_more_bits(i, n=2) holds for i >= 7n/8 = 1 only
    assert by_name["blk.0.attn_v.weight"].tensor_type.name == "Q4_K"
    assert by_name["blk.1.attn_v.weight"].tensor_type.name == "Q6_K"
    assert by_name["blk.0.ffn_gate.weight"].tensor_type.name == "Q4_K"


def test_quantized_file_evaluates_close_to_source(tiny_gguf_source, tiny_text, tmp_path):
    paths = convert(tiny_gguf_source, tmp_path, "F32", "Q8_0", "Q2_K")
    src = Checkpoint(tiny_gguf_source)
    tokens = load_windows(src.tokenizer, tiny_text, ctx=32, windows=4)
    base = evaluate(src, tokens)
    f32 = evaluate(GGUFModel(paths[0]), tokens, base=src)
    q8 = evaluate(GGUFModel(paths[1]), tokens, base=src)
    assert f32.perplexity == pytest.approx(base.perplexity, rel=1e-5) and f32.mean_kld < 1e-8
    q2 = evaluate(GGUFModel(paths[2]), tokens, base=src)
    # a random model amplifies error, so only the ordering and a loose bound are asserted
    assert 0 < q8.mean_kld < q2.mean_kld and q8.mean_kld < 0.1 and q8.top1_agreement > q2.top1_agreement


def test_many_types_from_one_read_of_the_source(tiny_gguf_source, tmp_path, monkeypatch):
    reads = []
    real = Checkpoint.tensor
    monkeypatch.setattr(Checkpoint, "tensor", lambda self, name: reads.append(name) or real(self, name))
    paths = convert(tiny_gguf_source, tmp_path, "Q8_0", "Q4_K_M", "Q2_K")
    assert [p.name for p in paths] == ["llama256-Q8_0.gguf", "llama256-Q4_K_M.gguf", "llama256-Q2_K.gguf"]
    assert len(reads) == len(set(reads))  # every source tensor read exactly once for all three files
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)


def test_tied_embeddings_write_no_output_tensor(tmp_path):
    src = make_checkpoint(tmp_path / "tied", hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=320,
                          tie=True, bpe=True)
    (path,) = convert(src, tmp_path / "out", "Q4_0")
    names = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert "output.weight" not in names
    assert names["token_embd.weight"].tensor_type.name == "Q6_K"  # tied: token_embd takes the output rule


def test_tensor_type_override_and_pure(tiny_gguf_source, tmp_path):
    (plan,) = api.plan(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path, {**OPTS, "tensor_type": ["ffn_up=q8_0"]})
    kinds = {r.tensor: r.kind for r in plan.rows}
    assert kinds["blk.0.ffn_up.weight"] == "Q8_0" and kinds["blk.0.ffn_gate.weight"] == "Q4_K"
    (pure,) = api.plan(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path, {**OPTS, "pure": True})
    assert {r.kind for r in pure.rows if len(r.shape) == 2} == {"Q4_K"}


def test_dry_run_writes_nothing_and_reports_bpw(tiny_gguf_source, tmp_path):
    out = tmp_path / "out"
    proc = run_cli("convert", str(tiny_gguf_source), "-f", "gguf:Q4_K_M", "-o", str(out), "--dry-run", "--json",
                   "--tokenizer-pre", "gpt-2")
    assert proc.returncode == 0, proc.stderr
    (plan,) = json.loads(proc.stdout)["plans"]
    assert not out.exists()
    weights = sum(math.prod(t["shape"]) for t in plan["tensors"])
    assert plan["bits_per_weight"] == pytest.approx(8 * plan["bytes"] / weights)
    assert {"peak memory (estimate)", "time (estimate)", "fused CPU kernels"} <= set(plan["extra"])
    # a tiny model builds no kernels
    assert plan["extra"]["fused CPU kernels"].startswith("used where already built, else eager")


# ---- bad input ---------------------------------------------------------------------------------------------

def test_unknown_gguf_type(tiny_gguf_source, tmp_path):
    proc = run_cli("convert", str(tiny_gguf_source), "-f", "gguf:Q7_K", "-o", str(tmp_path))
    assert proc.returncode == 2 and "Q7_K" in proc.stderr and "Q4_K_M" in proc.stderr and "Traceback" not in proc.stderr


def test_output_folder_not_writable(tiny_gguf_source, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the folder should be: fails even for root
    proc = run_cli("convert", str(tiny_gguf_source), "-f", "gguf:Q8_0", "-o", str(blocker / "out"),
                   "--tokenizer-pre", "gpt-2")
    assert proc.returncode == 7 and "output folder" in proc.stderr and "Traceback" not in proc.stderr


def test_disk_full_mid_write_leaves_nothing(tiny_gguf_source, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = gguf.GGUFWriter.write_tensor_data

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="disk is full"):
        convert(tiny_gguf_source, out, "Q8_0", "Q4_0")
    assert list(out.iterdir()) == []


def test_nan_weights_are_refused(tmp_path):
    src = make_checkpoint(tmp_path / "nan", hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=320, bpe=True)
    from safetensors.torch import load_file, save_file
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"][3, 7] = float("nan")
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    proc = run_cli("convert", str(src), "-f", "gguf:Q8_0", "-o", str(out), "--tokenizer-pre", "gpt-2")
    assert proc.returncode == 9 and "up_proj" in proc.stderr and "NaN" in proc.stderr
    assert list(out.iterdir()) == []


def test_tensor_that_cannot_take_the_type(tmp_path):
    src = make_checkpoint(tmp_path / "m", hidden=96, intermediate=192, heads=2, kv_heads=1, vocab=320, bpe=True)
    proc = run_cli("convert", str(src), "-f", "gguf:Q8_0", "-o", str(tmp_path / "out"), "--tensor-type",
                   "attn_q=q4_k", "--tokenizer-pre", "gpt-2")
    assert proc.returncode == 2 and "attn_q" in proc.stderr and "Traceback" not in proc.stderr


def test_llama_cpp_activation_rounding():
    from quantkit.backends.gguf.activations import q8_0, q8_k
    x = torch.randn(3, 512) * torch.linspace(0.1, 5, 512)
    y = q8_0(x)
    blocks, yb = x.reshape(3, 16, 32), y.reshape(3, 16, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    # half a step, plus the fp16 rounding of the scale (relative 2^-11) over up to 127 steps
    assert ((yb - blocks).abs() <= d * (0.5 + 127 * 2**-11) + 1e-6).all()
    assert len(torch.unique(torch.round(yb / d.half().float()))) <= 255
    z = q8_k(x)
    zb = z.reshape(3, 2, 256)
    xb = x.reshape(3, 2, 256)
    idx = xb.abs().argmax(-1, keepdim=True)
    # the largest-magnitude value of each 256-block is kept exactly (code -127 times its own scale)
    torch.testing.assert_close(zb.gather(-1, idx), xb.gather(-1, idx))
    assert not torch.equal(z, x)


def test_files_of_one_run_equal_files_written_alone(tmp_path, monkeypatch):
    """Two files of one run share the template's metadata and pack each large array (the vocabulary) once:
    each file is byte for byte the file a run of its type alone writes."""
    src = make_checkpoint(tmp_path / "vocab2k", hidden=256, intermediate=256, heads=4, kv_heads=2, layers=1,
                          vocab=2048, bpe=True)
    large = []
    real = writer._SharedArrays._pack_list

    def counting(self, val, sub_type):
        large.append(id(val))
        return real(self, val, sub_type)

    monkeypatch.setattr(writer._SharedArrays, "_pack_list", counting)
    together = convert(src, tmp_path / "together", "Q8_0", "Q4_K_M")
    assert large and len(large) == len(set(large))          # every large array packed once for both files
    for path in together:
        alone = convert(src, tmp_path / f"alone-{path.stem}", path.stem.rsplit("-", 1)[-1])[0]
        assert path.read_bytes() == alone.read_bytes(), path.name


class _Three(int):      # an int subclass, as gguf.TokenType is
    pass


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_large_arrays_pack_to_gguf_pys_bytes(endian):
    """The one-pass packing of large arrays gives gguf-py's bytes, and what gguf-py refuses it refuses."""
    n = 1500
    good = [[f"tok{i}\u0120é" for i in range(n)], [f"[PAD{i}]".encode() for i in range(n)],
            [i - 700 for i in range(n)], [_Three(i % 7) for i in range(n)],
            [float(i) / 3 for i in range(n)] + [float("nan"), -0.0, float("inf"), 1e-50]]
    bad = [[1] * n + ["x"], [2 ** 31] * n, [2 ** 70] * n, [1e300] * n, [True] + [1] * n]
    ours, theirs = writer._SharedArrays("llama", {}), gguf.GGUFWriter(None, "llama", endianess=endian)
    ours.endianess = endian
    for val in good:
        for add_vtype in (True, False):
            assert (ours._pack_val(val, gguf.GGUFValueType.ARRAY, add_vtype)
                    == theirs._pack_val(val, gguf.GGUFValueType.ARRAY, add_vtype))
    for val in bad:
        with pytest.raises(Exception) as want:
            theirs._pack_val(val, gguf.GGUFValueType.ARRAY, True)
        with pytest.raises(want.type):
            ours._pack_val(val, gguf.GGUFValueType.ARRAY, True)
