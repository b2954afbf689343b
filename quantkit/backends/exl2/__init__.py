"""EXL2 folders for exllamav2 / TabbyAPI: measured, allocated to a target bits per weight, quantized by
quantkit's own EXL2 quantizer on the shared capture pass (CPU or GPU)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import Backend, Plan, PlanRow
from ...artifact import model_stem
from ...device import resolve_device
from ...errors import UsageError
from ...options import RunOptions
from ...preflight import (RUNTIME_BYTES, Resources, folder_disk, largest_layer, layer_params, layer_shapes, layer_walk,
                           pass_seconds, stream_bytes)
from . import algorithm, spec as exl2_spec
from .job import EXL2Job
from .layout import check_model, head_name, slots
from .layouts import ATTENTION_OPTIONS, HEAD_OPTIONS, MLP_OPTIONS, distinct
from .reader import EXL2Checkpoint, read_quantization_config

FLAG_HELP = {"measurement": "an EXL2 measurement.json to reuse (skips the measurement pass)",
             "save_measurement": "where to keep the EXL2 measurement.json as well",
             "exl2_measure_samples": "EXL2's measurement windows (0 = all)"}


@dataclass(frozen=True)
class EXL2RunSettings:
    run: RunOptions
    measurement: str | None = None
    save_measurement: str | None = None
    measure_samples: int | None = None
    # One measurement per run serves every exl2 target in it: (damp, windows) -> the measurement dict that the
    # first job of those settings fills and the others read after pass 1.
    shared: dict = field(default_factory=dict, compare=False, repr=False)

    def load_measurement(self) -> dict | None:
        if not self.measurement:
            return None
        path = Path(self.measurement)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise UsageError(f"--measurement {path}: cannot read it ({e.strerror or e})") from None
        except ValueError:
            raise UsageError(f"--measurement {path}: not JSON (expected exllamav2's measurement.json)") from None
        if not isinstance(data, dict) or not isinstance(data.get("measurement"), dict):
            raise UsageError(f"--measurement {path}: no \"measurement\" object (expected exllamav2's measurement.json)")
        return data


def output_folder(model, out_dir: Path, variant: str) -> Path:
    return Path(out_dir) / f"{model_stem(model.name)}-exl2-{variant.lower()}"


class EXL2Backend(Backend):
    name = "exl2"
    summary = "EXL2 mixed bitrate to a target bpw (measured, allocated, GPTQ-quantized) for exllamav2 / TabbyAPI"
    calibrated = True
    owned_options = FLAG_HELP

    def settings(self, options: dict) -> EXL2RunSettings:
        return EXL2RunSettings(RunOptions.from_dict(options), options.get("measurement"),
                               options.get("save_measurement"), options.get("exl2_measure_samples"))

    def variants(self) -> list[str]:
        return list(exl2_spec.EXAMPLES)

    def parse_variant(self, text: str) -> exl2_spec.EXL2Variant:
        return exl2_spec.parse(text)

    def needs_calibration(self, variant, settings: EXL2RunSettings) -> bool:
        return True

    def plan(self, model, variant: exl2_spec.EXL2Variant, out_dir: Path, settings: EXL2RunSettings) -> Plan:
        check_model(model)
        s = variant.settings(settings.measure_samples)
        measurement = settings.load_measurement()
        rows = []
        weights = 0
        for slot in slots(model):
            prefix = model.adapter.prefix(slot.layer)
            for n in slot.linears:
                e = model.weights.entries[f"{prefix}{n}.weight"]
                weights += e.numel
                rows.append(PlanRow(f"{prefix}{n}", tuple(e.shape), f"exl2 ~{s.target_bpw} bpw",
                                    int(e.numel * s.target_bpw / 8), "bits chosen by the measurement"))
        hidden, vocab = model.config.hidden_size, model.config.vocab_size
        head = HEAD_OPTIONS[s.head_bits]
        rows.append(PlanRow(head_name(model.adapter), (vocab, hidden), f"exl2 head {s.head_bits}-bit",
                            head.total_bits(hidden, vocab) // 8, head.desc))
        kept = {model.adapter.embed, model.adapter.final_norm}
        for i in range(model.num_layers):
            linears = {f"{lin}.weight" for lin in model.block(i).linears}
            kept |= {model.adapter.prefix(i) + rel for rel in model.stored_names(i) if rel not in linears}
        for name in sorted(kept, key=list(model.weights.entries).index):
            e = model.weights.entries[name]
            rows.append(PlanRow(name, tuple(e.shape), "float16", e.numel * 2, "kept"))
        plan = Plan("exl2", variant.text, str(output_folder(model, out_dir, variant.text)), rows)
        run = settings.run
        plan.extra["calibration"] = run.calibration_text()
        plan.extra["bit budget"] = (f"{int(weights * s.target_bpw)} bits for {weights} decoder-linear weights "
                                    f"(≤ {s.target_bpw} bpw as exllamav2 counts, scales and permutations included)")
        plan.extra["measurement"] = (f"from {settings.measurement}" if measurement else
                                     f"pass 1 measures {len(ATTENTION_OPTIONS)} attention and {len(MLP_OPTIONS)} MLP "
                                     f"options per layer on {s.measure_samples or 'all'} windows, once for "
                                     f"every exl2 target of the run")
        device = resolve_device(run.device)
        text, shared, own, stream = _memory_estimate(model, run.calib_samples, run.calib_seqlen,
                                                     measuring=measurement is None, device=device)
        plan.extra["peak memory (estimate)"] = text
        seconds = (0.0, 0.0)
        if run.estimate_time:
            seconds = _time_estimate(model, run.calib_samples, run.calib_seqlen, s, measurement is None, device)
            plan.extra["time (estimate)"] = f"{sum(seconds):.0f} s on {device}"
        plan.resources = Resources(own_ram=own, shared_ram=shared, own_seconds=seconds[1], forward_seconds=seconds[0],
                                   final_disk=folder_disk(model, plan) + _MEASUREMENT_BYTES_PER_LAYER * model.num_layers,
                                   stream=stream, calibrated=True, on_device=device.type == "cuda")
        plan.extra["loads in"] = "exllamav2 / TabbyAPI (CUDA or ROCm; transformers does not load EXL2)"
        return plan

    def make_job(self, model, variant, plan: Plan, folder: Path, settings: EXL2RunSettings, calibration) -> EXL2Job:
        s = variant.settings(settings.measure_samples)
        key = (s.damp, s.measure_samples)
        measurer = key not in settings.shared
        if measurer:
            settings.shared[key] = dict((settings.load_measurement() or {}).get("measurement", {}))
        return EXL2Job(model, s, variant.text, folder, measurement=settings.shared[key], measurer=measurer,
                       save_measurement=Path(settings.save_measurement) if settings.save_measurement else None,
                       device=resolve_device(settings.run.device), calibration=calibration,
                       max_shard_bytes=settings.run.max_shard_bytes)

    def can_read(self, path: Path) -> bool:
        p = Path(path)
        return p.is_dir() and read_quantization_config(p) is not None

    def open_artifact(self, path: Path, base=None, activations: str = "exact") -> EXL2Checkpoint:
        if activations != "exact":
            raise UsageError("--activations: use the default (exact) for EXL2")
        return EXL2Checkpoint(Path(path))

    runtimes = ("exllamav2",)           # loaded and run the base class's way (quantkit.verify.sessions)
    runtime_packages = {"exllamav2": ("exllamav2",)}

    def describe_artifact(self, path: Path) -> dict:
        m = EXL2Checkpoint(Path(path))
        q = m.qconfig
        return m.described("exl2", bits=q.get("bits"), head_bits=q.get("head_bits"), version=q.get("version"),
                           calibration=q.get("calibration"))


_MEASUREMENT_BYTES_PER_LAYER = 12 * 1024     # measurement.json: two sub-blocks' options with their errors


# quantizing the head holds it as stored and in float32, its processing-order copy, int16 codes, the quantized
# values and the errors, then the packed result: 25 bytes per weight measured on the demo (49152 × 576, 0.68 GiB)
HEAD_BYTES_PER_WEIGHT = 25


def _memory_estimate(model, samples: int, seqlen: int, *, measuring: bool, device) -> tuple[str, int, int, int]:
    """(text, RAM shared with the run's other calibrated jobs, RAM of this job alone, its stream's bytes)."""
    cfg = model.config
    working = layer_params(model) * 4 * 2                             # the layer in float32 + the working copy
    candidates = _candidate_bytes(model, device) if measuring else 0
    stream = stream_bytes(model, samples, seqlen)
    head = cfg.vocab_size * cfg.hidden_size * HEAD_BYTES_PER_WEIGHT
    total = stream * 3 + working + candidates + head + RUNTIME_BYTES
    return (f"{total / 2**30:.2f} GiB (hidden states {stream / 2**30:.2f} GiB + the sub-block outputs the "
            f"measurement compares + one layer + its largest sub-block's candidates "
            f"{candidates / 2**30:.2f} GiB + the head + runtime)",
            0, stream * 3 + working + candidates + head, stream)


def _candidate_bytes(model, device) -> int:
    """The measurement holds, for one sub-block at a time, each of its linears quantized with every distinct
    layout its position takes in the option table, in the layer's compute dtype: for a mixture, every expert's
    at once (measured: 1.27 GiB live on a synthetic mixtral, 8 experts of 1024 × 2048, 13-14 layouts each)."""
    from ...calibration.capture import default_compute_dtype
    shapes = layer_shapes(model)
    width = torch.finfo(default_compute_dtype(device)).bits // 8
    largest = 0
    for slot in _largest_layer_tables(model):
        layouts = distinct(slot.table)
        largest = max(largest, sum(shapes[lin][0] * shapes[lin][1] * len(layouts[p])
                                   for lin, p in zip(slot.linears, slot.positions)))
    return largest * width


def _time_estimate(model, samples: int, seqlen: int, s, measure: bool, device: torch.device) -> tuple[float, float]:
    """(this job's walks of the layers, its own work): two walks with measurement, one without; per layer the
    measurement quantizes each linear once per distinct layout of its table and re-runs each sub-block once per
    option on its windows (its share of the layer's forward, from the pass's probe); pass 2 quantizes each linear
    once, then the head.  The quantizations are timed here (`_probe_quantize`)."""
    walk = pass_seconds(model, samples, seqlen, device)
    _, per_window = layer_walk(model, seqlen, device)
    shapes = layer_shapes(model)
    blocks = _largest_layer_tables(model)
    cost = _probe_quantize(blocks, shapes, s, device)
    layer_weights = sum(shapes[lin][0] * shapes[lin][1] for slot in blocks for lin in slot.linears)
    own = 0.0
    for slot in blocks:
        names, table = slot.linears, slot.table
        own += sum(cost(shapes[lin]) for lin in names)                                   # pass 2
        if measure:
            share = sum(shapes[lin][0] * shapes[lin][1] for lin in names) / layer_weights
            windows = min(samples, s.measure_samples or samples)
            positions = distinct(table)
            own += sum(cost(shapes[lin], lay) for lin, p in zip(names, slot.positions) for lay in positions[p])
            own += len(table) * per_window / 2 * share * windows
    head = cost((model.config.vocab_size, model.config.hidden_size))
    return walk * (2 if measure else 1), own * model.num_layers + head


def _largest_layer_tables(model) -> list:
    """The largest layer's sub-blocks (attention, MLP or mixture): their linears and the option table each is
    measured with."""
    i = largest_layer(model)
    return [slot for slot in slots(model) if slot.layer == i]


def _probe_quantize(blocks: list, shapes: dict, s, device: torch.device):
    """cost(shape, layout) in seconds of one EXL2 quantization here.  Each linear shape of layer 0 is timed at one
    layout; the layouts of each table are weighed against it on the table's largest linear (up to 1024 rows),
    since they cost up to 3x apart (the demo's gate: 0.07 s at groups of 32, 0.19-0.21 s at 64 and 128).  A shape
    the layer does not have (the head) scales from the largest linear by its columns' count and weights."""
    gen = torch.Generator().manual_seed(0)
    base = distinct(MLP_OPTIONS)[0][0]
    prepared: dict[int, algorithm.Prepared] = {}

    def prep(k: int) -> algorithm.Prepared:
        if k not in prepared:
            x = torch.randn(2 * k, k, generator=gen)
            prepared[k] = algorithm.prepare((x.T @ x / x.shape[0]).to(device), s.damp)
        return prepared[k]

    def timed(w: torch.Tensor, lay) -> float:
        algorithm.quantize(w[:8], prep(w.shape[1]), lay)          # first-call set-up is not per weight
        t0 = time.perf_counter()
        algorithm.quantize(w, prep(w.shape[1]), lay)
        return time.perf_counter() - t0

    linears = [n for slot in blocks for n in slot.linears]
    per_shape = {sh: timed(torch.randn(sh, generator=gen).to(device), base) for sh in dict.fromkeys(shapes[n] for n in linears)}
    ratio = {}
    for slot in blocks:
        table = slot.table
        big = max(slot.linears, key=lambda n: shapes[n][0] * shapes[n][1])
        w = torch.randn(min(shapes[big][0], 1024), shapes[big][1], generator=gen).to(device)
        reference = timed(w, base)
        for layouts in distinct(table):
            for lay in layouts:
                ratio.setdefault(lay, timed(w, lay) / reference)
    largest = max(per_shape, key=lambda sh: sh[0] * sh[1])

    def cost(shape: tuple[int, int], lay=None) -> float:
        seconds = per_shape.get(shape)
        if seconds is None:
            seconds = per_shape[largest] * shape[0] * shape[1] / (largest[0] * largest[1])
        return seconds * (ratio.get(lay, 1.0) if lay is not None else 1.0)
    return cost


BACKEND = EXL2Backend()
