"""Qwen2 (q/k/v biases) and Qwen3 (per-head RMSNorm on q and k): the llama layout plus one twist each."""
from dataclasses import replace

from .llama import ADAPTER as LLAMA

# llama.cpp has its own qwen2/qwen3 archs, which keep HF's rotate-half RoPE: no q/k permutation.
QWEN2 = replace(LLAMA, family="qwen2", model_types=("qwen2",), qkv_bias=True, gguf_arch="qwen2", gguf_permute_qk=False)
QWEN3 = replace(LLAMA, family="qwen3", model_types=("qwen3",), qk_norm=True, gguf_arch="qwen3", gguf_permute_qk=False)
