"""Rotary position embeddings: the frequencies each RoPE kind uses, and the cos/sin tables.

The kinds and their parameters are those transformers' configs carry (`rope_parameters`, or the older
`rope_theta` + `rope_scaling`): default, linear, dynamic (NTK), llama3, yarn and longrope.  yarn and longrope
also scale cos/sin by an attention factor.
"""
from __future__ import annotations

import math

import torch

from ..errors import UnsupportedArchitectureError
from .block import Rope

# "factors": an explicit divisor per frequency (what a GGUF file's rope_freqs tensor stores for llama3 scaling)
KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "factors")


def base_inv_freq(rope: Rope, theta: float | None = None) -> torch.Tensor:
    """The unscaled frequencies, theta^(-2i/dim)."""
    dim = rope.dim
    return 1.0 / ((theta or rope.theta) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freq(rope: Rope, seq_len: int = 0) -> tuple[torch.Tensor, float]:
    """(frequencies, attention factor) for sequences of `seq_len` tokens."""
    kind, p = rope.kind, rope.param
    inv = base_inv_freq(rope)
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(p("factor")), 1.0
    if kind == "dynamic":
        # NTK-aware: the base grows once a sequence is longer than the trained context
        if seq_len <= rope.max_positions:
            return inv, 1.0
        factor = float(p("factor"))
        base = rope.theta * ((factor * seq_len / rope.max_positions) - (factor - 1)) ** (rope.dim / (rope.dim - 2))
        return base_inv_freq(rope, base), 1.0
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
        factor = float(p("factor"))
        low, high = float(p("low_freq_factor")), float(p("high_freq_factor"))
        old_ctx = float(p("original_max_position_embeddings"))
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "factors":
        return inv / torch.tensor(p("factors"), dtype=torch.float32), 1.0
    if kind == "yarn":
        return _yarn(rope)
    if kind == "longrope":
        return _longrope(rope, seq_len)
    raise UnsupportedArchitectureError(f"RoPE scaling {kind!r} is not supported (supported: {', '.join(KINDS)})")


def _yarn(rope: Rope) -> tuple[torch.Tensor, float]:
    p, dim, base = rope.param, rope.dim, rope.theta
    factor = float(p("factor"))
    original = p("original_max_position_embeddings") or rope.max_positions

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p("attention_factor")
    if attention is None:
        m, m_all = p("mscale"), p("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(p("beta_fast") or 32), float(p("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp                      # 1: keep the original frequency, 0: interpolate it by `factor`
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate, float(attention)


def _longrope(rope: Rope, seq_len: int) -> tuple[torch.Tensor, float]:
    p, dim = rope.param, rope.dim
    original = p("original_max_position_embeddings") or rope.max_positions
    # Phi-3 leaves `factor` out and means the ratio of the extended to the pretrained context
    factor = float(p("factor")) if p("factor") is not None else rope.max_positions / original
    attention = p("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(p("long_factor") if seq_len > original else p("short_factor"), dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * rope.theta ** shape), float(attention)


def rope_tables(rope: Rope, seq_len: int, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (seq_len, dim), in HF's rotate-half layout (each frequency twice, halves concatenated)."""
    inv, attention = inv_freq(rope, seq_len)
    pos = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv.float())
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return cos.to(device, dtype), sin.to(device, dtype)
