"""Fused CPU kernels for the encoders' hot loops, through torch.compile.

The scale searches of the K-quants visit each block 16-37 times with a dozen
element-wise operations per visit.  Run as separate torch ops, every operation
streams the whole chunk through memory (and pays a dispatch), so the encoders
were 2-5x slower than llama.cpp's scalar C.  The search steps are therefore
written position by position over (m,)-shaped rows (all operations point-wise
over the blocks), which lets Inductor fuse one step into a single loop over the
blocks that keeps a block's values in registers.

The fused step is the same torch code as the eager one, and it keeps
llama.cpp's bytes because Inductor compiles C++ without FMA contraction and
without unsafe-math reassociation (torch._inductor.config.cpp defaults), and
every sum is written as explicit left-to-right additions.  Still, a compiled
kernel is used only after it reproduced the eager function bit for bit on its
first real input in this process; otherwise (no C++ compiler, an unsupported Python,
a different result) the eager function runs.  QUANTKIT_COMPILE=0 always runs
eagerly, =1 compiles from the first call, and the default compiles when the
planned conversion is large enough for the compile to pay (see plan_work).  CUDA runs eagerly: its kernels are already fused enough, and
Triton's float division is not guaranteed to be correctly rounded.

Compiling takes 10-25 s per function on 2 cores the first time on a machine;
later processes find the C++ in Inductor's on-disk cache and pay about 0.5 s
per function for tracing, plus ~1.5 s once for Inductor's start-up.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable

import torch

__all__ = ["fused", "compile_mode", "plan_work", "will_compile", "would_compile", "AUTO_MIN_ELEMENTS"]


# Compiling costs seconds (1-2 s per function with a warm on-disk cache plus
# ~1.5 s once per process; 10-25 s per function the first time on a machine),
# so by default (QUANTKIT_COMPILE=auto) the kernels are compiled only when the
# planned run encodes at least this many elements in fused types: about 10 s
# of eager work.  Small conversions (the demo, tests) run eagerly.  Which path
# runs changes the speed, never the bytes.
AUTO_MIN_ELEMENTS = 100_000_000
_planned_elements = 0


def plan_work(elements: int) -> bool:
    """Tell the auto mode how many elements the run will encode in FUSED_TYPES;
    returns whether the fused kernels will be compiled."""
    global _planned_elements
    _planned_elements = int(elements)
    return will_compile()


def will_compile() -> bool:
    return would_compile(_planned_elements)


def would_compile(elements: int) -> bool:
    """Whether a run encoding `elements` weights in FUSED_TYPES compiles the kernels."""
    mode = compile_mode()
    return mode == "always" or (mode == "auto" and elements >= AUTO_MIN_ELEMENTS)


def compile_mode() -> str:
    """QUANTKIT_COMPILE: 0 = never, 1 = from the first call, auto (default) = once the work pays."""
    v = os.environ.get("QUANTKIT_COMPILE", "auto").strip().lower()
    if v in ("0", "false", "no", "off", "never"):
        return "never"
    if v in ("1", "true", "yes", "on", "always"):
        return "always"
    return "auto"


# Kernels are compiled for static shapes (tracing with symbolic shapes costs
# 2-3x more per process).  A chunk of a tensor always has the same shape, so
# per specialization a few shapes are compiled: the first with at least this
# many blocks, then only larger ones (the steady-state chunk is the largest);
# other shapes (a tensor's last, smaller chunk) run eagerly.  (The first input
# is also what Inductor sizes its loops by: a tiny one gives a single-threaded
# kernel, hence the minimum.)
_MIN_COLUMNS = 512
_MAX_SHAPES = 3

# One step is a few hundred point-wise nodes; Inductor's default cap on a
# fused kernel (64 nodes) would cut it into loops that store and reload
# intermediate rows.  Without emulate_precision_casts Inductor drops the
# float32 -> float16 -> float32 round trips that ggml's fp16 scales need
# (the bit check caught that).
_INDUCTOR_OPTIONS = {"max_fusion_size": 1 << 16, "emulate_precision_casts": True}


class _Fused:
    """Callable that runs `fn` compiled on CPU tensors.  The first call of each
    compiled shape runs both the eager and the compiled function and keeps the
    compiled one only if the two agree bit for bit; anything else (no C++
    compiler, an unsupported Python, a different result, an odd shape) runs
    eagerly.  The tensors' last dimension is the blocks."""

    def __init__(self, fn: Callable, eager: Callable | None = None):
        self.fn = fn
        # what runs when nothing is compiled; by default fn itself, else a vectorized
        # formulation of the same step that runs faster op by op
        self.eager = eager or fn
        self.cfn: Callable | None = None
        self.verdict: dict = {}         # full shape key -> compiled ok?
        self.shapes: dict = {}          # specialization -> largest block count compiled

    @staticmethod
    def _key(args, full: bool) -> tuple:
        return tuple((tuple(a.shape) if full else tuple(a.shape[:-1])) + (a.dtype,)
                     if isinstance(a, torch.Tensor) else ("v", a) for a in args)

    def _compile_and_check(self, args):
        want = self.eager(*args)
        try:
            if self.cfn is None:
                import torch._dynamo
                # a few shapes x specializations per function, all wanted
                cfg = torch._dynamo.config
                for name in ("recompile_limit", "cache_size_limit"):
                    if hasattr(cfg, name):
                        setattr(cfg, name, max(getattr(cfg, name), 64))
                self.cfn = torch.compile(self.fn, dynamic=False, options=_INDUCTOR_OPTIONS)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = self.cfn(*args)
        except Exception:               # no C++ compiler, unsupported Python, ...: stay eager
            return False, want
        return _bits_equal(want, got), want

    def __call__(self, *args):
        if not isinstance(args[0], torch.Tensor) or args[0].device.type != "cpu" or not will_compile():
            return self.eager(*args)
        # views would make dynamo guard on their base tensors: hand over plain tensors
        args = tuple(a.clone() if isinstance(a, torch.Tensor) and a._base is not None else a for a in args)
        full = self._key(args, True)
        ok = self.verdict.get(full)
        if ok is None:
            spec = self._key(args, False)
            m = args[0].shape[-1]
            done = self.shapes.get(spec, [])
            if m < _MIN_COLUMNS or len(done) >= _MAX_SHAPES or (done and m <= max(done)):
                return self.eager(*args)
            self.shapes[spec] = done + [m]
            ok, out = self._compile_and_check(args)
            self.verdict[full] = ok
            return out
        return self.cfn(*args) if ok else self.eager(*args)


def _bits_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype == torch.float32:
            a, b = a.view(torch.int32), b.view(torch.int32)
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return (isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(_bits_equal(x, y) for x, y in zip(a, b)))
    return a == b


def fused(fn: Callable | None = None, *, eager: Callable | None = None):
    """Decorator: compile the function for CPU tensors (see module docstring).
    `eager`: an equivalent vectorized function to run when not compiled; the
    bit-for-bit check then also holds the two formulations to each other."""
    if fn is None:
        return lambda f: _Fused(f, eager)
    return _Fused(fn, eager)
