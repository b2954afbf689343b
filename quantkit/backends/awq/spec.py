"""`-f awq:SPEC`: a compact variant string, completed by explicit flags.

    SPEC := 4bit [-g{N} | -gnone] [-noclip] [-noduo] [-noscale] [-rtn]

`4bit-g128` is 4 bits with a zero point per group of 128 input columns (the GEMM checkpoint every AWQ
consumer reads), with the scale search (duo scaling, as AutoAWQ) and the clip search.  `-noclip` skips the
clip search, `-noduo` scores s = x̄^α alone (llm-awq's original rule), `-noscale` skips the scale search,
`-rtn` is round to nearest on AWQ's grid (no calibration; the baseline AWQ is measured against).  What the
string leaves out comes from the flags (--awq-clip/--no-awq-clip, --awq-duo/--no-awq-duo, --awq-grid, --awq-search-samples), then
from the defaults.  Only 4 bits: AWQ's GEMM kernels and vLLM's AWQ path read nothing else.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from ...errors import UsageError
from .algorithm import AWQSettings

EXAMPLES = ["4bit-g128", "4bit-g64", "4bit-g32", "4bit-gnone", "4bit-g128-noclip", "4bit-g128-rtn"]
GROUP_SIZES = (32, 64, 128, -1)    # what transformers + GPTQModel's AWQ kernels and vLLM all read
_TOKEN = re.compile(r"^(?:g(?P<group>\d+|none)|(?P<flag>noclip|clip|noduo|duo|noscale|rtn))$")


@dataclass(frozen=True)
class AWQVariant:
    text: str
    given: dict = field(default_factory=dict)   # settings the string fixes

    def settings(self, flags: dict | None = None) -> tuple[AWQSettings, bool]:
        """(settings, rtn) with string > flags > defaults."""
        merged = {k: v for k, v in (flags or {}).items() if v is not None and k in AWQSettings.__dataclass_fields__}
        merged.update({k: v for k, v in self.given.items() if k != "rtn"})
        s = replace(AWQSettings(), **merged)
        validate(s)
        rtn = bool(self.given.get("rtn"))
        return (replace(s, search_scales=False, search_clip=False) if rtn else s), rtn


def validate(s: AWQSettings) -> None:
    if s.bits != 4:
        raise UsageError(f"AWQ is 4-bit only (its GEMM kernels and vLLM read nothing else; got {s.bits}); "
                         f"use gptq:{s.bits}bit-… for other widths")
    if s.group_size not in GROUP_SIZES:
        raise UsageError(f"awq group size {s.group_size}: the AWQ kernels read groups of 32, 64 or 128, or none")
    if not 2 <= s.grid <= 200:
        raise UsageError(f"--awq-grid must be between 2 and 200 (got {s.grid})")
    if s.search_samples < 0:
        raise UsageError(f"--awq-search-samples must be 0 (all) or positive (got {s.search_samples})")


def parse(text: str) -> AWQVariant:
    parts = text.strip().lower().split("-")
    m = re.fullmatch(r"(\d+)bits?", parts[0])
    if not m:
        raise UsageError(f"awq:{text}: expected 4bit[-gN|-gnone][-noclip][-noduo][-noscale][-rtn], "
                         f"e.g. {', '.join(EXAMPLES[:3])}")
    given: dict = {"bits": int(m.group(1))}
    for part in parts[1:]:
        t = _TOKEN.match(part)
        if not t:
            raise UsageError(f"awq:{text}: unknown option {part!r} (known: gN, gnone, noclip, noduo, noscale, rtn)")
        if t.group("group"):
            given["group_size"] = -1 if t.group("group") == "none" else int(t.group("group"))
        else:
            flag = t.group("flag")
            key = {"noclip": "search_clip", "clip": "search_clip", "noduo": "duo_scaling", "duo": "duo_scaling",
                   "noscale": "search_scales", "rtn": "rtn"}[flag]
            given[key] = not flag.startswith("no")
    variant = AWQVariant(text=text, given=given)
    variant.settings()  # a string that is wrong on its own fails here, before the model is opened
    return variant
