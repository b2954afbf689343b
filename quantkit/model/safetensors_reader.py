"""Lazy reading of single or sharded safetensors checkpoints.

The header is parsed by hand (it is 8 bytes of length + JSON) so a corrupt file
gets a precise one-line error, and tensors are read with plain positioned reads
into fresh buffers rather than through a memory map: a mapped checkpoint counts
every touched page towards the process's resident memory, which defeats the
point of streaming a model one layer at a time.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SourceError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse one safetensors file's header; raise SourceError naming what is wrong."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise SourceError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise SourceError(f"{path}: corrupt safetensors header (claims {n} header bytes in a {size}-byte file)")
            raw = f.read(n)
    except OSError as e:
        raise SourceError(f"{path}: cannot read ({e.strerror or e})") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{path}: corrupt safetensors header (not valid JSON: {e})") from e
    if not isinstance(header, dict):
        raise SourceError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise SourceError(f"{path}: corrupt safetensors header (bad entry for tensor {name!r})") from e
        if dtype not in DTYPES:
            raise SourceError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        entry = TensorEntry(name, path, dtype, shape, data_start + begin, end - begin)
        expected = entry.numel * torch.empty((), dtype=DTYPES[dtype]).element_size()
        if end < begin or entry.nbytes != expected or data_start + end > size:
            raise SourceError(
                f"{path}: corrupt safetensors file (tensor {name!r} needs {expected} bytes at "
                f"[{begin}, {end}) but the file holds {size - data_start} bytes of data)")
        entries[name] = entry
    spans = sorted((e.start, e.start + e.nbytes, e.name) for e in entries.values() if e.nbytes)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise SourceError(f"{path}: corrupt safetensors header (the data of tensors {a!r} and {b!r} overlap)")
    return entries, metadata


class SafetensorsCheckpoint:
    """All tensors of a checkpoint folder (one file, or shards with or without an index)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        files = self._weight_files()
        if not files:
            raise SourceError(f"{self.folder}: no .safetensors weights in this folder")
        self.entries: dict[str, TensorEntry] = {}
        for file in files:
            entries, _ = read_header(file)
            self.entries.update(entries)

    def _weight_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise SourceError(f"{index}: corrupt index ({e})") from e
            files = sorted({self.folder / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise SourceError(f"{self.folder}: the index names shards that are missing: {', '.join(missing[:3])}")
            return files
        return sorted(self.folder.glob("*.safetensors"))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into its own memory (no mapping kept)."""
        try:
            entry = self.entries[name]
        except KeyError:
            raise SourceError(f"{self.folder}: tensor {name!r} is missing from the checkpoint") from None
        dtype = DTYPES[entry.dtype]
        # torch.empty, not bytearray: the buffer is filled by the read, a zero fill first costs a pass
        buf = torch.empty(entry.nbytes, dtype=torch.uint8)
        try:
            with open(entry.file, "rb", buffering=0) as f:
                f.seek(entry.start)
                view = memoryview(buf.numpy())
                got = 0
                while got < entry.nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise SourceError(f"{entry.file}: truncated while reading tensor {name!r}")
                    got += n
        except OSError as e:
            raise SourceError(f"{entry.file}: cannot read tensor {name!r} ({e.strerror or e})") from e
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        return buf.view(dtype).reshape(entry.shape)


def checkpoint_size(folder: Path) -> int:
    return sum(os.path.getsize(p) for p in Path(folder).glob("*.safetensors"))
