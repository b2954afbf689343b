"""Benchmark: quantkit's bnb writer against what users do today, transformers + bitsandbytes' load-quantize-save
(`from_pretrained(src, quantization_config=BitsAndBytesConfig(...), device_map="cpu")` + `save_pretrained`),
same machine, same source, same settings.

For each model (the demo, the synthetic llama of bench/gguf_vs_llamacpp.py: hidden 2048, 8 layers, bf16,
>= 1 GiB, and Qwen2.5-Coder-1.5B-Instruct, 3.4 GB bf16, built by ../shared/models/build.sh) and each variant (nf4, nf4-dq, int8): wall time and peak RSS of both, taking turns `--repeats`
times (medians reported, samples kept in the JSON), and whether the two folders hold the same tensors, byte
for byte, with the same quantization_config.  Then quantkit writing all three variants in one run (one read).
Last, untimed: the demo's NF4 perplexity (wikitext-2 test, 40 × 512) through transformers' own path and
through quantkit's reader, for both tools' folders.

    python bench/bnb_vs_transformers.py [--models demo,synthetic,qwen] [--variants nf4,nf4-dq,int8] [--repeats 3]

The driver imports no torch: each measured step runs in its own process, timed with os.wait4.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import median

import measure  # bench/measure.py
from gguf_vs_llamacpp import MAKE_SYNTHETIC  # the same synthetic llama as the GGUF benchmark

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "_work" / "bnb"
SYNTHETIC = ROOT / "bench" / "_work" / "gguf" / "synthetic-src"
RESULTS = ROOT / "bench" / "results"
DATA = ROOT.parent / "shared" / "data" / "wikitext2-test.raw.txt"
THREADS = os.cpu_count() or 1

TRANSFORMERS = """
import sys, torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
src, variant, out = sys.argv[1:4]
if variant == "int8":
    cfg = BitsAndBytesConfig(load_in_8bit=True)
else:
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=variant.split("-")[0],
                             bnb_4bit_use_double_quant=variant.endswith("-dq"), bnb_4bit_compute_dtype=torch.bfloat16)
model = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg, device_map="cpu")
model.save_pretrained(out)
"""

QUANTKIT = """
import sys
from quantkit import api
src, out, variants = sys.argv[1], sys.argv[2], sys.argv[3:]
api.convert(src, ["bnb:" + v for v in variants], out, options={"device": "cpu"})
"""

COMPARE = """
import json, sys, torch
from quantkit.model.safetensors_reader import SafetensorsCheckpoint
a, b = SafetensorsCheckpoint(sys.argv[1]), SafetensorsCheckpoint(sys.argv[2])
same = set(a.names()) == set(b.names())
differ = [n for n in a.names() if same and not (a.get(n).dtype == b.get(n).dtype and a.get(n).shape == b.get(n).shape
          and torch.equal(a.get(n).reshape(-1).view(torch.uint8), b.get(n).reshape(-1).view(torch.uint8)))]
qa, qb = (json.load(open(f"{p}/config.json"))["quantization_config"] for p in sys.argv[1:3])
print(json.dumps({"tensors": len(a.names()), "same_names": same, "differ": differ[:5], "config_equal": qa == qb}))
"""

EVAL = """
import json, sys
from quantkit import api
folder, data, windows, runtime = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
r = api.evaluate(folder, data, ctx=512, windows=windows, device="cpu", runtime=runtime)
print(json.dumps({"perplexity": round(r.perplexity, 3)}))
"""


def child(code: str, *args) -> list[str]:
    return [sys.executable, "-c", code, *map(str, args)]


def run(cmd: list[str]) -> tuple[float, int]:
    os.sync()   # neither tool pays for the other's dirty pages
    return measure.run(cmd, WORK / "last_command.log")


def last_json(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def folders(slug: str, v: str) -> tuple[Path, Path]:
    return WORK / f"{slug}-quantkit-{v}", WORK / f"{slug}-transformers-{v}"


def bench_model(label: str, slug: str, src: Path, variants: list[str], repeats: int) -> list[dict]:
    rows = []
    for v in variants:
        qk_dir, tf_dir = folders(slug, v)
        samples = {"quantkit": [], "transformers": []}
        for r in range(repeats):
            for tool in (("quantkit", "transformers") if r % 2 == 0 else ("transformers", "quantkit")):
                out = qk_dir if tool == "quantkit" else tf_dir
                shutil.rmtree(out, ignore_errors=True)
                cmd = child(QUANTKIT, src, out, v) if tool == "quantkit" else child(TRANSFORMERS, src, v, out)
                samples[tool].append(run(cmd))
                print(f"{label} {v} {tool}: {samples[tool][-1][0]:.1f} s", flush=True)
        qk_folder = next(qk_dir.iterdir())
        same = last_json(child(COMPARE, qk_folder, tf_dir))
        row = {"model": label, "variant": v, "identical": same["same_names"] and not same["differ"] and same["config_equal"],
               "compare": same, "source_bytes": sum(p.stat().st_size for p in src.glob("*.safetensors")),
               "output_bytes": sum(p.stat().st_size for p in qk_folder.glob("*.safetensors"))}
        for tool, runs in samples.items():
            row[tool] = {"seconds": round(median(w for w, _ in runs), 2), "peak_rss_gib": round(median(m for _, m in runs) / 2**30, 3),
                         "samples": [[round(w, 2), round(m / 2**30, 3)] for w, m in runs]}
        row["time_ratio"] = round(row["quantkit"]["seconds"] / row["transformers"]["seconds"], 3)
        row["rss_ratio"] = round(row["quantkit"]["peak_rss_gib"] / row["transformers"]["peak_rss_gib"], 3)
        row["rss_over_checkpoint"] = round(row["quantkit"]["peak_rss_gib"] * 2**30 / row["source_bytes"], 3)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("model", "variant", "identical", "time_ratio", "rss_ratio")}), flush=True)
        if (slug, v) != ("demo", "nf4"):   # the demo's nf4 folders are kept for the quality step
            shutil.rmtree(tf_dir, ignore_errors=True)
            shutil.rmtree(qk_dir, ignore_errors=True)
    all_dir = WORK / "quantkit-all"
    shutil.rmtree(all_dir, ignore_errors=True)
    wall, rss = run(child(QUANTKIT, src, all_dir, *variants))
    rows.append({"model": label, "variant": " + ".join(variants) + " (one run)", "quantkit": {"seconds": round(wall, 2),
                 "peak_rss_gib": round(rss / 2**30, 3)}})
    shutil.rmtree(all_dir, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="demo,synthetic,qwen")
    ap.add_argument("--variants", default="nf4,nf4-dq,int8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--out", default="bnb_vs_transformers")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    demo = Path(subprocess.run([sys.executable, "-c", "from quantkit.model.source import open_model; "
                                "print(open_model('demo:smollm2-135m').folder)"],
                               capture_output=True, text=True, check=True).stdout.strip())
    if "synthetic" in args.models and not (SYNTHETIC / "model.safetensors").is_file():
        subprocess.run(child(MAKE_SYNTHETIC, demo, SYNTHETIC), check=True)
    versions = last_json(child("import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in "
                               "('transformers', 'bitsandbytes', 'torch')}))"))
    result = {"benchmark": "bnb_vs_transformers", "date": dt.date.today().isoformat(),
              "machine": f"{platform.machine()}, {THREADS} cores, {platform.platform()}", "versions": versions,
              "repeats": args.repeats, "rows": [], "quality": {}}
    variants = args.variants.split(",")
    # the floor under every quantkit figure: a process that has imported torch and quantkit and done nothing
    idle = sorted(run(child("import torch\nfrom quantkit import api"))[1] for _ in range(3))[1]
    result["idle_rss_gib"] = round(idle / 2**30, 3)
    if "demo" in args.models:
        result["rows"] += bench_model("demo (SmolLM2-135M, bf16)", "demo", demo, variants, args.repeats)
    if "synthetic" in args.models:
        result["rows"] += bench_model("synthetic llama (hidden 2048, 8 layers, bf16)", "synthetic", SYNTHETIC, variants,
                                      args.repeats)
    if "qwen" in args.models:
        qwen = Path(subprocess.run(["bash", str(ROOT.parent / "shared" / "models" / "build.sh")], capture_output=True,
                                   text=True, check=True).stdout.strip().splitlines()[-1])
        result["rows"] += bench_model("Qwen2.5-Coder-1.5B-Instruct (bf16)", "qwen", qwen, variants, args.repeats)
    # quality last and untimed: the demo's nf4 folders, read by transformers + bitsandbytes and by quantkit
    if "demo" in args.models and DATA.is_file() and "nf4" in variants:
        qk_dir, tf_dir = folders("demo", "nf4")
        for f in demo.glob("tokenizer*"):   # save_pretrained of a model writes no tokenizer; eval needs one
            shutil.copy(f, tf_dir / f.name)
        for name, folder in (("quantkit's folder", next(qk_dir.iterdir())), ("transformers' folder", tf_dir)):
            for runtime in ("transformers", "quantkit"):
                got = last_json(child(EVAL, folder, DATA, args.windows, runtime))
                result["quality"][f"{name}, {runtime} runtime"] = got["perplexity"]
                print(name, runtime, got, flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(render(result))
    print(render(result))


def render(rep: dict) -> str:
    v = rep["versions"]
    lines = [f"# bnb: quantkit vs transformers {v['transformers']} + bitsandbytes {v['bitsandbytes']} (load, quantize, save)",
             "", f"{rep['date']} · {rep['machine']} · torch {v['torch']} · medians of {rep['repeats']} alternating runs", "",
             "| model | variant | identical | quantkit s | transformers s | time ratio (goal ≤ 0.5) | quantkit RSS GiB | "
             "transformers RSS GiB | quantkit RSS / checkpoint (goal ≤ 0.25) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rep["rows"]:
        if "transformers" not in r:
            lines.append(f"| {r['model']} | {r['variant']} | | {r['quantkit']['seconds']} | | | {r['quantkit']['peak_rss_gib']} | | |")
            continue
        lines.append(f"| {r['model']} | {r['variant']} | {'yes' if r['identical'] else 'NO'} | {r['quantkit']['seconds']} | "
                     f"{r['transformers']['seconds']} | {r['time_ratio']} | {r['quantkit']['peak_rss_gib']} | "
                     f"{r['transformers']['peak_rss_gib']} | {r['rss_over_checkpoint']} |")
    if rep["quality"]:
        lines += ["", "Demo NF4 (block 64, no double quant, bf16 compute), wikitext-2 test 40 × 512 perplexity:", "",
                  "| folder, runtime | perplexity |", "| --- | ---: |"]
        lines += [f"| {k} | {p} |" for k, p in rep["quality"].items()]
    if "idle_rss_gib" in rep:
        lines += ["", f"A process that has imported torch and quantkit and done nothing peaks at {rep['idle_rss_gib']} GiB "
                  "(median of 3): that floor alone is over a quarter of a 1 GiB checkpoint; above it quantkit holds "
                  "about one weight and its codes at a time."]
    lines += ["", "identical: the same tensor names, dtypes, shapes and bytes, and the same quantization_config.",
              "Regenerate: `python bench/bnb_vs_transformers.py`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
