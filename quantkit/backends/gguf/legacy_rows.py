"""Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 without an importance matrix, encoded in the blocks' own row layout.

These quantizers have no search: one scale (and minimum) per block of 32, then one division per value.
encoders.py's general path transposes every chunk to (32, blocks) and builds int32 byte planes, which made
them 3-7x slower than llama.cpp's C; here a chunk stays (blocks, 32), the codes are computed in place on
one float buffer, and the bytes are assembled as uint8 (measured on an 8960 x 1536 bf16 tensor, 2 cores:
Q5_0 0.15 -> 0.05 s, Q8_0 0.15 -> 0.03 s; llama.cpp's C 0.03-0.04 s).

Byte identity with ggml's reference quantizers rests on the value ranges a block with a finite scale and
its finite reciprocal allows (the C code's integer conversions then never leave their range, so a float
clamp and a plain cast give the same integers).  A block with a non-finite value, scale or reciprocal
(NaN/inf weights, scales that underflow to subnormals) is reported in `unsafe`, and the caller encodes it
with the general path, which reproduces x86's conversions of NaN and out-of-range values.
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QT

from .exact import _div, _recip

_F16 = torch.float16
_U8 = torch.uint8
# roundf(v) == trunc(v + copysign(c, v)) with c the float just below 0.5, for every float32 |v| <= 128
# (checked exhaustively); Q8_0's |v| never exceeds 127 * (1 + 2^-22) when its scale is finite
_BELOW_HALF = 0.49999997


def _first_at_zero(xf: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` per block, with a zero replaced by the block's first element equal to zero: the C loops keep
    the first of equal extremes, which matters only for the sign of a zero."""
    rows = (value == 0).nonzero().squeeze(1)
    if rows.numel():
        sub = xf[rows]
        first = (sub == 0).to(_U8).argmax(1, keepdim=True)   # argmax returns the first maximal index
        value = value.clone()
        value[rows] = sub.gather(1, first).squeeze(1)
    return value


def _signed_absmax_rows(xf: torch.Tensor) -> torch.Tensor:
    """Per block, the first element with the largest |x| (``if (amax < fabsf(v)) { amax = ...; max = v; }``
    from 0: +0 for an all-zero block)."""
    hi, lo = xf.amax(1), xf.amin(1)
    mx = torch.where(hi >= -lo, hi, lo)
    tie = (hi == -lo) & (hi != 0)                   # +a and -a both present: the first one wins
    rows = tie.nonzero().squeeze(1)
    if rows.numel():
        sub = xf[rows]
        first = (sub.abs() == hi[rows].unsqueeze(1)).to(_U8).argmax(1, keepdim=True)
        mx[rows] = sub.gather(1, first).squeeze(1)
    return torch.where((hi != 0) | (lo != 0), mx, torch.zeros_like(mx))


def _inverse(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(id, unsafe): ``id = d ? 1.0f/d : 0.0f``, and the blocks whose d or id is not finite (their id is
    set to 0 so that their lanes stay finite; the caller re-encodes them)."""
    idd = torch.where(d != 0, _recip(d), torch.zeros_like(d))
    unsafe = ~(torch.isfinite(d) & torch.isfinite(idd))
    return torch.where(unsafe, torch.zeros_like(idd), idd), unsafe


def _scaled(xf: torch.Tensor, idd: torch.Tensor, offset: float, top: float | None,
            shift: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 codes trunc(min((x [- shift]) * id + offset, top)): the C code's (int8_t)/(uint8_t) conversion
    and MIN, given the ranges a finite scale allows."""
    if shift is None:
        v = xf * idd.unsqueeze(1)                   # a fresh buffer (xf may be the caller's tensor)
    else:
        v = xf - shift.unsqueeze(1)
        v.mul_(idd.unsqueeze(1))
    v.add_(offset)
    if top is not None:
        v.clamp_(max=top)
    return v.to(_U8)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """(blocks, 32) codes -> (blocks, 16): byte j = low nibble of code j | low nibble of code j+16 << 4."""
    return (q[:, :16] & 0xF) | (q[:, 16:] << 4)


def _bit4(q: torch.Tensor) -> torch.Tensor:
    """(blocks, 32) codes -> (blocks, 4) qh bytes: bit j of the little-endian uint32 is bit 4 of code j."""
    words = (q >> 4).view(torch.int32).to(torch.int64)       # 4 codes' 0/1 per word, one per byte
    # the multiply gathers byte j's bit at position 28 + j (no two terms share a position, no overflow)
    nib = ((words * 0x10204080) >> 28) & 0xF
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(_U8)


def _f16(t: torch.Tensor) -> torch.Tensor:
    return t.to(_F16).view(_U8).view(-1, 2)


def _q8_0(xf):
    a = xf.abs()
    amax = a.amax(1)                                # +0 for an all-zero block (|x| is never -0)
    d = _div(amax, 127.0)
    idd, unsafe = _inverse(d)
    # roundf(x * id) = sign(x) * trunc(|x| * id + c): id >= 0, and |x * id| is |x| * id exactly
    a.mul_(idd.unsqueeze(1)).add_(_BELOW_HALF).copysign_(xf)
    return torch.cat([_f16(d), a.to(torch.int8).view(_U8)], 1), unsafe


def _q4_0(xf):
    d = _div(_signed_absmax_rows(xf), -8.0)
    idd, unsafe = _inverse(d)
    return torch.cat([_f16(d), _nibbles(_scaled(xf, idd, 8.5, 15.0))], 1), unsafe


def _q5_0(xf):
    d = _div(_signed_absmax_rows(xf), -16.0)
    idd, unsafe = _inverse(d)
    q = _scaled(xf, idd, 16.5, 31.0)
    return torch.cat([_f16(d), _bit4(q), _nibbles(q)], 1), unsafe


def _min_max(xf, nmax: float):
    lo = _first_at_zero(xf, xf.amin(1))
    hi = _first_at_zero(xf, xf.amax(1))
    d = _div(hi - lo, nmax)
    idd, unsafe = _inverse(d)
    return d, lo, idd, unsafe


def _q4_1(xf):
    d, lo, idd, unsafe = _min_max(xf, 15.0)
    return torch.cat([_f16(d), _f16(lo), _nibbles(_scaled(xf, idd, 0.5, 15.0, lo))], 1), unsafe


def _q5_1(xf):
    d, lo, idd, unsafe = _min_max(xf, 31.0)
    q = _scaled(xf, idd, 0.5, None, lo)        # (uint8_t)(x0 + 0.5f): no MIN, and x0 <= 31 * (1 + 2^-21)
    return torch.cat([_f16(d), _f16(lo), _bit4(q), _nibbles(q)], 1), unsafe


# qtype -> f(blocks (n, 32) float32) -> (bytes (n, type_size) uint8, unsafe (n,) bool)
ROW_ENCODERS = {QT.Q4_0: _q4_0, QT.Q4_1: _q4_1, QT.Q5_0: _q5_0, QT.Q5_1: _q5_1, QT.Q8_0: _q8_0}
