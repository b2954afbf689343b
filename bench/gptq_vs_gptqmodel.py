"""Benchmark: quantkit's GPTQ against GPTQModel on the same machine, model and calibration tokens.

For each setting (4-bit g128 symmetric, without and with act-order): wall time and peak RSS of
`quantkit convert` and of GPTQModel's load + quantize + save, then perplexity, mean KLD and top-1 agreement of
both artifacts against the bf16 demo model on wikitext-2 test (40 × 512 tokens), both read back by quantkit's
own GPTQ reader (the same harness for both; the consumer test checks that reader against transformers +
GPTQModel).  Round-to-nearest with the same grid is the floor both must beat.

Calibration: 128 × 512 tokens drawn by quantkit from wikitext-2 *valid* (seed 0), saved to a file and fed to
GPTQModel as token ids, so both quantize from identical tokens (the hash is checked against quantkit.json).

    python bench/gptq_vs_gptqmodel.py [--settings noact,act] [--windows 40] [--samples 128]

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

import measure  # bench/measure.py

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "_work" / "gptq"
RESULTS = ROOT / "bench" / "results"
SHARED = ROOT.parent / "shared" / "data"
SETTINGS = {"noact": {"variant": "4bit-g128", "desc_act": False},
            "act": {"variant": "4bit-g128-act", "desc_act": True}}
THREADS = os.cpu_count() or 1


def run(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    # in WORK: GPTQModel writes a logs/ folder into its working directory
    return measure.run(cmd, WORK / "last_command.log", env, cwd=WORK)


def child(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


DRAW = """
import json, sys, torch
from quantkit.calibration import CalibrationSpec, load_calibration
from quantkit.model.source import open_model
m = open_model('demo:smollm2-135m')
c = load_calibration(CalibrationSpec(source=sys.argv[1], samples=int(sys.argv[2]), seqlen=512, seed=0), m)
torch.save({'tokens': c.tokens}, sys.argv[3])
print('DRAWN ' + json.dumps({'hash': c.token_hash, 'folder': str(m.folder)}))
"""

GPTQMODEL = """
import sys, torch
from gptqmodel import GPTQModel, QuantizeConfig
src, tokens_file, out, desc_act = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == '1'
tokens = torch.load(tokens_file)['tokens']
calib = [{'input_ids': row.tolist(), 'attention_mask': [1] * row.numel()} for row in tokens]
cfg = QuantizeConfig(bits=4, group_size=128, sym=True, desc_act=desc_act)
model = GPTQModel.load(src, cfg, device='cpu')
model.quantize(calib)
model.save(out)
"""

QUANTKIT = """
import sys
from quantkit import api
calib, samples, variant, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
api.convert('demo:smollm2-135m', ['gptq:' + variant], out,
            options={'calib': calib, 'calib_samples': samples, 'calib_seqlen': 512, 'seed': 0, 'device': 'cpu'})
"""

EVAL = """
import json, sys
from quantkit import api
r = api.evaluate(sys.argv[1], sys.argv[2], base='demo:smollm2-135m', ctx=512, windows=int(sys.argv[3]), device='cpu')
print('RESULT ' + json.dumps(r.to_dict()))
"""


def evaluate(folder: Path, windows: int) -> dict:
    log = WORK / "eval.log"
    with open(log, "w") as sink:
        subprocess.run(child(EVAL, str(folder), str(SHARED / "wikitext2-test.raw.txt"), str(windows)),
                       stdout=sink, stderr=subprocess.STDOUT, check=True)
    line = [ln for ln in log.read_text().splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="noact,act")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--out", default="gptq_vs_gptqmodel")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    calib = str(SHARED / "wikitext2-valid.txt")
    tokens_file = WORK / "calibration.pt"
    run(child(DRAW, calib, str(args.samples), str(tokens_file)))
    drawn = [ln for ln in (WORK / "last_command.log").read_text().splitlines() if ln.startswith("DRAWN ")][-1]
    drawn = json.loads(drawn[len("DRAWN "):])
    folder, token_hash = drawn["folder"], drawn["hash"]
    env = {"GPTQMODEL_CPU_WORKERS": str(THREADS), "PYTHON_GIL": "1"}
    rows = []
    for key in args.settings.split(","):
        setting = SETTINGS[key]
        qk_out = WORK / f"quantkit-{key}"
        gm_out = WORK / f"gptqmodel-{key}"
        for d in (qk_out, gm_out):
            subprocess.run(["rm", "-rf", str(d)], check=True)
        print(f"[{key}] quantkit …", flush=True)
        qk_wall, qk_rss = run(child(QUANTKIT, calib, str(args.samples), setting["variant"], str(qk_out)))
        qk_folder = next(qk_out.iterdir())
        recorded = json.loads((qk_folder / "quantkit.json").read_text())["calibration"]["token_hash"]
        assert recorded == token_hash, "quantkit calibrated on different tokens than GPTQModel"
        print(f"[{key}] GPTQModel …", flush=True)
        gm_wall, gm_rss = run(child(GPTQMODEL, folder, str(tokens_file), str(gm_out), "1" if setting["desc_act"] else "0"),
                              env=env)
        print(f"[{key}] eval …", flush=True)
        qk_eval, gm_eval = evaluate(qk_folder, args.windows), evaluate(gm_out, args.windows)
        row = {"setting": setting["variant"], "desc_act": setting["desc_act"],
               "quantkit": {"seconds": round(qk_wall, 1), "peak_rss_gib": round(qk_rss / 2**30, 3), **_metrics(qk_eval)},
               "gptqmodel": {"seconds": round(gm_wall, 1), "peak_rss_gib": round(gm_rss / 2**30, 3), **_metrics(gm_eval)}}
        row["time_ratio"] = round(qk_wall / gm_wall, 3)
        row["rss_ratio"] = round(qk_rss / gm_rss, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    rtn_out = WORK / "quantkit-rtn"  # the floor: round to nearest on the same grid
    subprocess.run(["rm", "-rf", str(rtn_out)], check=True)
    run(child(QUANTKIT, calib, str(args.samples), "4bit-g128-rtn", str(rtn_out)))
    rtn = {"setting": "4bit-g128-rtn", **_metrics(evaluate(next(rtn_out.iterdir()), args.windows))}
    gm_version = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('gptqmodel'))"],
                                capture_output=True, text=True).stdout.strip()
    report = {"date": dt.date.today().isoformat(), "machine": f"{platform.machine()}, {THREADS} cores, {platform.platform()}",
              "gptqmodel": gm_version, "model": "demo:smollm2-135m (bf16)",
              "calibration": f"wikitext2-valid, {args.samples} × 512 tokens, seed 0, sha256 {token_hash}",
              "eval": f"wikitext2-test, {args.windows} × 512", "rows": rows, "rtn": rtn}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(render(report))
    print(render(report))


def _metrics(r: dict) -> dict:
    return {"perplexity": round(r["perplexity"], 3), "mean_kld": round(r["mean_kld"], 4),
            "top1": round(r["top1_agreement"], 4), "base_perplexity": round(r["base_perplexity"], 3)}


def render(rep: dict) -> str:
    lines = [f"# GPTQ: quantkit vs GPTQModel {rep['gptqmodel']}", "",
             f"{rep['date']} · {rep['machine']}", "",
             f"Model {rep['model']}; calibration {rep['calibration']}; evaluation {rep['eval']} "
             f"(base perplexity {rep['rows'][0]['quantkit']['base_perplexity']}).", "",
             "| setting | tool | wall s | peak RSS GiB | perplexity | mean KLD | top-1 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rep["rows"]:
        for tool in ("quantkit", "gptqmodel"):
            m = r[tool]
            lines.append(f"| {r['setting']} | {tool} | {m['seconds']} | {m['peak_rss_gib']} | {m['perplexity']} | "
                         f"{m['mean_kld']} | {m['top1']} |")
    rtn = rep["rtn"]
    lines.append(f"| {rtn['setting']} | quantkit (round to nearest) | | | {rtn['perplexity']} | {rtn['mean_kld']} | {rtn['top1']} |")
    lines += ["", "| setting | time ratio quantkit/GPTQModel (goal ≤ 0.5) | RSS ratio (goal ≤ 1) | perplexity quantkit − GPTQModel |",
              "| --- | ---: | ---: | ---: |"]
    for r in rep["rows"]:
        lines.append(f"| {r['setting']} | {r['time_ratio']} | {r['rss_ratio']} | "
                     f"{r['quantkit']['perplexity'] - r['gptqmodel']['perplexity']:+.3f} |")
    lines += ["", "Both artifacts are scored by quantkit's own GPTQ reader (GPTQModel's output read the same way).",
              "Regenerate: `python bench/gptq_vs_gptqmodel.py`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
