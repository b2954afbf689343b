"""AWQ's GEMM packing (../shared/docs/formats/awq.md §1.1).

Eight 4-bit codes per int32 along the OUTPUT dimension (GPTQ packs along the input), interleaved: nibble i
(bits 4i..4i+3) of word c holds column 8c + ORDER[i].  `qweight` is (K, N/8) from codes (K, N), `qzeros`
(G, N/8) from zero points (G, N), the same way.  Arithmetic in int64, the low 32 bits reinterpreted as int32.
"""
from __future__ import annotations

import torch

from ..int32_words import as_int32
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # column (within 8) held by nibble i
PER_WORD = 8


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(R, C) codes < 16 -> (R, C/8) int32 in AWQ's interleaved order; C must be a multiple of 8."""
    rows, cols = codes.shape
    if cols % PER_WORD:
        raise ValueError(f"{cols} columns cannot be packed: AWQ needs a multiple of 8")
    c = codes.to(torch.int64).view(rows, cols // PER_WORD, PER_WORD)[..., list(ORDER)]
    shifts = torch.arange(PER_WORD, device=c.device, dtype=torch.int64) * 4
    return as_int32((c << shifts).sum(dim=-1))


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: (R, C/8) int32 -> (R, C) uint8."""
    rows, words = packed.shape
    w = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(PER_WORD, device=w.device, dtype=torch.int64) * 4
    nibbles = (w[..., None] >> shifts) & 0xF                      # (R, W, 8): nibble i
    out = torch.empty_like(nibbles)
    out[..., list(ORDER)] = nibbles                                # nibble i -> column ORDER[i]
    return out.view(rows, words * PER_WORD).to(torch.uint8)
