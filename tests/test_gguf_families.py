"""GGUF for every family: the file quantkit writes has the names and metadata keys of llama.cpp's own
convert_hf_to_gguf.py (where its source is at hand), loads in llama.cpp, and llama.cpp's logits agree with
quantkit's own reading of the same file (F16 and Q4_K_M)."""
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from conftest import LLAMA3_ROPE, ROOT, TINY_TEXT, make_checkpoint
from quantkit import api
from quantkit.backends.gguf import llamacpp
from quantkit.backends.gguf.reader import GGUFModel
from quantkit.eval.harness import Scores, evaluate, load_windows, window_logits
from quantkit.model.checkpoint import Checkpoint

# rows of 256 so every K-quant applies; query scale = 1/sqrt(head_dim), the one llama.cpp's gemma archs use
FAMILIES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 64}),
    "gemma2": ("gemma2", {"tie": True, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 32,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    # six layers: llama.cpp places Gemma 3's global layers itself, every sixth (the transformers default)
    "gemma3": ("gemma3_text", {"layers": 6, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 32,
                               "rope_parameters": {
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}}),
    # global layers where llama.cpp would not put them: quantkit lists them in the file (the converter does not)
    "gemma3-layer-types": ("gemma3_text", {"layers": 3, "head_dim": 64, "query_pre_attn_scalar": 64,
                                           "sliding_window": 16, "layer_types": [
                                               "sliding_attention", "full_attention", "sliding_attention"]}),
    # the same language model inside an image-text-to-text checkpoint (a vision tower beside it)
    "gemma3-multimodal": ("gemma3", {"layers": 6, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 32}),
    "phi3": ("phi3", {"pad_token_id": 0}),
    "phi3-longrope": ("phi3", {"pad_token_id": 0, "original_max_position_embeddings": 32, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.05 * i for i in range(24)], "long_factor": [1.5 + 0.1 * i for i in range(24)]}}),
    # mixtures of experts: 4 experts, top-2; expert rows of 256 for the K-quants
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                                "shared_expert_intermediate_size": 512}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                                "norm_topk_prob": True, "head_dim": 64}),
}
CTX = 64
# keys quantkit writes beyond llama.cpp's converter, on purpose (see metadata.py)
BEYOND_CONVERTER = {"gemma3-layer-types": {"gemma3.attention.sliding_window_pattern"}}


_SOURCES: dict[str, Path] = {}


@pytest.fixture(scope="module")
def family_source(tmp_path_factory):
    """key -> a tiny checkpoint of that family fitted to TINY_TEXT for 30 steps (decisive predictions), made once."""
    def make(key: str) -> Path:
        if key not in _SOURCES:
            model_type, extra = FAMILIES[key]
            extra = dict(extra)
            # the folder names the model: llama.cpp gives models *named* phi3 the special tokens of Phi-3's
            # tokenizer, which the tiny one lacks
            _SOURCES[key] = make_checkpoint(tmp_path_factory.mktemp("families") / "tiny", model_type=model_type,
                                            hidden=256, intermediate=512, heads=4, kv_heads=2,
                                            layers=extra.pop("layers", 2), tie=extra.pop("tie", False), vocab=320,
                                            bpe=True, weight_std=0.03,
                                            train_steps=30, **extra)
        return _SOURCES[key]
    return make


def llama_cpp_source() -> Path | None:
    """llama.cpp's converter sources: $QUANTKIT_LLAMACPP_SRC (.ci/run unpacks them there from the sdist)."""
    for p in (os.environ.get("QUANTKIT_LLAMACPP_SRC"), ROOT / ".ci-cache" / "llama.cpp"):
        if p and (Path(p) / "convert_hf_to_gguf.py").is_file():
            return Path(p)
    return None


def metadata(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    kv = {}
    for k, f in r.fields.items():
        if k.startswith(("GGUF.", "tokenizer.", "general.")):
            continue  # the tokenizer is the converter's GPT-2 fallback here; general.* names the run
        kv[k] = f.contents()
    tensors = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name) for t in r.tensors}
    return kv, tensors


@pytest.mark.skipif(llama_cpp_source() is None, reason="llama.cpp's convert_hf_to_gguf.py not found "
                    "(set QUANTKIT_LLAMACPP_SRC; .ci/run unpacks it from the llama-cpp-python sdist)")
@pytest.mark.parametrize("key", list(FAMILIES))
def test_names_and_metadata_match_llama_cpps_converter(tmp_path, family_source, key):
    src = family_source(key)
    (ours,) = api.convert(str(src), ["gguf:F32"], tmp_path / "out", options={"tokenizer_pre": "gpt-2"})
    ref = tmp_path / "ref.gguf"
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "_llamacpp_convert.py"), str(llama_cpp_source()),
                          str(src), str(ref)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (kv, tensors), (kv_ref, tensors_ref) = metadata(ours), metadata(ref)
    extra = BEYOND_CONVERTER.get(key, set())
    assert extra <= set(kv)
    assert {k: v for k, v in kv.items() if k not in extra} == kv_ref
    assert tensors == tensors_ref
    data = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(ours)).tensors}
    for t in gguf.GGUFReader(str(ref)).tensors:   # F32: the values themselves (norm shift, q/k order, rope_freqs)
        np.testing.assert_allclose(data[t.name], np.asarray(t.data), rtol=0, atol=1e-6, err_msg=t.name)


def llama_cpp_scores(path: Path, tokens: torch.Tensor) -> tuple[list[torch.Tensor], float]:
    lc = llamacpp.load_llama_cpp()
    llm = lc.Llama(str(path), n_ctx=CTX, n_batch=CTX, n_ubatch=CTX, logits_all=True, verbose=False, n_threads=2,
                   type_k=0, type_v=0)   # f32 KV cache: the comparison is about the weights
    s, logits = Scores(), []
    for wi, w in enumerate(tokens.tolist()):
        llm.reset()
        llm.eval(w)
        x = torch.from_numpy(np.array(llm.scores[:CTX], dtype=np.float32))
        logits.append(x)
        s.add(x[:-1], tokens[wi, 1:])
    llm.close()
    return logits, s.result(model="llama.cpp", base=None, data="", ctx=CTX, windows=len(logits)).perplexity


@pytest.mark.slow
@pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python (quantkit[llamacpp]) not installed")
@pytest.mark.parametrize("key", list(FAMILIES))
def test_f16_and_q4_k_m_run_in_llama_cpp_as_quantkit_reads_them(tmp_path, family_source, key):
    src = family_source(key)
    f16, q4 = api.convert(str(src), ["gguf:F16", "gguf:Q4_K_M"], tmp_path / "out", options={"tokenizer_pre": "gpt-2"})
    text = tmp_path / "t.txt"
    text.write_text(TINY_TEXT)
    model = Checkpoint(src)
    tokens = load_windows(model.tokenizer, text, ctx=CTX, windows=3)
    for path, emulate in ((f16, "exact"), (q4, "llama.cpp")):
        theirs, ppl_theirs = llama_cpp_scores(path, tokens)
        mine = GGUFModel(path, base=model, activations=emulate)
        ours = list(window_logits(mine, tokens))
        agree = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ours, theirs)) / tokens.numel()
        assert agree >= 0.99, (path.name, agree)
        if path is f16:
            assert ppl_theirs == pytest.approx(evaluate(mine, tokens).perplexity, rel=0.005)


@pytest.mark.parametrize("key", ["gemma2", "gemma3", "gemma3-layer-types", "llama", "llama3-rope", "phi3",
                                 "phi3-longrope", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_quantkit_reads_its_f32_file_as_the_source(tmp_path, family_source, key):
    """The reader undoes what the writer did (Gemma's +1 norms, the tied head, llama's q/k order) and reads back
    what llama.cpp reads (Gemma 3's listed global layers): with the llama.cpp test above, llama.cpp runs the
    checkpoint's model."""
    src = family_source(key)
    (path,) = api.convert(str(src), ["gguf:F32"], tmp_path / "out", options={"tokenizer_pre": "gpt-2"})
    tokens = torch.randint(0, 320, (2, CTX), generator=torch.Generator().manual_seed(0))
    a = torch.stack(list(window_logits(Checkpoint(src), tokens)))
    b = torch.stack(list(window_logits(GGUFModel(path), tokens)))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_an_untied_gemma2_head_is_refused_not_dropped(tmp_path):
    src = make_checkpoint(tmp_path / "g", model_type="gemma2", hidden=256, intermediate=512, heads=4, kv_heads=2,
                          layers=2, vocab=320, bpe=True, head_dim=64, tie=False)
    with pytest.raises(Exception, match="separate tensor"):
        api.convert(str(src), ["gguf:F16"], tmp_path / "out", options={"tokenizer_pre": "gpt-2"})
    assert not list((tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else True


@pytest.mark.parametrize("model_type, extra, words", [
    ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1]}, "dense MLP"),
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False}, "always renormalises")])
def test_experts_llama_cpp_would_run_differently_are_refused_in_one_line(tmp_path, model_type, extra, words):
    """llama.cpp builds experts in every layer and fixes the renormalisation per architecture."""
    from conftest import run_cli
    src = make_checkpoint(tmp_path / "moe", model_type=model_type, **extra)
    r = run_cli("convert", str(src), "-f", "gguf:Q8_0", "-o", str(tmp_path / "out"))
    assert r.returncode == 4 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_q4_k_m_of_experts_follows_llama_quantizes_rules(family_source):
    """The expert tensors take the ffn rules by the block number in their name (two ffn_down per layer here: a
    counter would give blk.0's second one layer 1's type), and the 8-expert bumps (attn_k Q8_0) stay off."""
    from quantkit.backends.gguf import BACKEND
    model = Checkpoint(family_source("qwen2_moe"))
    plan = BACKEND.plan(model, BACKEND.parse_variant("Q4_K_M"), Path("."), BACKEND.settings({}))
    kinds = {r.tensor: r.kind for r in plan.rows}
    assert kinds["blk.0.ffn_down_exps.weight"] == kinds["blk.0.ffn_down_shexp.weight"] == "Q4_K"
    assert kinds["blk.1.ffn_down_exps.weight"] == kinds["blk.1.ffn_down_shexp.weight"] == "Q6_K"  # use_more_bits(1, 2)
    assert kinds["blk.0.ffn_gate_exps.weight"] == kinds["blk.0.ffn_up_exps.weight"] == "Q4_K"
    assert kinds["blk.0.ffn_gate_inp.weight"] == "F32" and kinds["blk.0.attn_k.weight"] == "Q4_K"


def test_a_tied_qwen2_moe_gets_the_output_tensor_llama_cpp_requires(tmp_path):
    """llama.cpp's qwen2moe has no tied head: the embedding is written as output.weight too."""
    src = make_checkpoint(tmp_path / "q", model_type="qwen2_moe", hidden=256, intermediate=512, heads=4, kv_heads=2,
                          layers=1, vocab=320, bpe=True, tie=True, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=256, shared_expert_intermediate_size=256)
    (path,) = api.convert(str(src), ["gguf:F32"], tmp_path / "out", options={"tokenizer_pre": "gpt-2"})
    data = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    np.testing.assert_array_equal(data["output.weight"], data["token_embd.weight"])
    tokens = torch.randint(0, 320, (1, CTX), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch.stack(list(window_logits(GGUFModel(path), tokens))),
                               torch.stack(list(window_logits(Checkpoint(src), tokens))), atol=1e-4, rtol=1e-4)
    if llamacpp.available():
        lc = llamacpp.load_llama_cpp()
        llm = lc.Llama(str(path), n_ctx=CTX, verbose=False, n_threads=2)   # loads: the tensor it requires is there
        llm.close()


def test_the_language_model_inside_a_multimodal_gemma3_makes_the_text_only_file(tmp_path):
    """Gemma 3's image-text-to-text checkpoint gives the GGUF of its language model alone: the same tensors and
    keys as the text-only checkpoint of that language model; the vision tower is left out, and the plan says so."""
    kw = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, layers=2, vocab=320, bpe=True, head_dim=64,
              sliding_window=32)
    text = make_checkpoint(tmp_path / "text", model_type="gemma3_text", **kw)
    both = make_checkpoint(tmp_path / "both", model_type="gemma3", **kw)
    (a,) = api.convert(str(text), ["gguf:F32"], tmp_path / "a", options={"tokenizer_pre": "gpt-2"})
    (b,) = api.convert(str(both), ["gguf:F32"], tmp_path / "b", options={"tokenizer_pre": "gpt-2"})
    assert metadata(a) == metadata(b)
    data = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(a)).tensors}
    for t in gguf.GGUFReader(str(b)).tensors:
        np.testing.assert_array_equal(np.asarray(t.data), data[t.name], err_msg=t.name)
    plans = api.plan(str(both), ["gguf:Q4_K_M"], tmp_path / "c", options={})
    assert "vision_tower." in plans[0].extra["left out"] and "mmproj" in plans[0].extra["left out"]
