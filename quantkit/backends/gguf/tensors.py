"""Which GGUF tensors a checkpoint becomes: names, GGUF shapes, write order, and the llama Q/K row order."""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from ...errors import UnsupportedArchitectureError
from ...model.checkpoint import Checkpoint
from ...model.decoder import rope_base_inv_freq, rope_inv_freq

ARCHES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


@dataclass(frozen=True)
class GGUFTensor:
    name: str             # GGUF name, e.g. blk.3.attn_q.weight
    source: str | None    # HF tensor name it is made from (None: generated, e.g. rope_freqs)
    shape: tuple[int, ...]  # torch order (rows, row_length); GGUF ne is the reverse
    permute_heads: int = 0  # > 0: llama q/k rows reordered for this many heads

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


def gguf_tensors(model: Checkpoint) -> list[GGUFTensor]:
    adapter, cfg = model.adapter, model.config
    arch = ARCHES.get(adapter.gguf_arch)
    if arch is None:
        raise UnsupportedArchitectureError(f"no GGUF mapping for the {adapter.family} family")
    name_map = gguf.get_tensor_name_map(arch, cfg.num_layers)
    out: list[GGUFTensor] = []
    for hf_name, entry in model.weights.entries.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if hf_name == adapter.lm_head and model.tied_embeddings:
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UnsupportedArchitectureError(f"tensor {hf_name} has no GGUF name for {adapter.gguf_arch}")
        heads = 0
        if adapter.gguf_permute_qk and hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            heads = cfg.num_heads
        elif adapter.gguf_permute_qk and hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            heads = cfg.num_kv_heads
        out.append(GGUFTensor(name, hf_name, tuple(entry.shape), heads))
    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3":
        # llama.cpp has no llama3 rope metadata; the per-frequency factors travel as a tensor.
        out.append(GGUFTensor("rope_freqs.weight", None, (cfg.head_dim // 2,)))
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
    if t.source is None:  # rope_freqs: factor by which llama3 scaling divides each frequency
        return (rope_base_inv_freq(model.config) / rope_inv_freq(model.config)).float()
    w = model.tensor(t.source)
    if not w.is_floating_point():
        w = w.float()
    if t.permute_heads:
        w = permute_qk(w, t.permute_heads)
    return w
