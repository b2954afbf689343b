"""EXL2 row layouts as data: how a matrix's input rows are split into groups of one bit width each, the
candidate layouts exllamav2 measures per sub-block, and the bits each costs.

A `RowLayout` is exllamav2's QParams (../shared/docs/formats/exl2.md §2): widths in decreasing order, the
proportion of rows each takes, a group size per width, 4-bit scales.  The tables below are exllamav2 0.3.2's
`qparams_attn` (one layout each for q, k, v, o), `qparams_mlp` (gate, up, down) and `qparams_headoptions`
(exllamav2/conversion/qparams.py at da07facd), kept as plain numbers so a measurement.json written by either
tool names the same options.  Group counting and bit costs follow `QParams.total_bits` to the bit, so the
budget quantkit plans is the one exllamav2 reports.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

WIDTHS = (8, 6, 5, 4, 3, 2)       # the widths the kernels decode, in the order groups must appear
SCALE_BITS = 4


@dataclass(frozen=True)
class Group:
    bits: int
    start: int                    # first row (in act-order) of the group
    end: int


@dataclass(frozen=True)
class RowLayout:
    bits: tuple[int, ...]                 # decreasing
    proportions: tuple[float, ...]        # of the rows, one per width, summing to 1
    group_sizes: tuple[int, ...]          # one per width

    def __post_init__(self):
        if list(self.bits) != sorted(self.bits, reverse=True) or any(b not in WIDTHS for b in self.bits):
            raise ValueError(f"EXL2 widths must be decreasing and among {WIDTHS}: {self.bits}")
        if not (len(self.bits) == len(self.proportions) == len(self.group_sizes)):
            raise ValueError("EXL2 layout: one proportion and one group size per width")

    @classmethod
    def of(cls, group_size, bits, proportions) -> "RowLayout":
        """From exllamav2's QParams arguments: one group size for all widths, or a list per width."""
        sizes = tuple(group_size) if isinstance(group_size, (list, tuple)) else (group_size,) * len(bits)
        return cls(tuple(bits), tuple(float(p) for p in proportions), sizes)

    @classmethod
    def from_dict(cls, d: dict) -> "RowLayout":
        """exllamav2's QParams dict ({"group_size": {bits: gs}, "bits": [...], "bits_prop": [...], "scale_bits": 4}),
        as measurement.json stores it (the group-size keys become strings in JSON)."""
        if d.get("scale_bits", SCALE_BITS) != SCALE_BITS:
            raise ValueError(f"EXL2 scale bits must be {SCALE_BITS}")
        sizes = {int(b): int(g) for b, g in d["group_size"].items()}
        return cls(tuple(int(b) for b in d["bits"]), tuple(float(p) for p in d["bits_prop"]),
                   tuple(sizes[int(b)] for b in d["bits"]))

    def to_dict(self) -> dict:
        return {"group_size": {str(b): g for b, g in zip(self.bits, self.group_sizes)}, "bits": list(self.bits),
                "bits_prop": list(self.proportions), "scale_bits": SCALE_BITS}

    @cached_property
    def desc(self) -> str:
        """exllamav2's description string, e.g. "0.05:3b_64g/0.95:2b_64g s4" (its key for deduplicating)."""
        parts = [f"{p}:{b}b_{g}g" for b, p, g in zip(self.bits, self.proportions, self.group_sizes)]
        return "/".join(parts) + f" s{SCALE_BITS}"

    def group_counts(self, rows: int) -> list[int]:
        """Groups per width for `rows` input rows: ceil(min(rows·p, rows left) / group size), as exllamav2 counts
        (floating-point rows·p included), so the last width may take fewer rows than its proportion."""
        left, counts = rows, []
        for b, p, gs in zip(self.bits, self.proportions, self.group_sizes):
            g = max(0, math.ceil(min(rows * p, left) / gs))   # 0 once earlier widths took every row
            counts.append(g)
            left -= g * gs
        if left > 0:
            raise ValueError(f"EXL2 layout {self.desc} leaves {left} of {rows} rows without a group")
        return counts

    def groups(self, rows: int) -> list[Group]:
        """The groups in storage order (widths decreasing); the last one may be short."""
        out, start = [], 0
        for b, gs, n in zip(self.bits, self.group_sizes, self.group_counts(rows)):
            for _ in range(n):
                if start >= rows:
                    break
                out.append(Group(b, start, min(start + gs, rows)))
                start = out[-1].end
        return out

    def total_bits(self, rows: int, columns: int, bias: bool = False) -> int:
        """Bits of one linear with `rows` inputs and `columns` outputs stored this way, counted as exllamav2 counts
        them: codes, 16-bit q_scale_max and two 16-bit q_groups entries per group, a 4-bit scale per group and
        column, a 32-bit q_invperm entry per row, and a float16 bias."""
        groups = sum(self.group_counts(rows))
        weight_bits = sum((g.end - g.start) * g.bits for g in self.groups(rows)) * columns
        return (weight_bits + groups * 16 + groups * 32 + groups * columns * SCALE_BITS + rows * 32
                + (16 * columns if bias else 0))


def _options(rows: list[list[tuple]]) -> tuple[tuple[RowLayout, ...], ...]:
    return tuple(tuple(RowLayout.of(*qp) for qp in option) for option in rows)


# exllamav2's qparams_attn: per option the layouts of q, k, v and o (as QParams(group_size, bits, bits_prop))
ATTENTION_OPTIONS = _options([
    [(64, [3, 2], [0.05, 0.95])] * 4,
    [(64, [3, 2], [0.1, 0.9]), (64, [3, 2], [0.1, 0.9]), (64, [3, 2], [0.25, 0.75]), (64, [3, 2], [0.1, 0.9])],
    [(64, [3, 2], [0.1, 0.9]), (64, [3, 2], [0.1, 0.9]), (128, [4, 3], [0.1, 0.9]), (64, [3, 2], [0.1, 0.9])],
    [(64, [3, 2], [0.1, 0.9]), (64, [3, 2], [0.1, 0.9]), (128, [4, 3], [0.1, 0.9]), (128, [4, 3], [0.1, 0.9])],
    [(128, [4, 3], [0.1, 0.9])] * 4,
    [(128, [4, 3], [0.1, 0.9]), (128, [4, 3], [0.1, 0.9]), (64, [4, 3], [0.1, 0.9]), (128, [4, 3], [0.1, 0.9])],
    [(128, [4], [1])] * 4,
    [(128, [4], [1]), (128, [4], [1]), (64, [4], [1]), (128, [4], [1])],
    [(64, [4], [1]), (64, [4], [1]), (32, [4], [1]), (64, [4], [1])],
    [(32, [4], [1])] * 4,
    [(128, [5, 4], [0.1, 0.9]), (128, [5, 4], [0.1, 0.9]), (64, [5, 4], [0.1, 0.9]), (128, [5, 4], [0.1, 0.9])],
    [(64, [5, 4], [0.1, 0.9]), (64, [5, 4], [0.1, 0.9]), (32, [5, 4], [0.1, 0.9]), (64, [5, 4], [0.1, 0.9])],
    [(64, [5, 4], [0.1, 0.9]), (64, [5, 4], [0.1, 0.9]), (64, [5], [1]), (64, [5, 4], [0.1, 0.9])],
    [(32, [5, 4], [0.1, 0.9]), (32, [5, 4], [0.1, 0.9]), (32, [5], [1]), (32, [5, 4], [0.1, 0.9])],
    [(128, [6, 5], [0.1, 0.9]), (128, [6, 5], [0.1, 0.9]), (128, [6], [1]), (128, [6, 5], [0.1, 0.9])],
    [(32, [6, 5], [0.1, 0.9]), (32, [6, 5], [0.1, 0.9]), (32, [6], [1]), (32, [6, 5], [0.1, 0.9])],
    [(128, [6], [1])] * 4,
    [(32, [6], [1]), (32, [6], [1]), (32, [8], [1]), (32, [6], [1])],
    [(128, [8], [1])] * 4,
])

# exllamav2's qparams_mlp: per option the layouts of gate, up and down
MLP_OPTIONS = _options([
    [(64, [3, 2], [0.05, 0.95]), (64, [3, 2], [0.05, 0.95]), ([32, 64, 64], [6, 3, 2], [0.05, 0.2, 0.75])],
    [(64, [3, 2], [0.1, 0.9]), (64, [3, 2], [0.25, 0.75]), ([32, 64, 64], [6, 3, 2], [0.05, 0.2, 0.75])],
    [(64, [3, 2], [0.1, 0.9]), (64, [3, 2], [0.3, 0.7]), (32, [5, 3], [0.05, 0.95])],
    [(64, [3, 2], [0.1, 0.9]), (64, [3, 2], [0.3, 0.7]), (32, [5, 4], [0.05, 0.95])],
    [(128, [4, 3], [0.1, 0.9]), (128, [4, 3], [0.25, 0.75]), ([32, 128, 128], [8, 4, 3], [0.05, 0.1, 0.85])],
    [(32, [4, 3], [0.1, 0.9]), (32, [4, 3], [0.25, 0.75]), ([32, 32, 32], [8, 4, 3], [0.05, 0.1, 0.85])],
    [(32, [4, 3], [0.1, 0.9]), (32, [4, 3], [0.25, 0.75]), ([32, 128], [8, 4], [0.05, 0.95])],
    [(128, [4], [1]), (32, [4], [1]), ([32, 128], [8, 4], [0.05, 0.95])],
    [(32, [4], [1]), (32, [4], [1]), ([32, 32], [8, 4], [0.05, 0.95])],
    [(128, [5, 4], [0.1, 0.9]), (128, [5, 4], [0.25, 0.75]), ([32, 128, 128], [8, 5, 4], [0.05, 0.1, 0.85])],
    [(32, [5, 4], [0.1, 0.9]), (32, [5, 4], [0.25, 0.75]), ([32, 32, 32], [8, 5, 4], [0.05, 0.1, 0.85])],
    [(128, [6, 5], [0.1, 0.9]), (128, [6, 5], [0.25, 0.75]), ([32, 128, 128], [8, 6, 5], [0.05, 0.1, 0.85])],
    [(32, [6, 5], [0.1, 0.9]), (32, [6, 5], [0.25, 0.75]), ([32, 32, 32], [8, 6, 5], [0.05, 0.1, 0.85])],
    [(128, [6], [1]), (128, [6], [1]), ([32, 128], [8, 6], [0.05, 0.95])],
    [(128, [8, 6], [0.1, 0.9]), (128, [8, 6], [0.1, 0.9]), (128, [8, 6], [0.15, 0.85])],
    [(128, [8, 6], [0.1, 0.9]), (128, [8, 6], [0.1, 0.9]), (128, [8], [1])],
    [(128, [8], [1])] * 3,
])

# exllamav2's qparams_headoptions: the head's layout for -hb 2 … 8
HEAD_OPTIONS = {b: RowLayout.of(*qp) for b, qp in {
    2: (32, [4, 2], [0.3, 0.7]), 3: (32, [4, 3], [0.15, 0.85]), 4: (32, [6, 4], [0.15, 0.85]),
    5: (128, [6, 5], [0.15, 0.85]), 6: (128, [8, 6], [0.15, 0.85]), 8: (128, [8], [1.0])}.items()}


def distinct(options: tuple[tuple[RowLayout, ...], ...]) -> list[list[RowLayout]]:
    """Per position (q, k, v, o or gate, up, down) the distinct layouts the options use, in first-use order: the
    quantizations a measurement must run (exllamav2's get_qparams_reduced)."""
    out: list[list[RowLayout]] = [[] for _ in options[0]]
    for option in options:
        for i, layout in enumerate(option):
            if layout not in out[i]:
                out[i].append(layout)
    return out
