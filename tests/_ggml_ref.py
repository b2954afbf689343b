"""ctypes bridge to llama.cpp's own quantizers (``ggml_quantize_chunk``).

The shared library comes from the ``llama_cpp`` (llama-cpp-python) wheel, which
ships ``libggml-base.so`` under ``site-packages/llama_cpp/lib``.  When that
package is not installed every entry point returns ``None`` and
``unavailable_reason()`` says why, so tests can ``pytest.skip`` cleanly.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from functools import lru_cache

import numpy as np

_LIB_NAMES = {
    "linux": ("libggml-base.so",),
    "darwin": ("libggml-base.dylib",),
    "win32": ("ggml-base.dll",),
}


def _candidate_dirs() -> list[str]:
    dirs = []
    env = os.environ.get("QUANTKIT_GGML_LIB_DIR")
    if env:
        dirs.append(env)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            dirs.append(os.path.join(loc, "lib"))
            dirs.append(loc)
    return dirs


_reason: str | None = None


@lru_cache(maxsize=1)
def _load():
    global _reason
    names = _LIB_NAMES.get(sys.platform, ("libggml-base.so",))
    dirs = _candidate_dirs()
    if not dirs:
        _reason = "llama_cpp (llama-cpp-python) is not installed; no libggml-base to compare against"
        return None
    for d in dirs:
        for n in names:
            p = os.path.join(d, n)
            if os.path.exists(p):
                try:
                    lib = ctypes.CDLL(p)
                except OSError as e:  # pragma: no cover - depends on environment
                    _reason = f"could not load {p}: {e}"
                    continue
                lib.ggml_quantize_chunk.restype = ctypes.c_size_t
                lib.ggml_quantize_chunk.argtypes = [
                    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                ]
                lib.ggml_row_size.restype = ctypes.c_size_t
                lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
                lib.ggml_quantize_init.restype = None
                lib.ggml_quantize_init.argtypes = [ctypes.c_int]
                return lib
    _reason = f"libggml-base not found in {dirs}"
    return None


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str:
    _load()
    return _reason or "reference library unavailable"


def quantize_ref(x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray | None:
    """llama.cpp bytes for a 2-D float32 array, shaped (rows, bytes_per_row).

    Uses ``ggml_quantize_chunk`` (single-threaded, imatrix=NULL unless given),
    exactly as llama-quantize does.  Returns ``None`` if the library is missing.
    """
    lib = _load()
    if lib is None:
        return None
    x = np.ascontiguousarray(x, dtype=np.float32)
    assert x.ndim == 2
    rows, n = x.shape
    t = int(qtype)
    row_size = lib.ggml_row_size(t, n)
    out = np.zeros((rows, row_size), dtype=np.uint8)
    imp = None
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        assert imatrix.shape == (n,)
        imp = imatrix.ctypes.data
    lib.ggml_quantize_init(t)
    written = lib.ggml_quantize_chunk(t, x.ctypes.data, out.ctypes.data, 0, rows, n, imp)
    assert written == rows * row_size, (written, rows, row_size)
    return out
