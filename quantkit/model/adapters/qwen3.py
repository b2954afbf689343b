"""Qwen3: the llama block with a per-head RMSNorm on q and k (and Qwen2's optional sliding windows)."""
from ..block import Block
from ..config import ModelConfig
from .base import ArchAdapter
from .llama import llama_block
from .qwen2 import qwen_window


def _layer(cfg: ModelConfig, i: int) -> Block:
    bias = bool(cfg.raw.get("attention_bias"))
    return llama_block(cfg, qkv_bias=bias, o_bias=bias, q_norm=True, window=qwen_window(cfg, i))


ADAPTER = ArchAdapter(family="qwen3", model_types=("qwen3",), describe_layer=_layer, gguf_arch="qwen3",
                      gguf_permute_qk=False)
