"""Which torch device a job runs on (--device auto|cpu|cuda[:N]), and how fast it multiplies matrices."""
from __future__ import annotations

import time

import torch

from .errors import UsageError


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA device is available here")
    try:
        return torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r}: expected auto, cpu or cuda[:N]") from None


def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Matmul throughput (FLOP/s) of `device` in `dtype`, probed here on 1024² products (for time estimates)."""
    a = torch.randn(1024, 1024, device=device, dtype=dtype)
    a @ a
    t0 = time.perf_counter()
    for _ in range(4):
        a @ a
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 4 * 2 * 1024 ** 3 / (time.perf_counter() - t0)

