"""bnb artifacts: the folder transformers + bitsandbytes would save (tensor for tensor, and the config), written
by streaming; read back as bitsandbytes dequantizes; loaded by transformers' from_pretrained on the CPU."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import WIKI_TEST, make_checkpoint, needs_shared_data, run_cli
from quantkit import api
from quantkit.backends.bnb.reader import BnbCheckpoint
from quantkit.model.safetensors_reader import SafetensorsCheckpoint

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                reason="bitsandbytes is not installed (pip install -e '.[bnb]')")


def transformers_config(variant: str, compute_dtype=torch.bfloat16, skip=None):
    from transformers import BitsAndBytesConfig
    if variant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    parts = variant.split("-")   # transformers has no block-size option: it always uses bitsandbytes' 64
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=parts[0], bnb_4bit_use_double_quant="dq" in parts,
                              bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=skip)


def transformers_save(source, variant: str, out: Path, **kw) -> Path:
    """What a user does today: quantize on load with transformers + bitsandbytes, then save_pretrained."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(source), quantization_config=transformers_config(variant, **kw),
                                                 device_map="cpu")
    model.save_pretrained(str(out))
    return out


def assert_same_checkpoint(ours: Path, theirs: Path) -> int:
    a, b = SafetensorsCheckpoint(ours), SafetensorsCheckpoint(theirs)
    assert set(a.names()) == set(b.names())
    for name in a.names():
        x, y = a.get(name), b.get(name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim() else y), name
    qa = json.loads((ours / "config.json").read_text())["quantization_config"]
    qb = json.loads((theirs / "config.json").read_text())["quantization_config"]
    assert qa == qb
    return len(a.names())


def convert(source, variants, out, **options):
    return api.convert(str(source), [f"bnb:{v}" for v in variants], out, options={"device": "cpu", **options})


def test_tiny_folders_equal_what_transformers_saves(tmp_path):
    """Every variant, from one read of a tiny model with a 40-wide hidden size (blocks of 64 span rows) and an
    untied head; bf16 compute as the config records it."""
    src = make_checkpoint(tmp_path / "src", hidden=40, intermediate=96, heads=4, kv_heads=2)
    variants = ["nf4", "fp4", "nf4-dq", "fp4-dq", "int8"]
    folders = convert(src, variants, tmp_path / "ours")
    for v, folder in zip(variants, folders):
        n = assert_same_checkpoint(folder, transformers_save(src, v, tmp_path / f"ref-{v}"))
        assert n > 20, v


@pytest.mark.parametrize("variant,block", [("nf4-b32", 32), ("fp4-dq-b128", 128), ("nf4-dq-b4096", 4096)])
def test_other_block_sizes_are_bitsandbytes_own_quant_states(tmp_path, variant, block):
    """transformers cannot choose a block size; bitsandbytes can.  Each linear's tensors equal its own
    quantize_4bit + QuantState.as_dict(packed=True) at that block size, under the keys Linear4bit saves."""
    import bitsandbytes.functional as F
    src = make_checkpoint(tmp_path / "src", hidden=40, intermediate=96)
    (folder,) = convert(src, [variant], tmp_path / "o")
    ours, source = SafetensorsCheckpoint(folder), SafetensorsCheckpoint(src)
    name = "model.layers.1.mlp.gate_proj"
    w = source.get(f"{name}.weight")
    packed, state = F.quantize_4bit(w, blocksize=block, compress_statistics="dq" in variant,
                                    quant_type=variant.split("-")[0])
    expected = {f"{name}.weight": packed, **{f"{name}.weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    assert {n for n in ours.names() if n.startswith(f"{name}.")} == set(expected)
    for key, t in expected.items():
        assert torch.equal(ours.get(key), t), key


def test_fused_tensors_bias_and_skip_modules_follow_transformers(tmp_path):
    """Phi-3's joined qkv_proj is converted as one linear, qwen2's biases stay in the source dtype, and
    --skip-modules leaves the named modules unconverted (lm_head with them, here and in transformers)."""
    phi3 = make_checkpoint(tmp_path / "phi3", "phi3", hidden=64, intermediate=128, pad_token_id=0)
    (folder,) = convert(phi3, ["nf4-dq"], tmp_path / "o1")
    assert_same_checkpoint(folder, transformers_save(phi3, "nf4-dq", tmp_path / "r1"))
    assert "model.layers.0.self_attn.qkv_proj.weight.absmax" in SafetensorsCheckpoint(folder)

    qwen = make_checkpoint(tmp_path / "qwen2", "qwen2", hidden=64, intermediate=128, dtype=torch.float16)
    (folder,) = convert(qwen, ["nf4"], tmp_path / "o2", skip_modules=["mlp.down_proj"])
    assert_same_checkpoint(folder, transformers_save(qwen, "nf4", tmp_path / "r2", compute_dtype=torch.float16,
                                                     skip=["mlp.down_proj", "lm_head"]))
    w = SafetensorsCheckpoint(folder)
    assert w.entries["model.layers.0.self_attn.q_proj.bias"].dtype == "F16"
    assert w.entries["model.layers.1.mlp.down_proj.weight"].dtype == "F16"   # skipped: as stored
    assert w.entries["lm_head.weight"].dtype == "F16"


def test_plan_sizes_are_the_written_sizes_and_shards_load(tmp_path):
    src = make_checkpoint(tmp_path / "src", hidden=64, intermediate=128)
    for v in ("nf4", "int8", "nf4-dq"):
        (plan,) = api.plan(str(src), [f"bnb:{v}"], tmp_path / v, {})
        (folder,) = convert(src, [v], tmp_path / v, max_shard_bytes=20_000)
        shards = sorted(folder.glob("*.safetensors"))
        assert len(shards) > 1
        w = SafetensorsCheckpoint(folder)
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        written = sum(e.nbytes for e in w.entries.values())
        assert index["metadata"]["total_size"] == written
        from safetensors import safe_open   # the real library accepts every shard (late tensors' rewritten headers)
        for shard in shards:
            with safe_open(str(shard), "pt") as f:
                assert all(f.get_tensor(k).numel() >= 0 for k in f.keys())
        if v == "nf4-dq":   # the JSON quant state holds a data-dependent decimal: a few bytes per linear
            assert abs(plan.total_bytes - written) <= 8 * 14 and "size" in plan.extra
        else:
            assert plan.total_bytes == written
        info = json.loads((folder / "quantkit.json").read_text())
        assert info["format"] == "bnb" and info["converted_linears"] == 14 and set(info["files"]) == {p.name for p in shards}


def test_reader_dequantizes_as_bitsandbytes_and_transformers_runs_it(tmp_path):
    """Each converted module that transformers loads, dequantized by bitsandbytes itself, equals quantkit's reader;
    and the whole model's logits follow (bf16 compute)."""
    import bitsandbytes as bnb
    from quantkit.backends.bnb import consumer
    from quantkit.eval.harness import window_logits
    src = make_checkpoint(tmp_path / "src", hidden=64, intermediate=128, train_steps=150)
    variants = ["nf4", "fp4-dq", "nf4-b32", "int8"]
    tokens = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    for v, folder in zip(variants, convert(src, variants, tmp_path / "o")):
        model, ours = consumer.load(folder, exact=True), BnbCheckpoint(folder)
        emulated = BnbCheckpoint(folder, "bitsandbytes" if v == "int8" else "exact")
        checked = 0
        for name, module in model.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                theirs = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            elif isinstance(module, bnb.nn.Linear8bitLt):
                theirs = bnb.functional.int8_vectorwise_dequant(module.weight.data, module.weight.SCB)
            else:
                continue
            assert torch.equal(theirs, ours.linear_weight(name).to(theirs.dtype)), (v, name)
            checked += 1
        assert checked == 14, v
        same = sum((a.argmax(-1) == b.argmax(-1)).sum().item()
                   for a, b in zip(window_logits(emulated, tokens), consumer.window_logits(folder, tokens, exact=True)))
        assert same / tokens.numel() >= 0.99, v


def test_one_run_writes_bnb_beside_gguf_and_eval_reads_it(tmp_path):
    src = make_checkpoint(tmp_path / "src", hidden=64, intermediate=128, vocab=320, bpe=True, train_steps=100)
    folders = api.convert(str(src), ["bnb:nf4", "gguf:Q8_0"], tmp_path / "o", options={"device": "cpu", "tokenizer_pre": "gpt-2"})
    assert folders[0].is_dir() and folders[1].suffix == ".gguf"
    r = run_cli("inspect", str(folders[0]), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["kind"], info["quant_type"], info["converted_linears"]) == ("bnb", "nf4", 14)
    text = tmp_path / "t.txt"
    from conftest import TINY_TEXT
    text.write_text(TINY_TEXT)
    ppl = {}
    for runtime in ("quantkit", "transformers"):
        r = run_cli("eval", str(folders[0]), "--data", str(text), "--ctx", "32", "--windows", "2", "--json",
                    "--runtime", runtime)
        assert r.returncode == 0, r.stderr
        ppl[runtime] = json.loads(r.stdout)["perplexity"]
    assert abs(ppl["transformers"] / ppl["quantkit"] - 1) < 0.02, ppl   # bf16 activations there, float32 here


@pytest.mark.parametrize("args,code,message", [
    (["-f", "bnb:nf4-b48"], 2, "block size 48"),
    (["-f", "bnb:nf3"], 2, "unknown quant type 'nf3'"),
    (["-f", "bnb:nf4-wat"], 2, "unknown option 'wat'"),
    (["-f", "bnb:int8-dq"], 2, "int8 takes no options"),
    (["-f", "bnb:nf4", "--bnb-compute-dtype", "int4"], 2, "--bnb-compute-dtype"),
    (["-f", "gguf:Q8_0", "--skip-modules", "mlp"], 2, "--skip-modules"),
])
def test_bad_input_is_one_line_and_leaves_nothing(tiny_llama, tmp_path, args, code, message):
    out = tmp_path / "o"
    r = run_cli("convert", str(tiny_llama), *args, "-o", str(out))
    assert r.returncode == code, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not out.exists() or not any(out.iterdir())


def test_nan_weights_and_unwritable_output_fail_cleanly(tmp_path):
    src = make_checkpoint(tmp_path / "nan", hidden=64, intermediate=128)
    from safetensors.torch import load_file, save_file
    t = load_file(src / "model.safetensors")
    t["model.layers.1.mlp.up_proj.weight"].view(-1)[5] = float("inf")
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "o"
    r = run_cli("convert", str(src), "-f", "bnb:nf4", "-f", "bnb:int8", "-o", str(out))
    assert r.returncode == 9 and "up_proj.weight: contains NaN or infinite values" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not any(out.iterdir())
    blocker = tmp_path / "file"
    blocker.write_text("x")   # a file where the output folder should be: not writable, even for root
    clean = make_checkpoint(tmp_path / "clean", hidden=64, intermediate=128)
    r = run_cli("convert", str(clean), "-f", "bnb:nf4", "-o", str(blocker / "out"))
    assert r.returncode == 7 and "output folder" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("variant,bad", [("nf4-dq", float("nan")), ("int8", float("nan")), ("fp4", float("-inf"))])
def test_a_non_finite_weight_is_caught_by_each_encoding(tmp_path, variant, bad):
    # a converted weight is checked through its encoding's statistics, not a pass of its own: each encoding
    # (double-quantized absmax, int8 row scales, plain absmax) must still see it
    src = make_checkpoint(tmp_path / "bad", hidden=64, intermediate=128)
    from safetensors.torch import load_file, save_file
    t = load_file(src / "model.safetensors")
    t["model.layers.0.self_attn.k_proj.weight"].view(-1)[7] = bad
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "o"
    r = run_cli("convert", str(src), "-f", f"bnb:{variant}", "-o", str(out))
    assert r.returncode == 9 and "k_proj.weight: contains NaN or infinite values" in r.stderr, r.stderr
    assert not out.exists() or not any(out.iterdir())


def test_mixtures_of_experts_are_refused_in_one_line(tmp_path):
    src = make_checkpoint(tmp_path / "moe", "qwen2_moe", hidden=64, intermediate=128, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    r = run_cli("convert", str(src), "-f", "bnb:nf4", "-o", str(tmp_path / "o"), "--dry-run")
    assert r.returncode == 2 and "mixture of experts" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --- the demo model -------------------------------------------------------------------------------------------
DEMO_VARIANTS = ["nf4", "nf4-dq", "fp4", "nf4-b128", "int8"]


@pytest.fixture(scope="module")
def demo_folders(tmp_path_factory):
    out = tmp_path_factory.mktemp("bnb-demo")
    return dict(zip(DEMO_VARIANTS, convert("demo:smollm2-135m", DEMO_VARIANTS, out)))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["nf4", "nf4-dq", "fp4", "int8"])   # transformers has no other block size
def test_demo_folder_equals_transformers_save_pretrained(demo_folders, variant, tmp_path):
    from quantkit.model.source import open_model
    src = open_model("demo:smollm2-135m").folder
    assert assert_same_checkpoint(demo_folders[variant], transformers_save(src, variant, tmp_path / "ref")) > 600


@pytest.mark.slow
@needs_shared_data(WIKI_TEST)
@pytest.mark.parametrize("variant", ["nf4", "nf4-dq", "fp4", "int8"])
def test_demo_loads_in_transformers_and_agrees(demo_folders, variant):
    """The issue's check: from_pretrained(folder) on the CPU, top-1 ≥ 99.5 % against quantkit's reader, the runtime
    computing in float32 so that the check is about the weights (measured: 100 % for nf4).  LLM.int8 also turns
    each linear's input into int8 codes, which amplifies any float difference: quantkit's reader computes those
    products as bitsandbytes does (--activations bitsandbytes; measured 100 %, against 91.7 % for the plain
    dequantized weights).  nf4-b128 is left out: bitsandbytes 0.50.2's CPU kernel mis-dequantizes blocks that
    span rows (next test)."""
    from quantkit.backends.bnb import consumer
    from quantkit.eval.harness import load_windows, window_logits
    folder = demo_folders[variant]
    ours = BnbCheckpoint(folder, "bitsandbytes" if variant == "int8" else "exact")
    tokens = load_windows(ours.tokenizer, WIKI_TEST, 512, 3)
    same = sum((a.argmax(-1) == b.argmax(-1)).sum().item()
               for a, b in zip(window_logits(ours, tokens), consumer.window_logits(folder, tokens, exact=True)))
    assert same / tokens.numel() >= 0.995, variant


@pytest.mark.slow
def test_the_plan_warns_where_bitsandbytes_cpu_kernel_goes_wrong(demo_folders):
    """Rows of 576 in blocks of 128: bitsandbytes' own CPU dequantization disagrees with its pure-torch one (and
    quantkit's reader) for most linears.  The file is right (it equals transformers' own save); the plan says so."""
    import bitsandbytes as bnb
    (plan,) = api.plan("demo:smollm2-135m", ["bnb:nf4-b128"], "/tmp/unused", {})
    assert any("CPU" in str(v) and "576" in str(v) for v in plan.extra.values())
    from quantkit.backends.bnb import consumer
    model, ours = consumer.load(demo_folders["nf4-b128"]), BnbCheckpoint(demo_folders["nf4-b128"])
    q = model.model.layers[0].self_attn.q_proj.weight
    theirs = bnb.functional.dequantize_4bit(q.data, q.quant_state)
    assert not torch.equal(theirs, ours.linear_weight("model.layers.0.self_attn.q_proj"))


def test_llm_int8_products_are_bitsandbytes_own(tmp_path):
    """`--activations bitsandbytes`: an int8 linear computed as LLM.int8 computes it (outlier columns in float, the
    rest as int8 codes per row, exact integer products, bitsandbytes' scaling) equals Linear8bitLt's output bit
    for bit; the input rounding alone is close, the plain float product is not."""
    from quantkit.backends.bnb import consumer
    src = make_checkpoint(tmp_path / "src", hidden=64, intermediate=128)
    (folder,) = convert(src, ["int8"], tmp_path / "o")
    model, ours = consumer.load(folder, exact=True), BnbCheckpoint(folder, "bitsandbytes")
    name = "model.layers.1.mlp.down_proj"
    product, rounding = ours.linear_fns(1)["mlp.down_proj"], ours.activation_fns(1)["mlp.down_proj"]
    module = model.get_submodule(name)
    x = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(0)) * 3
    x[0, :, 5] += 9.0   # an outlier column in the first window only
    with torch.no_grad():
        theirs = torch.cat([module(w[None]) for w in x])
    assert torch.equal(product(x), theirs)
    w = ours.linear_weight(name)
    close, plain = (rounding(x) @ w.T - theirs).abs().max(), (x @ w.T - theirs).abs().max()
    assert close < 1e-4 * theirs.abs().max() < plain


def test_short_writes_are_resumed_and_a_full_disk_leaves_nothing(tmp_path, monkeypatch):
    """A filesystem may write less than asked (one pwrite moves at most ~2 GiB on Linux): the writer goes on
    until every byte is down, and the folder equals an ordinary run's.  A write that moves nothing is a full disk:
    one OutputError, no folder."""
    import os
    from quantkit.errors import OutputError
    from quantkit.model import safetensors_writer
    src = make_checkpoint(tmp_path / "src", hidden=64, intermediate=128)
    (plain,) = convert(src, ["nf4-dq"], tmp_path / "plain")
    real = os.pwrite
    monkeypatch.setattr(safetensors_writer.os, "pwrite", lambda fd, data, off: real(fd, memoryview(data)[:999], off))
    (short,) = convert(src, ["nf4-dq"], tmp_path / "short")
    for p in plain.glob("*.safetensors"):
        assert (short / p.name).read_bytes() == p.read_bytes()
    calls = iter(range(10**6))
    monkeypatch.setattr(safetensors_writer.os, "pwrite", lambda fd, data, off: 0 if next(calls) == 20 else real(fd, data, off))
    with pytest.raises(OutputError, match="disk is full"):
        convert(src, ["nf4"], tmp_path / "full")
    assert list((tmp_path / "full").iterdir()) == []
