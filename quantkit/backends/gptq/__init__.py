"""GPTQ checkpoints for transformers + GPTQModel, vLLM and exllamav2, quantized by quantkit's own GPTQ."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import Backend, Plan
from ..hf_folder import EXPERTS_NOTE, plan_rows
from ...artifact import model_stem
from ...calibration.stats import HessianAccumulator
from ...device import resolve_device
from ...model.checkpoint import Checkpoint
from ...options import RunOptions
from ...preflight import (RUNTIME_BYTES, Resources, layer_column_loop_seconds, folder_disk, held_second_moments,
                           layer_params, pass_ram, pass_seconds, stream_bytes)
from . import spec as gptq_spec
from .algorithm import GPTQSettings, gptq_quantize
from .job import GPTQJob
from .layout import check_linear, checkpoint_specs, group_count
from .reader import GPTQCheckpoint, describe, read_quantization_config

FLAG_KEYS = {"act_order": "act_order", "static_groups": "static_groups", "group_aware": "group_aware", "sym": "sym", "damp": "damp",
             "damp_step": "damp_step", "mse": "mse_grid", "gptq_block_size": "block_size"}


FLAG_HELP = {"act_order": "GPTQ act-order", "static_groups": "GPTQ static groups", "group_aware": "GPTQ's visiting order",
             "sym": "GPTQ symmetric grids", "damp": "GPTQ dampening", "damp_step": "GPTQ dampening steps",
             "mse": "GPTQ's grid search", "gptq_block_size": "GPTQ's lazy-batch block"}


@dataclass(frozen=True)
class GPTQRunSettings:
    run: RunOptions
    flags: tuple[tuple[str, object], ...] = ()   # GPTQSettings field -> value, for what the spec string leaves out

    def resolve(self, variant: gptq_spec.GPTQVariant) -> tuple[GPTQSettings, bool]:
        """(settings, round-to-nearest) of one variant under these flags."""
        return variant.settings(dict(self.flags))


def describe_settings(s: GPTQSettings, rtn: bool) -> str:
    group = "per-row" if s.group_size == -1 else f"g{s.group_size}"
    flags = (("act-order", s.act_order), ("static", s.static_groups),
             ("natural order", not s.act_order and not s.group_aware), ("mse", s.mse_grid), ("rtn", rtn))
    extras = [name for name, on in flags if on]
    return " ".join([f"gptq {s.bits}-bit {group}", "sym" if s.sym else "asym", *extras])


def consumer_notes(model, s: GPTQSettings) -> list[str]:
    notes: list[str] = []
    for row in model.stored_linears:
        for lin in row:
            for n in check_linear(lin, s):
                if n not in notes:
                    notes.append(n)
    if s.bits not in (4, 8) or not s.sym:
        notes.append("vLLM (0.33) loads only symmetric 4- and 8-bit GPTQ")
    if s.act_order and s.group_size != -1:
        notes.append("vLLM (0.33) refuses act-order with groups; exllamav2 and transformers + GPTQModel load it")
    if s.bits != 4:
        notes.append("exllamav2 loads only 4-bit GPTQ")
    if model.has_experts:
        notes.append(EXPERTS_NOTE)
    return notes


def output_folder(model: Checkpoint, out_dir: Path, variant: str) -> Path:
    return Path(out_dir) / f"{model_stem(model.name)}-gptq-{variant.lower()}"


class GPTQBackend(Backend):
    name = "gptq"
    summary = "GPTQ (2/3/4/8-bit, groups, act-order, sym/asym) for transformers + GPTQModel, vLLM, exllamav2"
    calibrated = True
    owned_options = FLAG_HELP

    def settings(self, options: dict) -> GPTQRunSettings:
        return GPTQRunSettings(RunOptions.from_dict(options),
                               tuple((field, options.get(key)) for key, field in FLAG_KEYS.items()))

    def variants(self) -> list[str]:
        return list(gptq_spec.EXAMPLES)

    def parse_variant(self, text: str) -> gptq_spec.GPTQVariant:
        return gptq_spec.parse(text)

    def needs_calibration(self, variant: gptq_spec.GPTQVariant, settings: GPTQRunSettings) -> bool:
        return not settings.resolve(variant)[1]

    def plan(self, model: Checkpoint, variant: gptq_spec.GPTQVariant, out_dir: Path, settings: GPTQRunSettings) -> Plan:
        s, rtn = settings.resolve(variant)
        run = settings.run
        notes = consumer_notes(model, s)  # raises for shapes GPTQ cannot store
        kind = describe_settings(s, rtn)
        rows = plan_rows(model, checkpoint_specs(model, s), kind,
                         lambda lin: f"{group_count(lin.in_features, s)} groups")
        plan = Plan("gptq", variant.text, str(output_folder(model, out_dir, variant.text)), rows)
        device = resolve_device(run.device)
        samples, seqlen = run.calib_samples, run.calib_seqlen
        if not rtn:
            plan.extra["calibration"] = run.calibration_text()
        text, shared, own, stream = _memory_estimate(model, samples, seqlen, rtn)
        plan.extra["peak memory (estimate)"] = text
        seconds = (0.0, 0.0)
        if run.estimate_time:      # a dry run: the probe of the column loop costs a second
            seconds = _time_estimate(model, samples, seqlen, s, rtn, device)
            plan.extra["time (estimate)"] = f"{sum(seconds):.0f} s on {device}"
        plan.resources = Resources(own_ram=own, shared_ram=shared, own_seconds=seconds[1], forward_seconds=seconds[0],
                                   final_disk=folder_disk(model, plan), stream=stream, calibrated=not rtn,
                                   on_device=device.type == "cuda")
        plan.extra["settings"] = json.dumps({k: v for k, v in s.__dict__.items()})
        for i, n in enumerate(notes):
            plan.extra[f"note {i + 1}"] = n
        return plan

    def make_job(self, model: Checkpoint, variant: gptq_spec.GPTQVariant, plan: Plan, folder: Path,
                 settings: GPTQRunSettings, calibration) -> GPTQJob:
        s, rtn = settings.resolve(variant)
        return GPTQJob(model, s, variant.text, folder, rtn=rtn, device=resolve_device(settings.run.device),
                       calibration=None if rtn else calibration, notes=consumer_notes(model, s),
                       max_shard_bytes=settings.run.max_shard_bytes)

    def can_read(self, path: Path) -> bool:
        p = Path(path)
        return p.is_dir() and read_quantization_config(p) is not None

    def open_artifact(self, path: Path, base=None, activations: str = "exact") -> GPTQCheckpoint:
        if activations != "exact":
            from ...errors import UsageError
            raise UsageError("--activations: GPTQ runtimes compute in the model dtype; use the default (exact)")
        return GPTQCheckpoint(Path(path))

    def describe_artifact(self, path: Path) -> dict:
        return describe(Path(path))

    runtimes = ("transformers", "vllm", "exllamav2")
    kv_cache_runtimes = ("transformers",)

    def runtime_logits(self, path: Path, runtime: str, tokens: torch.Tensor, kv_cache: str | None = None):
        if runtime != "transformers":
            return super().runtime_logits(path, runtime, tokens)
        from . import consumer
        return consumer.window_logits(Path(path), tokens, kv_cache=kv_cache)

    runtime_packages = {"transformers": ("transformers", "gptqmodel"), "vllm": ("vllm",), "exllamav2": ("exllamav2",)}

    def runtime_loaders(self, path: Path, runtime: str, ctx: int) -> list:
        if runtime != "transformers":
            return super().runtime_loaders(path, runtime, ctx)
        from ...verify.sessions import PLAIN, TransformersSession, from_pretrained_plain
        from . import consumer
        torch_way = ("GPTQModel.load(folder) in float16" if GPTQCheckpoint(Path(path)).has_experts else
                     "GPTQConfig(backend=\"torch\") in float32")
        return [(PLAIN, lambda: TransformersSession(from_pretrained_plain(Path(path)), PLAIN)),
                (torch_way, lambda: TransformersSession(consumer.load(Path(path), "torch", torch.float32), torch_way))]


def _memory_estimate(model: Checkpoint, samples: int, seqlen: int, rtn: bool) -> tuple[str, int, int, int]:
    """(text, RAM shared with the run's other calibrated jobs, RAM of this job alone, its stream's bytes)."""
    weights_fp32 = layer_params(model) * 4 * 2  # the layer in float32 plus the stacked copy GPTQ works on
    if rtn:
        return f"{(weights_fp32 + RUNTIME_BYTES) / 2**30:.2f} GiB (one layer in float32 + runtime)", 0, weights_fp32, 0
    stream = stream_bytes(model, samples, seqlen)
    shared = pass_ram(model, seqlen)
    hessian = held_second_moments(model)
    total = stream + shared + hessian + RUNTIME_BYTES
    return (f"{total / 2**30:.2f} GiB (hidden states {stream / 2**30:.2f} GiB per calibrated artifact + one layer + "
            f"one batch + Hessians + runtime)", shared, stream + hessian, stream)


def _time_estimate(model: Checkpoint, samples: int, seqlen: int, s: GPTQSettings, rtn: bool,
                   device: torch.device) -> tuple[float, float]:
    """(this job's walk of the layers with its Hessians, timed here on the largest layer; its own work: the column
    loop timed here on the layer's largest linear).  The Hessians used to be counted as FLOPs at a quarter of the
    probed matmul rate, which on a machine that computes in float32 anyway came to 2.1x the demo's whole run."""
    loop = _probe_column_loop(model, s, device) * model.num_layers
    if rtn:
        return 0.0, loop / 4
    return pass_seconds(model, samples, seqlen, device, HessianAccumulator), loop


def _probe_column_loop(model: Checkpoint, s: GPTQSettings, device: torch.device) -> float:
    """Seconds of GPTQ's column loop for one layer's linears here, probed per input width."""
    groups: dict[tuple[int], list] = {}
    for lin in model.stored_linears[0]:
        groups.setdefault((lin.in_features,), []).append(lin)
    return layer_column_loop_seconds(groups, lambda w, h, key: gptq_quantize(w, h, s), device)


BACKEND = GPTQBackend()
