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


INV_127_SQUARED = 6.200124e-05   # bitsandbytes' constant for 1/127² (not quite it: kept, so the floats are its own)


class LlmInt8Product:
    """An LLM.int8 linear's output as bitsandbytes computes it, step for step (its default kernels
    `int8_vectorwise_quant`, `int8_mixed_scaled_mm`, `int8_mm_dequant`): the input's int8 codes times the weight's
    as exact integers, scaled by both row statistics in float32, plus the outlier columns' float product.  The
    int8 rounding amplifies any difference in its input, so agreeing with the runtime needs its floats, not
    only its algorithm: the input rounding alone (llm_int8_input) leaves 1e-5 differences that flip codes
    downstream."""

    def __init__(self, cb: torch.Tensor, scb: torch.Tensor, threshold: float = DEFAULT_THRESHOLD):
        self.cb, self.scb, self.threshold = cb, scb, threshold
        self.cb_exact = cb.to(torch.float64)   # int8 × int8 sums are exact in float64 (|sum| < 2^53)

    def one_call(self, a: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:   # a: (rows, features)
        half = a.to(torch.float16)
        outliers = half.abs() >= self.threshold if self.threshold > 0 else torch.zeros_like(half, dtype=torch.bool)
        cols = torch.argwhere(outliers.any(dim=0)).view(-1) if outliers.any() else None
        masked = half.masked_fill(outliers, 0)
        stats = masked.abs().amax(dim=1).float()
        codes = torch.round(masked * (127.0 / stats.unsqueeze(-1))).to(torch.int8)
        if a.shape[0] > 1 and cols is not None:
            codes[:, cols] = 0
        ints = (codes.to(torch.float64) @ self.cb_exact.T).to(torch.int32)
        out = ints * (stats.unsqueeze(-1) * self.scb.unsqueeze(0)) * INV_127_SQUARED
        if bias is not None:
            out += bias
        out = out.to(a.dtype)
        if cols is not None and cols.numel():
            sub_b = (self.cb[:, cols].contiguous() * self.scb.view(-1, 1) * 7.874015718698502e-3).to(a.dtype).t()
            out = out.addmm(a[:, cols].contiguous(), sub_b)
        return out

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2:
            return self.one_call(x, bias)
        return torch.stack([self.one_call(w.reshape(-1, x.shape[-1]), bias) for w in x]).reshape(*x.shape[:-1], -1)
