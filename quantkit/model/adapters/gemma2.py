"""Gemma 2: `1 + w` RMSNorms before and after both attention and MLP, embeddings × √hidden, gelu-tanh MLP,
query scaling by query_pre_attn_scalar^-½, attention and final logit softcaps, sliding/global alternation."""
from ..block import Attention, Block, GatedMLP, Norm, Residual
from ..config import ModelConfig
from .base import ArchAdapter
from .llama import rope_of


def layer_type(cfg: ModelConfig, i: int, pattern: int) -> str:
    """"sliding_attention" or "full_attention": from `layer_types`, else every `pattern`-th layer is global."""
    types = cfg.raw.get("layer_types")
    if types:
        return types[i]
    return "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"


def gemma_block(cfg: ModelConfig, i: int, *, rope, kind: str, qk_norm: bool) -> Block:
    eps = cfg.rms_norm_eps
    norm = lambda name: Norm(name, eps, unit_offset=True)
    cap = cfg.raw.get("attn_logit_softcapping")
    scalar = cfg.raw.get("query_pre_attn_scalar") or cfg.head_dim
    window = cfg.raw.get("sliding_window") if kind == "sliding_attention" else None
    bias = bool(cfg.raw.get("attention_bias"))
    attn = Attention(
        q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope=rope,
        qkv_bias=bias, o_bias=bias, q_norm=norm("self_attn.q_norm") if qk_norm else None,
        k_norm=norm("self_attn.k_norm") if qk_norm else None, window=int(window) if window else None,
        softcap=float(cap) if cap else None, scale=float(scalar) ** -0.5)
    mlp = GatedMLP("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", act="gelu_tanh")
    return Block((Residual(norm("input_layernorm"), attn, norm("post_attention_layernorm"), name="attention"),
                  Residual(norm("pre_feedforward_layernorm"), mlp, norm("post_feedforward_layernorm"), name="mlp")))


def _layer(cfg: ModelConfig, i: int) -> Block:
    return gemma_block(cfg, i, rope=rope_of(cfg), kind=layer_type(cfg, i, 2), qk_norm=False)


ADAPTER = ArchAdapter(family="gemma2", model_types=("gemma2",), describe_layer=_layer, embed_scale=True,
                      unit_offset_norms=True, logit_softcap_key="final_logit_softcapping", gguf_arch="gemma2",
                      gguf_permute_qk=False)
