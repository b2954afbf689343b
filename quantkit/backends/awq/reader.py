"""Read an AWQ GEMM checkpoint back: quantkit's own unpacker (any AWQ GEMM folder, not only quantkit's), as a
model for the evaluation harness, and a description for `inspect`."""
from __future__ import annotations

from pathlib import Path

import torch

from ...errors import SourceError
from ..hf_folder import QuantizedFolder, find_quantization_config
from .packing import unpack


def read_quantization_config(folder: Path) -> dict | None:
    """The AWQ settings of a folder (config.json's quantization_config, else quant_config.json)."""
    return find_quantization_config(folder, "awq", "quant_config.json")


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W (N, K) float32: W[n, k] = (q[k, n] − zero[k // g, n]) · scale[k // g, n]."""
    codes = unpack(qweight).to(torch.float32)                    # (K, N)
    zeros = unpack(qzeros).to(torch.float32)                     # (G, N)
    g = codes.shape[0] // scales.shape[0]
    w = (codes.view(-1, g, codes.shape[1]) - zeros[:, None]) * scales.to(torch.float32)[:, None]
    return w.reshape(codes.shape).T.contiguous()


class AWQCheckpoint(QuantizedFolder):
    """An AWQ folder as the harness sees a model: layer(i) returns dequantized float weights."""

    def __init__(self, folder: Path):
        q = read_quantization_config(Path(folder))
        if q is None:
            raise SourceError(f"{folder}: not an AWQ checkpoint (no quantization_config with quant_method awq)")
        version = str(q.get("version") or q.get("format") or "gemm").lower()
        if version != "gemm":
            raise SourceError(f"{folder}: AWQ {version} layout; quantkit reads the GEMM layout")
        super().__init__(folder, q)

    def linear_weight(self, name: str) -> torch.Tensor:
        get = self.weights.get
        if not self.is_quantized(name):
            return get(f"{name}.weight")
        return dequantize(get(f"{name}.qweight"), get(f"{name}.qzeros"), get(f"{name}.scales"))


def describe(folder: Path) -> dict:
    m = AWQCheckpoint(folder)
    weights = sum(e.numel for e in m.weights.entries.values() if e.name.endswith(".qweight")) * 8
    q = m.qconfig
    return m.described("awq", bits=q.get("bits", q.get("w_bit")), group_size=q.get("group_size", q.get("q_group_size")),
                       zero_point=q.get("zero_point"), version=q.get("version", "gemm"), quantized_weights=weights)
