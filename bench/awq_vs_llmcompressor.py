"""Benchmark: quantkit's AWQ against llm-compressor's AWQModifier on the same machine, model, settings and
calibration tokens.

For each group size: wall time and peak RSS of `quantkit convert -f awq:4bit-gN` and of llm-compressor's
load + oneshot(AWQModifier), then perplexity, mean KLD and top-1 agreement of both results against the bf16
demo model on wikitext-2 test (40 × 512 tokens), scored by the same harness: quantkit's folder through its
AWQ reader, llm-compressor's weights dequantized by compressed-tensors' own `fake_quantize` in its process
and saved as a float32 checkpoint (its norms carry the smoothing it folded in).  Round to nearest on the
same grid (`awq:4bit-gN-rtn`) is the floor both must beat.

llm-compressor 0.14 pins memory for GPU copies even on a CPU-only machine, which fails there; the child turns
that pinning (a speed-up of host-to-device copies, no effect on any value) off when there is no CUDA device.
llm-compressor pins an older transformers, so it runs in its own virtual environment
(bench/_work/awq/llmc-venv, made on first use: `pip install torch==<this torch> llmcompressor==VERSION`).

Calibration: 128 × 512 tokens drawn by quantkit from wikitext-2 *valid* (seed 0), written as token ids and
fed to llm-compressor as a datasets.Dataset, so both quantize from identical tokens (the hash is checked
against quantkit.json).  The tools take turns `--repeats` times; medians are reported, samples kept.

    python bench/awq_vs_llmcompressor.py [--groups 64,128] [--repeats 1] [--samples 128] [--windows 40]

The driver imports no torch: each measured step runs in its own process, timed with os.wait4.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from statistics import median

import measure  # bench/measure.py

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "_work" / "awq"
VENV = WORK / "llmc-venv"
RESULTS = ROOT / "bench" / "results"
SHARED = ROOT.parent / "shared" / "data"
THREADS = os.cpu_count() or 1
LLMC_VERSION = "0.14.0.1"


def run(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    return measure.run(cmd, WORK / "last_command.log", env, cwd=WORK)


def child(code: str, *args: str, python: str = sys.executable) -> list[str]:
    return [python, "-c", code, *args]


DRAW = """
import json, sys
from quantkit.calibration import CalibrationSpec, load_calibration
from quantkit.model.source import open_model
m = open_model('demo:smollm2-135m')
c = load_calibration(CalibrationSpec(source=sys.argv[1], samples=int(sys.argv[2]), seqlen=512, seed=0), m)
open(sys.argv[3], 'w').write(json.dumps(c.tokens.tolist()))
print('DRAWN ' + json.dumps({'hash': c.token_hash, 'folder': str(m.folder)}))
"""

QUANTKIT = """
import sys
from quantkit import api
calib, samples, variant, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
api.convert('demo:smollm2-135m', ['awq:' + variant], out,
            options={'calib': calib, 'calib_samples': samples, 'calib_seqlen': 512, 'seed': 0, 'device': 'cpu'})
"""

LLMCOMPRESSOR = """
import json, shutil, sys, torch
from pathlib import Path
from datasets import Dataset
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.transform.awq import AWQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from safetensors.torch import save_file
from llmcompressor.pipelines.cache import IntermediatesCache
# AWQModifier pins its cached activations for faster host-to-GPU copies, which fails where there is no accelerator
# (0.14: "Cannot access accelerator device"); pinning changes no value, so on a CPU-only machine it is skipped
if not torch.cuda.is_available():
    IntermediatesCache.pin_memory = lambda self, *a, **k: None
src, tokens_file, out, group = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
tokens = json.loads(open(tokens_file).read())
data = Dataset.from_dict({'input_ids': tokens, 'attention_mask': [[1] * len(t) for t in tokens]})
model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16)
args = QuantizationArgs(num_bits=4, type='int', symmetric=False, strategy='group', group_size=group)
recipe = [AWQModifier(duo_scaling=True),
          QuantizationModifier(ignore=['lm_head'], config_groups={'group_0': QuantizationScheme(targets=['Linear'], weights=args)})]
oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=len(tokens[0]), num_calibration_samples=len(tokens))
state = {}
with torch.no_grad():
    for name, module in model.named_modules():
        if hasattr(module, 'weight_scale'):
            zp = getattr(module, 'weight_zero_point', None)
            state[name + '.weight'] = fake_quantize(module.weight.float(), module.weight_scale.float(), zp, args)
    for name, t in model.state_dict().items():
        if name not in state and not name.rsplit('.', 1)[-1].startswith(('weight_scale', 'weight_zero_point', 'weight_g_idx')):
            state[name] = t.float()
out.mkdir(parents=True, exist_ok=True)
if model.config.tie_word_embeddings:
    state.pop('lm_head.weight', None)
save_file({k: v.contiguous() for k, v in state.items()}, str(out / 'model.safetensors'), metadata={'format': 'pt'})
config = json.loads((Path(src) / 'config.json').read_text())
config.pop('quantization_config', None)
config['torch_dtype'] = config['dtype'] = 'float32'
(out / 'config.json').write_text(json.dumps(config, indent=2))
for f in Path(src).iterdir():
    if f.name.startswith(('tokenizer', 'special_tokens', 'generation_config', 'vocab', 'merges')):
        shutil.copy(f, out / f.name)
"""

EVAL = """
import json, sys
from quantkit import api
r = api.evaluate(sys.argv[1], sys.argv[2], base='demo:smollm2-135m', ctx=512, windows=int(sys.argv[3]), device='cpu')
print('RESULT ' + json.dumps(r.to_dict()))
"""


def venv_python() -> str:
    """llm-compressor's own environment, made once (it pins a transformers older than quantkit's)."""
    python = VENV / "bin" / "python"
    if not python.is_file():
        torch_version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__.split('+')[0])"],
                                       capture_output=True, text=True, check=True).stdout.strip()
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={torch_version}",
                        f"llmcompressor=={LLMC_VERSION}"], check=True)
    return str(python)


def evaluate(folder: Path, windows: int) -> dict:
    log = WORK / "eval.log"
    with open(log, "w") as sink:
        subprocess.run(child(EVAL, str(folder), str(SHARED / "wikitext2-test.raw.txt"), str(windows)),
                       stdout=sink, stderr=subprocess.STDOUT, check=True)
    line = [ln for ln in log.read_text().splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _metrics(r: dict) -> dict:
    return {"perplexity": round(r["perplexity"], 3), "mean_kld": round(r["mean_kld"], 4),
            "top1": round(r["top1_agreement"], 4), "base_perplexity": round(r["base_perplexity"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", default="64,128")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--out", default="awq_vs_llmcompressor")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    llmc_python = venv_python()
    llmc_version = subprocess.run([llmc_python, "-c", "import importlib.metadata as m; print(m.version('llmcompressor'), "
                                   "m.version('transformers'))"], capture_output=True, text=True).stdout.split()
    calib = str(SHARED / "wikitext2-valid.txt")
    tokens_file = WORK / "calibration.json"
    run(child(DRAW, calib, str(args.samples), str(tokens_file)))
    drawn = [ln for ln in (WORK / "last_command.log").read_text().splitlines() if ln.startswith("DRAWN ")][-1]
    drawn = json.loads(drawn[len("DRAWN "):])
    source, token_hash = drawn["folder"], drawn["hash"]
    rows = []
    for group in [int(g) for g in args.groups.split(",")]:
        variant = f"4bit-g{group}"
        qk_out, lc_out = WORK / f"quantkit-g{group}", WORK / f"llmcompressor-g{group}"
        samples = {"quantkit": [], "llmcompressor": []}
        for i in range(args.repeats):
            order = ("quantkit", "llmcompressor") if i % 2 == 0 else ("llmcompressor", "quantkit")
            for tool in order:
                out = qk_out if tool == "quantkit" else lc_out
                subprocess.run(["rm", "-rf", str(out)], check=True)
                print(f"[g{group}] {tool} (run {i + 1}) …", flush=True)
                if tool == "quantkit":
                    samples[tool].append(run(child(QUANTKIT, calib, str(args.samples), variant, str(out))))
                else:
                    samples[tool].append(run(child(LLMCOMPRESSOR, source, str(tokens_file), str(out), str(group),
                                                   python=llmc_python), env={"OMP_NUM_THREADS": str(THREADS)}))
        qk_folder = next(qk_out.iterdir())
        recorded = json.loads((qk_folder / "quantkit.json").read_text())["calibration"]["token_hash"]
        assert recorded == token_hash, "quantkit calibrated on different tokens than llm-compressor"
        print(f"[g{group}] eval …", flush=True)
        row = {"setting": variant}
        for tool, folder in (("quantkit", qk_folder), ("llmcompressor", lc_out)):
            walls, rss = [w for w, _ in samples[tool]], [r for _, r in samples[tool]]
            row[tool] = {"seconds": round(median(walls), 1), "runs_s": [round(w, 1) for w in walls],
                         "peak_rss_gib": round(max(rss) / 2**30, 3), **_metrics(evaluate(folder, args.windows))}
        row["time_ratio"] = round(row["quantkit"]["seconds"] / row["llmcompressor"]["seconds"], 3)
        row["rss_ratio"] = round(row["quantkit"]["peak_rss_gib"] / row["llmcompressor"]["peak_rss_gib"], 3)
        rtn_out = WORK / f"quantkit-g{group}-rtn"
        subprocess.run(["rm", "-rf", str(rtn_out)], check=True)
        run(child(QUANTKIT, calib, str(args.samples), f"{variant}-rtn", str(rtn_out)))
        row["rtn"] = _metrics(evaluate(next(rtn_out.iterdir()), args.windows))
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"date": dt.date.today().isoformat(), "machine": f"{platform.machine()}, {THREADS} cores, {platform.platform()}",
              "llmcompressor": llmc_version[0] if llmc_version else "?",
              "llmcompressor_transformers": llmc_version[1] if len(llmc_version) > 1 else "?",
              "model": "demo:smollm2-135m (bf16)", "repeats": args.repeats,
              "calibration": f"wikitext2-valid, {args.samples} × 512 tokens, seed 0, sha256 {token_hash}",
              "eval": f"wikitext2-test, {args.windows} × 512", "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(render(report))
    print(render(report))


def render(rep: dict) -> str:
    lines = [f"# AWQ: quantkit vs llm-compressor {rep['llmcompressor']} (transformers {rep['llmcompressor_transformers']})",
             "", f"{rep['date']} · {rep['machine']} · medians of {rep['repeats']} alternating run(s)", "",
             f"Model {rep['model']}; calibration {rep['calibration']}; evaluation {rep['eval']} "
             f"(base perplexity {rep['rows'][0]['quantkit']['base_perplexity']}).", "",
             "| setting | tool | wall s | peak RSS GiB | perplexity | mean KLD | top-1 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rep["rows"]:
        for tool in ("quantkit", "llmcompressor"):
            m = r[tool]
            lines.append(f"| {r['setting']} | {tool} | {m['seconds']} | {m['peak_rss_gib']} | {m['perplexity']} | "
                         f"{m['mean_kld']} | {m['top1']} |")
        m = r["rtn"]
        lines.append(f"| {r['setting']}-rtn | quantkit (round to nearest) | | | {m['perplexity']} | {m['mean_kld']} | {m['top1']} |")
    lines += ["", "| setting | time ratio quantkit/llm-compressor (goal ≤ 0.5) | RSS ratio (goal ≤ 1) | "
              "perplexity quantkit − llm-compressor | KLD quantkit − llm-compressor |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rep["rows"]:
        lines.append(f"| {r['setting']} | {r['time_ratio']} | {r['rss_ratio']} | "
                     f"{r['quantkit']['perplexity'] - r['llmcompressor']['perplexity']:+.3f} | "
                     f"{r['quantkit']['mean_kld'] - r['llmcompressor']['mean_kld']:+.4f} |")
    lines += ["", "Both scored by quantkit's harness (llm-compressor's weights dequantized by compressed-tensors' "
              "fake_quantize and saved in float32).", "Regenerate: `python bench/awq_vs_llmcompressor.py`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
