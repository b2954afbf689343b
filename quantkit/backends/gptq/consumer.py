"""transformers + GPTQModel as the consumer of a GPTQ folder: load it the way users do and return logits,
for `quantkit eval FOLDER --runtime transformers` and the consumer tests."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ...errors import DependencyError, SourceError
from .reader import read_quantization_config


def pick_backend(folder: Path, dtype: torch.dtype) -> str:
    """GPTQModel's plain torch kernel takes any shape and float32; its default CPU kernel wants in-features
    divisible by 128 and half precision."""
    from .reader import GPTQCheckpoint
    if dtype == torch.float32:
        return "torch"
    ckpt = GPTQCheckpoint(folder)
    for e in ckpt.weights.entries.values():
        if e.name.endswith(".g_idx") and e.shape[0] % 128:
            return "torch"
    return "auto"


def load(folder: Path, backend: str | None = None, dtype=torch.float32):
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, os.cpu_count() or 1)))
    try:
        import gptqmodel  # noqa: F401  (transformers needs it to load GPTQ on any device)
        from transformers import AutoModelForCausalLM, GPTQConfig
    except ImportError as e:
        raise DependencyError(f"loading GPTQ in transformers needs gptqmodel and optimum ({e}); "
                              f"pip install --no-deps gptqmodel, plus its requirements") from None
    q = read_quantization_config(folder)
    if q is None:
        raise SourceError(f"{folder}: not a GPTQ checkpoint")
    config = GPTQConfig(bits=q["bits"], group_size=q["group_size"], desc_act=q.get("desc_act", False),
                        sym=q.get("sym", True), format=q.get("format", "gptq"), act_group_aware=False,
                        block_name_to_quantize=q.get("block_name_to_quantize"),
                        backend=backend or pick_backend(folder, dtype))
    from .reader import GPTQCheckpoint
    if GPTQCheckpoint(folder).has_experts:
        # transformers 5 fuses each layer's experts into one 3D tensor and cannot take per-expert quantized
        # linears (it would start them from random values); GPTQModel's own loader splits the experts again
        # (its torch kernel computes in half precision only: float32 is asked for as float16)
        from gptqmodel import GPTQModel
        half = torch.float16 if dtype == torch.float32 else dtype
        model = GPTQModel.load(str(folder), device="cpu", dtype=half, backend=config.backend).model
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu", dtype=dtype,
                                                     quantization_config=config)
    model.eval()
    return model


@torch.no_grad()
def window_logits(folder: Path, tokens: torch.Tensor, backend: str | None = None, dtype=torch.float32,
                  kv_cache: str | None = None):
    """Yield each window's logits (ctx, vocab) computed by transformers + GPTQModel (with `kv_cache`, fed through
    that K/V cache: quantkit.eval.transformers_cache).

    float32 by default, so a comparison with quantkit's reader is about the weights: on the demo, half
    precision activations alone move 0.3 % (fp16) to 2.4 % (bf16) of top-1 predictions (measured)."""
    model = load(Path(folder), backend, dtype)
    if kv_cache is not None:
        from ...eval import transformers_cache
        yield from transformers_cache.window_logits(model, tokens, kv_cache)
        return
    # GPTQModel's torch kernel recompiles for every layer shape (minutes on a small model); eager is exact.
    with torch.compiler.set_stance("force_eager"):
        for row in tokens:
            yield model(row[None]).logits[0].float()
