"""AWQ GEMM checkpoints for transformers + GPTQModel and vLLM, quantized by quantkit's own AWQ."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import Backend, Plan
from ..hf_folder import EXPERTS_NOTE, plan_rows
from ...artifact import model_stem
from ...device import matmul_flops, resolve_device
from ...errors import UsageError
from ...model.block import Attention, MoE
from ...options import RunOptions
from ...preflight import (RUNTIME_BYTES, Resources, folder_disk, held_second_moments, largest_layer, layer_params,
                           layer_shapes, layer_walk, pass_ram, pass_seconds, stream_bytes)
from . import spec as awq_spec
from .algorithm import AWQSettings
from .job import AWQJob, InputStats
from .layout import check_model, checkpoint_specs
from .reader import AWQCheckpoint, describe, read_quantization_config

FLAG_KEYS = {"awq_clip": "search_clip", "awq_duo": "duo_scaling", "awq_grid": "grid",
             "awq_search_samples": "search_samples"}
FLAG_HELP = {"awq_clip": "AWQ's clip search", "awq_duo": "AWQ's duo scaling", "awq_grid": "AWQ's α grid",
             "awq_search_samples": "AWQ's search windows"}


@dataclass(frozen=True)
class AWQRunSettings:
    run: RunOptions
    flags: tuple[tuple[str, object], ...] = ()

    def resolve(self, variant: awq_spec.AWQVariant) -> tuple[AWQSettings, bool]:
        return variant.settings(dict(self.flags))


def describe_settings(s: AWQSettings, rtn: bool) -> str:
    group = "per-row" if s.group_size == -1 else f"g{s.group_size}"
    if rtn:
        return f"awq {s.bits}-bit {group} round-to-nearest"
    steps = [name for name, on in (("scales", s.search_scales), ("clip", s.search_clip)) if on]
    return " ".join([f"awq {s.bits}-bit {group}", "+".join(steps) or "no search", "" if s.duo_scaling else "x-only"]).strip()


def consumer_notes(model, s: AWQSettings) -> list[str]:
    notes = []
    if s.group_size == -1:
        notes.append("one group per row: transformers + GPTQModel load it; vLLM's AWQ kernels want groups")
    if model.has_experts:
        notes += ["mixture of experts: one scale per layer for all experts' gate/up (folded into the norm, "
                  "router scaled to match)", EXPERTS_NOTE]
    return notes


def output_folder(model, out_dir: Path, variant: str) -> Path:
    return Path(out_dir) / f"{model_stem(model.name)}-awq-{variant.lower()}"


class AWQBackend(Backend):
    name = "awq"
    summary = "AWQ 4-bit GEMM (groups 32/64/128/none, scale + clip search) for transformers + GPTQModel, vLLM"
    calibrated = True
    owned_options = FLAG_HELP

    def settings(self, options: dict) -> AWQRunSettings:
        return AWQRunSettings(RunOptions.from_dict(options),
                              tuple((field, options.get(key)) for key, field in FLAG_KEYS.items()))

    def variants(self) -> list[str]:
        return list(awq_spec.EXAMPLES)

    def parse_variant(self, text: str) -> awq_spec.AWQVariant:
        return awq_spec.parse(text)

    def needs_calibration(self, variant: awq_spec.AWQVariant, settings: AWQRunSettings) -> bool:
        return not settings.resolve(variant)[1]

    def plan(self, model, variant: awq_spec.AWQVariant, out_dir: Path, settings: AWQRunSettings) -> Plan:
        s, rtn = settings.resolve(variant)
        check_model(model, s)
        kind = describe_settings(s, rtn)
        rows = plan_rows(model, checkpoint_specs(model, s), kind,
                         lambda lin: f"{lin.in_features // s.group(lin.in_features)} groups")
        plan = Plan("awq", variant.text, str(output_folder(model, out_dir, variant.text)), rows)
        run = settings.run
        if not rtn:
            plan.extra["calibration"] = run.calibration_text()
        text, shared, own, stream = _memory_estimate(model, run.calib_samples, run.calib_seqlen, rtn)
        plan.extra["peak memory (estimate)"] = text
        device = resolve_device(run.device)
        seconds = (0.0, 0.0)
        if run.estimate_time:
            seconds = _time_estimate(model, run.calib_samples, run.calib_seqlen, s, rtn, device)
            plan.extra["time (estimate)"] = f"{sum(seconds):.0f} s on {device}"
        plan.resources = Resources(own_ram=own, shared_ram=shared, own_seconds=seconds[1], forward_seconds=seconds[0],
                                   final_disk=folder_disk(model, plan), stream=stream, calibrated=not rtn,
                                   on_device=device.type == "cuda")
        plan.extra["loads in"] = ("transformers + GPTQModel (CPU or GPU), vLLM (GPU)" if s.group_size != -1
                                  else "transformers + GPTQModel")
        plan.extra["settings"] = json.dumps(s.__dict__)
        for i, n in enumerate(consumer_notes(model, s)):
            plan.extra[f"note {i + 1}"] = n
        return plan

    def make_job(self, model, variant: awq_spec.AWQVariant, plan: Plan, folder: Path, settings: AWQRunSettings,
                 calibration) -> AWQJob:
        s, rtn = settings.resolve(variant)
        return AWQJob(model, s, variant.text, folder, rtn=rtn, device=resolve_device(settings.run.device),
                      calibration=None if rtn else calibration, notes=consumer_notes(model, s),
                      max_shard_bytes=settings.run.max_shard_bytes)

    def can_read(self, path: Path) -> bool:
        p = Path(path)
        return p.is_dir() and read_quantization_config(p) is not None

    def open_artifact(self, path: Path, base=None, activations: str = "exact") -> AWQCheckpoint:
        if activations != "exact":
            raise UsageError("--activations: AWQ runtimes compute in the model dtype; use the default (exact)")
        return AWQCheckpoint(Path(path))

    def describe_artifact(self, path: Path) -> dict:
        return describe(Path(path))

    runtimes = ("transformers", "vllm")
    kv_cache_runtimes = ("transformers",)

    def runtime_logits(self, path: Path, runtime: str, tokens: torch.Tensor, kv_cache: str | None = None):
        if runtime != "transformers":
            return super().runtime_logits(path, runtime, tokens)
        from . import consumer
        return consumer.window_logits(Path(path), tokens, kv_cache=kv_cache)

    runtime_packages = {"transformers": ("transformers", "gptqmodel"), "vllm": ("vllm",)}

    def runtime_loaders(self, path: Path, runtime: str, ctx: int) -> list:
        if runtime != "transformers":
            return super().runtime_loaders(path, runtime, ctx)
        from ...verify.sessions import PLAIN, TransformersSession, from_pretrained_plain
        from . import consumer
        fp32 = ("GPTQModel.load(folder) in float32" if AWQCheckpoint(Path(path)).has_experts else
                "AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)")
        return [(PLAIN, lambda: TransformersSession(from_pretrained_plain(Path(path)), PLAIN)),
                (fp32, lambda: TransformersSession(consumer.load(Path(path), torch.float32), fp32))]


def _memory_estimate(model, samples: int, seqlen: int, rtn: bool) -> tuple[str, int, int, int]:
    """(text, RAM shared with the run's other calibrated jobs, RAM of this job alone, its stream's bytes)."""
    dequantized = layer_params(model) * 4      # beside the pass's layer and its scaled copy
    if rtn:
        weights = 3 * dequantized
        return f"{(weights + RUNTIME_BYTES) / 2**30:.2f} GiB (one layer in float32 + runtime)", 0, weights, 0
    stream = stream_bytes(model, samples, seqlen)
    outputs = 2 * stream                       # the sub-block's reference and candidate outputs
    shared = pass_ram(model, seqlen)
    # every group of the widest stage holds its H until the stage is quantized (all experts of a MoE layer)
    second_moments = held_second_moments(model)
    search = _search_copies(model)
    total = stream + outputs + shared + dequantized + second_moments + search + RUNTIME_BYTES
    return (f"{total / 2**30:.2f} GiB (hidden states {stream / 2**30:.2f} GiB per calibrated artifact + the "
            f"sub-block outputs the search compares + one layer + one batch + second moments + the scale "
            f"search's copies + runtime)", shared, stream + outputs + dequantized + second_moments + search, stream)


def _search_copies(model) -> int:
    """The scale search's float32 copies of the largest group it scales at once — the weights stacked, scaled,
    fake-quantized and unscaled: every expert's gate/up together in a mixture (measured: 4 × 128 MiB live on a
    synthetic mixtral with 8 experts of 1024 × 2048)."""
    shapes = layer_shapes(model)
    block = model.block(largest_layer(model))
    widest = max(sum(shapes[lin][0] * shapes[lin][1] for g in stage for lin in g.linears)
                 for r in block.residuals for stage in r.stages)
    return widest * 4 * 4


def _time_estimate(model, samples: int, seqlen: int, s: AWQSettings, rtn: bool,
                   device: torch.device) -> tuple[float, float]:
    """(this job's walk of the layers, its own work per layer × layers).  Per input group: every candidate scale
    (grid + the unscaled one) is fake-quantized, then scored by re-running its residual sub-block on the search
    windows (a group behind a norm; a sub-block costs its share of the layer's forward, which the pass's probe
    timed) or by tr(ΔW·H·ΔWᵀ) (a group behind a linear); the clip search fake-quantizes each of its candidates.
    The walk is probed gathering the job's own statistics (mean |x| and H; counted apart as K² products at the
    1024² matmul rate, the demo's run was estimated at 0.71x); a candidate is timed here (_candidate_cost), the
    clip search's block products count at that matmul rate."""
    if rtn:
        return 0.0, layer_params(model) * model.num_layers * 5e-9
    walk = pass_seconds(model, samples, seqlen, device, InputStats)
    _, per_window = layer_walk(model, seqlen, device)
    forward = per_window / 2                            # the staged walk runs each sub-block about twice
    shapes = layer_shapes(model)
    block = model.block(largest_layer(model))
    total = sum(shapes[lin][0] * shapes[lin][1] for lin in block.linears)
    flops = matmul_flops(device, torch.float32)
    cost = _candidate_cost(s, device)
    softmax = {n for r in block.residuals if isinstance(r.op, Attention) for n in (r.op.q, r.op.k)}
    candidates, clips = s.grid + 1, int(s.max_shrink * s.grid)
    searched = min(samples, s.search_samples or samples)
    own = 0.0
    for r in block.residuals:
        share = sum(shapes[lin][0] * shapes[lin][1] for st in r.stages for g in st for lin in g.linears) / total
        for index, stage in enumerate(r.stages):
            if index == 0 and isinstance(r.op, MoE) and s.search_scales:   # the experts are balanced together
                n, k = sum(shapes[lin][0] for g in stage for lin in g.linears), shapes[stage[0].linears[0]][1]
                own += candidates * (cost(n, k) + forward * share * searched)
            for g in stage:
                n, k = sum(shapes[lin][0] for lin in g.linears), shapes[g.linears[0]][1]
                if s.search_scales and not (index == 0 and isinstance(r.op, MoE)):
                    rerun = forward * share * searched if index == 0 else 0.0   # else scored by its H
                    own += candidates * (cost(n, k, scored=index > 0) + rerun)
                rows = sum(shapes[lin][0] for lin in g.linears if lin not in softmax)
                if s.search_clip and rows:
                    own += clips * (cost(rows, k) + 2 * rows * k * s.group(k) / flops)
    return walk, own * model.num_layers


# weights a fake-quantization probe times at most: a stack this size (64 MiB in float32) already runs at the
# memory-bound rate of larger ones
_PROBE_WEIGHTS = 16 * 2**20


def _candidate_cost(s: AWQSettings, device: torch.device):
    """cost(rows, columns, scored=False): seconds of one scale candidate here on a stack of that shape — W·s
    quantized, dequantized and divided by s, and for a group behind a linear (`scored`) its loss
    tr(ΔW·H·ΔWᵀ) — timed on up to _PROBE_WEIGHTS of it once per shape and scaled by the rows.  Timed, not
    counted: the quantize-dequantize took 8.5 ns a weight on the synthetic mixtral's 16 expert gate/up balanced
    together (33.5 M weights) and 1.7 ns on one of its 2 M-weight linears, and the loss's products at the
    1024² matmul rate read the demo's run at 0.73x."""
    from .algorithm import fake_quantize, linear_loss
    probed: dict[tuple[int, int, bool], float] = {}
    gen = torch.Generator().manual_seed(0)

    def cost(rows: int, k: int, scored: bool = False) -> float:
        probe = max(1, min(rows, _PROBE_WEIGHTS // k))
        if (probe, k, scored) not in probed:
            w = torch.randn(probe, k, generator=gen).to(device)
            scale = (torch.rand(k, generator=gen) + 0.5).to(device)
            loss = None
            if scored:
                x = torch.randn(2 * k, k, generator=gen).to(device)
                loss = linear_loss(w, x.T @ x / x.shape[0])

            def candidate() -> None:
                c = fake_quantize(w * scale, s) / scale
                if loss is not None:
                    loss(c)
            candidate()                           # the first call at a size pays for its buffers
            t0 = time.perf_counter()
            candidate()
            probed[probe, k, scored] = (time.perf_counter() - t0) / probe
        return probed[probe, k, scored] * rows
    return cost


BACKEND = AWQBackend()
