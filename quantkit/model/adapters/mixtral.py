"""Mixtral: the llama/mistral attention (sliding window where configured) with a mixture of experts in place
of the MLP — `block_sparse_moe.gate` routes each token to `num_experts_per_tok` of `num_local_experts`
experts (w1 = gate, w3 = up, w2 = down), their probabilities renormalised over the chosen ones."""
from dataclasses import replace

from ..block import Block, GatedMLP, MoE
from ..config import ModelConfig
from .base import ArchAdapter
from .llama import llama_block, sliding_window


def _layer(cfg: ModelConfig, i: int) -> Block:
    attn, mlp = llama_block(cfg, window=sliding_window(cfg, i)).residuals
    prefix = "block_sparse_moe"
    experts = tuple(GatedMLP(f"{prefix}.experts.{e}.w1", f"{prefix}.experts.{e}.w3", f"{prefix}.experts.{e}.w2")
                    for e in range(int(cfg.raw["num_local_experts"])))
    moe = MoE(f"{prefix}.gate", experts, top_k=int(cfg.raw["num_experts_per_tok"]), renormalize=True)
    return Block((attn, replace(mlp, op=moe, name="moe")))


ADAPTER = ArchAdapter(family="mixtral", model_types=("mixtral",), describe_layer=_layer)
