"""What a job sees of one layer during the capture pass: the layer's description and source tensors, its
own working weights and stream, and three abilities beyond reading a group's inputs:

- `run(group, overrides)`: re-run the residual sub-block that consumes `group` (attention, MLP …) over the
  calibration samples with candidate weights and read its output — AWQ's loss, EXL2's measurement;
- `fold(group, scale)`: divide the group's input channels by `scale` inside the op that produces them (the
  pre-norm, or v_proj for o_proj, up_proj for down_proj), so the job's stream continues with what it will
  store, and get the group's weights with their input columns multiplied by `scale` — AWQ's scale folding;
- `pass_index`: which of the job's passes this is (EXL2 measures every layer, then quantizes).
"""
from __future__ import annotations

import math

import torch

from ..errors import UsageError
from ..model.block import Block, InputGroup, Residual
from ..model.engine import Runtime, apply_norm, run_residual
from .stats import HessianAccumulator, ReferenceHessian


class LayerContext:
    def __init__(self, layer: int, block: Block, source: dict[str, torch.Tensor], *,
                 weights: dict[str, torch.Tensor] | None = None, stream: torch.Tensor | None = None,
                 runtime: Runtime | None = None, batch: int = 1, pass_index: int = 0):
        self.layer, self.block, self.source, self.pass_index = layer, block, source, pass_index
        self.weights = weights if weights is not None else {}
        self.stream, self.runtime, self.batch = stream, runtime, batch
        # producer weights this job replaced (by name); the artifact stores these instead of the source's
        self.replaced: dict[str, torch.Tensor] = {}
        # for a job with a `reference` share: the unquantized model's stream of that share of the samples (the
        # first of each batch, see paired_spans), and its weights
        self.reference: torch.Tensor | None = None
        self.reference_weights: dict[str, torch.Tensor] = {}
        self.reference_share = 0.0

    @property
    def has_data(self) -> bool:
        return self.stream is not None

    def stored(self, name: str) -> torch.Tensor:
        """A tensor of the layer as the job's artifact should store it: replaced, or the source's."""
        return self.replaced.get(name, self.source[name])

    def spans(self) -> list[slice]:
        return [slice(s, s + self.batch) for s in range(0, self.stream.shape[0], self.batch)]

    def paired_spans(self) -> list[tuple[slice, slice]]:
        """(batch of the job's stream, where the reference stream keeps its first samples) for each batch."""
        return paired_spans(self.stream.shape[0], self.batch, self.reference_share)

    def _need_data(self) -> None:
        if self.stream is None:
            raise UsageError("this job needs calibration data (it re-runs the layer on the calibration samples)")

    def head_hessian(self, model, device: torch.device) -> torch.Tensor:
        """H of the output head's inputs: the final norm of this (last) layer's output stream, in float32."""
        return self.head_statistics(model, device).value()

    def head_statistics(self, model, device: torch.device) -> HessianAccumulator:
        """The accumulated statistics of the output head's inputs (the final norm of this last layer's output
        stream), with the unquantized model's inputs as the reference when the job has that stream."""
        self._need_data()
        norm = model.pieces.final_norm
        weight = {f"{norm.weight}.weight": model.final_norm_weight().float().to(device)}
        features = model.config.hidden_size
        acc = HessianAccumulator(features, device) if self.reference is None else ReferenceHessian(features, device)
        if self.reference is None:
            for span in self.spans():
                acc.add(apply_norm(norm, self.stream[span].to(device).float(), weight))
            return acc
        for span, paired in self.paired_spans():
            acc.add(apply_norm(norm, self.stream[span].to(device).float(), weight),
                    reference=apply_norm(norm, self.reference[paired].to(device).float(), weight))
        return acc

    # --- re-running a sub-block ---------------------------------------------------------------
    def residual_of(self, group: InputGroup) -> Residual:
        return self.block.residual_of(group)

    @torch.no_grad()
    def run(self, group: InputGroup | Residual, overrides: dict[str, torch.Tensor] | None = None,
            samples: slice | None = None) -> torch.Tensor:
        """The residual branch output (samples, seqlen, hidden) of the sub-block that consumes `group`, over the
        calibration samples (all, or `samples`), with `overrides` in place of the job's current weights.  The
        inputs are the job's stream as this sub-block receives it."""
        self._need_data()
        sub = group if isinstance(group, Residual) else self.residual_of(group)
        w = dict(self.weights)
        for name, t in (overrides or {}).items():
            w[name] = t.to(self.runtime.device, self.weights[name].dtype if name in self.weights else t.dtype)
        h = self.stream if samples is None else self.stream[samples]
        outs = [run_residual(sub, h[s:s + self.batch].to(self.runtime.device), w, self.runtime)
                for s in range(0, h.shape[0], self.batch)]
        return torch.cat(outs)

    # --- folding a scale into the producer of a group's input ------------------------------------
    def fold(self, group: InputGroup, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """Divide `group`'s input channels by `scale` (in_features,) in the producing op, for this job's stream
        and artifact; return the group's source weights (float32) with input columns multiplied by `scale`.
        The layer computes the same function afterwards (exactly so when `scale` holds powers of two)."""
        name, kind = group.producer, group.producer_kind
        if name is None or kind == "none":
            raise UsageError(f"{', '.join(group.linears)}: no single op produces this input; it cannot take a scale")
        scale = scale.to(torch.float32)
        weight = f"{name}.weight"
        current = self.stored(weight).to(torch.float32)
        if kind == "norm":
            new = {weight: current / scale.to(current.device)}
        elif kind == "norm+1":       # the norm multiplies by 1 + w
            new = {weight: (1.0 + current) / scale.to(current.device) - 1.0}
        else:                        # a linear: its output channels are the group's input channels
            if current.shape[0] != scale.numel():
                raise UsageError(f"{name} has {current.shape[0]} outputs but {group.linears[0]} reads "
                                 f"{scale.numel()} channels (grouped-query attention): no per-channel fold")
            new = {weight: current / scale.to(current.device)[:, None]}
            if f"{name}.bias" in self.source:
                new[f"{name}.bias"] = self.stored(f"{name}.bias").to(torch.float32) / scale.to(current.device)
        for key, t in new.items():
            self.replaced[key] = t
            if key in self.weights:
                self.weights[key] = t.to(self.weights[key].device, self.weights[key].dtype)
        scaled = {}
        for lin in group.linears:
            w = self.stored(f"{lin}.weight").to(torch.float32)
            scaled[f"{lin}.weight"] = self.replaced[f"{lin}.weight"] = w * scale.to(w.device)
        return scaled


def reference_share(job, windows: int, seqlen: int) -> float:
    """The share of the calibration windows for which `job` also gets the unquantized model's inputs (jobs.py):
    its `reference` (0: none, True: all) and `reference_tokens` as paired_share takes them."""
    return paired_share(float(getattr(job, "reference", 0) or 0), getattr(job, "reference_tokens", 0), windows, seqlen)


def paired_share(share: float, floor_tokens: int, windows: int, seqlen: int) -> float:
    """`share` of the windows, raised so that at least `floor_tokens` tokens are paired when the windows hold that
    many (a reference estimated from few tokens is noisy)."""
    if share and floor_tokens:
        share = max(share, min(1.0, floor_tokens / max(windows * seqlen, 1)))
    return min(share, 1.0)


def paired_spans(samples: int, batch: int, share: float) -> list[tuple[slice, slice]]:
    """How a reference stream covers `share` of the samples: in every batch of the job's stream, its first
    ⌈share · batch size⌉ samples (at least one), kept one after another in the reference stream.  Each batch then
    pairs a few of its windows with the unquantized model's, and every part of the calibration set is sampled."""
    out, at = [], 0
    for start in range(0, samples, batch):
        n = min(batch, samples - start)
        paired = min(n, max(1, math.ceil(share * n - 1e-9)))
        out.append((slice(start, start + n), slice(at, at + paired)))
        at += paired
    return out


def reference_samples(samples: int, batch: int, share: float) -> torch.Tensor:
    """The indices of the samples a reference stream of `share` carries, in its order (see paired_spans)."""
    return torch.cat([torch.arange(s.start, s.start + p.stop - p.start) for s, p in paired_spans(samples, batch, share)])
