"""AWQ (Lin et al., 2023): activation-aware weight quantization.

A linear's output error under 4-bit rounding is dominated by the few input channels whose activations are
large.  AWQ protects them without storing anything extra: it multiplies those input columns of the weight by
s > 1 before quantizing (their relative rounding error shrinks) and divides the op that produces the input
by s (a norm's weight, or the producing linear's output rows), so the float network is unchanged.  Then it
clips each group's range where a smaller range loses less than it saves.  ../shared/docs/formats/awq.md §3.

Per input group (linears reading one input), in the layer's true-sequential order:
1. Statistics of the group's input x over the calibration tokens: x̄ = mean |x| per channel, and H = mean xxᵀ.
2. Scale search: for α = k/20, k = 0..19, s = x̄^α / (w̄^(1−α) + 1e−4) ("duo scaling"; s = x̄^α without it),
   w̄ = the mean over output rows of |W| normalised by its group's max; s is normalised to
   √(max s · min s) = 1.  Each candidate replaces W by Q(W·s)/s and is scored by the mean squared error of
   what the group feeds, against the unquantized output:
     - a group behind a norm (q/k/v, gate/up) by its residual sub-block's output (attention, the MLP), re-run
       through the layer context — the softmax and the gating make this loss non-linear in the weights;
     - a group behind a linear (o behind v, down behind up) by the linear's own output, which is exactly
       tr(ΔW·H·ΔWᵀ)/N with ΔW = Q(W·s)/s − W: the same number as running every calibration token through
       it, for the cost of one N×K×K product.
   s = 1 (no scaling) is scored too, so a group is never made worse than plain rounding on its own loss.
   The re-runs score on `search_samples` evenly spaced calibration windows (16 × 512 tokens by default: one
   scalar α per group is well determined by them, and the re-runs are most of AWQ's time); the statistics,
   the linear losses and the clip search use every token.
3. Fold the best s into the producing op (the layer context does it) and continue with W·s and H/(s·sᵀ).
4. Clip search (not for q and k, whose outputs pass a softmax): per output row and group, the range
   ±max|w|·(1 − i/20), i = 0..9, that minimises the group's share of the output error, ΔH_gΔᵀ with H_g the
   group's diagonal block of H (every calibration token, where AutoAWQ samples 512).
5. Quantize: per output row and group of `group_size` input columns, an asymmetric grid
   scale = (max − min)/15 rounded to float16, zero = clamp(−round(min/scale), 0, 15),
   q = clamp(round(w/scale) + zero, 0, 15); w ≈ (q − zero)·scale.

Dividing a quantized linear's output row by a number changes its group scales and nothing else (the grid is
per row), so a scale found for o or down is folded into the already quantized v or up by rescaling their
float16 scales (`Quantized.divide_rows`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SCALE_FLOOR = 1e-4        # AutoAWQ's floor on a candidate scale and on w̄ in the duo denominator
RANGE_FLOOR = 1e-5        # smallest group range before dividing by 15 (keeps the float16 scale nonzero)


@dataclass(frozen=True)
class AWQSettings:
    bits: int = 4
    group_size: int = 128          # -1: one group spanning the input dimension
    search_scales: bool = True
    search_clip: bool = True
    duo_scaling: bool = True
    grid: int = 20                 # α candidates k/grid, k < grid; clip candidates i/grid, i < max_shrink·grid
    max_shrink: float = 0.5
    search_samples: int = 16       # calibration windows a re-run sub-block is scored on (0: all of them)

    @property
    def maxq(self) -> int:
        return 2 ** self.bits - 1

    def group(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size


@dataclass
class Quantized:
    """One linear's (or a few stacked linears') codes and grid, rows = output features."""
    codes: torch.Tensor    # (N, K) uint8
    scales: torch.Tensor   # (N, G) float32 holding float16 values
    zeros: torch.Tensor    # (N, G) uint8

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        g = k // self.scales.shape[1]
        q = self.codes.to(torch.float32).view(n, -1, g)
        return ((q - self.zeros.to(torch.float32)[..., None]) * self.scales[..., None]).view(n, k)

    def rows(self, rows: slice) -> "Quantized":
        return Quantized(self.codes[rows], self.scales[rows], self.zeros[rows])

    def divide_rows(self, divisor: torch.Tensor) -> "Quantized":
        """The same codes with every output row r divided by divisor[r] (a scale folded in from the next op)."""
        scales = (self.scales / divisor.to(self.scales)[:, None]).to(torch.float16).to(torch.float32)
        return Quantized(self.codes, scales, self.zeros)

    @staticmethod
    def cat(parts: list["Quantized"]) -> "Quantized":
        return Quantized(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "zeros")))


def _grouped(w: torch.Tensor, s: AWQSettings) -> torch.Tensor:
    n, k = w.shape
    return w.reshape(n, k // s.group(k), s.group(k))


def quantize(w: torch.Tensor, s: AWQSettings) -> Quantized:
    """Step 5 on W (N, K) float32."""
    wg = _grouped(w, s)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = ((hi - lo).clamp(min=RANGE_FLOOR) / s.maxq).to(torch.float16).to(torch.float32)
    zeros = (-torch.round(lo / scales)).clamp(0, s.maxq)
    codes = (torch.round(wg / scales[..., None]) + zeros[..., None]).clamp(0, s.maxq)
    return Quantized(codes.reshape(w.shape).to(torch.uint8), scales, zeros.to(torch.uint8))


def fake_quantize(w: torch.Tensor, s: AWQSettings) -> torch.Tensor:
    return quantize(w, s).dequantize()


def weight_profile(w: torch.Tensor, s: AWQSettings) -> torch.Tensor:
    """w̄: per input channel, the mean over output rows of |W| relative to its group's max."""
    a = _grouped(w.abs(), s)
    return (a / a.amax(-1, keepdim=True).clamp(min=1e-12)).reshape(w.shape).mean(0)


@dataclass
class ScaleChoice:
    scale: torch.Tensor | None     # (K,) float32; None = s = 1 won
    alpha: float | None
    loss: float
    unscaled_loss: float


def search_scale(w: torch.Tensor, x_mean: torch.Tensor, loss: Callable[[torch.Tensor], float],
                 s: AWQSettings) -> ScaleChoice:
    """Step 2 for the stacked weights W (N, K) of one group; `loss(W')` scores a candidate W' (N, K) that
    replaces W in the input's own scale."""
    unscaled = loss(fake_quantize(w, s))
    best = ScaleChoice(None, None, unscaled, unscaled)
    w_mean = weight_profile(w, s)
    x_mean = x_mean.to(w)
    for k in range(s.grid):
        alpha = k / s.grid
        scale = x_mean.pow(alpha)
        if s.duo_scaling:
            scale = scale / (w_mean.pow(1 - alpha) + SCALE_FLOOR)
        scale = scale.clamp(min=SCALE_FLOOR)
        scale = scale / (scale.max() * scale.min()).sqrt()
        scale = torch.where(torch.isfinite(scale), scale, torch.ones_like(scale))
        value = loss(fake_quantize(w * scale, s) / scale)
        if value < best.loss:
            best = ScaleChoice(scale, alpha, value, unscaled)
    return best


def linear_loss(w: torch.Tensor, h: torch.Tensor) -> Callable[[torch.Tensor], float]:
    """The mean squared output error of a linear with weight W (N, K) and input second moments H (K, K),
    when W' replaces it: mean over tokens and outputs of (x·(W' − W)ᵀ)², = Σ (ΔW·H ⊙ ΔW) / N."""
    def loss(candidate: torch.Tensor) -> float:
        d = candidate - w
        return float(((d @ h) * d).sum() / w.shape[0])
    return loss


def search_clip(w: torch.Tensor, h: torch.Tensor, s: AWQSettings) -> torch.Tensor:
    """Step 4: each (row, group)'s clipping bound (N, G, 1) for W (N, K) with input second moments H (K, K)."""
    wg = _grouped(w, s)
    n, groups, g = wg.shape
    blocks = torch.diagonal(h.reshape(groups, g, groups, g), dim1=0, dim2=2).permute(2, 0, 1)   # (G, g, g)
    amax = wg.abs().amax(-1, keepdim=True)
    best, best_err = amax.clone(), None
    for i in range(int(s.max_shrink * s.grid)):
        bound = amax * (1 - i / s.grid)
        clipped = torch.maximum(torch.minimum(wg, bound), -bound)
        d = (_grouped(fake_quantize(clipped.reshape(n, -1), s), s) - wg).transpose(0, 1)   # (G, N, g)
        err = (torch.bmm(d, blocks) * d).sum(-1).T                                          # (N, G)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[..., None], bound, best)
    return best


def clip(w: torch.Tensor, bound: torch.Tensor, s: AWQSettings) -> torch.Tensor:
    wg = _grouped(w, s)
    return torch.maximum(torch.minimum(wg, bound), -bound).reshape(w.shape)
