"""LLM.int8's arithmetic on the activations side, for evaluations that should match bitsandbytes.

An LLM.int8 linear does not multiply its weight by the float input: it finds the input's outlier columns (any
|x| ≥ `llm_int8_threshold`, 6.0 by default, among the rows of one forward call), takes those columns in the
input's own precision against the dequantized weight, and every other column as int8 — each row in float16,
outlier elements zeroed, scaled by its absmax to ±127 and rounded.  The sum is the same as the float input
with its non-outlier columns replaced by their int8 values, which is what this rounding returns
(bitsandbytes 0.50's default kernels `int8_vectorwise_quant` and `int8_mixed_scaled_mm`; facts, not code).
"""
from __future__ import annotations

import torch

DEFAULT_THRESHOLD = 6.0


def compute_dtype_input(dtype: torch.dtype):
    """A 4-bit linear's input, cast to the compute dtype (the matmul's own rounding is not emulated)."""
    return lambda x: x.to(dtype).to(x.dtype)


def llm_int8_input(threshold: float = DEFAULT_THRESHOLD):
    """The rounding of a linear's input, per window: a (windows, tokens, features) input is one forward call per
    window, as transformers runs the evaluation's windows."""

    def one_call(a: torch.Tensor) -> torch.Tensor:   # (rows, features)
        half = a.to(torch.float16)
        outliers = half.abs() >= threshold if threshold > 0 else torch.zeros_like(half, dtype=torch.bool)
        cols = outliers.any(dim=0)
        masked = half.masked_fill(outliers, 0)
        stats = masked.abs().amax(dim=1).float()
        scale = torch.where(stats > 0, 127.0 / stats, torch.zeros_like(stats))   # an all-zero row stays zero
        values = torch.round(masked * scale[:, None]) * (stats[:, None] / 127.0)
        if a.shape[0] > 1:   # bitsandbytes zeroes the int8 outlier columns only when there is more than one row
            return torch.where(cols[None, :], a.float(), values).to(a.dtype)
        return torch.where(outliers, a.float(), values).to(a.dtype)

    def rounding(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return one_call(x)
        return torch.stack([one_call(w.reshape(-1, x.shape[-1])) for w in x]).reshape(x.shape)

    return rounding
