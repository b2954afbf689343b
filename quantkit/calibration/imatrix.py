"""The importance matrix llama.cpp's quantizers weight their rounding error with, collected in the shared
capture pass: for every linear inside the decoder layers, the mean of x² of each input column over the
calibration tokens.  Like `llama-imatrix`, it observes the unquantized model (the collector leaves every
weight as it is, so its stream is the full-precision model's) and, like its default, not the output head.
"""
from __future__ import annotations

import torch

from .jobs import PassJob
from .stats import SquareMeanAccumulator


class ImatrixCollector(PassJob):
    label = "importance matrix"

    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device
        self.stats: dict[str, SquareMeanAccumulator] = {}
        self.chunks = 0   # calibration samples seen (llama-imatrix's "chunks")

    def observe(self, ctx, group, x: torch.Tensor) -> None:
        prefix = self.model.adapter.prefix(ctx.layer)
        key = prefix + group.linears[0]
        acc = self.stats.get(key)
        if acc is None:
            acc = SquareMeanAccumulator(x.shape[-1], self.device)
            for lin in group.linears:  # linears reading the same input share one statistic
                self.stats[prefix + lin] = acc
        acc.add(x)

    def finish_layer(self, ctx) -> None:
        self.chunks = ctx.stream.shape[0]

    def resume_state(self) -> dict:
        return {"stats": self.stats, "chunks": self.chunks}   # pickled together: shared accumulators stay shared

    def restore(self, state: dict) -> None:
        self.stats, self.chunks = state["stats"], state["chunks"]

    def accumulators(self) -> dict[str, SquareMeanAccumulator]:
        """HF weight name -> its statistic (sums and token count); a checkpoint's joined linear (Phi-3's
        qkv_proj) gets its parts' statistic, which they share since they read the same input."""
        out = {f"{name}.weight": acc for name, acc in self.stats.items()}
        for i in range(self.model.num_layers):
            prefix = self.model.adapter.prefix(i)
            for part, (stored, _, _) in self.model.fused_parts.items():
                if prefix + part in out:
                    out[prefix + stored] = out[prefix + part]
        return out

    def result(self) -> dict[str, torch.Tensor]:
        """HF weight name -> importance vector (in_features,) float32 on the CPU."""
        return {name: acc.value() for name, acc in self.accumulators().items()}
