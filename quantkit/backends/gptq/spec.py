"""`-f gptq:SPEC`: a compact variant string, completed by explicit flags.

    SPEC := {2|3|4|8}bit [-g{N} | -gnone] [-act [-static] | -noga] [-sym | -asym] [-damp{F}] [-mse] [-rtn]

`4bit-g128` is 4 bits, groups of 128, symmetric, columns in natural order; `-act` = act-order (desc_act),
`-static` = static groups, `-noga` = without act-order, visit
columns in natural order instead of group-aware order (whole groups by importance; the default, as in GPTQModel),
`-gnone` = one group per output row, `-mse` = per-group range search, `-rtn` =
round to nearest (no calibration).  What the string leaves out comes from the flags (--act-order,
--static-groups, --group-aware/--no-group-aware, --asym, --damp, --damp-step, --mse, --gptq-block-size), then from the defaults
(group 128, symmetric, no act-order, damp 0.01 growing by 0.01 when the Hessian is not positive definite).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from ...errors import UsageError
from .algorithm import GPTQSettings
from .packing import BITS

EXAMPLES = ["4bit-g128", "4bit-g128-act", "4bit-g128-act-static", "8bit-g128", "3bit-g64-asym", "2bit-g32",
            "4bit-gnone", "4bit-g128-rtn"]
_TOKEN = re.compile(r"^(?:g(?P<group>\d+|none)|(?P<flag>act|actorder|static|sym|asym|mse|rtn|ga|noga)|damp(?P<damp>[0-9.]+))$")


@dataclass(frozen=True)
class GPTQVariant:
    text: str
    given: dict = field(default_factory=dict)   # settings the string fixes

    def settings(self, flags: dict | None = None) -> tuple[GPTQSettings, bool]:
        """(settings, rtn) with string > flags > defaults."""
        merged = {k: v for k, v in (flags or {}).items() if v is not None and k in GPTQSettings.__dataclass_fields__}
        merged.update({k: v for k, v in self.given.items() if k != "rtn"})
        s = replace(GPTQSettings(), **merged)
        validate(s)
        return s, bool(self.given.get("rtn"))


def validate(s: GPTQSettings) -> None:
    if s.bits not in BITS:
        raise UsageError(f"GPTQ bits must be one of {', '.join(map(str, BITS))} (got {s.bits})")
    if s.group_size != -1 and s.group_size < 8:
        raise UsageError(f"GPTQ group size must be at least 8, or none (got {s.group_size})")
    if not 0 < s.damp < 1:
        raise UsageError(f"--damp must be in (0, 1) (got {s.damp})")
    if s.damp_step < 0 or s.damp_step >= 1:
        raise UsageError(f"--damp-step must be in [0, 1) (got {s.damp_step})")
    if s.block_size < 1:
        raise UsageError(f"--gptq-block-size must be positive (got {s.block_size})")


def parse(text: str) -> GPTQVariant:
    parts = text.strip().lower().split("-")
    m = re.fullmatch(r"(\d+)bits?", parts[0])
    if not m:
        raise UsageError(f"gptq:{text}: expected BITSbit[-gN][-act][-static][-sym|-asym][-dampF][-mse][-rtn], "
                         f"e.g. {', '.join(EXAMPLES[:4])}")
    given: dict = {"bits": int(m.group(1))}
    if given["bits"] not in BITS:
        raise UsageError(f"gptq:{text}: {given['bits']}-bit GPTQ is not supported; choose 2, 3, 4 or 8 bits")
    for part in parts[1:]:
        t = _TOKEN.match(part)
        if not t:
            raise UsageError(f"gptq:{text}: unknown option {part!r} (known: gN, gnone, act, static, ga, noga, "
                             f"sym, asym, dampF, mse, rtn)")
        if t.group("group"):
            given["group_size"] = -1 if t.group("group") == "none" else int(t.group("group"))
        elif t.group("damp"):
            try:
                given["damp"] = float(t.group("damp"))
            except ValueError:
                raise UsageError(f"gptq:{text}: {part!r} is not a number") from None
        else:
            flag = t.group("flag")
            key = {"act": "act_order", "actorder": "act_order", "static": "static_groups", "mse": "mse_grid",
                   "rtn": "rtn"}.get(flag)
            if flag in ("sym", "asym"):
                given["sym"] = flag == "sym"
            elif flag in ("ga", "noga"):
                given["group_aware"] = flag == "ga"
            else:
                given[key] = True
    variant = GPTQVariant(text=text, given=given)
    variant.settings()  # a string that is wrong on its own fails here, before the model is opened
    return variant
