"""llama.cpp's arithmetic on the activations side, for evaluations that should match the runtime.

ggml's CPU backend does not multiply a quantized weight by float activations: it first converts each
row of activations to the weight type's "vec_dot" type (Q8_0, Q8_1 or Q8_K blocks; F16 or BF16 for
half-precision weights) and takes integer dot products.  That rounding is part of what llama.cpp measures,
so `eval --activations llama.cpp` applies the same rounding before each matmul; the default evaluates the
dequantized weights exactly.  (Formulas: ggml quantize_row_q8_0 / q8_1 / q8_K and the type traits'
vec_dot_type table.)
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as Q

ActFn = Callable[[torch.Tensor], torch.Tensor]


def _blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // n, n)


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """32-blocks, scale amax/127 stored as fp16, round half to even."""
    b = _blocks(x.float(), 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    return (q * d.half().float()).reshape(x.shape).to(x.dtype)


def q8_k(x: torch.Tensor) -> torch.Tensor:
    """256-blocks, scale from the signed value of largest magnitude, kept in fp32, codes capped at 127."""
    b = _blocks(x.float(), 256)
    idx = b.abs().argmax(-1, keepdim=True)
    mx = b.gather(-1, idx)
    iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
    q = torch.round(iscale * b).clamp(max=127)
    d = torch.where(mx != 0, 1 / iscale, torch.zeros_like(mx))
    return (q * d).reshape(x.shape).to(x.dtype)


def to_f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().to(x.dtype)


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().to(x.dtype)


# weight type -> what ggml turns the activations into before the dot product
VEC_DOT: dict[Q, ActFn | None] = {
    Q.F32: None, Q.F16: to_f16, Q.BF16: to_bf16,
    Q.Q4_0: q8_0, Q.Q5_0: q8_0, Q.Q8_0: q8_0, Q.IQ4_NL: q8_0,
    Q.Q4_1: q8_0, Q.Q5_1: q8_0,  # Q8_1: the same codes and fp16 scale (plus a sum term for the minimum)
    Q.Q2_K: q8_k, Q.Q3_K: q8_k, Q.Q4_K: q8_k, Q.Q5_K: q8_k, Q.Q6_K: q8_k, Q.IQ4_XS: q8_k,
    Q.IQ3_XXS: q8_k, Q.IQ3_S: q8_k, Q.IQ2_XXS: q8_k, Q.IQ2_XS: q8_k, Q.IQ2_S: q8_k, Q.IQ1_S: q8_k, Q.IQ1_M: q8_k,
    Q.TQ1_0: q8_k, Q.TQ2_0: q8_k,
}


def activation_fn(qtype) -> ActFn | None:
    return VEC_DOT.get(Q(qtype))
