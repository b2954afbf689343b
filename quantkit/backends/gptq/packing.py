"""GPTQ's int32 bit packing (../shared/docs/formats/gptq.md §2).

Codes are packed along dim 0 of the array handed in: `qweight` packs input rows (K, N) -> (K·b/32, N);
`qzeros` packs output columns, so callers pass zerosᵀ and transpose back.  2/4/8-bit fields sit in one
word each, lowest bits = lowest index.  3-bit: every 32 consecutive values form one little-endian 96-bit
string spread over 3 words (value k at stream bits 3k..3k+2, two values straddle word boundaries).
Arithmetic is done in int64 and the low 32 bits reinterpreted as int32, so bit 31 is just a bit.
"""
from __future__ import annotations

import torch

BITS = (2, 3, 4, 8)


def packed_rows(rows: int, bits: int) -> int:
    """Words needed for `rows` codes of `bits` bits (rows must be a multiple of 32)."""
    return rows * bits // 32


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C) unsigned codes < 2**bits -> (R·bits/32, C) int32; R must be a multiple of 32."""
    if bits not in BITS:
        raise ValueError(f"GPTQ packs 2, 3, 4 or 8 bits, not {bits}")
    rows, cols = codes.shape
    if rows % 32:
        raise ValueError(f"{rows} rows cannot be packed: GPTQ needs a multiple of 32")
    c = codes.to(torch.int64)
    if bits != 3:
        per = 32 // bits
        shifts = (torch.arange(per, device=c.device, dtype=torch.int64) * bits).view(1, per, 1)
        return _to_int32((c.view(rows // per, per, cols) << shifts).sum(dim=1))
    # 3-bit: 32 values -> 3 words.  Value k starts at stream bit 3k: word 3k//32, offset 3k%32.
    c = c.view(rows // 32, 32, cols)
    words = torch.zeros(rows // 32, 3, cols, dtype=torch.int64, device=c.device)
    for k in range(32):
        start = 3 * k
        word, offset = divmod(start, 32)
        words[:, word] |= (c[:, k] << offset) & 0xFFFFFFFF
        if offset > 29:  # the value crosses into the next word
            words[:, word + 1] |= c[:, k] >> (32 - offset)
    return _to_int32(words.view(rows // 32 * 3, cols))


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: (R·bits/32, C) int32 -> (R, C) uint8 codes."""
    if bits not in BITS:
        raise ValueError(f"GPTQ packs 2, 3, 4 or 8 bits, not {bits}")
    words = packed.to(torch.int64) & 0xFFFFFFFF
    n, cols = words.shape
    mask = (1 << bits) - 1
    if bits != 3:
        per = 32 // bits
        shifts = (torch.arange(per, device=words.device, dtype=torch.int64) * bits).view(1, per, 1)
        return ((words.view(n, 1, cols) >> shifts) & mask).reshape(n * per, cols).to(torch.uint8)
    if n % 3:
        raise ValueError(f"3-bit packing comes in 3-word runs; got {n} rows")
    words = words.view(n // 3, 3, cols)
    out = torch.empty(n // 3, 32, cols, dtype=torch.int64, device=words.device)
    for k in range(32):
        word, offset = divmod(3 * k, 32)
        v = words[:, word] >> offset
        if offset > 29:
            v = v | (words[:, word + 1] << (32 - offset))
        out[:, k] = v & mask
    return out.view(n // 3 * 32, cols).to(torch.uint8)


def pack_zeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """(G, N) stored zero points -> qzeros (G, N·bits/32), packed along the output dimension."""
    return pack(zeros.T.contiguous(), bits).T.contiguous()


def unpack_zeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack(qzeros.T.contiguous(), bits).T.contiguous()
