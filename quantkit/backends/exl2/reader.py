"""Read an EXL2 folder back with quantkit's own dequantizer (any exllamav2 folder of the layout exl2.md
describes, not only quantkit's): a model for the evaluation harness, and a description for `inspect`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ...errors import SourceError
from ...model.block import Attention, GatedMLP
from ..hf_folder import QuantizedFolder
from .algorithm import dequantize
from .layout import head_name
from .packing import unpack_linear


def read_quantization_config(folder: Path) -> dict | None:
    """config.json's quantization_config when it says exl2 (exllamav2's converter writes it with -cf)."""
    path = Path(folder) / "config.json"
    try:
        q = json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    return q if isinstance(q, dict) and str(q.get("quant_method", "")).lower() == "exl2" else None


class EXL2Checkpoint(QuantizedFolder):
    def __init__(self, folder: Path):
        q = read_quantization_config(Path(folder))
        if q is None:
            raise SourceError(f"{folder}: not an EXL2 folder (no quantization_config with quant_method exl2)")
        super().__init__(folder, q)

    def is_quantized(self, name: str) -> bool:
        return f"{name}.q_weight" in self.weights

    def linear_weight(self, name: str) -> torch.Tensor:
        get = self.weights.get
        stored = {k: get(f"{name}.{k}") for k in ("q_weight", "q_invperm", "q_scale", "q_scale_max", "q_groups")}
        columns = self._columns(name)
        return dequantize(*unpack_linear(stored, columns))

    def _columns(self, name: str) -> int:
        """Output features (q_weight is padded to a multiple of 32 columns), from the block description: an
        op's outputs are the hidden size or what the next linear of the op reads (its q_invperm's length)."""
        if name == head_name(self.adapter):
            return self.config.vocab_size
        for i in range(self.num_layers):
            prefix = self.adapter.prefix(i)
            if not name.startswith(prefix):
                continue
            rows = lambda rel: self.weights.entries[f"{prefix}{rel}.q_invperm"].shape[0]

            def mlp(m: GatedMLP) -> dict[str, int]:
                return {m.gate: rows(m.down), m.up: rows(m.down), m.down: self.config.hidden_size}
            for r in self.block(i).residuals:
                op = r.op
                if isinstance(op, Attention):
                    kv = op.num_kv_heads * op.head_dim
                    outs = {op.q: rows(op.o), op.k: kv, op.v: kv, op.o: self.config.hidden_size}
                elif isinstance(op, GatedMLP):
                    outs = mlp(op)
                else:                                  # a mixture: each expert is a gated MLP
                    outs = {k: v for e in op.experts for k, v in mlp(e).items()}
                rel = name[len(prefix):]
                if rel in outs:
                    return outs[rel]
        raise SourceError(f"{self.folder}: {name} is not a linear of the block description")

    @property
    def tied_embeddings(self) -> bool:
        return False   # EXL2 stores its own quantized head

    def lm_head_weight(self) -> torch.Tensor:
        if self.is_quantized(head_name(self.adapter)):
            return self.linear_weight(head_name(self.adapter))
        return super().lm_head_weight()

