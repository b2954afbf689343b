"""transformers + bitsandbytes as the consumer of a bnb folder: `from_pretrained(folder)` as a user loads it (the
quantization_config comes from config.json), for `quantkit eval --runtime transformers` and the consumer tests."""
from __future__ import annotations

from pathlib import Path

import torch

from ...errors import DependencyError


def load(folder: Path, exact: bool = False):
    """The model as transformers loads it.  exact=True keeps bitsandbytes' weights but computes in float32: 4-bit
    linears dequantize (bitsandbytes' own dequantize_4bit) and multiply in float32 instead of taking the CPU's
    bfloat16 kernel, so a comparison with quantkit's reader is about the weights, not the activations' rounding
    (bfloat16 alone moves ~3 % of the demo's top-1 predictions: measured).  LLM.int8 linears quantize their inputs
    to int8 whatever the setting: that is the algorithm."""
    try:
        import bitsandbytes as bnb
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise DependencyError(f"loading a bnb checkpoint needs bitsandbytes ({e}); pip install 'quantkit[bnb]'") from None
    model = AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu")
    if exact:
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                module.compute_dtype = torch.float32
                module.support_avx512bf16_for_cpu = False   # the CPU's repacked bfloat16 kernel
        # transformers loads a bnb model in its config's dtype whatever `dtype=` says and refuses .to(); the
        # unconverted tensors (embeddings, norms, skipped linears) are cast in place
        for param in model.parameters():
            if param.dtype in (torch.bfloat16, torch.float16):
                param.data = param.data.float()
    model.eval()
    return model


@torch.no_grad()
def window_logits(folder: Path, tokens: torch.Tensor, exact: bool = False, kv_cache: str | None = None):
    """Yield each window's logits (ctx, vocab) from transformers + bitsandbytes.  With `kv_cache` the window is
    fed through that K/V cache, computing in float32 (exact) so that the cache types compare at one precision."""
    if kv_cache is not None:
        from ...eval import transformers_cache
        yield from transformers_cache.window_logits(load(Path(folder), exact=True), tokens, kv_cache)
        return
    model = load(Path(folder), exact)
    for row in tokens:
        yield model(row[None]).logits[0].float()
