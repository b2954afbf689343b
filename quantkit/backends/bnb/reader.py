"""Read a bitsandbytes folder back (quantkit's or transformers'), dequantized as bitsandbytes dequantizes: a
4-bit weight is its level × its block's absmax in float32; an int8 weight is CB · SCB / 127."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ...errors import SourceError
from ...model.adapters import adapter_for
from ...model.checkpoint import ModelFolder
from ...model.config import ModelConfig
from ...model.safetensors_reader import SafetensorsCheckpoint
from .encoders import Packed4bit, dequantize_4bit, dequantize_int8

STATE_SUFFIXES = ("weight.quant_state.bitsandbytes__nf4", "weight.quant_state.bitsandbytes__fp4")


def read_quantization_config(folder: Path) -> dict | None:
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        q = json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(q, dict) and (q.get("quant_method") == "bitsandbytes" or q.get("load_in_4bit") or q.get("load_in_8bit")):
        return q
    return None


class BnbCheckpoint(ModelFolder):
    """A bnb folder as the harness sees a model: layer(i) returns dequantized weights."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        q = read_quantization_config(self.folder)
        if q is None:
            raise SourceError(f"{self.folder}: not a bitsandbytes checkpoint (no bitsandbytes quantization_config)")
        self.qconfig = q
        raw = json.loads((self.folder / "config.json").read_text())
        self.adapter = adapter_for(raw["model_type"])
        where = str(self.folder / "config.json")
        self.config = ModelConfig.from_dict(self.adapter.language_config(raw, where), where=where)
        self.weights = SafetensorsCheckpoint(self.folder)
        self.name = str(self.folder)
        self.num_layers = self.config.num_layers

    def quant_state(self, name: str) -> dict | None:
        for suffix in STATE_SUFFIXES:
            key = f"{name}.{suffix}"
            if key in self.weights:
                return json.loads(bytes(self.weights.get(key).tolist()).decode("utf-8"))
        return None

    def linear_weight(self, name: str) -> torch.Tensor:
        get, w = self.weights.get, self.weights
        state = self.quant_state(name)
        if state is not None:
            nested = f"{name}.weight.nested_absmax" in w
            packed = Packed4bit(get(f"{name}.weight"), get(f"{name}.weight.absmax"), get(f"{name}.weight.quant_map"),
                                get(f"{name}.weight.nested_absmax") if nested else None,
                                state.get("nested_offset") if nested else None)
            # level × absmax in float32: what bitsandbytes' 4-bit matmul multiplies by at float32 compute (its
            # dequantize_4bit() would round to the stored dtype, state["dtype"], as bfloat16 compute does anyway)
            return dequantize_4bit(packed, tuple(state["shape"]), int(state["blocksize"]))
        if f"{name}.SCB" in w:
            return dequantize_int8(get(f"{name}.weight"), get(f"{name}.SCB"))
        return get(f"{name}.weight")

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        prefix = self.adapter.prefix(i)

        def get(rel: str) -> torch.Tensor:
            if rel.endswith(".weight"):
                return self.linear_weight(prefix + rel.removesuffix(".weight"))
            return self.weights.get(prefix + rel)
        return self.split_layer(i, get)


def describe(folder: Path) -> dict:
    m = BnbCheckpoint(folder)
    info_path = Path(folder) / "quantkit.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    q = m.qconfig
    converted = sorted({e.name.rsplit(".weight.quant_state.", 1)[0] for e in m.weights.entries.values()
                        if ".weight.quant_state." in e.name} |
                       {e.name.removesuffix(".SCB") for e in m.weights.entries.values() if e.name.endswith(".SCB")})
    return {"kind": "bnb", "folder": str(folder), "architecture": m.config.model_type,
            "quant_type": "int8" if q.get("load_in_8bit") else q.get("bnb_4bit_quant_type"),
            "double_quant": q.get("bnb_4bit_use_double_quant"), "compute_dtype": q.get("bnb_4bit_compute_dtype"),
            "layers": m.num_layers, "converted_linears": len(converted),
            "size_on_disk": sum(p.stat().st_size for p in Path(folder).glob("*.safetensors")),
            "variant": info.get("variant"),
            "tensors": [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype} for e in m.weights.entries.values()]}
