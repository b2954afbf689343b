"""One settling call to the vector math library before any real work, so that every process computes the same
cos, sin, exp … to the last bit.

torch's CPU wheels compute cos, sin, exp, log, erf … of float tensors with MKL's vector math library (ATen's
cpu/vml.h, in builds with MKL), which sets itself up on its first call.  When that first call comes from two
OpenMP threads at once (a tensor big enough for torch to split), the set-up can end differently from one process
to the next, and the process then keeps last-bit-different results for every later call.  Measured here (torch 2.13, MKL
2024.2): after a Cholesky factorisation, the RoPE cos table of the demo model came out other in 11 of 40 fresh
processes; with one call on a tiny tensor first (torch runs it on the calling thread alone), in 0 of 40, and
warming sin alone also settled cos.  A resumed run met this at its first layer (GPTQ's Cholesky, then the first
RoPE table), so a run killed and resumed sometimes ended with other bytes than an uninterrupted one.
"""
from __future__ import annotations

import torch

def settle() -> None:
    """Make the vector math library's first call from one thread (cheap; later calls change nothing)."""
    torch.sin(torch.zeros(8, dtype=torch.float32))   # below torch's parallel grain: runs on this thread
