"""The lattices of llama.cpp's IQ1-IQ3 types and the neighbour lists its quantizers search, as data.

Each IQ type stores a group of 4 (IQ3) or 8 (IQ1, IQ2) values as the index of one point of a fixed grid.  The
points are taken from gguf-py's tables (``gguf.quants.IQ3_S.grid`` ..., the same points, in the same order, as
ggml-common.h's ``iq3s_grid`` ...), each written as its levels ``l`` (the value is ``grid_map[l]``).

ggml-quants.c's quantizers (``iq2xs_init_impl``, ``iq3xs_init_impl``) work on the odd integers ``2l + 1``: a
group's rounded levels form an index ``u`` (``bits`` bits per level); if ``u`` is a grid point the group takes
it, otherwise the quantizer searches a list made once per type: the grid points at the ``nwant`` smallest
squared distances from ``u``'s point, in the order (distance, grid index).  The lists are rebuilt here the same
way, vectorized, and kept as one flat array with each list's start and length (the lists' lengths differ by
two orders of magnitude, so a padded table would mostly hold padding).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as _gguf_quants

__all__ = ["GridTables", "grid_tables", "GRID_TYPES"]

QT = GGMLQuantizationType

# type -> (gguf-py class holding the grid, bits per level in an index, nwant: how many distinct distances the
# neighbour lists span); ggml-quants.c's iq2xs_init_impl / iq3xs_init_impl
_SPECS = {
    QT.IQ2_XXS: (_gguf_quants.IQ2_XXS, 2, 2),
    QT.IQ2_XS: (_gguf_quants.IQ2_XS, 2, 2),
    QT.IQ2_S: (_gguf_quants.IQ2_S, 2, 1),
    QT.IQ1_S: (_gguf_quants.IQ1_S, 2, 3),
    QT.IQ1_M: (_gguf_quants.IQ1_S, 2, 3),
    QT.IQ3_XXS: (_gguf_quants.IQ3_XXS, 3, 2),
    QT.IQ3_S: (_gguf_quants.IQ3_S, 3, 3),
}
GRID_TYPES = frozenset(_SPECS)


@dataclass(frozen=True)
class GridTables:
    levels: torch.Tensor       # (n_grid, dim) int32: each grid point's levels l
    index_of: torch.Tensor     # (2**(bits*dim),) int32: grid index of the point with index u, or -1
    row_of: torch.Tensor       # (2**(bits*dim),) int64: u's list (-1: on the grid or unreachable)
    start: torch.Tensor        # (lists,) int64: where each list begins in `flat`
    count: torch.Tensor        # (lists,) int64: its length
    flat: torch.Tensor         # (Σ count,) int64: the candidates (grid indices), list after list
    packed: torch.Tensor       # (Σ count, 1) int32: the levels of each of `flat`'s candidates, l_i << bits·i
    codes: torch.Tensor        # (n_grid,) int32: each grid point's levels the same way (its index u)
    bits: int
    dim: int

    def index(self, L: torch.Tensor) -> torch.Tensor:
        """Levels (..., dim) -> the index u = sum L[i] << bits*i."""
        sh = torch.arange(self.dim, device=L.device, dtype=torch.int32) * self.bits
        return (L.to(torch.int32) << sh).sum(-1)

    def by_group(self, t: torch.Tensor) -> torch.Tensor:
        """(sub, m) values whose groups are `dim` consecutive rows -> (dim, groups·m), column group·m + j: the
        layout from which one index_select over columns gives groups' values contiguous, as the neighbour
        kernel takes them."""
        sub, m = t.shape
        return t.view(sub // self.dim, self.dim, m).permute(1, 0, 2).reshape(self.dim, -1)

    def to(self, device) -> "GridTables":
        if self.levels.device == torch.device(device):
            return self
        return GridTables(*(getattr(self, f).to(device) for f in
                            ("levels", "index_of", "row_of", "start", "count", "flat", "packed", "codes")),
                          self.bits, self.dim)


def _grid_levels(cls) -> np.ndarray:
    cls.init_grid()
    values = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    levels = np.searchsorted(np.asarray(cls.grid_map, dtype=np.float32), values)
    assert np.array_equal(np.asarray(cls.grid_map, dtype=np.float32)[levels], values)
    return levels.astype(np.int32)


def _neighbour_lists(points: np.ndarray, grid: np.ndarray, nwant: int) -> np.ndarray:
    """For each row of `points` (odd-integer coordinates): the grid indices at its nwant smallest distinct
    squared distances, ordered by (distance, index), padded with -1.  Rows are independent and done in blocks
    of 256 K distances, of which only the listed columns are kept (~8 arrays of 2 MB live at once): all at once,
    IQ2_S's 65536 × 1024 distances took ~2 GB for a moment, and blocks of 2048 rows kept whole still added
    270 MiB to the peak of a run with IQ1's 2048-point grid."""
    n_grid = grid.shape[0]
    rows = max(1, (1 << 18) // n_grid)
    g = grid.astype(np.int64)
    g2 = (g * g).sum(1)[None, :]
    parts = []
    for a in range(0, len(points), rows):
        p = points[a:a + rows].astype(np.int64)
        d2 = (p * p).sum(1)[:, None] + g2 - 2 * (p @ g.T)
        key = np.sort(d2 * n_grid + np.arange(n_grid)[None, :], axis=1)
        dist, idx = key // n_grid, key % n_grid
        rank = np.concatenate([np.zeros((len(p), 1), np.int64), np.cumsum(dist[:, 1:] != dist[:, :-1], axis=1)], 1)
        keep = rank < nwant
        width = int(keep.sum(1).max())          # the lists are sorted: what a block keeps is its first columns
        parts.append(np.where(keep[:, :width], idx[:, :width], -1).astype(np.int32))
    width = max((q.shape[1] for q in parts), default=0)
    return np.concatenate([np.pad(q, ((0, 0), (0, width - q.shape[1])), constant_values=-1) for q in parts]) \
        if parts else np.zeros((0, 0), np.int32)


@functools.cache
def grid_tables(qtype: GGMLQuantizationType) -> GridTables:
    """The tables of one IQ type (built once per process, ~0.1-1 s)."""
    cls, bits, nwant = _SPECS[GGMLQuantizationType(qtype)]
    levels = _grid_levels(cls)
    n_grid, dim = levels.shape
    size = 1 << (bits * dim)
    shifts = bits * np.arange(dim)
    index_of = np.full(size, -1, dtype=np.int32)
    code = (levels.astype(np.int64) << shifts).sum(1)           # each grid point's levels as an index u
    index_of[code] = np.arange(n_grid, dtype=np.int32)
    # the quantizers clamp levels to the grid's range, so only indices whose levels all lie in it are looked up
    top = int(levels.max())
    all_u = np.arange(size)
    u_levels = (all_u[:, None] >> shifts[None, :]) & ((1 << bits) - 1)
    wanted = (index_of < 0) & (u_levels <= top).all(1)
    lists = _neighbour_lists(2 * u_levels[wanted] + 1, 2 * levels + 1, nwant)
    row_of = np.full(size, -1, dtype=np.int64)
    row_of[wanted] = np.arange(int(wanted.sum()))
    count = (lists >= 0).sum(1)
    start = np.cumsum(count) - count
    flat = lists[lists >= 0].astype(np.int64)
    return GridTables(levels=torch.from_numpy(levels),
                      index_of=torch.from_numpy(index_of), row_of=torch.from_numpy(row_of),
                      start=torch.from_numpy(start), count=torch.from_numpy(count),
                      flat=torch.from_numpy(flat),
                      packed=torch.from_numpy(code[flat].astype(np.int32).reshape(-1, 1)),
                      codes=torch.from_numpy(code.astype(np.int32)),
                      bits=bits, dim=dim)
