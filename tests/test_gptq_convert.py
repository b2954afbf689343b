"""HF checkpoint -> GPTQ folder through the capture pass: files and keys, the staged pass against the plain
decoder, one pass for several artifacts, the dry-run plan, sharding, eval, and bad input."""
import json

import pytest
import torch

from conftest import TINY_TEXT, make_checkpoint, run_cli
from quantkit import api
from quantkit.backends.gptq.reader import GPTQCheckpoint
from quantkit.eval.harness import evaluate
from quantkit.model.checkpoint import Checkpoint
from quantkit.model.safetensors_reader import SafetensorsCheckpoint
from quantkit.calibration.stats import HessianAccumulator

CALIB = {"calib_samples": 4, "calib_seqlen": 32, "seed": 0, "device": "cpu"}


def convert(src, out, *variants, calib=None, **opts):
    options = {**CALIB, "calib": str(calib) if calib else None, **opts}
    return api.convert(str(src), [f"gptq:{v}" for v in variants], out, options=options)


def test_folder_has_what_transformers_gptqmodel_and_vllm_read(tiny_gguf_source, calib_text, tmp_path):
    (folder,) = convert(tiny_gguf_source, tmp_path, "4bit-g128", calib=calib_text)
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "quantize_config.json", "quantkit.json", "tokenizer.json"} <= names
    assert not any(n.startswith(".partial") for n in (p.name for p in tmp_path.iterdir()))
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((folder / "quantize_config.json").read_text())
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym", "format", "checkpoint_format")} == \
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "format": "gptq",
         "checkpoint_format": "gptq"}
    w = SafetensorsCheckpoint(folder)
    q = "model.layers.0.self_attn.q_proj"
    assert f"{q}.weight" not in w
    assert (w.entries[f"{q}.qweight"].dtype, w.entries[f"{q}.qweight"].shape) == ("I32", (256 * 4 // 32, 256))
    assert (w.entries[f"{q}.qzeros"].dtype, w.entries[f"{q}.qzeros"].shape) == ("I32", (2, 256 * 4 // 32))
    assert (w.entries[f"{q}.scales"].dtype, w.entries[f"{q}.scales"].shape) == ("F16", (2, 256))
    assert w.entries[f"{q}.g_idx"].shape == (256,)
    assert set((w.get(f"{q}.qzeros").to(torch.int64) & 0xFFFFFFFF).flatten().tolist()) == {0x77777777}
    assert "lm_head.weight" in w and w.entries["lm_head.weight"].dtype == "BF16"
    info = json.loads((folder / "quantkit.json").read_text())
    assert info["calibration"]["samples"] == 4 and len(info["calibration"]["token_hash"]) == 64
    assert len(info["layers"]) == 2 * 4 and all(x["damp"] >= 0.01 for x in info["layers"])
    assert set(info["files"]) == {"model.safetensors"}


def test_several_artifacts_in_one_pass_equal_each_made_alone(tiny_gguf_source, calib_text, tmp_path):
    both = convert(tiny_gguf_source, tmp_path / "both", "4bit-g64", "3bit-g32-act", calib=calib_text)
    alone = convert(tiny_gguf_source, tmp_path / "alone", "3bit-g32-act", calib=calib_text)
    a = (both[1] / "model.safetensors").read_bytes()
    b = (alone[0] / "model.safetensors").read_bytes()
    assert a == b


def test_reader_matches_the_quantized_weights_and_eval_runs(tiny_gguf_source, calib_text, tmp_path):
    (folder,) = convert(tiny_gguf_source, tmp_path, "8bit-g64", calib=calib_text)
    model, base = GPTQCheckpoint(folder), Checkpoint(tiny_gguf_source)
    w, w0 = model.layer(1), base.layer(1)
    err = (w["mlp.down_proj.weight"] - w0["mlp.down_proj.weight"].float()).abs().max().item()
    assert 0 < err < 0.05  # 8-bit: close to the source, but quantized
    tokens = torch.randint(0, 300, (2, 24))
    r = evaluate(model, tokens, base=base)
    assert r.top1_agreement > 0.7 and r.mean_kld < 0.2  # (a random tiny model is chaotic: ppl ~1e6)


def test_rtn_needs_no_calibration_and_gptq_beats_it(tiny_gguf_source, calib_text, tmp_path):
    rtn, gptq = convert(tiny_gguf_source, tmp_path, "3bit-g32-rtn", "3bit-g32", calib=calib_text)
    assert json.loads((rtn / "quantkit.json").read_text())["calibration"] is None
    base = Checkpoint(tiny_gguf_source)
    tokens = Checkpoint(tiny_gguf_source).tokenizer(TINY_TEXT, return_tensors="pt")["input_ids"][:, :96].view(3, 32)
    kld = [evaluate(GPTQCheckpoint(f), tokens, base=base).mean_kld for f in (rtn, gptq)]
    assert kld[1] < kld[0]


def test_asymmetric_is_written_as_v2_and_read_back(tiny_gguf_source, calib_text, tmp_path):
    (folder,) = convert(tiny_gguf_source, tmp_path, "4bit-g32-asym-rtn")
    qc = json.loads((folder / "quantize_config.json").read_text())
    assert (qc["sym"], qc["format"]) == (False, "gptq_v2")
    ckpt = GPTQCheckpoint(folder)
    w = ckpt.layer(0)["self_attn.o_proj.weight"]
    w0 = Checkpoint(tiny_gguf_source).layer(0)["self_attn.o_proj.weight"].float()
    g_idx = ckpt.weights.get("model.layers.0.self_attn.o_proj.g_idx").long()
    scale = ckpt.weights.get("model.layers.0.self_attn.o_proj.scales").float()[g_idx].T
    # Round to nearest on an asymmetric grid: every weight within half a step (a zero read off by one would not be).
    assert ((w - w0).abs() <= 0.51 * scale).all()


def test_sharded_output_and_the_plan_agree_with_the_files(tiny_gguf_source, calib_text, tmp_path):
    (plan,) = api.plan(str(tiny_gguf_source), ["gptq:4bit-g64-act"], tmp_path, {**CALIB, "calib": str(calib_text)})
    (folder,) = convert(tiny_gguf_source, tmp_path, "4bit-g64-act", calib=calib_text, max_shard_bytes=400_000)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    w = SafetensorsCheckpoint(folder)
    assert set(index["weight_map"]) == set(w.names())
    data = sum(e.nbytes for e in w.entries.values())
    assert plan.total_bytes == data == index["metadata"]["total_size"]
    assert GPTQCheckpoint(folder).layer(1)["mlp.up_proj.weight"].shape == (512, 256)


def test_cli_dry_run_writes_nothing(tiny_gguf_source, tmp_path):
    r = run_cli("convert", str(tiny_gguf_source), "-f", "gptq:4bit-g128-act", "-o", str(tmp_path / "o"), "--dry-run",
                "--json", "--calib", "x.txt")
    assert r.returncode == 0, r.stderr
    (plan,) = json.loads(r.stdout)["plans"]
    assert plan["format"] == "gptq" and plan["bits_per_weight"] < 16
    assert "peak memory (estimate)" in plan["extra"] and "time (estimate)" in plan["extra"]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args,code,message", [
    (["-f", "gptq:5bit-g128"], 2, "5-bit GPTQ is not supported"),
    (["-f", "gptq:4bit-g96"], 2, "does not divide the input dimension"),
    (["-f", "gptq:4bit-g128-wat"], 2, "unknown option"),
    (["-f", "gptq:4bit-g128"], 2, "needs calibration data"),
    (["-f", "gptq:4bit-g128", "--calib", "CALIB", "--calib-samples", "500"], 6, "tokens"),
    (["-f", "gptq:4bit-g128", "--calib", "CALIB", "--damp", "1.5"], 2, "--damp"),
])
def test_bad_input_is_one_line_and_leaves_nothing(tiny_gguf_source, calib_text, tmp_path, args, code, message):
    out = tmp_path / "o"
    args = [str(calib_text) if a == "CALIB" else a for a in args]
    r = run_cli("convert", str(tiny_gguf_source), *args, "--calib-seqlen", "32", "-o", str(out))
    assert r.returncode == code, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"])
def test_nan_weights_or_activations_fail_cleanly(tmp_path, calib_text, tensor):
    """Refused by name before the layer's work starts (a NaN norm would otherwise surface as a Hessian that is
    not finite, naming nothing)."""
    message = f"{tensor}: contains NaN or infinite values"
    src = make_checkpoint(tmp_path / "nan", hidden=64, intermediate=128, vocab=320, bpe=True)
    from safetensors.torch import load_file, save_file
    f = src / "model.safetensors"
    t = load_file(f)
    t[tensor].view(-1)[5] = float("nan")
    save_file(t, f, metadata={"format": "pt"})
    out = tmp_path / "o"
    r = run_cli("convert", str(src), "-f", "gptq:4bit-g32", "--calib", str(calib_text), "--calib-samples", "2",
                "--calib-seqlen", "16", "-o", str(out))
    assert r.returncode == 9, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not any(out.iterdir())


def test_inspect_describes_a_gptq_folder(tiny_gguf_source, calib_text, tmp_path):
    (folder,) = convert(tiny_gguf_source, tmp_path, "3bit-g64-act", calib=calib_text)
    r = run_cli("inspect", str(folder), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["kind"], info["bits"], info["group_size"], info["desc_act"]) == ("gptq", 3, 64, True)
    assert info["quantized_weights"] == 2 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 512)  # q,o + k,v + mlp


def test_interrupted_run_leaves_no_partial_artifact(tiny_gguf_source, calib_text, tmp_path, monkeypatch):
    from quantkit.backends.gptq import job

    calls = {"n": 0}
    real = job.gptq_quantize

    def interrupt_on_third(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(job, "gptq_quantize", interrupt_on_third)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_gguf_source, tmp_path, "4bit-g64", calib=calib_text)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hessian_is_the_float32_mean_of_outer_products(dtype):
    x = (torch.randn(3000, 96) * torch.rand(96) * 5).to(dtype)
    acc = HessianAccumulator(96, torch.device("cpu"))
    for chunk in x.split(700):
        acc.add(chunk)
    exact = (x.double().T @ x.double()) / 3000
    assert ((acc.value().double() - exact).norm() / exact.norm()).item() < 1e-6


def test_self_generated_calibration_needs_no_dataset(tiny_gguf_source, tmp_path):
    (folder,) = api.convert(str(tiny_gguf_source), ["gptq:4bit-g64"], tmp_path,
                            options={"calib": "self", "calib_samples": 2, "calib_seqlen": 16, "device": "cpu"})
    calib = json.loads((folder / "quantkit.json").read_text())["calibration"]
    assert calib["source"] == "self" and calib["samples"] == 2 and len(calib["token_hash"]) == 64
    assert GPTQCheckpoint(folder).layer(0)["self_attn.q_proj.weight"].shape == (256, 256)


def test_qwen2_biases_are_kept_in_float16(tmp_path):
    src = make_checkpoint(tmp_path / "qwen2", "qwen2", hidden=64, intermediate=128, heads=2, kv_heads=1, vocab=320,
                          bpe=True)
    (folder,) = api.convert(str(src), ["gptq:4bit-g32-rtn"], tmp_path / "out", options={"device": "cpu"})
    w, base = SafetensorsCheckpoint(folder), Checkpoint(src)
    for p in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.1.self_attn.{p}.bias"
        assert w.entries[name].dtype == "F16"
        assert torch.equal(w.get(name), base.tensor(name).to(torch.float16))
    assert GPTQCheckpoint(folder).layer(1)["self_attn.q_proj.bias"].dtype == torch.float16


def test_moe_experts_are_quantized_from_their_routed_tokens(tmp_path, calib_text):
    """Mixture of experts: each expert's Hessian comes from the tokens routed to it; quantkit.json records how
    many each saw; an expert no token reached is rounded to nearest (and says so); every expert's weights
    reconstruct from its codes; the router stays unquantized."""
    src = make_checkpoint(tmp_path / "moe", model_type="qwen2_moe", hidden=64, layers=2, heads=4, kv_heads=2,
                          intermediate=128, vocab=64, num_experts=8, num_experts_per_tok=1, moe_intermediate_size=64,
                          shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])
    (folder,) = convert(src, tmp_path / "out", "4bit-g32", calib=calib_text, calib_samples=1, calib_seqlen=6)
    info = json.loads((folder / "quantkit.json").read_text())
    for layer in range(2):
        gate_up = [e for e in info["layers"] if e["layer"] == layer and e["linears"][0].startswith("mlp.experts.")
                   and e["linears"][0].endswith("gate_proj")]
        assert len(gate_up) == 8
        assert sum(e["tokens"] for e in gate_up) == 6          # top-1: every token reaches one expert
        unreached = [e for e in gate_up if e["tokens"] == 0]
        assert unreached and all("round-to-nearest" in e["method"] for e in unreached)
    quantized, base = GPTQCheckpoint(folder), Checkpoint(src)
    w, w0 = quantized.layer(1), base.layer(1)
    for e in range(8):
        name = f"mlp.experts.{e}.down_proj.weight"
        err = (w[name] - w0[name].float()).abs().max().item()
        assert 0 < err < 0.25 * w0[name].float().abs().max().item(), (e, err)
    stored = SafetensorsCheckpoint(folder)
    assert "model.layers.0.mlp.gate.weight" in stored and "model.layers.0.mlp.experts.3.up_proj.qweight" in stored
