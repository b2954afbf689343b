"""One EXL2 artifact being made: a two-pass job of the capture pass.

Pass 1, measurement (skipped with a complete `--measurement FILE`): the stream stays unquantized; per layer,
each sub-block's linears are quantized with every distinct layout its option table names (one Hessian
factorization per input, shared by all of them and by q/k/v), then the sub-block is re-run through the layer
context once per option, and the option's accuracy is 1 − the mean over windows of ‖y_q − y‖ / ‖y‖ of the
residual stream after the sub-block (exllamav2's measure).  The result is exllamav2's measurement.json,
written after every layer so a run that stops keeps what it measured.

Between the passes, allocate.solve picks one option per sub-block under target_bpw × weights.

Pass 2, quantization: each linear with its chosen layout, from the Hessian of the quantized model's own
stream; after the last layer the head at head_bits from the final norm's output.  Files: model*.safetensors,
config.json with exllamav2's quantization_config, measurement.json, the tokenizer and configs, quantkit.json
(the option chosen per sub-block with its predicted error, the achieved bits per weight).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ...calibration.context import LayerContext
from ...calibration.stats import GroupStats
from ...errors import UsageError
from ...model.block import InputGroup
from ..hf_folder import FolderJob, LayerJobWriter
from . import algorithm
from .allocate import Allocation, Option, solve
from .layout import checkpoint_specs, head_name, quantization_config, slots
from .layouts import HEAD_OPTIONS, RowLayout, distinct
from .packing import pack_linear


class EXL2Job(FolderJob):
    format = "exl2"
    log_key = "sub_blocks"

    def __init__(self, model, settings, variant: str, folder: Path, *, measurement: dict | None = None,
                 measurer: bool = True, save_measurement: Path | None = None, **kw):
        super().__init__(model, settings, variant, folder, None, **kw)
        self.slots = slots(model)
        self.slot_of = {(slot.layer, lin): slot for slot in self.slots for lin in slot.linears}
        # sub-block key -> its options' results; shared with the run's other exl2 jobs, of which only the
        # measurer fills it (the others join at pass 2)
        self.measurement: dict = {} if measurement is None else measurement
        self.save_measurement = save_measurement
        self.passes = 1 if all(slot.key in self.measurement for slot in self.slots) else 2
        self.first_pass = 0 if measurer or self.passes == 1 else 1
        self.stats = GroupStats(device=self.device)
        self.prepared: dict[str, algorithm.Prepared] = {}        # linear -> its input's factorization
        self.candidates: dict[tuple[str, RowLayout], torch.Tensor] = {}
        self.done: dict[str, algorithm.EXL2Linear] = {}
        self.layouts: dict[str, RowLayout] | None = None          # full linear name -> chosen layout
        self.allocation: Allocation | None = None
        self._opened = False
        if self.passes == 1:
            self._allocate()

    # --- life cycle ---------------------------------------------------------------------------
    def open(self) -> None:
        self._opened = True
        if self.layouts is not None:
            self._open_writer()

    def _open_writer(self) -> None:
        s = self.settings
        specs = checkpoint_specs(self.model, self.layouts, HEAD_OPTIONS[s.head_bits])
        self.writer = LayerJobWriter(self.model, self.folder, specs, self.max_shard_bytes)
        self.writer.open(self.resumed_written)

    def resume_state(self) -> dict:
        # the measurement so far (a follower's is the measurer's, shared); the rest is the folder job's
        return {**super().resume_state(), "measurement": dict(self.measurement)}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self.measurement.update(state["measurement"])

    def run_uncalibrated(self, progress_task=None) -> None:
        raise UsageError("exl2 needs calibration data: it measures and quantizes from the layers' inputs")

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()

    @property
    def quantizing(self) -> bool:
        return self.layouts is not None

    # --- the capture pass -----------------------------------------------------------------------
    def observe(self, ctx: LayerContext, group: InputGroup, x: torch.Tensor) -> None:
        if not self.quantizing and self.slot_of[(ctx.layer, group.linears[0])].key in self.measurement:
            return                       # measured by an earlier run (a measurement file given in part)
        self.stats.add(group, x)

    def quantize_group(self, ctx: LayerContext, group: InputGroup) -> dict[str, torch.Tensor]:
        acc = self.stats.pop(group.linears, None)
        slot = self.slot_of[(ctx.layer, group.linears[0])]
        if acc is None and (not slot.routed or (not self.quantizing and slot.key in self.measurement)):
            return {}                    # a sub-block measured by an earlier run
        if acc is None:                  # an expert no calibration token reached: the grid's rounding, no feedback
            h = torch.eye(ctx.source[f"{group.linears[0]}.weight"].shape[1], device=self.device)
        else:
            h = acc.value()
        prep = algorithm.prepare(h, self.settings.damp)
        if self.quantizing:
            return self._quantize(ctx, group, prep)
        for lin in group.linears:
            self.prepared[lin] = prep
        sub = ctx.residual_of(group)
        if group == sub.stages[-1][-1]:  # every input of the sub-block seen: measure its options
            self._measure(ctx, sub, slot)
        return {}                        # the measurement's stream stays unquantized

    def _measure(self, ctx: LayerContext, sub, slot) -> None:
        windows = ctx.stream.shape[0]
        n = self.settings.measure_samples
        some = slice(0, None, 1 if not n else -(-windows // n))
        positions = distinct(slot.table)
        bits = {}
        for lin, p in zip(slot.linears, slot.positions):
            w = ctx.source[f"{lin}.weight"]
            # kept as the layer computes with them (ctx.run casts to that anyway): a mixture holds every
            # expert's candidates at once, ~4x less memory in bf16 than in float32, same results
            dtype = ctx.weights[f"{lin}.weight"].dtype
            for lay in positions[p]:
                self.candidates[(lin, lay)] = algorithm.quantize(w, self.prepared[lin], lay).weight.to(dtype)
                bits[(lin, lay)] = lay.total_bits(w.shape[1], w.shape[0], f"{lin}.bias" in ctx.source)
        x = ctx.stream[some].float()
        reference = x + ctx.run(sub, samples=some).float()
        norms = torch.linalg.vector_norm(reference.flatten(1), dim=1)
        results = []
        for option in slot.table:
            chosen = slot.layouts(option)
            out = x + ctx.run(sub, {f"{lin}.weight": self.candidates[(lin, lay)] for lin, lay in chosen.items()},
                              samples=some).float()
            rel = torch.linalg.vector_norm((out - reference).flatten(1), dim=1) / norms
            entry = {"accuracy": max(1e-6, 1 - rel.mean().item()),
                     "total_bits": sum(bits[(lin, lay)] for lin, lay in chosen.items())}
            entry.update({k: lay.to_dict() for k, lay in zip(slot.keys, option)})
            results.append(entry)
        self.measurement[slot.key] = results
        self.candidates.clear()
        for lin in slot.linears:
            self.prepared.pop(lin, None)
        self._save_measurement()

    def _save_measurement(self) -> None:
        data = json.dumps({"measurement": self.measurement, "last_module_idx": len(self.measurement)}, indent=2)
        for path in [self.folder / "measurement.json"] + ([Path(self.save_measurement)] if self.save_measurement else []):
            path.write_text(data + "\n")

    def end_pass(self, index: int) -> None:
        if index == 0 and self.passes == 2:
            self._allocate()
            if self._opened:
                self._open_writer()

    def _allocate(self) -> None:
        s = self.settings
        options, weights = [], 0
        for slot in self.slots:
            prefix = self.model.adapter.prefix(slot.layer)
            measured = self.measurement.get(slot.key)
            if not measured:
                raise UsageError(f"exl2: the measurement has no entry for {slot.key}")
            try:
                options.append([(Option(int(m["total_bits"]), 1 - float(m["accuracy"])),
                                 {prefix + n: RowLayout.from_dict(m[slot.keys[p]])
                                  for n, p in zip(slot.linears, slot.positions)}) for m in measured])
            except KeyError as e:
                raise UsageError(f"exl2: the measurement's options for {slot.key} have no {e}: measured for another "
                                 f"model") from None
            weights += sum(self.model.weights.entries[f"{prefix}{n}.weight"].numel for n in slot.linears)
        budget = int(weights * s.target_bpw)
        try:
            self.allocation = solve([[o for o, _ in slot] for slot in options], budget)
        except ValueError as e:
            raise UsageError(f"exl2:{self.variant}: {e} (target {s.target_bpw} bpw over {weights} weights)") from None
        self.layouts = {}
        for slot, c in zip(options, self.allocation.choice):
            self.layouts.update(slot[c][1])
        self.weights_counted = weights
        self.stats.clear()

    def _quantize(self, ctx: LayerContext, group: InputGroup, prep: algorithm.Prepared) -> dict[str, torch.Tensor]:
        prefix = self.model.adapter.prefix(ctx.layer)
        out = {}
        for lin in group.linears:
            q = algorithm.quantize(ctx.source[f"{lin}.weight"], prep, self.layouts[prefix + lin])
            self.done[lin] = q
            out[f"{lin}.weight"] = q.weight
        return out

    def finish_layer(self, ctx: LayerContext) -> None:
        if not self.quantizing:
            return
        for row in self.model.stored_linears[ctx.layer]:
            q = self.done.pop(row.parts[0])
            for suffix, t in pack_linear(q.codes, q.groups, q.qscale, q.scale_max, q.perm).items():
                self.writer.put(f"{row.name}.{suffix}", t)
        self.writer.put_layer_rest(ctx)   # norms and biases, in float16 as planned
        self.layer_log.extend(
            {"sub_block": slot.key, "option": self.allocation.choice[i],
             "predicted_error": round(1 - self.measurement[slot.key][self.allocation.choice[i]]["accuracy"], 8)}
            for i, slot in enumerate(self.slots) if slot.layer == ctx.layer)
        if ctx.layer == self.model.num_layers - 1:
            self._quantize_head(ctx)

    def _quantize_head(self, ctx: LayerContext) -> None:
        """The head at head_bits, from the Hessian of what it reads: the final norm of the quantized stream."""
        model = self.model
        H = ctx.head_hessian(model, self.device)
        head = model.lm_head_weight()
        q = algorithm.quantize(head, algorithm.prepare(H, self.settings.damp), HEAD_OPTIONS[self.settings.head_bits])
        self.head = pack_linear(q.codes, q.groups, q.qscale, q.scale_max, q.perm)

    def finish(self) -> Path:
        model, adapter = self.model, self.model.adapter
        w = self.writer.writer
        w.put(adapter.final_norm, model.final_norm_weight().to(torch.float16))
        for suffix, t in self.head.items():
            w.put(f"{head_name(adapter)}.{suffix}", t)
        for name in model.beside_language_model():
            t = model.tensor(name)
            w.put(name, t.to(torch.float16) if t.is_floating_point() else t)
        self._save_measurement()
        return self.write_side_files(w.close())

    def quantization_config(self) -> dict:
        c = self.calibration
        return quantization_config(self.settings.target_bpw, self.settings.head_bits,
                                   c.samples if c is not None else 0, c.seqlen if c is not None else 0,
                                   Path(str(c.spec.source)).name if c is not None else "(none)")

    def summary(self) -> dict:
        a = self.allocation
        return {"target_bpw": self.settings.target_bpw, "achieved_bpw": round(a.bits / self.weights_counted, 5),
                "budget_bits": int(self.weights_counted * self.settings.target_bpw), "allocated_bits": a.bits,
                "predicted_error": round(a.error, 6), "measured_here": self.passes == 2 and self.first_pass == 0}
