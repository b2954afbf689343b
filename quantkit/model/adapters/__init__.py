"""Architecture adapters: one module per model family, each building an `ArchAdapter` whose
`describe_layer(config, i)` writes layer i down as a block description (quantkit.model.block).

Adding a family means adding one module here and listing it in `_FAMILIES` (docs/adding-a-family.md).
"""
from __future__ import annotations

from ...errors import UnsupportedArchitectureError
from ..block import InputGroup
from .base import ArchAdapter
from . import gemma2, gemma3, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3

_FAMILIES: list[ArchAdapter] = [llama.ADAPTER, mistral.ADAPTER, qwen2.ADAPTER, qwen3.ADAPTER, gemma2.ADAPTER,
                                gemma3.ADAPTER, gemma3.MULTIMODAL, phi3.ADAPTER, mixtral.ADAPTER, qwen2_moe.QWEN2_MOE, qwen2_moe.QWEN3_MOE]
_BY_TYPE = {t: a for a in _FAMILIES for t in a.model_types}
GUIDE = "docs/adding-a-family.md"


def supported_model_types() -> list[str]:
    return sorted(_BY_TYPE)


def adapter_for(model_type: str) -> ArchAdapter:
    try:
        return _BY_TYPE[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported; supported: {', '.join(supported_model_types())} "
            f"(adding one: {GUIDE})") from None


__all__ = ["ArchAdapter", "InputGroup", "adapter_for", "supported_model_types"]
