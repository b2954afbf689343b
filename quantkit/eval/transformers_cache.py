"""Windows run through transformers' own K/V caches, so `quantkit eval FOLDER --runtime transformers --kv-cache
TYPE` shows what the cache's quantization costs on top of the weights'.

One forward of a whole window never reads the cache (each layer attends to the keys it has just computed), so a
cache only matters for tokens that come after it was written.  Each window is therefore fed in chunks of
KV_CHUNK tokens through one cache, as generation feeds it: a chunk attends to the past as the cache keeps it and
to itself exactly.  The baseline (f32) goes through the same chunks with transformers' default DynamicCache,
so the figures differ by the cache alone.  transformers' QuantizedCache keeps its defaults (the way a user's
`generate(cache_implementation="quantized")` runs): int4/int2 are optimum-quanto's groups of 64 with the
128 most recent tokens kept unquantized between re-quantizations; fp8 is one e4m3 scale per layer's K and V.
"""
from __future__ import annotations

import inspect
from typing import Iterator

import torch

from ..errors import DependencyError, UsageError

KV_CHUNK = 32
# --kv-cache name -> QuantizedCache(backend, nbits); f32 is the default cache
_QUANTIZED = {"fp8": ("fp8", None), "int4": ("quanto", 4), "int2": ("quanto", 2)}


def make_cache(model, kind: str):
    from transformers import DynamicCache
    if kind == "f32":
        return DynamicCache()
    backend, nbits = _QUANTIZED[kind]
    try:
        from transformers.cache_utils import QuantizedCache
        return QuantizedCache(backend=backend, config=model.config, **({"nbits": nbits} if nbits else {}))
    except ImportError as e:
        raise DependencyError(f"--kv-cache {kind} in transformers needs optimum-quanto ({e}); "
                              f"pip install optimum-quanto") from None
    except (ValueError, TypeError) as e:   # sliding-window layers; a transformers without this backend
        raise UsageError(f"--kv-cache {kind}: transformers' QuantizedCache refuses this model or is too old "
                         f"here ({str(e).splitlines()[0]})") from None


@torch.no_grad()
def window_logits(model, tokens: torch.Tensor, kind: str) -> Iterator[torch.Tensor]:
    """Each window's logits (ctx, vocab), the window fed in chunks through a fresh cache of type `kind`."""
    with torch.compiler.set_stance("force_eager"):
        for row in tokens:
            yield run_window(model, row, kind)[0]


@torch.no_grad()
def run_window(model, row: torch.Tensor, kind: str):
    """(logits (ctx, vocab), the cache as the window left it): `row` fed KV_CHUNK tokens at a time."""
    # transformers 5 renamed the argument; older releases only know past_key_values
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = make_cache(model, kind)
    parts = [model(row[None, i:i + KV_CHUNK], use_cache=True, **{arg: cache}).logits[0].float()
             for i in range(0, row.shape[0], KV_CHUNK)]
    return torch.cat(parts), cache


def held_bytes(cache) -> int:
    """Bytes of every tensor the cache holds now (quantized payloads with their scales, unquantized residues)."""
    def size(obj) -> int:
        if isinstance(obj, (tuple, list)):
            return sum(size(o) for o in obj)
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):   # quanto's packed tensors
                names, _ = obj.__tensor_flatten__()
                return sum(size(getattr(obj, n)) for n in names)
            return obj.numel() * obj.element_size()
        return 0
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += size(getattr(layer, name, None))
    return total
