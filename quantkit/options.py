"""The options every part of a run shares (device, calibration, output sharding), parsed once from the dict
the CLI and recipes pass to `quantkit.api`.  Each format parses the options it owns into its own settings
(`Backend.settings`); these are the rest."""
from __future__ import annotations

from dataclasses import dataclass

from .calibration.spec import CalibrationSpec, calibration_size

SHARED_KEYS = ("device", "calib", "calib_samples", "calib_seqlen", "seed", "calib_column", "max_shard_bytes",
               "estimate_time")


@dataclass(frozen=True)
class RunOptions:
    device: str | None = None
    calib: str | None = None
    calib_samples: int = CalibrationSpec.samples
    calib_seqlen: int = CalibrationSpec.seqlen
    seed: int = 0
    calib_column: str | None = None
    max_shard_bytes: int = 4 << 30
    estimate_time: bool = False           # a dry run: timing probes are worth their second or two

    @classmethod
    def from_dict(cls, options: dict) -> "RunOptions":
        o = options or {}
        samples, seqlen = calibration_size(o)
        return cls(device=o.get("device"), calib=str(o["calib"]) if o.get("calib") else None,
                   calib_samples=samples, calib_seqlen=seqlen,
                   seed=int(o.get("seed") or 0), calib_column=o.get("calib_column"),
                   max_shard_bytes=int(o.get("max_shard_bytes") or 4 << 30),
                   estimate_time=bool(o.get("estimate_time")))

    def calibration_text(self) -> str:
        return (f"{self.calib or '(none given: --calib is required)'}, {self.calib_samples} × {self.calib_seqlen} "
                f"tokens, seed {self.seed}")
