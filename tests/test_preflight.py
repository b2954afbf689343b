"""Pre-flight: the run's figures from its jobs' (the calibration pass shared, the rest one after another), the
dry run's report of them, and the refusal up front when the disk or the memory cannot hold the run.  How close
the estimates come to the measurement is a benchmark (bench/preflight.py), not a test."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_TEXT, make_checkpoint, run_cli
from quantkit import api, preflight
from quantkit.calibration.stats import ReferenceHessian
from quantkit.errors import ResourceError
from quantkit.preflight import Resources, combine

MiB = 2**20


def test_calibrated_jobs_share_the_pass_and_the_others_run_after_it(monkeypatch):
    monkeypatch.setattr(preflight, "_own_rss", lambda: 300 * MiB)
    monkeypatch.setitem(preflight._startup, "rss", 0)
    monkeypatch.setitem(preflight._startup, "seconds", 5.0)
    gptq = Resources(own_ram=100 * MiB, shared_ram=50 * MiB, own_seconds=10, forward_seconds=20, final_disk=7,
                     stream=40 * MiB, calibrated=True)
    awq = Resources(own_ram=200 * MiB, shared_ram=80 * MiB, own_seconds=30, forward_seconds=25, final_disk=8,
                    stream=40 * MiB, calibrated=True)
    gguf = Resources(own_ram=900 * MiB, own_seconds=4, final_disk=9)
    run = combine([gptq, awq, gguf], "cpu")
    pass_ram = 300 * MiB + preflight.CALIBRATION_LOAD_BYTES + 80 * MiB + 300 * MiB + 80 * MiB   # + both copies
    assert run.peak_ram == max(pass_ram, 300 * MiB + 900 * MiB)
    assert run.seconds == 5 + 20 + 25 + 10 + 30 + 4            # each job walks the layers with its own stream
    # two generations of both streams, beside the folders the pass writes; the GGUF file (9 bytes) comes after
    # the commit points are removed, and only a peak beyond the final bytes counts as temporary
    assert run.final_disk == 24 and run.scratch_disk == 2 * 80 * MiB - 9
    no_resume = combine([gptq, awq], "cpu", resume=False)
    assert no_resume.scratch_disk == 0 and no_resume.peak_ram == pass_ram - 80 * MiB


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    base = tmp_path_factory.mktemp("pf")
    text = base / "calib.txt"
    text.write_text(TINY_TEXT * 3)
    return make_checkpoint(base / "m", hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, vocab=96), text


def test_dry_run_reports_the_run_and_what_is_here(model, tmp_path):
    folder, text = model
    r = run_cli("convert", str(folder), "-f", "gptq:4bit-g32", "-f", "bnb:nf4", "--calib", str(text),
                "--calib-samples", "4", "--calib-seqlen", "32", "--dry-run", "--json", "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    run = d["run"]
    assert run["disk_final_bytes"] >= sum(p["bytes"] for p in d["plans"])
    # GPTQ's stream, two commit generations, gone before the bnb folder is written
    assert 0 <= run["disk_temporary_bytes"] <= 2 * 4 * 32 * 64 * 4
    assert run["peak_ram_bytes"] > 0 and run["seconds"] > 0 and run["refused"] is None
    assert run["disk_free_bytes"] > 0 and run["ram_available_bytes"] > 0
    table = run_cli("convert", str(folder), "-f", "bnb:nf4", "--dry-run", "-o", str(tmp_path / "o"))
    assert "peak RAM" in table.stdout and "temporary" in table.stdout and "it fits" in table.stdout
    assert not (tmp_path / "o").exists()


def test_an_importance_matrix_adds_its_pass_to_the_gguf_estimate(model, tmp_path):
    """GGUF with --imatrix is a calibrated job: the pass's working set and forwards are counted, and its
    encoders are timed weighted (they search differently with an importance vector)."""
    folder, text = model
    common = ["convert", str(folder), "-f", "gguf:Q8_0", "--calib", str(text), "--calib-samples", "4",
              "--calib-seqlen", "32", "--dry-run", "--json", "-o", str(tmp_path / "o")]
    plain, weighted = (json.loads(run_cli(*common, *extra).stdout) for extra in ([], ["--imatrix"]))
    assert weighted["run"]["peak_ram_bytes"] > plain["run"]["peak_ram_bytes"]
    # its commit points (two generations of the stream) are gone before the file is written: they only count
    # where they outgrow it
    stream_copies = 2 * 4 * 32 * 64 * 4
    final = weighted["run"]["disk_final_bytes"]
    assert weighted["run"]["disk_temporary_bytes"] == max(0, stream_copies - final)
    assert plain["run"]["disk_temporary_bytes"] == 0
    assert "importance matrix's pass" in weighted["plans"][0]["extra"]["time (estimate)"]


@pytest.mark.parametrize("what, patch, fragment", [
    ("disk", "free_disk", "GiB of disk"),
    ("memory", "available_ram", "GiB of RAM"),
])
def test_a_run_that_cannot_fit_is_refused_up_front(model, tmp_path, monkeypatch, what, patch, fragment):
    folder, text = model
    monkeypatch.setattr(preflight, patch, lambda *a: 1024)
    out = tmp_path / "o"
    options = {"calib": str(text), "calib_samples": 4, "calib_seqlen": 32}
    with pytest.raises(ResourceError, match=fragment) as e:
        api.convert(str(folder), ["gptq:4bit-g32"], out, options=options)
    assert "--no-preflight" in e.value.message and "\n" not in e.value.message
    assert not out.exists() or not list(out.iterdir())
    (written,) = api.convert(str(folder), ["gptq:4bit-g32"], out, options={**options, "preflight": False})
    assert written.is_dir()


def test_the_refusal_through_the_command_line_is_exit_10(model, tmp_path, monkeypatch, capsys):
    from test_bad_inputs import invoke
    folder, _ = model
    monkeypatch.setattr(preflight, "free_disk", lambda *a: 1000)
    code, err = invoke(["convert", str(folder), "-f", "bnb:nf4", "-o", str(tmp_path / "o")], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 10 and len(lines) == 1 and "GiB of disk" in lines[0] and "0.00 GiB is free" in lines[0], err
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def test_the_pass_is_timed_on_a_real_layer_walk_and_scaled_by_windows_and_layers(model, monkeypatch):
    """The forwards' estimate comes from walking layer 0 with the pass's own code (once per model and window
    length), then grows with the calibration windows and the layers."""
    from quantkit.calibration import capture
    from quantkit.model.checkpoint import Checkpoint
    folder, _ = model
    walks = []
    real = capture.quantize_layer
    monkeypatch.setattr(capture, "quantize_layer",
                        lambda ctx, job, **kw: walks.append((ctx.stream.shape, ctx.reference is not None))
                        or real(ctx, job, **kw))
    monkeypatch.setattr(preflight, "_pass_probe", {})
    m, cpu = Checkpoint(folder), torch.device("cpu")
    four, eight = preflight.pass_seconds(m, 4, 32, cpu), preflight.pass_seconds(m, 8, 32, cpu)
    # a warm-up window, a batch of the pass's 4096 tokens that pays for its buffers, then that batch again, timed
    assert walks == [((1, 32, 64), False), ((128, 32, 64), False), ((128, 32, 64), False)]
    per_layer, per_window = preflight._pass_probe[(str(folder), 32, "cpu", None, False)]
    assert four == pytest.approx((per_layer + 4 * per_window) * 2) and eight > four > 0
    # a job that also walks the unquantized model's stream is timed walking both, with its statistics
    walks.clear()
    preflight.pass_seconds(m, 4, 32, cpu, ReferenceHessian, reference=True)
    assert walks == [((1, 32, 64), True), ((128, 32, 64), True), ((128, 32, 64), True)]


def test_estimates_size_the_pass_by_its_largest_layer(tmp_path):
    """A mixture whose layer 0 is dense (qwen2_moe's mlp_only_layers) is sized by a mixture layer: the pass holds
    one layer at a time, and the largest sets the peak; the formats' estimates then count every expert."""
    from quantkit.model.source import open_model
    folder = make_checkpoint(tmp_path / "m", "qwen2_moe", hidden=64, intermediate=256, heads=4, kv_heads=2, layers=3,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[0])
    model = open_model(folder)
    sizes = [sum(t.numel() for t in model.layer(i).values()) for i in range(3)]
    assert sizes[1] == sizes[2] > sizes[0]
    assert preflight.largest_layer(model) == 1 and preflight.layer_params(model) == sizes[1]
    experts = [f"mlp.experts.{e}.{p}_proj" for e in range(8) for p in ("gate", "up")] + \
              ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"]
    assert preflight.held_second_moments(model) >= len(experts) // 2 * 64 ** 2 * 4   # every expert's gate/up H
    assert all(name in preflight.layer_shapes(model) for name in experts)
