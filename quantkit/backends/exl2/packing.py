"""EXL2's packed tensors (../shared/docs/formats/exl2.md §3): per group, each output column's codes as a plain
little-endian bit stream along the input rows (row k of the group at stream bit b·k, 32 bits a word), the
4-bit scale codes eight columns to a word, and q_groups as (bits, first packed row) pairs.

Arithmetic in int64, the low 32 bits reinterpreted as int32 (the stored dtype).
"""
from __future__ import annotations

import torch

from ..int32_words import as_int32
from .layouts import Group, SCALE_BITS


def packed_rows(rows: int, bits: int) -> int:
    return -(-rows * bits // 32)


def pack_group(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, columns) codes < 2^bits -> (ceil(rows·bits/32), columns) int32.  A code may straddle two words
    (3, 5 and 6 bits); the bits past the last row of a short group are zero."""
    rows, columns = codes.shape
    c = codes.to(torch.int64)
    position = torch.arange(rows, device=codes.device, dtype=torch.int64) * bits
    word, shift = position // 32, position % 32
    out = torch.zeros(packed_rows(rows, bits) + 1, columns, dtype=torch.int64, device=codes.device)
    out.index_add_(0, word, (c << shift[:, None]) & 0xFFFFFFFF)
    spill = shift + bits > 32                         # the code's high bits continue in the next word
    if spill.any():
        out.index_add_(0, word[spill] + 1, c[spill] >> (32 - shift[spill])[:, None])
    return as_int32(out[:-1])


def unpack_group(packed: torch.Tensor, rows: int, bits: int) -> torch.Tensor:
    """Inverse of `pack_group`: the (rows, columns) codes as int64."""
    w = torch.cat([packed.to(torch.int64) & 0xFFFFFFFF, torch.zeros_like(packed[:1], dtype=torch.int64)])
    position = torch.arange(rows, device=packed.device, dtype=torch.int64) * bits
    word, shift = position // 32, (position % 32)[:, None]
    both = w[word] | (w[word + 1] << 32)              # 64 bits from the code's first word on
    return (both >> shift) & ((1 << bits) - 1)


def pack_scales(qscale: torch.Tensor) -> torch.Tensor:
    """(groups, columns) scale codes in 1 … 16 -> (groups, columns/8) int32 of (qscale − 1), column 8w + i at
    bits 4i.  `columns` must be a multiple of 8 (the writer pads to 32)."""
    groups, columns = qscale.shape
    if columns % 8:
        raise ValueError(f"{columns} columns: EXL2 scales pack 8 to a word")
    c = (qscale.to(torch.int64) - 1).view(groups, columns // 8, 8)
    shifts = torch.arange(8, device=c.device, dtype=torch.int64) * SCALE_BITS
    return as_int32((c << shifts).sum(dim=-1))


def unpack_scales(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_scales`: (groups, words) int32 -> (groups, 8·words) scale codes in 1 … 16 (int64)."""
    groups, words = packed.shape
    w = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(8, device=w.device, dtype=torch.int64) * SCALE_BITS
    return (((w[..., None] >> shifts) & 0xF) + 1).view(groups, words * 8)


def q_groups(groups: list[Group]) -> torch.Tensor:
    """(2·groups,) int16: each group's width and the index of its first row in q_weight."""
    out, row = [], 0
    for g in groups:
        out += [g.bits, row]
        row += packed_rows(g.end - g.start, g.bits)
    return torch.tensor(out, dtype=torch.int16)


def padded_columns(columns: int) -> int:
    return -(-columns // 32) * 32


def pack_linear(codes: torch.Tensor, groups: list[Group], qscale: torch.Tensor, scale_max: torch.Tensor,
                perm: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stored tensors of one linear (suffixes of its name): codes (K, N) in processing order, padded to a
    multiple of 32 columns with the zero code 2^(b−1) (a zero weight) and the scale code 16."""
    K, N = codes.shape
    pad = padded_columns(N) - N
    words = []
    for g in groups:
        block = codes[g.start:g.end]
        if pad:
            block = torch.nn.functional.pad(block.to(torch.int64), (0, pad), value=2 ** (g.bits - 1))
        words.append(pack_group(block, g.bits))
    qs = torch.nn.functional.pad(qscale.to(torch.int64), (0, pad), value=16) if pad else qscale
    return {"q_weight": torch.cat(words), "q_invperm": torch.argsort(perm).to(torch.int32),
            "q_scale": pack_scales(qs), "q_scale_max": scale_max.to(torch.float16).reshape(-1),
            "q_groups": q_groups(groups)}


def unpack_linear(t: dict[str, torch.Tensor], columns: int):
    """(codes (K, columns), groups, qscale (G, columns), scale_max (G,), perm) from the stored tensors; each
    group's rows follow from where the next group starts in q_weight, the last group's from K."""
    perm = torch.argsort(t["q_invperm"].to(torch.int64))
    K = perm.numel()
    pairs = t["q_groups"].to(torch.int64).view(-1, 2).tolist()
    groups, start = [], 0
    for i, (bits, first) in enumerate(pairs):
        rows = (pairs[i + 1][1] - first) * 32 // bits if i + 1 < len(pairs) else K - start
        groups.append(Group(bits, start, start + rows))
        start += rows
    if start != K or any(g.end <= g.start for g in groups):
        raise ValueError(f"q_groups does not cover the {K} rows of q_invperm")
    q = t["q_weight"]
    codes = torch.cat([unpack_group(q[first:first + packed_rows(g.end - g.start, g.bits)], g.end - g.start, g.bits)
                       for g, (_, first) in zip(groups, pairs)])
    return codes[:, :columns], groups, unpack_scales(t["q_scale"])[:, :columns], t["q_scale_max"], perm
