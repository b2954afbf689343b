"""K/V cache types a runtime can keep its attention cache in, and what the cache costs in bytes.

llama.cpp stores K and V in one of its block types (`--cache-type-k/-v`); its quantized V cache needs flash
attention, so quantkit turns flash attention on for every cache type of a comparison (f16 included), and
the figures differ only by the cache.  The sizes are gguf-py's block tables: bytes per block of elements.
"""
from __future__ import annotations

import gguf

from ..errors import UsageError

# the types llama.cpp accepts for its K/V cache (common/arg.cpp's kv_cache_types)
LLAMACPP_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def parse_types(text: str) -> list[str]:
    """`f16,q8_0,q4_0` -> ["f16", "q8_0", "q4_0"], each a type llama.cpp's cache takes."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in LLAMACPP_TYPES]
    if not names or bad:
        raise UsageError(f"--kv-cache {text!r}: expected one or more of {', '.join(LLAMACPP_TYPES)} (comma-separated)")
    return list(dict.fromkeys(names))


def ggml_type(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name.upper()]


def cache_bytes(config, tokens: int, name: str) -> int:    # config: quantkit.model.config.ModelConfig
    """Bytes of the K and V cache of every layer for `tokens` positions, stored as `name`."""
    block, size = gguf.GGML_QUANT_SIZES[ggml_type(name)]
    row = config.num_kv_heads * config.head_dim
    if row % block:
        raise UsageError(f"--kv-cache {name}: a K/V row of {row} values is not a multiple of its block of {block}")
    return 2 * config.num_layers * tokens * (row // block) * size
