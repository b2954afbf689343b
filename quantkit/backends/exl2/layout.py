"""What an EXL2 folder holds (../shared/docs/formats/exl2.md §1, §5.5, §6): the tensors of each quantized
linear, embeddings and norms in float16, the quantization_config exllamav2's converter writes, and which
models quantkit can write this way."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UsageError
from ...model.block import Attention, GatedMLP, MoE
from ...model.safetensors_writer import TensorSpec
from ..hf_folder import checkpoint_specs as hf_checkpoint_specs
from .layouts import ATTENTION_OPTIONS, MLP_OPTIONS, RowLayout
from .packing import packed_rows, padded_columns

EXLLAMAV2_VERSION = "0.3.2"          # the release whose layout this is (frozen since 2025-07)
# exllamav2's fixed names for the positions of its option tables
ATTENTION_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_KEYS = ("gate_proj", "up_proj", "down_proj")
EXPERT_KEYS = ("w1", "w3", "w2")     # a mixture's option names its experts' gate, up, down as Mixtral's modules


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


@dataclass(frozen=True)
class Slot:
    """One sub-block the allocation chooses an option for: exllamav2's module key ("<prefix>self_attn", "…mlp",
    "…block_sparse_moe"), its linears (a mixture's: every expert's gate, up, down), each linear's position in the
    option table (an expert's gate/up/down take the same option in every expert, as exllamav2 measures them), and
    the table with exllamav2's name for each position."""
    layer: int
    key: str
    linears: tuple[str, ...]
    positions: tuple[int, ...]
    table: tuple
    keys: tuple[str, ...]
    routed: bool = False          # experts: an expert no calibration token reached has no input statistics

    def layouts(self, option) -> dict[str, RowLayout]:
        return {lin: option[p] for lin, p in zip(self.linears, self.positions)}


def slots(model) -> list[Slot]:
    """The sub-blocks the allocation chooses for, in model order."""
    out = []
    for i in range(model.num_layers):
        prefix = model.adapter.prefix(i)
        for r in model.block(i).residuals:
            op = r.op
            if isinstance(op, Attention):
                names, positions, table, keys = (op.q, op.k, op.v, op.o), (0, 1, 2, 3), ATTENTION_OPTIONS, ATTENTION_KEYS
            elif isinstance(op, GatedMLP):
                names, positions, table, keys = (op.gate, op.up, op.down), (0, 1, 2), MLP_OPTIONS, MLP_KEYS
            elif op.shared is not None:
                raise UsageError(f"exl2: {model.config.model_type} layer {i} has a shared expert, which exllamav2 "
                                 f"does not load (its mixtures are mixtral's and qwen3_moe's); use gguf or gptq")
            else:
                names = tuple(n for e in op.experts for n in (e.gate, e.up, e.down))
                positions, table, keys = (0, 1, 2) * len(op.experts), MLP_OPTIONS, EXPERT_KEYS
            module = names[0].split(".")[0]          # self_attn, mlp, block_sparse_moe
            out.append(Slot(i, f"{prefix}{module}", names, positions, table, keys, isinstance(op, MoE)))
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
