"""An artifact's record: what quantkit knows about it beyond its bytes — the source, the calibration, and the
metrics measured against the original with their protocol.

A folder artifact keeps it in its quantkit.json (written by the format's writer); a GGUF file, whose bytes
must stay llama.cpp's, keeps it beside itself in `NAME.gguf.quantkit.json`.  The CLI's convert (and a
recipe) adds the command that made the artifact, `quantkit eval --record` the metrics; cards and reports read
them from here."""
from __future__ import annotations

import json
from pathlib import Path

from .. import __version__
from ..artifact import atomic_file, sha256_file
from ..errors import SourceError, UsageError


def record_path(artifact: Path) -> Path:
    artifact = Path(artifact)
    return artifact / "quantkit.json" if artifact.is_dir() else artifact.with_name(artifact.name + ".quantkit.json")


def read_record(artifact: Path) -> dict:
    path = record_path(artifact)
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except ValueError:
        raise SourceError(f"{path}: not valid JSON") from None
    return record if isinstance(record, dict) else {}


def write_metrics(artifact: Path, result, data: Path, runtime: str, activations: str) -> Path:
    """Put an evaluation's figures and protocol into the artifact's record (replacing an earlier measurement
    with the same protocol), atomically: a reader sees the old record or the new one, never half of one."""
    artifact = Path(artifact)
    if not artifact.exists():
        raise UsageError(f"--record: {artifact} is not an artifact on disk")
    protocol = {"data": Path(data).name, "data_sha256": sha256_file(Path(data)), "ctx": result.ctx,
                "windows": result.windows, "runtime": runtime, "activations": activations, "base": result.base}
    figures = {"perplexity": result.perplexity, "tokens_scored": result.tokens_scored}
    if result.base is not None:
        figures.update(base_perplexity=result.base_perplexity, mean_kld=result.mean_kld,
                       top1_agreement=result.top1_agreement)
    record = read_record(artifact)
    kept = [m for m in record.get("metrics", []) if m.get("protocol") != protocol]
    record["metrics"] = kept + [{"protocol": protocol, **figures}]
    return _write(artifact, record)


def update_record(artifact: Path, fields: dict) -> Path:
    """Top-level entries a format adds to a file's record after writing it (GGUF: how its rounding was weighted,
    `quantization.method`, and the calibration tokens); a folder artifact's writer fills its own quantkit.json."""
    record = read_record(Path(artifact))
    record.update(fields)
    return _write(Path(artifact), record)


def write_origin(artifact: Path, command: str, source: dict) -> Path:
    """Put the command that made `artifact` (and, for a GGUF file, whose record starts here, the quantkit
    version, the source and the file's sha256, which `verify` checks) into its record, atomically."""
    artifact = Path(artifact)
    record = read_record(artifact)
    record.setdefault("quantkit_version", __version__)
    record.setdefault("source", source)
    if artifact.is_file():
        record["files"] = {artifact.name: sha256_file(artifact)}      # the file just written
    record["command"] = command
    return _write(artifact, record)


def write_verify(artifact: Path, report: dict) -> Path:
    """`quantkit verify`'s report into the artifact's record (the last one replaces the one before)."""
    record = read_record(Path(artifact))
    record["verify"] = report
    return _write(Path(artifact), record)


def _write(artifact: Path, record: dict) -> Path:
    path = record_path(artifact)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
    return path


def best_metrics(record: dict) -> dict | None:
    """The measurement a card shows: against a base model, in the artifact's own runtime where there is one,
    the most windows."""
    rows = [m for m in record.get("metrics", []) if m.get("protocol", {}).get("base")]
    if not rows:
        return None
    return max(rows, key=lambda m: (m["protocol"]["runtime"] != "quantkit", m["protocol"]["windows"]))
