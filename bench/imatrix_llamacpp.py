"""Importance-matrix files against llama.cpp's own tools: quantkit's file read by llama-quantize, and llama-imatrix's
file read by quantkit, each giving the same tensors as the other tool given the same file (issue 18 item 2).

llama-quantize and llama-imatrix are built once from the llama.cpp that the pinned llama-cpp-python sdist vendors
(the Makefile's version and build flags), into quantkit's cache.  Then, on the demo model:

1. quantkit converts to GGUF F32 (llama-quantize's input) and, in one calibrated run, to Q4_K_M with `--imatrix`,
   writing its matrix with `--imatrix-out` (GGUF, and the legacy .dat in a second run);
   llama-quantize quantizes the F32 file to Q4_K_M with that matrix file;
2. llama-imatrix collects its own matrix (GGUF and .dat) over the calibration text;
   quantkit (`--imatrix-file`) and llama-quantize each quantize with it;

and every tensor's type and bytes are compared between the two tools' files (the metadata differs by design: the
matrix file's name, the tool's own keys).

    python bench/imatrix_llamacpp.py [--samples 16] [--seqlen 256] [--types Q4_K_M Q4_0 IQ4_NL]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CALIB = ROOT.parent / "shared" / "data" / "wikitext2-valid.txt"
TOOLS = ("llama-quantize", "llama-imatrix")


def makefile_value(name: str) -> str:
    """A variable of the project's Makefile (the pinned version and llama.cpp's build flags live there only)."""
    m = re.search(rf"^{name}\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    return m.group(1).strip()


def build_tools() -> Path:
    """The folder holding llama-quantize and llama-imatrix, built from the pinned sdist when missing."""
    version = makefile_value("LLAMA_CPP_PYTHON")
    cache = Path(os.environ.get("QUANTKIT_CACHE") or Path.home() / ".cache" / "quantkit")
    build = cache / f"llama-tools-{version}"
    binaries = build / "bin"
    if all((binaries / t).is_file() for t in TOOLS):
        return binaries
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", tmp], check=True)
        with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        flags = makefile_value("LLAMA_CPP_CMAKE").split()
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *flags,
                        "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
                        "-DBUILD_SHARED_LIBS=OFF"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", *TOOLS, "-j", str(os.cpu_count() or 2)],
                       check=True, stdout=subprocess.DEVNULL)
    return binaries


def quantkit(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "quantkit", *args], check=True, stdout=subprocess.DEVNULL)


def tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, bytes(t.data.tobytes())) for t in reader.tensors}


def compare(ours: Path, theirs: Path) -> dict:
    a, b = tensors(ours), tensors(theirs)
    differ = sorted(n for n in a.keys() & b.keys() if a[n] != b[n])
    return {"tensors": len(a), "same_names": a.keys() == b.keys(), "identical": len(a.keys() & b.keys()) - len(differ),
            "differing": [f"{n} ({a[n][0]} vs {b[n][0]})" for n in differ][:20],
            "only_in_one": sorted(a.keys() ^ b.keys())[:20]}


def compare_tools(ftype: str, work: Path, model: str, calib: list[str], f32: Path, quantize: Path, imatrix: Path,
                  a) -> list[dict]:
    """The four comparisons (quantkit's file and llama-imatrix's, GGUF and .dat) at one file type, and the
    control without a matrix."""
    name = f"smollm2-135m-{ftype}.gguf"
    rows = []
    for fmt in ("gguf", "dat"):
        # quantkit collects and writes the file; llama-quantize reads it
        ours_dir, matrix = work / f"qk-{ftype}-{fmt}", work / f"quantkit.imatrix.{fmt}"
        quantkit("convert", model, "-f", f"gguf:{ftype}", "-o", str(ours_dir), "--imatrix", *calib,
                 "--imatrix-out", str(matrix), "--imatrix-format", fmt)
        theirs = work / f"lq-{ftype}-from-quantkit-{fmt}.gguf"
        subprocess.run([str(quantize), "--imatrix", str(matrix), str(f32), str(theirs), ftype],
                       check=True, capture_output=True)
        rows.append({"type": ftype, "file": f"quantkit's ({fmt})", "read by": "llama-quantize vs quantkit",
                     **compare(ours_dir / name, theirs)})
        # llama-imatrix collects and writes the file; quantkit reads it
        matrix = work / f"llama.imatrix.{fmt}"
        if not matrix.is_file():
            subprocess.run([str(imatrix), "-m", str(f32), "-f", str(CALIB), "--chunks", str(a.samples),
                            "-c", str(a.seqlen), "-o", str(matrix), "--output-format", fmt, "--no-ppl"],
                           check=True, capture_output=True)
        ours_dir = work / f"qk-{ftype}-from-llama-{fmt}"
        quantkit("convert", model, "-f", f"gguf:{ftype}", "-o", str(ours_dir), "--imatrix-file", str(matrix),
                 "--device", "cpu")
        theirs = work / f"lq-{ftype}-from-llama-{fmt}.gguf"
        subprocess.run([str(quantize), "--imatrix", str(matrix), str(f32), str(theirs), ftype],
                       check=True, capture_output=True)
        rows.append({"type": ftype, "file": f"llama-imatrix's ({fmt})", "read by": "quantkit vs llama-quantize",
                     **compare(ours_dir / name, theirs)})
        print(ftype, rows[-2]["file"], rows[-2]["identical"], "/", rows[-2]["tensors"], "|",
              rows[-1]["file"], rows[-1]["identical"], "/", rows[-1]["tensors"], flush=True)
    # the control: without a matrix, how many tensors come out otherwise (what the rows above would miss if the
    # matrix were silently ignored)
    plain = work / f"qk-{ftype}-plain"
    quantkit("convert", model, "-f", f"gguf:{ftype}", "-o", str(plain), "--device", "cpu")
    rows.append({"type": ftype, "file": "none (control)", "read by": "quantkit without vs with its matrix",
                 **compare(plain / name, work / f"qk-{ftype}-gguf" / name)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q4_0", "IQ4_NL"],
                    help="file types (Q4_0 and IQ4_NL choose some ffn_down types by whether a matrix is given)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/quantkit-imatrix-llamacpp"))
    a = ap.parse_args()
    t0 = time.perf_counter()
    tools = build_tools()
    built = time.perf_counter() - t0
    work = a.work
    work.mkdir(parents=True, exist_ok=True)
    quantize, imatrix = tools / "llama-quantize", tools / "llama-imatrix"
    model = "demo:smollm2-135m"
    calib = ["--calib", str(CALIB), "--calib-samples", str(a.samples), "--calib-seqlen", str(a.seqlen),
             "--device", "cpu", "--no-resume"]
    f32 = work / "f32" / "smollm2-135m-F32.gguf"
    if not f32.is_file():
        quantkit("convert", model, "-f", "gguf:F32", "-o", str(f32.parent))
    rows = []
    for ftype in a.types:
        rows += compare_tools(ftype, work, model, calib, f32, quantize, imatrix, a)
    write_results(rows, a, built)


def write_results(rows: list[dict], a, built: float) -> None:
    meta = {"date": dt.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "llama.cpp": f"vendored by llama-cpp-python {makefile_value('LLAMA_CPP_PYTHON')}",
            "model": "demo:smollm2-135m", "types": a.types,
            "calibration": f"{a.samples} × {a.seqlen} tokens of {CALIB.name}", "tools_build_seconds": round(built)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "imatrix_llamacpp.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["# Importance-matrix files: quantkit and llama.cpp's tools read each other's (bench/imatrix_llamacpp.py)",
             "", f"{meta['date']}, {meta['machine']}; llama.cpp {meta['llama.cpp']}; {meta['model']} at {', '.join(a.types)}; "
             f"calibration {meta['calibration']} (quantkit's windows; llama-imatrix its first {a.samples} chunks "
             f"of {a.seqlen}).", "",
             "Each row: the matrix file, then the two tools that quantized with it (llama-quantize from quantkit's "
             "F32 GGUF); tensors whose type and bytes are identical in both outputs.", "",
             "| type | matrix file | quantized by | tensors identical | differing |", "| --- | --- | --- | ---: | --- |"]
    for r in rows:
        differing = r["differing"] + r["only_in_one"]
        more = r["tensors"] - r["identical"] - len(differing)
        lines.append(f"| {r['type']} | {r['file']} | {r['read by']} | {r['identical']} / {r['tensors']} | "
                     f"{', '.join(differing) + (f' and {more} more' if more > 0 else '') or 'none'} |")
    (RESULTS / "imatrix_llamacpp.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
