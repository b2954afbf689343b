"""llama.cpp's split GGUF layout (what `llama-gguf-split --split-max-size` writes, and llama.cpp loads as one
model from its first part): `NAME-00001-of-0000N.gguf` …, every part a GGUF file whose header carries
`split.no` (u16, from 0), `split.count` (u16) and `split.tensors.count` (i32, all parts'); the first part
holds all other metadata, the others only those three keys.  Tensors keep their order; a new part starts when
the next tensor (padded to the alignment) would take the current part's tensor data past the maximum — sizes
in decimal units, as llama-gguf-split counts them (48G = 48·10⁹ bytes).  Source: tools/gguf-split/gguf-split.cpp
and llama_split_path in src/llama.cpp (llama.cpp 0c1e57098)."""
from __future__ import annotations

import re
from pathlib import Path

import gguf

from ...errors import SourceError, UsageError

PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """'48G', '500M', '2000000' -> bytes (decimal units, as llama-gguf-split)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(text).upper())
    if not m or float(m[1]) <= 0:
        raise UsageError(f"--split-max-size {text!r}: expected a size such as 48G, 500M or a number of bytes")
    return int(float(m[1]) * _UNITS[m[2]])


def part_path(path: Path, no: int, count: int) -> Path:
    """Part `no` (0-based) of `count` of the file `path` names (NAME.gguf -> NAME-0000k-of-0000N.gguf)."""
    return path.with_name(f"{path.name.removesuffix('.gguf')}-{no + 1:05d}-of-{count:05d}.gguf")


def partition(nbytes: list[int], max_bytes: int | None) -> list[int]:
    """The part of each tensor (by its unpadded size) under llama-gguf-split's rule; a tensor larger than the
    maximum gets a part of its own rather than failing."""
    if not max_bytes:
        return [0] * len(nbytes)
    parts, part, used = [], 0, 0
    for n in nbytes:
        padded = gguf.GGUFWriter.ggml_pad(n, gguf.GGUF_DEFAULT_ALIGNMENT)
        if used and used + padded > max_bytes:
            part, used = part + 1, 0
        used += padded
        parts.append(part)
    return parts


def split_keys(writer: gguf.GGUFWriter, no: int, count: int, tensors: int) -> None:
    writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, no)
    writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, count)
    writer.add_int32(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, tensors)


def all_parts(path: Path, count: int | None) -> list[Path]:
    """Every part of the split file whose first part is `path` ([path] when it is not split)."""
    path = Path(path)
    if not count or count <= 1:
        return [path]
    m = PART_NAME.match(path.name)
    if not m or int(m["no"]) != 1:
        raise SourceError(f"{path}: one part of a split GGUF; open its first part (NAME-00001-of-{count:05d}.gguf)")
    parts = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise SourceError(f"{path}: split GGUF part{'s' if len(missing) > 1 else ''} {', '.join(missing)} missing")
    return parts


def split_file(path: Path, max_bytes: int, out_dir: Path) -> list[Path]:
    """An existing GGUF file rewritten as split parts into `out_dir` (what llama-gguf-split --split-max-size
    does): metadata and tensor bytes copied as they are, a part at a time, each part atomically."""
    import numpy as np

    from ...artifact import atomic_file
    path, out_dir = Path(path), Path(out_dir)
    reader = gguf.GGUFReader(str(path))
    if reader.fields.get(gguf.Keys.Split.LLM_KV_SPLIT_COUNT) is not None:
        raise UsageError(f"{path}: already split")
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tensors = list(reader.tensors)
    where = partition([int(t.n_bytes) for t in tensors], max_bytes)
    count = max(where, default=0) + 1
    paths = [part_path(out_dir / path.name, i, count) for i in range(count)]
    for no, target in enumerate(paths):
        with atomic_file(target) as tmp:
            w = gguf.GGUFWriter(None, arch)
            if no > 0:
                w.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)
            if no == 0:
                for field in reader.fields.values():
                    if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                        continue   # the writer puts the architecture first itself, as the original has it
                    vtype = field.types[0]
                    w.add_key_value(field.name, field.contents(), vtype,
                                    sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
            split_keys(w, no, count, len(tensors))
            mine = [t for t, part in zip(tensors, where) if part == no]
            raws = [np.asarray(t.data).view(np.uint8).reshape(*np.asarray(t.data).shape[:-1], -1) for t in mine]
            for t, raw in zip(mine, raws):
                w.add_tensor_info(t.name, raw.shape, np.dtype(np.uint8), raw.nbytes, raw_dtype=t.tensor_type)
            w.write_header_to_file(tmp)
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for raw in raws:
                w.write_tensor_data(raw)
            w.close()
    return paths
