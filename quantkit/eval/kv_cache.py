"""K/V cache types a runtime can keep its attention cache in, and what the cache costs in bytes.

llama.cpp stores K and V in one of its block types (`--cache-type-k/-v`); its quantized V cache needs flash
attention, so quantkit turns flash attention on for every cache type of a comparison (f16 included), and
the figures differ only by the cache.  The sizes are gguf-py's block tables: bytes per block of elements.
transformers keeps them in its DynamicCache (float32 here: the consumers compute in float32 for a comparison)
or its QuantizedCache (quantkit.eval.transformers_cache): fp8 with one float32 scale per layer's K and V,
optimum-quanto's int4/int2 with a float32 scale and shift per group of 64 values.
"""
from __future__ import annotations

import gguf

from ..errors import UsageError

# the types llama.cpp accepts for its K/V cache (common/arg.cpp's kv_cache_types)
LLAMACPP_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
TRANSFORMERS_TYPES = ("f32", "fp8", "int4", "int2")
TYPES = {"llama.cpp": LLAMACPP_TYPES, "transformers": TRANSFORMERS_TYPES}
QUANTO_GROUP = 64      # QuantizedCache's default q_group_size


def parse_types(text: str, runtime: str = "llama.cpp") -> list[str]:
    """`f16,q8_0,q4_0` -> ["f16", "q8_0", "q4_0"], each a type the runtime's cache takes."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    known = TYPES.get(runtime, LLAMACPP_TYPES)
    bad = [t for t in names if t not in known]
    if not names or bad:
        raise UsageError(f"--kv-cache {text!r}: expected one or more of {', '.join(known)} (comma-separated; "
                         f"{runtime}'s cache types)")
    return list(dict.fromkeys(names))


def ggml_type(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name.upper()]


def cache_bytes(config, tokens: int, name: str, runtime: str = "llama.cpp") -> int:
    """Bytes of the K and V cache of every layer for `tokens` positions, stored as `name` (config: quantkit's
    ModelConfig).  transformers' int4/int2 keep up to 128 recent tokens unquantized on top of this."""
    row = config.num_kv_heads * config.head_dim
    if runtime == "transformers":
        values = 2 * config.num_layers * tokens * row
        if name == "f32":
            return values * 4
        if name == "fp8":
            return values + 2 * config.num_layers * 4
        return values * int(name[3:]) // 8 + values // QUANTO_GROUP * 2 * 4
    block, size = gguf.GGML_QUANT_SIZES[ggml_type(name)]
    if row % block:
        raise UsageError(f"--kv-cache {name}: a K/V row of {row} values is not a multiple of its block of {block}")
    return 2 * config.num_layers * tokens * (row // block) * size
