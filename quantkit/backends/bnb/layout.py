"""Which tensors a bitsandbytes checkpoint holds, under which keys (../shared/docs/formats/bnb.md §1-3).

transformers replaces every linear whose module name no skip pattern matches; quantkit converts the decoder
layers' linears the same way and, like transformers' defaults, never the embeddings, norms or lm_head.  A
converted 4-bit linear `P` is stored as `P.weight` (packed codes), `P.weight.absmax`, `P.weight.quant_map`,
with double quantization `P.weight.nested_absmax` and `P.weight.nested_quant_map`, and its quant state as
UTF-8 JSON in `P.weight.quant_state.bitsandbytes__nf4|fp4`; an LLM.int8 linear as `P.weight` (int8),
`P.SCB` and `P.weight_format`.  Everything else keeps its name and dtype.
"""
from __future__ import annotations

import json
import math
import re

import torch

from ...errors import UsageError
from ...model.checkpoint import StoredLinear
from ...model.safetensors_reader import DTYPES
from ...model.safetensors_writer import TensorSpec
from .encoders import NESTED_BLOCK
from .spec import BnbVariant

# the double-quant offset's decimal digits are only known from the data: the plan sizes the JSON with a
# typical one, and the writer sizes it when written (TensorSpec.late)
TYPICAL_OFFSET = 0.48481982946395874   # a float32 mean, printed with 17 significant digits
INT8_ROW_FORMAT = 0   # bitsandbytes' weight_format id of the row-major layout, the only one it loads today


def should_convert(module: str, patterns: list[str] | None) -> bool:
    """transformers' rule for llm_int8_skip_modules: a pattern skips a module when it matches from the start up to a
    module boundary (also as a regex), or ends its name."""
    if not patterns:
        return True
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


def converted_linears(model, skip: list[str] | None) -> list[list[StoredLinear]]:
    """Per layer, the stored linears this checkpoint converts."""
    refuse_unsupported(model)
    return [[lin for lin in row if should_convert(lin.name, skip)] for row in model.stored_linears]


def refuse_unsupported(model) -> None:
    if model.config.raw.get("num_experts") or model.config.raw.get("num_local_experts"):
        raise UsageError(f"bnb: {model.config.model_type} is a mixture of experts; transformers keeps its fused expert "
                         f"tensors unconverted, which quantkit's bnb writer does not reproduce yet")
    if model.beside_language_model():
        raise UsageError(f"bnb: {model.config.model_type} carries a vision tower, whose linears transformers converts "
                         f"too; quantkit's bnb writer covers text-only checkpoints so far")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quant_state_json(v: BnbVariant, shape: tuple[int, int], dtype: torch.dtype, offset: float | None) -> bytes:
    """Linear4bit's packed quant state: the non-tensor fields, in bitsandbytes' order, json.dumps' default spacing."""
    state: dict = {"quant_type": v.quant_type, "blocksize": v.blocksize, "dtype": dtype_name(dtype), "shape": list(shape)}
    if v.double_quant:
        state.update(nested_blocksize=NESTED_BLOCK, nested_dtype="float32", nested_offset=offset)
    return json.dumps(state).encode("utf-8")


def state_key(v: BnbVariant) -> str:
    return f"weight.quant_state.bitsandbytes__{v.quant_type}"


def linear_specs(lin: StoredLinear, v: BnbVariant, dtype: torch.dtype) -> list[TensorSpec]:
    n, k, p = lin.out_features, lin.in_features, lin.name
    if not v.four_bit:
        specs = [TensorSpec(f"{p}.weight", torch.int8, (n, k)), TensorSpec(f"{p}.SCB", torch.float32, (n,)),
                 TensorSpec(f"{p}.weight_format", torch.uint8, ())]
    else:
        blocks = math.ceil(n * k / v.blocksize)
        state = quant_state_json(v, (n, k), dtype, TYPICAL_OFFSET if v.double_quant else None)
        specs = [TensorSpec(f"{p}.weight", torch.uint8, ((n * k + 1) // 2, 1)),
                 TensorSpec(f"{p}.weight.absmax", torch.uint8 if v.double_quant else torch.float32, (blocks,)),
                 TensorSpec(f"{p}.weight.quant_map", torch.float32, (16,))]
        if v.double_quant:
            specs += [TensorSpec(f"{p}.weight.nested_absmax", torch.float32, (math.ceil(blocks / NESTED_BLOCK),)),
                      TensorSpec(f"{p}.weight.nested_quant_map", torch.float32, (256,))]
        specs.append(TensorSpec(f"{p}.{state_key(v)}", torch.uint8, (len(state),), late=v.double_quant))
    if lin.bias:
        specs.append(TensorSpec(f"{p}.bias", dtype, (n,)))
    return specs


def checkpoint_specs(model, v: BnbVariant, skip: list[str] | None) -> list[TensorSpec]:
    """Every tensor of the checkpoint, by layer (what is not converted keeps its stored name and dtype)."""
    adapter, weights = model.adapter, model.weights

    def plain(name: str) -> TensorSpec:
        e = weights.entries[name]
        return TensorSpec(name, DTYPES[e.dtype], tuple(e.shape))

    specs = [plain(adapter.embed)]
    for i, row in enumerate(converted_linears(model, skip)):
        converted = set()
        for lin in row:
            specs += linear_specs(lin, v, DTYPES[weights.entries[f"{lin.name}.weight"].dtype])
            converted.update((f"{lin.name}.weight", f"{lin.name}.bias"))
        prefix = adapter.prefix(i)
        specs += [plain(prefix + rel) for rel in model.stored_names(i) if prefix + rel not in converted]
    specs.append(plain(adapter.final_norm))
    if not model.tied_embeddings:
        specs.append(plain(adapter.lm_head))
    return specs


def quantization_config(v: BnbVariant, compute_dtype: torch.dtype, skip: list[str] | None) -> dict:
    """`BitsAndBytesConfig(...).to_dict()` for this variant (transformers 5: its fields, then the two properties)."""
    return {
        "_load_in_4bit": v.four_bit, "_load_in_8bit": not v.four_bit,
        "bnb_4bit_compute_dtype": dtype_name(compute_dtype), "bnb_4bit_quant_storage": "uint8",
        "bnb_4bit_quant_type": v.quant_type if v.four_bit else "fp4",
        "bnb_4bit_use_double_quant": v.double_quant,
        "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
        "llm_int8_skip_modules": skip, "llm_int8_threshold": 6.0,
        "load_in_4bit": v.four_bit, "load_in_8bit": not v.four_bit, "quant_method": "bitsandbytes",
    }
