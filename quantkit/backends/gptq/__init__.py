"""GPTQ checkpoints for transformers + GPTQModel, vLLM and exllamav2, quantized by quantkit's own GPTQ."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import Backend, Plan
from ..hf_folder import plan_rows
from ...artifact import model_stem
from ...calibration.capture import batch_for, default_compute_dtype
from ...device import matmul_flops, resolve_device
from ...model.checkpoint import Checkpoint
from ...options import RunOptions
from . import spec as gptq_spec
from .algorithm import GPTQSettings
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
        plan.extra["peak memory (estimate)"] = _memory_estimate(model, samples, seqlen, rtn)
        plan.extra["time (estimate)"] = f"{_time_estimate(model, samples * seqlen, rtn, device):.0f} s on {device}"
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

    runtimes = ("transformers",)

    def runtime_logits(self, path: Path, runtime: str, tokens: torch.Tensor):
        from . import consumer
        return consumer.window_logits(Path(path), tokens)

    runtime_packages = {"transformers": ("transformers", "gptqmodel")}

    def runtime_loaders(self, path: Path, runtime: str, ctx: int) -> list:
        from ...verify.sessions import PLAIN, TransformersSession, from_pretrained_plain
        from . import consumer
        torch_way = "GPTQConfig(backend=\"torch\") in float32"
        return [(PLAIN, lambda: TransformersSession(from_pretrained_plain(Path(path)), PLAIN)),
                (torch_way, lambda: TransformersSession(consumer.load(Path(path), "torch", torch.float32), torch_way))]


def _memory_estimate(model: Checkpoint, samples: int, seqlen: int, rtn: bool) -> str:
    cfg = model.config
    layer = sum(e.numel for n, e in model.weights.entries.items() if n.startswith(model.adapter.prefix(0)))
    weights_fp32 = layer * 4 * 2  # the layer in float32 plus the stacked copy GPTQ works on
    if rtn:
        total = weights_fp32 + 300 * 2**20
        return f"{total / 2**30:.2f} GiB (one layer in float32 + runtime)"
    stream = samples * seqlen * cfg.hidden_size * 4
    batch_tokens = batch_for(seqlen) * seqlen
    inter = batch_tokens * cfg.intermediate_size * 4 * 4
    hessian = max(cfg.hidden_size, cfg.intermediate_size) ** 2 * 4 * 3
    total = stream + weights_fp32 + inter + hessian + 400 * 2**20
    return (f"{total / 2**30:.2f} GiB (hidden states {stream / 2**30:.2f} GiB per calibrated artifact + one layer + "
            f"one batch + Hessians + runtime)")


def _time_estimate(model: Checkpoint, tokens: int, rtn: bool, device: torch.device) -> float:
    """Matmul throughput probed here × the pass's FLOPs, plus the column loop's per-column cost."""
    params = sum(e.numel for n, e in model.weights.entries.items() if n.startswith(model.adapter.prefix(0)))
    columns = sum(lin.in_features for lin in model.stored_linears[0])
    per_column = 40e-6 if device.type == "cpu" else 60e-6
    loop = columns * per_column * model.num_layers
    if rtn:
        return loop / 4
    flops = matmul_flops(device, default_compute_dtype(device))
    # about two forward passes per layer, plus X^T X in float32 (counted at a quarter of the bf16 rate)
    forward = 2 * 2 * params * tokens / flops
    hessian = 2 * tokens * (3 * model.config.hidden_size ** 2 + model.config.intermediate_size ** 2) / (flops / 4)
    return (forward + hessian) * model.num_layers + loop


BACKEND = GPTQBackend()
