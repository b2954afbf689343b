"""GGUF with an importance matrix collected in the shared calibration pass (--imatrix)."""
import gguf
import numpy as np
import pytest
import torch

from conftest import run_cli
from quantkit import api
from quantkit.backends.gguf import encoders
from quantkit.calibration import CalibrationSpec, load_calibration
from quantkit.calibration.capture import run_capture
from quantkit.calibration.imatrix import ImatrixCollector
from quantkit.model.checkpoint import Checkpoint

OPTS = {"tokenizer_pre": "gpt-2", "device": "cpu", "calib_samples": 4, "calib_seqlen": 32, "seed": 0}


def test_collector_is_the_mean_square_of_each_linears_input(tiny_gguf_source):
    model = Checkpoint(tiny_gguf_source)
    tokens = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(1))
    collector = ImatrixCollector(model, torch.device("cpu"))
    run_capture(model, tokens, [collector], device=torch.device("cpu"), compute_dtype=torch.float32)
    got = collector.result()
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_gguf_source), dtype=torch.float32).eval()
    seen = {}
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            module.register_forward_pre_hook(  # a pre-hook returning a value would replace the input
                lambda m, args, name=name: seen.__setitem__(name, args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        hf(tokens)
    for name, x in seen.items():  # transformers' own modules' inputs, squared and averaged
        torch.testing.assert_close(got[f"{name}.weight"], x.square().mean(0), rtol=1e-4, atol=1e-6)
    assert len(got) == model.num_layers * 7  # every linear, no head, no embeddings (as llama-imatrix)


def _importance(model, calib_text) -> dict:
    """The importance matrix of the capture pass over the calibration that OPTS asks for."""
    spec = CalibrationSpec(source=str(calib_text), samples=4, seqlen=32, seed=0)
    collector = ImatrixCollector(model, torch.device("cpu"))
    run_capture(model, load_calibration(spec, model).tokens, [collector], device=torch.device("cpu"))
    return collector.result()


def _tensor_bytes(path, name):
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == name)
    return t.tensor_type, np.asarray(t.data).view(np.uint8).reshape(-1)


def test_imatrix_file_uses_the_weighted_quantizers(tiny_gguf_source, calib_text, tmp_path):
    (plain,) = api.convert(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path / "plain", options=OPTS)
    (weighted,) = api.convert(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path / "imx",
                              options={**OPTS, "imatrix": True, "calib": str(calib_text)})
    model = Checkpoint(tiny_gguf_source)
    importance = _importance(model, calib_text)["model.layers.1.mlp.down_proj.weight"]
    qtype, got = _tensor_bytes(weighted, "blk.1.ffn_down.weight")
    _, without = _tensor_bytes(plain, "blk.1.ffn_down.weight")
    src = model.tensor("model.layers.1.mlp.down_proj.weight").float()
    expected = encoders.quantize(src, qtype, imatrix=importance).reshape(-1)
    assert np.array_equal(got, expected)
    assert not np.array_equal(got, without)
    fields = gguf.GGUFReader(str(weighted)).fields
    assert fields["quantize.imatrix.entries_count"].contents() == 2 * 7
    assert fields["quantize.imatrix.chunks_count"].contents() == 4


def test_imatrix_and_gptq_share_one_pass(tiny_gguf_source, calib_text, tmp_path):
    paths = api.convert(str(tiny_gguf_source), ["gguf:Q4_0", "gptq:4bit-g64"], tmp_path,
                        options={**OPTS, "imatrix": True, "calib": str(calib_text)})
    # the GGUF file's record says how it was weighted and from which tokens (it cannot hold that itself)
    assert sorted([p.name for p in paths] + ["llama256-Q4_0.gguf.quantkit.json"]) == sorted(
        p.name for p in tmp_path.iterdir())
    gptq_opts = {k: v for k, v in OPTS.items() if k != "tokenizer_pre"}   # a GGUF option: refused without GGUF
    alone = api.convert(str(tiny_gguf_source), ["gptq:4bit-g64"], tmp_path / "alone",
                        options={**gptq_opts, "calib": str(calib_text)})
    gptq = [p for p in paths if p.is_dir()][0]
    assert (gptq / "model.safetensors").read_bytes() == (alone[0] / "model.safetensors").read_bytes()


@pytest.mark.parametrize("args,message", [
    (["-f", "gguf:Q4_K_M", "--imatrix"], "needs calibration data"),
    (["-f", "gptq:4bit-g64", "--imatrix", "--calib", "x.txt"], "--imatrix weights GGUF"),
])
def test_imatrix_usage_errors(tiny_gguf_source, tmp_path, args, message):
    r = run_cli("convert", str(tiny_gguf_source), *args, "-o", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_each_expert_is_weighted_by_its_own_importance(tmp_path, calib_text):
    """As llama-imatrix keeps one vector per expert: expert e's rows of a stacked ffn_*_exps tensor are quantized
    with the statistic of the tokens routed to e (and unweighted if none reached it)."""
    from conftest import make_checkpoint
    src = make_checkpoint(tmp_path / "moe", model_type="qwen3_moe", hidden=256, intermediate=512, layers=1,
                          vocab=320, bpe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                          norm_topk_prob=True, head_dim=64)
    (weighted,) = api.convert(str(src), ["gguf:Q4_K_M"], tmp_path / "imx",
                              options={**OPTS, "imatrix": True, "calib": str(calib_text)})
    model = Checkpoint(src)
    importance = _importance(model, calib_text)
    qtype, got = _tensor_bytes(weighted, "blk.0.ffn_up_exps.weight")
    names = [f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(4)]
    assert sum(n in importance for n in names) >= 2
    expected = np.concatenate([encoders.quantize(model.tensor(n).float(), qtype, imatrix=importance.get(n)).reshape(-1)
                               for n in names])
    assert np.array_equal(got, expected)
    plain = np.concatenate([encoders.quantize(model.tensor(n).float(), qtype).reshape(-1) for n in names])
    assert not np.array_equal(got, plain)
