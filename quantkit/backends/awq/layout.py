"""Which tensors an AWQ GEMM checkpoint holds (../shared/docs/formats/awq.md §1, §4), and which shapes it
can hold.

Every linear inside a decoder block becomes qweight (K, N/8) int32, qzeros (K/g, N/8) int32, scales
(K/g, N) float16 (+ bias float16); embeddings, norms and lm_head stay in the source dtype.  The consumers
size qzeros and scales as K // g (GPTQModel's `AWQuantLinear`, AutoAWQ asserts K % g == 0), so a partial last
group would be misread, not padded: such a shape is refused, naming the group sizes that fit.
"""
from __future__ import annotations

import torch

from ...errors import UsageError
from ...model.checkpoint import StoredLinear
from ...model.safetensors_writer import TensorSpec
from ..hf_folder import checkpoint_specs as hf_checkpoint_specs
from .algorithm import AWQSettings
from .spec import GROUP_SIZES


def quantized_specs(lin: StoredLinear, s: AWQSettings) -> list[TensorSpec]:
    k, n = lin.in_features, lin.out_features
    groups = k // s.group(k)
    specs = [TensorSpec(f"{lin.name}.qweight", torch.int32, (k, n // 8)),
             TensorSpec(f"{lin.name}.qzeros", torch.int32, (groups, n // 8)),
             TensorSpec(f"{lin.name}.scales", torch.float16, (groups, n))]
    if lin.bias:
        specs.append(TensorSpec(f"{lin.name}.bias", torch.float16, (n,)))
    return specs


def check_model(model, s: AWQSettings) -> None:
    """Refuse a model AWQ cannot store at these settings, in one line naming what would work."""
    linears = [lin for row in model.stored_linears for lin in row]
    narrow = [lin for lin in linears if lin.out_features % 8]
    if narrow:
        raise UsageError(f"awq: {narrow[0].name} has {narrow[0].out_features} outputs; AWQ packs 8 per int32, "
                         f"so every linear needs a multiple of 8")
    if s.group_size == -1:
        return
    bad = [lin for lin in linears if lin.in_features % s.group_size]
    if bad:
        dims = sorted({lin.in_features for lin in linears})
        fits = [str(g) for g in GROUP_SIZES if g != -1 and all(d % g == 0 for d in dims)] + ["none"]
        raise UsageError(f"awq group size {s.group_size} does not divide the input dimension {bad[0].in_features} "
                         f"of {bad[0].name}, and AWQ's consumers cannot read a partial group; use -g"
                         f"{' or -g'.join(fits)}")


def checkpoint_specs(model, s: AWQSettings) -> list[TensorSpec]:
    """Every tensor of the AWQ checkpoint, in file order."""
    return hf_checkpoint_specs(model, lambda lin: quantized_specs(lin, s))


def quantization_config(s: AWQSettings, not_converted: list[str] | None = None) -> dict:
    """config.json's block as transformers' AwqConfig emits it (vLLM and GPTQModel read the same keys)."""
    return {"quant_method": "awq", "bits": s.bits, "group_size": s.group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": not_converted or None}
