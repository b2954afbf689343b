"""transformers + GPTQModel as the consumer of an AWQ folder: load it the way users do and return logits,
for `quantkit eval FOLDER --runtime transformers` and the consumer tests."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ...errors import DependencyError, SourceError
from .reader import AWQCheckpoint, read_quantization_config


def load(folder: Path, dtype=torch.float32):
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, os.cpu_count() or 1)))
    try:
        import gptqmodel  # noqa: F401  (transformers loads AWQ through GPTQModel's kernels)
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise DependencyError(f"loading AWQ in transformers needs gptqmodel ({e}); pip install --no-deps "
                              f"gptqmodel, plus its requirements") from None
    if read_quantization_config(folder) is None:
        raise SourceError(f"{folder}: not an AWQ checkpoint")
    if AWQCheckpoint(folder).has_experts:
        # transformers 5 fuses each layer's experts into one 3D tensor and cannot take per-expert quantized
        # linears (it would start them from random values); GPTQModel's own loader splits the experts again
        from gptqmodel import GPTQModel
        model = GPTQModel.load(str(folder), device="cpu", dtype=dtype).model
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu", dtype=dtype)
    model.eval()
    return model


@torch.no_grad()
def window_logits(folder: Path, tokens: torch.Tensor, dtype=torch.float32, kv_cache: str | None = None):
    """Yield each window's logits (ctx, vocab) computed by transformers + GPTQModel (float32 by default, so a
    comparison with quantkit's reader is about the weights; with `kv_cache`, fed through that K/V cache)."""
    model = load(Path(folder), dtype)
    if kv_cache is not None:
        from ...eval import transformers_cache
        yield from transformers_cache.window_logits(model, tokens, kv_cache)
        return
    with torch.compiler.set_stance("force_eager"):
        for row in tokens:
            yield model(row[None]).logits[0].float()
