"""Tests for quantkit.backends.gguf.mixtures (llama-quantize per-tensor types).

``tests/data/gguf_mixture_expected.json`` holds the per-tensor types that
llama.cpp itself (llama-cpp-python 0.3.36, llama.cpp 0c1e57098,
``llama_model_quantize``) wrote for several models and settings.  The
recorded tests compare :func:`plan_types` to those without llama.cpp; the
``live`` tests re-derive them with llama.cpp when ``llama_cpp`` is
importable.  The live tests build a GGUF with the recorded tensor names and
row lengths but only a few rows per tensor: llama.cpp's type choice depends on
names, ``ne[0]`` and the hyper-parameters only, so that is enough and fast.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType

from quantkit.backends.gguf import llamacpp
from quantkit.errors import SourceError
from quantkit.backends.gguf.mixtures import (
    FILE_TYPES,
    TensorChoice,
    allows_quantization,
    plan_types,
    resolve_file_type,
    tensor_category,
    use_more_bits,
)

Q = GGMLQuantizationType
DATA = Path(__file__).parent / "data" / "gguf_mixture_expected.json"
EXPECTED = json.loads(DATA.read_text())
MODELS: dict = EXPECTED["models"]
CASES: dict = EXPECTED["cases"]

ALL_FILE_TYPES = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_S",
                  "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS",
                  "Q2_K_S", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M",
                  "IQ1_S", "TQ1_0", "TQ2_0", "F16", "BF16", "F32"]


# --------------------------------------------------------------------------
# helpers shared with the recording script
# --------------------------------------------------------------------------


def model_tensors(model: dict) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(shape)) for name, shape in model["tensors"]]


def plan_for(model: dict, case: dict) -> list[TensorChoice]:
    hp = model["hparams"]
    return plan_types(
        model_tensors(model), case["file_type"],
        n_layer=hp["n_layer"], n_head=hp["n_head"], n_head_kv=hp["n_head_kv"], n_expert=hp["n_expert"],
        tied_embeddings=model["tied_embeddings"],
        overrides=[tuple(o) for o in case["overrides"]], pure=case["pure"], has_imatrix=case.get("imatrix", False),
    )


def write_synthetic_gguf(path: str | os.PathLike, model: dict, *, max_rows: int | None = 4, seed: int = 0) -> None:
    """An F16 GGUF with the model's tensor names and hparams and random data.

    ``max_rows`` caps ne[1] (rows) of every tensor; ne[0] and the expert
    dimension are kept, since llama-quantize's choice depends only on them.
    2-D+ weights are F16 except MoE routers (F32, as the converter writes
    them); 1-D tensors are F32.
    """
    rng = np.random.default_rng(seed)
    hp = model["hparams"]
    arch = model["arch"]
    w = GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name("synthetic")
    w.add_block_count(hp["n_layer"])
    w.add_context_length(2048)
    w.add_embedding_length(hp["n_embd"])
    w.add_feed_forward_length(hp["n_ff"])
    w.add_head_count(hp["n_head"])
    w.add_head_count_kv(hp["n_head_kv"])
    w.add_layer_norm_rms_eps(1e-5)
    if hp["n_expert"]:
        w.add_expert_count(hp["n_expert"])
        w.add_expert_used_count(2)
    w.add_file_type(LlamaFileType.MOSTLY_F16)
    for name, ne in model["tensors"]:
        ne = list(ne)
        if len(ne) >= 2 and max_rows is not None:
            ne[1] = min(ne[1], max_rows)
        shape = tuple(reversed(ne))   # numpy order
        if len(ne) < 2 or "ffn_gate_inp" in name:
            arr = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        else:
            arr = (rng.standard_normal(shape) * 0.02).astype(np.float16)
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_LOG_CALLBACK = None


def _silence_llama_cpp(llama_cpp) -> None:
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def llama_cpp_quantize(inp: str, out: str, file_type: str, overrides=(), pure: bool = False,
                       nthread: int = 2, imatrix: bool = False) -> tuple[dict[str, str], int]:
    """Run llama.cpp's quantizer; returns ({tensor: type name}, general.file_type).  `imatrix`: hand it an
    importance matrix of ones for every matrix of the input (the types it chooses depend only on whether there
    is one)."""
    import llama_cpp

    _silence_llama_cpp(llama_cpp)
    vectors = None
    if imatrix:
        reader = GGUFReader(str(inp))
        vectors = {t.name: np.ones(int(t.shape[0]) * (int(t.shape[2]) if len(t.shape) > 2 else 1), np.float32)
                   for t in reader.tensors if len(t.shape) >= 2}
        del reader
    try:
        llamacpp.quantize(inp, out, int(FILE_TYPES[file_type].file_type), nthread, vectors, overrides, pure)
    except SourceError as e:
        raise RuntimeError(f"{e} for {file_type}") from None
    reader = GGUFReader(str(out))
    field = reader.fields["general.file_type"]
    ftv = int(field.parts[field.data[0]][0])
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    del reader
    return types, ftv


def _diff(model: dict, plan: list[TensorChoice], types: list[str]) -> list[str]:
    out = []
    for (name, _), choice, want in zip(model["tensors"], plan, types):
        assert choice.name == name
        if choice.qtype.name != want:
            out.append(f"{name}: plan {choice.qtype.name} ({choice.reason}) != llama.cpp {want}")
    return out


# --------------------------------------------------------------------------
# recorded llama.cpp results
# --------------------------------------------------------------------------

_RECORDED = [(m, c) for m in MODELS for c in MODELS[m]["results"]]


@pytest.mark.parametrize("model_name,case_name", _RECORDED, ids=[f"{m}-{c}" for m, c in _RECORDED])
def test_matches_recorded_llama_cpp(model_name, case_name):
    model = MODELS[model_name]
    plan = plan_for(model, CASES[case_name])
    assert len(plan) == len(model["tensors"])
    bad = _diff(model, plan, model["results"][case_name])
    assert not bad, "\n".join(bad[:20])


def test_recorded_data_covers_every_file_type():
    for name, model in MODELS.items():
        plain = {CASES[c]["file_type"] for c in model["results"] if not CASES[c]["overrides"] and not CASES[c]["pure"]}
        assert plain == set(ALL_FILE_TYPES), name


@pytest.mark.parametrize("file_type", ALL_FILE_TYPES)
def test_general_file_type_matches_recorded(file_type):
    assert int(FILE_TYPES[file_type].file_type) == EXPECTED["general_file_type"][file_type]


def test_recorded_models_exercise_the_rules():
    """Guard against a recording that would not test much."""
    smol = MODELS["smollm2_135m"]
    q4km = dict(zip([n for n, _ in smol["tensors"]], smol["results"]["Q4_K_M"]))
    assert q4km["token_embd.weight"] == "Q8_0"          # tied, 576 % 256 != 0
    assert q4km["blk.0.attn_q.weight"] == "Q5_0"        # Q4_K fallback
    assert q4km["blk.0.ffn_down.weight"] == "Q6_K"      # 1536 is a multiple of 256
    assert q4km["blk.4.ffn_down.weight"] == "Q4_K"
    big = MODELS["llama_80l_gqa8"]
    q3ks = dict(zip([n for n, _ in big["tensors"]], big["results"]["Q3_K_S"]))
    assert q3ks["blk.0.attn_v.weight"] == "Q5_K"        # 70B rule
    moe = MODELS["llama_moe_8x"]
    q4 = dict(zip([n for n, _ in moe["tensors"]], moe["results"]["Q4_K_M"]))
    assert q4["blk.0.attn_v.weight"] == "Q8_0" and q4["blk.0.attn_k.weight"] == "Q8_0"


# --------------------------------------------------------------------------
# live comparison with llama.cpp (skipped without llama_cpp)
# --------------------------------------------------------------------------

# Every case for these models; set QUANTKIT_LIVE_ALL=1 to run all models.
_LIVE_MODELS = list(MODELS) if os.environ.get("QUANTKIT_LIVE_ALL") else ["smollm2_135m", "llama16_untied", "llama_moe_8x"]


@pytest.mark.parametrize("model_name", _LIVE_MODELS)
def test_live_llama_cpp(model_name, tmp_path):
    pytest.importorskip("llama_cpp")
    model = MODELS[model_name]
    src = tmp_path / "in-f16.gguf"
    write_synthetic_gguf(src, model)
    failures = []
    for case_name in model["results"]:
        case = CASES[case_name]
        types, ftv = llama_cpp_quantize(src, tmp_path / "out.gguf", case["file_type"],
                                        [tuple(o) for o in case["overrides"]], case["pure"],
                                        imatrix=case.get("imatrix", False))
        live = [types[n] for n, _ in model["tensors"]]
        if live != model["results"][case_name]:
            failures.append(f"{case_name}: llama.cpp no longer matches the recording")
        failures += [f"{case_name}: {d}" for d in _diff(model, plan_for(model, case), live)]
        if ftv != int(FILE_TYPES[case["file_type"]].file_type):
            failures.append(f"{case_name}: general.file_type {ftv}")
    assert not failures, "\n".join(failures[:30])


# --------------------------------------------------------------------------
# unit tests (no llama.cpp needed)
# --------------------------------------------------------------------------


def _dense(n_layer=8, n_embd=512, n_ff=1536, tied=True):
    t = [("token_embd.weight", (n_embd, 1000)), ("output_norm.weight", (n_embd,))]
    if not tied:
        t.append(("output.weight", (n_embd, 1000)))
    for i in range(n_layer):
        t += [
            (f"blk.{i}.attn_norm.weight", (n_embd,)),
            (f"blk.{i}.attn_q.weight", (n_embd, n_embd)),
            (f"blk.{i}.attn_k.weight", (n_embd, 128)),
            (f"blk.{i}.attn_v.weight", (n_embd, 128)),
            (f"blk.{i}.attn_output.weight", (n_embd, n_embd)),
            (f"blk.{i}.ffn_norm.weight", (n_embd,)),
            (f"blk.{i}.ffn_gate.weight", (n_embd, n_ff)),
            (f"blk.{i}.ffn_up.weight", (n_embd, n_ff)),
            (f"blk.{i}.ffn_down.weight", (n_ff, n_embd)),
        ]
    return t


def _types(choices):
    return {c.name: c.qtype for c in choices}


def test_file_types_table():
    assert list(FILE_TYPES) == ALL_FILE_TYPES
    assert FILE_TYPES["Q4_K_M"].default_type == Q.Q4_K
    assert FILE_TYPES["Q4_K_M"].file_type == LlamaFileType.MOSTLY_Q4_K_M
    assert FILE_TYPES["F32"].file_type == LlamaFileType.ALL_F32
    assert FILE_TYPES["IQ4_XS"].default_type == Q.IQ4_XS
    assert all(spec.description for spec in FILE_TYPES.values())
    assert resolve_file_type("q4_k").name == "Q4_K_M"
    assert resolve_file_type("Q5_K").name == "Q5_K_M"


def test_unknown_file_type_lists_valid_ones():
    with pytest.raises(ValueError) as err:
        plan_types(_dense(), "Q7_K", n_layer=8, n_head=8, n_head_kv=2)
    msg = str(err.value)
    assert "Q7_K" in msg
    for name in ALL_FILE_TYPES:
        assert name in msg


def test_use_more_bits():
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


def test_categories_and_quantizable():
    assert tensor_category("blk.3.attn_qkv.weight") == "attn_v"
    assert tensor_category("blk.3.attn_k.weight") == "attn_k"
    assert tensor_category("blk.3.ffn_down_exps.weight") == "ffn_down"
    assert tensor_category("output.weight") == "output"
    assert not allows_quantization("blk.0.attn_norm.weight", (512,))
    assert not allows_quantization("blk.0.attn_q.bias", (512,))
    assert not allows_quantization("blk.0.ffn_gate_inp.weight", (512, 8))
    assert not allows_quantization("blk.0.attn_q.weight", (512, 1))    # trailing 1 dims do not count
    assert allows_quantization("blk.0.ffn_up_exps.weight", (512, 1024, 8))


def test_result_order_and_norms():
    tensors = _dense(n_layer=2)
    # llama.cpp visits in its own order; the result follows the caller's order
    shuffled = list(reversed(tensors))
    a = plan_types(tensors, "Q4_K_M", n_layer=2, n_head=8, n_head_kv=2, tied_embeddings=True)
    b = plan_types(shuffled, "Q4_K_M", n_layer=2, n_head=8, n_head_kv=2, tied_embeddings=True)
    assert [c.name for c in b] == [n for n, _ in shuffled]
    assert _types(a) == _types(b)
    assert all(c.qtype == Q.F32 for c in a if "norm" in c.name)


def test_q4_k_m_mixture_rules():
    t = _types(plan_types(_dense(16, tied=False), "Q4_K_M", n_layer=16, n_head=8, n_head_kv=2))
    more = {0, 1, 4, 7, 10, 13, 14, 15}
    for i in range(16):
        want = Q.Q6_K if i in more else Q.Q4_K
        assert t[f"blk.{i}.attn_v.weight"] == want
        assert t[f"blk.{i}.ffn_down.weight"] == want
        assert t[f"blk.{i}.attn_q.weight"] == Q.Q4_K
    assert t["output.weight"] == Q.Q6_K
    assert t["token_embd.weight"] == Q.Q4_K     # untied: default type


@pytest.mark.parametrize("ftype, without, with_matrix", [
    ("Q4_0", Q.Q4_0, Q.Q4_1),        # llama-quantize guards the first eighth's ffn_down only with a matrix
    ("Q5_0", Q.Q5_0, Q.Q5_1),
    ("IQ4_NL", Q.Q5_K, Q.IQ4_NL),    # ... and raises IQ4's first eighth only without one
    ("IQ4_XS", Q.Q5_K, Q.IQ4_XS),
])
def test_ffn_down_of_the_first_eighth_depends_on_an_importance_matrix(ftype, without, with_matrix):
    """llama-quant.cpp's has_imatrix branches (checked against llama-quantize itself on the demo:
    bench/results/imatrix_llamacpp.md)."""
    for has, want in ((False, without), (True, with_matrix)):
        t = _types(plan_types(_dense(16, tied=False), ftype, n_layer=16, n_head=8, n_head_kv=2, has_imatrix=has))
        assert [t[f"blk.{i}.ffn_down.weight"] for i in range(3)] == [want, want, FILE_TYPES[ftype].default_type]


def test_tied_embeddings_follow_output_rule():
    t = _types(plan_types(_dense(4), "Q5_K_S", n_layer=4, n_head=8, n_head_kv=2, tied_embeddings=True))
    assert t["token_embd.weight"] == Q.Q6_K
    t = _types(plan_types(_dense(4), "Q8_0", n_layer=4, n_head=8, n_head_kv=2, tied_embeddings=True))
    assert t["token_embd.weight"] == Q.Q8_0
    # no output.weight: llama.cpp treats the embeddings as tied whatever the flag says
    t = _types(plan_types(_dense(4), "Q4_0", n_layer=4, n_head=8, n_head_kv=2, tied_embeddings=False))
    assert t["token_embd.weight"] == Q.Q6_K
    with pytest.raises(ValueError, match="output.weight"):
        plan_types(_dense(4, tied=False), "Q4_0", n_layer=4, n_head=8, n_head_kv=2, tied_embeddings=True)


def test_shape_fallback():
    choices = plan_types(_dense(4, n_embd=576, n_ff=1536), "Q4_K_M", n_layer=4, n_head=9, n_head_kv=3)
    by = {c.name: c for c in choices}
    assert by["blk.0.attn_q.weight"].qtype == Q.Q5_0
    assert "fallback 576 % 256" in by["blk.0.attn_q.weight"].reason
    assert by["blk.3.attn_v.weight"].qtype == Q.Q8_0            # Q6_K (last layer) -> Q8_0
    assert by["blk.0.attn_v.weight"].qtype == Q.Q5_0
    assert by["blk.3.ffn_down.weight"].qtype == Q.Q6_K          # 1536 % 256 == 0
    assert by["blk.1.ffn_down.weight"].qtype == Q.Q4_K
    assert by["token_embd.weight"].qtype == Q.Q8_0
    # row length not a multiple of 32: F16
    t = _types(plan_types(_dense(2, n_embd=256, n_ff=1000), "Q4_0", n_layer=2, n_head=4, n_head_kv=2))
    assert t["blk.0.ffn_down.weight"] == Q.F16
    assert t["blk.0.ffn_up.weight"] == Q.Q4_0


def test_unquantized_file_types_ignore_overrides():
    for ft, q in (("F16", Q.F16), ("BF16", Q.BF16), ("F32", Q.F32)):
        t = _types(plan_types(_dense(2), ft, n_layer=2, n_head=8, n_head_kv=2, overrides=[("attn_v", "q4_0")]))
        assert t["blk.0.attn_v.weight"] == q
        assert t["token_embd.weight"] == q
        assert t["blk.0.attn_norm.weight"] == Q.F32


def test_overrides_first_match_and_counter_shift():
    ovr = [("blk\\.[0-1]\\.ffn_down", "Q8_0"), ("ffn_down", "q2_k"), ("ATTN_Q", "f16")]
    by = {c.name: c for c in plan_types(_dense(8), "Q4_K_M", n_layer=8, n_head=8, n_head_kv=2, overrides=ovr)}
    assert by["blk.0.ffn_down.weight"].qtype == Q.Q8_0
    assert by["blk.2.ffn_down.weight"].qtype == Q.Q2_K          # first matching pattern wins
    assert by["blk.0.attn_q.weight"].qtype == Q.F16             # pattern lower-cased like llama-quantize
    assert "override" in by["blk.0.attn_q.weight"].reason
    # overridden tensors do not advance llama.cpp's counters
    ovr = [("blk\\.[0-1]\\.ffn_down", "Q8_0"), ("blk\\.0\\.attn_v", "q8_0")]
    t = _types(plan_types(_dense(8), "Q4_K_M", n_layer=8, n_head=8, n_head_kv=2, overrides=ovr))
    # layers 2..7 are seen as ffn_down layers 0..5; use_more_bits(., 8) = {0, 3, 6, 7}
    assert [t[f"blk.{i}.ffn_down.weight"] for i in range(2, 8)] == [Q.Q6_K, Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.Q4_K]
    # attn_v of layer i is counted as i-1 (of n_attention_wv = 8)
    assert [t[f"blk.{i}.attn_v.weight"] for i in range(1, 8)] == [Q.Q6_K, Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.Q4_K, Q.Q6_K]


def test_override_is_still_shape_checked():
    t = _types(plan_types(_dense(2, n_embd=576), "Q8_0", n_layer=2, n_head=9, n_head_kv=3,
                          overrides=[("attn_q", "q4_k"), ("attn_k", "iq4_xs")]))
    assert t["blk.0.attn_q.weight"] == Q.Q5_0
    assert t["blk.0.attn_k.weight"] == Q.IQ4_NL


def test_bad_overrides():
    with pytest.raises(ValueError, match="ggml type"):
        plan_types(_dense(2), "Q4_0", n_layer=2, n_head=8, n_head_kv=2, overrides=[("attn_v", "q9_9")])
    with pytest.raises(ValueError, match="pattern"):
        plan_types(_dense(2), "Q4_0", n_layer=2, n_head=8, n_head_kv=2, overrides=[("attn_v(", "q8_0")])
    # validated even where llama.cpp then ignores them (F16 file)
    with pytest.raises(ValueError, match="ggml type"):
        plan_types(_dense(2), "F16", n_layer=2, n_head=8, n_head_kv=2, overrides=[("attn_v", "q9_9")])
    # "REGEX=TYPE" strings are accepted too
    t = _types(plan_types(_dense(2), "Q4_0", n_layer=2, n_head=8, n_head_kv=2, overrides=["attn_v=q8_0"]))
    assert t["blk.0.attn_v.weight"] == Q.Q8_0


def test_pure():
    t = _types(plan_types(_dense(8, tied=False), "Q4_K_M", n_layer=8, n_head=8, n_head_kv=2, pure=True))
    assert {q for n, q in t.items() if "norm" not in n} == {Q.Q4_K}
    # pure still applies the shape fallback
    t = _types(plan_types(_dense(2, n_embd=576), "Q4_K_M", n_layer=2, n_head=9, n_head_kv=3, pure=True))
    assert t["blk.0.attn_v.weight"] == Q.Q5_0
    assert t["token_embd.weight"] == Q.Q5_0
    assert t["blk.0.ffn_down.weight"] == Q.Q4_K
    # pure + override: the override wins
    t = _types(plan_types(_dense(2), "Q4_K_M", n_layer=2, n_head=8, n_head_kv=2, pure=True,
                          overrides=[("attn_v", "q6_k")]))
    assert t["blk.0.attn_v.weight"] == Q.Q6_K and t["blk.0.attn_q.weight"] == Q.Q4_K


def test_gqa_and_70b():
    t = _types(plan_types(_dense(4), "Q2_K", n_layer=4, n_head=8, n_head_kv=2))
    assert t["blk.0.attn_v.weight"] == Q.Q4_K
    t = _types(plan_types(_dense(4), "Q2_K", n_layer=4, n_head=8, n_head_kv=4))
    assert t["blk.0.attn_v.weight"] == Q.Q3_K
    t = _types(plan_types(_dense(80), "Q4_K_M", n_layer=80, n_head=64, n_head_kv=8))
    assert t["blk.20.attn_v.weight"] == Q.Q5_K                  # Q4_K bumped by the 70B rule
    t = _types(plan_types(_dense(80), "Q4_K_M", n_layer=80, n_head=64, n_head_kv=64))
    assert t["blk.20.attn_v.weight"] == Q.Q4_K


def test_moe_layer_from_name():
    tensors = [("token_embd.weight", (256, 100))]
    for i in range(8):
        tensors += [(f"blk.{i}.ffn_gate_inp.weight", (256, 8)),
                    (f"blk.{i}.ffn_down_exps.weight", (512, 256, 8)),
                    (f"blk.{i}.attn_v.weight", (256, 64))]
    with_bad = tensors + [("blk.9.ffn_down_exps.weight", (512, 256, 8))]
    t = _types(plan_types(tensors, "Q4_K_M", n_layer=8, n_head=8, n_head_kv=2, n_expert=8))
    assert t["blk.0.ffn_gate_inp.weight"] == Q.F32
    assert t["blk.0.attn_v.weight"] == Q.Q8_0
    assert [t[f"blk.{i}.ffn_down_exps.weight"] for i in range(8)] == [
        Q.Q6_K if use_more_bits(i, 8) else Q.Q4_K for i in range(8)]
    with pytest.raises(ValueError, match="layer 9"):
        plan_types(with_bad, "Q4_K_M", n_layer=8, n_head=8, n_head_kv=2, n_expert=8)


# file types llama-quantize refuses without an importance matrix (some tensor gets a type that needs one)
_NEEDS_IMATRIX_TO_RECORD = {"Q2_K_S", "IQ3_XS", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S"}


def record(case_names: list[str]) -> None:
    """Add cases to tests/data/gguf_mixture_expected.json from llama.cpp itself: `python
    tests/test_gguf_mixtures.py CASE ...`, a case being FILE_TYPE (importance matrix given when the file type
    needs one) or FILE_TYPE+imatrix."""
    import tempfile

    data = json.loads(DATA.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for name in case_names:
            ftype, _, extra = name.partition("+")
            case = {"file_type": ftype, "overrides": [], "pure": False}
            if extra == "imatrix" or ftype in _NEEDS_IMATRIX_TO_RECORD:
                case["imatrix"] = True
            data["cases"][name] = case
            data["general_file_type"][ftype] = int(FILE_TYPES[ftype].file_type)
            for model_name, model in data["models"].items():
                src = Path(tmp) / f"{model_name}.gguf"
                if not src.exists():
                    write_synthetic_gguf(src, model)
                types, _ = llama_cpp_quantize(src, Path(tmp) / "out.gguf", ftype, imatrix=case.get("imatrix", False))
                model["results"][name] = [types[n] for n, _ in model["tensors"]]
                print(name, model_name, "recorded")
    DATA.write_text(_layout(data))


def _layout(data: dict) -> str:
    """The recording's layout: one line per top-level entry, model field and result list."""
    def c(v, sep=(",", ":")):
        return json.dumps(v, separators=sep)
    lines = ["{"]
    top = [k for k in data if k != "models"]
    for k in top:
        lines.append(f"  {c(k)}: {c(data[k], (', ', ': '))},")
    lines.append('  "models": {')
    for i, (name, model) in enumerate(data["models"].items()):
        lines.append(f"    {c(name)}: {{")
        fields = list(model.items())
        for j, (k, v) in enumerate(fields):
            if k == "results":
                lines.append('      "results": {')
                res = list(v.items())
                lines += [f"        {c(r)}: {c(t)}" + ("," if n < len(res) - 1 else "") for n, (r, t) in enumerate(res)]
                lines.append("      }" + ("," if j < len(fields) - 1 else ""))
            else:
                lines.append(f"      {c(k)}: {c(v, (',', ':') if k in ('hparams', 'tensors') else (', ', ': '))}"
                             + ("," if j < len(fields) - 1 else ""))
        lines.append("    }" + ("," if i < len(data["models"]) - 1 else ""))
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    record(sys.argv[1:])
