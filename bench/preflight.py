"""Benchmark: the dry run's estimates against what the run then takes, for every format, on the demo model,
on a >= 1 GiB synthetic llama, and (the calibrated formats) on a synthetic mixtral.

For each (model, formats) it runs `quantkit convert --dry-run --json` (the estimate: peak RAM, disk final and
temporary, time), then the same command for real in a child process, and measures the child's peak RSS
(its VmHWM), the output folder's final size, its peak size while the run goes (partial folders and crash-resume
commit points included; sampled every 10 ms), and the wall time.  Reports estimate / measured per figure;
the goal is every ratio within [0.8, 1.2].

    python bench/preflight.py [--samples 32] [--seqlen 256] [--only demo|synthetic|moe] [--keep]
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CALIB = ROOT.parent / "shared" / "data" / "wikitext2-valid.txt"
RUNS = [["gguf:Q4_K_M"], ["gguf:Q4_K_M", "--imatrix"], ["gptq:4bit-g128"], ["awq:4bit-g64"], ["exl2:4.0bpw"],
        ["bnb:nf4"], ["bnb:int8"], ["gptq:4bit-g128", "-f", "awq:4bit-g64"], ["gguf:Q4_K_M", "--error-feedback"],
        ["gguf:IQ2_XS", "--imatrix"]]
MOE_RUNS = [2, 3, 4]     # the calibrated formats that hold a whole layer's experts: gptq, awq, exl2
FIGURES = [("peak RAM", "peak_ram_bytes", "rss"), ("disk final", "disk_final_bytes", "final"),
           ("disk peak", "disk_bytes", "disk_peak"), ("time", "seconds", "wall")]


def folder_bytes(folder: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass   # renamed or removed while we looked
    return total


def synthetic(folder: Path, target_gib: float) -> dict:
    """A llama of hidden 1024 with the demo's tokenizer (vocab 49152), as many layers as reach target_gib."""
    from stream_memory import write_checkpoint
    info = write_checkpoint(folder, target_gib, hidden=1024, inter=4096, vocab=49152, heads=16, kv=4)
    _demo_tokenizer(folder)
    return info


def synthetic_mixtral(folder: Path) -> None:
    """A 4-layer mixtral (hidden 1024, 8 experts of 2048, top-2; 0.58 GiB in bf16) with the demo's tokenizer,
    saved by transformers itself: what the calibrated formats hold per layer grows with the experts."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=49152, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                        num_attention_heads=16, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                        tie_word_embeddings=False, max_position_embeddings=4096)
    model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    model.save_pretrained(str(folder))
    _demo_tokenizer(folder)


def _demo_tokenizer(folder: Path) -> None:
    from quantkit.model.demo import demo_checkpoint
    demo = Path(demo_checkpoint("smollm2-135m"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        if (demo / name).is_file():
            shutil.copy(demo / name, folder / name)


MIXTRAL = "synthetic mixtral 0.58 GiB (4 layers, hidden 1024, 8 experts of 2048)"


def measure(model: str, formats: list[str], out: Path, common: list[str]) -> dict:
    args = [sys.executable, "-m", "quantkit", "convert", model, "-f", *formats, "-o", str(out), *common]
    dry = subprocess.run([*args, "--dry-run", "--json"], capture_output=True, text=True)
    if dry.returncode:
        raise SystemExit(dry.stderr[-2000:])
    estimate = json.loads(dry.stdout)["run"]
    estimate["disk_bytes"] = estimate["disk_final_bytes"] + estimate["disk_temporary_bytes"]
    shutil.rmtree(out, ignore_errors=True)
    peak = {"disk": 0, "hwm": 0}
    stop = threading.Event()

    def watch():       # every 10 ms: a file and the scratch it is written from coexist for moments only
        while not stop.is_set():
            peak["disk"] = max(peak["disk"], folder_bytes(out))
            time.sleep(0.01)
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.parent / "child.log"
    with open(logs, "w") as log:
        proc = subprocess.Popen([*args, "--json"], stdout=log, stderr=subprocess.STDOUT)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        # the child's own VmHWM, read while it runs: wait4's ru_maxrss starts from this process's RSS at the
        # fork (the synthetic model was made here), so it is not the child's figure
        while proc.poll() is None:
            peak["hwm"] = max(peak["hwm"], _high_water(proc.pid))
            time.sleep(0.02)
        status = proc.returncode
    wall = time.perf_counter() - t0
    stop.set()
    watcher.join()
    if status:
        raise SystemExit(logs.read_text()[-2000:])
    final = folder_bytes(out)
    return {"estimate": estimate, "measured": {"rss": peak["hwm"], "final": final,
                                               "disk_peak": max(peak["disk"], final), "wall": round(wall, 1)}}


def _high_water(pid: int) -> int:
    """The process's peak resident set so far (VmHWM), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--gib", type=float, default=1.05)
    ap.add_argument("--only", choices=["demo", "synthetic", "moe"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/quantkit-preflight"))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--runs", type=int, nargs="*", help="indices into RUNS, in this order (default: all)")
    ap.add_argument("--synthetic-runs", type=int, nargs="*", help="indices into RUNS for the synthetic model")
    a = ap.parse_args()
    common = ["--calib", str(CALIB), "--calib-samples", str(a.samples), "--calib-seqlen", str(a.seqlen),
              "--device", "cpu"]
    models = {}
    if a.only in (None, "demo"):
        models["demo:smollm2-135m"] = "demo:smollm2-135m"
    if a.only in (None, "synthetic"):
        info = synthetic(a.work / "synthetic", a.gib)
        models[f"synthetic llama {info['bytes'] / 2**30:.2f} GiB ({info['layers']} layers, hidden 1024)"] = \
            str(a.work / "synthetic")
    if a.only in (None, "moe"):
        synthetic_mixtral(a.work / "mixtral")
        models[MIXTRAL] = str(a.work / "mixtral")
    rows = []
    for label, model in models.items():
        picked = a.synthetic_runs if (label != "demo:smollm2-135m" and a.synthetic_runs) else a.runs
        if label == MIXTRAL:
            picked = MOE_RUNS
        for run in [RUNS[i] for i in picked] if picked else RUNS:
            formats = [f for f in run if not f.startswith("-")]
            r = measure(model, run, a.work / "out", common)
            r.update(model=label, formats=" + ".join(formats) + "".join(f" {f}" for f in run if f.startswith("--")),
                     date=dt.date.today().isoformat())
            r["ratios"] = {name: round(r["estimate"][e] / max(r["measured"][m], 1e-9), 3) for name, e, m in FIGURES}
            rows.append(r)
            print(r["model"], r["formats"], r["ratios"], flush=True)
            shutil.rmtree(a.work / "out", ignore_errors=True)
            write_results(rows, a)     # after every run: a long benchmark cut short keeps what it measured
    if not a.keep:
        shutil.rmtree(a.work, ignore_errors=True)
    write_results(rows, a)


# why a figure is outside 0.8-1.2 where that is known (formats, figure) -> cause; printed beside the deviation
EXPLAINED = {
    ("gguf:Q4_K_M --imatrix", "peak RAM"):
        "was bimodal: identical runs of the demo peaked at 0.57-0.60 GiB or at 1.12-1.21 GiB, glibc keeping freed "
        "temporaries in its heap after raising its mmap threshold; with freed pages handed back after every layer "
        "and tensor, 0.73 / 0.57 / 0.57 GiB in three runs; also after each stage's walk (quantkit/heap.py), "
        "0.56-0.62 GiB in four",
    ("exl2:4.0bpw", "time"):
        "the synthetic mixtral: 465 s measured (433 s on the run before), 363 s estimated. Timed apart in an "
        "instrumented run of 444 s: the quantizations took 403 s against 339 s estimated (each layout probed on "
        "1024 rows of one expert, 0.84x), the Hessian preparations 15 s (145 of them, not in the estimate), the "
        "mixture block's re-runs per option 8.7 s against 10.4 s. The dense demo: 1.03",
    ("bnb:nf4", "time"):
        "a 4.7 s run (3.6 s on 2026-12-03): the estimate's read of the 1.07 GiB source at 500 MiB/s (2.2 s) is not paid by a file the "
        "benchmark has just written, still in the page cache",
    ("gptq:4bit-g128 + awq:4bit-g64", "time"):
        "the two jobs in one pass ran 87 s where each alone ran 28 s and 53 s (81 s with two start-ups; 80 s for "
        "this run on 2026-12-03): the estimate (69 s) adds the parts of the two estimates that were 0.93x and 0.96x "
        "alone, so the shortfall is the shared run's own, not a missing part",
}


def merged(rows: list[dict]) -> list[dict]:
    """This invocation's rows, and the committed rows it did not measure again (a long benchmark is rerun a few
    rows at a time); in the committed order, new rows last."""
    try:
        old = json.loads((RESULTS / "preflight.json").read_text())["rows"]
    except (OSError, ValueError, KeyError):
        old = []
    key = lambda r: (r["model"], r["formats"])
    fresh = {key(r): r for r in rows}
    kept = [fresh.pop(key(r), r) for r in old]
    return kept + list(fresh.values())


def write_results(rows: list[dict], a) -> None:
    rows = merged(rows)
    meta = {"date": dt.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(), "calibration": f"{a.samples} × {a.seqlen} tokens of {CALIB.name}"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "preflight.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    gib = lambda b: f"{b / 2**30:.3f}"
    lines = ["# Pre-flight estimates against the run (bench/preflight.py)", "",
             f"{meta['date']}, {meta['machine']}, Python {meta['python']}; calibration {meta['calibration']}; "
             f"each run alone in a child process, right after its `--dry-run` (which gives the estimate).", "",
             "Ratio = estimate / measured; goal 0.8-1.2.  RAM: the child's peak RSS (VmHWM, read every 20 ms while it runs).  Disk final: the output folder "
             "after the run.  Disk peak: the folder's largest size during the run (partial folders and the "
             "crash-resume commit points included; sampled every 10 ms).  Time: wall time of the child.", "",
             "| model | formats | measured | RAM est / meas (GiB) | ratio | disk final est / meas (GiB) | ratio | "
             "disk peak est / meas (GiB) | ratio | time est / meas (s) | ratio |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        e, m, q = r["estimate"], r["measured"], r["ratios"]
        lines.append(f"| {r['model']} | {r['formats']} | {r.get('date', '2026-12-02')} | {gib(e['peak_ram_bytes'])} / {gib(m['rss'])} | "
                     f"{q['peak RAM']} | {gib(e['disk_final_bytes'])} / {gib(m['final'])} | {q['disk final']} | "
                     f"{gib(e['disk_bytes'])} / {gib(m['disk_peak'])} | {q['disk peak']} | "
                     f"{e['seconds']:.0f} / {m['wall']:.0f} | {q['time']} |")
    outside = [f"{r['model']} {r['formats']}: {k} {v}" + (f": {EXPLAINED[r['formats'], k]}"
                                                           if (r["formats"], k) in EXPLAINED else "")
               for r in rows for k, v in r["ratios"].items() if not 0.8 <= v <= 1.2]
    lines += ["", f"Outside 0.8-1.2: {len(outside)} of {4 * len(rows)}" + (":" if outside else ".")]
    lines += [f"- {o}" for o in outside]
    (RESULTS / "preflight.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
