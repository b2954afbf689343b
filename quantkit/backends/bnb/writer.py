"""Every bnb artifact of a run from one read of the source: each tensor is read once and encoded for every variant
asked for, each into its own atomic folder, so memory stays at one weight whatever the model."""
from __future__ import annotations

import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import torch

from ...artifact import atomic_folder
from ...errors import QuantizationError
from ...model.read_ahead import read_ahead
from ...model.safetensors_reader import DTYPES
from ...model.safetensors_writer import ShardedSafetensorsWriter, copy_tensor
from ...progress import Progress, null_progress
from ..hf_folder import write_side_files
from .encoders import dynamic_map, quantize_4bit, quantize_int8
from .layout import INT8_ROW_FORMAT, checkpoint_specs, converted_linears, quant_state_json, quantization_config, state_key
from .spec import BnbVariant


class BnbArtifact:
    """One bnb folder being written (into a .partial-* folder that the caller renames when it is complete)."""

    def __init__(self, model, variant: BnbVariant, folder: Path, compute_dtype: torch.dtype,
                 skip: list[str] | None, device: torch.device, max_shard_bytes: int):
        self.model, self.variant, self.folder = model, variant, Path(folder)
        self.compute_dtype, self.skip, self.device = compute_dtype, skip, device
        self.linears = converted_linears(model, skip)
        self.converted = [{lin.name for lin in row} for row in self.linears]
        self.writer = ShardedSafetensorsWriter(self.folder, checkpoint_specs(model, variant, skip), max_shard_bytes)
        self.started = time.time()

    def put_linear(self, name: str, weight: torch.Tensor) -> None:
        v, put = self.variant, self.writer.put
        w = weight.to(self.device)
        if not v.four_bit:
            cb, scb = quantize_int8(w)
            refuse_non_finite(f"{name}.weight", scb)
            put(f"{name}.weight", cb)
            put(f"{name}.SCB", scb)
            put(f"{name}.weight_format", torch.tensor(INT8_ROW_FORMAT, dtype=torch.uint8))
            return
        p = quantize_4bit(w, v.quant_type, v.blocksize, v.double_quant)
        refuse_non_finite(f"{name}.weight", p.nested_absmax if v.double_quant else p.absmax)
        put(f"{name}.weight", p.weight)
        put(f"{name}.weight.absmax", p.absmax)
        put(f"{name}.weight.quant_map", p.quant_map)
        if v.double_quant:
            put(f"{name}.weight.nested_absmax", p.nested_absmax)
            put(f"{name}.weight.nested_quant_map", dynamic_map())
        state = quant_state_json(v, tuple(weight.shape), weight.dtype, p.nested_offset)
        put(f"{name}.{state_key(v)}", torch.frombuffer(bytearray(state), dtype=torch.uint8))

    def put_stored(self, i: int, name: str, t: torch.Tensor) -> None:
        """One of layer i's stored tensors (full name): a converted linear's weight is encoded, the rest kept."""
        base, _, leaf = name.rpartition(".")
        if leaf == "weight" and base in self.converted[i]:
            self.put_linear(base, t)
        else:
            self.writer.put(name, t)

    def finish(self, seconds_reading: float) -> Path:
        files = self.writer.close()
        v = self.variant
        converted = [lin.name for row in self.linears for lin in row]
        write_side_files(self.model, self.folder, quantization_config(v, self.compute_dtype, self.skip), {
            "format": "bnb", "variant": v.text, "method": v.describe(),
            "settings": {"quant_type": v.quant_type, "blocksize": v.blocksize if v.four_bit else None,
                         "double_quant": v.double_quant, "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                         "skip_modules": self.skip},
            "converted_linears": len(converted),
            "seconds": round(time.time() - self.started, 2), "seconds_reading_source": round(seconds_reading, 2),
        }, files)
        return self.folder


def check_finite(name: str, t: torch.Tensor) -> None:
    # the minimum and maximum are NaN or infinite exactly when an element is: one reduction, no copy
    if t.is_floating_point() and t.numel():
        refuse_non_finite(name, torch.stack(torch.aminmax(t)))


def refuse_non_finite(name: str, stats: torch.Tensor) -> None:
    """A converted weight is checked through its encoding's statistics (a NaN or inf in a block or row shows in
    its absmax, and under double quantization in the nested absmax): no extra pass over the weight."""
    if not torch.isfinite(stats).all():
        raise QuantizationError(f"{name}: contains NaN or infinite values; cannot quantize")


def write_all(model, items: list[tuple[BnbVariant, Path, torch.dtype]], *, skip: list[str] | None,
              device: torch.device, max_shard_bytes: int, progress: Progress = null_progress) -> list[Path]:
    """Each (variant, output folder, compute dtype) written from one read of `model`."""
    adapter = model.adapter
    reading = 0.0

    def read(name: str, encoded: bool) -> torch.Tensor:
        nonlocal reading
        t0 = time.perf_counter()
        t = model.tensor(name)
        reading += time.perf_counter() - t0
        if not encoded:   # an encoded weight is checked by its encoding (refuse_non_finite)
            check_finite(name, t)
        return t

    with ExitStack() as stack:
        artifacts = []
        try:
            for variant, out, compute_dtype in items:
                folder = stack.enter_context(atomic_folder(out))
                a = BnbArtifact(model, variant, folder, compute_dtype, skip, device, max_shard_bytes)
                a.writer.open()
                artifacts.append(a)
            outside = [adapter.embed, adapter.final_norm] + ([] if model.tied_embeddings else [adapter.lm_head])
            for name in outside:   # kept as stored: copied byte for byte, a piece at a time (embeddings are large)
                e = model.weights.entries[name]
                copy_tensor([a.writer for a in artifacts], name, e.file, e.start, e.nbytes,
                            check=lambda piece, n=name, dtype=DTYPES[e.dtype]: check_finite(n, piece.view(dtype)))
            task = progress.task(f"bnb layers ({', '.join(v.text for v, _, _ in items)})", total=model.num_layers)
            order = []   # a tensor at a time (memory holds one weight, not a layer), the next read meanwhile
            for i in range(model.num_layers):
                for rel in model.stored_names(i):
                    name = adapter.prefix(i) + rel
                    base, _, leaf = name.rpartition(".")
                    order.append((i, name, leaf == "weight" and base in artifacts[0].converted[i]))
            left = Counter(i for i, _, _ in order)
            reads = read_ahead(lambda name=name, encoded=encoded: read(name, encoded) for _, name, encoded in order)
            for (i, name, _), t in zip(order, reads):
                for a in artifacts:
                    a.put_stored(i, name, t)
                del t
                left[i] -= 1
                if not left[i]:
                    task.advance()
            for a in artifacts:
                a.finish(reading)
        except BaseException:
            for a in artifacts:
                a.writer.abort()
            raise
    return [Path(out) for _, out, _ in items]
