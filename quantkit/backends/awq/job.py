"""One AWQ artifact being made: the capture pass's job for it (the algorithm of algorithm.py run through the
layer context), and its writer.

Files (../shared/docs/formats/awq.md §1, §4): model*.safetensors (+ index when sharded), config.json with
`quantization_config`, the tokenizer and generation config copied from the source, and quantkit.json (the
settings, per group the scale that was folded and where, α, the losses and the clipping, the calibration
provenance, file hashes).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...calibration.context import LayerContext
from ...calibration.stats import GroupStats, HessianAccumulator
from ...errors import QuantizationError
from ...model.block import Attention, InputGroup, MoE, Residual
from ...model.engine import apply_norm
from ..hf_folder import FolderJob
from .algorithm import AWQSettings, Quantized, clip, linear_loss, quantize, search_clip, search_scale
from .layout import checkpoint_specs, quantization_config
from .packing import pack


class InputStats:
    """What AWQ needs of one group's input: mean |x| per channel and H = mean xxᵀ."""

    def __init__(self, features: int, device: torch.device):
        self.abs_sum = torch.zeros(features, dtype=torch.float64, device=device)
        self.hessian = HessianAccumulator(features, device)

    def add(self, x: torch.Tensor) -> None:
        self.abs_sum += x.to(self.abs_sum.device).abs().sum(dim=0, dtype=torch.float64)
        self.hessian.add(x)

    @property
    def rows(self) -> int:
        return self.hessian.rows

    def x_mean(self) -> torch.Tensor:
        return (self.abs_sum / max(self.rows, 1)).to(torch.float32)


class AWQJob(FolderJob):
    """Quantizes and writes one AWQ checkpoint into `folder` (a .partial-* folder the caller renames)."""
    format = "awq"
    log_key = "groups"

    def __init__(self, model, settings: AWQSettings, variant: str, folder: Path, **kw):
        super().__init__(model, settings, variant, folder, checkpoint_specs(model, settings), **kw)
        self.stats = GroupStats(InputStats, self.device)
        self.done: dict[str, Quantized] = {}      # this layer's linears, by name, until finish_layer writes them
        # (layer, the MoE block's norm) -> its experts' scale, once balanced (None: unscaled won)
        self.expert_scale: dict[tuple[int, str], torch.Tensor | None] = {}

    # --- LayerJob ---------------------------------------------------------------------------
    def observe(self, ctx: LayerContext, group: InputGroup, x: torch.Tensor) -> None:
        self.stats.add(group, x)

    def quantize_group(self, ctx: LayerContext, group: InputGroup) -> dict[str, torch.Tensor]:
        s = self.settings
        names = [f"{lin}.weight" for lin in group.linears]
        rows, start = {}, 0
        for lin, name in zip(group.linears, names):
            rows[lin] = slice(start, start + ctx.source[name].shape[0])
            start = rows[lin].stop
        moe = self._routed_input(ctx, group)
        if moe is not None and s.search_scales:
            expert_scale = self._balance_experts(ctx, moe)
        # the stored weights: a balanced expert's input columns already hold the scale folded into the norm
        w = torch.cat([ctx.stored(n).to(self.device, torch.float32) for n in names])
        stats = self.stats.pop(group.linears, None)
        entry: dict = {"layer": ctx.layer, "linears": list(group.linears)}
        out: dict[str, torch.Tensor] = {}
        h = None
        if stats is not None:
            x_mean, h = stats.x_mean(), stats.hessian.value()
            entry["tokens"] = stats.rows
            if not torch.isfinite(x_mean).all():
                raise QuantizationError(f"layer {ctx.layer} {group.linears[0]}: the calibration inputs hold inf or "
                                        f"NaN (the model overflows in {ctx.runtime.compute_dtype}); check its weights")
            if moe is not None:
                if s.search_scales and expert_scale is not None:   # H was taken before the fold
                    h = h / (expert_scale[:, None] * expert_scale[None, :]).to(h)
                    entry["scaled_into"] = moe.norm.weight
            elif s.search_scales:
                scale, note = self._scale(ctx, group, w, rows, x_mean, h, entry)
                if scale is not None:
                    w = torch.cat(list(ctx.fold(group, scale).values())).to(self.device)
                    h = h / (scale[:, None] * scale[None, :]).to(h)
                    if group.producer_kind == "linear":   # rescale the already quantized producer's rows
                        self.done[group.producer] = self.done[group.producer].divide_rows(scale)
                        out[f"{group.producer}.weight"] = self.done[group.producer].dequantize()
                if note:
                    entry["note"] = note
        elif not self.rtn:
            entry["method"] = "round-to-nearest (no calibration token reached these linears)"
        if s.search_clip and h is not None:
            ratios = []
            for lin in group.linears:
                if lin in self._softmax_inputs(ctx):
                    continue          # q and k: their error passes a softmax, not a sum
                bound = search_clip(w[rows[lin]], h, s)
                ratios.append(float((bound / _grouped_amax(w[rows[lin]], s)).mean()))
                w[rows[lin]] = clip(w[rows[lin]], bound, s)
            if ratios:
                entry["clip_mean_ratio"] = round(sum(ratios) / len(ratios), 4)
        for lin, name in zip(group.linears, names):
            self.done[lin] = quantize(w[rows[lin]], s)
            out[name] = self.done[lin].dequantize()
        self.layer_log.append(entry)
        return out

    def _scale(self, ctx: LayerContext, group: InputGroup, w: torch.Tensor, rows: dict[str, slice],
               x_mean: torch.Tensor, h: torch.Tensor, entry: dict) -> tuple[torch.Tensor | None, str | None]:
        """The scale to fold for this group (None: leave it unscaled) and a note when it cannot take one."""
        s, kind = self.settings, group.producer_kind
        if kind in ("norm", "norm+1"):
            loss = self._output_loss(ctx, ctx.residual_of(group), rows)
        elif kind == "linear":
            outputs = ctx.source[f"{group.producer}.weight"].shape[0]
            if outputs != w.shape[1] or group.producer not in self.done:
                return None, (f"not scaled: {group.producer} has {outputs} outputs and {group.linears[0]} reads "
                              f"{w.shape[1]} channels (grouped-query attention)")
            loss = linear_loss(w, h)
        else:
            return None, "not scaled: no single op produces this input"
        choice = search_scale(w, x_mean, loss, s)
        entry.update(scaled_into=group.producer if choice.scale is not None else None, alpha=choice.alpha,
                     loss=choice.loss, unscaled_loss=choice.unscaled_loss)
        return choice.scale, None

    def _output_loss(self, ctx: LayerContext, sub: Residual, rows: dict[str, slice]):
        """loss(W') for stacked candidate weights (linear lin in rows[lin]): the mean squared error of the
        residual sub-block's output against the unquantized one, on `search_samples` evenly spaced windows."""
        n, windows = self.settings.search_samples, ctx.stream.shape[0]
        some = slice(0, None, 1 if not n else -(-windows // n))
        reference = ctx.run(sub, samples=some).float()

        def loss(candidate: torch.Tensor) -> float:
            out = ctx.run(sub, {f"{lin}.weight": candidate[r] for lin, r in rows.items()}, samples=some)
            return float((out.float() - reference).pow(2).mean())
        return loss

    @staticmethod
    def _routed_input(ctx: LayerContext, group: InputGroup) -> Residual | None:
        """The mixture-of-experts sub-block whose norm feeds `group` (an expert's gate/up), else None."""
        if group.producer_kind != "none":
            return None
        sub = ctx.residual_of(group)
        return sub if isinstance(sub.op, MoE) and group in sub.stages[0] else None

    def _balance_experts(self, ctx: LayerContext, sub: Residual) -> torch.Tensor | None:
        """One scale for everything the MoE block's norm feeds — every expert's gate/up, the shared expert's,
        and the unquantized router and shared gate (scaled too, so routing is unchanged) — searched once per
        layer like a norm-fed group: x̄ over every token entering the block, each candidate scored by the whole
        block's output with all experts' gate/up fake-quantized.  No per-expert scale can be folded: the norm
        is shared.  Returns the scale (None: unscaled won)."""
        block = (ctx.layer, sub.norm.weight)
        if block in self.expert_scale:
            return self.expert_scale[block]
        s, op = self.settings, sub.op
        first = sub.stages[0]
        linears = [lin for g in first for lin in g.linears]
        rows, start = {}, 0
        for lin in linears:
            rows[lin] = slice(start, start + ctx.source[f"{lin}.weight"].shape[0])
            start = rows[lin].stop
        w = torch.cat([ctx.source[f"{lin}.weight"].to(self.device, torch.float32) for lin in linears])
        abs_sum, tokens = torch.zeros(w.shape[1], dtype=torch.float64, device=self.device), 0
        for span in ctx.spans():
            x = apply_norm(sub.norm, ctx.stream[span].to(ctx.runtime.device), ctx.weights).reshape(-1, w.shape[1])
            abs_sum += x.to(self.device).abs().sum(0, dtype=torch.float64)
            tokens += x.shape[0]
        x_mean = (abs_sum / tokens).to(torch.float32)
        if not torch.isfinite(x_mean).all():
            raise QuantizationError(f"layer {ctx.layer} {sub.norm.weight}: the calibration inputs hold inf or NaN "
                                    f"(the model overflows in {ctx.runtime.compute_dtype}); check its weights")
        choice = search_scale(w, x_mean, self._output_loss(ctx, sub, rows), s)
        unquantized = [op.router] + ([op.shared_gate] if op.shared_gate else [])
        if choice.scale is not None:
            kind = "norm+1" if sub.norm.unit_offset else "norm"
            ctx.fold(InputGroup(tuple(linears + unquantized), sub.norm.weight, kind), choice.scale)
            for name in unquantized:      # no quantize_group hands these back to the stream
                key = f"{name}.weight"
                ctx.weights[key] = ctx.replaced[key].to(ctx.weights[key].device, ctx.weights[key].dtype)
        self.layer_log.append({"layer": ctx.layer, "linears": linears + unquantized,
                               "tokens": tokens, "balanced": len(first),
                               "scaled_into": sub.norm.weight if choice.scale is not None else None,
                               "alpha": choice.alpha, "loss": choice.loss, "unscaled_loss": choice.unscaled_loss})
        self.expert_scale = {block: choice.scale}   # earlier layers' scales are done with
        return choice.scale

    @staticmethod
    def _softmax_inputs(ctx: LayerContext) -> set[str]:
        return {n for r in ctx.block.residuals if isinstance(r.op, Attention) for n in (r.op.q, r.op.k)}

    def finish_layer(self, ctx: LayerContext) -> None:
        for stored in self.model.stored_linears[ctx.layer]:   # a joined linear (qkv_proj) is its parts' rows
            q = Quantized.cat([self.done.pop(p) for p in stored.parts])
            self.writer.put(f"{stored.name}.qweight", pack(q.codes.T.contiguous()))
            self.writer.put(f"{stored.name}.qzeros", pack(q.zeros.T.contiguous()))
            self.writer.put(f"{stored.name}.scales", q.scales.T.contiguous().to(torch.float16))
        self.writer.put_layer_rest(ctx)   # norms (with folded scales), biases

    def quantization_config(self) -> dict:
        return quantization_config(self.settings)


def _grouped_amax(w: torch.Tensor, s: AWQSettings) -> torch.Tensor:
    n, k = w.shape
    return w.abs().reshape(n, k // s.group(k), s.group(k)).amax(-1, keepdim=True).clamp(min=1e-12)
