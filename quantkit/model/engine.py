"""The one engine that runs a block description (`quantkit.model.block`), for every family and every caller.

Evaluation calls `run_block` layer by layer; the capture pass calls `run_residual` with `observe` (each input
group's input is handed to the caller as the op computes it) and `stop` (return once a stage's inputs are
seen, so that group can be quantized before the rest of the op runs).  Both go through the same functions,
so eval's forward and what calibration sees cannot drift apart.

Precision: the residual stream and the pre/post norms run in the stream's dtype (float32); an op's input is
cast to the runtime's compute dtype (bf16 for calibration where bf16 is fast, float32 for eval) and every
weight is cast to its input's dtype where it is used.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .block import Attention, Block, GatedMLP, InputGroup, MoE, Norm, Residual, Rope
from .rope import rope_tables
from .vector_math import settle

settle()   # before any parallel cos/sin/exp: see vector_math

Observer = Callable[[InputGroup, torch.Tensor], None]
# what an op calls at each of its input groups: (stage, group within the stage, the group's input rows)
_StageObserver = Callable[[int, int, torch.Tensor], None]


class Runtime:
    """What ops need besides weights: the compute dtype, RoPE tables per `Rope` (cached: layers share them),
    and optionally a runtime's arithmetic: its rounding of a linear's input (`acts`, e.g. llama.cpp's Q8 blocks),
    or the whole product as it computes it (`linears`: name -> f(x, bias), holding its own weights; LLM.int8)."""

    def __init__(self, seq_len: int, device, compute_dtype: torch.dtype = torch.float32,
                 acts: dict[str, Callable] | None = None, linears: dict[str, Callable] | None = None):
        self.seq_len, self.device, self.compute_dtype = seq_len, device, compute_dtype
        self.acts = acts or {}
        self.linears = linears or {}
        self._rope: dict[Rope, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        if rope not in self._rope:
            self._rope[rope] = rope_tables(rope, self.seq_len, self.device, self.compute_dtype)
        return self._rope[rope]

    def with_acts(self, acts: dict[str, Callable] | None, linears: dict[str, Callable] | None = None) -> "Runtime":
        """The same runtime (sharing its RoPE tables) with another runtime's arithmetic."""
        other = copy.copy(self)
        other.acts, other.linears = acts or {}, linears or {}
        return other


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    w = weight.to(x.dtype)
    return x * torch.rsqrt(var + eps) * ((1.0 + w) if unit_offset else w)


def apply_norm(norm: Norm, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return rms_norm(x, w[f"{norm.weight}.weight"], norm.eps, norm.unit_offset)


def linear(x: torch.Tensor, w: dict[str, torch.Tensor], name: str, rt: Runtime, bias: bool = False) -> torch.Tensor:
    product = rt.linears.get(name)
    if product is not None:
        return product(x, w[f"{name}.bias"].to(x.dtype) if bias else None)
    act = rt.acts.get(name)
    if act is not None:
        x = act(x)
    weight = w[f"{name}.weight"].to(x.dtype)
    b = w[f"{name}.bias"].to(x.dtype) if bias else None
    return F.linear(x, weight, b)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, keep = x[..., :d], x[..., d:]      # partial rotary: only the first `d` channels of each head turn
    return torch.cat([rot * cos + _rotate_half(rot) * sin, keep], dim=-1)


def _mask(t: int, window: int | None, device) -> torch.Tensor | None:
    """Boolean keep-mask for causal (sliding-window) attention; None where plain causal attention is exact."""
    if window is None or window >= t:
        return None
    i = torch.arange(t, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def attention(op: Attention, x: torch.Tensor, w, rt: Runtime, observe: _StageObserver | None, stop: int | None):
    """Causal grouped-query self-attention over x: (batch, seq, hidden)."""
    if observe:
        observe(0, 0, _rows(x))
    if stop == 0:
        return None
    b, t, _ = x.shape
    hd = op.head_dim
    q = linear(x, w, op.q, rt, op.qkv_bias).view(b, t, op.num_heads, hd)
    k = linear(x, w, op.k, rt, op.qkv_bias).view(b, t, op.num_kv_heads, hd)
    v = linear(x, w, op.v, rt, op.qkv_bias).view(b, t, op.num_kv_heads, hd)
    if op.q_norm is not None:
        q = apply_norm(op.q_norm, q, w)
        k = apply_norm(op.k_norm, k, w)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    cos, sin = (r[:t].to(x.dtype) for r in rt.rope(op.rope))
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    groups = op.num_heads // op.num_kv_heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    mask = _mask(t, op.window, x.device)
    if op.softcap is None:
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=op.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=op.scale)
    else:  # SDPA has no logit softcap: the scores are formed here
        scores = (q @ k.transpose(-1, -2)) * (op.scale if op.scale is not None else hd ** -0.5)
        scores = op.softcap * torch.tanh(scores / op.softcap)
        keep = mask if mask is not None else torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
        out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
    a = out.transpose(1, 2).reshape(b, t, op.num_heads * hd)
    if observe:
        observe(1, 0, _rows(a))
    if stop == 1:
        return None
    return linear(a, w, op.o, rt, op.o_bias)


_ACTS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def gated_mlp(op: GatedMLP, x: torch.Tensor, w, rt: Runtime, observe: _StageObserver | None, stop: int | None):
    if observe:
        observe(0, 0, _rows(x))
    if stop == 0:
        return None
    m = _ACTS[op.act](linear(x, w, op.gate, rt)) * linear(x, w, op.up, rt)
    if observe:
        observe(1, 0, _rows(m))
    if stop == 1:
        return None
    return linear(m, w, op.down, rt)


def _observe_nonempty(observe: _StageObserver | None, stage: int, inputs: list[torch.Tensor]) -> None:
    """Each expert's input rows at a stage; an expert no token was routed to has nothing to observe."""
    for k, rows in enumerate(inputs if observe else ()):
        if rows.shape[0]:
            observe(stage, k, rows)


def moe(op: MoE, x: torch.Tensor, w, rt: Runtime, observe: _StageObserver | None, stop: int | None):
    """Top-k routing as transformers does it: softmax in float32, top-k, optional renormalisation, weights in the
    activations' dtype; each expert runs on its routed tokens only (an expert no token chose is not observed)."""
    b, t, hidden = x.shape
    flat = x.reshape(-1, hidden)
    probs = torch.softmax(linear(flat, w, op.router, rt).float(), dim=-1)
    top, chosen = probs.topk(op.top_k, dim=-1)
    if op.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    top = top.to(x.dtype)
    routes = [torch.where(chosen == e) for e in range(len(op.experts))]    # (token rows, top-k slot) per expert
    inputs = [flat[tokens] for tokens, _ in routes] + ([flat] if op.shared else [])
    experts = op._all
    _observe_nonempty(observe, 0, inputs)
    if stop == 0:
        return None
    hidden_states = [_ACTS[e.act](linear(rows, w, e.gate, rt)) * linear(rows, w, e.up, rt)
                     for e, rows in zip(experts, inputs)]
    _observe_nonempty(observe, 1, hidden_states)
    if stop == 1:
        return None
    out = torch.zeros_like(flat)
    for e, (tokens, slot), m in zip(op.experts, routes, hidden_states):
        out.index_add_(0, tokens, linear(m, w, e.down, rt) * top[tokens, slot, None])
    if op.shared:
        gate = torch.sigmoid(linear(flat, w, op.shared_gate, rt))
        out = out + gate * linear(hidden_states[-1], w, op.shared.down, rt)
    return out.view(b, t, hidden)


OPS = {Attention: attention, GatedMLP: gated_mlp, MoE: moe}


def run_residual(sub: Residual, h: torch.Tensor, w: dict[str, torch.Tensor], rt: Runtime, *,
                 observe: Observer | None = None, stop: int | None = None) -> torch.Tensor | None:
    """The residual branch post_norm(op(norm(h))) for h (batch, seq, hidden) in the stream dtype, returned in
    the compute dtype (the caller adds it to h).  With `stop` = s, returns None once stage s's inputs were
    handed to `observe`."""
    x = apply_norm(sub.norm, h, w).to(rt.compute_dtype)
    stages = sub.stages
    by_index = (lambda s, k, rows: observe(stages[s][k], rows)) if observe else None
    out = OPS[type(sub.op)](sub.op, x, w, rt, by_index, stop)
    if out is None or sub.post_norm is None:
        return out
    return apply_norm(sub.post_norm, out.float(), w)   # norms run in float32, as the pre-norm does


def run_block(block: Block, h: torch.Tensor, w: dict[str, torch.Tensor], rt: Runtime) -> torch.Tensor:
    """One decoder layer: every residual sub-block in order."""
    for sub in block.residuals:
        h = h + run_residual(sub, h, w, rt).to(h.dtype)
    return h


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else cap * torch.tanh(logits / cap)




def embed(model, tokens: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The embedding rows of `tokens` in `dtype`, times the family's embedding scale (Gemma's √hidden, taken
    in the checkpoint's dtype as transformers does)."""
    h = model.embed_weight()[tokens]
    scale = model.pieces.embed_scale
    if scale is not None:
        h = h * torch.tensor(scale, dtype=h.dtype)
    return h.to(dtype)
