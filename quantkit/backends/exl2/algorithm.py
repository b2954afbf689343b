"""EXL2's quantizer (exllamav2 0.3.2's AdaptiveGPTQ, ../shared/docs/formats/exl2.md §4) in plain torch.

One linear, weight W (N outputs, K inputs), calibration Hessian H (K, K), and a `RowLayout` that splits the K
input rows into groups of one bit width each:

1. act-order: rows visited by decreasing H[d, d]; the permutation is stored (q_invperm), so groups are runs
   of rows in that order, the widest bits first: the most active inputs get the most bits.
2. Damp H by 0.12·mean(diag H) (raised further when the Cholesky factorization fails); U = the upper Cholesky
   factor of H⁻¹.
3. Per group, on the rows as the error feedback has left them: a scale per output column,
   scale = (qs/16)²·m with a 4-bit code qs ∈ 1 … 16 under the group's maximum m, and m multiplied by the best
   p on a 97-point grid in [0.70, 1.20] for Σ|q(w) − w|^3.5 (searched coarse to fine: on the CPU the scan is
   most of a quantization's time, and a measurement runs ~100 of them per layer).  The scale is rounded as the kernels compute it
   (float16 qs² times float16 m/256), so the error feedback sees the weights a runtime reconstructs.
4. Codes q = clamp(rint(w/scale) + 2^(b−1), 0, 2^b − 1) row by row; each row's error (w − q̂)/U[c, c] goes to
   the rows left in the group at once and, when the group ends, to all later rows in one matmul.

`q_proj`'s H, permutation and factor serve k_proj and v_proj too (the same input), and one factorization
serves every candidate layout of a measurement (`Prepared`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import QuantizationError
from .layouts import Group, RowLayout

DAMP = 0.12
NORM = 3.5
P_MIN, P_MAX, P_GRID = 0.70, 1.20, 96
_PRESCALE = torch.tensor(1 / 256, dtype=torch.float16)


@dataclass
class Prepared:
    """What every layout of one input shares: the act-order permutation and the factor U of H⁻¹ (permuted)."""
    perm: torch.Tensor        # (K,) int64: processing position k holds input row perm[k]
    U: torch.Tensor           # (K, K) float32, upper triangular
    damp: float


@dataclass
class EXL2Linear:
    """One quantized linear in storage terms (rows = inputs in processing order)."""
    layout: RowLayout
    groups: list[Group]
    perm: torch.Tensor        # (K,) int64
    codes: torch.Tensor       # (K, N) int16, processing order
    qscale: torch.Tensor      # (G, N) int16, 1 … 16
    scale_max: torch.Tensor   # (G,) float16
    weight: torch.Tensor      # (N, K) float32: the dequantized weight in the original input order


def prepare(H: torch.Tensor, damp: float = DAMP, attempts: int = 10) -> Prepared:
    H = H.float()
    if not torch.isfinite(H).all():
        raise QuantizationError("the calibration Hessian is not finite (NaN/inf activations)")
    perm = torch.argsort(torch.diag(H), descending=True)
    H = H[perm][:, perm]
    step = max(damp * torch.mean(torch.diag(H)).item(), 1e-5)
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    for attempt in range(1, attempts + 1):
        L, info = torch.linalg.cholesky_ex(H + attempt * step * eye)
        if info.item() == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if info.item() == 0 and torch.isfinite(U).all():
                return Prepared(perm, U, damp * attempt)
    raise QuantizationError(f"the Hessian stays singular after {attempts}× the dampening; use more or more varied "
                            "calibration data")


def stored_scale(qscale: torch.Tensor, scale_max: torch.Tensor) -> torch.Tensor:
    """The scale a runtime reconstructs: float16 qs² × float16 (scale_max / 256), in float32."""
    return ((qscale * qscale).to(torch.float16) * (scale_max.to(torch.float16) * _PRESCALE.to(qscale.device))).float()


def _p_errors(x: torch.Tensor, trial: torch.Tensor, points: torch.Tensor, maxq: int, qzero: int) -> torch.Tensor:
    """Σ |q(x) − x|^3.5 over the group for each grid point (index into the 97-point p grid)."""
    frac = points.to(torch.float32) / P_GRID
    s = trial[None, :] * (P_MIN * (1 - frac) + P_MAX * frac)[:, None]      # (P, N)
    err = torch.zeros(points.numel(), device=x.device)
    chunk = max(1, (1 << 22) // (points.numel() * x.shape[1]))            # rows at a time: (P, rows, N) ~16 MB
    for r in range(0, x.shape[0], chunk):
        rows = x[r:r + chunk][None]
        q = torch.clamp(torch.round(rows / s[:, None, :]), -qzero, maxq - qzero) * s[:, None, :]
        e = (q - rows).abs_()
        err += (e * e * e * e.sqrt()).sum(dim=(1, 2))                     # |e|^3.5, without pow's exp and log
    return err


def find_scales(x: torch.Tensor, bits: int, coarse: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(qscale (N,) in 1 … 16, scale_max float16 scalar) for the rows x (rows, N) of one group.

    p is chosen among exllamav2's 97 grid points, coarse to fine: every `coarse`-th point, then every point
    within `coarse` of the best of those (28 evaluations instead of 97; coarse=1 is the full scan)."""
    maxq, qzero = 2 ** bits - 1, 2 ** (bits - 1)
    base = (x.abs().amax(dim=0) + 1e-12) / (maxq / 2)
    top = base.max()
    qscale = torch.clamp(torch.round(torch.sqrt(base / top) * 16), 1, 16)
    trial = (qscale / 16) ** 2 * top
    points = torch.arange(0, P_GRID + 1, coarse, device=x.device)
    err = _p_errors(x, trial, points, maxq, qzero)
    best = int(points[torch.argmin(err)])
    if coarse > 1:
        points = torch.arange(max(0, best - coarse + 1), min(P_GRID, best + coarse - 1) + 1, device=x.device)
        err = _p_errors(x, trial, points, maxq, qzero)
        best = int(points[torch.argmin(err)])
    frac = best / P_GRID
    best_p = P_MAX * frac + P_MIN * (1 - frac)
    return qscale.to(torch.int16), (top * best_p).to(torch.float16)


def quantize(W: torch.Tensor, prep: Prepared, layout: RowLayout) -> EXL2Linear:
    """Quantize W (N, K) under `layout` with the shared permutation and factor; see the module docstring."""
    N, K = W.shape
    W = W.to(prep.perm.device)       # the work runs where the Hessian's factor is (the job's device)
    if not torch.isfinite(W).all():
        raise QuantizationError("the weights contain NaN or inf")
    weights = W.float().t()[prep.perm].contiguous()                  # (K, N), processing order
    U = prep.U
    groups = layout.groups(K)
    codes = torch.empty(K, N, dtype=torch.int16, device=W.device)
    quant = torch.empty(K, N, dtype=torch.float32, device=W.device)
    error = torch.empty(K, N, dtype=torch.float32, device=W.device)
    qscales, maxima = [], []
    for g in groups:
        a, b = g.start, g.end
        maxq, qzero = 2 ** g.bits - 1, 2 ** (g.bits - 1)
        qscale, scale_max = find_scales(weights[a:b], g.bits)
        scale = stored_scale(qscale, scale_max)
        qscales.append(qscale)
        maxima.append(scale_max)
        for c in range(a, b):
            q = torch.clamp(torch.round(weights[c] / scale) + qzero, 0, maxq)
            codes[c] = q.to(torch.int16)
            quant[c] = ((q - qzero).to(torch.float16) * scale.to(torch.float16)).float()
            error[c] = (weights[c] - quant[c]) / U[c, c]
            if c + 1 < b:
                weights[c + 1:b].addr_(U[c, c + 1:b], error[c], alpha=-1.0)
        if b < K:
            weights[b:].addmm_(U[a:b, b:].t(), error[a:b], alpha=-1.0)
    inverse = torch.argsort(prep.perm)
    return EXL2Linear(layout, groups, prep.perm, codes, torch.stack(qscales), torch.stack(maxima),
                      quant[inverse].t().contiguous())


def dequantize(codes: torch.Tensor, groups: list[Group], qscale: torch.Tensor, scale_max: torch.Tensor,
               perm: torch.Tensor) -> torch.Tensor:
    """(N, K) float32 weight from processing-order codes (K, N), as the kernels reconstruct it in float16."""
    K, N = codes.shape
    rows = torch.empty(K, N, dtype=torch.float16, device=codes.device)
    for i, g in enumerate(groups):
        scale = stored_scale(qscale[i, :N].to(torch.int32), scale_max[i]).to(torch.float16)
        rows[g.start:g.end] = (codes[g.start:g.end].to(torch.int32) - 2 ** (g.bits - 1)).to(torch.float16) * scale
    return rows[torch.argsort(perm)].t().float()
