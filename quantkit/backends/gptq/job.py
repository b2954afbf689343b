"""One GPTQ artifact being made: the capture pass's `LayerQuantizer` for it, and its writer.

Files (../shared/docs/formats/gptq.md §5): model*.safetensors (+ index when sharded), config.json with
`quantization_config`, quantize_config.json, the tokenizer and generation config copied from the source, and
quantkit.json (settings, calibration provenance and token hash, per-layer damping and loss, file hashes).
Symmetric grids are stored in the v1 convention every consumer reads (`format: gptq`, stored zero = zero −
1); asymmetric grids cannot be stored in v1 when a zero point is 0, so they use GPTQModel's v2 (`gptq_v2`,
zeros as they are), which GPTQModel and transformers + GPTQModel read.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ... import __version__
from ...calibration.context import LayerContext
from ...calibration.stats import GroupStats
from ...model.block import InputGroup
from ..hf_folder import FolderJob
from .algorithm import GPTQResult, GPTQSettings, gptq_quantize, rtn_quantize
from .layout import checkpoint_specs
from .packing import pack, pack_zeros


def quantization_config(s: GPTQSettings) -> dict:
    """The dict transformers (config.json), GPTQModel and vLLM (either file) read."""
    fmt = "gptq" if s.sym else "gptq_v2"
    return {
        "quant_method": "gptq", "bits": s.bits, "group_size": s.group_size, "desc_act": s.act_order,
        "sym": s.sym, "damp_percent": s.damp, "static_groups": s.static_groups, "true_sequential": True,
        "format": fmt, "checkpoint_format": fmt, "lm_head": False, "pack_dtype": "int32",
        "meta": {"quantizer": [f"quantkit:{__version__}"], "damp_auto_increment": s.damp_step,
                 "static_groups": s.static_groups, "true_sequential": True, "mse": 2.4 if s.mse_grid else 0.0,
                 "act_group_aware": s.group_aware and not s.act_order},
    }


class GPTQJob(FolderJob):
    """Quantizes and writes one GPTQ checkpoint into `folder` (a .partial-* folder the caller renames)."""
    format = "gptq"

    def __init__(self, model, settings: GPTQSettings, variant: str, folder: Path, **kw):
        super().__init__(model, settings, variant, folder, checkpoint_specs(model, settings), **kw)
        self.layer_linears = model.stored_linears
        self.stats = GroupStats(device=self.device)

    # --- LayerJob ---------------------------------------------------------------------------
    def observe(self, ctx: LayerContext, group: InputGroup, x: torch.Tensor) -> None:
        self.stats.add(group, x)

    def quantize_group(self, ctx: LayerContext, group: InputGroup) -> dict[str, torch.Tensor]:
        # Linears that read the same input share H, and GPTQ treats output rows independently, so one
        # stacked run quantizes q/k/v (or gate/up) exactly as three separate runs would, at a third of the cost.
        layer, weights = ctx.layer, ctx.source
        names = [f"{lin}.weight" for lin in group.linears]
        stacked = torch.cat([weights[n].to(self.device, torch.float32) for n in names])
        acc = None if self.rtn else self.stats.pop(group.linears, None)
        if acc is None:   # round to nearest, or an expert no calibration token was routed to
            result = rtn_quantize(stacked, self.settings)
        else:             # an expert that saw fewer tokens than inputs: its rank-deficient H is damped as usual
            result = gptq_quantize(stacked, acc.value(), self.settings)
        entry = {"layer": layer, "linears": list(group.linears), "damp": result.damp, "loss": result.loss}
        if not self.rtn:
            entry["tokens"] = acc.rows if acc is not None else 0
            if acc is None:
                entry["method"] = "round-to-nearest (no calibration token reached this expert)"
        self.layer_log.append(entry)
        rows, row = {}, 0
        for lin, name in zip(group.linears, names):
            rows[lin] = (row, row + weights[name].shape[0])
            row = rows[lin][1]
        for stored in self.layer_linears[layer]:   # a joined linear (qkv_proj) is its parts' rows, in order
            if stored.parts[0] in rows:
                self._write_linear(stored.name, result, slice(rows[stored.parts[0]][0], rows[stored.parts[-1]][1]))
        return {name: result.weight[slice(*rows[lin])] for lin, name in zip(group.linears, names)}

    def finish_layer(self, ctx: LayerContext) -> None:
        self.writer.put_layer_rest(ctx)   # norms; the quantized linears' biases (written by quantize_group)

    # --- writing ----------------------------------------------------------------------------
    def _write_linear(self, name: str, r: GPTQResult, rows: slice) -> None:
        s = self.settings
        codes = r.codes[rows]                                   # (N, K)
        zeros = r.zeros[rows].T                                 # (G, N)
        stored = zeros - 1 if s.sym else zeros                  # v1 stores zero − 1; v2 the zero itself
        self.writer.put(f"{name}.qweight", pack(codes.T.contiguous(), s.bits))
        self.writer.put(f"{name}.qzeros", pack_zeros(stored, s.bits))
        self.writer.put(f"{name}.scales", r.scales[rows].T.contiguous().to(torch.float16))
        self.writer.put(f"{name}.g_idx", r.g_idx.to(torch.int32))

    def quantization_config(self) -> dict:
        qconfig = quantization_config(self.settings)
        if self.model.adapter.layers_module:
            # optimum finds the language model's layers by a name pattern; naming them keeps every consumer off the
            # vision tower's own stack of layers
            qconfig["block_name_to_quantize"] = self.model.adapter.layers_module
        return qconfig

    def write_format_files(self, qconfig: dict) -> None:
        (self.folder / "quantize_config.json").write_text(json.dumps(qconfig, indent=2) + "\n")
