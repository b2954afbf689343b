"""Statistics of a linear's inputs that quantizers share (GPTQ and EXL2 use the Hessian XᵀX)."""
from __future__ import annotations

import torch


class HessianAccumulator:
    """Running XᵀX / n in float32 over batches of input rows (tokens × in_features).

    The mean (not the sum) keeps values in a fixed range however many tokens are seen; GPTQ's damping is
    relative to diag(H), so the scale does not change the result."""

    def __init__(self, features: int, device: torch.device):
        self.H = torch.zeros(features, features, dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.H.device, torch.float32)
        n = x.shape[0]
        total = self.rows + n
        self.H.mul_(self.rows / total)
        self.H.addmm_(x.T, x, alpha=1.0 / total)
        self.rows = total

    def value(self) -> torch.Tensor:
        return self.H
