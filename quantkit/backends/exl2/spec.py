"""`-f exl2:SPEC`: the target bits per weight of the decoder linears and the head's bits.

    SPEC := {BPW}bpw [-h{6|8|2|3|4|5}]        e.g. 4.0bpw, 4.65bpw-h8, 3bpw

The measurement's windows (--exl2-measure-samples, 16 by default as exllamav2's -mr; 0 = all) and the
measurement file (--measurement FILE to reuse one, --save-measurement FILE to keep it) are flags.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import UsageError
from .algorithm import DAMP
from .layouts import HEAD_OPTIONS

EXAMPLES = ["4.0bpw", "3.0bpw", "5.0bpw-h8", "2.5bpw", "6.0bpw-h8"]
MIN_BPW, MAX_BPW = 2.0, 8.0


@dataclass(frozen=True)
class EXL2Settings:
    target_bpw: float
    head_bits: int = 6
    damp: float = DAMP
    measure_samples: int = 16


@dataclass(frozen=True)
class EXL2Variant:
    text: str
    target_bpw: float
    head_bits: int

    def settings(self, measure_samples: int | None = None) -> EXL2Settings:
        if measure_samples is not None and measure_samples < 0:
            raise UsageError(f"--exl2-measure-samples must be 0 (all) or more (got {measure_samples})")
        return EXL2Settings(self.target_bpw, self.head_bits,
                            measure_samples=16 if measure_samples is None else measure_samples)


def parse(text: str) -> EXL2Variant:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)bpw(?:-h(\d+))?", text.strip().lower())
    if not m:
        raise UsageError(f"exl2:{text}: expected BPWbpw[-hBITS], e.g. {', '.join(EXAMPLES[:3])}")
    bpw, head = float(m.group(1)), int(m.group(2) or 6)
    if not MIN_BPW <= bpw <= MAX_BPW:
        raise UsageError(f"exl2:{text}: the target must be between {MIN_BPW} and {MAX_BPW} bits per weight "
                         f"(exllamav2's options span about 2.2 to 8.1)")
    if head not in HEAD_OPTIONS:
        raise UsageError(f"exl2:{text}: head bits {head}: choose one of {', '.join(map(str, HEAD_OPTIONS))}")
    return EXL2Variant(text.strip(), bpw, head)
