"""Benchmark: quantkit's encoders of the low-bit GGUF types (IQ1-IQ3 lattices, TQ) against llama.cpp's own
quantizers, same tensors, same importance matrix, same run.

The tensors are slices (512 and 256 rows) of one Qwen2.5-1.5B layer's attention output (row length 1536) and MLP
down projection (row length 8960), with heavy-tailed values like trained weights, and a lognormal importance
vector.  llama.cpp's
side is ggml_quantize_chunk from the libggml-base that llama-cpp-python ships (the quantizer llama-quantize
calls), run on the rows split over as many threads as cores, as llama-quantize does; quantkit's side is
encoders.quantize (torch on the same cores).  Each type runs --repeats times per tool, the tools taking turns
to go first; medians are reported, and the bytes are compared.

    python bench/gguf_lowbit_encoders.py [--types IQ3_S,IQ2_XXS] [--repeats 3]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import _ggml_ref as ref  # noqa: E402  (the ctypes binding of ggml_quantize_chunk)

from quantkit.backends.gguf.encoders import quantize  # noqa: E402

TYPES = ["IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"]
SHAPES = [(512, 1536), (256, 8960)]            # (rows, row length): slices of attn_output, ffn_down
THREADS = os.cpu_count() or 1


def tensors() -> list[tuple[np.ndarray, np.ndarray]]:
    g = np.random.default_rng(0)
    out = []
    for rows, n in SHAPES:
        x = g.standard_t(5, (rows, n)).astype(np.float32) * 0.02
        out.append((x, (g.lognormal(0, 1.5, n) ** 2).astype(np.float32)))
    return out


def llama(x: np.ndarray, im: np.ndarray, qtype) -> np.ndarray:
    parts = np.array_split(np.arange(x.shape[0]), THREADS)
    with ThreadPoolExecutor(THREADS) as pool:                 # ctypes releases the GIL during the call
        done = list(pool.map(lambda p: ref.quantize_ref(x[p[0]:p[-1] + 1], qtype, imatrix=im), parts))
    return np.concatenate(done)


def ours(x: np.ndarray, im: np.ndarray, qtype) -> np.ndarray:
    return quantize(torch.from_numpy(x), qtype, imatrix=torch.from_numpy(im))


def timed(fn, data, qtype) -> tuple[float, list[np.ndarray]]:
    t0 = time.perf_counter()
    out = [fn(x, im, qtype) for x, im in data]
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="gguf_lowbit_encoders")
    args = ap.parse_args()
    if not ref.available():
        raise SystemExit(ref.unavailable_reason())
    data = tensors()
    for x, im in data:                                        # tables built, code paths warm, outside the timing
        quantize(torch.from_numpy(x[:2]), QT.IQ2_XXS, imatrix=torch.from_numpy(im))
    rows = []
    for name in args.types.split(","):
        qtype = QT[name]
        ours(data[0][0][:8], data[0][1], qtype)               # this type's tables
        qk, ll = [], []
        for i in range(args.repeats):
            order = [(ours, qk), (llama, ll)] if i % 2 == 0 else [(llama, ll), (ours, qk)]
            results = {}
            for fn, runs in order:
                wall, results[fn] = timed(fn, data, qtype)
                runs.append(wall)
        same = all(np.array_equal(a, b) for a, b in zip(results[ours], results[llama]))
        row = {"type": name, "quantkit_s": median(qk), "llamacpp_s": median(ll), "ratio": median(qk) / median(ll),
               "quantkit_runs_s": [round(w, 2) for w in qk], "llamacpp_runs_s": [round(w, 2) for w in ll],
               "identical": same}
        print(json.dumps(row), flush=True)
        rows.append(row)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    result = {"benchmark": "gguf_lowbit_encoders", "date": dt.date.today().isoformat(),
              "machine": f"{cpu}, {THREADS} cores", "torch": torch.__version__, "threads": THREADS,
              "shapes": SHAPES, "weights": sum(r * n for r, n in SHAPES), "repeats": args.repeats, "rows": rows}
    out = ROOT / "bench" / "results"
    (out / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# GGUF low-bit types: quantkit's encoders vs llama.cpp's quantizers\n",
             f"Date {result['date']}. Machine: {result['machine']}, torch {result['torch']}. Command: "
             f"`python bench/gguf_lowbit_encoders.py`.\n",
             f"Tensors: {' and '.join(f'{r} x {n}' for r, n in SHAPES)} ({result['weights'] / 1e6:.1f} M weights, "
             "t(5)-distributed, slices of a Qwen2.5-1.5B layer's attn_output and ffn_down) with a lognormal importance "
             f"vector. llama.cpp: ggml_quantize_chunk of llama-cpp-python's libggml-base on {THREADS} threads (rows "
             f"split, as llama-quantize does). Median of {args.repeats} runs per tool, taking turns.\n",
             "Goal: quantkit ≤ 1.0x llama.cpp's time, identical bytes.\n",
             "| type | quantkit s | llama.cpp s | ratio | identical bytes |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['type']} | {r['quantkit_s']:.2f} | {r['llamacpp_s']:.2f} | **{r['ratio']:.1f}** | "
                     f"{'yes' if r['identical'] else 'no'} |")
    (out / f"{args.out}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
