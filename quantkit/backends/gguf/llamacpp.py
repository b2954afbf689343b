"""llama.cpp as the reference consumer of GGUF files, through llama-cpp-python (optional).

Used to check quantkit's files in the runtime that will load them: logits for
the evaluation harness, and llama.cpp's own quantizer for byte comparisons.
"""
from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import torch

from ...errors import DependencyError, SourceError


def load_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise DependencyError("llama.cpp is not installed: pip install 'quantkit[llamacpp]'") from e
    return llama_cpp


def available() -> bool:
    try:
        load_llama_cpp()
        return True
    except DependencyError:
        return False


def quantize(src: Path, dst: Path, file_type: int, threads: int | None = None,
             imatrix: dict[str, np.ndarray] | None = None, overrides=(), pure: bool = False) -> None:
    """llama-quantize SRC DST FTYPE: llama.cpp's own quantizer, weighted by `imatrix` (GGUF weight name -> the
    vector llama-quantize reads from an imatrix file) when given; `overrides`: --tensor-type (pattern, type
    name) pairs, `pure`: --pure."""
    import ctypes

    lc = load_llama_cpp()
    params = lc.llama_model_quantize_default_params()
    params.ftype = int(file_type)
    params.nthread = threads or os.cpu_count() or 1
    keep = []                                   # the buffers the C side reads, alive until it returns
    if imatrix:
        entries = (lc.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, vector) in enumerate(imatrix.items()):
            data = np.ascontiguousarray(vector, dtype=np.float32)
            keep += [name.encode(), data]
            entries[i].name, entries[i].size = keep[-2], data.size
            entries[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[len(imatrix)].name = None       # the list ends at a null name
        keep.append(entries)
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(lc.llama_model_imatrix_data))
    if overrides:
        rules = (lc.llama_model_tensor_override * (len(overrides) + 1))()
        for i, (pattern, type_name) in enumerate(overrides):
            keep.append(pattern.lower().encode())          # llama-quantize lower-cases the pattern
            rules[i].pattern, rules[i].type = keep[-1], int(gguf.GGMLQuantizationType[type_name.upper()])
        rules[len(overrides)].pattern = None               # a null pattern ends the list
        keep.append(rules)
        params.tt_overrides = ctypes.cast(rules, ctypes.POINTER(lc.llama_model_tensor_override))
    params.pure = pure
    rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise SourceError(f"llama.cpp failed to quantize {src} (code {rc})")


def window_logits(path: Path, tokens: torch.Tensor, threads: int | None = None, kv_cache: str | None = None):
    """Yield llama.cpp's logits (ctx, vocab) for each window, each evaluated from an empty context.
    `kv_cache` (a name of quantkit.eval.kv_cache.LLAMACPP_TYPES) keeps K and V in that type, with flash
    attention (which llama.cpp's quantized V cache needs); None: llama.cpp's defaults."""
    lc = load_llama_cpp()
    ctx = tokens.shape[1]
    cache = {}
    if kv_cache is not None:
        from ...eval.kv_cache import ggml_type
        cache = {"type_k": int(ggml_type(kv_cache)), "type_v": int(ggml_type(kv_cache)), "flash_attn": True}
    try:
        model = lc.Llama(str(path), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, verbose=False,
                         n_threads=threads or os.cpu_count() or 1, **cache)
    except ValueError as e:
        raise SourceError(f"{path}: llama.cpp cannot load this file ({e})") from None
    try:
        for window in tokens.tolist():
            model.reset()
            model.eval(window)
            yield torch.from_numpy(np.array(model.scores[:ctx], dtype=np.float32))
    finally:
        model.close()
