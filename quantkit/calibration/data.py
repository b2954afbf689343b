"""Calibration tokens: `samples` × `seqlen` token ids that every format's calibration pass shares.

Text sources (a .txt/.jsonl/.parquet file, or an ``hf:`` dataset):

1. The documents are read in their stored order: the whole .txt file is one document; every .jsonl line
   (a JSON object) and every parquet / dataset row is one document, its text in the chosen column.
   Rows whose value is missing, null or blank are skipped (counted in the provenance); a value that is not
   a string is a `DataError`.
2. The documents are joined with ``SEPARATOR`` ("\\n\\n") and the whole text is tokenized once, without
   special tokens (no BOS/EOS), as the evaluation harness does.  The cost is proportional to the size of the
   source (about 1 MB of text per second on one CPU core with a byte-level BPE tokenizer): for a large
   ``hf:`` split, take a slice, e.g. ``train[:20000]``.
3. `samples` non-overlapping windows of `seqlen` tokens are drawn from the T tokens: the placement is
   uniform over all ways to put the windows in the stream (each window may start at any token, not only at
   multiples of `seqlen`), and the rows come out in a shuffled order.  The draw uses only
   ``random.Random(seed).random()``, whose sequence Python guarantees across versions and platforms, so the
   same tokens and seed give the same windows anywhere.  T < samples × seqlen is a `DataError` that says
   both numbers.

``self`` generates the text with the model instead (`quantkit.calibration.selfgen`).

Whatever the source, `CalibrationSet.token_hash` (sha256 of the ids as little-endian int32, row-major)
identifies the exact tokens, and `CalibrationSet.to_json()` is what goes into an artifact's quantkit.json.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..artifact import sha256_file
from ..errors import DataError, DependencyError, UsageError
from ..progress import Progress, null_progress
from .spec import CalibrationSource, CalibrationSpec, parse_calibration_source

SEPARATOR = "\n\n"
WINDOWS_METHOD = "non-overlapping windows, uniform random placement and row order (random.Random(seed).random())"

__all__ = ["CalibrationSet", "CalibrationSpec", "CalibrationSource", "SEPARATOR", "draw_windows",
           "load_calibration", "parse_calibration_source", "token_hash", "tokenize_documents"]


def token_hash(tokens: torch.Tensor) -> str:
    """sha256 hex of the token ids as little-endian int32 bytes, row-major."""
    t = tokens.detach().to("cpu")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= 2 ** 31):
        raise ValueError("token ids outside the int32 range cannot be hashed as int32")
    arr = t.to(torch.int32).contiguous().numpy().astype("<i4", copy=False)
    return hashlib.sha256(arr.tobytes(order="C")).hexdigest()


@dataclass
class CalibrationSet:
    """The calibration tokens and where they came from.

    tokens: (samples, seqlen) int64.  provenance: the source kind plus enough to find the exact input again
    (file path + sha256; dataset name/config/split/column + resolved commit; or the generation settings).
    """
    tokens: torch.Tensor
    spec: CalibrationSpec
    provenance: dict = field(default_factory=dict)
    token_hash: str = ""

    def __post_init__(self) -> None:
        if not self.token_hash:
            self.token_hash = token_hash(self.tokens)

    @property
    def samples(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seqlen(self) -> int:
        return int(self.tokens.shape[1])

    def to_json(self) -> dict:
        """The calibration entry of an artifact's quantkit.json (plain JSON types only)."""
        return {"source": self.spec.source, "samples": self.samples, "seqlen": self.seqlen, "seed": self.spec.seed,
                "token_hash": self.token_hash, "provenance": json.loads(json.dumps(self.provenance, default=str))}


# --- windows ---------------------------------------------------------------------------------------
def _below(rng: random.Random, n: int) -> int:
    """An integer in [0, n) from rng.random() only (stable across Python versions, unlike randrange)."""
    return min(int(rng.random() * n), n - 1)


def draw_windows(total: int, samples: int, seqlen: int, seed: int) -> list[int]:
    """Start offsets of `samples` non-overlapping windows of `seqlen` in a stream of `total` tokens.

    Uniform over all placements (stars and bars: choose `samples` distinct values c in
    [0, total - samples*seqlen + samples), sort, start_i = c_i + i*(seqlen - 1)), then shuffled.
    Requires total >= samples * seqlen.
    """
    slack = total - samples * seqlen
    if slack < 0:
        raise ValueError(f"{total} tokens cannot hold {samples} windows of {seqlen}")
    rng = random.Random(seed)
    n = slack + samples
    swapped: dict[int, int] = {}
    chosen = []
    for i in range(samples):  # partial Fisher-Yates over range(n), sparse
        j = i + _below(rng, n - i)
        vi, vj = swapped.get(i, i), swapped.get(j, j)
        swapped[j] = vi
        chosen.append(vj)
    starts = [c + i * (seqlen - 1) for i, c in enumerate(sorted(chosen))]
    for i in range(len(starts) - 1, 0, -1):  # Fisher-Yates shuffle of the row order
        j = _below(rng, i + 1)
        starts[i], starts[j] = starts[j], starts[i]
    return starts


def too_little_text(where: str, have: int, samples: int, seqlen: int) -> DataError:
    return DataError(f"{where}: {have} tokens of text, but {samples} samples × {seqlen} tokens = {samples * seqlen} "
                     f"are needed; use fewer --calib-samples or a shorter --calib-seqlen (or more text)")


def tokenize_documents(tokenizer, documents: list[str]) -> list[int]:
    """Join the documents with SEPARATOR and tokenize the whole text without special tokens."""
    text = SEPARATOR.join(documents)
    try:
        return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    except TypeError:  # a tokenizer without the `verbose` keyword
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def windows_from_documents(tokenizer, documents: list[str], spec: CalibrationSpec, where: str,
                           progress: Progress = null_progress) -> tuple[torch.Tensor, int]:
    """(samples, seqlen) int64 windows drawn from the tokenized documents, and the number of tokens there were."""
    task = progress.task("tokenizing calibration text", total=None)
    ids = tokenize_documents(tokenizer, documents)
    task.done()
    if len(ids) < spec.samples * spec.seqlen:
        raise too_little_text(where, len(ids), spec.samples, spec.seqlen)
    stream = torch.tensor(ids, dtype=torch.int64)
    starts = draw_windows(len(ids), spec.samples, spec.seqlen, spec.seed)
    index = torch.tensor(starts, dtype=torch.int64)[:, None] + torch.arange(spec.seqlen, dtype=torch.int64)
    return stream[index], len(ids)


# --- local files -----------------------------------------------------------------------------------
def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: a folder, not a calibration file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def _decode(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None


def _collect(path_or_name: str, column: str, values, columns: list[str], rows: int) -> tuple[list[str], int]:
    """Documents from a column's values: blanks/None skipped (counted); non-strings refused; none at all refused."""
    docs, skipped = [], 0
    for i, v in enumerate(values):
        if v is None or (isinstance(v, str) and not v.strip()):
            skipped += 1
            continue
        if not isinstance(v, str):
            raise DataError(f"{path_or_name}: row {i + 1}: column {column!r} holds {type(v).__name__}, not text")
        docs.append(v)
    if not docs:
        raise DataError(f"{path_or_name}: column {column!r} has no text in any of its {rows} rows "
                        f"(columns: {', '.join(columns) or 'none'})")
    return docs, skipped


def read_txt(path: Path) -> tuple[list[str], dict]:
    raw = _read_bytes(path)
    text = _decode(path, raw)
    if not text.strip():
        raise DataError(f"{path}: the file has no text")
    return [text], {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw), "documents": 1}


def read_jsonl(path: Path, column: str) -> tuple[list[str], dict]:
    raw = _read_bytes(path)
    text = _decode(path, raw)
    values, seen, rows = [], {}, 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}: line {lineno} is not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}: line {lineno} is a JSON {type(obj).__name__}, expected an object with a "
                            f"{column!r} field")
        rows += 1
        seen.update(dict.fromkeys(obj))
        values.append(obj.get(column))
    if rows == 0:
        raise DataError(f"{path}: no JSON lines")
    if column not in seen:
        raise DataError(f"{path}: no column {column!r} (columns: {', '.join(seen)}); choose one with --calib-column")
    docs, skipped = _collect(str(path), column, values, list(seen), rows)
    return docs, {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw), "column": column, "rows": rows,
                  "documents": len(docs), "rows_skipped": skipped}


def read_parquet(path: Path, column: str) -> tuple[list[str], dict]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DependencyError("reading .parquet calibration files needs pyarrow: pip install pyarrow") from None
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        raise DataError(f"{path}: a folder, not a calibration file")
    try:
        pf = pq.ParquetFile(path)
        columns = list(pf.schema_arrow.names)
        if column not in columns:
            raise DataError(f"{path}: no column {column!r} (columns: {', '.join(columns)}); choose one with --calib-column")
        field_type = pf.schema_arrow.field(column).type
        if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)
                or getattr(pa.types, "is_string_view", lambda t: False)(field_type)):
            raise DataError(f"{path}: column {column!r} is {field_type}, not text (columns: {', '.join(columns)})")
        values = pf.read(columns=[column]).column(column).to_pylist()
    except DataError:
        raise
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read as parquet ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    docs, skipped = _collect(str(path), column, values, columns, len(values))
    return docs, {"sha256": sha256_file(path), "bytes": path.stat().st_size, "column": column, "rows": len(values),
                  "documents": len(docs), "rows_skipped": skipped}


def read_file_documents(source: CalibrationSource, column: str | None) -> tuple[list[str], dict]:
    """The documents of a local file and its provenance (kind, format, absolute path, sha256, ...)."""
    path = source.path
    if source.format == "txt":
        docs, info = read_txt(path)
    elif source.format == "jsonl":
        docs, info = read_jsonl(path, column)
    else:
        docs, info = read_parquet(path, column)
    return docs, {"kind": "file", "format": source.format, "path": str(path.resolve()), **info}


# --- the entry point -------------------------------------------------------------------------------
def _tokenizer_info(model) -> dict:
    tok = model.tokenizer
    return {"model": getattr(model, "name", None), "class": type(tok).__name__, "size": len(tok)}


def _check_context(spec: CalibrationSpec, model) -> None:
    ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(ctx, int) and spec.seqlen > ctx:
        raise UsageError(f"--calib-seqlen {spec.seqlen} is longer than the model's context "
                         f"(max_position_embeddings {ctx}); use --calib-seqlen {min(ctx, 2048)} or less")


def load_calibration(spec: CalibrationSpec, model, *, device=None, batch_size: int | None = None,
                     progress: Progress = null_progress) -> CalibrationSet:
    """The calibration tokens for `spec`, for `model` (a quantkit Checkpoint).

    Text sources need only `model.tokenizer` (and `model.config.max_position_embeddings`, which `seqlen`
    may not exceed); ``self`` loads the whole model (see `quantkit.calibration.selfgen.generate_tokens`;
    `device` and `batch_size` apply to it only).  Errors: `UsageError` for a bad spec, `DataError` for
    missing/unreadable/short data, `NetworkError` when an ``hf:`` dataset cannot be fetched and is not
    cached, `DependencyError` for a missing optional package.
    """
    source = spec.parsed
    _check_context(spec, model)
    if source.kind == "self":
        from .selfgen import generate_tokens
        tokens, provenance = generate_tokens(model, spec.samples, spec.seqlen, spec.seed, device=device,
                                             batch_size=batch_size, progress=progress)
        return CalibrationSet(tokens=tokens, spec=spec, provenance=provenance)
    if source.kind == "hf":
        from .hub import read_hf_documents
        documents, provenance = read_hf_documents(source, spec.text_column, progress=progress)
    else:
        documents, provenance = read_file_documents(source, spec.text_column)
    tokens, total = windows_from_documents(model.tokenizer, documents, spec, source.text, progress=progress)
    provenance.update({"separator": SEPARATOR, "special_tokens": False, "tokens_available": total,
                       "windows": WINDOWS_METHOD, "tokenizer": _tokenizer_info(model)})
    if source.bundle:
        provenance["bundle"] = source.bundle
    return CalibrationSet(tokens=tokens, spec=spec, provenance=provenance)
