"""Encoders of llama.cpp's lattice types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S), byte-identical to
ggml-quants.c, vectorized.

These types store each group of 8 (IQ2) or 4 (IQ3) magnitudes as the index of a point of a fixed lattice
(grids.py), the signs apart, and one 4-bit scale per sub-block of 16 or 32 values under an fp16 super-block
scale.  llama.cpp's search, per sub-block (the numbers of each type are the _Lattice rows below):

1. weights: with an importance matrix qw·sqrt(σ² + x²), σ² = k·Σx²/256 over the super-block; without one
   x² (IQ3) or σ²/4 + x² (IQ2_S); IQ2_XXS and IQ2_XS need the matrix.  Values are taken by magnitude; the
   "even" types store 7 sign bits per 8 values: an odd count of negatives flips the value with the smallest
   w·x², so the 8th sign is the parity;
2. for each trial inverse scale id = (2·kmax - 1 + step·is) / top, is = -trials..trials (top: the largest
   magnitude, or for IQ2_XXS kmax times make_qp_quants' scale): levels l = nearest_int((id·|x| - 1) / 2)
   clamped to the grid's range; a group whose levels are no grid point takes the candidate of its neighbour
   list (grids.py) nearest in the weighted distance at scale 1/id; a trial strictly better in
   (Σwxq)² / Σwq² than all before it wins, scale = Σwxq / Σwq² (q = 2l + 1);
3. the groups (those that came from a neighbour list, or all) are requantized once at the winning scale, and
   the scale refitted;
4. the super-block scale d = max scale / 31, stored times the type's fudge factor, and the 4-bit sub-block
   scales nearest_int((s/d - 1) / 2).

Every step is the same float32 operation as the C, sums sequential where the C sums, the first minimum where
the C keeps the first.  One trial is two fused kernels over all sub-blocks of a chunk (fusion.py): _trial_points
rounds every group, looks its levels up on the grid and searches the first candidates of an off-grid group's
list (_Lattice.row: most lists are that short), _grid_sums scores the sub-blocks; only the groups whose list goes on are picked
out and searched further between the two.  Op by op, a trial streamed its sub-blocks through memory some forty
times and the picking out of the off-grid groups cost more than their search.  One quirk is reproduced on
purpose: IQ3_S does not advance its output pointers past an all-zero sub-block, so the next sub-block's indices
and signs land in its slot and the last slots stay zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from .exact import _div, _f16_bytes, _f32, _nearest_int, _recip, _seqsum, _sqrt, _sub
from .grids import GridTables, grid_tables
from .fusion import fused
from .neighbours import _distance, _rows_vec, best_neighbour, nearest_in_lists
from .qp_search import make_qp_quants

__all__ = ["GRID_ENCODERS", "NEEDS_IMATRIX", "importance_weights"]

QT = GGMLQuantizationType
_F32 = torch.float32


@dataclass(frozen=True)
class _Lattice:
    qtype: GGMLQuantizationType
    sub: int                  # values per sub-block (one 4-bit scale)
    kmax: int                 # levels 0 .. kmax-1
    trials: int               # is = -trials .. trials
    step: float               # id = (2·kmax - 1 + step·is) / top
    parity: bool              # 7 sign bits per 8 values, the 8th the parity
    eps: float                # a sub-block whose largest magnitude is below this is left zero
    sigma: float              # σ² = sigma · Σx² / 256
    plain: str | None         # weights without a matrix: "x2", "sigma/4+x2", None (matrix required)
    qp_start: bool            # IQ2_XXS: top = kmax · make_qp_quants' scale
    track: bool               # remember which winning groups came from a neighbour list
    redo_all: bool            # step 3 requantizes every group (else only those)
    fudge: float              # d is stored times this
    # neighbour candidates a trial's kernel searches per group, longer lists going on after it: every group pays
    # for them, and a group picked out to go on pays ~100 times as much per group (IQ3 and IQ2_S lists hold 9-12
    # candidates on average, 13 % or fewer of the off-grid groups more than 16; IQ2_XXS 31, IQ2_XS 61)
    row: int = 16


_LATTICES = {
    QT.IQ3_XXS: _Lattice(QT.IQ3_XXS, 32, 8, 15, 0.2, True, 1e-8, 2.0, "x2", False, True, False, 1.0125),
    QT.IQ3_S: _Lattice(QT.IQ3_S, 32, 8, 9, 0.2, False, 0.0, 2.0, "x2", False, True, True, 1.033),
    QT.IQ2_XXS: _Lattice(QT.IQ2_XXS, 32, 3, 6, 0.1, True, 1e-15, 1.0, None, True, False, True, 1.0, 32),
    QT.IQ2_XS: _Lattice(QT.IQ2_XS, 16, 3, 9, 0.1, True, 1e-15, 1.0, None, False, True, False, 1.0, 48),
    QT.IQ2_S: _Lattice(QT.IQ2_S, 16, 3, 9, 0.1, False, 1e-8, 2.0, "sigma/4+x2", False, True, False, 0.9875),
}
# ggml-quants.c asserts on a missing importance matrix for these
NEEDS_IMATRIX = frozenset(t for t, p in _LATTICES.items() if p.plain is None) | {QT.IQ1_S}


def _snap(tab: GridTables, lv: torch.Tensor, xg: torch.Tensor, wg: torch.Tensor, scale: torch.Tensor):
    """Levels lv (sub, m) -> (levels on the grid (sub, m), on-grid mask (groups, m)): an off-grid group takes
    its best neighbour at `scale` (m,); xg, wg: the values and weights by group (GridTables.by_group)."""
    sub, m = lv.shape
    dim = tab.dim
    u = tab.index(lv.view(sub // dim, dim, m).permute(0, 2, 1))                # (groups, m)
    on = tab.index_of[u.long()] >= 0
    grp, col = (~on).nonzero(as_tuple=True)                         # the off-grid groups
    if grp.numel():
        sel = grp * m + col
        best = best_neighbour(tab, u.view(-1)[sel], xg.index_select(1, sel), wg.index_select(1, sel),
                              scale.index_select(0, col))
        at = (grp * (dim * m) + col).unsqueeze(0) + (torch.arange(dim, device=lv.device) * m).unsqueeze(1)
        lv = lv.reshape(-1).index_put((at,), tab.levels[best].t().to(lv.dtype)).view(sub, m)   # their levels
    return lv, on


def _sums(w, xval, L):
    """Σ w·x·q and Σ w·q² over a sub-block (sequential), q = 2L + 1."""
    q = (2 * L + 1).to(_F32)
    return _seqsum(w * xval * q), _seqsum(w * q * q)


def _levels(idd, xval, kmax):
    return _nearest_int(0.5 * (idd.unsqueeze(0) * xval - 1.0)).clamp(0, kmax - 1)


def _trial_points_vec(xg, wg, idd, index_of, row_of, start, count, packed, flat, kmax: int, bits: int, row: int):
    """_trial_points op by op (the path without a kernel: CUDA, no compiler)."""
    shifts = (torch.arange(xg.shape[0], device=xg.device, dtype=torch.int32) * bits).unsqueeze(1)
    u = (_levels(idd, xg, kmax) << shifts).sum(0, dtype=torch.int32)
    gi = index_of.view(-1)[u.long()].to(torch.int64)
    on = gi >= 0
    d2 = torch.zeros(gi.shape, dtype=_F32, device=gi.device)
    more = torch.zeros_like(on)
    off = (~on).nonzero().squeeze(1)
    if off.numel():
        lists = row_of.view(-1)[u.index_select(0, off).long()]
        first, left = start.view(-1)[lists], count.view(-1)[lists]
        d, at = _rows_vec(xg[:, off], wg[:, off], _recip(idd.index_select(0, off)), None, first, left, packed, bits,
                          row)
        gi[off], d2[off], more[off] = flat.view(-1)[first + at], d, left > row
    return gi, d2, on, u, more


@fused(eager=_trial_points_vec)
def _trial_points(xg, wg, idd, index_of, row_of, start, count, packed, flat, kmax: int, bits: int, row: int):
    """One search trial's grid points, group by group: xg, wg (dim, G) the groups' magnitudes and neighbour
    weights, idd (G,) the trial's inverse scale -> the grid index of the rounded levels, or of the nearest of the
    first `row` candidates of their neighbour list (G,), that candidate's distance (G,), whether the levels were a
    grid point (G,), their index u (G,), and whether the list goes on past `row` (G,).  The tables are (n, 1): GridTables' index_of,
    row_of, start, count, packed and flat.  Position by position, so that one kernel does a whole trial."""
    u = None
    for i in range(xg.shape[0]):
        level = _nearest_int(0.5 * (idd * xg[i] - 1.0)).clamp(0, kmax - 1)
        u = level if u is None else u | (level << (bits * i))
    grid = index_of.view(-1)[u].to(torch.int64)
    on = grid >= 0
    lists = row_of.view(-1)[u].clamp(min=0)
    first = start.view(-1)[lists]
    left = torch.where(on, 0, count.view(-1)[lists])
    scale = _recip(idd)
    best = at = None
    for j in range(row):
        ok = left > j
        d2 = _distance(packed.view(-1)[torch.where(ok, first + j, 0)], xg, wg, scale, None, bits)
        if best is None:
            best, at = d2, torch.zeros_like(first)
        else:
            better = ok & (d2 < best)
            best = torch.where(better, d2, best)
            at = torch.where(better, j, at)
    grid = torch.where(on, grid, flat.view(-1)[torch.where(on, 0, first + at)])
    return grid, torch.where(on, 0.0, best), on, u, left > row


def _grid_sums_vec(xval, w, gi, codes, bits: int):
    """_grid_sums op by op."""
    L = codes.view(-1)[gi.long()]                                              # packed levels (groups, m)
    dim = xval.shape[0] // gi.shape[0]
    shifts = (torch.arange(dim, device=gi.device, dtype=torch.int32) * bits).view(1, dim, 1)
    L = ((L.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(xval.shape)
    return _sums(w, xval, L)


@fused(eager=_grid_sums_vec)
def _grid_sums(xval, w, gi, codes, bits: int):
    """_sums of sub-blocks xval, w (sub, m) whose groups (sub/dim consecutive rows each) take the grid points
    gi (groups, m); codes (n_grid, 1): GridTables.codes.  Position by position, one kernel."""
    groups = gi.shape[0]
    dim = xval.shape[0] // groups
    sqx = sq2 = None
    for g in range(groups):
        code = codes.view(-1)[gi[g]]
        for i in range(dim):
            q = (2 * ((code >> (bits * i)) & ((1 << bits) - 1)) + 1).to(_F32)
            k = g * dim + i
            tqx, tq2 = w[k] * xval[k] * q, w[k] * q * q
            sqx, sq2 = (tqx + 0.0, tq2 + 0.0) if sqx is None else (sqx + tqx, sq2 + tq2)
    return sqx, sq2


def _trial(p: _Lattice, tab: GridTables, xg, wg, idd):
    """One trial's grid point per group (step 2 of the module docstring): the first p.row candidates of an
    off-grid group's list in the kernel, the rest of the longer lists after it.  xg, wg (dim, G) by group,
    idd (m,) -> (grid indices (G,), on the grid (G,))."""
    idd = idd.repeat(xg.shape[1] // idd.numel())
    gi, d2, on, u, more = _trial_points(xg, wg, idd, tab.index_of.view(-1, 1), tab.row_of.view(-1, 1),
                                        tab.start.view(-1, 1), tab.count.view(-1, 1), tab.packed,
                                        tab.flat.view(-1, 1), p.kmax, tab.bits, p.row)
    if bool(more.any()):
        cols = more.nonzero().squeeze(1)
        lists = tab.row_of[u.index_select(0, cols).long()]
        start = tab.start[lists] + p.row
        d2_rest, place = nearest_in_lists(tab, start, tab.count[lists] - p.row, xg[:, cols], wg[:, cols],
                                          _recip(idd.index_select(0, cols)))
        better = d2_rest < d2.index_select(0, cols)             # the C keeps the first of equal distances
        gi[cols] = torch.where(better, tab.flat.index_select(0, start + place), gi.index_select(0, cols))
    return gi, on


def _search(p: _Lattice, tab: GridTables, xval, w, waux, top, scale):
    """Steps 2-3 of the module docstring for m sub-blocks: xval, w, waux (sub, m); top, the starting scale
    (m,) -> levels (sub, m) int32 and scale (m,)."""
    sub, m = xval.shape
    groups = sub // tab.dim
    best = torch.zeros(m, dtype=_F32, device=xval.device)
    won = torch.zeros(m, dtype=torch.bool, device=xval.device)
    gi = torch.zeros((groups, m), dtype=torch.int64, device=xval.device)
    on_grid = torch.full((groups, m), p.track and not p.redo_all, dtype=torch.bool, device=xval.device)
    base = np.float32(2 * p.kmax - 1)
    xg, wg = tab.by_group(xval), tab.by_group(waux)
    codes = tab.codes.view(-1, 1)
    for k in range(-p.trials, p.trials + 1):
        idd = _div(_f32(base + np.float32(k) * np.float32(p.step)), top)
        g_k, on = _trial(p, tab, xg, wg, idd)
        g_k, on = g_k.view(groups, m), on.view(groups, m)
        sumqx, sumq2 = _grid_sums(xval, w, g_k, codes, tab.bits)
        take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        scale = torch.where(take, _div(sumqx, sumq2), scale)
        best = torch.where(take, scale * sumqx, best)
        won |= take
        gi = torch.where(take.unsqueeze(0), g_k, gi)
        if p.track:
            on_grid = torch.where(take.unsqueeze(0), on, on_grid)
    L = tab.levels[gi].permute(0, 2, 1).reshape(sub, m).masked_fill(~won.unsqueeze(0), 0)
    redo = (~on_grid).any(0) & (scale > 0)
    if bool(redo.any()):
        cols = redo.nonzero().squeeze(1)
        xs, ws, wa, sc = xval[:, cols], w[:, cols], waux[:, cols], scale[cols]
        Lnew, _ = _snap(tab, _levels(_recip(sc), xs, p.kmax), tab.by_group(xs), tab.by_group(wa), sc)
        if not p.redo_all:
            keep = on_grid[:, cols].repeat_interleave(tab.dim, 0)
            Lnew = torch.where(keep, L[:, cols], Lnew)
        sumqx, sumq2 = _sums(ws, xs, Lnew)
        L[:, cols] = Lnew
        scale[cols] = torch.where(sumq2 > 0, _div(sumqx, sumq2), sc)
    return L, scale


def importance_weights(x, qw, sigma: float, plain: str | None):
    """The lattice and IQ1 quantizers' weights for (256, nb) super-blocks: qw·sqrt(σ² + x²) with
    σ² = sigma·Σx²/256, or without a matrix x² ("x2") or σ²/4 + x² ("sigma/4+x2")."""
    if qw is None and plain == "x2":
        return x * x
    sigma2 = _div(sigma * _seqsum(x * x), 256.0).unsqueeze(0)
    return _f32(0.25) * sigma2 + x * x if qw is None else qw * _sqrt(sigma2 + x * x)


def _weights(p: _Lattice, x, qw):
    """Weights and their square roots, as (sub, (256/sub)·nb) sub-blocks."""
    w = _sub(importance_weights(x, qw, p.sigma, p.plain), p.sub)
    return w, _sqrt(w)


@dataclass
class _Coded:
    """A chunk's search result, per sub-block column j·nb + b: grid indices (groups, m), signs of each 8 values
    (sub/8, m), the 4-bit scales (256/sub, nb), the fp16 d bytes (2, nb), which sub-blocks were searched, and
    which super-blocks are all zero."""
    gi: torch.Tensor
    signs: torch.Tensor
    ls: torch.Tensor
    dh: torch.Tensor
    active: torch.Tensor
    empty: torch.Tensor


def _encode(p: _Lattice, x, qw) -> _Coded:
    nb = x.shape[1]
    dev = x.device
    tab = grid_tables(p.qtype).to(dev)
    w, waux = _weights(p, x, qw)
    xs = _sub(x, p.sub)                                                 # (sub, m), m = (256/sub)·nb
    m = xs.shape[1]
    n8 = p.sub // 8
    neg = xs < 0
    xval = torch.where(neg, -xs, xs)                                    # keeps -0.0 like the C
    bit = 1 << torch.arange(8, device=dev, dtype=torch.int64).view(1, 8, 1)
    signs = (neg.view(n8, 8, m).to(torch.int64) * bit).sum(1)
    if p.parity:
        odd = (neg.view(n8, 8, m).sum(1) % 2) == 1
        imin = (w * xs * xs).view(n8, 8, m).min(1).indices               # the first of equal minima
        flip = odd.unsqueeze(1) & (torch.arange(8, device=dev).view(1, 8, 1) == imin.unsqueeze(1))
        xval = torch.where(flip.reshape(p.sub, m), -xval, xval)
        signs = (signs ^ (flip.to(torch.int64) * bit).sum(1)) & 127
    mx = xval.amax(0)
    active = mx >= _f32(p.eps) if p.eps > 0 else mx != 0
    L = torch.zeros((p.sub, m), dtype=torch.int32, device=dev)
    scale = torch.zeros(m, dtype=_F32, device=dev)
    if bool(active.any()):
        cols = active.nonzero().squeeze(1)
        xa, wa = xval[:, cols], w[:, cols]
        if p.qp_start:
            start, _ = make_qp_quants(xa, p.kmax + 1, wa)
            top = start * float(p.kmax)
            ok = top > 0                                                # else the sub-block is left zero
            active[cols] = ok
            cols, start, top, xa, wa = cols[ok], start[ok], top[ok], xa[:, ok], wa[:, ok]
        else:
            top = mx[cols]
            start = _div(top, float(2 * p.kmax - 1))
        La, sa = _search(p, tab, xa, wa, waux[:, cols], top, start)
        flip = sa < 0
        signs[:, cols] = torch.where(flip.unsqueeze(0), ~signs[:, cols] & (127 if p.parity else 255),
                                     signs[:, cols])
        L[:, cols], scale[cols] = La, torch.where(flip, -sa, sa)
    gi = tab.index_of[tab.index(L.view(p.sub // tab.dim, tab.dim, m).permute(0, 2, 1)).long()].to(torch.int64)
    zero = ~active.unsqueeze(0)
    gi = gi.masked_fill(zero, 0)
    signs = signs.masked_fill(zero, 0)

    scales = scale.view(256 // p.sub, nb)
    max_scale = scales.amax(0)
    d = _div(max_scale, 31.0)
    ls = _nearest_int(0.5 * (_recip(d).unsqueeze(0) * scales - 1.0)).clamp(0, 15).to(torch.int64)
    dh = _f16_bytes(d * _f32(p.fudge) if p.fudge != 1.0 else d).to(torch.int64)
    return _Coded(gi, signs, ls, dh, active, max_scale == 0)


def _bytes_le(v: torch.Tensor, nbytes: int) -> torch.Tensor:
    """(k, nb) unsigned values held in int64 -> (nbytes·k, nb) little-endian bytes."""
    k, nb = v.shape
    return torch.stack([(v >> (8 * i)) & 0xFF for i in range(nbytes)], 1).reshape(nbytes * k, nb)


def _nibbles(ls: torch.Tensor) -> torch.Tensor:
    return ls[0::2] | (ls[1::2] << 4)


def _zero_where(empty: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t.masked_fill(empty.unsqueeze(0), 0)


def _enc_iq3_xxs(x, qw, ctx):
    """block_iq3_xxs: d, 64 grid indices (byte 8j + k), 8 words: 4×7 sign bits | scale << 28."""
    nb = x.shape[1]
    c = _encode(_LATTICES[QT.IQ3_XXS], x, qw)
    q3 = c.gi.view(8, 8, nb).permute(1, 0, 2).reshape(64, nb)
    sh = torch.tensor([0, 7, 14, 21], device=x.device, dtype=torch.int64).view(4, 1, 1)
    words = (c.signs.view(4, 8, nb) << sh).sum(0) | (c.ls << 28)
    return _zero_where(c.empty, torch.cat([c.dh, q3, _bytes_le(words, 4)]))


def _enc_iq3_s(x, qw, ctx):
    """block_iq3_s: d, 64 low index bytes, 8 bytes of index bit 8, 32 sign bytes, 4 bytes of scale pairs."""
    nb = x.shape[1]
    c = _encode(_LATTICES[QT.IQ3_S], x, qw)
    gi = c.gi.view(8, 8, nb)                                            # [group k, sub-block j, b]
    qh = ((gi >> 8) << torch.arange(8, device=x.device, dtype=torch.int64).view(8, 1, 1)).sum(0)
    # llama.cpp's pointer quirk: sub-block j's low index bytes and signs go to slot (searched sub-blocks
    # before j); a sub-block left zero writes nothing (its slot index 8 is dropped)
    act = c.active.view(8, nb)
    slot = torch.where(act, torch.cumsum(act.to(torch.int64), 0) - 1, torch.full_like(act, 8, dtype=torch.int64))
    qs = torch.zeros((9, 8, nb), dtype=torch.int64, device=x.device)
    qs.scatter_(0, slot.unsqueeze(1).expand(8, 8, nb), (gi & 255).permute(1, 0, 2))
    sg = torch.zeros((9, 4, nb), dtype=torch.int64, device=x.device)
    sg.scatter_(0, slot.unsqueeze(1).expand(8, 4, nb), c.signs.view(4, 8, nb).permute(1, 0, 2))
    return torch.cat([_zero_where(c.empty, c.dh), qs[:8].reshape(64, nb), qh, sg[:8].reshape(32, nb),
                      _zero_where(c.empty, _nibbles(c.ls))])


def _enc_iq2_xxs(x, qw, ctx):
    """block_iq2_xxs: d, 8 × (word of 4 grid indices, word of 4×7 sign bits | scale << 28)."""
    nb = x.shape[1]
    c = _encode(_LATTICES[QT.IQ2_XXS], x, qw)
    sh = torch.arange(4, device=x.device, dtype=torch.int64).view(4, 1, 1)
    grid = (c.gi.view(4, 8, nb) << (8 * sh)).sum(0)
    sign = (c.signs.view(4, 8, nb) << (7 * sh)).sum(0) | (c.ls << 28)
    words = torch.stack([grid, sign], 1).reshape(16, nb)
    return _zero_where(c.empty, torch.cat([c.dh, _bytes_le(words, 4)]))


def _enc_iq2_xs(x, qw, ctx):
    """block_iq2_xs: d, 32 × uint16 (grid index | 7 sign bits << 9), 8 bytes of scale pairs."""
    nb = x.shape[1]
    c = _encode(_LATTICES[QT.IQ2_XS], x, qw)
    half = c.gi.view(2, 16, nb) | (c.signs.view(2, 16, nb) << 9)       # [k, sub-block j, b]
    q2 = half.permute(1, 0, 2).reshape(32, nb)                          # entry 2j + k
    return _zero_where(c.empty, torch.cat([c.dh, _bytes_le(q2, 2), _nibbles(c.ls)]))


def _enc_iq2_s(x, qw, ctx):
    """block_iq2_s: d, 32 low index bytes, 32 sign bytes, 8 bytes of index bits 8-9, 8 bytes of scale pairs."""
    nb = x.shape[1]
    c = _encode(_LATTICES[QT.IQ2_S], x, qw)
    gi = c.gi.view(2, 16, nb).permute(1, 0, 2).reshape(32, nb)          # entry i8 = 2j + k
    signs = c.signs.view(2, 16, nb).permute(1, 0, 2).reshape(32, nb)
    sh = (2 * torch.arange(4, device=x.device, dtype=torch.int64)).view(1, 4, 1)
    qh = ((gi >> 8).view(8, 4, nb) << sh).sum(1)
    return torch.cat([_zero_where(c.empty, c.dh), gi & 255, signs, qh, _zero_where(c.empty, _nibbles(c.ls))])


# type -> (encoder, relative work per element, row sigma needed): the shape of encoders.py's table
GRID_ENCODERS = {
    QT.IQ3_XXS: (_enc_iq3_xxs, 8, False),
    QT.IQ3_S: (_enc_iq3_s, 8, False),
    QT.IQ2_XXS: (_enc_iq2_xxs, 8, False),
    QT.IQ2_XS: (_enc_iq2_xs, 32, False),        # its long neighbour lists: smaller chunks stay in cache
    QT.IQ2_S: (_enc_iq2_s, 8, False),
}
