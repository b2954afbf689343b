"""GPU check: the CUDA path gives the same bytes and numbers as the CPU path, and how much faster it is.

Run on a machine with CUDA (bench/gpu_check.sh sets it up on the lent H200); writes a JSON report.
1. every GGUF encoder on random tensors: CUDA bytes == CPU bytes (== llama.cpp's where its library is
   importable), with timings on both;
2. a synthetic llama (hidden 2048) converted to Q4_K_M + Q8_0 on CUDA and on CPU: identical files, times;
3. the evaluation harness on CUDA vs CPU on that model: perplexity agreement.
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
    x = (torch.randn(rows, cols, generator=g) * (1 + torch.rand(rows, cols, generator=g))).float()
    for qtype in ([] if os.environ.get("QUANTKIT_GPU_SKIP_ENCODERS") else sorted(encoders.SUPPORTED, key=lambda t: t.name)):
        cpu, t_cpu = timed(lambda: encoders.quantize(x, qtype), False)
        row = {"cpu_s": round(t_cpu, 3)}
        if cuda:
            xc = x.cuda()
            encoders.quantize(xc[:256], qtype)  # warm-up (kernels, allocator)
            gpu, t_gpu = timed(lambda: encoders.quantize(xc, qtype), True)
            row.update(cuda_s=round(t_gpu, 4), speedup=round(t_cpu / t_gpu, 1), cuda_equals_cpu=bool((gpu == cpu).all()))
        if ref is not None:
            theirs = ref.quantize_ref(x.numpy(), int(qtype))
            row["cpu_equals_llamacpp"] = bool((theirs.reshape(cpu.shape) == cpu).all())
        report["encoders"][qtype.name] = row
        print(qtype.name, row, flush=True)

    from conftest import make_checkpoint, TINY_TEXT
    hidden, inter = (256, 512) if os.environ.get("QUANTKIT_GPU_CHECK_SMALL") else (2048, 5632)
    src = make_checkpoint(out_dir / "synthetic", hidden=hidden, intermediate=inter, heads=16, kv_heads=4, layers=4,
                          vocab=320, bpe=True)
    for dev in (["cuda", "cpu"] if cuda else ["cpu"]):
        t0 = time.perf_counter()
        paths = api.convert(str(src), ["gguf:Q4_K_M", "gguf:Q8_0"], out_dir / dev,
                            options={"device": dev, "tokenizer_pre": "gpt-2"})
        report["files"][dev] = {"seconds": round(time.perf_counter() - t0, 2), "files": [p.name for p in paths]}
    if cuda:
        same = all((out_dir / "cuda" / n).read_bytes() == (out_dir / "cpu" / n).read_bytes()
                   for n in report["files"]["cpu"]["files"])
        report["files"]["cuda_files_identical_to_cpu"] = same
    text = out_dir / "text.txt"
    text.write_text(TINY_TEXT)
    model = Checkpoint(src)
    tokens = load_windows(model.tokenizer, text, ctx=64, windows=8)
    for dev in (["cuda", "cpu"] if cuda else ["cpu"]):
        (r, secs) = timed(lambda: evaluate(model, tokens, device=torch.device(dev)), dev == "cuda")
        report["eval"][dev] = {"perplexity": r.perplexity, "seconds": round(secs, 2)}
    if cuda:  # data-free calibration draws on the GPU too
        from quantkit.calibration import CalibrationSpec, load_calibration
        (cal, secs) = timed(lambda: load_calibration(CalibrationSpec("self", samples=16, seqlen=64), model,
                                                     device="cuda"), True)
        report["calibration_self_cuda"] = {"shape": list(cal.tokens.shape), "token_hash": cal.token_hash,
                                           "seconds": round(secs, 2)}
    print(json.dumps(report, indent=2))
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/_work/gpu_check"))
