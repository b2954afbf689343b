"""What an EXL2 folder holds (../shared/docs/formats/exl2.md §1, §5.5, §6): the tensors of each quantized
linear, embeddings and norms in float16, the quantization_config exllamav2's converter writes, and which
models quantkit can write this way."""
from __future__ import annotations

import torch

from ...errors import UsageError
from ...model.block import Attention, GatedMLP
from ...model.safetensors_writer import TensorSpec
from ..hf_folder import checkpoint_specs as hf_checkpoint_specs
from .layouts import RowLayout
from .packing import packed_rows, padded_columns

EXLLAMAV2_VERSION = "0.3.2"          # the release whose layout this is (frozen since 2025-07)
# exllamav2's fixed names for the positions of its option tables
ATTENTION_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_KEYS = ("gate_proj", "up_proj", "down_proj")


def linear_specs(name: str, rows: int, columns: int, bias: bool, layout: RowLayout) -> list[TensorSpec]:
    groups = layout.groups(rows)
    words = sum(packed_rows(g.end - g.start, g.bits) for g in groups)
    cols = padded_columns(columns)
    specs = [TensorSpec(f"{name}.q_weight", torch.int32, (words, cols)),
             TensorSpec(f"{name}.q_invperm", torch.int32, (rows,)),
             TensorSpec(f"{name}.q_scale", torch.int32, (len(groups), cols // 8)),
             TensorSpec(f"{name}.q_scale_max", torch.float16, (len(groups),)),
             TensorSpec(f"{name}.q_groups", torch.int16, (2 * len(groups),))]
    return specs + ([TensorSpec(f"{name}.bias", torch.float16, (columns,))] if bias else [])


def checkpoint_specs(model, layouts: dict[str, RowLayout], head: RowLayout) -> list[TensorSpec]:
    """Every tensor of the folder in file order: the decoder linears as `layouts` (full name -> layout) says,
    the head quantized as `head`, everything else in float16 (what exllamav2's loader computes with)."""
    def spec(lin):
        return linear_specs(lin.name, lin.in_features, lin.out_features, lin.bias, layouts[lin.name])
    specs = [TensorSpec(s.name, torch.float16 if s.dtype.is_floating_point else s.dtype, s.shape)
             for s in hf_checkpoint_specs(model, spec)
             if s.name != model.adapter.lm_head]
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    return specs + linear_specs(head_name(model.adapter), hidden, vocab, False, head)


def head_name(adapter) -> str:
    """The head's module name ("lm_head"): its quantized tensors are lm_head.q_weight …, as exllamav2 names them."""
    return adapter.lm_head.removesuffix(".weight")


def quantization_config(target_bpw: float, head_bits: int, rows: int, length: int, dataset: str) -> dict:
    return {"quant_method": "exl2", "version": EXLLAMAV2_VERSION, "bits": target_bpw, "head_bits": head_bits,
            "calibration": {"rows": rows, "length": length, "dataset": dataset}}


def slots(model) -> list[tuple[int, str, tuple[str, ...]]]:
    """(layer, exllamav2's module key, the linears in table order) per sub-block the allocation chooses for."""
    out = []
    for i in range(model.num_layers):
        prefix = model.adapter.prefix(i)
        for r in model.block(i).residuals:
            op = r.op
            if isinstance(op, Attention):
                names = (op.q, op.k, op.v, op.o)
            elif isinstance(op, GatedMLP):
                names = (op.gate, op.up, op.down)
            else:
                raise UsageError(f"exl2: {model.config.model_type} layer {i} has a mixture of experts, which quantkit's "
                                 f"EXL2 does not measure yet; use gguf or gptq for this model")
            module = names[0].split(".")[0]          # self_attn, mlp
            out.append((i, f"{prefix}{module}", names))
    return out


def check_model(model) -> None:
    """Refuse, in one line, models whose layers exllamav2's tables do not describe."""
    slots(model)
    for row in model.stored_linears:
        for lin in row:
            if len(lin.parts) > 1:
                raise UsageError(f"exl2: {lin.name} stores {', '.join(lin.parts)} joined; quantkit's EXL2 writes "
                                 f"separate linears only (use gguf or gptq for {model.config.model_type})")
            if lin.in_features % 32:
                raise UsageError(f"exl2: {lin.name} has {lin.in_features} inputs; exllamav2's groups need a "
                                 f"multiple of 32")
