"""Read a bitsandbytes folder back (quantkit's or transformers'), dequantized as bitsandbytes dequantizes: a
4-bit weight is its level × its block's absmax in float32; an int8 weight is CB · SCB / 127."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ...errors import SourceError, UsageError
from ..hf_folder import QuantizedFolder
from .activations import DEFAULT_THRESHOLD, LlmInt8Product, compute_dtype_input, llm_int8_input
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


class BnbCheckpoint(QuantizedFolder):
    """A bnb folder as the harness sees a model: layer(i) returns dequantized weights."""

    def __init__(self, folder: Path, activations: str = "exact"):
        if activations not in ("exact", "bitsandbytes"):
            raise UsageError(f"--activations {activations!r}: expected exact or bitsandbytes")
        q = read_quantization_config(Path(folder))
        if q is None:
            raise SourceError(f"{folder}: not a bitsandbytes checkpoint (no bitsandbytes quantization_config)")
        super().__init__(folder, q)
        self.emulate = activations == "bitsandbytes"

    def is_quantized(self, name: str) -> bool:
        return f"{name}.SCB" in self.weights or self.quant_state(name) is not None

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

    def _stored(self, prefix: str, lin: str) -> tuple[str, list[int]]:
        """The stored linear holding block linear `lin` (full name), and its rows there ([] when stored alone)."""
        stored, *rows = self.fused_parts.get(f"{lin}.weight", (f"{lin}.weight",))
        return prefix + stored.removesuffix(".weight"), rows

    def linear_fns(self, i: int) -> dict | None:
        """Per LLM.int8 linear, its product as bitsandbytes computes it (only when emulating bitsandbytes)."""
        if not self.emulate:
            return None
        prefix, threshold = self.adapter.prefix(i), float(self.qconfig.get("llm_int8_threshold", DEFAULT_THRESHOLD))
        fns = {}
        for lin in self.block(i).linears:
            base, rows = self._stored(prefix, lin)
            if f"{base}.SCB" in self.weights:
                cb, scb = self.weights.get(f"{base}.weight"), self.weights.get(f"{base}.SCB")
                if rows:   # a part of a joined linear (Phi-3's qkv_proj): its rows, each computed on its own
                    cb, scb = cb[rows[0]:rows[1]], scb[rows[0]:rows[1]]
                fns[lin] = LlmInt8Product(cb, scb, threshold)
        return fns

    def activation_fns(self, i: int) -> dict | None:
        """Per converted linear, bitsandbytes' rounding of its input (only when emulating bitsandbytes): LLM.int8's
        int8 columns, or the 4-bit compute dtype."""
        if not self.emulate:
            return None
        prefix, q = self.adapter.prefix(i), self.qconfig
        int8 = llm_int8_input(float(q.get("llm_int8_threshold", DEFAULT_THRESHOLD)))
        four_bit = compute_dtype_input(getattr(torch, q.get("bnb_4bit_compute_dtype") or "float32"))
        fns = {}
        for lin in self.block(i).linears:
            stored, _ = self._stored(prefix, lin)
            if f"{stored}.SCB" in self.weights:
                fns[lin] = int8
            elif self.quant_state(stored) is not None:
                fns[lin] = four_bit
        return fns

def describe(folder: Path) -> dict:
    m = BnbCheckpoint(folder)
    q = m.qconfig
    converted = [lin.name for row in m.stored_linears for lin in row if m.is_quantized(lin.name)]
    return m.described("bnb", quant_type="int8" if q.get("load_in_8bit") else q.get("bnb_4bit_quant_type"),
                       double_quant=q.get("bnb_4bit_use_double_quant"), compute_dtype=q.get("bnb_4bit_compute_dtype"),
                       converted_linears=len(converted))
