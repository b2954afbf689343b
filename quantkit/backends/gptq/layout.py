"""Which tensors a GPTQ checkpoint holds, with their dtypes and shapes (../shared/docs/formats/gptq.md §1).

Every linear inside a decoder block becomes qweight / qzeros / scales / g_idx (+ bias); embeddings, norms
and lm_head stay in the source dtype.  Shapes follow from (K, N, bits, group size) alone, so the whole file
layout — and the dry-run's sizes — are known before anything is quantized.
"""
from __future__ import annotations

import math

import torch

from ...errors import UsageError
from ...model.checkpoint import StoredLinear
from ...model.safetensors_writer import TensorSpec
from ..hf_folder import checkpoint_specs as hf_checkpoint_specs
from .algorithm import GPTQSettings


def group_count(k: int, s: GPTQSettings) -> int:
    return 1 if s.group_size == -1 else math.ceil(k / s.group_size)


def quantized_specs(lin: StoredLinear, s: GPTQSettings) -> list[TensorSpec]:
    k, n, b = lin.in_features, lin.out_features, s.bits
    g = group_count(k, s)
    specs = [TensorSpec(f"{lin.name}.qweight", torch.int32, (k * b // 32, n)),
             TensorSpec(f"{lin.name}.qzeros", torch.int32, (g, n * b // 32)),
             TensorSpec(f"{lin.name}.scales", torch.float16, (g, n)),
             TensorSpec(f"{lin.name}.g_idx", torch.int32, (k,))]
    if lin.bias:
        specs.append(TensorSpec(f"{lin.name}.bias", torch.float16, (n,)))
    return specs


def check_linear(lin: StoredLinear, s: GPTQSettings) -> list[str]:
    """Refuse shapes GPTQ cannot store; return notes on consumers that will not load the result."""
    k, n = lin.in_features, lin.out_features
    if k % 32 or n % 32:
        raise UsageError(f"{lin.name}: {n}×{k} cannot be packed as GPTQ (both dimensions must be multiples of 32)")
    notes = []
    if s.group_size != -1 and k % s.group_size:
        power_of_two = s.group_size & (s.group_size - 1) == 0
        if not power_of_two:
            raise UsageError(f"gptq group size {s.group_size} does not divide the input dimension {k} of {lin.name}; "
                             f"use a divisor of {k} or a power of two (the last group is then partial)")
        notes.append(f"input dimension {k} is not a multiple of the group size {s.group_size}: the last group is "
                     f"partial (transformers loads it with GPTQConfig(backend='torch'), not by its default CPU "
                     f"kernel; exllamav2 loads it, vLLM does not); a group size dividing {k} loads everywhere")
    return notes


def checkpoint_specs(model, s: GPTQSettings) -> list[TensorSpec]:
    """Every tensor of the GPTQ checkpoint, in file order."""
    return hf_checkpoint_specs(model, lambda lin: quantized_specs(lin, s))
