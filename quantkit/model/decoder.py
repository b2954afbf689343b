"""The llama-family decoder in plain torch, one layer at a time.

Calibration and evaluation both walk a model layer by layer over many
sequences, so instead of building a whole transformers model they call
`decoder_layer` with one layer's weights.  Qwen2's q/k/v biases and Qwen3's q/k
norms are the only family differences (adapter flags).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import UnsupportedArchitectureError
from .adapters import ArchAdapter
from .config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * weight


def rope_base_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The unscaled RoPE frequencies, theta^(-2i/d)."""
    dim = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv = rope_base_inv_freq(cfg)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled)
    raise UnsupportedArchitectureError(f"RoPE scaling {kind!r} is not supported (supported: default, linear, llama3)")


def rope_tables(cfg: ModelConfig, seq_len: int, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    inv = rope_inv_freq(cfg).to(device)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _linear(x, w, b=None, act=None):
    if act is not None:  # a runtime's rounding of the activations (e.g. llama.cpp's Q8 blocks)
        x = act(x)
    return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))


def attention(x: torch.Tensor, w: dict[str, torch.Tensor], cfg: ModelConfig, adapter: ArchAdapter,
              rope: tuple[torch.Tensor, torch.Tensor], acts: dict | None = None) -> torch.Tensor:
    """Causal grouped-query self-attention over x: (batch, seq, hidden)."""
    b, t, _ = x.shape
    hd = cfg.head_dim
    bias = (lambda n: w[f"self_attn.{n}.bias"]) if adapter.qkv_bias else (lambda n: None)
    act = (acts or {}).get
    q = _linear(x, w["self_attn.q_proj.weight"], bias("q_proj"), act("self_attn.q_proj")).view(b, t, cfg.num_heads, hd)
    k = _linear(x, w["self_attn.k_proj.weight"], bias("k_proj"), act("self_attn.k_proj")).view(b, t, cfg.num_kv_heads, hd)
    v = _linear(x, w["self_attn.v_proj.weight"], bias("v_proj"), act("self_attn.v_proj")).view(b, t, cfg.num_kv_heads, hd)
    if adapter.qk_norm:
        q = rms_norm(q, w["self_attn.q_norm.weight"].to(x.dtype), cfg.rms_norm_eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"].to(x.dtype), cfg.rms_norm_eps)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    cos, sin = (r[:t].to(x.dtype) for r in rope)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    groups = cfg.num_heads // cfg.num_kv_heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, t, cfg.num_heads * hd)


def decoder_layer(h: torch.Tensor, w: dict[str, torch.Tensor], cfg: ModelConfig, adapter: ArchAdapter,
                  rope: tuple[torch.Tensor, torch.Tensor], hooks=None, acts: dict | None = None) -> torch.Tensor:
    """One pre-norm decoder layer.  `hooks(name, x)` (optional) sees each linear group's input,
    which is where calibration collects its statistics; `acts` (optional) maps a linear's name to a
    function applied to its input, to reproduce a runtime's activation rounding."""
    eps = cfg.rms_norm_eps
    act = (acts or {}).get
    x = rms_norm(h, w["input_layernorm.weight"].to(h.dtype), eps)
    if hooks:
        hooks("attn_in", x)
    a = attention(x, w, cfg, adapter, rope, acts)
    if hooks:
        hooks("attn_out", a)
    h = h + _linear(a, w["self_attn.o_proj.weight"], act=act("self_attn.o_proj"))
    x = rms_norm(h, w["post_attention_layernorm.weight"].to(h.dtype), eps)
    if hooks:
        hooks("mlp_in", x)
    m = F.silu(_linear(x, w["mlp.gate_proj.weight"], act=act("mlp.gate_proj"))) * \
        _linear(x, w["mlp.up_proj.weight"], act=act("mlp.up_proj"))
    if hooks:
        hooks("mlp_out", m)
    return h + _linear(m, w["mlp.down_proj.weight"], act=act("mlp.down_proj"))
