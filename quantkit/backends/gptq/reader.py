"""Read a GPTQ checkpoint back: quantkit's own unpacker (any GPTQ folder, not only quantkit's), as a
DenseModel for the evaluation harness, and a description for `inspect`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ...errors import SourceError
from ...model.adapters import adapter_for
from ...model.checkpoint import ModelFolder
from ...model.config import ModelConfig
from ...model.safetensors_reader import SafetensorsCheckpoint
from .packing import unpack, unpack_zeros


def read_quantization_config(folder: Path) -> dict | None:
    """The GPTQ settings of a folder (config.json's quantization_config, else quantize_config.json)."""
    for name, key in (("config.json", "quantization_config"), ("quantize_config.json", None)):
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        q = data.get(key) if key else data
        if isinstance(q, dict) and str(q.get("quant_method", q.get("method", ""))).lower() == "gptq":
            return q
    return None


def dequantize(qweight, qzeros, scales, g_idx, bits: int, v2: bool) -> torch.Tensor:
    """W (N, K) float32 from the packed tensors: W[j, i] = scale[g, j] · (q[i, j] − zero[g, j]), g = g_idx[i]."""
    codes = unpack(qweight, bits).to(torch.float32)                # (K, N)
    zeros = unpack_zeros(qzeros, bits).to(torch.float32)           # (G, N)
    if not v2:
        zeros = zeros + 1  # v1 stores zero − 1 (consumers read it back the same way)
    g = g_idx.to(torch.int64)
    w = scales.to(torch.float32)[g] * (codes - zeros[g])           # (K, N)
    return w.T.contiguous()


class GPTQCheckpoint(ModelFolder):
    """A GPTQ folder as the harness sees a model: layer(i) returns dequantized float weights."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        q = read_quantization_config(self.folder)
        if q is None:
            raise SourceError(f"{self.folder}: not a GPTQ checkpoint (no quantization_config with quant_method gptq)")
        self.qconfig = q
        self.bits = int(q.get("bits", 4))
        fmt = str(q.get("format") or q.get("checkpoint_format") or "gptq").lower()
        self.v2 = fmt == "gptq_v2"
        raw = json.loads((self.folder / "config.json").read_text())
        self.adapter = adapter_for(raw["model_type"])
        where = str(self.folder / "config.json")
        self.config = ModelConfig.from_dict(self.adapter.language_config(raw, where), where=where)
        self.weights = SafetensorsCheckpoint(self.folder)
        self.name = str(self.folder)
        self.num_layers = self.config.num_layers

    def linear_weight(self, name: str) -> torch.Tensor:
        """A linear's float weight: stored as is (a layer left unquantized), or dequantized."""
        get = self.weights.get
        if f"{name}.weight" in self.weights:
            return get(f"{name}.weight")
        return dequantize(get(f"{name}.qweight"), get(f"{name}.qzeros"), get(f"{name}.scales"),
                          get(f"{name}.g_idx"), self.bits, self.v2)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        prefix = self.adapter.prefix(i)

        def get(rel: str) -> torch.Tensor:
            base = rel.removesuffix(".weight")
            if rel.endswith(".weight") and f"{prefix}{base}.qweight" in self.weights:
                return self.linear_weight(prefix + base)
            return self.weights.get(prefix + rel)
        return self.split_layer(i, get)


def describe(folder: Path) -> dict:
    m = GPTQCheckpoint(folder)
    info_path = Path(folder) / "quantkit.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    tensors = [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype} for e in m.weights.entries.values()]
    size = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
    weights = sum(e.numel for e in m.weights.entries.values() if e.name.endswith(".qweight")) * 32 // m.bits
    q = m.qconfig
    return {"kind": "gptq", "folder": str(folder), "architecture": m.config.model_type, "bits": m.bits,
            "group_size": q.get("group_size"), "desc_act": q.get("desc_act"), "sym": q.get("sym"),
            "format": q.get("format") or q.get("checkpoint_format"), "layers": m.num_layers,
            "size_on_disk": size, "quantized_weights": weights,
            "calibration": (info.get("calibration") or {}).get("token_hash") if info else None,
            "tensors": tensors}
