"""Read a GPTQ checkpoint back: quantkit's own unpacker (any GPTQ folder, not only quantkit's), as a
DenseModel for the evaluation harness, and a description for `inspect`."""
from __future__ import annotations

from pathlib import Path

import torch

from ...errors import SourceError
from ..hf_folder import QuantizedFolder, find_quantization_config
from .packing import unpack, unpack_zeros


def read_quantization_config(folder: Path) -> dict | None:
    """The GPTQ settings of a folder (config.json's quantization_config, else quantize_config.json)."""
    return find_quantization_config(folder, "gptq", "quantize_config.json")


def dequantize(qweight, qzeros, scales, g_idx, bits: int, v2: bool) -> torch.Tensor:
    """W (N, K) float32 from the packed tensors: W[j, i] = scale[g, j] · (q[i, j] − zero[g, j]), g = g_idx[i]."""
    codes = unpack(qweight, bits).to(torch.float32)                # (K, N)
    zeros = unpack_zeros(qzeros, bits).to(torch.float32)           # (G, N)
    if not v2:
        zeros = zeros + 1  # v1 stores zero − 1 (consumers read it back the same way)
    g = g_idx.to(torch.int64)
    w = scales.to(torch.float32)[g] * (codes - zeros[g])           # (K, N)
    return w.T.contiguous()


class GPTQCheckpoint(QuantizedFolder):
    """A GPTQ folder as the harness sees a model: layer(i) returns dequantized float weights."""

    def __init__(self, folder: Path):
        q = read_quantization_config(Path(folder))
        if q is None:
            raise SourceError(f"{folder}: not a GPTQ checkpoint (no quantization_config with quant_method gptq)")
        super().__init__(folder, q)
        self.bits = int(q.get("bits", 4))
        fmt = str(q.get("format") or q.get("checkpoint_format") or "gptq").lower()
        self.v2 = fmt == "gptq_v2"

    def linear_weight(self, name: str) -> torch.Tensor:
        """A linear's float weight: stored as is (a layer left unquantized), or dequantized."""
        get = self.weights.get
        if not self.is_quantized(name):
            return get(f"{name}.weight")
        return dequantize(get(f"{name}.qweight"), get(f"{name}.qzeros"), get(f"{name}.scales"),
                          get(f"{name}.g_idx"), self.bits, self.v2)


def describe(folder: Path) -> dict:
    m = GPTQCheckpoint(folder)
    weights = sum(e.numel for e in m.weights.entries.values() if e.name.endswith(".qweight")) * 32 // m.bits
    q = m.qconfig
    return m.described("gptq", bits=m.bits, group_size=q.get("group_size"), desc_act=q.get("desc_act"),
                       sym=q.get("sym"), format=q.get("format") or q.get("checkpoint_format"),
                       quantized_weights=weights)
