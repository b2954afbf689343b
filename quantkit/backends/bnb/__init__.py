"""bitsandbytes checkpoints (NF4 / FP4 with or without double quantization, LLM.int8) as transformers saves them,
written one layer at a time by quantkit's own encoders; no calibration."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import Backend, Plan, PlanRow
from ...artifact import model_stem
from ...device import resolve_device
from ...errors import UsageError
from ...model.checkpoint import Checkpoint
from ...model.safetensors_reader import DTYPES
from ...options import RunOptions
from ...preflight import RUNTIME_BYTES, Resources, folder_disk, layer_entries, read_seconds
from . import spec as bnb_spec
from .encoders import quantize_4bit, quantize_int8
from .layout import checkpoint_specs, converted_linears, quantization_config
from .reader import BnbCheckpoint, describe, read_quantization_config

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class BnbSettings:
    run: RunOptions
    compute_dtype: str | None = None      # None: the source's dtype for 4-bit (see compute_dtype_for)
    skip_modules: tuple[str, ...] | None = None

    def compute_dtype_for(self, model, v: bnb_spec.BnbVariant) -> torch.dtype:
        """The given dtype, else: 4-bit computes in the source's half precision (what QLoRA and published bnb-4bit
        repositories use, instead of transformers' slow float32 default); int8 records float32, as
        BitsAndBytesConfig(load_in_8bit=True) does (the field is unused there)."""
        if self.compute_dtype:
            return COMPUTE_DTYPES[self.compute_dtype]
        if not v.four_bit:
            return torch.float32
        e = model.weights.entries[model.adapter.embed]
        return DTYPES[e.dtype]

    def skip(self) -> list[str] | None:
        """llm_int8_skip_modules as written: given patterns replace transformers' defaults, so lm_head is added to
        keep it unconverted there as it is here."""
        if self.skip_modules is None:
            return None
        return list(self.skip_modules) + ([] if "lm_head" in self.skip_modules else ["lm_head"])


def output_folder(model: Checkpoint, out_dir: Path, variant: str) -> Path:
    return Path(out_dir) / f"{model_stem(model.name)}-bnb-{variant.lower()}"


class BnbBackend(Backend):
    name = "bnb"
    summary = "bitsandbytes NF4 / FP4 (block 32…4096, double quant) and LLM.int8, as transformers saves them"
    owned_options = {"bnb_compute_dtype": "the bnb 4-bit compute dtype", "skip_modules": "bnb modules left unconverted"}

    def settings(self, options: dict) -> BnbSettings:
        dtype = options.get("bnb_compute_dtype")
        if dtype:
            dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
            if dtype not in COMPUTE_DTYPES:
                raise UsageError(f"--bnb-compute-dtype {options['bnb_compute_dtype']!r}: expected bfloat16, float16 or float32")
        skip = options.get("skip_modules")
        return BnbSettings(RunOptions.from_dict(options), dtype or None, tuple(skip) if skip else None)

    def variants(self) -> list[str]:
        return list(bnb_spec.EXAMPLES)

    def parse_variant(self, text: str) -> bnb_spec.BnbVariant:
        return bnb_spec.parse(text)

    def plan(self, model: Checkpoint, variant: bnb_spec.BnbVariant, out_dir: Path, settings: BnbSettings) -> Plan:
        skip = settings.skip()
        specs = checkpoint_specs(model, variant, skip)
        converted = {lin.name: lin for row in converted_linears(model, skip) for lin in row}
        rows, by_linear = [], {}
        for sp in specs:
            owner = next((name for name in (sp.name.split(".weight")[0], sp.name.rsplit(".", 1)[0]) if name in converted), None)
            if owner is None:
                rows.append(PlanRow(sp.name, sp.shape, str(sp.dtype).removeprefix("torch."), sp.nbytes, "kept"))
            elif owner not in by_linear:
                lin = converted[owner]
                by_linear[owner] = PlanRow(owner, (lin.out_features, lin.in_features), variant.describe(), sp.nbytes)
                rows.append(by_linear[owner])
            else:
                by_linear[owner].bytes += sp.nbytes
        plan = Plan("bnb", variant.text, str(output_folder(model, out_dir, variant.text)), rows)
        if variant.double_quant:
            plan.extra["size"] = ("each quant state's JSON holds a decimal whose digits depend on the weights: "
                                  "the written size differs from this by a few bytes per linear")
        if variant.four_bit:
            spanning = sorted({lin.in_features for lin in converted.values() if lin.in_features % variant.blocksize})
            if spanning:
                plan.extra["consumer note"] = (
                    f"rows of {', '.join(map(str, spanning))} are not a multiple of block {variant.blocksize}: "
                    f"bitsandbytes 0.50.2's CPU kernel dequantizes blocks that span rows wrongly (measured on the "
                    f"demo), so on the CPU choose a block size dividing the rows; the file itself is as bitsandbytes "
                    f"writes it")
            plan.extra["compute dtype"] = str(settings.compute_dtype_for(model, variant)).removeprefix("torch.")
        if skip:
            plan.extra["skip modules"] = ", ".join(skip)
        layer = sum(e.nbytes for e in layer_entries(model))
        biggest = max(lin.in_features * lin.out_features for row in model.stored_linears for lin in row)
        own = layer + biggest * 4 * 4
        plan.extra["peak memory (estimate)"] = (f"{(own + RUNTIME_BYTES) / 2**30:.2f} GiB (one layer as stored + the "
                                                f"largest linear's float32 working copies + runtime), per run, for "
                                                f"every bnb variant")
        device = resolve_device(settings.run.device)
        seconds = 0.0
        if settings.run.estimate_time:
            seconds = _time_estimate(model, variant, device)
            plan.extra["time (estimate)"] = f"{seconds:.0f} s"
        plan.resources = Resources(own_ram=own, own_seconds=seconds, final_disk=folder_disk(model, plan),
                                   on_device=device.type == "cuda")
        return plan

    def write_all(self, model, items, out_dir: Path, settings: BnbSettings, progress, collected=None) -> list[Path]:
        from .writer import write_all
        jobs = [(v, Path(p.output), settings.compute_dtype_for(model, v)) for v, p in items]
        return write_all(model, jobs, skip=settings.skip(), device=resolve_device(settings.run.device),
                         max_shard_bytes=settings.run.max_shard_bytes, progress=progress)

    def can_read(self, path: Path) -> bool:
        p = Path(path)
        return p.is_dir() and read_quantization_config(p) is not None

    def open_artifact(self, path: Path, base=None, activations: str = "exact") -> BnbCheckpoint:
        return BnbCheckpoint(Path(path), activations)

    def describe_artifact(self, path: Path) -> dict:
        return describe(Path(path))

    runtimes = ("transformers",)
    kv_cache_runtimes = ("transformers",)

    def runtime_logits(self, path: Path, runtime: str, tokens: torch.Tensor, kv_cache: str | None = None):
        from . import consumer
        return consumer.window_logits(Path(path), tokens, kv_cache=kv_cache)

    runtime_packages = {"transformers": ("transformers", "bitsandbytes")}

    def runtime_loaders(self, path: Path, runtime: str, ctx: int) -> list:
        from ...verify.sessions import PLAIN, TransformersSession
        from . import consumer
        return [(PLAIN, lambda: TransformersSession(consumer.load(Path(path)), PLAIN))]


def _time_estimate(model, v: bnb_spec.BnbVariant, device: torch.device) -> float:
    """Encode a 1M-weight slab here after a warm-up, scaled by the model's converted weights, plus reading the
    source once."""
    slab = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)

    def encode(x: torch.Tensor) -> None:
        quantize_4bit(x, v.quant_type, v.blocksize, v.double_quant) if v.four_bit else quantize_int8(x)
    encode(slab[:8])         # first-call set-up (lookup tables, kernel choices) is not per weight
    t0 = time.perf_counter()
    encode(slab)
    per_weight = (time.perf_counter() - t0) / slab.numel()
    weights = sum(lin.in_features * lin.out_features for row in model.stored_linears for lin in row)
    return weights * per_weight + read_seconds(model)


BACKEND = BnbBackend()
