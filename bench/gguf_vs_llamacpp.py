"""Benchmark: quantkit's HF -> GGUF against llama.cpp's convert_hf_to_gguf.py + llama-quantize, same run.

For each model (the demo, and a synthetic llama with hidden size 2048 and >= 1 GiB of weights made here)
and each file type: wall time and peak RSS of both pipelines, whether the tensor data is byte-identical,
file sizes; for the demo also perplexity, mean KLD and top-1 agreement of every file run in llama.cpp.

llama.cpp's side: its converter is taken from the llama-cpp-python sdist (downloaded into bench/_work, not
kept in the repo) and writes a BF16 GGUF (lossless for a bf16 checkpoint), then llama-quantize (through
llama-cpp-python, threads = cores) makes each type. F16/BF16/F32 come straight from the converter.

Each row runs both tools `--repeats` times (default 3) in alternating order and reports the median wall time
of each; the samples are kept in the JSON.

    python bench/gguf_vs_llamacpp.py [--types Q8_0,Q4_K_M] [--models demo,synthetic] [--windows 40] [--repeats 3]

`--lowbit` benchmarks the file types of the low-bit lattice and ternary encoders instead (IQ1_S ... IQ3_M, TQ1_0,
TQ2_0, Q2_K_S; results in gguf_vs_llamacpp_lowbit.*).  Most of them need an importance matrix, so one matrix
file per model is made first (quantkit's calibration pass on wikitext2-valid, `--imatrix-out`; not timed) and both
tools quantize with that same file: quantkit with `--imatrix-file`, llama.cpp with the llama-quantize program
(built once from the pinned sdist, as bench/imatrix_llamacpp.py does: the Python binding cannot pass a matrix).

The driver imports no torch: each measured step runs in its own process, timed with os.wait4, so a child's
peak RSS is its own (Linux carries ru_maxrss across fork + exec from a large parent).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tarfile
from collections.abc import Iterable
from pathlib import Path
from statistics import median

import measure  # bench/measure.py
from imatrix_llamacpp import CALIB, build_tools, quantkit as run_quantkit  # bench/imatrix_llamacpp.py

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "_work" / "gguf"
RESULTS = ROOT / "bench" / "results"
LLAMA_CPP_PYTHON = "0.3.36"
ALL_TYPES = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_S", "Q4_K_M",
             "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS", "F16", "BF16", "F32"]
FTYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11,
             "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18,
             "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32}
# the file types of the lattice (IQ1-IQ3) and ternary encoders, as llama-quantize names them
LOWBIT_TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ1_S", "IQ1_M",
                "TQ1_0", "TQ2_0", "Q2_K_S"]
THREADS = os.cpu_count() or 1


def run(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    # written-back first: a run must not pay for the dirty pages of the previous one's file (measured:
    # quantkit's F32 file took 9.2 s right after another 2 GiB write, 5.9-6.3 s after a sync)
    os.sync()
    return measure.run(cmd, WORK / "last_command.log", env)


def run_fresh(cmd: list[str], old_outputs: Iterable[Path], env: dict | None = None) -> tuple[float, int]:
    # each tool writes a new file, as a user's run does: replacing a 2 GiB file from an earlier run
    # made ext4 flush the new one at the rename (measured: quantkit F32 5.5-9.5 s over an old file,
    # 4.4-4.9 s without one); each tool's old file is deleted just before its own run, so that
    # neither pays for freeing the other's
    for old in list(old_outputs):
        old.unlink(missing_ok=True)
    return run(cmd, env)


def kernels_built() -> int:
    return sum(1 for _ in KERNEL_DIR.rglob("*.pt2")) if KERNEL_DIR.is_dir() else 0


def llama_cpp_converter() -> Path:
    """convert_hf_to_gguf.py from the llama-cpp-python sdist matching the installed llama.cpp."""
    dest = WORK / "llama.cpp"
    script = dest / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    dl = WORK / "sdist"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(dl),
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
    with tarfile.open(next(dl.glob("*.tar.gz"))) as tar:
        top = tar.getnames()[0].split("/")[0]
        prefix = f"{top}/vendor/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and
                   (m.name.startswith(prefix + "conversion/") or m.name.startswith(prefix + "gguf-py/")
                    or m.name == prefix + "convert_hf_to_gguf.py")]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(dest, members=members, filter="data")
    return script


MAKE_SYNTHETIC = r"""
import json, shutil, sys, torch
from pathlib import Path
from safetensors.torch import save_file
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
hidden, inter, layers, heads, kv, vocab = 2048, 5632, 8, 16, 4, 49152
cfg = json.loads((src / "config.json").read_text())
cfg.update(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
           num_key_value_heads=kv, head_dim=hidden // heads, vocab_size=vocab, tie_word_embeddings=False)
(out / "config.json").write_text(json.dumps(cfg, indent=2))
for f in src.iterdir():
    if f.name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens")):
        shutil.copy(f, out / f.name)
g = torch.Generator().manual_seed(0)
# Heavier-tailed than a Gaussian (like trained weights), bf16 like a real checkpoint.
w = lambda *s: (torch.randn(*s, generator=g) * 0.02 * (1 + torch.rand(*s, generator=g))).to(torch.bfloat16)
sd = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden),
      "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
kvd = kv * hidden // heads
for i in range(layers):
    p = f"model.layers.{i}."
    sd.update({p + "self_attn.q_proj.weight": w(hidden, hidden), p + "self_attn.k_proj.weight": w(kvd, hidden),
               p + "self_attn.v_proj.weight": w(kvd, hidden), p + "self_attn.o_proj.weight": w(hidden, hidden),
               p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
               p + "mlp.down_proj.weight": w(hidden, inter),
               p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
print(sum(t.numel() for t in sd.values()))
"""

QUANTIZE = r"""
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = int(sys.argv[3]); p.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""

COMPARE = r"""
import json, sys, gguf, numpy as np
a = {t.name: t for t in gguf.GGUFReader(sys.argv[1]).tensors}
b = {t.name: t for t in gguf.GGUFReader(sys.argv[2]).tensors}
same_types = a.keys() == b.keys() and all(a[n].tensor_type == b[n].tensor_type for n in a)
identical = [n for n in a if n in b and np.asarray(a[n].data).tobytes() == np.asarray(b[n].data).tobytes()]
nbytes = sum(int(t.n_bytes) for t in a.values())
diff_bytes = sum(int(a[n].n_bytes) for n in a if n not in identical)
counts = {}
for t in a.values():
    counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
print(json.dumps({"tensors": len(a), "identical_tensors": len(identical), "same_types": same_types,
                  "differing_bytes_fraction": diff_bytes / nbytes, "tensor_types": counts}))
"""

EVAL = r"""
import json, sys
from pathlib import Path
from quantkit.backends.gguf import llamacpp
from quantkit.eval.harness import Scores, final_hidden_states, load_windows
from quantkit.model.source import open_model
base = open_model(sys.argv[1]); data = Path(sys.argv[2]); windows = int(sys.argv[3])
tokens = load_windows(base.tokenizer, data, 512, windows)
hidden = final_hidden_states(base, tokens)  # the base runs once; its logits are re-formed per window
head = base.lm_head_weight().float()
out = {}
for f in map(Path, sys.argv[4:]):
    s = Scores()
    for wi, logits in enumerate(llamacpp.window_logits(f, tokens)):
        s.add(logits[:-1], tokens[wi, 1:], (hidden[wi] @ head.T)[:-1])
    out[f.name] = s.result(model=f.name, base=base.name, data=str(data), ctx=512, windows=windows).to_dict()
    print(f.name, out[f.name]["perplexity"], out[f.name]["mean_kld"], file=sys.stderr, flush=True)
print(json.dumps(out))
"""


# quantkit's fused CPU kernels (quantkit/backends/gguf/fusion.py) are built once per machine.  The benchmark
# starts from an empty kernel folder and converts the synthetic model to every fused type once with building
# forced, then again with the kernels built: the difference is what a first run on a machine pays, once.
WARM_TYPES = ["Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS"]
KERNEL_DIR = WORK / "kernels"
LOWBIT_NOTES = [
    "the demo's hidden size (576) is not a multiple of 256, so llama-quantize's fallback gives every tensor with "
    "rows of 576 another type (IQ4_NL, Q4_0; see the tensor types below): in the lattice rows only the 27-30 "
    "ffn_down tensors (rows of 1536) are in the file's own low-bit types, about a third of the weights; the "
    "encoders themselves, on tensors wholly in each type, are measured in bench/results/gguf_lowbit_encoders.md",
    "TQ1_0 and TQ2_0 are for ternary-trained models (BitNet b1.58); on the demo's ordinary weights they are "
    "unusable, as in llama.cpp (same bytes)",
]
DEMO_NOTES = [
    "the demo checkpoint is a dequantized Q4_1 (group 32) model, so Q4_1 re-quantizes it almost losslessly and "
    "grids that do not align with it (Q5_1, Q3_K, IQ4) look worse than on a normally trained model",
    "demo Q2_K and Q3_K_S are the same file: with hidden 576 llama.cpp's fallback turns both mixtures into "
    "Q4_0 + Q3_K(ffn_down) + Q8_0(tied output)",
]


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {THREADS} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def make_imatrix(src: Path, work: Path, samples: int, seqlen: int) -> Path:
    """One importance-matrix file for the model (llama-imatrix's GGUF layout), from quantkit's calibration pass on
    wikitext2-valid; both tools then quantize with it."""
    matrix = work / f"imatrix-{samples}x{seqlen}.gguf"
    if not matrix.is_file():
        out = work / "imatrix-run"
        run_quantkit("convert", str(src), "-f", "gguf:Q4_K_M", "-o", str(out), "--device", "cpu", "--imatrix",
                     "--calib", str(CALIB), "--calib-samples", str(samples), "--calib-seqlen", str(seqlen),
                     "--imatrix-out", str(matrix))
        for f in out.glob("*.gguf"):
            f.unlink()
    return matrix


def bench_model(label: str, src: Path, types: list[str], converter: Path, work: Path, repeats: int,
                imatrix: Path | None = None, quantize_bin: Path | None = None) -> list[dict]:
    """`imatrix` (with `quantize_bin`, llama-quantize): both tools quantize with that matrix file."""
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    conv_env = {"PYTHONPATH": str(converter.parent / "gguf-py")}
    bf16 = work / "llama-BF16.gguf"
    qk_dir = work / "quantkit"

    def convert(outtype: str, out: Path) -> tuple[float, int]:
        return run_fresh([sys.executable, str(converter), str(src), "--outtype", outtype, "--outfile", str(out)],
                         [out], env=conv_env)

    # llama.cpp's quantized files start from its BF16 conversion, made once per row set: its time is the
    # median of `repeats` runs, added to each quantize step
    conv = [convert("bf16", bf16) for _ in range(repeats)]
    conv_wall, conv_rss = median(w for w, _ in conv), max(r for _, r in conv)
    for t in types:
        ref = work / f"llama-{t}.gguf"

        def quantkit() -> tuple[float, int]:
            matrix = ["--imatrix-file", str(imatrix)] if imatrix else []
            return run_fresh([sys.executable, "-m", "quantkit", "convert", str(src), "-f", f"gguf:{t}", "-o",
                              str(qk_dir), "--device", "cpu", *matrix], qk_dir.glob(f"*-{t}.gguf"))

        def llama() -> tuple[float, int]:
            if t in ("F16", "BF16", "F32"):
                return convert(t.lower(), ref)
            if imatrix:
                cmd = [str(quantize_bin), "--imatrix", str(imatrix), str(bf16), str(ref), t, str(THREADS)]
            else:
                cmd = [sys.executable, "-c", QUANTIZE, str(bf16), str(ref), str(FTYPE_IDS[t]), str(THREADS)]
            wall, rss = run_fresh(cmd, [ref])
            return conv_wall + wall, max(conv_rss, rss)

        before = kernels_built()
        qk_runs, ll_runs = [], []
        for i in range(repeats):
            # the tools take turns going first: on this VM a run's time depends on what the previous
            # process left in the page cache, and a fixed order would hand one tool the same state each time
            pair = [(quantkit, qk_runs), (llama, ll_runs)]
            for step, runs in pair if i % 2 == 0 else pair[::-1]:
                runs.append(step())
        new_kernels = kernels_built() - before
        qk_file = next(qk_dir.glob(f"*-{t}.gguf"))
        cmp = json.loads(subprocess.run([sys.executable, "-c", COMPARE, str(qk_file), str(ref)], capture_output=True,
                                        text=True, check=True).stdout)
        qk_wall, ref_wall = median(w for w, _ in qk_runs), median(w for w, _ in ll_runs)
        qk_rss, ref_rss = max(r for _, r in qk_runs), max(r for _, r in ll_runs)
        row = {"model": label, "type": t, "quantkit_s": qk_wall, "llamacpp_s": ref_wall, "ratio": qk_wall / ref_wall,
               "quantkit_runs_s": [round(w, 3) for w, _ in qk_runs],
               "llamacpp_runs_s": [round(w, 3) for w, _ in ll_runs],
               "quantkit_rss": qk_rss, "llamacpp_rss": ref_rss, "rss_ratio": qk_rss / ref_rss,
               "identical": cmp["identical_tensors"] == cmp["tensors"] and cmp["same_types"],
               "identical_tensors": f"{cmp['identical_tensors']}/{cmp['tensors']}",
               "differing_bytes_fraction": cmp["differing_bytes_fraction"],
               "tensor_types": cmp["tensor_types"], "date": dt.date.today().isoformat(),
               "kernels_built_during_run": new_kernels,
               "quantkit_size": qk_file.stat().st_size, "llamacpp_size": ref.stat().st_size,
               "quantkit_file": str(qk_file), "llamacpp_file": str(ref)}
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_file")}), flush=True)
        rows.append(row)
    return rows


def build_kernels(syn: Path) -> dict:
    """Empty the kernel folder, convert to every fused type with building forced, then again with the
    kernels built; the difference is the one-time cost on a new machine."""
    import shutil
    shutil.rmtree(KERNEL_DIR, ignore_errors=True)
    out = WORK / "warm-up"
    cmd = [sys.executable, "-m", "quantkit", "convert", str(syn), "-o", str(out), "--device", "cpu"]
    for t in WARM_TYPES:
        cmd += ["-f", f"gguf:{t}"]
    walls = []
    for _ in range(2):
        shutil.rmtree(out, ignore_errors=True)
        walls.append(run(cmd, env={"QUANTKIT_COMPILE": "1"})[0])
    shutil.rmtree(out, ignore_errors=True)
    return {"types": WARM_TYPES, "kernels": kernels_built(), "first_run_s": round(walls[0], 1),
            "second_run_s": round(walls[1], 1), "build_s": round(walls[0] - walls[1], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=None, help="file types (default: all of the mode)")
    ap.add_argument("--models", default=None, help="demo,synthetic (default; --lowbit: demo: at its speed the "
                    "synthetic model's IQ files take tens of minutes each)")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each tool per row; the median is reported")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "wikitext2-test.raw.txt")
    ap.add_argument("--out", default=None, help="results name (default gguf_vs_llamacpp[_lowbit])")
    ap.add_argument("--lowbit", action="store_true", help="the lattice and ternary file types, with an importance "
                    "matrix file given to both tools (see the module docstring)")
    ap.add_argument("--merge", action="store_true", help="replace only these rows (and their quality) in the "
                    "existing results, keeping the others")
    ap.add_argument("--calib-samples", type=int, default=128, help="--lowbit: calibration windows of the matrix")
    ap.add_argument("--calib-seqlen", type=int, default=512, help="--lowbit: tokens per calibration window")
    args = ap.parse_args()
    types = args.types.split(",") if args.types else (LOWBIT_TYPES if args.lowbit else ALL_TYPES)
    args.models = args.models or ("demo" if args.lowbit else "demo,synthetic")
    args.out = args.out or ("gguf_vs_llamacpp_lowbit" if args.lowbit else "gguf_vs_llamacpp")
    converter = llama_cpp_converter()
    os.environ["QUANTKIT_KERNEL_DIR"] = str(KERNEL_DIR)
    demo = Path(subprocess.run([sys.executable, "-c", "from quantkit.model.source import open_model; "
                                "print(open_model('demo:smollm2-135m').folder)"],
                               capture_output=True, text=True, check=True).stdout.strip())
    result = {"benchmark": "gguf_vs_llamacpp", "date": dt.date.today().isoformat(), "machine": machine(),
              "llama_cpp": f"llama-cpp-python {LLAMA_CPP_PYTHON} (llama.cpp 0c1e57098)", "threads": THREADS,
              "repeats": args.repeats, "rows": [], "quality": {}}
    syn = WORK / "synthetic-src"
    if "synthetic" in args.models and not (syn / "model.safetensors").is_file():
        subprocess.run([sys.executable, "-c", MAKE_SYNTHETIC, str(demo), str(syn)], check=True)
    quantize_bin = None

    def matrix_of(src: Path, work: Path) -> Path | None:
        return make_imatrix(src, work, args.calib_samples, args.calib_seqlen) if args.lowbit else None

    if args.lowbit:
        # the lattice types' neighbour search and the mixtures' K-quant tensors use the shipped kernels
        quantize_bin = build_tools() / "llama-quantize"
        result["imatrix"] = {"data": CALIB.name, "samples": args.calib_samples, "seqlen": args.calib_seqlen,
                             "made_by": "quantkit --imatrix --imatrix-out (GGUF), not timed; both tools read it"}
    elif "synthetic" in args.models:
        result["kernel_build"] = build_kernels(syn)
    demo_rows = []
    if "demo" in args.models:
        result["notes"] = list(LOWBIT_NOTES if args.lowbit else DEMO_NOTES)
        work = WORK / ("demo-lowbit" if args.lowbit else "demo")
        demo_rows = bench_model("demo (SmolLM2-135M, bf16)", demo, types, converter, work, args.repeats,
                                matrix_of(demo, work), quantize_bin)
        result["rows"] += demo_rows
    if "synthetic" in args.models:
        result["synthetic_bytes"] = (syn / "model.safetensors").stat().st_size
        work = WORK / ("synthetic-lowbit" if args.lowbit else "synthetic")
        result["rows"] += bench_model("synthetic llama (hidden 2048, 8 layers, bf16)", syn, types, converter,
                                      work, args.repeats, matrix_of(syn, work), quantize_bin)
    # quality last: it is not timed, so nothing after it can be disturbed by what else runs on the machine
    if demo_rows and args.data.is_file():
        proc = subprocess.run([sys.executable, "-c", EVAL, "demo:smollm2-135m", str(args.data),
                               str(args.windows)] + [r["quantkit_file"] for r in demo_rows],
                              capture_output=True, text=True, check=True)
        result["quality"] = json.loads(proc.stdout.strip().splitlines()[-1])
    if args.merge and (RESULTS / f"{args.out}.json").is_file():
        result = merged(json.loads((RESULTS / f"{args.out}.json").read_text()), result)
    write_results(result, args.out)


def merged(old: dict, new: dict) -> dict:
    """`old` with `new`'s rows (same model and type) and quality entries in place of its own; the header (date,
    machine) is new's, and rows from another day keep their own date."""
    key = lambda r: (r["model"], r["type"])
    fresh = {key(r): r for r in new["rows"]}
    rows = [fresh.pop(key(r), r) for r in old["rows"]] + list(fresh.values())
    for r in old["rows"]:
        r.setdefault("date", old["date"])
    return {**old, **{k: v for k, v in new.items() if k not in ("rows", "quality")}, "rows": rows,
            "quality": {**old.get("quality", {}), **new.get("quality", {})}}


def timing(median_s: float, runs: list[float] | None) -> str:
    return f"{median_s:.1f}" + (f" ({min(runs):.1f}–{max(runs):.1f})" if runs and len(runs) > 1 else "")


def write_results(result: dict, name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    for r in result["rows"]:
        r.pop("quantkit_file", None)
        r.pop("llamacpp_file", None)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    gib = lambda b: f"{b / 2**30:.2f}"
    lines = ["# GGUF: quantkit vs llama.cpp (convert_hf_to_gguf.py + llama-quantize)\n",
             f"Date {result['date']}. Machine: {result['machine']}. Reference: {result['llama_cpp']}, "
             f"{result['threads']} threads. Command: `python bench/gguf_vs_llamacpp.py"
             f"{' --lowbit' if result.get('imatrix') else ''}`.\n",
             "Goal per type: quantkit wall time ≤ 1.0× llama.cpp's, identical tensor bytes, peak RSS ≤ llama.cpp's.\n",
             *([f"Both tools quantize with the same importance-matrix file: {result['imatrix']['samples']} × "
                f"{result['imatrix']['seqlen']} tokens of {result['imatrix']['data']}, collected by quantkit's "
                "calibration pass and written in llama-imatrix's GGUF layout (not timed); quantkit reads it with "
                "`--imatrix-file`, llama.cpp's side is its converter to BF16 plus the llama-quantize program with "
                "`--imatrix`.\n"] if result.get("imatrix") else []),
             f"Times are the median of {result.get('repeats', 1)} runs of each tool, the tools taking turns to go "
             "first (the range of the runs in brackets); RSS is the highest of the runs.\n",
             "| model | type | quantkit s | llama.cpp s | time ratio | quantkit RSS GiB | llama.cpp RSS GiB | RSS ratio "
             "| identical tensors | file MiB (qk / llama) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['type']} | {timing(r['quantkit_s'], r.get('quantkit_runs_s'))} | "
                     f"{timing(r['llamacpp_s'], r.get('llamacpp_runs_s'))} | "
                     f"**{r['ratio']:.2f}** | {gib(r['quantkit_rss'])} | {gib(r['llamacpp_rss'])} | {r['rss_ratio']:.2f} | "
                     f"{'yes' if r['identical'] else 'no'} ({r['identical_tensors']}) | "
                     f"{r['quantkit_size'] / 2**20:.1f} / {r['llamacpp_size'] / 2**20:.1f} |")
    kb = result.get("kernel_build")
    if kb:
        built_late = [f"{r['model'].split(' (')[0]} {r['type']}" for r in result["rows"]
                      if r.get("kernels_built_during_run")]
        if kb["kernels"]:
            built = (f"Here they were built from an empty folder before the timed runs: converting the synthetic "
                     f"model to {', '.join(kb['types'])} in one run took {kb['first_run_s']} s with the "
                     f"{kb['kernels']} kernels being built and {kb['second_run_s']} s once they were, so building "
                     f"cost {kb['build_s']} s, once. The timed runs load them (milliseconds)")
        else:
            built = ("Here the kernels quantkit ships covered every fused type, so none was built from the empty "
                     "folder (a machine that cannot use the shipped set builds its own: "
                     "bench/results/gguf_cold_start.md)")
        lines.append(f"\nNote: quantkit's fused CPU kernels (AOTInductor, see quantkit/backends/gguf/fusion.py) are built "
                     f"once per machine. {built}; kernels built during a timed run: "
                     f"{', '.join(built_late) if built_late else 'none'}. Every timed run of either tool "
                     "starts after os.sync(), so that none pays for the previous one's dirty pages.")
    older = [f"{r['model'].split(' (')[0]} {r['type']} ({r['date']})" for r in result["rows"]
             if r.get("date", result["date"]) != result["date"]]
    if older:
        lines.append(f"\nNote: rows measured on another day than the header's: {', '.join(older)}.")
    for note in result.get("notes", []):
        lines.append(f"\nNote: {note}.")
    typed = [r for r in result["rows"] if r.get("tensor_types")]
    if typed:
        lines += ["", "## Tensor types in quantkit's files (the same as llama.cpp's)\n", "| model | type | tensors |",
                  "|---|---|---|"]
        for r in typed:
            kinds = sorted(r["tensor_types"].items(), key=lambda kv: -kv[1])
            lines.append(f"| {r['model'].split(' (')[0]} | {r['type']} | {', '.join(f'{n} {k}' for k, n in kinds)} |")
    if result.get("quality"):
        lines += ["", "## Demo model through llama.cpp (wikitext-2 test, 512-token windows; base: the bf16 model "
                  "in quantkit's harness)\n", "| file | perplexity | mean KLD | top-1 agreement |", "|---|---|---|---|"]
        for file, q in result["quality"].items():
            lines.append(f"| {file} | {q['perplexity']:.3f} | {q['mean_kld']:.5f} | {100 * q['top1_agreement']:.2f} % |")
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--render":  # re-render the Markdown from a results JSON
        write_results(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[2]).stem)
    else:
        main()
