"""Writing a (possibly sharded) safetensors checkpoint whose tensors arrive one layer at a time.

Every tensor's name, dtype and shape are known from the plan before any is computed, so the headers and
the shard split are fixed up front and each tensor is written at its final offset as soon as it exists:
nothing is held back in memory.  Files are named as transformers names them (`model.safetensors`, or
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`).

A few small tensors cannot be sized before their weight is seen (bitsandbytes' quant-state JSON holds a
decimal whose digits depend on the data).  Such a spec is `late`: its shape is an estimate, it is placed
after the other tensors of its shard, held in memory when put, and written at close, when the header is
rewritten in the room reserved for it (safetensors allows a header padded with spaces).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .safetensors_reader import DTYPES

CODES = {v: k for k, v in DTYPES.items()}
ALIGN = 8  # safetensors pads the header so data starts 8-byte aligned
LATE_HEADER_ROOM = 32  # header bytes reserved per late tensor, for its real shape and offsets


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    late: bool = False      # the shape is an estimate; the tensor is sized when it is put

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


class ShardedSafetensorsWriter:
    def __init__(self, folder: Path, specs: list[TensorSpec], max_shard_bytes: int = 4 << 30,
                 metadata: dict[str, str] | None = None):
        self.folder = Path(folder)
        shards: list[list[TensorSpec]] = [[]]
        size = 0
        for spec in specs:
            if shards[-1] and size + spec.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += spec.nbytes
        n = len(shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.metadata = {"format": "pt", **(metadata or {})}
        self.where: dict[str, tuple[Path, int, TensorSpec]] = {}
        self.shards: dict[Path, list[TensorSpec]] = {}
        self.files: list[tuple[Path, bytes, int]] = []
        for fname, shard in zip(names, shards):
            shard = [sp for sp in shard if not sp.late] + [sp for sp in shard if sp.late]
            path = self.folder / fname
            header = self._header(shard)
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (LATE_HEADER_ROOM * sum(sp.late for sp in shard))
            raw += b" " * (-len(raw) % ALIGN)
            base = 8 + len(raw)
            for spec in shard:
                self.where[spec.name] = (path, base + header[spec.name]["data_offsets"][0], spec)
            self.shards[path] = shard
            self.files.append((path, raw, base + sum(sp.nbytes for sp in shard)))
        self.pending = set(self.where)
        self.late: dict[str, torch.Tensor] = {}
        self._fds: dict[Path, int] = {}

    def _header(self, shard: list[TensorSpec], shapes: dict[str, tuple[int, ...]] | None = None) -> dict:
        header: dict = {"__metadata__": self.metadata}
        offset = 0
        for spec in shard:
            spec = TensorSpec(spec.name, spec.dtype, (shapes or {}).get(spec.name, spec.shape))
            header[spec.name] = {"dtype": CODES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        return header

    def open(self, written: set[str] | None = None) -> None:
        """Create the shards at their full size; `written` (a resumed run): reopen the shards a previous run of
        the same plan left, whose tensors named there are already in place."""
        for path, raw, total in self.files:
            if written is not None:
                if not path.is_file() or path.stat().st_size != total:
                    raise FileNotFoundError(f"{path}: not the shard a previous run of this plan left")
                self._fds[path] = os.open(path, os.O_RDWR)
                continue
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
            self._fds[path] = fd
            _pwrite_all(fd, len(raw).to_bytes(8, "little") + raw, 0)
            os.ftruncate(fd, total)
        if written:
            self.pending -= written

    def written(self) -> set[str]:
        """The planned tensors put so far (late ones excepted: they live in memory until close)."""
        return set(self.where) - self.pending - set(self.late)

    def put_bytes(self, name: str, data, at: int) -> None:
        """Bytes of a planned tensor at byte `at` within it (a tensor written in pieces); `done` marks it whole."""
        path, offset, spec = self.where[name]
        if spec.late or at + len(data) > spec.nbytes:
            raise ValueError(f"{name}: {at + len(data)} bytes written of {spec.nbytes} planned")
        _pwrite_all(self._fds[path], data, offset + at)

    def done(self, name: str) -> None:
        self.pending.discard(name)

    def put(self, name: str, tensor: torch.Tensor) -> None:
        path, offset, spec = self.where[name]
        t = tensor.detach().to("cpu").contiguous()
        if spec.late and t.dtype == spec.dtype and t.dim() == len(spec.shape):
            self.late[name] = t
            self.pending.discard(name)
            return
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise ValueError(f"{name}: planned {spec.dtype} {spec.shape}, got {t.dtype} {tuple(t.shape)}")
        _pwrite_all(self._fds[path], _bytes_of(t), offset)
        self.pending.discard(name)

    def close(self) -> list[Path]:
        """Check every planned tensor was written, flush, and write the index when sharded."""
        if self.pending:
            missing = sorted(self.pending)
            raise RuntimeError(f"tensors never written: {', '.join(missing[:3])}")
        self._write_late()
        for fd in self._fds.values():
            os.fsync(fd)
            os.close(fd)
        self._fds.clear()
        paths = [p for p, _, _ in self.files]
        if len(paths) > 1:
            sizes = {name: t.numel() * t.element_size() for name, t in self.late.items()}
            index = {"metadata": {"total_size": sum(sizes.get(n, s.nbytes) for n, (_, _, s) in self.where.items())},
                     "weight_map": {name: p.name for name, (p, _, _) in sorted(self.where.items())}}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return paths

    def _write_late(self) -> None:
        """Late tensors go after their shard's others, and the header is rewritten with their real shapes."""
        for path, raw, _ in self.files:
            shard = self.shards[path]
            late = [sp for sp in shard if sp.late]
            if not late:
                continue
            header = self._header(shard, {sp.name: tuple(self.late[sp.name].shape) for sp in late})
            text = json.dumps(header, separators=(",", ":")).encode()
            if len(text) > len(raw):
                raise RuntimeError(f"{path.name}: the header outgrew the room reserved for it")
            fd, base = self._fds[path], 8 + len(raw)
            _pwrite_all(fd, text + b" " * (len(raw) - len(text)), 8)
            end = base + header[late[0].name]["data_offsets"][0]
            for sp in late:
                data = _bytes_of(self.late[sp.name])
                _pwrite_all(fd, data, end)
                end += len(data)
            os.ftruncate(fd, end)

    def abort(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _bytes_of(t: torch.Tensor):
    """A contiguous CPU tensor's bytes, without copying them."""
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def _pwrite_all(fd: int, data, offset: int) -> None:
    # one pwrite moves at most ~2 GiB on Linux, and a full disk shows up on some filesystems as a short write
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(28, "short write")
        done += n


def copy_tensor(writers: list[ShardedSafetensorsWriter], name: str, source: Path, start: int, nbytes: int,
                check=None, chunk: int = 16 << 20) -> None:
    """Write a tensor kept as it is straight from its source file into every writer, `chunk` bytes at a time, so a
    2 GB embedding is read once and never sits in memory whole; the next piece is read while one is written
    (two buffers).  `check(piece)` sees each piece (uint8) first."""
    from .read_ahead import read_ahead
    size = min(chunk, max(nbytes, 1))
    buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2 if nbytes > chunk else 1)]
    with open(source, "rb", buffering=0) as f:
        def piece(k: int) -> tuple[int, torch.Tensor]:
            at = k * chunk
            buf = buffers[k % len(buffers)]
            want, got, view = min(chunk, nbytes - at), 0, memoryview(buf.numpy())
            while got < want:   # pieces are read in order, one at a time: the file position is the piece's
                n = f.readinto(view[got:want])
                if not n:
                    raise OSError(5, f"{source} ended while copying {name}")
                got += n
            return at, buf[:want]

        f.seek(start)
        for at, data in read_ahead(lambda k=k: piece(k) for k in range(-(-nbytes // chunk))):
            if check is not None:
                check(data)
            for w in writers:
                w.put_bytes(name, memoryview(data.numpy()), at)
    for w in writers:
        w.done(name)
