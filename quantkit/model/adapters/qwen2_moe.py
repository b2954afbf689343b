"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE: the qwen2 / qwen3 attention with a mixture of experts
in the layers `decoder_sparse_step` and `mlp_only_layers` select (the others keep a dense MLP).  Qwen2-MoE adds
a shared expert every token goes through, scaled by a sigmoid gate; Qwen3-MoE has none.  `norm_topk_prob`
says whether the chosen experts' probabilities are renormalised."""
from dataclasses import replace

from ..block import Block, GatedMLP, MoE
from ..config import ModelConfig
from .base import ArchAdapter
from .llama import llama_block
from .qwen2 import qwen_window


def expert_count(cfg: ModelConfig) -> int:
    """`num_experts` in Qwen's own configs, `num_local_experts` as transformers 5 saves them."""
    return int(cfg.raw.get("num_experts") or cfg.raw.get("num_local_experts") or 0)


def _is_sparse(cfg: ModelConfig, i: int) -> bool:
    raw = cfg.raw
    experts = expert_count(cfg)
    return i not in (raw.get("mlp_only_layers") or []) and experts > 0 and (i + 1) % int(raw.get("decoder_sparse_step") or 1) == 0


def moe_block(cfg: ModelConfig, i: int, *, shared: bool, **attention) -> Block:
    attn, mlp = llama_block(cfg, window=qwen_window(cfg, i), **attention).residuals
    if not _is_sparse(cfg, i):
        return Block((attn, mlp))
    experts = tuple(GatedMLP(f"mlp.experts.{e}.gate_proj", f"mlp.experts.{e}.up_proj", f"mlp.experts.{e}.down_proj")
                    for e in range(expert_count(cfg)))
    moe = MoE("mlp.gate", experts, top_k=int(cfg.raw["num_experts_per_tok"]),
              renormalize=bool(cfg.raw.get("norm_topk_prob")),
              shared=GatedMLP("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                              "mlp.shared_expert.down_proj") if shared else None,
              shared_gate="mlp.shared_expert_gate" if shared else None)
    return Block((attn, replace(mlp, op=moe, name="moe")))


def _qwen2_moe(cfg: ModelConfig, i: int) -> Block:
    return moe_block(cfg, i, shared=True, qkv_bias=True)


def _qwen3_moe(cfg: ModelConfig, i: int) -> Block:
    bias = bool(cfg.raw.get("attention_bias"))
    return moe_block(cfg, i, shared=False, qkv_bias=bias, o_bias=bias, q_norm=True)


QWEN2_MOE = ArchAdapter(family="qwen2_moe", model_types=("qwen2_moe",), describe_layer=_qwen2_moe,
                        gguf_arch="qwen2moe", gguf_permute_qk=False)
QWEN3_MOE = ArchAdapter(family="qwen3_moe", model_types=("qwen3_moe",), describe_layer=_qwen3_moe,
                        gguf_arch="qwen3moe", gguf_permute_qk=False)
