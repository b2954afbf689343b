"""`-f bnb:SPEC`: which bitsandbytes encoding, as a short string.

    SPEC := {nf4|fp4}[-dq][-b{32…4096}]  |  int8

`nf4` is 4-bit NormalFloat in blocks of 64 (bitsandbytes' and transformers' default), `-dq` adds the double
quantization of the block scales (QLoRA's `bnb_4bit_use_double_quant`), `-b128` another block size; `int8` is
LLM.int8 (row-wise absmax).  The compute dtype written to the config comes from --bnb-compute-dtype.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import UsageError
from .encoders import BLOCK_SIZES

EXAMPLES = ["nf4", "nf4-dq", "fp4", "fp4-dq", "nf4-b128", "int8"]
DEFAULT_BLOCK = 64


@dataclass(frozen=True)
class BnbVariant:
    text: str
    quant_type: str              # "nf4", "fp4" or "int8"
    blocksize: int = DEFAULT_BLOCK
    double_quant: bool = False

    @property
    def four_bit(self) -> bool:
        return self.quant_type != "int8"

    def describe(self) -> str:
        if not self.four_bit:
            return "bnb LLM.int8 (row absmax)"
        return f"bnb {self.quant_type} b{self.blocksize}" + (" double-quant" if self.double_quant else "")


def parse(text: str) -> BnbVariant:
    parts = text.strip().lower().split("-")
    kind = parts[0]
    if kind == "int8":
        if len(parts) > 1:
            raise UsageError(f"bnb:{text}: int8 takes no options (LLM.int8 has one layout)")
        return BnbVariant(text, "int8")
    if kind not in ("nf4", "fp4"):
        raise UsageError(f"bnb:{text}: unknown quant type {kind!r}; expected nf4, fp4 or int8 "
                         f"(e.g. {', '.join(EXAMPLES)})")
    blocksize, double_quant = DEFAULT_BLOCK, False
    for part in parts[1:]:
        m = re.fullmatch(r"b(\d+)", part)
        if part == "dq":
            double_quant = True
        elif m:
            blocksize = int(m.group(1))
            if blocksize not in BLOCK_SIZES:
                raise UsageError(f"bnb:{text}: block size {blocksize} is not one bitsandbytes allows "
                                 f"({', '.join(map(str, BLOCK_SIZES))})")
        else:
            raise UsageError(f"bnb:{text}: unknown option {part!r} (known: dq, bN)")
    return BnbVariant(text, kind, blocksize, double_quant)
