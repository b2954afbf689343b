"""The harness's metrics, checked against direct formulas (its forward is the engine's: test_block_engine.py)."""
import math

import pytest
import torch

from conftest import make_checkpoint
from quantkit.eval.harness import evaluate, load_windows
from quantkit.errors import DataError
from quantkit.model.checkpoint import Checkpoint


def hf_logits(folder, tokens):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def direct_metrics(logits, logits_base, tokens):
    """Perplexity, KL(base || model) and top-1 agreement written out token by token."""
    nll, kld, agree, n = 0.0, 0.0, 0, 0
    for w in range(tokens.shape[0]):
        for t in range(tokens.shape[1] - 1):
            p = torch.softmax(logits[w, t].double(), -1)
            pb = torch.softmax(logits_base[w, t].double(), -1)
            nll -= math.log(p[tokens[w, t + 1]].item())
            kld += float((pb * (pb.log() - p.log())).sum())
            agree += int(p.argmax() == pb.argmax())
            n += 1
    return math.exp(nll / n), kld / n, agree / n


def test_metrics_match_direct_computation(tmp_path, tiny_text):
    base = Checkpoint(make_checkpoint(tmp_path / "base", seed=1))
    other = Checkpoint(make_checkpoint(tmp_path / "other", seed=2))
    tokens = load_windows(base.tokenizer, tiny_text, ctx=16, windows=5)
    result = evaluate(other, tokens, base=base)
    ppl, kld, top1 = direct_metrics(hf_logits(other.folder, tokens), hf_logits(base.folder, tokens), tokens)
    assert result.tokens_scored == 5 * 15
    assert result.perplexity == pytest.approx(ppl, rel=1e-4)
    assert result.mean_kld == pytest.approx(kld, rel=1e-3, abs=1e-6)
    assert result.top1_agreement == pytest.approx(top1)
    same = evaluate(base, tokens, base=base)
    assert same.mean_kld == pytest.approx(0.0, abs=1e-6) and same.top1_agreement == 1.0
    assert same.perplexity == pytest.approx(result.base_perplexity, rel=1e-6)


def test_windows_are_non_overlapping_slices_of_the_whole_text(tiny_llama, tiny_text):
    tok = Checkpoint(tiny_llama).tokenizer
    ids = tok(tiny_text.read_text(), add_special_tokens=False)["input_ids"]
    windows = load_windows(tok, tiny_text, ctx=10, windows=7)
    assert windows.flatten().tolist() == ids[:70]


def test_too_little_text_says_how_much_there_is(tiny_llama, tiny_text):
    tok = Checkpoint(tiny_llama).tokenizer
    with pytest.raises(DataError, match=r"tokens make only \d+ windows of 512; asked for 40"):
        load_windows(tok, tiny_text, ctx=512, windows=40)
