"""Mistral: the llama block with sliding-window attention (`sliding_window`, None in Mistral v0.2+)."""
from ..block import Block
from ..config import ModelConfig
from .base import ArchAdapter
from .llama import llama_block, sliding_window


def _layer(cfg: ModelConfig, i: int) -> Block:
    return llama_block(cfg, window=sliding_window(cfg, i))


ADAPTER = ArchAdapter(family="mistral", model_types=("mistral",), describe_layer=_layer)
