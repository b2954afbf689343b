"""The model card of a repo of quantized artifacts: README.md with the Hub's metadata, a table of every
artifact (format, type, size, bits per weight, quality against the original), how to run each one, where its
calibration came from, and a plot of quality against size.

The rows live in the card itself (a JSON comment at its end), so a later push of more artifacts of the same
model to the same repo regrows the table from the card already there: new rows are added, a row for the same
path is replaced, every other row stays."""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import __version__
from ..backends import backend_for_artifact
from ..model.demo import UPSTREAM
from .plot import write_plot
from .record import best_metrics, read_record

ROWS_MARK = "quantkit-rows"
PLOT_NAME = "quantkit-kld-vs-bpw.png"
LIBRARY = {"gguf": "gguf"}        # library_name on the Hub; every other format is a transformers folder
PIPELINE = "text-generation"


@dataclass
class CardRow:
    """One artifact of the repo, as its card shows it."""
    path: str                             # file or folder in the repo ("" for a folder at the root)
    format: str                           # gguf, gptq, bnb …
    variant: str                          # Q4_K_M, 4bit-g128, nf4 …
    size: int                             # bytes of weights
    bits_per_weight: float | None
    metrics: dict | None = None           # perplexity, base_perplexity, mean_kld, top1_agreement, protocol
    calibration: dict | None = None       # source, samples, seqlen, token_hash
    source: dict = field(default_factory=dict)   # the model it was made from (name, revision)
    command: str | None = None            # the quantkit command that made it, local paths shortened
    verify: list[dict] | None = None      # `quantkit verify`: per runtime, verdict, how it loaded, agreement, speed

    @property
    def label(self) -> str:
        return self.path or "(the repo's root folder)"


def row_for(artifact: Path, path_in_repo: str, parameters: int | None = None) -> CardRow:
    """The card row of a local artifact, from its own description and record."""
    artifact = Path(artifact)
    backend = backend_for_artifact(artifact)
    info = backend.describe_artifact(artifact)
    record = read_record(artifact)
    if artifact.is_file():
        # llama.cpp's file-type names without the enum's prefix: MOSTLY_Q4_K_M -> Q4_K_M, ALL_F32 -> F32
        file_type = re.sub(r"^(MOSTLY|ALL)_", "", str(info.get("file_type") or ""))
        size, variant = info.get("file_size") or artifact.stat().st_size, file_type or record.get("variant") or "?"
        method = (record.get("quantization") or {}).get("method")
        if method:          # same type and size as the plain file: what differs is how the rounding was chosen
            variant = f"{variant} ({method})"
        bpw = info.get("bits_per_weight")
    else:
        size = sum(p.stat().st_size for p in artifact.glob("*.safetensors"))
        variant = record.get("variant") or info.get("variant") or "?"
        params = parameters or record.get("parameters")
        bpw = round(8 * size / params, 3) if params else None
    calibration = dict(record["calibration"]) if record.get("calibration") else None
    if calibration:
        calibration.pop("provenance", None)
        calibration["source"] = public_name(str(calibration.get("source", "")))
    source = record.get("source") or {}
    metrics = best_metrics(record)
    if metrics:
        metrics = {**metrics, "protocol": {**metrics["protocol"], "base": public_name(str(metrics["protocol"]["base"]))}}
    return CardRow(path=path_in_repo, format=backend.name, variant=str(variant), size=size, bits_per_weight=bpw,
                   metrics=metrics, calibration=calibration, verify=_verified(record.get("verify")),
                   source={"model": public_name(str(source.get("model", ""))), "revision": source.get("revision")},
                   command=public_command(record["command"]) if record.get("command") else None)


def _verified(report: dict | None) -> list[dict] | None:
    """What the card shows of a verify report: per runtime that ran, the verdict and its figures."""
    if not report:
        return None
    out = []
    for r in report.get("runtimes", []):
        if r["verdict"] == "not installed":
            continue
        f = r.get("figures") or {}
        failed = (f.get("default_failed") or [{}])[0]
        out.append({"runtime": r["runtime"], "verdict": r["verdict"], "why": r.get("why", ""),
                    "loaded_with": f.get("loaded_with"), "default_failed": failed.get("error"),
                    "dtype": f.get("dtype"), "top1_agreement": f.get("top1_agreement"),
                    "decode_tokens_per_s": f.get("decode_tokens_per_s"),
                    "prompt_tokens_per_s": f.get("prompt_tokens_per_s"), "peak_rss_gib": f.get("peak_rss_gib"),
                    "date": report.get("date")})
    return out or None


def public_name(name: str) -> str:
    """A Hub id, demo or dataset name as it is; a local path by its last part only (a card is public, the
    publisher's folders are not)."""
    if name.startswith(("/", ".", "~")) or "\\" in name or Path(name).expanduser().exists():
        return Path(name).name
    return name


def public_command(command: str) -> str:
    """A recorded command with every local path (as a word or an --option=value) shortened by public_name."""
    import shlex
    try:
        words = shlex.split(command)
    except ValueError:
        return command
    def short(word: str) -> str:
        key, eq, value = word.partition("=")
        if eq and key.startswith("--"):
            return f"{key}={public_name(value)}"
        return word if word.startswith("-") else public_name(word)
    return shlex.join([short(w) for w in words])


def card_files(repo: str, rows: list[CardRow], *, base_model: str | None = None,
               license: str | None = None) -> dict[str, bytes]:
    """README.md and its plot (when an artifact has a mean KLD), as the repo's files."""
    import tempfile
    base_model = base_model or base_model_of(rows)
    if license is None and base_model in {hub for hub, _ in UPSTREAM.values()}:
        license = next(lic for hub, lic in UPSTREAM.values() if hub == base_model)
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        plot = write_plot(rows, Path(tmp) / PLOT_NAME, f"{base_model or repo}: quantized artifacts")
        if plot is not None:
            files[PLOT_NAME] = plot.read_bytes()
    text = card_text(repo, rows, base_model=base_model, license=license, plot=PLOT_NAME in files)
    return {"README.md": text.encode(), **files}


def base_model_of(rows: list[CardRow]) -> str | None:
    """The Hub id the artifacts were made from, when their records name one (a demo names its upstream)."""
    names = [str(r.source.get("model") or "") for r in rows]
    names += [str(r.metrics["protocol"].get("base") or "") for r in rows if r.metrics]   # eval --base MODEL
    for name in names:
        if name.startswith("demo:") and name[5:] in UPSTREAM:
            return UPSTREAM[name[5:]][0]
        if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name):
            return name
    return None


def merge_rows(old: list[CardRow], new: list[CardRow]) -> list[CardRow]:
    by_path = {r.path: r for r in old}
    by_path.update({r.path: r for r in new})
    return sorted(by_path.values(), key=lambda r: (r.bits_per_weight or 99.0, r.path))


def rows_in(card_text: str) -> list[CardRow]:
    """The rows an earlier quantkit card recorded ([] for any other README)."""
    m = re.search(rf"<!-- {ROWS_MARK}\n(.*?)\n-->", card_text or "", re.S)
    if not m:
        return []
    try:
        return [CardRow(**r) for r in json.loads(m.group(1))]
    except (ValueError, TypeError):
        return []


def card_text(repo: str, rows: list[CardRow], *, base_model: str | None, license: str | None,
              base_perplexity: float | None = None, plot: bool = False) -> str:
    """README.md: validated Hub metadata, then the table, the plot, how to run, calibration, the rows."""
    from huggingface_hub import ModelCardData
    formats = sorted({r.format for r in rows})
    library = LIBRARY.get(formats[0], "transformers") if len(formats) == 1 else "transformers"
    data = ModelCardData(base_model=base_model, base_model_relation="quantized" if base_model else None,
                         library_name=library, pipeline_tag=PIPELINE, license=license, quantized_by="quantkit",
                         tags=sorted({"quantkit", *formats, *(f"{r.format}-{r.variant}".lower() for r in rows)}))
    title = base_model.split("/")[-1] if base_model else repo.split("/")[-1]
    lines = ["---", data.to_yaml(), "---", "", f"# {title}, quantized", ""]
    if base_model:
        lines += [f"Quantized versions of [{base_model}](https://huggingface.co/{base_model}), made with "
                  f"[quantkit](https://pypi.org/project/quantkit/) {__version__}.", ""]
    lines += _table(rows, base_perplexity)
    if plot:
        lines += ["", f"![mean KL divergence and perplexity against bits per weight]({PLOT_NAME})"]
    lines += ["", "## How to run", ""] + _how_to_run(repo, rows)
    lines += _verification(rows)
    lines += _calibration(rows)
    lines += ["", "## How these were made", "",
              f"quantkit {__version__}. Each artifact's `quantkit.json` (for a GGUF file, this card's row) holds "
              f"its source revision, settings and calibration provenance; the metrics are "
              f"`quantkit eval ARTIFACT --base MODEL --record` on the protocol given under the table.", ""]
    lines += _commands(rows)
    lines += [f"<!-- {ROWS_MARK}", json.dumps([asdict(r) for r in rows], indent=None), "-->", ""]
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _table(rows: list[CardRow], base_perplexity: float | None) -> list[str]:
    out = ["| file | format | type | size | bits/weight | perplexity | mean KLD | top-1 agreement |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    protocols = []
    for r in rows:
        m = r.metrics or {}
        bpw = f"{r.bits_per_weight:.3f}" if r.bits_per_weight else "–"
        ppl = f"{m['perplexity']:.3f}" if "perplexity" in m else "–"
        kld = f"{m['mean_kld']:.5f}" if m.get("mean_kld") is not None else "–"
        top1 = f"{100 * m['top1_agreement']:.2f} %" if m.get("top1_agreement") is not None else "–"
        out.append(f"| `{r.label}` | {r.format} | {r.variant} | {_human(r.size)} | {bpw} | {ppl} | {kld} | {top1} |")
        if m.get("protocol"):
            protocols.append(m["protocol"])
    base = [m["base_perplexity"] for r in rows if (m := r.metrics) and m.get("base_perplexity") is not None]
    if base or base_perplexity:
        out.append(f"| original | | | | 16 | {(base_perplexity or base[0]):.3f} | 0 | 100 % |")
    described = sorted({f"{p['data']} (sha256 {p['data_sha256'][:12]}), {p['windows']} windows × {p['ctx']} "
                        f"tokens, run in {p['runtime']}" for p in protocols})
    if described:
        out += ["", "Measured against the original on " + "; ".join(described) + ". Mean KLD is KL(original ‖ "
                "quantized) per token; top-1 agreement is how often both pick the same next token."]
    return out


def _how_to_run(repo: str, rows: list[CardRow]) -> list[str]:
    out: list[str] = []
    ggufs = [r for r in rows if r.format == "gguf"]
    if ggufs:
        f = ggufs[len(ggufs) // 2].path
        out += ["llama.cpp (any GGUF file of the table):", "", "```bash",
                f'llama-cli --hf-repo {repo} --hf-file {f} -p "The meaning of life is"',
                f"llama-server --hf-repo {repo} --hf-file {f}", "```", ""]
    for r in rows:
        if r.format == "gguf":
            continue
        sub = f', subfolder="{r.path}"' if r.path else ""
        needs = {"gptq": "pip install gptqmodel (with optimum)", "bnb": "pip install bitsandbytes"}.get(r.format, "")
        fallback = next((v for v in r.verify or [] if v["runtime"] == "transformers" and v["verdict"] == "pass"
                         and v.get("default_failed") and "GPTQConfig" in str(v.get("loaded_with"))), None)
        out += [f"transformers ({r.format} {r.variant}{'; ' + needs if needs else ''}):", "", "```python",
                "from transformers import AutoModelForCausalLM, AutoTokenizer",
                f'model = AutoModelForCausalLM.from_pretrained("{repo}"{sub}, device_map="auto")',
                f'tokenizer = AutoTokenizer.from_pretrained("{repo}"{sub})', "```", ""]
        if fallback:   # verify found that the default way fails here and which way works
            bits = re.match(r"(\d+)bit", r.variant)
            out += [f"On the CPU the default kernel refuses this one ({fallback['default_failed']}); "
                    f"`quantkit verify` loaded it with {fallback['loaded_with']}:", "", "```python",
                    "import torch",
                    "from transformers import AutoModelForCausalLM, GPTQConfig",
                    f'model = AutoModelForCausalLM.from_pretrained("{repo}"{sub}, torch_dtype=torch.float32, '
                    f'quantization_config=GPTQConfig(bits={bits.group(1) if bits else 4}, backend="torch"))',
                    "```", ""]
        if r.format == "gptq" and not r.path:   # vLLM loads a repo's root, not a subfolder
            out += ["vLLM:", "", "```bash", f"vllm serve {repo}", "```", ""]
    return out


def _commands(rows: list[CardRow]) -> list[str]:
    """Each command that made artifacts of the table, with the files it made (one run often makes several)."""
    made: dict[str, list[str]] = {}
    for r in rows:
        if r.command:
            made.setdefault(r.command, []).append(f"`{r.label}`")
    out = []
    for command, labels in made.items():
        out += [f"{', '.join(labels)}:", "", "```bash", command, "```", ""]
    return out


def _verification(rows: list[CardRow]) -> list[str]:
    checked = [(r, v) for r in rows for v in r.verify or []]
    if not checked:
        return []
    out = ["", "## Checked in its runtimes", "",
           "`quantkit verify`: each file loaded in the runtime named, a fixed text run through it, and its logits "
           "compared with quantkit's own reading of the file.", "",
           "| file | runtime | verdict | loaded with | top-1 vs quantkit | prompt tok/s | decode tok/s | peak memory |",
           "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r, v in checked:
        num = lambda key, fmt: fmt.format(v[key]) if v.get(key) is not None else "–"
        verdict = v["verdict"] + (f" ({v['why']})" if v["verdict"] == "fail" and v.get("why") else "")
        out.append(f"| `{r.label}` | {v['runtime']} | {verdict} | {v.get('loaded_with') or '–'} | "
                   f"{num('top1_agreement', '{:.2%}')} | {num('prompt_tokens_per_s', '{:.1f}')} | "
                   f"{num('decode_tokens_per_s', '{:.1f}')} | {num('peak_rss_gib', '{:.2f} GiB')} |")
    return out


def _calibration(rows: list[CardRow]) -> list[str]:
    calibrated = [r for r in rows if r.calibration]
    if not calibrated:
        return []
    out = ["", "## Calibration", "", "| file | text | windows × tokens | token hash |", "| --- | --- | ---: | --- |"]
    for r in calibrated:
        c = r.calibration
        out.append(f"| `{r.label}` | {c.get('source', '?')} | {c.get('samples', '?')} × {c.get('seqlen', '?')} | "
                   f"`{str(c.get('token_hash', ''))[:16]}` |")
    return out
