"""Which torch device a job runs on: --device auto|cpu|cuda[:N]."""
from __future__ import annotations

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
