"""Llama family: Llama 2/3/3.1+, SmolLM and other models that share the llama layout — the block every
other dense family here varies on (`llama_block`'s keyword arguments are those variations)."""
from ..block import Attention, Block, GatedMLP, Norm, Residual, Rope
from ..config import ModelConfig
from .base import ArchAdapter


def rope_of(cfg: ModelConfig, theta: float | None = None, scaling: dict | None = None) -> Rope:
    scaling = dict(cfg.rope_scaling or {}) if scaling is None else dict(scaling)
    params = cfg.raw.get("rope_parameters") or {}
    # partial rotary: a top-level key in older configs, inside rope_parameters in transformers 5
    partial = cfg.raw.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    scaling.pop("partial_rotary_factor", None)
    if scaling and "original_max_position_embeddings" not in scaling and cfg.raw.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = cfg.raw["original_max_position_embeddings"]   # Phi-3
    return Rope(theta=float(theta or cfg.rope_theta), dim=int(cfg.head_dim * float(partial)),
                scaling=tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items())),
                max_positions=cfg.max_position_embeddings)


def llama_block(cfg: ModelConfig, *, qkv_bias: bool = False, o_bias: bool = False, q_norm: bool = False, window: int | None = None,
                rope: Rope | None = None, act: str = "silu", mlp_prefix: str = "mlp") -> Block:
    eps = cfg.rms_norm_eps
    attn = Attention(
        q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope=rope or rope_of(cfg),
        qkv_bias=qkv_bias, o_bias=o_bias,
        q_norm=Norm("self_attn.q_norm", eps) if q_norm else None,
        k_norm=Norm("self_attn.k_norm", eps) if q_norm else None, window=window)
    mlp = GatedMLP(f"{mlp_prefix}.gate_proj", f"{mlp_prefix}.up_proj", f"{mlp_prefix}.down_proj", act)
    return Block((Residual(Norm("input_layernorm", eps), attn, name="attention"),
                  Residual(Norm("post_attention_layernorm", eps), mlp, name="mlp")))


def sliding_window(cfg: ModelConfig, i: int) -> int | None:
    """The window of layer i: from `layer_types` where the config lists them (transformers ≥ 4.54), else the
    family's `sliding_window` for every layer (None = full attention)."""
    types = cfg.raw.get("layer_types")
    window = cfg.raw.get("sliding_window")
    if types:
        return int(window) if types[i] == "sliding_attention" and window else None
    return int(window) if window else None


def _layer(cfg: ModelConfig, i: int) -> Block:
    bias = bool(cfg.raw.get("attention_bias"))   # Llama configs may put biases on q/k/v/o
    return llama_block(cfg, qkv_bias=bias, o_bias=bias)


ADAPTER = ArchAdapter(family="llama", model_types=("llama",), describe_layer=_layer)
