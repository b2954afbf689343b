"""llama.cpp's make_qp_quants: the importance-weighted search for a scale of non-negative values on 0..nmax,
used for the K-quants' sub-block scales (Q2_K, Q4_K, Q5_K) and IQ2_XXS's first guess; exact like encoders.py."""

from __future__ import annotations

import numpy as np
import torch

from .exact import (_any_big, _div, _nearest_int, _ni, _pos_max, _recip, _round_ni, _seqsum, _u8)

__all__ = ["make_qp_quants"]

_F32 = torch.float32
_GROUP_MAX_EPS = float(np.float32(1e-15))


def make_qp_quants(x: torch.Tensor, nmax: int, w: torch.Tensor):
    """make_qp_quants(n, nmax, x, L, quant_weights=w).  x, w: (n, m).
    Returns (scale (m,), L (n, m) float32)."""
    mx = _pos_max(x)
    zero = mx < _GROUP_MAX_EPS
    iscale = _div(float(nmax), mx)
    L = _u8(_nearest_int(iscale * x)).to(_F32)      # stored in uint8_t L[]
    scale = _recip(iscale)
    diff = x - scale * L
    best = _seqsum((w * diff) * diff)
    iss = [i for i in range(-4, 5) if i != 0]
    nums = (torch.tensor(0.1, dtype=_F32) * torch.tensor(iss, dtype=_F32) + float(nmax)).to(x.device)
    isc = _div(nums.unsqueeze(1), mx.unsqueeze(0))                       # (C, m)
    ssc = _recip(isc)
    bound = torch.where(zero, torch.zeros_like(mx), isc.abs().amax(0) * x.abs().amax(0))
    l = _round_ni(isc.unsqueeze(0) * x.unsqueeze(1), _any_big(bound)).clamp_(max=nmax)
    diff = x.unsqueeze(1) - ssc.unsqueeze(0) * l
    mse = _seqsum((w.unsqueeze(1) * diff) * diff)
    for c in range(len(iss)):
        upd = mse[c] < best
        best = torch.where(upd, mse[c], best)
        iscale = torch.where(upd, isc[c], iscale)
    L = _ni(iscale * x).clamp(max=nmax)
    wx = w * x
    # the sums take the int level; L[] keeps it as uint8_t, and later steps read the wrapped value (a negative
    # level occurs only for IQ2_XXS, whose sign parity can leave one value negative)
    sums = _seqsum(torch.stack([wx * L, (w * L) * L], 1))
    sumlx, suml2 = sums[0].clone(), sums[1].clone()
    L = _u8(L.to(torch.int32)).to(_F32).contiguous()
    n = x.shape[0]
    for _ in range(5):
        changed = torch.zeros_like(zero)
        for i in range(n):
            wi, wxi, xi, Li = w[i], wx[i], x[i], L[i]
            slx = sumlx - wxi * Li
            sl2 = suml2 - (wi * Li) * Li
            new_l = _ni(_div(xi * sl2, slx)).clamp(max=nmax)
            slx_n = slx + wxi * new_l
            sl2_n = sl2 + (wi * new_l) * new_l
            acc = ((slx > 0) & (sl2 > 0) & (new_l != Li)
                   & ((slx_n * slx_n) * suml2 > (sumlx * sumlx) * sl2_n))
            L[i] = torch.where(acc, _u8(new_l.to(torch.int32)).to(_F32), Li)
            sumlx = torch.where(acc, slx_n, sumlx)
            suml2 = torch.where(acc, sl2_n, suml2)
            changed |= acc
        if not bool(changed.any()):
            break
    scale = torch.where(suml2 > 0, _div(sumlx, suml2), torch.zeros_like(sumlx))
    L = torch.where(zero.unsqueeze(0), torch.zeros_like(L), L)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale, L
