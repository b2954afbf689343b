"""The job protocol of the capture pass, typed in one place.

A `LayerJob` is one participant of the pass (a calibrated artifact being made, or a statistics collector such
as the GGUF importance matrix).  For every layer and every input group of the layer's block description, in
true-sequential order, the pass calls

    observe(ctx, group, x)      once per batch: x (tokens, in_features) is what the group's linears read
    quantize_group(ctx, group)  once: returns the weights the job's own stream continues with, by name
                                ("mlp.up_proj.weight"); {} keeps the current ones
    finish_layer(ctx)           the layer is done (write it out)

and, after the last layer of each pass, `end_pass(index)`.  A job with a `reference` share (0 < share ≤ 1) is
called `observe(ctx, group, x, reference=x_ref)` instead, x_ref being what the group's linears read in the
unquantized model for the first samples of the batch, ⌈share × batch⌉ of them (context.paired_spans), and None
inside a routed MoE block, where the two streams route tokens differently: the pass keeps that model's stream
for those samples beside the job's own (walking it costs about one forward of the share).  A job with `passes = 2` sees every layer in pass 0
(EXL2's measurement) before any layer in pass 1; each pass starts a fresh stream from the embeddings.  A job
with `first_pass = 1` sits pass 0 out (an EXL2 target that reads the measurement another job of the run makes)
but still gets `end_pass(0)`, after the jobs that took part in it.

`ArtifactJob` adds the artifact's life cycle: `open`, `finish` (-> the artifact's path), `abort`, and
`run_uncalibrated` for variants that need no data (round to nearest), which walks the layers with
data-less contexts.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from ..model.block import InputGroup

if TYPE_CHECKING:
    from .context import LayerContext


@runtime_checkable
class LayerJob(Protocol):
    label: str
    passes: int

    def observe(self, ctx: "LayerContext", group: InputGroup, x: torch.Tensor) -> None: ...

    def quantize_group(self, ctx: "LayerContext", group: InputGroup) -> dict[str, torch.Tensor]: ...

    def finish_layer(self, ctx: "LayerContext") -> None: ...

    def end_pass(self, index: int) -> None: ...


@runtime_checkable
class ArtifactJob(LayerJob, Protocol):
    needs_calibration: bool

    def open(self) -> None: ...

    def run_uncalibrated(self, progress_task=None) -> None: ...

    def finish(self) -> Path: ...

    def abort(self) -> None: ...


class PassJob:
    """Defaults for a one-pass job that quantizes nothing; participants override what they need."""
    label = "job"
    passes = 1
    first_pass = 0
    reference = 0.0       # > 0: observe() also gets the unquantized model's inputs for that share of the samples
                          # (see the module docstring); True counts as 1, all of them
    calibration = None    # the run's CalibrationSet, given to every pass job before the pass

    def resume_state(self) -> dict:
        """What the job carries from one layer to the next, for a crash resume (quantkit.calibration.resume);
        called between layers, picklable."""
        return {}

    def restore(self, state: dict) -> None:
        """Take back a `resume_state()` before the run goes on from its layer."""

    def observe(self, ctx, group: InputGroup, x: torch.Tensor) -> None:
        pass

    def quantize_group(self, ctx, group: InputGroup) -> dict[str, torch.Tensor]:
        return {}

    def finish_layer(self, ctx) -> None:
        pass

    def end_pass(self, index: int) -> None:
        pass
