"""float32 arithmetic exactly as ggml-base's C does it, in torch ops (shared by the block encoders).

ggml-base is compiled without FMA contraction or fast-math, so every C float
operator is one correctly rounded float32 operation; the helpers here make
torch do the same where its defaults differ (division by a scalar, sqrt on the
CPU, nearest_int's magic-number rounding, sequential sums, x86's float->int
conversion and NaN, the C idioms for running maxima).  See encoders.py's
docstring for how the encoders use them.
"""

from __future__ import annotations

import numpy as np
import torch

_F32 = torch.float32


def _f32(v: float) -> float:
    """A Python float rounded like a C float literal."""
    return float(np.float32(v))


def _c(v: float, ref: torch.Tensor) -> torch.Tensor:
    """0-dim float32 constant on ref's device (value rounded like a C float literal)."""
    return torch.tensor(float(np.float32(v)), dtype=_F32, device=ref.device)


def _div(a, b) -> torch.Tensor:
    """IEEE float32 a / b with tensors on both sides (see module docstring)."""
    if not isinstance(a, torch.Tensor):
        a = _c(a, b)
    if not isinstance(b, torch.Tensor):
        b = _c(b, a)
    return torch.div(a, b)


def _recip(a: torch.Tensor) -> torch.Tensor:
    return torch.reciprocal(a)


_MAGIC = 12582912.0        # 1.5 * 2**23: nearest_int's addend


def _nearest_int(f: torch.Tensor) -> torch.Tensor:
    """ggml nearest_int: add 1.5*2^23 in float32 and take the mantissa bits (int32)."""
    # NaN here only comes from invalid operations (inf*0, 0/0) in lanes the C
    # code also evaluates; x86 produces the "default NaN" 0xFFC00000 there, for
    # which the trick yields 0.  GPUs use another canonical NaN, so map NaN to
    # 0 explicitly (infinities are kept: the trick maps them to -0x400000).
    f = torch.nan_to_num(f, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    return ((f + _MAGIC).view(torch.int32) & 0x7FFFFF) - 0x400000


def _ni(f: torch.Tensor) -> torch.Tensor:
    """nearest_int as float32 values (small integers are exact)."""
    return _nearest_int(f).to(_F32)


_SAFE_ROUND = float(2 ** 21)


def _round_ni(f: torch.Tensor, exact: bool) -> torch.Tensor:
    """nearest_int as float32: the bit-exact emulation when some |f| may reach
    2**22 (where the C magic-number trick stops being a rounding), else the
    cheaper torch.round (identical below that)."""
    return _ni(f) if exact else torch.round(f)


def _any_big(bound: torch.Tensor) -> bool:
    """True if some lane may hold |f| >= 2**21 (conservative; NaN counts as big)."""
    return bool((~(bound < _SAFE_ROUND)).any())


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt (sqrtf).  On the CPU: numpy's, the hardware's IEEE instruction.  torch's
    CPU sqrt is not correctly rounded (against numpy's it differed in the last bit for 14.4 M of 84 M random
    float32, and for 0.5 M of 42 M float64; 2026-12-06), so elsewhere: a float64 sqrt rounded to float32,
    its last bit fixed with an exact float64 midpoint test (products of <= 25-bit significands are exact in
    float64)."""
    if v.device.type == "cpu" and v.dtype == _F32:
        with np.errstate(invalid="ignore"):
            return torch.from_numpy(np.asarray(np.sqrt(v.detach().numpy())))
    r = torch.sqrt(v.to(torch.float64)).to(_F32)
    rd = r.to(torch.float64)
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    dn = torch.nextafter(r, torch.zeros_like(r))
    hi = (rd + up.to(torch.float64)) * 0.5
    lo = (rd + dn.to(torch.float64)) * 0.5
    vd = v.to(torch.float64)
    r = torch.where(vd > hi * hi, up, r)
    r = torch.where(vd < lo * lo, dn, r)
    return r


def _f16r(t: torch.Tensor) -> torch.Tensor:
    """GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(t))."""
    return t.to(torch.float16).to(_F32)


def _seqsum_loop(t: torch.Tensor, from_zero: bool = True) -> torch.Tensor:
    """Sequential float32 sum over dim 0: ((0 + t0) + t1) + ... like a C loop."""
    acc = t[0] + 0.0 if from_zero else t[0].clone()
    for j in range(1, t.shape[0]):
        acc.add_(t[j])
    return acc


def _seqsum_index_add(t: torch.Tensor, from_zero: bool = True) -> torch.Tensor:
    """The same sum as one call: on the CPU, index_add_ with every index 0 adds
    the source rows into the output row one after another, each row a single
    float32 add (one op instead of n, which matters for small chunks)."""
    t = t.contiguous()
    if from_zero:
        acc = torch.zeros((1,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    else:
        acc, t = t[:1].clone(), t[1:]
    acc.index_add_(0, _zero_index(t.shape[0], t.device), t)
    return acc[0]


_ZERO_INDEX: dict = {}


def _zero_index(n: int, device) -> torch.Tensor:
    key = (n, str(device))
    idx = _ZERO_INDEX.get(key)
    if idx is None:
        idx = _ZERO_INDEX[key] = torch.zeros(n, dtype=torch.int64, device=device)
    return idx


_INDEX_ADD_SEQUENTIAL: bool | None = None


def _index_add_is_sequential() -> bool:
    """index_add_'s accumulation order is an implementation detail of ATen's CPU
    kernel, so check it once per process on values where any other order or an
    extended-precision accumulator changes the result; fall back to the loop
    when it does not hold."""
    global _INDEX_ADD_SEQUENTIAL
    if _INDEX_ADD_SEQUENTIAL is None:
        g = torch.Generator().manual_seed(12345)
        ok = True
        for shape in ((32, 3, 1037), (16, 4099), (7, 33), (32, 1)):
            mag = torch.pow(10.0, torch.randint(-8, 9, shape, generator=g).to(_F32))
            t = torch.randn(shape, generator=g) * mag
            for fz in (True, False):
                a = _seqsum_loop(t, fz).view(torch.int32)
                b = _seqsum_index_add(t, fz).view(torch.int32)
                ok = ok and torch.equal(a, b)
        _INDEX_ADD_SEQUENTIAL = ok
    return _INDEX_ADD_SEQUENTIAL


def _seqsum(t: torch.Tensor, from_zero: bool = True) -> torch.Tensor:
    """Sequential float32 sum over dim 0 (see _seqsum_loop).  CUDA's index_add_
    uses atomics (any order), so there the loop is used."""
    if t.device.type == "cpu" and t.shape[0] > 2 and _index_add_is_sequential():
        return _seqsum_index_add(t, from_zero)
    return _seqsum_loop(t, from_zero)


def _signed_absmax(x: torch.Tensor):
    """Over dim 0: (amax, max) where max is the first element with the largest |x|
    (the C idiom ``if (ax > amax) { amax = ax; max = x; }`` starting from 0)."""
    amax, idx = x.abs().max(0)          # first index of the largest |x|
    mx = x.gather(0, idx.unsqueeze(0)).squeeze(0)
    mx = torch.where(amax > 0, mx, torch.zeros_like(mx))
    return amax, mx


def _first_min(x: torch.Tensor) -> torch.Tensor:
    """Running ``if (x[i] < min) min = x[i]`` over dim 0: the first of equal
    minima (matters only for the sign of zero).  torch.min(dim) returns the
    index of the first minimal value."""
    idx = x.min(0).indices
    return x.gather(0, idx.unsqueeze(0)).squeeze(0)


def _first_max(x: torch.Tensor) -> torch.Tensor:
    idx = x.max(0).indices
    return x.gather(0, idx.unsqueeze(0)).squeeze(0)


def _pos_max(t: torch.Tensor) -> torch.Tensor:
    """Over dim 0: the C idiom ``m = 0; if (v > m) m = v;`` (+0.0 when nothing is positive)."""
    m = t.amax(0)
    return torch.where(m > 0, m, torch.zeros_like(m))


def _cvt_i32(v: torch.Tensor) -> torch.Tensor:
    """C float -> int conversion as x86 does it (cvttss2si): truncation, and
    INT_MIN for NaN / out-of-range values (GPUs saturate instead)."""
    ok = v.abs() < 2147483648.0
    return torch.where(ok, v, torch.full_like(v, -2147483648.0)).to(torch.int32)


def _u8(t: torch.Tensor) -> torch.Tensor:
    """(uint8_t) conversion of an integer tensor (wraps mod 256)."""
    return t.to(torch.int32) & 0xFF


def _i8(t: torch.Tensor) -> torch.Tensor:
    """(int8_t) conversion of an integer tensor (wraps into [-128, 127])."""
    return ((t.to(torch.int32) + 128) & 0xFF) - 128


def _f16_bytes(t: torch.Tensor) -> torch.Tensor:
    """float32 (m,) -> (2, m) int32 bytes of the ggml fp16 encoding (little-endian)."""
    h = t.to(torch.float16)
    bits = h.view(torch.int16).to(torch.int32) & 0xFFFF
    # ggml's software converter writes NaN as sign|0x7E00 (no data-dependent
    # branch here: this also runs inside fused kernels)
    sign = (t.view(torch.int32) >> 16) & 0x8000
    bits = torch.where(torch.isnan(t), sign | 0x7E00, bits)
    return torch.stack([bits & 0xFF, (bits >> 8) & 0xFF])


def _sub(x: torch.Tensor, n: int) -> torch.Tensor:
    """(bs, nb) super-blocks -> (n, (bs//n)*nb) sub-blocks; column = j*nb + b."""
    bs, nb = x.shape
    return x.view(bs // n, n, nb).permute(1, 0, 2).reshape(n, (bs // n) * nb)


def _unsub(L: torch.Tensor, bs: int, nb: int) -> torch.Tensor:
    """Inverse of _sub: (n, (bs//n)*nb) -> (bs, nb)."""
    n = L.shape[0]
    return L.view(n, bs // n, nb).permute(1, 0, 2).reshape(bs, nb)


def _lround(f: torch.Tensor) -> torch.Tensor:
    """lroundf as int32: to nearest, halves away from zero (f - trunc(f) is exact in float32)."""
    t = torch.trunc(f)
    frac = f - t
    step = (frac >= 0.5).to(torch.int32) - (frac <= -0.5).to(torch.int32)
    return t.to(torch.int32) + step
