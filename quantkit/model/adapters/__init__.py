"""Architecture adapters: what one decoder layer of a model family is made of.

Adding a family means adding one module here that builds an `ArchAdapter` and
listing it in `_FAMILIES`.
"""
from __future__ import annotations

from ...errors import UnsupportedArchitectureError
from .base import ArchAdapter, InputGroup
from . import llama, qwen

_FAMILIES: list[ArchAdapter] = [llama.ADAPTER, qwen.QWEN2, qwen.QWEN3]
_BY_TYPE = {t: a for a in _FAMILIES for t in a.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_TYPE)


def adapter_for(model_type: str) -> ArchAdapter:
    try:
        return _BY_TYPE[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        ) from None


__all__ = ["ArchAdapter", "InputGroup", "adapter_for", "supported_model_types"]
