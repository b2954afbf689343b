"""Write several GGUF files from one read of the source, one tensor in memory at a time.

Every tensor's size is known from the plan, so each file's header and tensor
table are written first; then each source tensor is read once, quantized to
every type the files ask for (once per distinct type) and appended to each file.
"""
from __future__ import annotations

import math
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

from ...artifact import atomic_file
from ...errors import QuantizationError
from ...heap import release_free_memory
from ...model.checkpoint import Checkpoint
from ...progress import Progress
from . import encoders, fusion
from .metadata import add_hparams, add_tokenizer
from .kernel_samples import encode_samples
from .split import part_path, partition, split_keys
from .tensors import GGUFTensor, load_source


@dataclass
class FileJob:
    path: Path
    file_type: int                                  # general.file_type
    types: dict[str, gguf.GGMLQuantizationType]     # GGUF tensor name -> type
    split_max_bytes: int | None = None              # llama.cpp's split layout (split.py) above this size
    # tensors made elsewhere (error feedback: GGUF name -> its bytes, None for the ones to encode here) and the
    # importance vectors (HF weight name -> vector) this file's own encoding uses instead of the run's
    encoded: Callable[[str], np.ndarray | None] | None = None
    imatrix: dict[str, torch.Tensor] | None = None

    def parts(self, tensors: list[GGUFTensor]) -> tuple[list[Path], list[int]]:
        """The files written (one, or the split's parts) and each tensor's part."""
        where = partition([tensor_nbytes(t, self.types[t.name]) for t in tensors], self.split_max_bytes)
        count = max(where, default=0) + 1
        if count == 1:
            return [self.path], where
        return [part_path(self.path, i, count) for i in range(count)], where


def byte_shape(t: GGUFTensor, qtype: gguf.GGMLQuantizationType) -> tuple[int, ...]:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return (*t.shape[:-1], t.shape[-1] // block * size)


def tensor_nbytes(t: GGUFTensor, qtype: gguf.GGMLQuantizationType) -> int:
    return int(np.prod(byte_shape(t, qtype)))


_PLAIN = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
_SLICE_ELEMENTS = 1 << 18
# types whose encoding is a plain dtype cast, given finite values (write_files refuses the others first):
# a copy_ rounds exactly as quantize()'s .to() does
_BY_COPY = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16}


class _Streamed:
    """A float tensor converted and written slice by slice (what GGUFWriter.write_tensor_data
    uses of an array: nbytes and tofile), so that the converted whole (twice the source for F32
    from bf16) is never held (measured: synthetic F32 file, peak RSS 0.86 -> 0.52 GiB)."""

    def __init__(self, src: torch.Tensor, q: gguf.GGMLQuantizationType, nbytes: int):
        self.src, self.q, self.nbytes = src, q, nbytes

    def tofile(self, f) -> None:
        rows, n = self.src.shape
        step = max(1, _SLICE_ELEMENTS // n)
        wide = _BY_COPY.get(self.q)
        # a cast goes into one reused buffer small enough to stay in cache: a fresh buffer per slice made
        # the synthetic F32 file's writes take 3.2-3.7 s instead of 1.3-1.8 s (cProfile, page cache dropped)
        buf = (torch.empty((step, n), dtype=wide)
               if wide is not None and self.src.dtype != wide and self.src.device.type == "cpu" else None)
        for s in range(0, rows, step):
            part = self.src[s:s + step]
            if buf is None:
                encoders.quantize(part, self.q).tofile(f)
            else:
                out = buf[:part.shape[0]]
                out.copy_(part)
                out.numpy().tofile(f)


def _encode(src: torch.Tensor, t: GGUFTensor, q: gguf.GGMLQuantizationType,
            imatrix: dict[str, torch.Tensor] | None) -> np.ndarray:
    if imatrix and t.stack:
        # like llama-imatrix, one importance vector per expert, from the tokens routed to it (an expert no
        # calibration token reached gets ones, as llama-quantize reads a zero count); experts of a tensor the
        # matrix has no entry for are quantized unweighted
        rows = src.shape[0] // len(t.stack)
        parts = [encoders.quantize(src[e * rows:(e + 1) * rows], q, imatrix=imatrix.get(name))
                 for e, name in enumerate(t.stack)]
        return np.concatenate(parts).reshape(byte_shape(t, q))
    weights = imatrix.get(t.source) if imatrix and t.source else None
    return encoders.quantize(src, q, imatrix=weights).reshape(byte_shape(t, q))


class _SharedArrays(gguf.GGUFWriter):
    """A GGUFWriter that packs each large metadata array once for all the files of a run (the files share the
    template's vocabulary lists: tokens, merges, token types), and packs arrays of strings, integers and floats
    in one pass: gguf-py's item-by-item packing cost ~0.14 s per 150 K-item list (~0.02 s here).  The bytes are
    gguf-py's own (tests/test_gguf_convert.py compares them); anything else goes to gguf-py."""

    def __init__(self, arch: str, packed: dict):
        super().__init__(None, arch)
        self._packed = packed

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        if vtype != gguf.GGUFValueType.ARRAY or not isinstance(val, list) or len(val) < 1024:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        key = (id(val), add_vtype, sub_type)
        if key not in self._packed:     # the list is kept beside its bytes, so its id cannot be reused meanwhile
            packed = self._pack_list(val, sub_type)
            if packed is None:
                packed = super()._pack_val(val, vtype, add_vtype=False, sub_type=sub_type)
            self._packed[key] = (val, self._pack("I", vtype) + packed if add_vtype else packed)
        return self._packed[key][1]

    def _pack_list(self, val: list, sub_type) -> bytes | None:
        """gguf-py's bytes of an array's item type, count and items, or None where gguf-py should decide
        (mixed item types, values its struct packing refuses)."""
        T = gguf.GGUFValueType
        ltype = sub_type if sub_type is not None else T.get_type(val[0])
        order = "<" if self.endianess == gguf.GGUFEndian.LITTLE else ">"
        head = self._pack("I", ltype) + self._pack("Q", len(val))
        if ltype == T.STRING and all(isinstance(v, (str, bytes, bytearray)) for v in val):
            length = struct.Struct(order + "Q").pack
            out = bytearray(head)
            for v in val:
                b = v.encode("utf-8") if isinstance(v, str) else v
                out += length(len(b))
                out += b
            return bytes(out)
        if ltype == T.INT32 and all(isinstance(v, int) and not isinstance(v, bool) for v in val):
            try:
                a = np.array(val, dtype=np.int64)
            except OverflowError:
                return None
            if a.min() >= -2 ** 31 and a.max() < 2 ** 31:
                return head + a.astype(order + "i4").tobytes()
        if ltype == T.FLOAT32 and all(isinstance(v, float) for v in val):
            a = np.array(val, dtype=np.float64)
            with np.errstate(over="ignore"):
                f = a.astype(order + "f4")
            if np.array_equal(np.isinf(f), np.isinf(a)):   # struct refuses a finite value beyond float32
                return head + f.tobytes()
        return None


def _probe_encoders(tensors: list[GGUFTensor], jobs: list[FileJob], imatrix: dict | None) -> None:
    """Encode a small random sample of each fused type the files give a tensor, weighted where that tensor's
    rounding is: the calls fusion.prebuild learns the run's kernels from."""
    kinds = set()
    for t in tensors:
        for job in jobs:
            q = job.types[t.name]
            weights = job.imatrix if job.imatrix is not None else imatrix
            weighted = bool(weights) and (any(n in weights for n in t.stack) if t.stack else t.source in weights)
            if q in encoders.FUSED_TYPES:
                kinds.add((q, weighted))
    encode_samples(kinds)


def write_files(model: Checkpoint, tensors: list[GGUFTensor], jobs: list[FileJob], *, name: str,
                device: torch.device, tokenizer_pre: str | None, progress: Progress,
                imatrix: dict[str, torch.Tensor] | None = None, imatrix_info: dict | None = None) -> list[Path]:
    """`imatrix` (HF weight name -> per-column importance) makes the quantizers weight their rounding error
    as llama-quantize does with --imatrix; `imatrix_info` (imatrix_file.Imatrix.provenance: file, dataset,
    entries, chunks) goes into the quantize.imatrix.* keys as llama-quantize writes them."""
    arch = model.adapter.gguf_arch
    template = gguf.GGUFWriter(None, arch)
    add_hparams(template, model, name=name)
    add_tokenizer(template, model, tokenizer_pre)
    if imatrix or any(job.imatrix for job in jobs):
        info = imatrix_info or {}
        template.add_string("quantize.imatrix.file", str(info.get("file", "")))
        template.add_string("quantize.imatrix.dataset", str(info.get("dataset", "")))
        template.add_uint32("quantize.imatrix.entries_count", int(info.get("entries", len(imatrix or ()))))
        if info.get("chunks"):   # llama-quantize leaves the key out for a file that does not say
            template.add_uint32("quantize.imatrix.chunks_count", int(info["chunks"]))
    packed: dict = {}
    with ExitStack() as stack:
        writers = []   # per job, the writer of each tensor (its part's)
        for job in jobs:
            paths, where = job.parts(tensors)
            parts = []
            for no, path in enumerate(paths):
                tmp = stack.enter_context(atomic_file(path))
                w = _SharedArrays(arch, packed)
                if no == 0:
                    # the values are shared, never changed (a deep copy of the vocabulary cost ~0.6 s a file)
                    w.kv_data = [dict(part) for part in template.kv_data]
                    w.add_file_type(job.file_type)
                else:   # a split's other parts carry only the split keys (not even the architecture)
                    w.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)
                if len(paths) > 1:
                    split_keys(w, no, len(paths), len(tensors))
                for t, part in zip(tensors, where):
                    if part == no:
                        q = job.types[t.name]
                        w.add_tensor_info(t.name, byte_shape(t, q), np.dtype(np.uint8), tensor_nbytes(t, q), raw_dtype=q)
                stack.callback(w.close)
                w.write_header_to_file(tmp)
                w.write_kv_data_to_file()
                w.write_ti_data_to_file()
                parts.append(w)
            writers.append([parts[part] for part in where])
        # each (tensor, type) is encoded once however many files want it
        fusion.plan_work(sum(math.prod(t.shape) for t in tensors
                             for q in {job.types[t.name] for job in jobs} if q in encoders.FUSED_TYPES))
        if device.type == "cpu":
            fusion.prebuild(lambda: _probe_encoders(tensors, jobs, imatrix))
        tasks = [progress.task(job.path.name, total=len(tensors)) for job in jobs]
        for i, t in enumerate(tensors):
            made = [job.encoded(t.name) if job.encoded else None for job in jobs]
            src = None
            if any(m is None for m in made):
                src = load_source(model, t)
                # one reduction catches NaN/inf (a finite sum overflowing only costs the full check)
                if not torch.isfinite(src.sum()) and not torch.isfinite(src).all():
                    raise QuantizationError(f"{t.source or t.name}: contains NaN or infinite values; cannot quantize")
                src = src.to(device).reshape(-1, t.shape[-1])
            done: dict[tuple, np.ndarray | _Streamed] = {}
            for job, per_tensor, task, data in zip(jobs, writers, tasks, made):
                q = job.types[t.name]
                weights = job.imatrix if job.imatrix is not None else imatrix
                key = (q, id(weights))
                if data is not None:
                    per_tensor[i].write_tensor_data(data.reshape(byte_shape(t, q)))
                    task.advance()
                    continue
                if key not in done and q in _PLAIN:
                    done[key] = _Streamed(src, q, tensor_nbytes(t, q))
                elif key not in done:
                    done[key] = _encode(src, t, q, weights)
                per_tensor[i].write_tensor_data(done[key])
                task.advance()
            del src, done
            release_free_memory()   # the encoders' temporaries: see quantkit.heap
        for per_tensor, task in zip(writers, tasks):
            for w in dict.fromkeys(per_tensor):
                w.close()
            task.done()
    return [job.parts(tensors)[0][0] for job in jobs]
