"""IQ1's exact split search (step 2 of iq1_encoders.py): which candidate llama.cpp's running pick keeps, found
without replaying every candidate, with fused CPU kernels for the passes over all of them.

A sub-block's candidates are the cut pairs (i1 <= i2) of its sorted values and the shifts (IQ1_S: two, IQ1_M:
four), in llama.cpp's order (i1, then i2, then the shift): 1122 for IQ1_S, 612 for IQ1_M.  Each has
a = Σw·x·q and b = Σw·q² from prefix sums, and the C keeps, in that order, every candidate with b > 0 and float32
a·a > best·b, then best = (a/b)·a.  Its last such candidate is what counts, and that is one of (nearly) the
largest key a²/b.

Keys are compared here in float32 (key = a·a/b).  Where two keys differ by more than the relative DELTA, the C's
test orders the two candidates as the keys do: its products and this quotient are each within a few float32
roundings of a²/b (5 units of 2^-24 in all, 3e-7, with the threshold's own rounding), while those products are
normal numbers (_TINY).  So for a threshold T with no key in [T·(1 - 2·DELTA), T), the first candidate of
key >= T is taken whatever came before it, and no candidate below the gap is taken after it: replaying only the
candidates of key >= T, from the start state, keeps what the C keeps.  Each sub-block tries the thresholds
T = best key · (1 - ε) for ε in EPSILONS, nearest first, and takes the first with such a gap and at most CAP
candidates above it (on the bench's tensors 99.2 % of the sub-blocks; mostly one or two candidates).  The rest
sort their keys for the highest clean threshold, whatever its count; where the keys cannot decide, every
candidate is replayed.

The passes over all candidates (best key; the counts above and in the gap below each threshold; which are
above the chosen one) recompute the candidates' sums from the prefix sums and never store them.  The replay
takes a few candidates one by one; many (the sorted fallback) as a path followed by doubling (_run_as_path).
"""

from __future__ import annotations

import numpy as np
import torch

from .exact import _div, _f32
from .fusion import fused

__all__ = ["pick", "unravel"]

_F32 = torch.float32
DELTA = 1e-6
EPSILONS = (0.0, 3e-6, 1e-5, 3e-5, 1e-4, 1e-3)
CAP = 16
# the keys decide only where the C's products are normal numbers (in the subnormal range their rounding is
# absolute and can outweigh DELTA): every candidate's b is at least Σw/64 (|q| >= 1/8), so above a threshold T
# both a·a and best·b are at least T·Σw/64, and T·Σw >= 2^-99 keeps them 2^20 above that range
_TINY = 2.0 ** -99
_DELTA8 = 0.125
X_P = (-1 + _DELTA8, _DELTA8, 1 + _DELTA8)      # a group's level values with the + shift; exact in float32
X_M = (-1 - _DELTA8, -_DELTA8, 1 - _DELTA8)


def _sq_diff(u, v) -> float:
    return _f32(np.float32(u) * np.float32(u) - np.float32(v) * np.float32(v))


# IQ1_M's Σwq² of one group of 8 from its prefix sums: total·q2² + (values below i1)·(q0² - q1²) + (values below
# i2)·(q1² - q2²), the coefficients rounded to float32 as llama.cpp's are
_M_COEF = {True: (X_P[2], _sq_diff(X_P[0], X_P[1]), _sq_diff(X_P[1], X_P[2])),
           False: (X_M[2], _sq_diff(X_M[0], X_M[1]), _sq_diff(X_M[1], X_M[2]))}


@fused
def prefix_sums(vals, ws, half):
    """The running sums, from 0, of w·x and w over each sub-block's sorted values vals and their weights ws
    (n, m), added one by one as the C adds them: P (2, n + 1, m) for IQ1_S (half None); for IQ1_M, where half
    (n, m) says which group of 8 each sorted value is in, those of each group: P (4, n + 1, m)."""
    zero = torch.zeros_like(vals[0])
    groups = (None,) if half is None else (False, True)
    sx = [[zero] for _ in groups]
    sw = [[zero] for _ in groups]
    for j in range(vals.shape[0]):
        for h, mine in enumerate(groups):
            x, w = sx[h][-1] + ws[j] * vals[j], sw[h][-1] + ws[j]
            if mine is not None:
                x, w = torch.where(half[j] == mine, x, sx[h][-1]), torch.where(half[j] == mine, w, sw[h][-1])
            sx[h].append(x)
            sw[h].append(w)
    return torch.stack([torch.stack(t) for t in sx + sw])


def shifts(kind: str) -> int:
    return 2 if kind == "s" else 4


def _sums_s(P, at1, at2, k):
    """IQ1_S, P (2, 33, m) the prefix sums of w·x and w over the sorted values: (a, b) of the candidates whose
    rows of P are at1 / at2 (broadcast index functions) and whose shift is k (0: +, 1: -)."""
    sx, sw = P[0], P[1]
    n = sx.shape[0] - 1
    x0, x1, x2 = (torch.where(k == 0, _f32(p), _f32(q)) for p, q in zip(X_P, X_M))
    a = (at1(sx) - sx[0]) * x0 + (at2(sx) - at1(sx)) * x1 + (sx[n] - at2(sx)) * x2
    b = (at1(sw) - sw[0]) * x0 * x0 + (at2(sw) - at1(sw)) * x1 * x1 + (sw[n] - at2(sw)) * x2 * x2
    return a, b


def _sums_m(P, at1, at2, k):
    """IQ1_M, P (4, 17, m) the prefix sums of w·x for each group of 8, then of w, over the sub-block's sorted
    values: (a, b) as _sums_s, k = 2·(first group's shift is -) + (second's is -)."""
    n = P.shape[1] - 1
    a = b = None
    for h, plus in ((0, k < 2), (1, k % 2 == 0)):
        px, pw = P[h], P[2 + h]
        c2, c01, c12 = (torch.where(plus, p, q) for p, q in zip(_M_COEF[True], _M_COEF[False]))
        qx = px[n] * c2 - (at1(px) + at2(px))
        q2 = pw[n] * c2 * c2 + at1(pw) * c01 + at2(pw) * c12
        a, b = (qx, q2) if a is None else (a + qx, b + q2)
    return a, b


_SUMS = {"s": _sums_s, "m": _sums_m}


def _total_weight(P, kind):
    """Σw of each sub-block (m,)."""
    return P[1, -1] if kind == "s" else P[2, -1] + P[3, -1]


def candidates(n1: int, kind: str) -> int:
    return n1 * (n1 + 1) // 2 * shifts(kind)


def unravel(c: torch.Tensor, n1: int, kind: str):
    """Candidate index -> (i1, i2, shift)."""
    k = shifts(kind)
    i1, i2 = torch.triu_indices(n1, n1, device=c.device)
    return i1[c // k], i2[c // k], c % k


def _all_sums(P, kind):
    """(a, b, valid) of every candidate (C, m); valid: b > 0."""
    n1 = P.shape[1]
    i1, i2, k = unravel(torch.arange(candidates(n1, kind), device=P.device), n1, kind)
    a, b = _SUMS[kind](P, lambda t: t[i1], lambda t: t[i2], k.unsqueeze(1))
    return a, b, b > 0


def _keys(P, kind):
    """Every candidate's key (C, m), -inf where it is not valid."""
    a, b, valid = _all_sums(P, kind)
    return torch.where(valid, a * a / torch.where(valid, b, 1.0), -float("inf"))


@fused
def _best_key(P, kind: str):
    """The largest key of each sub-block's candidates (m,)."""
    return _keys(P, kind).amax(0)


@fused
def _counts(P, T, low, kind: str):
    """For each threshold T (E, m) and the bottom of its gap `low` (E, m): (candidates with key >= T, candidates
    with low <= key < T) as (2, E, m)."""
    key = _keys(P, kind)
    above = [(key >= t).sum(0, dtype=torch.int32) for t in T]
    gap = [((key >= lo) & (key < t)).sum(0, dtype=torch.int32) for t, lo in zip(T, low)]
    return torch.stack([torch.stack(above), torch.stack(gap)])


@fused
def _above(P, T, kind: str):
    """Which candidates (C, m) have key >= T (m,), as int32 (stored as bool or uint8, Inductor's vectors take
    5-8x the time)."""
    return (_keys(P, kind) >= T).to(torch.int32)


def _first(mask: torch.Tensor, dim: int = 0, keepdim: bool = False) -> torch.Tensor:
    """Index of the first True along dim (its size where none): a minimum over int64 (argmax over bool or uint8
    does not vectorize)."""
    at = torch.arange(mask.shape[dim], device=mask.device).view([-1] + [1] * (mask.dim() - dim - 1))
    return torch.where(mask, at, mask.shape[dim]).amin(dim, keepdim=keepdim)


def _in_order(mask: torch.Tensor, C: int) -> torch.Tensor:
    """mask (C, m) -> each column's candidates in order as the rows of an (R, m) index, padded with C."""
    m = mask.shape[1]
    cand, col = mask.nonzero(as_tuple=True)                   # row-major: candidates ascending
    keep = torch.argsort(col, stable=True)
    cand, col = cand[keep], col[keep]
    counts = torch.bincount(col, minlength=m)
    rank = torch.arange(col.numel(), device=col.device) - (torch.cumsum(counts, 0) - counts)[col]
    order = torch.full((int(counts.max().item()) if col.numel() else 0, m), C, dtype=torch.int64, device=mask.device)
    order[rank, col] = cand
    return order


_FEW = 24      # up to this many candidates a column, _run takes them one by one; beyond, as a path


def _run(order, a, b, C):
    """llama.cpp's running pick over the candidates `order` (R, m) (padding: C) whose sums are a, b (R, m)
    -> (chosen candidate or -1, scale)."""
    R, m = order.shape
    if R > _FEW:
        return _run_as_path(order, a, b, C)
    chosen = torch.full((m,), -1, dtype=torch.int64, device=order.device)
    scale = torch.zeros(m, dtype=_F32, device=order.device)
    best = torch.full((m,), -float(np.finfo(np.float32).max), dtype=_F32, device=order.device)
    for row, ar, br in zip(order, a, b):
        take = (row < C) & (br > 0) & (ar * ar > best * br)
        scale = torch.where(take, _div(ar, br), scale)
        best = torch.where(take, scale * ar, best)
        chosen = torch.where(take, row, chosen)
    return chosen, scale


def _run_as_path(order, a, b, C):
    """_run for many candidates a column: the candidates kept form a path (the first that passes the test
    against the start state, then from each one kept the first later one that passes the test against it), so
    every (kept, next) test is made at once and the path followed by doubling: log2(R) steps, not R."""
    R, m = order.shape
    ok = (order < C) & (b > 0)
    scale = _div(a, torch.where(ok, b, 1.0))
    best = scale * a
    aa = a * a
    rows = torch.arange(R, device=order.device).view(R, 1)
    first = ok & (aa > _f32(-np.finfo(np.float32).max) * b)
    passes = (rows.unsqueeze(1) < rows.unsqueeze(0)) & ok & (aa.unsqueeze(0) > best.unsqueeze(1) * b)
    # passes[t, c]: c after t passes the test against t's state; next[t]: the first such c, else t itself
    nxt = _first(passes, 1)
    nxt = torch.where(nxt < R, nxt, rows)
    for _ in range((R - 1).bit_length()):
        nxt = nxt.gather(0, nxt)
    start = _first(first, 0, keepdim=True)
    kept = start.squeeze(0) < R
    last = nxt.gather(0, start.clamp(max=R - 1))
    return (torch.where(kept, order.gather(0, last).squeeze(0), -1),
            torch.where(kept, scale.gather(0, last).squeeze(0), 0.0))


def _sums_of(P, kind, order, C):
    """(a, b) (R, m) of the candidates `order` (R, m) (padding: C)."""
    i1, i2, k = unravel(order.clamp(max=C - 1), P.shape[1], kind)
    return _SUMS[kind](P, lambda t: t.gather(0, i1), lambda t: t.gather(0, i2), k)


def _replayed(P, kind, order, C, budget: int = 1 << 22):
    """_run over `order`, its columns in batches that keep the (R, R, columns) tests within `budget`."""
    R, m = order.shape
    step = max(1, budget // max(1, R * R))
    if step >= m:
        return _run(order, *_sums_of(P, kind, order, C), C)
    parts = [_run(order[:, j:j + step], *_sums_of(P[..., j:j + step], kind, order[:, j:j + step], C), C)
             for j in range(0, m, step)]
    return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])


def _least_clean(key: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """The largest threshold T (m,) of the keys (C, m) with no key in [T·(1 - 2·DELTA), T): a key that the next
    lower one (sorted) falls that far short of.  Where the best key is 0 (every a = 0: the C keeps its first
    valid candidate) the first valid candidate alone: T above every key (inf) with that one added by the
    caller; where it is not finite, or too small for the keys to decide (_TINY), -inf: every candidate is
    replayed."""
    ks = key.sort(0, descending=True).values
    short = ks[1:] < ks[:-1] * _f32(1 - 2 * DELTA)
    j = _first(short, 0, keepdim=True)
    T = torch.where(j.squeeze(0) < short.shape[0], ks.gather(0, j.clamp(max=short.shape[0] - 1)).squeeze(0),
                    -float("inf"))
    g = ks[0]
    T = torch.where(T * W >= _TINY, T, -float("inf"))
    return torch.where(torch.isfinite(g) & (g > 0), T, torch.where(g == 0, float("inf"), -float("inf")))


def _slow(P, kind, C):
    """pick() for the sub-blocks no threshold of the kernels' served: their keys sorted for the least clean
    threshold, and the path over all candidates above it."""
    key = _keys(P, kind)
    T = _least_clean(key, _total_weight(P, kind))
    members = (key >= T) & (key > -float("inf"))
    zero = torch.isinf(T) & (T > 0)                                 # best key 0: the first valid candidate
    members[_first(key > -float("inf")).clamp(max=key.shape[0] - 1), torch.arange(key.shape[1], device=key.device)] |= zero
    return _replayed(P, kind, _in_order(members, C), C)


def pick(P: torch.Tensor, kind: str):
    """P: the prefix sums ("s": (2, 33, m), "m": (4, 17, m)) -> (the candidate llama.cpp keeps (m,), -1 where
    none has b > 0; its scale a/b)."""
    n1 = P.shape[1]
    C = candidates(n1, kind)
    g = _best_key(P, kind)
    T = g.unsqueeze(0) * torch.tensor([_f32(1 - e) for e in EPSILONS], device=P.device).unsqueeze(1)
    above, gap = _counts(P, T, T * _f32(1 - 2 * DELTA), kind)
    ok = (gap == 0) & (above >= 1) & (above <= CAP) & torch.isfinite(g) & (T * _total_weight(P, kind) >= _TINY)
    fast = ok.any(0)
    at = _first(ok, 0, keepdim=True).clamp(max=len(EPSILONS) - 1)           # the nearest clean threshold
    order = _in_order(_above(P, torch.where(fast, T.gather(0, at).squeeze(0), float("inf")), kind), C)
    chosen, scale = _run(order, *_sums_of(P, kind, order, C), C)
    none = torch.isinf(g) & (g < 0)                                          # no valid candidate: -1
    slow = (~fast & ~none).nonzero().squeeze(1)
    if slow.numel():
        chosen[slow], scale[slow] = _slow(P.index_select(-1, slow), kind, C)
    return chosen, scale
