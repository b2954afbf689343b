"""The lattice quantizers' neighbour search (ggml-quants.c's iq2/iq3_find_best_neighbour and IQ1's
iq1_find_best_neighbour2), byte for byte, as a fused CPU kernel.

A group of 8 (IQ1, IQ2) or 4 (IQ3) values whose rounded levels are no grid point takes, of the grid points
listed for its levels (grids.py), the first one with the least Σ w·(scale·q - x)², summed in position order
(q: the value of the candidate's level in that position).  Each search trial of each sub-block does this for
its off-grid groups, and the lists hold 1 to 292 candidates: on the lattice types this search was three
quarters of the encoding time.

Run op by op, every (group, candidate) pair streams its terms through memory a dozen times.  Here the lists
are cut into rows of ROW candidates (a group with a longer list gets several rows) and one row is searched
position by position, with the candidates' levels packed in one integer each, so that Inductor fuses a whole
row into one loop that keeps a group's values in registers (fusion.py builds and ships the kernel; measured
at 2.3 ns per pair against ~30 op by op).  A group's rows are then joined by one segmented minimum whose key
keeps the first of equal distances, as the C's strict `<` does.
"""

from __future__ import annotations

import torch

from .fusion import fused
from .grids import GridTables

__all__ = ["best_neighbour", "nearest_in_lists", "ROW"]

_F32 = torch.float32
ROW = 16                    # candidates per row: the kernel's unrolled loop
_PLACE_BITS = 9             # a candidate's place in its list (the longest list: 292) in a key's low bits


def _distance(p, x, w, s, values, bits: int):
    """Σ w·(s·q - x)² over the positions in order, q the value of the level that candidate p (packed levels)
    holds there: the odd integer 2l + 1, or the group's own values[l].  p: (R,) or (places, R)."""
    d2 = None
    for i in range(x.shape[0]):
        level = (p >> (bits * i)) & ((1 << bits) - 1)
        if values is None:
            q = (2 * level + 1).to(_F32)
        else:                               # a select chain, point-wise (a gather would not fuse)
            q = values[0]
            for k in range(1, values.shape[0]):
                q = torch.where(level == k, values[k], q)
        diff = s * q - x[i]
        t = w[i] * diff * diff
        d2 = t if d2 is None else d2 + t
    return d2


def _rows_vec(x, w, s, values, first, left, packed, bits: int, row: int = ROW):
    """_nearest_in_rows op by op over all `row` places at once (the path without a kernel: CUDA, no compiler)."""
    place = torch.arange(row, device=x.device).unsqueeze(1)
    ok = left.unsqueeze(0) > place                                           # (ROW, R)
    p = packed.view(-1)[torch.where(ok, first.unsqueeze(0) + place, 0)]
    d2 = torch.where(ok, _distance(p, x, w, s, values, bits), torch.tensor(float("inf"), device=x.device))
    at = d2.argmin(0)                                                        # the first of equal minima
    return d2.gather(0, at.unsqueeze(0)).squeeze(0), at


@fused(eager=_rows_vec)
def _nearest_in_rows(x, w, s, values, first, left, packed, bits: int):
    """Rows of one group's candidates: x, w (dim, R) the group's values and weights; s (R,) the scale; values
    (levels, R) the level values or None (odd integers); first (R,) the row's first entry of the flat lists;
    left (R,) how many of its list's candidates are left from there (>= 1); packed (entries, 1) each listed
    candidate's levels, `bits` each -> (least distance (R,), its first place in the row (R,))."""
    best = at = None
    for j in range(ROW):
        ok = left > j
        d2 = _distance(packed.view(-1)[torch.where(ok, first + j, 0)], x, w, s, values, bits)
        if best is None:                    # every row has its first candidate
            best, at = d2, torch.zeros_like(first)
        else:
            better = ok & (d2 < best)
            best = torch.where(better, d2, best)
            at = torch.where(better, j, at)
    return best, at


def best_neighbour(tab: GridTables, u: torch.Tensor, xval: torch.Tensor, waux: torch.Tensor,
                   scale: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """For off-grid groups: u (g,) their level index, xval / waux (dim, g), scale (g,), the level values
    (2**bits, g) or None for the odd integers 2l + 1 -> the grid index (g,) of the first candidate of u's list
    with the least Σ waux·(scale·q - x)²."""
    lists = tab.row_of[u]
    start = tab.start[lists]
    _, place = nearest_in_lists(tab, start, tab.count[lists], xval, waux, scale, values)
    return tab.flat.index_select(0, start + place)


def nearest_in_lists(tab: GridTables, start: torch.Tensor, count: torch.Tensor, xval: torch.Tensor,
                     waux: torch.Tensor, scale: torch.Tensor, values: torch.Tensor | None = None):
    """The search of best_neighbour over the runs count (g,) >= 1 of tab.flat's candidates from start (g,) ->
    (least distance (g,), its first place in the run (g,))."""
    g = start.numel()
    dev = start.device
    n_rows = (count + (ROW - 1)) // ROW
    if bool((n_rows == 1).all()):
        group, step = None, torch.zeros_like(count)
    else:
        total = int(n_rows.sum())
        group = torch.repeat_interleave(torch.arange(g, device=dev), n_rows, output_size=total)
        step = (torch.arange(total, device=dev) - (torch.cumsum(n_rows, 0) - n_rows).index_select(0, group)) * ROW

    def rows(t):                            # (k, g) or (g,) -> each group's columns repeated for its rows
        if group is None:
            return t
        return t.index_select(t.dim() - 1, group)
    first, left = rows(start) + step, rows(count) - step
    d2, at = _nearest_in_rows(rows(xval), rows(waux), rows(scale), None if values is None else rows(values),
                              first, left, tab.packed, tab.bits)
    place = step + at
    if group is not None:
        # distances are >= +0, so their float32 bits order as they do; the place below them keeps the first of
        # equal ones; the key (< 2**40) is exact in float64
        key = ((d2.view(torch.int32).to(torch.int64) << _PLACE_BITS) | place).double()
        best = torch.segment_reduce(key, "min", lengths=n_rows).to(torch.int64)
        place = best & ((1 << _PLACE_BITS) - 1)
        d2 = (best >> _PLACE_BITS).to(torch.int32).view(_F32)
    return d2, place
