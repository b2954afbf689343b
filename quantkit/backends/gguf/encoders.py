"""Vectorized PyTorch GGML block encoders, byte-identical to llama.cpp.

Every encoder works on all blocks of a tensor at once, on whatever device the
input lives on (CPU or CUDA), using plain float32 torch element-wise ops.  The
result for each type is byte-for-byte what ``ggml_quantize_chunk`` writes for
the same float32 input (``imatrix=NULL`` path by default; the importance-matrix
path when ``imatrix`` is given).

How bit-exactness is obtained
-----------------------------
* Each float32 operation is a separate correctly-rounded torch op, written in
  the same association order as the reference C expressions (ggml-base is
  compiled without FMA contraction or fast-math, so the C side does exactly
  one rounding per operator as well).
* Sums over the positions of a block are accumulated sequentially, position by
  position (a Python loop over the 16/32/256 in-block positions, each step a
  vector op across *all* blocks and search candidates), because a tree
  reduction would round differently.
* Divisions are always tensor/tensor (torch may turn ``t / scalar`` into a
  multiplication by the reciprocal on CUDA, and ``scalar / t`` into
  ``reciprocal(t) * scalar`` everywhere); constants that are not exact in
  float32 are produced by float32 torch ops, like the C float literals.
* ``nearest_int`` is reproduced with the same magic-number trick
  (x + 1.5*2**23, reinterpret bits), so it matches even outside its nominal
  range (huge or infinite arguments occur with zero weights or subnormal
  scales); where an argument is provably below 2**21, torch.round is used
  instead (identical there, cheaper).  NaN from invalid operations is mapped
  like x86's default NaN, and C float->int casts follow x86 (cvttss2si), so
  CPU and CUDA give the same bytes as the x86 build of llama.cpp.
* sqrtf is computed correctly rounded (torch's CPU float32 sqrt is not always).
* ``make_qx_quants`` and the IQ4 scale search evaluate all candidate scales in
  parallel, then pick the winner with a short sequential pass over the
  candidates that applies the reference's strict comparisons.  In
  ``make_qkx2/3_quants`` a winning candidate moves the ``min`` that later
  candidates are computed from, so that search runs candidate by candidate
  (each step vectorized over all groups).  The coordinate-descent passes
  (``make_q3_quants``, ``make_qp_quants``) loop over positions, vectorized over
  groups; groups that stopped changing are dropped from later passes.

Block layouts follow ggml-common.h; see docs/formats/gguf.md section 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as _gguf_quants

from .exact import (_div, _recip, _nearest_int, _ni, _sqrt, _f16r, _seqsum, _signed_absmax,
    _first_min, _first_max, _pos_max, _cvt_i32, _u8, _i8, _f16_bytes, _sub, _unsub, _lround, _SAFE_ROUND, _MAGIC)
from .fusion import fused
from .grid_encoders import GRID_ENCODERS, NEEDS_IMATRIX
from .iq1_encoders import IQ1_ENCODERS
from .legacy_rows import ROW_ENCODERS
from .qp_search import make_qp_quants as _make_qp_quants

__all__ = ["quantize", "dequantize", "with_codes", "SUPPORTED", "FUSED_TYPES", "CODE_LAYOUTS"]

QT = GGMLQuantizationType

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset({
    QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS, QT.TQ1_0, QT.TQ2_0,
}) | frozenset(GRID_ENCODERS) | frozenset(IQ1_ENCODERS)

# types whose encoders run fused kernels on the CPU (see fusion.py; the lattice types' neighbour search:
# neighbours.py)
FUSED_TYPES: frozenset[GGMLQuantizationType] = frozenset({QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
                                                         QT.IQ4_NL, QT.IQ4_XS}) | frozenset(GRID_ENCODERS) \
    | frozenset(IQ1_ENCODERS)

_F32 = torch.float32
_GROUP_MAX_EPS = float(np.float32(1e-15))
_KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _pack_nibbles_halves(L: torch.Tensor) -> torch.Tensor:
    """(32*k, nb) -> (16*k, nb): byte j of each 32-group = L[j] | L[j+16] << 4."""
    n, nb = L.shape
    v = L.to(torch.uint8).view(n // 32, 2, 16, nb)      # codes < 16: the bit work on a quarter of the bytes
    return (v[:, 0] | (v[:, 1] << 4)).reshape(n // 2, nb)


def _pack_2bit(L: torch.Tensor) -> torch.Tensor:
    """(256, nb) 2-bit -> (64, nb): qs[32h+l] = sum_k L[128h+32k+l] << 2k."""
    nb = L.shape[1]
    v = L.view(2, 4, 32, nb)
    return (v[:, 0] | (v[:, 1] << 2) | (v[:, 2] << 4) | (v[:, 3] << 6)).reshape(64, nb)


def _bits32(hb: torch.Tensor) -> torch.Tensor:
    """(32, nb) 0/1 -> (4, nb) bytes of a little-endian uint32 with bit j = hb[j]."""
    nb = hb.shape[1]
    v = hb.view(4, 8, nb)
    sh = torch.arange(8, device=hb.device, dtype=torch.int32).view(1, 8, 1)
    return (v << sh).sum(1)


# ----------------------------------------------------------------------------
# search helpers (vectorized over columns = blocks)
# ----------------------------------------------------------------------------

def _qx_pick(sumlx, suml2, iscale, scale, best, isc_sel, first):
    """make_qx_quants' choice: the first candidate, then a later one only when
    strictly better (sumlx^2/suml2 larger).  `first` is a 0-dim bool tensor."""
    q = _div(sumlx, suml2)
    scale0 = torch.where(suml2 != 0, q, torch.zeros_like(q))
    upd = (suml2 > 0) & (sumlx * sumlx > best * suml2)
    scale1 = torch.where(upd, q, scale)
    return (torch.where(first, scale0, scale1),
            torch.where(first, scale0 * sumlx, torch.where(upd, scale1 * sumlx, best)),
            torch.where(first, iscale, torch.where(upd, iscale, isc_sel)))


def _qx_candidate_vec(x, w, wx, mx, num, nmax, scale, best, isc_sel, first):
    """_qx_candidate over all positions at once (the eager formulation)."""
    iscale = _div(num, mx)
    l = torch.mul(x, iscale).round_().clamp_(min=-nmax)
    l = torch.minimum(l, nmax - 1, out=l)
    t = torch.empty((x.shape[0], 2) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    torch.mul(wx, l, out=t[:, 0])
    torch.mul(w, l, out=t[:, 1]).mul_(l)                           # (w * l) * l
    sums = _seqsum(t, from_zero=False)
    return _qx_pick(sums[0], sums[1], iscale, scale, best, isc_sel, first)


def _qx_candidate(x, w, wx, mx, num, nmax, scale, best, isc_sel, first):
    """One candidate scale of make_qx_quants, position by position (x, w, wx:
    (n, m); the rest (m,) or 0-dim).  Returns the updated (scale, best, isc_sel):
    the reference keeps the first candidate, then takes a later one only when
    it is strictly better (sumlx^2/suml2 larger)."""
    iscale = _div(num, mx)
    sumlx = suml2 = None
    for xj, wj, wxj in zip(x.unbind(0), w.unbind(0), wx.unbind(0)):
        # |iscale*x| <= nmax + 1 here, so plain rounding equals nearest_int
        lj = torch.round(xj * iscale).clamp(min=-nmax).minimum(nmax - 1)
        a, b = wxj * lj, (wj * lj) * lj
        sumlx, suml2 = (a, b) if sumlx is None else (sumlx + a, suml2 + b)
    return _qx_pick(sumlx, suml2, iscale, scale, best, isc_sel, first)


def _qx_search_vec(x, w, wx, mx, nums, nmax, scale, best, isc_sel, first):
    """_qx_search step by step over all positions at once (the eager formulation)."""
    later = torch.zeros_like(first)
    for c in range(nums.shape[0]):
        scale, best, isc_sel = _qx_candidate_vec(x, w, wx, mx, nums[c], nmax, scale, best, isc_sel,
                                                 first if c == 0 else later)
    return scale, best, isc_sel


@fused(eager=_qx_search_vec)
def _qx_search(x, w, wx, mx, nums, nmax, scale, best, isc_sel, first):
    """A run of make_qx_quants' candidates (one _qx_candidate per entry of nums, in turn; `first` for the
    run's first) as one function, so that a kernel reads a group's values once per run: one by one the
    candidates were memory-bound (Q6_K: 0.09 s of an 8960 x 1536 tensor's 0.24 s)."""
    later = torch.zeros_like(first)
    for c in range(nums.shape[0]):
        scale, best, isc_sel = _qx_candidate(x, w, wx, mx, nums[c], nmax, scale, best, isc_sel,
                                             first if c == 0 else later)
    return scale, best, isc_sel


def _make_qx_quants(x: torch.Tensor, nmax: int, w: torch.Tensor | None):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw=w).  x: (n, m).
    Returns (scale (m,), L (n, m) float32 holding l + nmax, or 0 for all-zero groups)."""
    amax, mx = _signed_absmax(x)
    zero = amax < _GROUP_MAX_EPS
    if w is None:
        w = x * x
    wx = w * x
    # candidate numerators: is = 0 (base) then -9..9 without 0.  The base goes in twice, so that the 19
    # candidates make 4 runs of 5 for one kernel: the second is a no-op, as a candidate evaluated again
    # against the state it left (taken or not) leaves it as it is
    iss = torch.tensor([i for i in range(-9, 10) if i != 0], dtype=_F32)
    nums = torch.cat([torch.tensor([-float(nmax)] * 2, dtype=_F32),
                      -(torch.tensor(float(nmax), dtype=_F32) + torch.tensor(0.1, dtype=_F32) * iss)])
    nums = nums.to(x.device)
    nmax_t = torch.tensor(float(nmax), device=x.device)
    state = tuple(torch.zeros_like(mx) for _ in range(3))     # distinct tensors: no aliasing guards
    is_first = (torch.tensor(True, device=x.device), torch.tensor(False, device=x.device))
    run = max(k for k in range(1, _SEARCH_RUN + 1) if nums.shape[0] % k == 0)     # 20 candidates: 4 runs of 5
    for c in range(0, nums.shape[0], run):
        state = _qx_search(x, w, wx, mx, nums[c:c + run], nmax_t, *state, is_first[c > 0])
    scale, _, isc_sel = state
    # the winner's L again (same ops => same values)
    L = torch.mul(x, isc_sel).round_().clamp_(-nmax, nmax - 1).add_(nmax)
    if bool(zero.any()):
        L.masked_fill_(zero.unsqueeze(0), 0)
        scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale, L


def _q3_start_vec(x, nmax):
    """_q3_start over all positions at once (the eager formulation)."""
    amax, mx = _signed_absmax(x)
    zero = amax < _GROUP_MAX_EPS
    iscale = torch.where(zero, torch.zeros_like(mx), _div(-nmax, mx))
    L = torch.round(iscale * x).clamp(min=-nmax).minimum(nmax - 1)
    w = x * x
    sums = _seqsum(torch.stack([(w * x) * L, (w * L) * L], 1), from_zero=False)
    return zero, L, sums[0], sums[1]


@fused(eager=_q3_start_vec)
def _q3_start(x, nmax):
    """The start of make_q3_quants, position by position (x: (n, m)): the
    all-zero groups, the levels of the grid through the largest |x| (n, m)
    and their sums.  Zero groups get iscale 0 (their output is zeroed anyway)."""
    xs = x.unbind(0)
    amax = mx = torch.zeros_like(xs[0])
    for xj in xs:
        ax = xj.abs()
        bigger = ax > amax
        amax = torch.where(bigger, ax, amax)
        mx = torch.where(bigger, xj, mx)
    zero = amax < _GROUP_MAX_EPS
    iscale = torch.where(zero, torch.zeros_like(mx), _div(-nmax, mx))
    rows, sumlx, suml2 = [], None, None
    for xj in xs:
        # |iscale*x| <= nmax here, so plain rounding equals nearest_int
        lj = torch.round(iscale * xj).clamp(min=-nmax).minimum(nmax - 1)
        rows.append(lj)
        wj = xj * xj
        a, b = (wj * xj) * lj, (wj * lj) * lj
        sumlx, suml2 = (a, b) if sumlx is None else (sumlx + a, suml2 + b)
    return zero, torch.stack(rows), sumlx, suml2


@fused
def _q3_pass(x, L, sumlx, suml2, nmax):
    """One coordinate-descent pass of make_q3_quants over the positions of each
    group (x, L: (n, m)).  Returns (L, sumlx, suml2, changed)."""
    rows = []
    changed = None
    for xi, Li in zip(x.unbind(0), L.unbind(0)):
        wi = xi * xi
        wxi = wi * xi
        slx = sumlx - wxi * Li
        sl2 = suml2 - (wi * Li) * Li
        new_l = _nearest_int(_div(xi * sl2, slx)).clamp(-nmax, nmax - 1).to(_F32)
        slx_n = slx + wxi * new_l
        sl2_n = sl2 + (wi * new_l) * new_l
        acc = ((slx > 0) & (new_l != Li) & (sl2_n > 0)
               & ((slx_n * slx_n) * suml2 > (sumlx * sumlx) * sl2_n))
        rows.append(torch.where(acc, new_l, Li))
        sumlx = torch.where(acc, slx_n, sumlx)
        suml2 = torch.where(acc, sl2_n, suml2)
        changed = acc if changed is None else changed | acc
    return torch.stack(rows), sumlx, suml2, changed


def _make_q3_quants(x: torch.Tensor, nmax: int):
    """make_q3_quants(n, nmax, x, L, do_rmse=true).  x: (n, m)."""
    zero, L, sumlx, suml2 = _q3_start(x, torch.tensor(float(nmax), device=x.device))
    # Coordinate descent, up to 5 passes.  A pass that changes nothing in a
    # group leaves its state untouched, so every later pass is a no-op for it:
    # after each pass only the groups that changed are carried on (compacted);
    # the kernel takes any number of groups.
    act = None
    for _ in range(5):
        if act is None:
            xa, La, slx_a, sl2_a = x, L, sumlx, suml2
        else:
            xa, La = x[:, act], L[:, act]
            slx_a, sl2_a = sumlx[act], suml2[act]
        La, slx_a, sl2_a, changed = _q3_pass(xa, La, slx_a, sl2_a, nmax)
        if act is None:
            L, sumlx, suml2 = La, slx_a, sl2_a
            act = torch.nonzero(changed).squeeze(1)
        else:
            L[:, act] = La
            sumlx[act] = slx_a
            suml2[act] = sl2_a
            act = act[changed]
        if act.numel() == 0:
            break
    scale = torch.where(suml2 > 0, _div(sumlx, suml2), torch.zeros_like(sumlx))
    L = L.add_(nmax)            # in place: L is this function's own
    if bool(zero.any()):
        L.masked_fill_(zero.unsqueeze(0), 0)
        scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale, L


def _qkx_scale_min(sum_w, sum_x, sum_l, sum_l2, sum_xl):
    """make_qkx's weighted least-squares scale and min for given levels (min <= 0)."""
    D = sum_w * sum_l2 - sum_l * sum_l
    this_scale = _div(sum_w * sum_xl - sum_x * sum_l, D)
    this_min = _div(sum_l2 * sum_x - sum_l * sum_xl, D)
    pos = this_min > 0
    this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
    this_scale = torch.where(pos, _div(sum_xl, sum_l2), this_scale)
    return D, this_scale, this_min


def _qkx_take(D, err, this_scale, this_min, isc, best, scale, isc_w, cur_w, won, cur, big):
    upd = (D > 0) & (err < best)
    return (torch.where(upd, err, best), torch.where(upd, this_scale, scale),
            torch.where(upd, isc, isc_w), torch.where(upd, cur, cur_w), won | upd,
            torch.where(upd, this_min, cur), big)


def _qkx_isc_big(num, mx, cur, xmin, degenerate):
    isc = _div(num, mx - cur)
    # cur (a least-squares min) can lie above the smallest x when weights
    # vanish, making isc*(x-cur) huge: then emulate nearest_int exactly.
    bound = isc.abs() * torch.maximum((xmin - cur).abs(), (mx - cur).abs())
    return isc, (~(bound < _SAFE_ROUND)) & ~degenerate    # per lane: reducing would split the kernel


def _qkx_candidate_vec(x, w, xmin, mx, degenerate, sum_w, sum_x, nmax, num,
                       best, scale, isc_w, cur_w, won, cur, use_mad: bool, exact: bool):
    """_qkx_candidate over all positions at once (the eager formulation)."""
    isc, big = _qkx_isc_big(num, mx, cur, xmin, degenerate)
    f = torch.sub(x, cur).mul_(isc)
    # in place where possible: each full-chunk temporary is a fresh allocation and its page faults
    la = _levels_(_ni(f) if exact else f.round_(), nmax)
    wl = w * la
    t = wl * la
    sum_l, sum_l2 = _seqsum(wl, from_zero=False), _seqsum(t, from_zero=False)
    sum_lx = _seqsum(torch.mul(wl, x, out=t), from_zero=False)
    D, this_scale, this_min = _qkx_scale_min(sum_w, sum_x, sum_l, sum_l2, sum_lx)
    diff = la.mul_(this_scale).add_(this_min).sub_(x)             # la * scale + min - x
    err = _seqsum((diff.abs_() if use_mad else diff.mul_(diff)).mul_(w), from_zero=False)
    return _qkx_take(D, err, this_scale, this_min, isc, best, scale, isc_w, cur_w, won, cur, big)


def _qkx_candidate(x, w, xmin, mx, degenerate, sum_w, sum_x, nmax, num,
                   best, scale, isc_w, cur_w, won, cur, use_mad: bool, exact: bool):
    """One candidate of make_qkx2/3_quants' search, position by position
    (x, w: (n, m); everything else (m,) or 0-dim).  Returns the updated
    (best, scale, isc_w, cur_w, won, cur) and which lanes needed the exact
    nearest_int (if any did, the caller re-runs the step with exact=True)."""
    isc, big = _qkx_isc_big(num, mx, cur, xmin, degenerate)
    ls = []
    sum_l = sum_l2 = sum_xl = None
    for xj, wj in zip(x.unbind(0), w.unbind(0)):
        f = (xj - cur) * isc
        lj = _levels(_ni(f) if exact else torch.round(f), nmax)
        ls.append(lj)
        wl = wj * lj
        if sum_l is None:
            sum_l, sum_l2, sum_xl = wl, wl * lj, wl * xj
        else:
            sum_l, sum_l2, sum_xl = sum_l + wl, sum_l2 + wl * lj, sum_xl + wl * xj
    D, this_scale, this_min = _qkx_scale_min(sum_w, sum_x, sum_l, sum_l2, sum_xl)
    err = None
    for xj, wj, lj in zip(x.unbind(0), w.unbind(0), ls):
        diff = lj * this_scale + this_min - xj
        e = (diff.abs() if use_mad else diff * diff) * wj
        err = e if err is None else err + e
    return _qkx_take(D, err, this_scale, this_min, isc, best, scale, isc_w, cur_w, won, cur, big)


_SEARCH_RUN = 8


def _qkx_search_vec(x, w, xmin, mx, degenerate, sum_w, sum_x, nmax, nums,
                    best, scale, isc_w, cur_w, won, cur, use_mad: bool):
    """_qkx_search step by step over all positions at once (the eager formulation)."""
    state, big = (best, scale, isc_w, cur_w, won, cur), torch.zeros_like(won)
    for c in range(nums.shape[0]):
        *state, flagged = _qkx_candidate_vec(x, w, xmin, mx, degenerate, sum_w, sum_x, nmax, nums[c], *state,
                                             use_mad, False)
        big = big | flagged
    return (*state, big)


@fused(eager=_qkx_search_vec)
def _qkx_search(x, w, xmin, mx, degenerate, sum_w, sum_x, nmax, nums,
                best, scale, isc_w, cur_w, won, cur, use_mad: bool):
    """A run of make_qkx2/3_quants' candidates (one _qkx_candidate per entry of nums, in turn) as one
    function, so that a kernel reads a block's values once per run rather than once per candidate (the steps
    one by one were memory-bound).  The last output: the lanes where any step needed the exact nearest_int;
    the caller then replays the steps one by one."""
    state, big = (best, scale, isc_w, cur_w, won, cur), None
    for c in range(nums.shape[0]):
        *state, flagged = _qkx_candidate(x, w, xmin, mx, degenerate, sum_w, sum_x, nmax, nums[c], *state,
                                         use_mad, False)
        big = flagged if big is None else big | flagged
    return (*state, big)


def _levels(r: torch.Tensor, nmax: torch.Tensor) -> torch.Tensor:
    """MAX(0, MIN(nmax, l)) for rounded values r.  Written so that a zero is
    always +0.0 and NaN gives 0 (as nearest_int's trick does): clamp would
    keep -0.0 where a compiled max may not, and the fused kernels must equal
    the eager ones bit for bit."""
    return torch.where(r > 0, r, torch.zeros_like(r)).minimum(nmax)


def _levels_(r: torch.Tensor, nmax: torch.Tensor) -> torch.Tensor:
    """_levels in place (the eager formulations: fewer full-chunk temporaries)."""
    return torch.minimum(r.masked_fill_(~(r > 0), 0.0), nmax, out=r)


def _qkx_init_vec(x, w, nmax, use_mad: bool, exact: bool = False):
    """_qkx_init over all positions at once (the eager formulation); exact=True
    emulates nearest_int exactly (for the rare lanes _qkx_init flags)."""
    xmin, mx = _first_min(x), _first_max(x)
    sum_w = _seqsum(w, from_zero=False)
    sum_x = _seqsum(w * x, from_zero=False)
    mn = torch.where(xmin > 0, torch.zeros_like(xmin), xmin)
    degenerate = mx <= mn
    iscale = _div(nmax, mx - mn)
    scale = _recip(iscale)
    big = ~(iscale.abs() * (mx - mn) < _SAFE_ROUND) & ~degenerate
    f = iscale * (x - mn)
    L = _levels(_ni(f) if exact else torch.round(f), nmax)
    diff = scale * L + mn - x
    best = _seqsum(w * (diff.abs() if use_mad else diff * diff), from_zero=False)
    return xmin, mx, sum_w, sum_x, mn, degenerate, scale, best, L, big


@fused(eager=_qkx_init_vec)
def _qkx_init(x, w, nmax, use_mad: bool):
    """The start of make_qkx2/3_quants, position by position (x, w: (n, m)):
    min (the first smallest x), max, sum_w, sum_x, the min clamped to <= 0,
    the plain min/max grid's levels L0 (n, m), its scale and weighted error,
    and the lanes whose levels need the exact nearest_int (an iscale that
    overflowed for a subnormal range; the caller then re-runs eagerly with
    exact levels)."""
    xs, ws = x.unbind(0), w.unbind(0)
    xmin, mx, sum_w, sum_x = xs[0], xs[0], ws[0], ws[0] * xs[0]
    for xj, wj in zip(xs[1:], ws[1:]):
        xmin = torch.where(xj < xmin, xj, xmin)
        mx = torch.where(xj > mx, xj, mx)
        sum_w = sum_w + wj
        sum_x = sum_x + wj * xj
    mn = torch.where(xmin > 0, torch.zeros_like(xmin), xmin)
    degenerate = mx <= mn
    iscale = _div(nmax, mx - mn)
    scale = _recip(iscale)
    big = ~(iscale.abs() * (mx - mn) < _SAFE_ROUND) & ~degenerate
    rows, best = [], None
    for xj, wj in zip(xs, ws):
        lj = _levels(torch.round(iscale * (xj - mn)), nmax)
        rows.append(lj)
        diff = scale * lj + mn - xj
        e = wj * (diff.abs() if use_mad else diff * diff)
        best = e if best is None else best + e
    return xmin, mx, sum_w, sum_x, mn, degenerate, scale, best, torch.stack(rows), big


def _qkx_levels_vec(x, isc, cur, nmax, exact: bool = False):
    """_qkx_levels over all positions at once (the eager formulation); exact=True
    emulates nearest_int exactly (for the lanes _qkx_levels flags)."""
    bound = isc.abs() * torch.maximum((x - cur).abs().amax(0), torch.zeros_like(cur))
    f = (x - cur) * isc
    return _levels(_ni(f) if exact else torch.round(f), nmax), ~(bound < _SAFE_ROUND)


@fused(eager=_qkx_levels_vec)
def _qkx_levels(x, isc, cur, nmax):
    """Levels clamp(nearest_int(isc * (x - cur)), 0, nmax) (x: (n, m)), and
    the lanes where rounding must be emulated exactly (|argument| may reach 2**21)."""
    bound = isc.abs() * torch.maximum((x - cur).abs().amax(0), torch.zeros_like(cur))
    rows = [_levels(torch.round((xj - cur) * isc), nmax) for xj in x.unbind(0)]
    return torch.stack(rows), ~(bound < _SAFE_ROUND)


def _make_qkx_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float,
                     nstep: int, use_mad: bool):
    """make_qkx2_quants / make_qkx3_quants (identical once weights are explicit).
    x, w: (n, m).  Returns (scale (m,), the_min (m,) = -min >= 0, L (n, m) float32)."""
    nmax_t = torch.tensor(float(nmax), device=x.device)
    init = _qkx_init(x, w, nmax_t, use_mad)
    if bool(init[-1].any()):
        init = _qkx_init_vec(x, w, nmax_t, use_mad, exact=True)
    xmin, mx, sum_w, sum_x, mn, degenerate, scale, best, L = init[:9]

    # The reference overwrites `min` whenever a candidate wins, and later
    # candidates are computed relative to that updated min: the search is
    # inherently sequential over candidates (vectorized over groups here).
    ist = torch.arange(nstep + 1, dtype=_F32)
    nums = (torch.tensor(rmin, dtype=_F32) + torch.tensor(rdelta, dtype=_F32) * ist) + float(nmax)
    nums = nums.to(x.device)
    state = (best, scale, torch.zeros_like(mx), torch.zeros_like(mx), torch.zeros_like(degenerate), mn)
    fixed = (x, w, xmin, mx, degenerate, sum_w, sum_x, nmax_t)
    # the candidates in equal runs of at most _SEARCH_RUN: one kernel per type serves every run, and a kernel of
    # the whole search (21 steps) took 5 min to build for a 1.3x faster Q4_K than one of a single step
    run = max(k for k in range(1, _SEARCH_RUN + 1) if (nstep + 1) % k == 0)
    searched, exact = state, False
    for c in range(0, nstep + 1, run):
        *searched, flagged = _qkx_search(*fixed, nums[c:c + run], *searched, use_mad)
        if bool(flagged.any()):
            exact = True
            break
    if not exact:
        state = tuple(searched)
    else:       # a lane's rounding must be emulated exactly at some step: replay the steps, exactly where needed
        for c in range(nstep + 1):
            new = _qkx_candidate_vec(*fixed, nums[c], *state, use_mad, False)
            if bool(new[-1].any()):
                new = _qkx_candidate_vec(*fixed, nums[c], *state, use_mad, True)
            state = new[:-1]
    best, scale, isc_w, cur_w, won, cur = state
    # rebuild the winning candidate's L (same ops => same values)
    la, big = _qkx_levels(x, isc_w, cur_w, nmax_t)
    if bool((big & won).any()):
        la, _ = _qkx_levels_vec(x, isc_w, cur_w, nmax_t, exact=True)
    L = torch.where(won.unsqueeze(0), la, L, out=la)        # la is this call's own: no new buffer
    mn_best = cur
    if bool(degenerate.any()):
        L.masked_fill_(degenerate.unsqueeze(0), 0)
        scale = torch.where(degenerate, torch.zeros_like(scale), scale)
        mn_best = torch.where(degenerate, mn, mn_best)
    return scale, -mn_best, L


# IQ4 codebook lookup -------------------------------------------------------

_IQ4_TAB_CACHE: dict = {}


def _iq4_tables(dev):
    """Codebook plus, for every integer cell [i, i+1) with i in -128..127, the
    neighbours (lo, hi) = (v[mu-1], v[mu]) where mu = #codebook values <= x
    (clamped to 1..15) -- constant over the cell because the values are integers."""
    key = str(dev)
    t = _IQ4_TAB_CACHE.get(key)
    if t is None:
        v = np.array(_KVALUES_IQ4NL, dtype=np.float32)
        cells = np.arange(-128, 128)
        mu = np.clip((v[None, :] <= cells[:, None]).sum(1), 1, 15)
        vals = torch.tensor(v, device=dev)
        lo = torch.tensor(v[mu - 1], device=dev)
        hi = torch.tensor(v[mu], device=dev)
        mut = torch.tensor(mu, dtype=torch.int64, device=dev)
        t = (vals, lo, hi, mut)
        _IQ4_TAB_CACHE[key] = t
    return t


def _best_index_iq4(al: torch.Tensor, tabs, want_index: bool):
    """best_index_int8(16, kvalues_iq4nl, al): index (int64) or the codebook value.
    Same decision as the reference: (al - lo) < (hi - al) in float32 picks lo."""
    _, lo_t, hi_t, mu_t = tabs
    # cell = floor(al) + 128.  (al + 128 may round up to the next integer when
    # al is just below it; that only changes the cell when the integer is a
    # codebook value v, and then both cells give v.)  Truncation == floor
    # after clamping to >= 0; NaN (masked lanes only) is mapped to cell 0.
    cell = (al + 128.0).nan_to_num_(nan=0.0).clamp_(0, 255).to(torch.int64)
    lo = torch.take(lo_t, cell)
    hi = torch.take(hi_t, cell)
    pick_lo = torch.sub(al, lo) < torch.sub(hi, al)
    if want_index:
        return torch.take(mu_t, cell) - pick_lo.to(torch.int64)
    return hi.add_((lo - hi).mul_(pick_lo))


def _iq4_pick(al: torch.Tensor, lo_t: torch.Tensor, hi_t: torch.Tensor) -> torch.Tensor:
    """best_index_int8's codebook value for al (see _best_index_iq4)."""
    cell = (al + 128.0).nan_to_num(nan=0.0).clamp(0, 255).to(torch.int64)
    lo, hi = torch.take(lo_t, cell), torch.take(hi_t, cell)
    return torch.where(torch.sub(al, lo) < torch.sub(hi, al), lo, hi)


def _iq4_take(sumqx, sumq2, d, best, first):
    """quantize_row_iq4_nl_impl's choice: the base candidate's scale (0 unless
    sumq2 > 0), then a later one only when strictly better.  `first`: 0-dim bool."""
    r = _div(sumqx, sumq2)
    pos = sumq2 > 0
    d0 = torch.where(pos, r, torch.zeros_like(r))
    upd = pos & (sumqx * sumqx > best * sumq2)
    d_new = torch.where(first, d0, torch.where(upd, r, d))
    return d_new, torch.where(first | upd, d_new * sumqx, best)


def _iq4_candidate_vec(x, w, lo_t, hi_t, idc, d, best, first):
    """_iq4_candidate over all positions at once (the eager formulation)."""
    q = _iq4_pick(idc * x, lo_t, hi_t)
    wq = w * q
    sums = _seqsum(torch.stack([wq * x, wq * q], 1))      # the C sums start at +0
    return _iq4_take(sums[0], sums[1], d, best, first)


@fused(eager=_iq4_candidate_vec)
def _iq4_candidate(x, w, lo_t, hi_t, idc, d, best, first):
    """One candidate inverse scale `idc` (m,) of the IQ4 scale search, position by
    position (x, w: (32, m)).  Returns the updated (d, best)."""
    sumqx = sumq2 = None
    for xj, wj in zip(x.unbind(0), w.unbind(0)):
        q = _iq4_pick(idc * xj, lo_t, hi_t)
        wq = wj * q
        a, b = wq * xj, wq * q
        sumqx, sumq2 = (a, b) if sumqx is None else (sumqx + a, sumq2 + b)
    # the C sums start at +0 and so are never -0; without that leading 0 an
    # all-zero sum could be -0 (w*q*q is never -0)
    sumqx = torch.where(sumqx == 0, torch.zeros_like(sumqx), sumqx)
    return _iq4_take(sumqx, sumq2, d, best, first)


def _iq4_block_scales(x: torch.Tensor, w: torch.Tensor, tabs, ntry: int = 7):
    """Per-32 scale search of quantize_row_iq4_nl_impl.  x, w: (32, m) -> d (m,)."""
    _, lo_t, hi_t, _ = tabs
    amax, mx = _signed_absmax(x)
    zero = amax < _GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)   # all-zero groups are masked below
    d0 = _div(-mx, -127.0)                       # -max / values[0]
    is_first = (torch.tensor(True, device=x.device), torch.tensor(False, device=x.device))
    state = (torch.zeros_like(mx), torch.zeros_like(mx))      # (d, best); distinct tensors
    state = _iq4_candidate(x, w, lo_t, hi_t, _recip(d0), *state, is_first[0])
    for itry in range(-ntry, ntry + 1):          # id = (itry + values[0]) / max
        num = torch.tensor(float(itry - 127), dtype=_F32, device=x.device)
        state = _iq4_candidate(x, w, lo_t, hi_t, _div(num, mx), *state, is_first[1])
    d = state[0]
    return torch.where(zero, torch.zeros_like(d), d)


# ----------------------------------------------------------------------------
# per-type encoders: x is (block_size, nb) float32, returns (type_size, nb) int32
# ----------------------------------------------------------------------------

def _enc_q8_0(x, qw, ctx):
    amax = x.abs().amax(0)
    d = _div(amax, 127.0)
    idd = torch.where(d != 0, _recip(d), torch.zeros_like(d))
    v = x * idd
    # roundf: half away from zero
    t = torch.trunc(v)
    frac = (v - t).abs()
    r = torch.where(frac >= 0.5, t + torch.sign(v), t)
    q = _i8(_cvt_i32(r)) & 0xFF
    return torch.cat([_f16_bytes(d), q])


def _enc_q4_0(x, qw, ctx):
    if qw is not None:
        w = qw * _sqrt(ctx["sigma2"].unsqueeze(0) + x * x)
        d, L = _make_qx_quants(x, 8, w)
        Li = L.to(torch.int32)
        return torch.cat([_f16_bytes(d), _pack_nibbles_halves(Li)])
    _, mx = _signed_absmax(x)
    d = _div(mx, -8.0)
    idd = torch.where(d != 0, _recip(d), torch.zeros_like(d))
    q = _i8(_cvt_i32(x * idd + 8.5)).clamp(max=15) & 0xFF
    return torch.cat([_f16_bytes(d), _pack_nibbles_halves(q)])


def _enc_q5_0(x, qw, ctx):
    if qw is not None:
        w = qw * _sqrt(ctx["sigma2"].unsqueeze(0) + x * x)
        d, L = _make_qx_quants(x, 16, w)
        q = L.to(torch.int32)
    else:
        _, mx = _signed_absmax(x)
        d = _div(mx, -16.0)
        idd = torch.where(d != 0, _recip(d), torch.zeros_like(d))
        q = _i8(_cvt_i32(x * idd + 16.5)).clamp(max=31) & 0xFF
    return torch.cat([_f16_bytes(d), _pack_5bit_halves(q)])


def _scale_min_codes(x, qw, ctx, nmax: int, to_code):
    """Q4_1/Q5_1: (scale, minimum, codes).  With an importance matrix, llama.cpp's weighted search;
    without, min/max over the block, and `to_code` applies the type's own C integer conversion."""
    if qw is not None:
        w = qw * _sqrt(ctx["sigma2"].unsqueeze(0) + x * x)
        d, the_min, L = _make_qkx_quants(x, w, nmax, -0.9, 0.05, 36, False)
        return d, -the_min, L.to(torch.int32)
    mn = _first_min(x)
    mx = _first_max(x)
    d = _div(mx - mn, float(nmax))
    idd = torch.where(d != 0, _recip(d), torch.zeros_like(d))
    return d, mn, to_code(_cvt_i32((x - mn) * idd + 0.5))


def _enc_q4_1(x, qw, ctx):
    d, m, q = _scale_min_codes(x, qw, ctx, 15, lambda c: _i8(c).clamp(max=15) & 0xFF)
    return torch.cat([_f16_bytes(d), _f16_bytes(m), _pack_nibbles_halves(q)])


def _enc_q5_1(x, qw, ctx):
    d, m, q = _scale_min_codes(x, qw, ctx, 31, _u8)
    return torch.cat([_f16_bytes(d), _f16_bytes(m), _pack_5bit_halves(q)])


def _sumsq_seq(x):
    return _seqsum(x * x)


def _enc_q2_k(x, qw, ctx):
    nb = x.shape[1]
    xs = _sub(x, 16)                                        # (16, 16*nb)
    if qw is None:
        w = xs.abs()
        sc, mins, L = _make_qkx_quants(xs, w, 3, -0.5, 0.1, 15, True)
        scales = sc.view(16, nb)
        mins = mins.view(16, nb)
        max_scale = _pos_max(scales)
        max_min = _pos_max(mins)
        has_s = max_scale > 0
        ls = _u8(_nearest_int(_div(15.0, max_scale).unsqueeze(0) * scales))
        ls = torch.where(has_s.unsqueeze(0), ls, torch.zeros_like(ls))
        d = _div(max_scale, 15.0)
        has_m = max_min > 0
        lm = _nearest_int(_div(15.0, max_min).unsqueeze(0) * mins)
        sbyte = _u8(ls | torch.where(has_m.unsqueeze(0), lm << 4, torch.zeros_like(lm)))
        dmin = _div(max_min, 15.0)
    else:
        sigma2 = _div(_sumsq_seq(x), 256.0)                 # (nb,)
        s2 = sigma2.repeat(16)                               # column j*nb+b -> b
        w = _sub(qw, 16) * _sqrt(s2.unsqueeze(0) + xs * xs)
        sw = _seqsum(w).view(16, nb)
        sc, mins, L = _make_qkx_quants(xs, w, 3, -0.9, 0.05, 36, False)
        d, Ls = _make_qp_quants(sc.view(16, nb), 15, sw)
        dmin, Lm = _make_qp_quants(mins.view(16, nb), 15, sw)
        sbyte = _u8(Ls.to(torch.int32) | (Lm.to(torch.int32) << 4))
    return _q2_finish(x, d, dmin, sbyte, L)


def _q2_finish(x, d, dmin, sbyte, L):
    """Q2_K after the search: re-quantize every value with its block's
    fp16-rounded scale and min, and pack.  x: (256, nb); d, dmin: (nb,);
    sbyte: (16, nb) scale | min << 4; L: the search's codes as (16, 16 * nb) sub-blocks."""
    dq = _f16r(d).unsqueeze(0) * (sbyte & 0xF).to(_F32)          # (16, nb)
    dm = _f16r(dmin).unsqueeze(0) * (sbyte >> 4).to(_F32)
    codes = _requantized(x, dq, 0, 3, dm=dm, keep=L).to(torch.uint8)     # the bit work on a quarter of the bytes
    return torch.cat([sbyte, _pack_2bit(codes), _f16_bytes(d), _f16_bytes(dmin)])


def _pack_q3_scales(s):
    """s: (16, nb) int 0..63 -> (12, nb)."""
    low = (s[:8] & 0xF) | ((s[8:] & 0xF) << 4)
    hi = (s >> 4) & 3
    hv = hi.view(4, 4, -1)           # [k, i] -> j = 4k + i
    high = hv[0] | (hv[1] << 2) | (hv[2] << 4) | (hv[3] << 6)
    return torch.cat([low, high])


def _enc_q3_k(x, qw, ctx):
    nb = x.shape[1]
    xs = _sub(x, 16)
    if qw is None:
        sc, L = _make_q3_quants(xs, 4)
        scales = sc.view(16, nb)
        _, max_scale = _signed_absmax(scales)
        nz = max_scale != 0
        iscale = _div(-32.0, max_scale)
        l = _i8(_nearest_int(iscale.unsqueeze(0) * scales)).clamp(-32, 31) + 32
        s = torch.where(nz.unsqueeze(0), l, torch.zeros_like(l))
        d = torch.where(nz, _recip(iscale), torch.zeros_like(iscale))
    else:
        sigma2 = _div(2 * _sumsq_seq(x), 256.0)
        s2 = sigma2.repeat(16)
        w = _sub(qw, 16) * _sqrt(s2.unsqueeze(0) + xs * xs)
        sw = _seqsum(w).view(16, nb)
        sc, L = _make_qx_quants(xs, 4, w)
        d, Ls = _make_qx_quants(sc.view(16, nb), 32, sw)
        s = Ls.to(torch.int32)
    return _q3_finish(x, d, s, L)


def _requantized(x: torch.Tensor, dq: torch.Tensor, lo: int, hi: int, dm: torch.Tensor | None = None,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
    """The K-quants' last step: clamp(nearest_int((x + dm) / dq), lo, hi) - lo as int32 (256, nb) codes, for x
    (256, nb) and per-sub-block scales dq and minimums dm (g, nb); where dq is 0, the search's codes `keep`
    ((256 / g, g * nb) sub-blocks, as the search left them) stay.  In place on one buffer: nearest_int's
    magic-number bits, then the clamp on the integers.  Not fused: as kernels, Inductor recomputed each code for
    every byte it went into, which made these steps 2x slower than the eager ops (Q4_K's: 0.94 against 0.48 ms
    on 1024 blocks; Q6_K's 0.081 against ~0.045 s on an 8960 x 1536 tensor, 2026-12-05).  x is finite, so where
    dq is not 0 a NaN comes only from an fp16 overflow of the scale (inf * 0), the x86 default NaN, whose bits
    give 0 as C's do (a GPU's canonical NaN would not: there it is mapped to 0 first, as _nearest_int does)."""
    g, nb = dq.shape
    X = x.view(g, 256 // g, nb)
    f = _div(X, dq.unsqueeze(1)) if dm is None else torch.add(X, dm.unsqueeze(1)).div_(dq.unsqueeze(1))
    if f.device.type != "cpu":
        f = torch.nan_to_num_(f, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    q = f.add_(_MAGIC).view(torch.int32).bitwise_and_(0x7FFFFF).sub_(0x400000 + lo).clamp_(0, hi - lo)
    unset = dq == 0
    if bool(unset.any()):
        q = torch.where(unset.unsqueeze(1), _unsub(keep, 256, nb).view(g, 256 // g, nb).to(torch.int32), q)
    return q.view(256, nb)


def _q3_finish(x, d, s, L):
    """Q3_K after the scale search: re-quantize every value with its block's
    fp16-rounded scale and pack.  x: (256, nb); d: (nb,); s: (16, nb); L: the search's codes as (16, 16 * nb)
    sub-blocks, kept where a sub-block's scale is 0."""
    dq = _f16r(d).unsqueeze(0) * (s - 32).to(_F32)
    return torch.cat([_pack_q3_codes(_requantized(x, dq, -4, 3, keep=L)), _pack_q3_scales(s), _f16_bytes(d)])


def _pack_k4_scales(ls, lm):
    """ls, lm: (8, nb) int 0..63 -> (12, nb) (get_scale_min_k4 layout)."""
    b0 = ls[:4] | ((ls[4:] >> 4) << 6)
    b1 = lm[:4] | ((lm[4:] >> 4) << 6)
    b2 = (ls[4:] & 0xF) | ((lm[4:] & 0xF) << 4)
    return torch.cat([b0, b1, b2])


def _k45_common(x, qw, nmax, rmin, rdelta, nstep):
    nb = x.shape[1]
    xs = _sub(x, 32)                                          # (32, 8*nb)
    if qw is None:
        sum_x2 = _sumsq_seq(xs)
        av = _sqrt(_div(sum_x2, 32.0))
        w = av.unsqueeze(0) + xs.abs()
        sc, mins, L = _make_qkx_quants(xs, w, nmax, rmin, rdelta, nstep, False)
        scales = sc.view(8, nb)
        mins = mins.view(8, nb)
        max_scale = _pos_max(scales)
        max_min = _pos_max(mins)
        inv_s = torch.where(max_scale > 0, _div(63.0, max_scale), torch.zeros_like(max_scale))
        inv_m = torch.where(max_min > 0, _div(63.0, max_min), torch.zeros_like(max_min))
        ls = _u8(_nearest_int(inv_s.unsqueeze(0) * scales)).clamp(max=63)
        lm = _u8(_nearest_int(inv_m.unsqueeze(0) * mins)).clamp(max=63)
        d = _div(max_scale, 63.0)
        dmin = _div(max_min, 63.0)
    else:
        sigma2 = _div(2 * _sumsq_seq(x), 256.0)
        s2 = sigma2.repeat(8)
        w = _sub(qw, 32) * _sqrt(s2.unsqueeze(0) + xs * xs)
        sw = _seqsum(w).view(8, nb)
        sc, mins, L = _make_qkx_quants(xs, w, nmax, -0.9, 0.05, 36, False)
        d, Ls = _make_qp_quants(sc.view(8, nb), 63, sw)
        dmin, Lm = _make_qp_quants(mins.view(8, nb), 63, sw)
        ls = Ls.to(torch.int32)
        lm = Lm.to(torch.int32)
    return _k45_finish(x, d, dmin, ls, lm, L, nmax)


def _k45_finish(x, d, dmin, ls, lm, L, nmax: int):
    """Q4_K/Q5_K after the search: re-quantize every value with its block's
    fp16-rounded scale and min.  x: (256, nb); d, dmin: (nb,); ls, lm: (8, nb)
    6-bit codes; L: the search's codes as (32, 8 * nb) sub-blocks.  Returns
    (the 16 header bytes, the codes int32 (256, nb))."""
    dq = _f16r(d).unsqueeze(0) * ls.to(_F32)
    dm = _f16r(dmin).unsqueeze(0) * lm.to(_F32)
    head = torch.cat([_f16_bytes(d), _f16_bytes(dmin), _pack_k4_scales(ls & 0xFF, lm & 0xFF)])
    return head, _requantized(x, dq, 0, nmax, dm=dm, keep=L)


def _pack_k_nibbles(L):
    """(256, nb) -> (128, nb): qs[32c+l] = L[64c+l] | L[64c+32+l] << 4."""
    nb = L.shape[1]
    v = L.to(torch.uint8).view(4, 2, 32, nb)            # codes < 16: the bit work on a quarter of the bytes
    return (v[:, 0] | (v[:, 1] << 4)).reshape(128, nb)

def _pack_5bit_halves(q: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 codes (32, nb) 0..31 -> (20, nb): qh (bit 4 of each, a little-endian uint32), then the nibbles."""
    return torch.cat([_bits32((q >> 4) & 1), _pack_nibbles_halves(q & 0xF)])


def _high_bits(hb: torch.Tensor) -> torch.Tensor:
    """(256, nb) 0/1 -> (32, nb): byte l holds bit c of position 32c + l (Q3_K's hmask, Q5_K's qh)."""
    v = hb.view(8, 32, hb.shape[1])
    out = v[0]
    for c in range(1, 8):       # ors, not a sum: the input's dtype out
        out = out | (v[c] << c)
    return out


def _pack_q3_codes(L: torch.Tensor) -> torch.Tensor:
    """Q3_K codes (256, nb) 0..7 (value d·(L − 4)) -> (96, nb): hmask (L > 3), then the low 2 bits."""
    u = L.to(torch.uint8)       # the bit work on a quarter of the bytes
    return torch.cat([_high_bits(u >> 2), _pack_2bit(u & 3)])


def _pack_q5_k_codes(L: torch.Tensor) -> torch.Tensor:
    """Q5_K codes (256, nb) 0..31 -> (160, nb): qh (bit 4), then the low nibbles."""
    u = L.to(torch.uint8)
    return torch.cat([_high_bits(u >> 4), _pack_k_nibbles(u & 0xF)])


def _pack_q6_codes(L: torch.Tensor) -> torch.Tensor:
    """Q6_K codes (256, nb) 0..63 -> (192, nb): ql (low nibbles), then qh (the high 2 bits)."""
    nb = L.shape[1]
    v = L.view(2, 4, 32, nb)
    ql = torch.cat([(v[:, 0] & 0xF) | ((v[:, 2] & 0xF) << 4),
                    (v[:, 1] & 0xF) | ((v[:, 3] & 0xF) << 4)], 1).reshape(128, nb)
    qh = ((v[:, 0] >> 4) | ((v[:, 1] >> 4) << 2) | ((v[:, 2] >> 4) << 4)
          | ((v[:, 3] >> 4) << 6)).reshape(64, nb)
    return torch.cat([ql, qh])



def _enc_q4_k(x, qw, ctx):
    head, L = _k45_common(x, qw, 15, -1.0, 0.1, 20)
    return torch.cat([head, _pack_k_nibbles(L)])


def _enc_q5_k(x, qw, ctx):
    head, L = _k45_common(x, qw, 31, -0.5, 0.1, 15)
    return torch.cat([head, _pack_q5_k_codes(L)])


def _enc_q6_k(x, qw, ctx):
    nb = x.shape[1]
    xs = _sub(x, 16)
    sc, L = _make_qx_quants(xs, 32, None if qw is None else _sub(qw, 16))
    return _q6_finish(x, sc.view(16, nb), L)


def _q6_finish(x, scales, L):
    """Q6_K after the per-16 search: quantize the block scales to int8 with the
    largest one at -128, re-quantize every value with its fp16-rounded scale and
    pack.  x: (256, nb); scales: (16, nb); L: the search's codes as (16, 16 * nb)
    sub-blocks, kept where a sub-block's scale is 0."""
    amax, max_scale = _signed_absmax(scales)
    zero = amax < _GROUP_MAX_EPS
    iscale = _div(-128.0, max_scale)
    d = _recip(iscale)
    s = _i8(_nearest_int(iscale.unsqueeze(0) * scales).clamp(max=127))
    dq = _f16r(d).unsqueeze(0) * s.to(_F32)
    out = torch.cat([_pack_q6_codes(_requantized(x, dq, -32, 31, keep=L)), s & 0xFF, _f16_bytes(d)])
    if bool(zero.any()):
        out.masked_fill_(zero.unsqueeze(0), 0)
    return out


def _iq4_weights(x, qw, sbs):
    if qw is None:
        return x * x
    sigma2 = _sumsq_seq(x) * (2.0 / sbs)                     # sigma2 *= 2.f/sbs (exact)
    return qw * _sqrt(sigma2.unsqueeze(0) + x * x)


def _enc_iq4_nl(x, qw, ctx):
    vals = _iq4_tables(x.device)
    w = _iq4_weights(x, qw, 32)
    d = _iq4_block_scales(x, w, vals)
    idd = torch.where(d != 0, _recip(d), torch.zeros_like(d))
    L = _best_index_iq4(idd.unsqueeze(0) * x, vals, True).to(torch.int32)
    return torch.cat([_f16_bytes(d), _pack_nibbles_halves(L)])


def _enc_iq4_xs(x, qw, ctx):
    nb = x.shape[1]
    vals = _iq4_tables(x.device)
    w = _iq4_weights(x, qw, 256)
    xs = _sub(x, 32)
    scales = _iq4_block_scales(xs, _sub(w, 32), vals).view(8, nb)
    _, max_scale = _signed_absmax(scales)
    d = _div(-max_scale, 32.0)
    idd = torch.where(d != 0, _recip(d), torch.zeros_like(d))
    l = _nearest_int(idd.unsqueeze(0) * scales).clamp(-32, 31)
    dl = d.unsqueeze(0) * l.to(_F32)
    idl = torch.where(dl != 0, _recip(dl), torch.zeros_like(dl))
    X = x.view(8, 32, nb)
    L = _best_index_iq4(idl.unsqueeze(1) * X, vals, True).to(torch.int32).reshape(256, nb)
    s = l + 32
    lo = s & 0xF
    scales_l = lo[0::2] | (lo[1::2] << 4)                                    # (4, nb)
    hi = (s >> 4) & 3
    sh = (2 * torch.arange(8, device=x.device, dtype=torch.int32)).view(8, 1)
    sh_val = (hi << sh).sum(0)
    scales_h = torch.stack([sh_val & 0xFF, (sh_val >> 8) & 0xFF])
    return torch.cat([_f16_bytes(d), scales_h, scales_l, _pack_nibbles_halves(L)])


def _trits(x):
    """TQ1_0 / TQ2_0: d = max |x| of the 256-block, each value rounded (lroundf) to -1, 0, 1 of d and stored
    as the trit 0, 1, 2.  x (256, nb) -> trits (256, nb) int32, d (nb,)."""
    d = x.abs().amax(0)
    idd = torch.where(d != 0, _recip(d), torch.zeros_like(d))
    return _lround(x * idd.unsqueeze(0)) + 1, d


def _base3_byte(t: torch.Tensor) -> torch.Tensor:
    """(5, k, nb) trits, the first the most significant -> (k, nb) bytes: the 5-trit number scaled to 0..255
    by ceiling division (q * 256 + 242) / 243, so that a byte times 3^n keeps trit n in its top bits."""
    q = torch.zeros_like(t[0])
    for n in range(t.shape[0]):
        q = q * 3 + t[n]
    return (q * 256 + 242) // 243


def _enc_tq1_0(x, qw, ctx):
    nb = x.shape[1]
    t, d = _trits(x)
    head = _base3_byte(t[:160].view(5, 32, nb))                 # 5 trits per byte, bytes 0..31
    tail = _base3_byte(t[160:240].view(5, 16, nb))              # bytes 32..47
    # the last 16 values: 4 trits per byte, shifted up one trit (a zero trit appended) to the same scaling
    qh = _base3_byte(torch.cat([t[240:].view(4, 4, nb), torch.zeros((1, 4, nb), dtype=t.dtype, device=t.device)]))
    return torch.cat([head, tail, qh, _f16_bytes(d)])


def _enc_tq2_0(x, qw, ctx):
    nb = x.shape[1]
    t, d = _trits(x)
    v = (t & 3).view(2, 4, 32, nb)
    qs = v[:, 0] | (v[:, 1] << 2) | (v[:, 2] << 4) | (v[:, 3] << 6)
    return torch.cat([qs.reshape(64, nb), _f16_bytes(d)])


# (encoder, relative work per element: sizes the chunks, row-sigma needed for imatrix).  The K-quants run
# fastest on chunks of ~4096 super-blocks now that their searches are kernels: an 8960 x 1536 tensor in chunks of
# 1024 -> 4096 blocks (medians of 5, interleaved, AMD EPYC, 2026-12-06): Q4_K 298 -> 263 ms, Q5_K 281 -> 230,
# Q2_K 270 -> 243, Q6_K (2048 ->) 281 -> 265, IQ4_XS 512 -> 2048 blocks 1198 -> 943 ms; larger chunks lost again
_ENCODERS = {
    QT.Q8_0: (_enc_q8_0, 1, False),
    QT.Q4_0: (_enc_q4_0, 1, True),
    QT.Q4_1: (_enc_q4_1, 1, True),
    QT.Q5_0: (_enc_q5_0, 1, True),
    QT.Q5_1: (_enc_q5_1, 1, True),
    QT.Q2_K: (_enc_q2_k, 1, False),
    QT.Q3_K: (_enc_q3_k, 1, False),
    QT.Q4_K: (_enc_q4_k, 1, False),
    QT.Q5_K: (_enc_q5_k, 1, False),
    QT.Q6_K: (_enc_q6_k, 1, False),
    QT.IQ4_NL: (_enc_iq4_nl, 8, False),
    QT.IQ4_XS: (_enc_iq4_xs, 2, False),
    QT.TQ1_0: (_enc_tq1_0, 1, False),
    QT.TQ2_0: (_enc_tq2_0, 1, False),
    **GRID_ENCODERS,
    **IQ1_ENCODERS,
}
# Where each type's codes sit in its block and how they are packed, for writers that choose codes themselves on
# a block's own scales (feedback.py): the bytes [start, end) of a block hold pack(codes), codes (block size, nb)
# as the encoders lay them out; code c decodes to offset + scale · levels[c], offset and scale per value (set by
# the block's header, which stays as the search wrote it).
@dataclass(frozen=True)
class CodeLayout:
    start: int
    end: int
    pack: Callable[[torch.Tensor], torch.Tensor]
    levels: tuple[int, ...]


_UNIFORM = {n: tuple(range(n)) for n in (4, 8, 16, 32, 64, 256)}
CODE_LAYOUTS: dict[GGMLQuantizationType, CodeLayout] = {
    QT.Q8_0: CodeLayout(2, 34, lambda L: (L - 128) & 0xFF, _UNIFORM[256]),      # int8 stored, code = q + 128
    QT.Q4_0: CodeLayout(2, 18, _pack_nibbles_halves, _UNIFORM[16]),
    QT.Q4_1: CodeLayout(4, 20, _pack_nibbles_halves, _UNIFORM[16]),
    QT.Q5_0: CodeLayout(2, 22, _pack_5bit_halves, _UNIFORM[32]),
    QT.Q5_1: CodeLayout(4, 24, _pack_5bit_halves, _UNIFORM[32]),
    QT.Q2_K: CodeLayout(16, 80, _pack_2bit, _UNIFORM[4]),
    QT.Q3_K: CodeLayout(0, 96, _pack_q3_codes, _UNIFORM[8]),
    QT.Q4_K: CodeLayout(16, 144, _pack_k_nibbles, _UNIFORM[16]),
    QT.Q5_K: CodeLayout(16, 176, _pack_q5_k_codes, _UNIFORM[32]),
    QT.Q6_K: CodeLayout(0, 192, _pack_q6_codes, _UNIFORM[64]),
    QT.IQ4_NL: CodeLayout(2, 18, _pack_nibbles_halves, _KVALUES_IQ4NL),
    QT.IQ4_XS: CodeLayout(8, 136, _pack_nibbles_halves, _KVALUES_IQ4NL),
}


def with_codes(data: np.ndarray, qtype: GGMLQuantizationType, codes: torch.Tensor) -> np.ndarray:
    """`data` (rows, bytes per row) with every block's codes replaced by `codes` (rows, row length) (see
    CODE_LAYOUTS); the headers (scales, minimums) are kept."""
    layout = CODE_LAYOUTS[GGMLQuantizationType(qtype)]
    bs, ts = GGML_QUANT_SIZES[qtype]
    rows = data.shape[0]
    blocks = codes.to(device="cpu", dtype=torch.int32).reshape(-1, bs).t().contiguous()
    packed = layout.pack(blocks).t().to(torch.uint8).numpy()
    out = np.array(data, dtype=np.uint8, copy=True).reshape(-1, ts)
    out[:, layout.start:layout.end] = packed
    return out.reshape(rows, -1)


# with an importance matrix the legacy types run a 19/37-candidate search (chunk sizing)
_IMATRIX_WORK = {QT.Q4_0: 2, QT.Q5_0: 2, QT.Q4_1: 1, QT.Q5_1: 1, QT.Q2_K: 1,
                 QT.Q3_K: 2, QT.Q4_K: 1, QT.Q5_K: 1}
# types whose llama.cpp quantizer ignores the importance matrix
_IMATRIX_IGNORED = {QT.Q8_0, QT.F32, QT.F16, QT.BF16, QT.TQ1_0, QT.TQ2_0}


def _chunk_elems(device: torch.device) -> int:
    import os
    return (1 << 26) if device.type == "cuda" else (1 << int(os.environ.get("QK_CHUNK", "20")))


def _bf16_bits(xf: torch.Tensor) -> torch.Tensor:
    """ggml_compute_fp32_to_bf16 bits as int16.  torch's float->bfloat16 cast is
    the same round-to-nearest-even without flushing subnormals; only NaN
    differs (ggml keeps sign and payload and sets the quiet bit)."""
    bits = xf.to(torch.bfloat16).view(torch.int16)
    nan = torch.isnan(xf)
    if bool(nan.any()):
        u = xf.view(torch.int32)
        nb = (((u >> 16) | 64) & 0xFFFF).to(torch.int16)   # int32 -> int16 keeps the low bits
        bits = torch.where(nan, nb, bits)
    return bits


def quantize(x: torch.Tensor, qtype: GGMLQuantizationType,
             imatrix: torch.Tensor | None = None) -> np.ndarray:
    """Encode a 2-D tensor (rows, n_per_row) into GGML blocks.

    Returns a uint8 array (rows, bytes_per_row), byte-identical to
    llama.cpp's ``ggml_quantize_chunk`` (imatrix=NULL unless ``imatrix`` is
    given, in which case the importance-weighted quantizers are used like
    llama-quantize does).  Runs with torch ops on ``x.device``.
    """
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED:
        raise ValueError(f"unsupported quantization type {qtype.name}")
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating point tensor, got {x.dtype}")
    rows, n = x.shape
    bs, ts = GGML_QUANT_SIZES[qtype]
    if n % bs != 0:
        raise ValueError(f"{qtype.name}: row length {n} is not a multiple of the block size {bs}")

    if qtype == QT.F32:
        return x.detach().to(_F32).contiguous().cpu().numpy().view(np.uint8).reshape(rows, n * 4)
    if qtype == QT.F16:
        xd = x.detach()
        h = xd.to(torch.float16)
        bits = h.view(torch.int16)
        if xd.dtype != torch.float16:
            nan = torch.isnan(xd)
            if bool(nan.any()):
                # ggml's converter writes NaN as sign | 0x7E00
                sign = (xd.to(_F32).view(torch.int32) >> 16) & 0x8000
                bits = torch.where(nan, (sign | 0x7E00).to(torch.int16), bits)
        return bits.contiguous().cpu().numpy().view(np.uint8).reshape(rows, n * 2)
    if qtype == QT.BF16:
        xd = x.detach()
        if xd.dtype == torch.bfloat16:
            bits = xd.view(torch.int16)
        else:
            bits = _bf16_bits(xd.to(_F32).contiguous())
        return bits.contiguous().cpu().numpy().view(np.uint8).reshape(rows, n * 2)

    if imatrix is None and qtype in NEEDS_IMATRIX:
        raise ValueError(f"{qtype.name} needs an importance matrix (llama.cpp refuses to quantize without one)")
    enc, work, row_sigma = _ENCODERS[qtype]
    # converted to float32 chunk by chunk: a whole-tensor copy would double
    # the peak memory on the largest tensor (the output matrix)
    xs = x.detach().contiguous()
    dev = xs.device
    qw_rows = None
    sigma_row = None
    if imatrix is not None and qtype not in _IMATRIX_IGNORED:
        qw_rows = torch.as_tensor(imatrix).detach().to(device=dev, dtype=_F32).reshape(-1)
        if qw_rows.numel() != n:
            raise ValueError(f"imatrix has {qw_rows.numel()} entries, expected {n}")
        work = _IMATRIX_WORK.get(qtype, work)
        if row_sigma:
            # sum_x2 over the whole row, sequential, then / n_per_row
            acc = torch.zeros(rows, dtype=_F32, device=dev)
            xt = xs.to(_F32).t()
            for j in range(n):
                acc.add_(xt[j] * xt[j])
            sigma_row = _div(acc, float(n))

    nbr = n // bs
    nblocks = rows * nbr
    blocks = xs.view(nblocks, bs)
    qwb_all = qw_rows.view(nbr, bs) if qw_rows is not None else None
    out = torch.empty((nblocks, ts), dtype=torch.uint8, device=dev)
    step = max(1, _chunk_elems(dev) // (bs * work))
    by_rows = ROW_ENCODERS.get(qtype) if qw_rows is None else None
    for s in range(0, nblocks, step):
        e = min(nblocks, s + step)
        if by_rows is not None:
            xr = blocks[s:e].to(_F32)
            res, unsafe = by_rows(xr)
            redo = unsafe.nonzero().squeeze(1)
            if redo.numel():        # non-finite values or scales: the general path's exact C conversions
                res[redo] = enc(xr[redo].t().contiguous(), None, {}).t().to(torch.uint8)
            out[s:e] = res
            continue
        # widened, then transposed: torch's blocked transpose of float32 beat the strided copy of bf16
        # (8960 x 1536 bf16 in chunks of 1024 blocks: 15.7 against 20.1 ms, medians of 15, 2026-12-06)
        xb = blocks[s:e].to(_F32).t().contiguous()
        qwb = None
        ctx = {}
        if qwb_all is not None:
            bidx = torch.arange(s, e, device=dev) % nbr
            qwb = qwb_all[bidx].t().contiguous()
            if sigma_row is not None:
                ctx["sigma2"] = sigma_row[torch.arange(s, e, device=dev) // nbr]
        res = enc(xb, qwb, ctx)
        assert res.shape[0] == ts, (qtype, res.shape)
        out[s:e] = res.t().to(torch.uint8)
    return out.view(rows, nbr * ts).cpu().numpy()


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape) -> torch.Tensor:
    """Decode GGML bytes back to float32 (thin wrapper around gguf.quants.dequantize)."""
    qtype = GGMLQuantizationType(qtype)
    arr = np.ascontiguousarray(np.asarray(data, dtype=np.uint8))
    if qtype == QT.BF16:
        vals = (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        vals = _gguf_quants.dequantize(arr, qtype)
    return torch.from_numpy(np.array(vals, dtype=np.float32, copy=True)).reshape(tuple(shape))
