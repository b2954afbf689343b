"""Benchmark: quantkit's EXL2 at a ladder of targets against quantkit's GPTQ at the same bits per weight, on
the demo model, from the same calibration tokens.

exllamav2's own converter needs CUDA for every step, so it cannot be the anchor on a CPU machine; the anchor
here is GPTQ (4- and 3-bit, group 128, quantkit's, itself better than GPTQModel's on the same tokens — see
gptq_vs_gptqmodel.md).  Two runs, each in its own process (wall time and peak RSS by os.wait4):

1. `-f gptq:4bit-g128 -f gptq:3bit-g128`: the decoder linears' bits per weight are then counted from the
   written files (every stored tensor of each linear: codes, zeros, scales, g_idx, bias), as exllamav2
   counts its own (codes, scales, groups, permutation, bias).
2. `-f exl2:T` for T in 2.5, 3.0, 4.0, 5.0, 6.0 and for each GPTQ's bits per weight rounded down to 0.01:
   one run, so one measurement pass serves every target (kept as bench/_work/exl2/measurement.json).

Each folder is then scored against the bf16 model on wikitext-2 test (40 × 512) by quantkit's harness:
perplexity, mean KLD, top-1 agreement; each EXL2 row also gives the achieved bpw (goal: within 0.02 of the
target, never above) and the allocation's predicted error.  Calibration: 128 × 512 tokens of wikitext-2
valid (seed 0), the same for both runs (hash checked).  Loading in exllamav2 itself is bench/gpu_check's part.

    python bench/exl2_vs_gptq.py [--samples 128] [--windows 40] [--targets 2.5,3.0,4.0,5.0,6.0]

The driver imports no torch.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import measure  # bench/measure.py

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "_work" / "exl2"
RESULTS = ROOT / "bench" / "results"
SHARED = ROOT.parent / "shared" / "data"
THREADS = os.cpu_count() or 1
GPTQ = ["4bit-g128", "3bit-g128"]

CONVERT = """
import json, sys
from quantkit import api
calib, samples, out, formats, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
api.convert('demo:smollm2-135m', formats, out, options={'calib': calib, 'calib_samples': samples, 'calib_seqlen': 512,
                                                         'seed': 0, 'device': 'cpu', **extra})
"""

# Bits per weight of the decoder linears from a written folder: every stored tensor named after a linear of a
# decoder layer, over the weights of those linears (their shapes from the source model).
BITS = """
import json, sys
from pathlib import Path
from quantkit.model.source import open_model
from quantkit.model.safetensors_reader import SafetensorsCheckpoint
m = open_model('demo:smollm2-135m')
linears = {}
for i in range(m.num_layers):
    prefix = m.adapter.prefix(i)
    for lin in m.block(i).linears:
        linears[prefix + lin] = m.weights.entries[f'{prefix}{lin}.weight'].numel
st = SafetensorsCheckpoint(Path(sys.argv[1]))
bits = 0
for name in st.names():
    owner = name.rsplit('.', 1)[0]
    if owner in linears:
        t = st.get(name)
        bits += t.numel() * t.element_size() * 8
print('BITS ' + json.dumps({'bits': bits, 'weights': sum(linears.values())}))
"""

EVAL = """
import json, sys
from quantkit import api
r = api.evaluate(sys.argv[1], sys.argv[2], base='demo:smollm2-135m', ctx=512, windows=int(sys.argv[3]), device='cpu')
print('RESULT ' + json.dumps(r.to_dict()))
"""


def child(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def last_line(prefix: str) -> dict:
    line = [ln for ln in (WORK / "last_command.log").read_text().splitlines() if ln.startswith(prefix)][-1]
    return json.loads(line[len(prefix):])


def run(cmd: list[str]) -> tuple[float, int]:
    return measure.run(cmd, WORK / "last_command.log", cwd=WORK)


def convert(formats: list[str], out: Path, calib: str, samples: int, extra: dict | None = None) -> tuple[float, int]:
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return run(child(CONVERT, calib, str(samples), str(out), json.dumps(formats), json.dumps(extra or {})))


def linear_bpw(folder: Path) -> float:
    run(child(BITS, str(folder)))
    b = last_line("BITS ")
    return b["bits"] / b["weights"]


def evaluate(folder: Path, windows: int) -> dict:
    run(child(EVAL, str(folder), str(SHARED / "wikitext2-test.raw.txt"), str(windows)))
    r = last_line("RESULT ")
    return {"perplexity": round(r["perplexity"], 3), "mean_kld": round(r["mean_kld"], 4),
            "top1": round(r["top1_agreement"], 4), "base_perplexity": round(r["base_perplexity"], 3)}


def token_hash(folder: Path) -> str:
    return json.loads((folder / "quantkit.json").read_text())["calibration"]["token_hash"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--targets", default="2.5,3.0,4.0,5.0,6.0")
    ap.add_argument("--out", default="exl2_vs_gptq")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    calib = str(SHARED / "wikitext2-valid.txt")

    print("gptq run …", flush=True)
    gptq_out = WORK / "gptq"
    gptq_wall, gptq_rss = convert([f"gptq:{v}" for v in GPTQ], gptq_out, calib, args.samples)
    gptq_rows = []
    for v in GPTQ:
        folder = next(f for f in gptq_out.iterdir() if f.name.endswith(f"gptq-{v}"))
        gptq_rows.append({"format": f"gptq:{v}", "folder": folder, "bpw": round(linear_bpw(folder), 4)})

    targets = [float(t) for t in args.targets.split(",")]
    matched = [math.floor(r["bpw"] * 100) / 100 for r in gptq_rows]
    ladder = sorted(set(targets + matched))
    print(f"exl2 run: {ladder} …", flush=True)
    exl2_out = WORK / "exl2"
    measurement = WORK / "measurement.json"
    exl2_wall, exl2_rss = convert([f"exl2:{t}bpw" for t in ladder], exl2_out, calib, args.samples,
                                  {"save_measurement": str(measurement)})
    hashes = set()
    rows = []
    for r in gptq_rows:
        hashes.add(token_hash(r["folder"]))
        print(f"eval {r['format']} …", flush=True)
        rows.append({"format": r["format"], "bpw": r["bpw"], **evaluate(r["folder"], args.windows)})
    for t in ladder:
        folder = next(f for f in exl2_out.iterdir() if f.name.endswith(f"exl2-{t}bpw"))
        hashes.add(token_hash(folder))
        info = json.loads((folder / "quantkit.json").read_text())
        print(f"eval exl2:{t}bpw …", flush=True)
        rows.append({"format": f"exl2:{t}bpw", "target": t, "bpw": info["achieved_bpw"],
                     "bpw_counted": round(linear_bpw(folder), 4), "predicted_error": info["predicted_error"],
                     "matches": next((r["format"] for r, m in zip(gptq_rows, matched) if m == t), None),
                     **evaluate(folder, args.windows)})
    assert len(hashes) == 1, f"the runs calibrated on different tokens: {hashes}"
    report = {"date": dt.date.today().isoformat(),
              "machine": f"{platform.machine()}, {THREADS} cores, {platform.platform()}",
              "model": "demo:smollm2-135m (bf16)",
              "calibration": f"wikitext2-valid, {args.samples} × 512 tokens, seed 0, sha256 {hashes.pop()}",
              "eval": f"wikitext2-test, {args.windows} × 512",
              "runs": {"gptq": {"formats": len(GPTQ), "seconds": round(gptq_wall, 1),
                                "peak_rss_gib": round(gptq_rss / 2**30, 3)},
                       "exl2": {"formats": len(ladder), "seconds": round(exl2_wall, 1),
                                "peak_rss_gib": round(exl2_rss / 2**30, 3)}},
              "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(render(report))
    print(render(report))


def render(rep: dict) -> str:
    base = rep["rows"][0]["base_perplexity"]
    g, e = rep["runs"]["gptq"], rep["runs"]["exl2"]
    lines = ["# EXL2 against GPTQ at the same bits per weight (quantkit, CPU)", "",
             f"{rep['date']} · {rep['machine']}", "",
             f"Model {rep['model']}; calibration {rep['calibration']}; evaluation {rep['eval']} "
             f"(base perplexity {base}).", "",
             f"Runs: gptq, {g['formats']} formats in one run: {g['seconds']} s, peak RSS {g['peak_rss_gib']} GiB; "
             f"exl2, {e['formats']} targets in one run (one measurement): {e['seconds']} s, peak RSS "
             f"{e['peak_rss_gib']} GiB.", "",
             "| format | target bpw | achieved bpw | counted from the files | predicted error | perplexity | "
             "mean KLD | top-1 |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rep["rows"]:
        if r["format"].startswith("gptq"):
            lines.append(f"| {r['format']} | | | {r['bpw']} | | {r['perplexity']} | {r['mean_kld']} | {r['top1']} |")
        else:
            name = r["format"] + (f" (= {r['matches']})" if r["matches"] else "")
            lines.append(f"| {name} | {r['target']} | {r['bpw']} | {r['bpw_counted']} | {r['predicted_error']} | "
                         f"{r['perplexity']} | {r['mean_kld']} | {r['top1']} |")
    lines += ["", "| pair | KLD exl2 / gptq | perplexity exl2 − gptq |", "| --- | ---: | ---: |"]
    for r in rep["rows"]:
        if r.get("matches"):
            q = next(x for x in rep["rows"] if x["format"] == r["matches"])
            lines.append(f"| {r['format']} vs {q['format']} ({q['bpw']} bpw) | {r['mean_kld'] / q['mean_kld']:.3f} | "
                         f"{r['perplexity'] - q['perplexity']:+.3f} |")
    lines += ["", "Achieved bpw: the decoder linears as exllamav2 counts them (quantkit.json); counted from the files: "
              "every stored tensor of the decoder linears over their weights, the same count for both formats.",
              "Regenerate: `python bench/exl2_vs_gptq.py`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
