"""`quantkit verify ARTIFACT`: is the artifact intact, and does it load and run in the runtimes that will load
it, computing what quantkit's own reader computes?

1. Integrity: every file's sha256 against the one its record took when it was written (quantkit.json, or a
   GGUF file's NAME.gguf.quantkit.json).  The runtimes and quantkit's reader read the same bytes, so they
   agree on a damaged file as well: this is what catches bytes changed after writing.
2. For each runtime installed here that loads the format (`Backend.runtimes`): a child process
   (quantkit.verify.child) loads the artifact the first way that works, in the order a user would try them
   (transformers' plain `from_pretrained(folder)` first; llama.cpp's defaults), runs a fixed text of `tokens`
   tokens and decodes `generate` more greedily.  Its logits are compared with quantkit's reader's on the same
   tokens: top-1 agreement and mean KL(reader ‖ runtime), against thresholds stated per runtime and compute
   dtype (THRESHOLDS: activations are rounded differently by each), plus max |Δlogit| as a figure.  Measured:
   load time, prompt tokens/s, decode tokens/s and the child's peak RSS.
3. With a base model, the runtime's top-1 agreement and KLD against the original as figures.

The verdicts (pass / fail with the figure / not installed) go into the artifact's record (`verify`), where
cards and `quantkit push` read them.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import UsageError

# Our own fixed text: plain English prose, so every tokenizer cuts it into ordinary tokens.
TEXT = (
    "The river left the mountains in early spring, carrying snow water past the old mill and the stone bridge "
    "that the village had rebuilt after the flood. Farmers on both banks waited for the level to fall before "
    "they planted, and the children counted the days by the marks on the bridge. When the water finally "
    "settled, the fields turned green within a week, and the market in the square filled again with bread, "
    "cheese, apples from the last harvest and tools brought up from the coast. The miller, who kept the only "
    "clock in the valley, rang the bell at noon so that everyone would know the hour. Travellers who crossed "
    "the pass in summer said that the valley looked the same as it had for a hundred years, and the people "
    "who lived there liked to believe it."
)


@dataclass(frozen=True)
class Threshold:
    top1: float          # at least this top-1 agreement with quantkit's reader
    kld: float           # at most this mean KL(reader ‖ runtime), nats per token
    why: str


# Per runtime and the dtype it computed in.  Measured on the demo model (tests/test_verify.py): llama.cpp's Q8
# activation blocks move ~1-3 % of top-1 predictions; transformers in float32 on the same weights agrees to
# float rounding; half-precision activations move a few percent.
THRESHOLDS = {
    "llama.cpp": Threshold(0.90, 0.05, "llama.cpp rounds each matmul's input to Q8 blocks"),
    ("transformers", "float32"): Threshold(0.98, 0.005, "float32 activations: the same weights, float rounding only"),
    ("transformers", "half"): Threshold(0.90, 0.05, "bfloat16/float16 activations round every product"),
    # not yet measured on a GPU here: the half-precision bound until bench/gpu_check.py has figures for them
    ("vllm", "half"): Threshold(0.90, 0.05, "float16 activations and vLLM's own kernels"),
    ("exllamav2", "half"): Threshold(0.90, 0.05, "float16 activations and exllamav2's own kernels"),
}


def threshold_for(runtime: str, dtype: str) -> Threshold:
    if runtime in THRESHOLDS:
        return THRESHOLDS[runtime]
    return THRESHOLDS[(runtime, "float32" if dtype == "float32" else "half")]


@dataclass
class RuntimeCheck:
    runtime: str
    verdict: str                     # pass | fail | not installed
    why: str = ""
    figures: dict = field(default_factory=dict)


@dataclass
class VerifyReport:
    artifact: str
    format: str
    integrity: dict
    runtimes: list[RuntimeCheck]
    tokens: int
    generate: int
    date: str = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))

    @property
    def passed(self) -> bool:
        return self.integrity["verdict"] != "fail" and all(r.verdict != "fail" for r in self.runtimes)

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def verify(artifact: str | Path, *, base: str | None = None, runtimes: list[str] | None = None, tokens: int = 128,
           generate: int = 32, record: bool = True) -> VerifyReport:
    from ..backends import backend_for_artifact
    from ..eval.harness import window_logits
    from ..model.source import open_model
    path = Path(artifact)
    backend = backend_for_artifact(path) if path.exists() else None
    if backend is None:
        raise UsageError(f"{artifact}: not an artifact of an installed format (a GGUF file or a quantized folder)")
    asked = list(backend.runtimes) if runtimes is None else runtimes
    unknown = [r for r in asked if r not in backend.runtimes]
    if unknown:
        raise UsageError(f"--runtime {unknown[0]}: {backend.name} artifacts run in "
                         f"{', '.join(backend.runtimes) or 'no runtime quantkit drives'}")
    integrity = check_integrity(path)
    base_model = open_model(base) if base else None
    model = backend.open_artifact(path, base=base_model)
    ids = (base_model or model).tokenizer(TEXT, add_special_tokens=False)["input_ids"][:tokens]
    if len(ids) < 8:
        raise UsageError(f"--tokens {tokens}: too few to compare")
    window = torch.tensor([ids])
    ours = next(window_logits(model, window))
    theirs_base = next(window_logits(base_model, window)) if base_model is not None else None
    checks = []
    for runtime in asked:
        missing = backend.runtime_missing(runtime)
        if missing:
            checks.append(RuntimeCheck(runtime, "not installed", missing))
            continue
        checks.append(_check_runtime(backend.name, path, runtime, ids, generate, ours, theirs_base,
                                     (base_model or model).tokenizer))
    report = VerifyReport(str(path), backend.name, integrity, checks, len(ids), generate)
    if record:
        from ..publish.record import write_verify
        write_verify(path, report.to_dict())
    return report


def check_integrity(path: Path) -> dict:
    """Each recorded file's sha256 now against the one taken when it was written."""
    from ..artifact import sha256_file
    from ..publish.record import read_record
    recorded = read_record(path).get("files") or {}
    if not recorded:
        return {"verdict": "no record", "why": "no sha256 of the written files is recorded (made by another tool?)"}
    folder = path if path.is_dir() else path.parent
    for name, digest in recorded.items():
        f = folder / name
        if not f.is_file():
            return {"verdict": "fail", "why": f"{name} is missing"}
        if sha256_file(f) != digest:
            return {"verdict": "fail", "why": f"{name}: sha256 differs from the one recorded when it was written "
                                              f"(changed or damaged since)"}
    return {"verdict": "pass", "files": len(recorded)}


def _check_runtime(fmt: str, path: Path, runtime: str, ids: list[int], generate: int, ours: torch.Tensor,
                   base_logits: torch.Tensor | None, tokenizer) -> RuntimeCheck:
    with tempfile.TemporaryDirectory(prefix="quantkit-verify-") as tmp:
        request = Path(tmp) / "request.json"
        out = Path(tmp) / "logits.pt"
        request.write_text(json.dumps({"format": fmt, "artifact": str(path), "runtime": runtime, "ids": ids,
                                       "generate": generate, "out": str(out)}))
        log = Path(tmp) / "child.log"
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        with open(log, "wb") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "quantkit.verify.child", str(request)], stdout=sink,
                                    stderr=subprocess.STDOUT, env=env)
            _, status, usage = os.wait4(proc.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        text = log.read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        if code != 0 or not lines:
            tail = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["(no output)"]
            return RuntimeCheck(runtime, "fail", f"the runtime's process ended with code {code}: {tail[0][:300]}")
        result = json.loads(lines[-1][len("RESULT "):])
        if not result["loaded"]:
            ways = "; ".join(f"{f['how']}: {f['error']}" for f in result["failed_ways"])
            return RuntimeCheck(runtime, "fail", f"does not load ({ways})")
        theirs = torch.load(out)
    figures = {"loaded_with": result["how"], "dtype": result["dtype"], "load_s": round(result["load_s"], 2),
               "prompt_tokens_per_s": round(result["prompt_tokens_per_s"], 1),
               "decode_tokens_per_s": round(result["decode_tokens_per_s"], 1),
               "peak_rss_gib": round(usage.ru_maxrss * 1024 / 2**30, 3),
               "generated": tokenizer.decode(result["generated"])}
    if result["failed_ways"]:
        figures["default_failed"] = result["failed_ways"]
    vocab = min(ours.shape[-1], theirs.shape[-1])
    a, b = ours[:, :vocab].float(), theirs[:, :vocab].float()
    if not torch.isfinite(b).all():
        return RuntimeCheck(runtime, "fail", "the runtime's logits are not finite", figures)
    logp_a, logp_b = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    figures["top1_agreement"] = round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 4)
    figures["mean_kld"] = round((logp_a.exp() * (logp_a - logp_b)).sum(-1).mean().item(), 6)
    if runtime != "vllm":      # vLLM gives log-probabilities: logits differ from them by a constant per position
        figures["max_abs_logit_diff"] = round((a - b).abs().max().item(), 4)
    if base_logits is not None:
        c = torch.log_softmax(base_logits[:, :vocab].float(), -1)
        figures["base_top1_agreement"] = round((c.argmax(-1) == b.argmax(-1)).float().mean().item(), 4)
        figures["base_mean_kld"] = round((c.exp() * (c - logp_b)).sum(-1).mean().item(), 6)
    t = threshold_for(runtime, result["dtype"])
    figures["thresholds"] = {"top1_at_least": t.top1, "kld_at_most": t.kld, "why": t.why}
    bad = []
    if figures["top1_agreement"] < t.top1:
        bad.append(f"top-1 agreement {figures['top1_agreement']:.4f} < {t.top1}")
    if figures["mean_kld"] > t.kld:
        bad.append(f"mean KLD {figures['mean_kld']:.4f} > {t.kld}")
    note = ""
    if result["failed_ways"]:
        first = result["failed_ways"][0]
        note = f"the default way ({first['how']}) fails: {first['error']}; loads with {result['how']}"
    if bad:
        return RuntimeCheck(runtime, "fail", "; ".join(bad) + (f" ({note})" if note else ""), figures)
    return RuntimeCheck(runtime, "pass", note, figures)
