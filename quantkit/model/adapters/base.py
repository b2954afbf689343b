"""The shape of an architecture adapter."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputGroup:
    """Linears that read the same input; `norm` is the RMSNorm applied just before them (or None)."""
    norm: str | None
    linears: tuple[str, ...]


@dataclass(frozen=True)
class ArchAdapter:
    family: str
    model_types: tuple[str, ...]
    # Names relative to the layer prefix, in true-sequential order (q/k/v -> o -> gate/up -> down).
    input_groups: tuple[InputGroup, ...]
    norms: tuple[str, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    layer_prefix: str = "model.layers.{i}."
    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    # Name of the GGUF / llama.cpp architecture this family converts to.
    gguf_arch: str = "llama"
    # Only llama.cpp's "llama" arch permutes q/k rows (HF's rotate-half -> GGML's interleaved RoPE).
    gguf_permute_qk: bool = True

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for g in self.input_groups for name in g.linears)

    def layer_tensor_names(self) -> list[str]:
        names = [f"{lin}.weight" for lin in self.linears]
        if self.qkv_bias:
            names += [f"self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")]
        if self.qk_norm:
            names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        names += [f"{n}.weight" for n in self.norms]
        return names

    def prefix(self, i: int) -> str:
        return self.layer_prefix.format(i=i)
