"""llama.cpp's importance-matrix files: the calibration pass's matrix written as `llama-imatrix` writes it
(--imatrix-out), and a `llama-imatrix` file read in place of a calibration pass (--imatrix-file).

The facts below are those of the llama.cpp vendored by llama-cpp-python 0.3.36: tools/imatrix/imatrix.cpp
(`save_imatrix`, `save_imatrix_legacy`), common/imatrix-loader.cpp (`common_imatrix_load`) and
tools/quantize/quantize.cpp (`load_imatrix`).  Entries are named by llama.cpp's GGUF weight names
(blk.N.attn_q.weight), which quantkit maps to the checkpoint's through `gguf_tensors`, as its GGUF writer does.

* GGUF, llama-imatrix's default: `general.type` "imatrix", `imatrix.datasets` (array of strings),
  `imatrix.chunk_count` and `imatrix.chunk_size` (uint32), no architecture.  Per weight, in byte order of the
  names, two F32 tensors: `NAME.in_sum2`, the plain sum of x² of each input column (ne = [width, matrices]), and
  `NAME.counts`, the tokens each matrix saw (ne = [1, matrices]); one matrix for a dense weight, one per expert
  for a stacked `*_exps` weight, and dimensions of 1 at the end are not written.
* the legacy `.dat`: int32 entry count; per entry int32 name length, the name, int32 ncall, int32 value count and
  the float32 values; then int32 chunk count, int32 dataset-name length and the name.  A value is
  (sum / count) · ncall in float32, ncall = ⌈largest count / chunk size⌉; a matrix no token reached stores
  1 · ncall, and an entry no token reached at all is left out.

Reading divides as llama-quantize does: GGUF sums by their matrix's count (a matrix without tokens gets ones),
legacy values by ncall.  The GGUF layout round-trips exactly, since quantkit's own vector is computed from the
float32 sums and the count it stores (`mean_of_sums`).  The .dat does not in general: its values are
float32(mean · ncall), and dividing by ncall again returns the mean only up to one unit in the last place unless
ncall is a power of two.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from ...artifact import atomic_file
from ...calibration.stats import mean_of_sums
from ...errors import SourceError, UsageError
from .mixtures import requires_imatrix
from .reader import open_reader
from .tensors import gguf_tensors

FORMATS = ("gguf", "dat")
DATASETS, CHUNK_COUNT, CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"
SUMS, COUNTS = ".in_sum2", ".counts"
_VALUE_CHARS = 127      # llama-quantize keeps this much of the file name and the dataset in its metadata
_TOKEN_EMBD = ("token_embd.weight", "per_layer_token_embd.weight")


@dataclass
class Entry:
    sums: np.ndarray    # float32 (matrices, width): sum of x² of each input column, a row per matrix (expert)
    counts: np.ndarray  # int64 (matrices,): tokens each matrix saw; a legacy file's single value is its ncall


@dataclass
class Imatrix:
    entries: dict[str, Entry]   # llama.cpp's GGUF weight name -> its statistic
    datasets: list[str]
    chunk_count: int
    chunk_size: int
    legacy: bool = False        # read from a .dat: the sums are means × ncall
    source: str | None = None   # the file, as the user named it (the collected one: where it is written, if it is)
    loaded: bool = False        # read from `source` (not collected)

    def vectors(self) -> dict[str, np.ndarray]:
        """GGUF weight name -> the flat float32 vector llama-quantize weights that tensor's rows with."""
        return {name: self._vector(e) for name, e in self.entries.items()}

    def _vector(self, e: Entry) -> np.ndarray:
        if self.legacy:
            ncall = int(e.counts[0])
            return (mean_of_sums(e.sums, ncall) if ncall > 0 else e.sums.astype(np.float32)).reshape(-1)
        return np.concatenate([mean_of_sums(s, c) if c > 0 else np.ones(s.shape, np.float32)
                               for s, c in zip(e.sums, e.counts)])

    def provenance(self) -> dict:
        """The quantize.imatrix.* values llama-quantize records for this matrix."""
        def clip(text: str) -> str:
            return text.encode()[:_VALUE_CHARS].decode(errors="ignore")
        return {"file": clip(self.source or "quantkit calibration pass"),
                "dataset": clip(self.datasets[0]) if self.datasets else "",
                "entries": len(self.entries), "chunks": self.chunk_count}

    def describe(self) -> str:
        what = "legacy .dat" if self.legacy else "GGUF"
        return (f"from {self.source} ({what}, {len(self.entries)} entries, {self.chunk_count} chunks of "
                f"{', '.join(self.datasets) or 'an unnamed dataset'})")


# -- from the calibration pass, and to the quantizers

def _sources(t) -> tuple[str, ...]:
    """The HF weights a GGUF tensor is made of, in its matrices' order: its experts, or its one source."""
    return t.stack or ((t.source,) if t.source else ())


def from_collector(model, collector, dataset: str, chunk_size: int, source: str | None = None) -> Imatrix:
    """The collector's statistics as llama-imatrix would have them: per GGUF weight its float32 sums and token
    counts (a stacked expert tensor: one row per expert, zeros for an expert no token reached)."""
    accumulators = collector.accumulators()
    entries = {}
    for t in gguf_tensors(model):
        found = [accumulators.get(n) for n in _sources(t)]
        if all(a is None for a in found):
            continue
        width = t.shape[-1]
        entries[t.name] = Entry(
            np.stack([a.float_sums() if a is not None else np.zeros(width, np.float32) for a in found]),
            np.array([a.rows if a is not None else 0 for a in found], dtype=np.int64))
    return Imatrix(entries, [dataset], collector.chunks, chunk_size, source=source)


def importance_for(model, imatrix: Imatrix, types: dict | None = None, file_type: str = "") -> dict[str, torch.Tensor]:
    """HF weight name -> the importance vector llama-quantize would give it from `imatrix` (each expert of a
    stacked tensor its own slice).  A matrix that does not fit the model is refused: non-finite values, an entry
    whose length is not the tensor's input width (llama-quantize stops there too, except for the embedding), no
    entry naming any of the model's tensors, or none for a tensor that `types` (GGUF name -> type) puts in a type
    llama.cpp refuses to write without one.  Tensors without an entry are otherwise quantized unweighted, as by
    llama-quantize."""
    where = f"--imatrix-file {imatrix.source}" if imatrix.loaded else "the collected importance matrix"
    vectors = imatrix.vectors()
    for name, v in vectors.items():
        if not np.isfinite(v).all():
            raise UsageError(f"{where}: {name} holds non-finite values")
    out: dict[str, torch.Tensor] = {}
    matched = 0
    for t in gguf_tensors(model):
        v = vectors.get(t.name)
        qtype = (types or {}).get(t.name)
        if v is None and qtype is not None and requires_imatrix(t.name, qtype, file_type):
            raise UsageError(f"{where}: no entry for {t.name}, which {file_type} writes as {qtype.name}, a type "
                             f"llama.cpp refuses to write without an importance matrix")
        parts = _sources(t)
        if v is None or not parts:
            continue
        width = t.shape[-1]
        if v.size != width * len(parts):
            if t.name in _TOKEN_EMBD:
                continue
            per = f" for each of {len(parts)} experts" if t.stack else ""
            raise UsageError(f"{where}: {t.name} has {v.size} values, and this model's tensor reads {width} inputs"
                             f"{per}; the matrix is from another model")
        matched += 1
        out.update(zip(parts, torch.from_numpy(v).reshape(len(parts), width).unbind(0)))
    if vectors and not matched:
        raise UsageError(f"{where}: none of its {len(vectors)} entries (e.g. {next(iter(vectors))}) names a tensor "
                         f"of this model; the matrix is from another model")
    return out


# -- writing

def save(imatrix: Imatrix, path: str | Path, fmt: str = "gguf") -> Path:
    """`imatrix` as llama-imatrix writes it, `fmt` "gguf" or "dat"; under a temporary name until complete."""
    path = Path(path)
    with atomic_file(path) as tmp:
        (_write_gguf if fmt == "gguf" else _write_dat)(imatrix, tmp)
    return path


def _write_gguf(imatrix: Imatrix, path: Path) -> None:
    w = gguf.GGUFWriter(None, "")
    w.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)    # llama-imatrix's file has none
    w.add_string(gguf.Keys.General.TYPE, "imatrix")
    w.add_array(DATASETS, list(imatrix.datasets))
    w.add_uint32(CHUNK_COUNT, imatrix.chunk_count)
    w.add_uint32(CHUNK_SIZE, imatrix.chunk_size)
    for name in sorted(imatrix.entries):    # code-point order: the byte order of the UTF-8 names, as std::sort
        e = imatrix.entries[name]
        matrices = len(e.counts)
        # ggml writes a dimension of 1 at the end as no dimension: a dense weight's tensors are 1-D
        shape = (matrices, -1) if matrices > 1 else (-1,)
        w.add_tensor(name + SUMS, np.ascontiguousarray(e.sums, dtype=np.float32).reshape(shape))
        w.add_tensor(name + COUNTS, e.counts.astype(np.float32).reshape(shape))
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_dat(imatrix: Imatrix, path: Path) -> None:
    stored = [(n, imatrix.entries[n]) for n in sorted(imatrix.entries) if imatrix.entries[n].counts.any()]
    out = [struct.pack("<i", len(stored))]
    for name, e in stored:
        ncall = -(-int(e.counts.max()) // imatrix.chunk_size)
        counts = e.counts.astype(np.float32)[:, None]
        empty = counts == 0        # stored as a mean of 1
        values = (np.where(empty, np.float32(1), e.sums) / np.where(empty, np.float32(1), counts)) * np.float32(ncall)
        raw = name.encode()
        out += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, values.size),
                values.astype("<f4").tobytes()]
    dataset = (imatrix.datasets[-1] if imatrix.datasets else "").encode()
    out += [struct.pack("<ii", imatrix.chunk_count, len(dataset)), dataset]
    path.write_bytes(b"".join(out))


# -- reading

def load(path: str | Path) -> Imatrix:
    """A llama-imatrix file, GGUF or legacy .dat (told apart by the GGUF magic); any problem is one UsageError."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise UsageError(f"--imatrix-file {path}: no such file") from None
    except OSError as e:
        raise UsageError(f"--imatrix-file {path}: cannot read it ({e.strerror or e})") from None
    return _read_gguf(str(path)) if magic == b"GGUF" else _read_dat(str(path))


def _read_gguf(path: str) -> Imatrix:
    where = f"--imatrix-file {path}"
    try:
        reader = open_reader(Path(path))
    except SourceError as e:
        raise UsageError(f"--imatrix-file {e.message}") from None

    def value(key: str, vtype: gguf.GGUFValueType, sub=None):
        f = reader.fields.get(key)
        if f is None:
            return None
        if f.types[0] != vtype or (sub is not None and f.types[-1] != sub):
            raise UsageError(f"{where}: metadata {key} has the wrong type; the file is corrupt")
        try:
            return f.contents()
        except (UnicodeDecodeError, ValueError, IndexError):
            raise UsageError(f"{where}: metadata {key} is unreadable; the file is corrupt") from None

    kind = value(gguf.Keys.General.TYPE, gguf.GGUFValueType.STRING)
    if kind != "imatrix":
        found = f"general.type {kind!r}" if kind else "no general.type"
        raise UsageError(f"{where}: not an importance matrix (a GGUF file with {found}; llama-imatrix writes "
                         f"general.type 'imatrix')")
    datasets = value(DATASETS, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    chunk_count = value(CHUNK_COUNT, gguf.GGUFValueType.UINT32)
    chunk_size = value(CHUNK_SIZE, gguf.GGUFValueType.UINT32)
    if datasets is None or chunk_count is None or chunk_size is None:
        raise UsageError(f"{where}: no {DATASETS} / {CHUNK_COUNT} / {CHUNK_SIZE} metadata, without which "
                         f"llama-quantize refuses the file")
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        for suffix in (SUMS, COUNTS):
            if t.name.endswith(suffix):
                if t.tensor_type != gguf.GGMLQuantizationType.F32:
                    raise UsageError(f"{where}: {t.name} is {t.tensor_type.name}; llama.cpp's are F32")
                pairs.setdefault(t.name[:-len(suffix)], {})[suffix] = np.array(t.data, dtype=np.float32).reshape(-1)
    entries = {}
    for name, pair in pairs.items():
        if len(pair) != 2:
            raise UsageError(f"{where}: {name} has {'a sum' if SUMS in pair else 'counts'} without "
                             f"{'counts' if SUMS in pair else 'a sum'}; the file is corrupt")
        sums, counts = pair[SUMS], pair[COUNTS]
        if not counts.size or sums.size % counts.size or not np.isfinite(counts).all():
            raise UsageError(f"{where}: {name}'s {sums.size} sums and {counts.size} counts do not fit together; "
                             f"the file is corrupt")
        entries[name] = Entry(sums.reshape(counts.size, -1), _lround(counts))
    if not entries:
        raise UsageError(f"{where}: holds no {SUMS} / {COUNTS} tensors; it is no importance matrix")
    return Imatrix(entries, list(datasets), int(chunk_count), int(chunk_size), source=path, loaded=True)


def _lround(x: np.ndarray) -> np.ndarray:
    """C's lround (halves away from zero), with which llama.cpp reads the float counts back as integers."""
    x = x.astype(np.float64)
    return np.where(x >= 0, np.floor(x + 0.5), np.ceil(x - 0.5)).astype(np.int64)


class _Short(Exception):
    pass


def _read_dat(path: str) -> Imatrix:
    data = Path(path).read_bytes()
    at = 0

    def take(n: int) -> bytes:
        nonlocal at
        if n < 0 or at + n > len(data):
            raise _Short
        at += n
        return data[at - n:at]

    def int32() -> int:
        return struct.unpack("<i", take(4))[0]

    entries: dict[str, Entry] = {}
    count = 0
    try:
        count = int32()
        if count < 1:
            raise _Short
        for _ in range(count):
            name = take(int32()).split(b"\0")[0].decode()
            ncall, nval = int32(), int32()
            if nval < 1:
                raise _Short
            sums = np.frombuffer(take(4 * nval), dtype="<f4").astype(np.float32).reshape(1, nval)
            entries[name] = Entry(sums, np.array([ncall], dtype=np.int64))
    except (_Short, UnicodeDecodeError):
        if not entries:
            raise UsageError(f"--imatrix-file {path}: not an importance matrix (no GGUF magic, and not llama-imatrix's "
                             f"legacy .dat layout either)") from None
        raise UsageError(f"--imatrix-file {path}: a legacy .dat truncated or corrupt after {len(entries)} of its "
                         f"{count} entries") from None
    chunk_count, datasets = 0, []
    if len(data) - at >= 4:          # the chunk count and the dataset's name are optional
        chunk_count = int32()
        if len(data) - at >= 4:
            n = int32()
            if 0 < n <= len(data) - at:
                datasets.append(take(n).split(b"\0")[0].decode(errors="replace"))
    return Imatrix(entries, datasets, chunk_count, 0, legacy=True, source=path, loaded=True)


# -- the options

def file_options(options: dict, collecting: bool) -> tuple[str | None, str, Imatrix | None]:
    """(--imatrix-out, --imatrix-format, the matrix --imatrix-file names, read), checked against each other."""
    out, fmt, given = options.get("imatrix_out"), options.get("imatrix_format"), options.get("imatrix_file")
    if given and collecting:
        raise UsageError("--imatrix collects an importance matrix and --imatrix-file reads one: give one of them")
    if out and not collecting:
        raise UsageError("--imatrix-out writes the importance matrix the calibration pass collects: add --imatrix "
                         "and --calib")
    if fmt and not out:
        raise UsageError("--imatrix-format says how --imatrix-out writes the matrix: add --imatrix-out FILE")
    if fmt and fmt not in FORMATS:
        raise UsageError(f"--imatrix-format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return (str(out) if out else None), fmt or "gguf", (load(given) if given else None)
