"""Which GGUF tensors a checkpoint becomes: names, GGUF shapes, write order, and the llama Q/K row order."""
from __future__ import annotations

import math
from dataclasses import dataclass

import gguf
import torch

from ...errors import UnsupportedArchitectureError
from ...model.block import MoE
from ...model.checkpoint import Checkpoint
from ...model.rope import base_inv_freq

ARCHES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
          "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3,
          "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE}
# llama.cpp's own conventions per architecture (facts of its convert_hf_to_gguf.py and src/models/*.cpp): Gemma
# stores `1 + w` norms with the 1 added; llama.cpp's gemma2 always ties the output head to the embedding and its
# qwen2moe never does (it requires output.weight, so a tied checkpoint's embedding is written there too).
NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}
TIED_ONLY = {"gemma2"}
UNTIED_ONLY = {"qwen2moe"}
# Mixture of experts: llama.cpp builds every layer of these architectures with experts, and whether it
# renormalises the chosen experts' weights is fixed per architecture, not read from the file.
EXPERT_RENORMALIZE = {"llama": True, "qwen2moe": False, "qwen3moe": True}
# the stacked expert tensors, one per projection of the experts' gated MLP
EXPERT_STACKS = (("gate", gguf.MODEL_TENSOR.FFN_GATE_EXP), ("up", gguf.MODEL_TENSOR.FFN_UP_EXP),
                 ("down", gguf.MODEL_TENSOR.FFN_DOWN_EXP))


@dataclass(frozen=True)
class GGUFTensor:
    name: str             # GGUF name, e.g. blk.3.attn_q.weight
    source: str | None    # HF tensor name it is made from (None: generated, e.g. rope_freqs; or stacked)
    shape: tuple[int, ...]  # torch order (rows, row_length); GGUF ne is the reverse
    permute_heads: int = 0  # > 0: llama q/k rows reordered for this many heads
    shift: float = 0.0      # added to every value (Gemma's norms: llama.cpp multiplies by w, HF by 1 + w)
    stack: tuple[str, ...] = ()  # HF tensors stacked along a new first axis (the experts' ffn_*_exps)

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def layer(self) -> int:
        return int(self.name.split(".")[1]) if self.name.startswith("blk.") else -1


def write_order(names: list[str]) -> list[str]:
    """llama-quantize's order: tensors outside blocks first, then by block index, by name within each."""
    def key(n: str):
        if n.startswith("blk."):
            parts = n.split(".", 2)
            return (int(parts[1]), parts[2])
        return (-1, n)
    return sorted(names, key=key)


def moe_op(model, i: int) -> MoE | None:
    return next((r.op for r in model.block(i).residuals if isinstance(r.op, MoE)), None)


def sliding_layers(model) -> list[bool]:
    """Per layer, whether its attention slides over a window."""
    return [model.block(i).residuals[0].op.window is not None for i in range(model.config.num_layers)]


def expert_count(model) -> int:
    """The number of experts per layer (0 for a dense model): llama-quantize's rules read it."""
    return max((len(op.experts) for i in range(model.config.num_layers) if (op := moe_op(model, i))), default=0)


def expert_stacks(model, i: int) -> dict[str, tuple[str, ...]]:
    """Layer i's stacked expert tensors: GGUF name -> the experts' weights (names relative to the layer), in order."""
    op = moe_op(model, i)
    if op is None:
        return {}
    return {gguf.TENSOR_NAMES[kind].format(bid=i) + ".weight": tuple(f"{getattr(e, role)}.weight" for e in op.experts)
            for role, kind in EXPERT_STACKS}


def _check_experts(model) -> None:
    """llama.cpp runs what these architectures' code says, whatever the checkpoint's config: refuse a file that it
    would run differently from the model."""
    arch, layers = model.adapter.gguf_arch, range(model.config.num_layers)
    ops = [moe_op(model, i) for i in layers]
    if not any(ops):
        return
    if arch not in EXPERT_RENORMALIZE:
        raise UnsupportedArchitectureError(f"llama.cpp's {arch} has no mixture-of-experts layers")
    if not all(ops):
        dense = [i for i, op in zip(layers, ops) if op is None]
        raise UnsupportedArchitectureError(f"layers {dense} have a dense MLP (mlp_only_layers / decoder_sparse_step), "
                                           f"and llama.cpp's {arch} builds experts in every layer")
    if ops[0].renormalize != EXPERT_RENORMALIZE[arch]:
        raise UnsupportedArchitectureError(
            f"llama.cpp's {arch} {'always' if EXPERT_RENORMALIZE[arch] else 'never'} renormalises the chosen experts' "
            f"weights, and this checkpoint {'does not' if EXPERT_RENORMALIZE[arch] else 'does'} (norm_topk_prob)")


def gguf_tensors(model: Checkpoint) -> list[GGUFTensor]:
    adapter, cfg = model.adapter, model.config
    arch = ARCHES.get(adapter.gguf_arch)
    if arch is None:
        raise UnsupportedArchitectureError(f"no GGUF mapping for the {adapter.family} family")
    _check_experts(model)
    name_map = gguf.get_tensor_name_map(arch, cfg.num_layers)
    out: list[GGUFTensor] = []
    stacked: set[str] = set()
    for i in range(cfg.num_layers):
        prefix = adapter.prefix(i)
        for name, parts in expert_stacks(model, i).items():
            first = model.weights.entries[prefix + parts[0]]
            out.append(GGUFTensor(name, None, (len(parts), *first.shape), stack=tuple(prefix + p for p in parts)))
            stacked.update(prefix + p for p in parts)
    for hf_name, entry in model.weights.entries.items():
        if hf_name.endswith("rotary_emb.inv_freq") or hf_name in stacked or not adapter.in_language_model(hf_name):
            continue   # a vision tower is llama.cpp's separate mmproj file, not the language model's
        if hf_name == adapter.lm_head and model.tied_embeddings:
            continue
        if hf_name == adapter.lm_head and adapter.gguf_arch in TIED_ONLY:
            raise UnsupportedArchitectureError(f"{hf_name}: llama.cpp's {adapter.gguf_arch} reads the output head from "
                                               f"the embedding, and this checkpoint's head is a separate tensor")
        name = name_map.get_name(hf_name.removeprefix(adapter.text_prefix), try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UnsupportedArchitectureError(f"tensor {hf_name} has no GGUF name for {adapter.gguf_arch}")
        heads = 0
        if adapter.gguf_permute_qk and hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            heads = cfg.num_heads
        elif adapter.gguf_permute_qk and hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            heads = cfg.num_kv_heads
        shift = NORM_SHIFT.get(adapter.gguf_arch, 0.0) if hf_name.endswith("norm.weight") else 0.0
        out.append(GGUFTensor(name, hf_name, tuple(entry.shape), heads, shift))
    if model.tied_embeddings and adapter.gguf_arch in UNTIED_ONLY:
        out.append(GGUFTensor("output.weight", adapter.embed, tuple(model.weights.entries[adapter.embed].shape)))
    rope = model.block(0).residuals[0].op.rope
    if rope.kind == "llama3":
        # llama.cpp has no llama3 rope metadata; the per-frequency factors travel as a tensor.
        out.append(GGUFTensor("rope_freqs.weight", None, (cfg.head_dim // 2,)))
    if rope.kind == "longrope":   # Phi-3: both factor lists, llama.cpp picks by context length
        for kind in ("long", "short"):
            out.append(GGUFTensor(f"rope_factors_{kind}.weight", None, (len(rope.param(f"{kind}_factor")),)))
    by_name = {t.name: t for t in out}
    return [by_name[n] for n in write_order(list(by_name))]


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half row order -> llama.cpp's interleaved pairs, within each head."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *rest).transpose(1, 2).reshape(rows, *rest)


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def load_source(model: Checkpoint, t: GGUFTensor) -> torch.Tensor:
    """The values that go into GGUF tensor `t` (permuted, generated where needed),
    in the checkpoint's own dtype: the encoders widen them to float32 chunk by
    chunk, so the largest tensor is never held twice, once at double width."""
    rope = model.block(0).residuals[0].op.rope
    if t.name.startswith("rope_factors_"):
        return torch.tensor(rope.param(t.name[len("rope_factors_"):-len(".weight")] + "_factor"), dtype=torch.float32)
    if t.stack:   # one projection of every expert of a layer: a layer's worth of weights, held once
        return torch.stack([model.tensor(n) for n in t.stack])
    if t.source is None:  # rope_freqs: factor by which llama3 scaling divides each frequency
        return llama3_rope_factors(rope)
    w = model.tensor(t.source)
    if not w.is_floating_point():
        w = w.float()
    if t.shift:  # in float32: llama.cpp's converter adds in the checkpoint's dtype, rounding 1 + w to bf16
        w = w.float() + t.shift
    if t.permute_heads:
        w = permute_qk(w, t.permute_heads)
    return w


def llama3_rope_factors(rope) -> torch.Tensor:
    """Per frequency, the factor llama3 scaling divides it by, computed as llama.cpp's converter does (in float32,
    from the wavelength), so the tensor's bytes are the converter's."""
    p = rope.param
    factor, low, high = float(p("factor")), float(p("low_freq_factor")), float(p("high_freq_factor"))
    old = float(p("original_max_position_embeddings"))
    wavelen = 2 * math.pi / base_inv_freq(rope)
    smooth = (old / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen < old / high, torch.ones_like(wavelen), torch.where(wavelen > old / low,
                                                                                  torch.full_like(wavelen, factor), blend))
    return out.float()
