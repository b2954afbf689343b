"""transformers' K/V caches as `quantkit eval FOLDER --runtime transformers --kv-cache` runs them: the chunked
feeding changes nothing by itself, each quantized cache really holds what the size table says, and a
quantized cache costs agreement in the order of its bits."""
import importlib.util

import pytest
import torch

from conftest import TINY_TEXT, make_checkpoint
from quantkit import api
from quantkit.eval import transformers_cache
from quantkit.eval.kv_cache import cache_bytes
from quantkit.model.checkpoint import Checkpoint

needs_quanto = pytest.mark.skipif(importlib.util.find_spec("optimum") is None
                                  or importlib.util.find_spec("optimum.quanto") is None,
                                  reason="optimum-quanto is not installed (pip install -e '.[kvcache]')")


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A llama fitted to TINY_TEXT (decisive predictions), 2 KV heads of 32: rows of 64, one quanto group."""
    return make_checkpoint(tmp_path_factory.mktemp("kv") / "src", hidden=128, intermediate=256, heads=4,
                           kv_heads=2, vocab=64, layers=2, train_steps=100)


@pytest.fixture(scope="module")
def nf4(fitted, tmp_path_factory):
    """A bnb folder of the fitted model, and a text to evaluate it on."""
    out = tmp_path_factory.mktemp("kv-nf4")
    (folder,) = api.convert(str(fitted), ["bnb:nf4"], out / "out", options={"device": "cpu"})
    text = out / "eval.txt"
    text.write_text(TINY_TEXT * 8)
    return folder, text


def _hf(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _tokens(folder, n):
    ids = Checkpoint(folder).tokenizer(TINY_TEXT * 8, return_tensors="pt")["input_ids"][0]
    return ids[:n][None]


def test_chunked_feeding_through_the_default_cache_is_the_one_shot_forward(fitted):
    model, tokens = _hf(fitted), _tokens(fitted, 160)
    (chunked,) = transformers_cache.window_logits(model, tokens, "f32")
    with torch.no_grad():
        whole = model(tokens).logits[0]
    assert torch.allclose(chunked, whole, atol=1e-4)


@pytest.mark.parametrize("kind", ["f32", "fp8", pytest.param("int4", marks=needs_quanto),
                                  pytest.param("int2", marks=needs_quanto)])
def test_the_cache_holds_the_bytes_the_size_table_gives(fitted, kind):
    """160 tokens in chunks of 32: transformers re-quantizes everything at the fifth chunk (its 128-token
    residue is full), so the quantized caches hold all 160 positions quantized, nothing beside."""
    model, tokens = _hf(fitted), _tokens(fitted, 160)
    _, cache = transformers_cache.run_window(model, tokens[0], kind)
    config = Checkpoint(fitted).config
    assert transformers_cache.held_bytes(cache) == cache_bytes(config, 160, kind, "transformers")
    assert cache_bytes(config, 160, "f32", "transformers") == 2 * 2 * 160 * 64 * 4


@needs_quanto
def test_a_quantized_cache_costs_agreement_in_the_order_of_its_bits(fitted, nf4):
    """End to end: a bnb folder of the fitted model evaluated in transformers with each cache type."""
    folder, text = nf4
    results = {k: api.evaluate(str(folder), text, base=str(fitted), ctx=128, windows=2, device="cpu",
                               runtime="transformers", kv_cache=k) for k in ("f32", "fp8", "int4", "int2")}
    assert all(r.kv_cache == k and r.runtime == "transformers" for k, r in results.items())
    kld = {k: r.mean_kld for k, r in results.items()}
    assert kld["int2"] > kld["int4"] > kld["f32"] and kld["fp8"] > kld["f32"], kld
    sizes = [results[k].kv_cache_bytes for k in ("f32", "fp8", "int4", "int2")]
    assert sizes == sorted(sizes, reverse=True)


def test_cache_types_are_the_runtimes_own(nf4):
    from quantkit.errors import UsageError
    folder, text = nf4
    with pytest.raises(UsageError, match="f32, fp8, int4, int2"):
        api.evaluate(str(folder), text, ctx=32, windows=1, runtime="transformers", kv_cache="q8_0")
    with pytest.raises(UsageError, match="--runtime transformers"):
        api.evaluate(str(folder), text, ctx=32, windows=1, runtime="quantkit", kv_cache="fp8")
