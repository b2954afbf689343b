"""GPU check: the CUDA path gives the same bytes and numbers as the CPU path, and how much faster it is.

Run on a machine with CUDA (bench/gpu_check.sh sets it up on the lent H200); writes a JSON report.
1. every GGUF encoder on random tensors: CUDA bytes == CPU bytes (== llama.cpp's where its library is
   importable), with timings on both;
2. a synthetic llama (hidden 2048) converted to Q4_K_M + Q8_0 on CUDA and on CPU: identical files, times;
3. the evaluation harness on CUDA vs CPU on that model: perplexity agreement;
4. GPTQ 4-bit g128 (with and without act-order) of that model on CUDA and on CPU from the same calibration
   tokens: times, how far the two artifacts' weights are apart, perplexity of each; then the GPU-only
   consumers when installed (vLLM, exllamav2), through `quantkit verify`'s own sessions: does the CUDA-made
   folder load, and do its logits agree with quantkit's reader (verify's verdict and figures)?
5. AWQ 4-bit g128 of that model made on CUDA, verified in vLLM, and EXL2 at 4.0 bpw made on CUDA, verified in
   exllamav2 (as is exllamav2's own converter's folder of the same model): the verdicts, the CUDA times.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from quantkit import api  # noqa: E402
from quantkit.backends.gguf import encoders  # noqa: E402
from quantkit.eval.harness import evaluate, load_windows  # noqa: E402
from quantkit.model.checkpoint import Checkpoint  # noqa: E402


def timed(fn, cuda: bool):
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main(out_dir: Path) -> None:
    cuda = torch.cuda.is_available()
    report = {"torch": torch.__version__, "cuda": cuda,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu only", "encoders": {}, "files": {}, "eval": {}}
    import _ggml_ref as ref
    if not ref.available():  # llama.cpp's library may not be carried
        report["ggml_ref"] = f"unavailable: {ref.unavailable_reason()}"
        ref = None
    g = torch.Generator().manual_seed(0)
    rows, cols = (64, 512) if os.environ.get("QUANTKIT_GPU_CHECK_SMALL") else (2048, 5632)
    full = (torch.randn(rows, cols, generator=g) * (1 + torch.rand(rows, cols, generator=g))).float()
    # every quantized type with an importance matrix (the IQ1/IQ2 types refuse to run without one; the others
    # take the weighted search an imatrix run takes); the unweighted paths were checked on 2026-12-01
    importance = torch.rand(cols, generator=g) + 0.1
    for qtype in ([] if os.environ.get("QUANTKIT_GPU_SKIP_ENCODERS") else sorted(encoders.SUPPORTED, key=lambda t: t.name)):
        # the lattice (IQ1-IQ3) searches run eagerly here (QUANTKIT_COMPILE=0) and took up to 145 s for 256 rows
        # on the device's busy CPU (2026-12-04): fewer rows for them
        x = full[:64] if qtype.name[:3] in ("IQ1", "IQ2", "IQ3") else full
        weights = None if qtype.name in ("F32", "F16", "BF16") else importance
        cpu, t_cpu = timed(lambda: encoders.quantize(x, qtype, imatrix=weights), False)
        row = {"rows": x.shape[0], "cpu_s": round(t_cpu, 3)}
        if cuda:
            xc = x.cuda()
            encoders.quantize(xc[:64], qtype, imatrix=weights)  # warm-up (kernels, allocator)
            gpu, t_gpu = timed(lambda: encoders.quantize(xc, qtype, imatrix=weights), True)
            row.update(cuda_s=round(t_gpu, 4), speedup=round(t_cpu / t_gpu, 1), cuda_equals_cpu=bool((gpu == cpu).all()))
        if ref is not None:
            theirs = ref.quantize_ref(x.numpy(), int(qtype), None if weights is None else weights.numpy())
            row["cpu_equals_llamacpp"] = bool((theirs.reshape(cpu.shape) == cpu).all())
        report["encoders"][qtype.name] = row
        print(qtype.name, row, flush=True)

    from conftest import make_checkpoint, TINY_TEXT
    hidden, inter = (256, 512) if os.environ.get("QUANTKIT_GPU_CHECK_SMALL") else (2048, 5632)
    # weights ~ N(0, 1/hidden) keep activations well inside float16's range: the GPU consumers run in float16
    # (with the tests' N(0, 0.3) the residual stream reaches ~2e4 at hidden 2048 and the MLP overflows)
    src = make_checkpoint(out_dir / "synthetic", hidden=hidden, intermediate=inter, heads=16, kv_heads=4, layers=4,
                          vocab=320, bpe=True, weight_std=hidden ** -0.5)
    consumers_only = bool(os.environ.get("QUANTKIT_GPU_CONSUMERS_ONLY"))  # a re-run of the consumer step alone
    for dev in ([] if consumers_only else ["cuda", "cpu"] if cuda else ["cpu"]):
        t0 = time.perf_counter()
        paths = api.convert(str(src), ["gguf:Q4_K_M", "gguf:Q8_0"], out_dir / dev,
                            options={"device": dev, "tokenizer_pre": "gpt-2"})
        report["files"][dev] = {"seconds": round(time.perf_counter() - t0, 2), "files": [p.name for p in paths]}
    if cuda and not consumers_only:
        same = all((out_dir / "cuda" / n).read_bytes() == (out_dir / "cpu" / n).read_bytes()
                   for n in report["files"]["cpu"]["files"])
        report["files"]["cuda_files_identical_to_cpu"] = same
    text = out_dir / "text.txt"
    text.write_text(TINY_TEXT)
    model = Checkpoint(src)
    tokens = load_windows(model.tokenizer, text, ctx=64, windows=8)
    for dev in ([] if consumers_only else ["cuda", "cpu"] if cuda else ["cpu"]):
        (r, secs) = timed(lambda: evaluate(model, tokens, device=torch.device(dev)), dev == "cuda")
        report["eval"][dev] = {"perplexity": r.perplexity, "seconds": round(secs, 2)}
    if cuda and not consumers_only:  # data-free calibration draws on the GPU too
        from quantkit.calibration import CalibrationSpec, load_calibration
        (cal, secs) = timed(lambda: load_calibration(CalibrationSpec("self", samples=16, seqlen=64), model,
                                                     device="cuda"), True)
        report["calibration_self_cuda"] = {"shape": list(cal.tokens.shape), "token_hash": cal.token_hash,
                                           "seconds": round(secs, 2)}
    for name, check in (("gptq", gptq_check), ("awq", awq_check), ("exl2", exl2_check)):
        # the report is saved after each section: one failing or cut short by the device's time limit must
        # not lose what the others measured
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))
        try:
            report[name] = check(src, text, tokens, out_dir, cuda)
        except Exception as e:
            report[name] = {"error": f"{type(e).__name__}: {e}"[:800]}
        print(name, report[name], flush=True)
    print(json.dumps(report, indent=2))
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))


def gptq_check(src: Path, text: Path, tokens: torch.Tensor, out_dir: Path, cuda: bool) -> dict:
    from quantkit.backends.gptq.reader import GPTQCheckpoint
    result: dict = {}
    options = _calib_options(text, out_dir)
    variants = ["gptq:4bit-g128", "gptq:4bit-g128-act"]
    base = Checkpoint(src)
    folders = {}
    devices = ["cuda", "cpu"] if cuda else ["cpu"]
    for dev in devices[:1] if os.environ.get("QUANTKIT_GPU_CONSUMERS_ONLY") else devices:
        (paths, secs) = timed(lambda: api.convert(str(src), variants, out_dir / f"gptq-{dev}",
                                                  options={**options, "device": dev}), dev == "cuda")
        folders[dev] = paths
        result[dev] = {"seconds": round(secs, 2), "perplexity": {
            p.name: evaluate(GPTQCheckpoint(p), tokens, base=base).perplexity for p in paths}}
        print("gptq", dev, result[dev], flush=True)
    if cuda and "cpu" in folders:
        diffs = {}
        for a, b in zip(folders["cuda"], folders["cpu"]):
            wa, wb = GPTQCheckpoint(a).layer(0), GPTQCheckpoint(b).layer(0)
            diffs[a.name] = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
        result["layer0_max_weight_difference_cuda_vs_cpu"] = diffs
    target = folders["cuda" if cuda else "cpu"][0]  # vLLM refuses act-order with groups: the plain one
    result["vllm"] = _in_runtime(target, "vllm")
    result["exllamav2"] = _in_runtime(target, "exllamav2")
    return result


def _calib_options(text: Path, out_dir: Path) -> dict:
    """The calibration every calibrated check draws: the check text repeated, 32 windows of 128 tokens."""
    calib = out_dir / "calib.txt"
    calib.write_text(text.read_text() * 40)
    return {"calib": str(calib), "calib_samples": 32, "calib_seqlen": 128, "seed": 0}


def _calibrated(src: Path, text: Path, out_dir: Path, fmt: str, cuda: bool):
    """One calibrated artifact made on the fastest device here: its folder and the time."""
    dev = "cuda" if cuda else "cpu"
    ((folder,), secs) = timed(lambda: api.convert(str(src), [fmt], out_dir / f"{fmt.split(':')[0]}-{dev}", options={
        **_calib_options(text, out_dir), "device": dev}), cuda)
    return folder, {"device": dev, "seconds": round(secs, 2)}


def awq_check(src: Path, text: Path, tokens: torch.Tensor, out_dir: Path, cuda: bool) -> dict:
    from quantkit.backends.awq.reader import AWQCheckpoint
    folder, result = _calibrated(src, text, out_dir, "awq:4bit-g128", cuda)
    result["quality"] = _quality(AWQCheckpoint(folder), tokens, Checkpoint(src))
    result["vllm"] = _in_runtime(folder, "vllm")
    return result


def exl2_check(src: Path, text: Path, tokens: torch.Tensor, out_dir: Path, cuda: bool) -> dict:
    from quantkit.backends.exl2.reader import EXL2Checkpoint
    folder, result = _calibrated(src, text, out_dir, "exl2:4.0bpw", cuda)
    result["achieved_bpw"] = json.loads((folder / "quantkit.json").read_text())["achieved_bpw"]
    base = Checkpoint(src)
    result["quality"] = _quality(EXL2Checkpoint(folder), tokens, base)
    result["exllamav2"] = _in_runtime(folder, "exllamav2")
    if cuda:
        result["exllamav2_converter"] = _exllamav2_convert(src, text, out_dir, tokens, base)
    return result


def _exllamav2_convert(src: Path, text: Path, out_dir: Path, tokens: torch.Tensor, base) -> dict:
    """The anchor: exllamav2 0.3.2's own converter on the same model, 4.0 bpw, head 6 bits, the same
    calibration text at the same rows x length; its folder read back by quantkit's reader (the reader is
    meant for any exllamav2 folder) and run in exllamav2."""
    import subprocess
    from quantkit.backends.exl2.reader import EXL2Checkpoint
    import importlib.util
    if importlib.util.find_spec("exllamav2") is None:
        return {"available": False, "why": "exllamav2 is not installed"}
    import pandas
    opts = _calib_options(text, out_dir)
    cal = out_dir / "calib.parquet"
    pandas.DataFrame({"text": [t for t in Path(opts["calib"]).read_text().split("\n\n") if t.strip()]}).to_parquet(cal)
    work, folder = out_dir / "exllamav2-work", out_dir / "exllamav2-4.0bpw"
    rows, length = str(opts["calib_samples"]), str(opts["calib_seqlen"])
    cmd = [sys.executable, "-m", "exllamav2.conversion.convert_exl2", "-i", str(src), "-o", str(work), "-nr",
           "-cf", str(folder), "-c", str(cal), "-b", "4.0", "-hb", "6", "-r", rows, "-l", length, "-mr", rows,
           "-ml", length]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    result = {"seconds": round(time.perf_counter() - t0, 2), "rc": proc.returncode}
    (out_dir / "exllamav2_convert.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not (folder / "config.json").is_file():
        result["error"] = (proc.stdout + proc.stderr)[-800:]
        return result
    try:
        result["quality_read_by_quantkit"] = _quality(EXL2Checkpoint(folder), tokens, base)
        result["exllamav2_runs_its_own_folder"] = _in_runtime(folder, "exllamav2")
    except Exception as e:
        result["read_error"] = f"{type(e).__name__}: {e}"[:800]
    return result


def _quality(model, tokens: torch.Tensor, base) -> dict:
    r = evaluate(model, tokens, base=base)
    return {"perplexity": r.perplexity, "mean_kld": r.mean_kld, "top1_vs_base": r.top1_agreement}


def _in_runtime(folder: Path, runtime: str) -> dict:
    """`quantkit verify`'s own check of the folder in a GPU runtime (its sessions, quantkit.verify.sessions):
    the verdict with its figures (top-1 and KLD against quantkit's reader on verify's text, load time, tokens/s,
    peak memory), or why it did not run."""
    try:
        report = api.verify(folder, runtimes=[runtime], tokens=128, generate=8, record=False)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:800]}
    (check,) = report.runtimes
    return {"verdict": check.verdict, "why": check.why, **check.figures}

if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/_work/gpu_check"))
