"""Packed formats compute their words in int64 and store int32: the low 32 bits, reinterpreted as signed."""
from __future__ import annotations

import torch


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 `words` as int32 (a bit pattern ≥ 2^31 becomes negative)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
