"""bitsandbytes' weight encodings in plain torch (CUDA or CPU): 4-bit NF4 / FP4 with a per-block absmax, the
double quantization of those absmax values, and LLM.int8's row-wise absmax int8.

The layouts and formulas are ../shared/docs/formats/bnb.md §2-3 (facts of bitsandbytes 0.50's
`quantize_4bit`, `quantize_blockwise` and `int8_vectorwise_quant`); tests/test_bnb_encoders.py holds every
output to bitsandbytes' own, byte for byte.  The arithmetic follows the reference step for step where the
bytes depend on it: full blocks are scaled by the reciprocal of their absmax and a partial last block by
division, a value exactly on a midpoint between two codes takes the lower one, and LLM.int8 rounds the
weight from float16, as bitsandbytes' Int8Params does.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from ..int32_words import as_int32
# the 16 NF4 levels (normal-distribution quantiles scaled to [-1, 1]), ascending; code i is level i
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
# FP4 (e2m1 as bitsandbytes lays it out) in code order: bit 3 is the sign, the magnitudes scaled by 1/12.  Code 8
# ("negative zero") is +0.0 in bitsandbytes' table, and the stored quant_map carries those bytes
FP4 = tuple(v / 12 for v in (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0,
                             0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0))
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCK = 256            # double quantization: the absmax values in blocks of 256, 8-bit dynamic codes
_TINY = 1e-38                 # the reference's floor under a block's absmax when dividing by it


@cache
def code_table(quant_type: str) -> torch.Tensor:
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"4-bit quant type {quant_type!r}: expected nf4 or fp4")
    return torch.tensor(NF4 if quant_type == "nf4" else FP4, dtype=torch.float32)


@cache
def dynamic_map() -> torch.Tensor:
    """The signed 8-bit dynamic code (256 values, ascending): for each decade 10^-6 … 10^0, the midpoints of an
    even split of [0.1, 1] into 2^k parts (k = 0 … 6 from the smallest decade up), both signs, plus 0 and 1."""
    values: list[float] = []
    for k in range(7):
        edges = torch.linspace(0.1, 1, 2 ** k + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10 ** (k - 6)
        values += (scale * mids).tolist() + (-scale * mids).tolist()
    return torch.tensor(values + [0.0, 1.0], dtype=torch.float32).sort().values


@cache
def _nearest_tables(levels: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lookup tables for the nearest level, indexed by a float32's top 16 bits (sign, exponent, 7 mantissa bits).

    The float32 values that share those bits form a closed interval at most 1/128 of its magnitude wide, far
    narrower than the gap between two midpoints of the 16 levels, so it holds at most one midpoint: the nearest
    level of every value in it is the one below that midpoint or the one above, told apart by one comparison.
    Per prefix: the sorted position of the level nearest the interval's low end, the midpoint inside (+inf if
    none), and the levels' codes in sorted order."""
    table = torch.tensor(levels, dtype=torch.float32)
    order = torch.argsort(table)
    ascending = table[order]
    mids = (ascending[:-1] + ascending[1:]) / 2
    first = torch.arange(1 << 16, dtype=torch.int64) << 16
    ends = [as_int32(b).view(torch.float32) for b in (first, first | 0xFFFF)]
    # a negative prefix counts down: its interval runs from the last pattern up to the first
    low = torch.nan_to_num(torch.minimum(*ends), nan=2.0, posinf=2.0, neginf=2.0)   # inf/NaN prefixes: never met
    high = torch.nan_to_num(torch.maximum(*ends), nan=2.0, posinf=2.0, neginf=2.0)
    base = (mids < low[:, None]).sum(dim=1)
    inside = (mids >= low[:, None]) & (mids < high[:, None])
    if int(inside.sum(dim=1).max()) > 1:
        raise ValueError("code levels too close together for the 16-bit lookup")
    threshold = torch.where(inside, mids, torch.tensor(float("inf"))).amin(dim=1)
    return base.to(torch.uint8), threshold, order.to(torch.uint8)


def _nearest(scaled: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Code (uint8) of the level in `table` nearest each float32 value; a value exactly on a midpoint between two
    levels takes the lower one (as bitsandbytes' comparisons do).  Two table lookups and a comparison per value,
    all of them torch ops that run on every core (a binary search, torch.bucketize, runs on one)."""
    base, threshold, order = (t.to(scaled.device) for t in _nearest_tables(tuple(table.tolist())))
    prefix = scaled.reshape(-1).view(torch.int32).bitwise_right_shift(16).bitwise_and_(0xFFFF)
    position = base.index_select(0, prefix).add_(scaled.reshape(-1) > threshold.index_select(0, prefix))
    if torch.equal(order, torch.arange(order.numel(), dtype=torch.uint8, device=order.device)):
        return position.reshape(scaled.shape)   # NF4's levels are in code order: the positions are the codes
    return order.index_select(0, position.int()).reshape(scaled.shape)


CHUNK = 1 << 20   # weights encoded per step: the step's float32 temporaries stay a few MB, whatever the tensor


def _blockwise(flat: torch.Tensor, blocksize: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, one per value) and per-block absmax (float32) of a flat tensor, a chunk of whole blocks at a
    time.  A NaN or inf in a block shows in its absmax."""
    n = flat.numel()
    full = n - n % blocksize
    table = table.to(flat.device)
    codes = torch.empty(n, dtype=torch.uint8, device=flat.device)
    absmax = torch.empty(-(-n // blocksize), dtype=torch.float32, device=flat.device)
    step = max(blocksize, CHUNK - CHUNK % blocksize)
    for s in range(0, full, step):
        body = flat[s:min(s + step, full)].float().reshape(-1, blocksize)
        am = body.abs().amax(dim=1)   # (linalg.vector_norm(inf) gives the same, an order of magnitude slower)
        body.mul_((1.0 / am.clamp(min=_TINY))[:, None]).clamp_(-1, 1)
        codes[s:s + body.numel()] = _nearest(body.reshape(-1), table)
        absmax[s // blocksize:s // blocksize + am.numel()] = am
    if full < n:
        tail = flat[full:].float()
        tail_max = tail.abs().max().clamp(min=_TINY)
        absmax[-1] = tail_max
        codes[full:] = _nearest(torch.clamp(tail / tail_max, -1, 1), table)
    return codes, absmax


_LUT_BINS = 65536


@cache
def _lookup_table(code: tuple[float, ...]) -> torch.Tensor:
    """For each of 65536 even steps across [-1, 1], the index of the nearest code (a step on a midpoint: the lower)."""
    levels = torch.tensor(code, dtype=torch.float32)
    mids = 0.5 * (levels[:-1] + levels[1:])
    steps = -1.0 + (2.0 * torch.arange(_LUT_BINS, dtype=torch.float32)) / (_LUT_BINS - 1)
    return torch.searchsorted(mids, steps).to(torch.uint8)


def _blockwise_by_table(flat: torch.Tensor, blocksize: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes (uint8) and per-block absmax as bitsandbytes' CPU kernel makes them for the absmax values: the
    value × 1/absmax is rounded to one of 65536 steps across [-1, 1] and the step's nearest code taken, so a value
    within half a step of a midpoint between codes can take the farther one; an all-zero block is all code 0."""
    n = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, -n % blocksize)).reshape(-1, blocksize)
    absmax = padded.abs().amax(dim=1)
    inv = torch.where(absmax > 0, 1.0 / absmax, 0.0)   # a zero block's codes are set below
    scaled = torch.clamp(padded * inv[:, None], -1.0, 1.0)
    # truncation, as the C cast; a NaN (from a non-finite weight) takes step 0 and leaves its block's absmax NaN,
    # for the caller to refuse
    step = ((scaled + 1.0) * 0.5 * (_LUT_BINS - 1) + 0.5).nan_to_num_(0.0).to(torch.int64)
    codes = _lookup_table(tuple(table.tolist())).to(flat.device)[step]
    codes[absmax == 0] = 0
    return codes.reshape(-1)[:n], absmax


@dataclass
class Packed4bit:
    """One weight in bitsandbytes' 4-bit layout (the tensors Linear4bit saves, before their key names)."""
    weight: torch.Tensor                        # uint8 (ceil(n / 2), 1): two codes per byte, the first high
    absmax: torch.Tensor                        # float32 per block, or uint8 codes under double quantization
    quant_map: torch.Tensor                     # float32 (16,)
    nested_absmax: torch.Tensor | None = None   # double quantization: float32 per 256 absmax values
    nested_offset: float | None = None          # … and the mean subtracted before coding them

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None


def quantize_4bit(w: torch.Tensor, quant_type: str = "nf4", blocksize: int = 64,
                  double_quant: bool = False) -> Packed4bit:
    """The row-major flattened weight in blocks of `blocksize`, each scaled by its absmax to [-1, 1] and coded by
    the nearest of the 16 levels."""
    if blocksize not in BLOCK_SIZES:
        raise ValueError(f"4-bit block size {blocksize}: expected one of {', '.join(map(str, BLOCK_SIZES))}")
    table = code_table(quant_type)
    codes, absmax = _blockwise(w.reshape(-1), blocksize, table)
    if codes.numel() % 2:   # the last byte's low nibble: the code of 0
        zero = _nearest(torch.zeros(1, device=codes.device), table.to(codes.device)).to(torch.uint8)
        codes = torch.cat([codes, zero])
    packed = ((codes[0::2] << 4) | codes[1::2])[:, None]
    if not double_quant:
        return Packed4bit(packed, absmax, table.to(w.device))
    offset = absmax.mean()
    nested_codes, nested_absmax = _blockwise_by_table(absmax - offset, NESTED_BLOCK, dynamic_map())
    return Packed4bit(packed, nested_codes, table.to(w.device), nested_absmax, offset.item())


def block_scales(p: Packed4bit) -> torch.Tensor:
    """Each block's absmax in float32 (decoded from its 8-bit code under double quantization)."""
    if not p.double_quant:
        return p.absmax
    code = dynamic_map().to(p.absmax.device)[p.absmax.long()]
    per_value = p.nested_absmax.repeat_interleave(NESTED_BLOCK)[:code.numel()]
    return code * per_value + p.nested_offset


def dequantize_4bit(p: Packed4bit, shape: tuple[int, ...], blocksize: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight of `shape`: level × its block's absmax in float32, then cast to `dtype` (bitsandbytes casts to
    the weight's original dtype)."""
    n = 1
    for d in shape:
        n *= d
    packed = p.weight.reshape(-1)
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].long()
    values = p.quant_map[codes]
    scales = block_scales(p).repeat_interleave(blocksize)[:n]
    return (values * scales).reshape(shape).to(dtype)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LLM.int8's weight: per row, SCB = absmax (float32) and CB = round(127 · w / SCB) as int8, from the weight in
    float16 (what bitsandbytes quantizes)."""
    half = w.to(torch.float16)
    scb = torch.empty(half.shape[0], dtype=torch.float32, device=half.device)
    cb = torch.empty(half.shape, dtype=torch.int8, device=half.device)
    rows = max(1, CHUNK // max(1, half.shape[1]))
    for r in range(0, half.shape[0], rows):   # a chunk of rows at a time: the float32 temporaries stay small
        h = half[r:r + rows]
        scb[r:r + rows] = row_max = h.abs().amax(dim=1).float()
        cb[r:r + rows] = h.float().mul_(127.0 / row_max[:, None]).round_()   # float16 × float32 is float32
    return cb, scb


INV_127 = 7.874015718698502e-3   # bitsandbytes multiplies by this reciprocal rather than dividing by 127


def dequantize_int8(cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """CB · SCB · (1/127) in float32, in bitsandbytes' order of operations (so the float32 values are its own)."""
    return cb.float() * scb[:, None] * INV_127
