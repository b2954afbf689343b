"""The shape of an architecture adapter: the tensors outside the layers, and a function that describes
layer i of a config as a `Block` (quantkit.model.block)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...errors import SourceError
from ..block import Block, ModelPieces, Norm
from ..config import ModelConfig


@dataclass(frozen=True)
class ArchAdapter:
    family: str
    model_types: tuple[str, ...]
    # layer i of a model with this config, as data; the engine runs it, formats read its linears
    describe_layer: Callable[[ModelConfig, int], Block]
    layer_prefix: str = "model.layers.{i}."
    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    # Gemma: embeddings × √hidden, norms scale by 1 + w; a final logit softcap is read from this config key
    embed_scale: bool = False
    unit_offset_norms: bool = False
    logit_softcap_key: str | None = None
    # checkpoints that store linears joined (Phi-3's qkv_proj, gate_up_proj): config -> {stored name: ((part, rows),
    # …)}, names relative to the layer prefix with ".weight"; every consumer sees the parts, split on read
    fused: Callable[[ModelConfig], dict] | None = None
    # families whose layer types use different RoPEs (Gemma 3): config -> {"full_attention": Rope, ...}
    rope_by_layer_type: Callable[[ModelConfig], dict] | None = None
    # Name of the GGUF / llama.cpp architecture this family converts to.
    gguf_arch: str = "llama"
    # Only llama.cpp's "llama" arch permutes q/k rows (HF's rotate-half -> GGML's interleaved RoPE).
    gguf_permute_qk: bool = True
    # a language model inside a larger checkpoint (Gemma 3's image-text-to-text): the config key of its own config
    # and the prefix its tensors carry there.  The other tensors (a vision tower) travel unchanged in formats that
    # store a whole checkpoint (GPTQ) and stay out of text-only ones (GGUF).
    text_config: str | None = None
    text_prefix: str = ""
    # where transformers' model holds the decoder layers, when that differs from the names in the file
    # (GPTQ's block_name_to_quantize: the stack of layers that is quantized, not the vision tower's)
    layers_module: str | None = None

    def language_config(self, raw: dict, where: str = "config.json") -> dict:
        """The config the block descriptions read: the checkpoint's own, or its language model's."""
        if self.text_config is None:
            return raw
        inner = raw.get(self.text_config)
        if not isinstance(inner, dict):
            raise SourceError(f"{where}: a {raw.get('model_type')} config without its {self.text_config!r}")
        return inner

    def in_language_model(self, name: str) -> bool:
        return name.startswith(self.text_prefix)

    def prefix(self, i: int) -> str:
        return self.layer_prefix.format(i=i)

    def model_pieces(self, cfg: ModelConfig) -> ModelPieces:
        cap = cfg.raw.get(self.logit_softcap_key) if self.logit_softcap_key else None
        return ModelPieces(embed=self.embed, lm_head=self.lm_head,
                           final_norm=Norm(self.final_norm.removesuffix(".weight"), cfg.rms_norm_eps,
                                           self.unit_offset_norms),
                           embed_scale=cfg.hidden_size ** 0.5 if self.embed_scale else None,
                           logit_softcap=float(cap) if cap else None)
