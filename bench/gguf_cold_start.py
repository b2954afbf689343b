"""Benchmark: the first GGUF conversion on a machine with no kernels built (cold) and a later one (warm),
against llama.cpp's convert_hf_to_gguf.py + llama-quantize, same run, same checkpoint.

quantkit's K-quant encoders run fused CPU kernels built by AOTInductor (quantkit/backends/gguf/fusion.py).
quantkit ships them built for x86-64 CPUs with AVX2; a machine that cannot use that set (another CPU, another
torch) builds its own, once.  Four quantkit runs:
- cold: a new machine as installed: empty kernel folder AND empty Inductor cache (its precompiled headers and
  graph cache: a new machine has neither), the shipped set used;
- cold, own build: the same with the shipped set left aside (QUANTKIT_SHIPPED_KERNELS=0): what a machine that
  cannot use it pays on its first run;
- warm: a later run as installed (the shipped set);
- warm, own build: a later run with the machine's own kernels (-march=native) and no shipped set.
llama.cpp's run is its converter to BF16 followed by one llama-quantize per file type (threads = cores), as a
user runs it.

Each round runs the five in turn (the order rotates from round to round); medians over `--repeats` rounds.

    python bench/gguf_cold_start.py [--models qwen,demo] [--types Q4_K_M,Q3_K_M] [--repeats 2]

The Qwen2.5-Coder-1.5B checkpoint comes from `bash ../shared/models/build.sh`.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import median

from gguf_vs_llamacpp import (COMPARE, FTYPE_IDS, LLAMA_CPP_PYTHON, QUANTIZE, RESULTS, ROOT, THREADS,
                              llama_cpp_converter, machine, run_fresh)

WORK = ROOT / "bench" / "_work" / "cold_start"


def qwen_folder() -> Path:
    out = subprocess.run(["bash", str(ROOT.parent / "shared" / "models" / "build.sh")], capture_output=True,
                         text=True, check=True).stdout.strip().splitlines()[-1]
    return Path(out)


def demo_folder() -> Path:
    return Path(subprocess.run([sys.executable, "-c", "from quantkit.model.source import open_model; "
                                "print(open_model('demo:smollm2-135m').folder)"],
                               capture_output=True, text=True, check=True).stdout.strip())


def bench_model(label: str, src: Path, types: list[str], converter: Path, repeats: int) -> dict:
    work = WORK / label.split()[0]
    work.mkdir(parents=True, exist_ok=True)
    qk_out, kernels, inductor = work / "quantkit", work / "kernels", work / "inductor"
    bf16 = work / "llama-BF16.gguf"
    fmt = [a for t in types for a in ("-f", f"gguf:{t}")]
    qk_cmd = [sys.executable, "-m", "quantkit", "convert", str(src), *fmt, "-o", str(qk_out), "--device", "cpu"]
    qk_env = {"QUANTKIT_KERNEL_DIR": str(kernels), "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    own_env = {**qk_env, "QUANTKIT_SHIPPED_KERNELS": "0"}
    built: dict[str, list[int]] = {"cold": [], "cold, own build": []}

    def first(name: str, env: dict) -> float:
        shutil.rmtree(kernels, ignore_errors=True)
        shutil.rmtree(inductor, ignore_errors=True)
        wall = run_fresh(qk_cmd, qk_out.glob("*.gguf"), env=env)[0]
        built[name].append(sum(1 for _ in kernels.rglob("*.pt2")))
        return wall

    def warm() -> float:
        return run_fresh(qk_cmd, qk_out.glob("*.gguf"), env=qk_env)[0]

    def warm_own() -> float:
        if not any(kernels.rglob("*.pt2")):       # it follows a run that built them
            first("cold, own build", own_env)
        return run_fresh(qk_cmd, qk_out.glob("*.gguf"), env=own_env)[0]

    def llama() -> float:
        wall = run_fresh([sys.executable, str(converter), str(src), "--outtype", "bf16", "--outfile", str(bf16)],
                         [bf16], env={"PYTHONPATH": str(converter.parent / "gguf-py")})[0]
        for t in types:
            ref = work / f"llama-{t}.gguf"
            wall += run_fresh([sys.executable, "-c", QUANTIZE, str(bf16), str(ref), str(FTYPE_IDS[t]), str(THREADS)],
                              [ref])[0]
        return wall

    steps = [("cold", lambda: first("cold", qk_env)), ("cold, own build", lambda: first("cold, own build", own_env)),
             ("warm", warm), ("warm, own build", warm_own),
             ("llama.cpp", llama)]
    runs: dict[str, list[float]] = {name: [] for name, _ in steps}
    for i in range(repeats):
        for name, step in steps[i % len(steps):] + steps[:i % len(steps)]:
            runs[name].append(step())
            print(label, name, round(runs[name][-1], 1), flush=True)
    identical = {}
    for t in types:
        qk_file = next(qk_out.glob(f"*-{t}.gguf"))
        cmp = json.loads(subprocess.run([sys.executable, "-c", COMPARE, str(qk_file), str(work / f"llama-{t}.gguf")],
                                        capture_output=True, text=True, check=True).stdout)
        identical[t] = cmp["identical_tensors"] == cmp["tensors"] and cmp["same_types"]
    med = {name: median(v) for name, v in runs.items()}
    return {"model": label, "types": types, "seconds": med, "ratio": {k: v / med["llama.cpp"] for k, v in med.items()},
            "kernels_built": {k: max(v) for k, v in built.items()},
            "runs_s": {k: [round(w, 1) for w in v] for k, v in runs.items()}, "identical": identical}


def write_results(result: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gguf_cold_start.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# GGUF: cold and warm start against llama.cpp (convert_hf_to_gguf.py + llama-quantize)\n",
             f"Date {result['date']}. Machine: {result['machine']}. Reference: {result['llama_cpp']}, "
             f"{result['threads']} threads. Command: `{result['command']}`.\n",
             "Goal: cold ≤ 1.0× llama.cpp, warm ≤ 0.5×. Cold: empty quantkit kernel folder and empty Inductor "
             "cache, with the kernels quantkit ships (x86-64 with AVX2); own build: the shipped set left aside "
             "(QUANTKIT_SHIPPED_KERNELS=0), as on a machine that cannot use it; warm: a later run. llama.cpp: its "
             "converter to BF16, then one llama-quantize per type. Medians over the rounds (each run's time in "
             "brackets); ratios to llama.cpp.\n",
             "| model | types | run | quantkit s | llama.cpp s | ratio | kernels built | identical tensors |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        br = {k: "/".join(f"{w:.0f}" for w in v) for k, v in r["runs_s"].items()}
        llama = f"{r['seconds']['llama.cpp']:.1f} ({br['llama.cpp']})"
        same = "yes" if all(r["identical"].values()) else "NO"
        for run in ("cold", "cold, own build", "warm", "warm, own build"):
            lines.append(f"| {r['model']} | {' + '.join(r['types'])} | {run} | {r['seconds'][run]:.1f} ({br[run]}) | "
                         f"{llama} | **{r['ratio'][run]:.2f}** | {r['kernels_built'].get(run, 0)} | {same} |")
    for note in result.get("notes", []):
        lines.append(f"\nNote: {note}")
    (RESULTS / "gguf_cold_start.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen,demo")
    ap.add_argument("--types", default="Q4_K_M,Q3_K_M")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the three runs; the median is reported")
    args = ap.parse_args()
    types = args.types.split(",")
    converter = llama_cpp_converter()
    result = {"benchmark": "gguf_cold_start", "date": dt.date.today().isoformat(), "machine": machine(),
              "llama_cpp": f"llama-cpp-python {LLAMA_CPP_PYTHON} (llama.cpp 0c1e57098)", "threads": THREADS,
              "command": "python bench/gguf_cold_start.py " + " ".join(sys.argv[1:]), "rows": []}
    models = {"qwen": ("qwen2.5-coder-1.5b (bf16)", qwen_folder), "demo": ("demo (SmolLM2-135M, bf16)", demo_folder)}
    for name in args.models.split(","):
        label, folder = models[name]
        result["rows"].append(bench_model(label, folder(), types, converter, args.repeats))
        write_results(result)


if __name__ == "__main__":
    main()
