"""The command line as a user meets it: help, inspect, eval, and one-line errors with distinct exit codes."""
import json

import pytest

from conftest import make_checkpoint, run_cli


def assert_one_line_error(proc, code, *fragments):
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_help_has_examples():
    proc = run_cli("--help")
    assert proc.returncode == 0
    assert "quantkit convert demo:smollm2-135m" in proc.stdout
    for cmd in ("inspect", "eval", "convert", "formats"):
        assert cmd in proc.stdout


def test_inspect_json(tiny_llama):
    proc = run_cli("inspect", str(tiny_llama), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["architecture"] == "llama" and info["layers"] == 2
    names = {t["name"]: t for t in info["tensors"]}
    assert names["model.layers.0.self_attn.k_proj.weight"]["shape"] == [32, 64]
    assert names["model.layers.0.self_attn.k_proj.weight"]["dtype"] == "BF16"
    assert info["parameters"] == sum(__import__("math").prod(t["shape"]) for t in info["tensors"])


def test_eval_json_and_table_agree(tiny_llama, tiny_text):
    args = ("eval", str(tiny_llama), "--data", str(tiny_text), "--ctx", "16", "--windows", "4", "--base", str(tiny_llama))
    proc = run_cli(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["tokens_scored"] == 4 * 15 and r["mean_kld"] == pytest.approx(0, abs=1e-6) and r["top1_agreement"] == 1.0
    table = run_cli(*args)
    assert table.returncode == 0 and f"{r['perplexity']:.4f}" in table.stdout


def test_missing_folder():
    assert_one_line_error(run_cli("inspect", "./no/such/model"), 3, "no such folder")


def test_folder_without_weights(tmp_path):
    folder = make_checkpoint(tmp_path / "m")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    assert_one_line_error(run_cli("inspect", str(folder)), 3, "no .safetensors weights")


def test_corrupt_safetensors_header(tmp_path):
    folder = make_checkpoint(tmp_path / "m")
    (folder / "model.safetensors").write_bytes((40).to_bytes(8, "little") + b"{garbage" + b"\0" * 40)
    assert_one_line_error(run_cli("inspect", str(folder)), 3, "corrupt safetensors header")


def test_unsupported_architecture(tmp_path):
    folder = make_checkpoint(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    from quantkit.model.adapters import supported_model_types
    assert_one_line_error(run_cli("inspect", str(folder)), 4, "'gpt2' is not supported", "docs/adding-a-family.md",
                          *supported_model_types())


def test_unknown_format(tiny_llama):
    proc = run_cli("convert", str(tiny_llama), "-f", "zip:9bit", "-o", "/tmp/never")
    assert_one_line_error(proc, 2, "unknown format 'zip'")


def test_malformed_format(tiny_llama):
    assert_one_line_error(run_cli("convert", str(tiny_llama), "-f", "gguf"), 2, "FORMAT:VARIANT")


def test_hub_id_while_offline(tmp_path):
    proc = run_cli("inspect", "acme/not-cached", env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert_one_line_error(proc, 5, "cannot reach the Hugging Face Hub")


def test_eval_missing_data_file(tiny_llama, tmp_path):
    proc = run_cli("eval", str(tiny_llama), "--data", str(tmp_path / "none.txt"))
    assert_one_line_error(proc, 6, "no such file")


def test_debug_shows_traceback():
    proc = run_cli("--debug", "inspect", "./no/such/model")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


@pytest.mark.parametrize("args,flag", [(["-f", "gguf:Q8_0", "--act-order"], "--act-order"),
                                       (["-f", "gptq:4bit-g64", "--pure"], "--pure")])
def test_an_option_of_a_format_not_in_the_run_is_refused(tiny_llama, tmp_path, args, flag):
    """A format owns its options; set without that format, they would be silently ignored."""
    r = run_cli("convert", str(tiny_llama), *args, "-o", str(tmp_path / "o"))
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()
    assert len(line) == 1 and flag in line[0] and "add -f" in line[0]
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def test_convert_returns_the_artifacts_in_the_order_asked(tiny_gguf_source, tiny_text, tmp_path):
    """Writing goes by format and calibration (GPTQ's pass first); what convert returns follows the -f order."""
    from quantkit import api
    formats = ["gguf:Q8_0", "bnb:nf4", "gptq:4bit-g128", "gguf:Q4_0"]
    options = {"device": "cpu", "tokenizer_pre": "gpt-2", "calib": str(tiny_text), "calib_samples": 4,
               "calib_seqlen": 32}
    paths = api.convert(str(tiny_gguf_source), formats, tmp_path, options=options)
    assert [str(p) for p in paths] == [p.output for p in api.plan(str(tiny_gguf_source), formats, tmp_path, options)]
    assert [p.name.rsplit("-", 1)[-1] for p in paths] == ["Q8_0.gguf", "nf4", "g128", "Q4_0.gguf"]
