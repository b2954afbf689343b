"""GPTQ (Frantar et al., 2022): quantize a weight matrix column by column, pushing each column's rounding
error onto the columns not yet quantized through the inverse Hessian of the layer's inputs.

    W (N, K)  — a linear's weight, rows = outputs; several linears reading the same input may be stacked.
    H (K, K)  — Σ xxᵀ over the calibration inputs of that linear (any positive scale: damping is relative).

Steps (../shared/docs/formats/gptq.md §6):
1. Inputs that never fire (H[d, d] = 0) get H[d, d] = 1 and a zero weight column.
2. act-order: visit columns by decreasing H[d, d] (most active inputs first, while most error can still be
   compensated).  Groups are then runs of `group_size` columns in visiting order, unless `static_groups`,
   where each group's grid is fixed up front from the untouched weights of the original column order.
   Without act-order the default is group-aware order: whole groups of original columns, the group with the
   most active input first, columns by decreasing H[d, d] inside each group (storage stays g_idx = i // g).
3. Damp: H += λ·mean(diag H)·I, λ = `damp`; if the Cholesky factorization fails, λ grows by
   `damp_step` until it succeeds (or reaches 1, then the layer is reported as numerically broken).
4. U = upper Cholesky factor of H⁻¹.  For each column i: pick the group's grid when a group starts,
   q = grid(wᵢ), e = (wᵢ − q)/U[i,i], and w_{j>i} −= e·U[i,j].  Updates inside a block of columns are
   applied at once; the rest of the matrix receives each block's errors in one matmul (lazy batching).
5. Undo the permutation.  The result holds the integer codes, per-group scales and zero points, g_idx
   (the group of every input column) and the dequantized weights the next layer's inputs are computed from.

The grids are per output row and group: symmetric grids are centred on 2^(b−1) and span ±max|w|; asymmetric
grids span [min(w, 0), max(w, 0)].  Scales are rounded to float16 before use, because that is how they are
stored, so the codes and the error feedback see exactly the weights a runtime will reconstruct.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import QuantizationError

FP16_TINY = 2.0 ** -24  # smallest positive float16 (subnormal): a scale may not round to zero


@dataclass(frozen=True)
class GPTQSettings:
    bits: int = 4
    group_size: int = 128          # -1: one group spanning the whole input dimension
    sym: bool = True
    act_order: bool = False
    static_groups: bool = False
    group_aware: bool = True       # without act-order: visit whole groups by importance (storage unchanged)
    damp: float = 0.01
    damp_step: float = 0.01        # 0 disables the automatic increase
    block_size: int = 128
    mse_grid: bool = False         # search a shrunk range per group (minimises Σ|w − q|^2.4)

    @property
    def maxq(self) -> int:
        return 2 ** self.bits - 1


@dataclass
class GPTQResult:
    codes: torch.Tensor      # (N, K) uint8, original column order
    scales: torch.Tensor     # (N, G) float32 holding float16 values
    zeros: torch.Tensor      # (N, G) int64, true zero points
    g_idx: torch.Tensor      # (K,) int32
    weight: torch.Tensor     # (N, K) float32, dequantized
    damp: float              # λ actually used
    loss: float              # Σ (w − q)² / U[i,i]² / 2, the proxy GPTQ minimises


def _grid(w: torch.Tensor, s: GPTQSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero for each row of w (rows × group columns)."""
    lo = w.min(dim=1).values.clamp(max=0)
    hi = w.max(dim=1).values.clamp(min=0)
    if s.mse_grid:
        lo, hi = _shrink_range(w, lo, hi, s)
    return _scale_zero(lo, hi, s)


def _scale_zero(lo: torch.Tensor, hi: torch.Tensor, s: GPTQSettings) -> tuple[torch.Tensor, torch.Tensor]:
    maxq = s.maxq
    if s.sym:
        amax = torch.maximum(-lo, hi)
        amax = torch.where(amax == 0, torch.ones_like(amax), amax)
        scale = 2 * amax / maxq
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        empty = (lo == 0) & (hi == 0)
        lo = torch.where(empty, -torch.ones_like(lo), lo)
        hi = torch.where(empty, torch.ones_like(hi), hi)
        scale = (hi - lo) / maxq
    if not torch.isfinite(scale).all() or scale.abs().max() > 65504:
        raise QuantizationError("a GPTQ scale is not finite in float16 (weights are NaN/inf or too large)")
    scale = scale.to(torch.float16).float().clamp(min=FP16_TINY)
    if not s.sym:
        zero = torch.round(-lo / scale).clamp(0, maxq)
    return scale, zero


def _shrink_range(w, lo, hi, s: GPTQSettings, steps: int = 80, grid: int = 100, norm: float = 2.4):
    best = torch.full_like(lo, float("inf"))
    best_lo, best_hi = lo.clone(), hi.clone()
    for i in range(steps):
        p = 1 - i / grid
        scale, zero = _scale_zero(p * lo, p * hi, s)
        q = _fake_quant(w, scale[:, None], zero[:, None], s.maxq)
        err = (q - w).abs().pow(norm).sum(dim=1)
        better = err < best
        best = torch.where(better, err, best)
        best_lo = torch.where(better, p * lo, best_lo)
        best_hi = torch.where(better, p * hi, best_hi)
    return best_lo, best_hi


def _codes(w, scale, zero, maxq):
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def _fake_quant(w, scale, zero, maxq):
    return scale * (_codes(w, scale, zero, maxq) - zero)


def inverse_cholesky(H: torch.Tensor, s: GPTQSettings) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + λ·mean(diag)·I)⁻¹, raising λ until the factorization succeeds."""
    _, U, damp = dampened_inverse(H, s)
    return U, damp


def dampened_inverse(H: torch.Tensor, s: GPTQSettings) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(H_λ⁻¹, its upper Cholesky factor, λ) for H_λ = H + λ·mean(diag)·I, raising λ until both factorizations
    succeed: `inverse_cholesky` with the inverse kept, for a caller that also solves with it."""
    mean_diag = torch.mean(torch.diag(H)).item()
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    damp = s.damp
    while True:
        L, info = torch.linalg.cholesky_ex(H + damp * mean_diag * eye)
        if info.item() == 0:
            inverse = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if info.item() == 0 and torch.isfinite(U).all():
                return inverse, U, damp
        if s.damp_step <= 0 or damp + s.damp_step >= 1:
            raise QuantizationError(f"the Hessian stays singular up to dampening {damp:.3f}; "
                                    f"use more or more varied calibration data, or a larger --damp")
        damp += s.damp_step


def visiting_order(importance: torch.Tensor, group_size: int, s: GPTQSettings) -> tuple[torch.Tensor, bool]:
    """(perm, groups_follow_columns): the column order, and whether each group is a fixed set of original
    columns (True: natural order, static groups, group-aware order) or a run in visiting order (act-order)."""
    K = importance.shape[0]
    if s.act_order:
        return torch.argsort(importance, descending=True), s.static_groups
    if not s.group_aware or group_size >= K:
        return torch.arange(K, device=importance.device), True
    # Group-aware order: whole groups, most important first (the partial last group stays last, so group
    # boundaries stay on multiples of group_size), and inside each group its columns by importance.
    full = K // group_size
    groups = list(range(full))
    peak = [importance[g * group_size:(g + 1) * group_size].max().item() for g in groups]
    groups.sort(key=lambda g: -peak[g])
    if K % group_size:
        groups.append(full)
    parts = []
    for g in groups:
        cols = torch.arange(g * group_size, min((g + 1) * group_size, K), device=importance.device)
        parts.append(cols[torch.argsort(importance[cols], descending=True)])
    return torch.cat(parts), True


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, s: GPTQSettings) -> GPTQResult:
    """Quantize W (N, K) given H (K, K); see the module docstring."""
    W = W.float().clone()
    H = H.float().clone()
    N, K = W.shape
    if not torch.isfinite(H).all():
        raise QuantizationError("the calibration Hessian is not finite (NaN/inf activations)")
    if not torch.isfinite(W).all():
        raise QuantizationError("the weights contain NaN or inf")
    gs = K if s.group_size == -1 else s.group_size
    groups = math.ceil(K / gs)

    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    perm, fixed_groups = visiting_order(torch.diag(H), gs, s)
    # Static groups and the single per-row group take their grids from the untouched weights.
    static = None
    if (s.act_order and s.static_groups) or s.group_size == -1:
        static = [_grid(W[:, g * gs:(g + 1) * gs], s) for g in range(groups)]
    W = W[:, perm]
    H = H[perm][:, perm]
    U, damp = inverse_cholesky(H, s)
    del H
    # The group of each visited column: its original column's group, or its run in visiting order.
    group_of = perm // gs if fixed_groups else torch.arange(K, device=W.device) // gs
    group_of_list = group_of.tolist()

    scales = torch.zeros(N, groups, device=W.device)
    zeros = torch.zeros(N, groups, device=W.device)
    if static is not None:
        for g, (scale, zero) in enumerate(static):
            scales[:, g], zeros[:, g] = scale, zero
    C = torch.zeros(N, K, device=W.device)  # codes, in visiting order
    d_list = torch.diag(U).tolist()
    loss = 0.0
    # Blocks hold whole groups, so a group's grid is always taken from fully updated columns.
    block = max(s.block_size // gs, 1) * gs if s.group_size != -1 else s.block_size
    scale = zero = None
    current = -1
    # The inner loop is the algorithm's only sequential part, so it is kept to a few fused in-place ops
    # per column (on a small model their fixed cost, not arithmetic, is what takes the time).
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            g = group_of_list[i1 + i]
            if g != current:  # a new group starts: its grid
                current = g
                if static is not None:
                    scale, zero = static[g]
                else:  # its columns are the next ones in visiting order (whole groups sit inside a block)
                    scale, zero = _grid(W1[:, i:i + min(gs, K - g * gs)], s)
                    scales[:, g], zeros[:, g] = scale, zero
            w = W1[:, i]
            c = torch.div(w, scale).round_().add_(zero).clamp_(0, s.maxq)
            C[:, i1 + i] = c
            err = (c - zero).mul_(scale).neg_().add_(w).div_(d_list[i1 + i])  # (w − q) / U[i, i]
            Err1[:, i] = err
            W1[:, i + 1:].addr_(err, U1[i, i + 1:], alpha=-1)
        W[:, i2:].addmm_(Err1, U[i1:i2, i2:], alpha=-1)
        loss += 0.5 * Err1.pow(2).sum().item()

    Q = scales[:, group_of] * (C - zeros[:, group_of])
    inv = torch.argsort(perm)
    return GPTQResult(codes=C[:, inv].to(torch.uint8), scales=scales, zeros=zeros.to(torch.int64),
                      g_idx=group_of[inv].to(torch.int32), weight=Q[:, inv], damp=damp, loss=loss)


def rtn_quantize(W: torch.Tensor, s: GPTQSettings) -> GPTQResult:
    """Round-to-nearest on the same grids (the baseline GPTQ must beat; no calibration)."""
    W = W.float()
    N, K = W.shape
    gs = K if s.group_size == -1 else s.group_size
    groups = math.ceil(K / gs)
    codes = torch.empty(N, K, dtype=torch.uint8, device=W.device)
    Q = torch.empty_like(W)
    scales = torch.empty(N, groups, device=W.device)
    zeros = torch.empty(N, groups, device=W.device)
    for g in range(groups):
        sl = slice(g * gs, min((g + 1) * gs, K))
        scale, zero = _grid(W[:, sl], s)
        c = _codes(W[:, sl], scale[:, None], zero[:, None], s.maxq)
        codes[:, sl] = c.to(torch.uint8)
        Q[:, sl] = scale[:, None] * (c - zero[:, None])
        scales[:, g], zeros[:, g] = scale, zero
    g_idx = (torch.arange(K, device=W.device) // gs).to(torch.int32)
    return GPTQResult(codes=codes, scales=scales, zeros=zeros.to(torch.int64), g_idx=g_idx, weight=Q,
                      damp=0.0, loss=0.0)
