"""Phi-3 / Phi-3.5 / Phi-4-mini: the llama block stored with q/k/v joined in `qkv_proj` and gate/up joined in
`gate_up_proj` (split on read, so every format sees the llama linears; formats that store them joined join
them again), longrope scaling with the pretrained context as a top-level config key, partial rotary
(Phi-4-mini rotates 3/4 of each head) and an optional sliding window."""
from ..block import Block
from ..config import ModelConfig
from .base import ArchAdapter
from .llama import llama_block


def _layer(cfg: ModelConfig, i: int) -> Block:
    window = cfg.raw.get("sliding_window")
    return llama_block(cfg, window=int(window) if window else None)


def _fused(cfg: ModelConfig) -> dict:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"self_attn.qkv_proj.weight": (("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", kv),
                                          ("self_attn.v_proj.weight", kv)),
            "mlp.gate_up_proj.weight": (("mlp.gate_proj.weight", cfg.intermediate_size),
                                        ("mlp.up_proj.weight", cfg.intermediate_size))}


ADAPTER = ArchAdapter(family="phi3", model_types=("phi3",), describe_layer=_layer, fused=_fused, gguf_arch="phi3",
                      gguf_permute_qk=False)
