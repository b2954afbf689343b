"""Qwen2 / Qwen2.5: the llama block with q/k/v biases; sliding windows only when `use_sliding_window` is on,
for layers from `max_window_layers` on (transformers writes these as `layer_types`)."""
from ..block import Block
from ..config import ModelConfig
from .base import ArchAdapter
from .llama import llama_block, sliding_window


def qwen_window(cfg: ModelConfig, i: int) -> int | None:
    if cfg.raw.get("layer_types"):
        return sliding_window(cfg, i)
    on = cfg.raw.get("use_sliding_window") and i >= int(cfg.raw.get("max_window_layers") or 0)
    return int(cfg.raw["sliding_window"]) if on and cfg.raw.get("sliding_window") else None


def _layer(cfg: ModelConfig, i: int) -> Block:
    return llama_block(cfg, qkv_bias=True, window=qwen_window(cfg, i))


# llama.cpp has its own qwen2 arch, which keeps HF's rotate-half RoPE: no q/k permutation.
ADAPTER = ArchAdapter(family="qwen2", model_types=("qwen2",), describe_layer=_layer, gguf_arch="qwen2",
                      gguf_permute_qk=False)
