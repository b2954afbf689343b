"""The sample encodes that show which fused kernels a run uses: a run's probe before it builds what it lacks
(writer.py), and the set quantkit ships, which covers every kind (ship_kernels.py)."""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QT

from . import encoders
from .grid_encoders import NEEDS_IMATRIX

# every (type, weighted by an importance vector?) a run may encode with fused kernels: the fused types, and the
# legacy types whose importance-matrix path runs the fused searches of make_qx_quants / make_qkx_quants (a file
# that mixes them in, such as the IQ mixtures' Q4_0 tensors, would otherwise build those on its first run)
EVERY_KIND = tuple((q, weighted) for q in sorted(encoders.FUSED_TYPES) for weighted in (False, True)
                   if weighted or q not in NEEDS_IMATRIX) \
    + tuple((q, True) for q in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1))


def encode_samples(kinds) -> None:
    """Encode a small random sample of each (type, weighted?): the calls that show which kernels a run uses.
    Rows of 1536 take every block size; 48 of them give each step a few hundred blocks."""
    x = torch.randn(48, 1536, generator=torch.Generator().manual_seed(0))
    for q, weighted in kinds:
        encoders.quantize(x, q, imatrix=torch.rand(1536, generator=torch.Generator().manual_seed(1)) + 0.1
                          if weighted else None)
