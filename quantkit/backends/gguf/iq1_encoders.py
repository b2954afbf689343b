"""Encoders of llama.cpp's 1.56 / 1.75-bit types IQ1_S and IQ1_M, byte-identical to ggml-quants.c, vectorized.

Both store each group of 8 weights as a point of a 2048-point grid of the three values -1, 0, 1, shifted by
±delta (delta = 1/8): x ≈ s·(v ± delta).  llama.cpp's search, per sub-block (32 values for IQ1_S, 16 for IQ1_M):

1. weights qw·sqrt(σ² + x²), σ² = 2·Σx²/256 over the super-block (IQ1_M without a matrix: x²);
2. the exact split: with the values sorted, every pair of cut points (i1 ≤ i2) puts the lowest values on -1,
   the middle on 0 and the top on +1; for each split and each shift (IQ1_S: the sub-block's +delta or -delta;
   IQ1_M: one shift per group of 8, four combinations) the least-squares scale Σwxq / Σwq² is scored by
   (Σwxq)² / Σwq², and a candidate strictly better than all before it, in llama.cpp's order, wins;
3. groups whose levels are no grid point take the candidate of their neighbour list nearest in the weighted
   distance at that scale (grids.py), and the scale is refitted if any did;
4. 3-bit sub-block scales under a fp16 super-block scale (IQ1_S: d = max/15 stored ×1.125; IQ1_M: d refitted
   by least squares on the final codes, stored ×1.1125 in the top nibbles of the four scale words).

Step 2 runs in iq1_splits.py: of the 1122 (IQ1_S) or 612 (IQ1_M) candidates of a sub-block, only the few near
the best score are replayed in llama.cpp's order with its float32 test, and which few that must be is found by
fused passes over all of them.  The sort keeps equal values in index order, like glibc's merge-sort qsort.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from .exact import _div, _f16_bytes, _f32, _nearest_int, _recip, _seqsum, _sub, _unsub
from .grid_encoders import importance_weights
from .grids import grid_tables
from .iq1_splits import X_M as _X_M, X_P as _X_P, pick, prefix_sums, unravel
from .neighbours import best_neighbour

__all__ = ["IQ1_ENCODERS"]

QT = GGMLQuantizationType
_F32 = torch.float32


def _levels_from_split(idx: torch.Tensor, i1: torch.Tensor, i2: torch.Tensor) -> torch.Tensor:
    """Sorted order idx (n, m) and cut points (m,) -> levels (n, m): sorted positions below i1 on 0, below i2
    on 1, the rest on 2."""
    n = idx.shape[0]
    rank = torch.arange(n, device=idx.device).unsqueeze(1)
    lev_sorted = (rank >= i1.unsqueeze(0)).long() + (rank >= i2.unsqueeze(0)).long()
    return torch.empty_like(lev_sorted).scatter_(0, idx, lev_sorted)


def _snap(L, x, w, scale, shift_p, tab):
    """Off-grid groups of 8 (levels L (n, m)) take their best neighbour (iq1_find_best_neighbour2) at `scale`
    with level values x_p or x_m (shift_p (n/8, m)) -> (grid index (n/8, m), all on grid (m,))."""
    n, m = L.shape
    G = L.view(n // 8, 8, m).permute(0, 2, 1)                        # (groups, m, 8)
    u = tab.index(G)
    gi = tab.index_of[u.long()].long()
    off = gi < 0
    grp, col = off.nonzero(as_tuple=True)                           # the off-grid groups, as in grid_encoders
    if grp.numel():
        sel = grp * m + col
        xp = torch.tensor(_X_P + (0.0,), device=x.device)
        xm = torch.tensor(_X_M + (0.0,), device=x.device)
        values = torch.where(shift_p.reshape(-1)[sel].unsqueeze(0), xp.unsqueeze(1), xm.unsqueeze(1))   # (4, g)
        gi.view(-1)[sel] = best_neighbour(tab, u.view(-1)[sel], tab.by_group(x).index_select(1, sel),
                                          tab.by_group(w).index_select(1, sel), scale.index_select(0, col),
                                          values).long()
    return gi, ~off.any(0)


def _refit(gi, x, w, shift_p, tab, scale):
    """Σwqx / Σwq² over a sub-block with the final grid points (q the shifted level value), sequential."""
    n, m = x.shape
    lev = tab.levels[gi.view(-1)].view(n // 8, m, 8).permute(0, 2, 1).reshape(n, m).long()
    xp = torch.tensor(_X_P, device=x.device)
    xm = torch.tensor(_X_M, device=x.device)
    sp = shift_p.repeat_interleave(8, 0)
    q = torch.where(sp, xp[lev], xm[lev])
    sumqx, sumq2 = _seqsum(w * q * x), _seqsum(w * q * q)
    return torch.where((sumqx > 0) & (sumq2 > 0), _div(sumqx, sumq2), scale)


def _sorted_prefix(xs, w, groups: bool):
    """Values sorted (stable; equal ones in index order, like glibc's merge-sort qsort), their order, and the
    prefix sums the split search runs on (iq1_splits.prefix_sums; groups: those of each group of 8)."""
    vals, idx = torch.sort(xs, dim=0, stable=True)
    return idx, prefix_sums(vals, w.gather(0, idx), (idx >= 8) if groups else None)


def _subblocks(x, qw, qtype, sub: int, eps: float):
    """(grid tables, weights and values as (sub, m) sub-blocks, the sub-blocks searched: largest |x| >= eps)."""
    w = _sub(importance_weights(x, qw, 2.0, "x2"), sub)
    xs = _sub(x, sub)
    return grid_tables(qtype).to(x.device), w, xs, xs.abs().amax(0) >= _f32(eps)


def _placed(idx, cut1, cut2, scale):
    """Step 2's winner as levels (sub, m) and a non-negative scale; flipped: where the scale was negative."""
    L = _levels_from_split(idx, cut1, cut2)
    flipped = scale < 0
    return torch.where(flipped.unsqueeze(0), 2 - L, L), scale.abs(), flipped


def _on_grid(L, xs, w, scale, shift_p, tab, active):
    """Step 3, and the sub-blocks left zero: (grid index (groups, m), scale (m,))."""
    gi, on = _snap(L, xs, w, scale, shift_p, tab)
    scale = torch.where(on, scale, _refit(gi, xs, w, shift_p, tab, scale))
    return gi.masked_fill(~active.unsqueeze(0), 0), scale.masked_fill(~active, 0)


def _enc_iq1_s(x, qw, ctx):
    nb = x.shape[1]
    dev = x.device
    tab, w, xs, active = _subblocks(x, qw, QT.IQ1_S, 32, 1e-12)       # (32, m), m = 8·nb
    m = xs.shape[1]
    idx, P = _sorted_prefix(xs, w, False)
    chosen, scale = pick(P, "s")
    active &= chosen >= 0
    i1, i2, k = unravel(chosen.clamp(min=0), P.shape[1], "s")
    L, scale, flipped = _placed(idx, i1, i2, scale)
    shift_p = (k == 0) ^ flipped
    gi, scale = _on_grid(L, xs, w, scale, shift_p.unsqueeze(0).expand(4, m), tab, active)
    shift_p = shift_p | ~active                                       # skipped sub-blocks keep shift +1

    scales = scale.view(8, nb)
    max_scale = scales.amax(0)
    d = _div(max_scale, 15.0)
    ls = _nearest_int(0.5 * (_recip(d).unsqueeze(0) * scales - 1.0)).clamp(0, 7).long()
    ls = ls | torch.where(shift_p.view(8, nb), 0, 8)
    gi = gi.view(4, 8, nb)                                            # [group k, sub-block j, b]
    h = ((gi >> 8) << (3 * torch.arange(4, device=dev).view(4, 1, 1))).sum(0)
    qh = h | torch.where((max_scale > 0).unsqueeze(0), ls << 12, 0)
    dh = _f16_bytes(d * _f32(1.125)).long().masked_fill((max_scale == 0).unsqueeze(0), 0)
    qs = (gi & 255).permute(1, 0, 2).reshape(32, nb)
    return torch.cat([dh, qs, torch.stack([qh & 255, qh >> 8], 1).reshape(16, nb)])


_MASKS = (0x00, 0x80, 0x08, 0x88)


def _enc_iq1_m(x, qw, ctx):
    nb = x.shape[1]
    dev = x.device
    tab, w, xs, active = _subblocks(x, qw, QT.IQ1_M, 16, 1e-7)        # (16, m), m = 16·nb
    idx, P = _sorted_prefix(xs, w, True)
    chosen, scale = pick(P, "m")
    active &= chosen >= 0
    i1, i2, k = unravel(chosen.clamp(min=0), P.shape[1], "m")
    L, scale, flipped = _placed(idx, i1, i2, scale)
    k = torch.where(flipped, 3 - k, k)
    gi, scale = _on_grid(L, xs, w, scale, torch.stack([k < 2, k % 2 == 0]), tab, active)   # shifts of 2 groups
    k = k.masked_fill(~active, 0)

    scales = scale.view(16, nb)
    max_scale = scales.amax(0)
    d = _div(max_scale, 15.0)
    ls = _nearest_int(0.5 * (_recip(d).unsqueeze(0) * scales - 1.0)).clamp(0, 7).long()   # (16, nb)
    gi = gi.view(2, 16, nb)
    masks = torch.tensor(_MASKS, device=dev)[k].view(16, nb)
    qh = (gi[0] >> 8) | ((gi[1] >> 8) << 4)
    # the final d: least squares over the whole super-block on the codes as stored (sub-blocks left zero take
    # grid point 0 and the + shift), position order
    kk = k.view(16, nb)
    sp = torch.stack([kk < 2, kk % 2 == 0]).permute(1, 0, 2).repeat_interleave(8, 1).reshape(256, nb)
    lev = tab.levels[gi.permute(1, 0, 2).reshape(32, nb).view(-1)].view(32, nb, 8).permute(0, 2, 1).reshape(256, nb)
    xp, xm = torch.tensor(_X_P, device=dev), torch.tensor(_X_M, device=dev)
    q = torch.where(sp, xp[lev.long()], xm[lev.long()]) * (2 * ls + 1).to(_F32).repeat_interleave(16, 0)
    wf = _unsub(w, 256, nb)                                           # the same weights, position order
    sumqx, sumq2 = _seqsum(wf * q * x), _seqsum(wf * q * q)
    d = torch.where(sumq2 > 0, _div(sumqx, sumq2), d)
    u16 = _f16_bytes(d * _f32(1.1125)).long()
    u16 = u16[0] | (u16[1] << 8)
    sc = (ls.view(4, 4, nb) << (3 * torch.arange(4, device=dev).view(1, 4, 1))).sum(1)  # (4 words, nb)
    sc = sc | (((u16 >> (4 * torch.arange(4, device=dev).view(4, 1))) & 0xF) << 12)
    empty = (max_scale == 0).unsqueeze(0)
    sc = sc.masked_fill(empty, 0)
    qh = torch.where(empty, qh, qh | masks)
    qs = (gi & 255).permute(1, 0, 2).reshape(32, nb)
    return torch.cat([qs, qh, torch.stack([sc & 255, sc >> 8], 1).reshape(8, nb)])


# (encoder, relative work per element: sizes the chunks, row sigma needed) as in encoders.py.  At 16 a chunk is
# 256 super-blocks: the split search's passes keep no candidate in memory, so the chunk size weighs the eager
# steps' per-call cost against one (candidates, sub-blocks) int32 mask (9 MiB at 256).  Measured on the bench's
# two tensors (bench/gguf_lowbit_encoders.py, 2026-12-06): IQ1_S / IQ1_M 1.40 / 1.66 s and +113 / +110 MiB peak
# against 2.03 / 2.21 s at 64, and 1.48 / 1.72 s (+237 MiB) at 4
IQ1_ENCODERS = {
    QT.IQ1_S: (_enc_iq1_s, 16, False),
    QT.IQ1_M: (_enc_iq1_m, 16, False),
}
