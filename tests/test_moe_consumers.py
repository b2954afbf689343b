"""Mixtures of experts in their consumer, for every folder format that stores experts one linear each (GPTQ,
AWQ): transformers 5 fuses experts and cannot take per-expert quantized linears, so the consumer is GPTQModel's
own loader; its predictions agree with quantkit's reader on a fitted tiny qwen2_moe (routed experts, a shared
expert and its gate)."""
import importlib.util

import pytest

from conftest import TINY_TEXT, make_checkpoint
from quantkit import api
from quantkit.backends.awq import consumer as awq_consumer
from quantkit.backends.awq.reader import AWQCheckpoint
from quantkit.backends.gptq import consumer as gptq_consumer
from quantkit.backends.gptq.reader import GPTQCheckpoint
from quantkit.eval.harness import window_logits
from quantkit.model.checkpoint import Checkpoint

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None,
                                reason="gptqmodel is not installed (pip install -e '.[gptq]' && pip install --no-deps gptqmodel)")

FORMATS = {"gptq:4bit-g32": (GPTQCheckpoint, gptq_consumer), "awq:4bit-g32": (AWQCheckpoint, awq_consumer)}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("moe") / "src", "qwen2_moe", hidden=64, intermediate=128,
                           heads=4, kv_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
                           train_steps=60)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_mixture_of_experts_loads_in_gptqmodel_and_agrees(moe, fmt, tmp_path):
    reader, consumer = FORMATS[fmt]
    text = tmp_path / "calib.txt"
    text.write_text(TINY_TEXT * 3)
    (folder,) = api.convert(str(moe), [fmt], tmp_path / "out",
                            options={"calib": str(text), "calib_samples": 8, "calib_seqlen": 32, "device": "cpu"})
    assert reader(folder).has_experts
    tokens = Checkpoint(moe).tokenizer(TINY_TEXT, return_tensors="pt")["input_ids"][:, :128].view(4, 32)
    ours, theirs = window_logits(reader(folder), tokens), consumer.window_logits(folder, tokens)
    same = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ours, theirs))
    assert same / tokens.numel() >= 0.97
