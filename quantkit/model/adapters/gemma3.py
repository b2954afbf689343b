"""Gemma 3 (text): Gemma 2's block with `1 + w` q/k norms instead of the attention softcap, five sliding layers
to one global, and a RoPE per layer type — local layers at rope_local_base_freq (10 000) unscaled, global ones
at rope_theta with the checkpoint's scaling.  transformers ≥ 5 writes both as `rope_parameters[layer_type]`.

The image-text-to-text checkpoints (model_type `gemma3`, Gemma3ForConditionalGeneration) hold the same language
model under `language_model.` with its config as `text_config`, beside a SigLIP vision tower quantkit leaves as
it is."""
from dataclasses import replace

from ..block import Block
from ..config import ModelConfig
from .base import ArchAdapter
from .gemma2 import gemma_block, layer_type
from .llama import rope_of


def gemma3_rope(cfg: ModelConfig, kind: str):
    params = cfg.raw.get("rope_parameters")
    if isinstance(params, dict) and kind in params:       # transformers 5: one entry per layer type
        p = dict(params[kind] or {})
        theta = p.pop("rope_theta", None)
        return rope_of(cfg, theta=theta, scaling={} if p.get("rope_type", "default") == "default" else p)
    if kind == "sliding_attention":                          # older configs: rope_local_base_freq, unscaled
        return rope_of(cfg, theta=cfg.raw.get("rope_local_base_freq") or 10000.0, scaling={})
    return rope_of(cfg)


def _layer(cfg: ModelConfig, i: int) -> Block:
    kind = layer_type(cfg, i, int(cfg.raw.get("sliding_window_pattern") or 6))
    return gemma_block(cfg, i, rope=gemma3_rope(cfg, kind), kind=kind, qk_norm=True)


def _ropes(cfg: ModelConfig) -> dict:
    return {kind: gemma3_rope(cfg, kind) for kind in ("sliding_attention", "full_attention")}


ADAPTER = ArchAdapter(family="gemma3", model_types=("gemma3_text",), describe_layer=_layer, embed_scale=True,
                      rope_by_layer_type=_ropes,
                      unit_offset_norms=True, logit_softcap_key="final_logit_softcapping", gguf_arch="gemma3",
                      gguf_permute_qk=False)

MULTIMODAL = replace(ADAPTER, model_types=("gemma3",), text_config="text_config", text_prefix="language_model.",
                     layer_prefix="language_model.model.layers.{i}.", embed="language_model.model.embed_tokens.weight",
                     final_norm="language_model.model.norm.weight", lm_head="language_model.lm_head.weight",
                     layers_module="model.language_model.layers")
