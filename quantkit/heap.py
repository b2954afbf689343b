"""Giving freed memory back to the system between layers, and starting a process with the heap it will run on.

A calibrated pass frees and reallocates the same few hundred megabytes every layer (hidden-state batches,
per-expert activations, candidate weights).  glibc's malloc serves blocks under its mmap threshold — which it
raises to 32 MiB as large blocks are freed — from its heap, and a heap that fragments keeps the freed pages:
measured on a 4-layer synthetic mixtral (8 experts, hidden 1024), the resident set of an AWQ run grew to 2.70 GiB
around 0.74 GiB of live tensors, an EXL2 run's to 8.2 GiB around ~1.5 GiB.  malloc_trim(0) hands every free page
back (the heap's middle included, since glibc 2.8); called after every layer it brought the EXL2 run to 3.26
GiB and the AWQ run to 2.18 GiB, their wall times unchanged (458 / 453 s, 80 / 81 s).  Called after each stage's
walk as well, the demo's GGUF --imatrix run, bimodal at 0.57 or 0.73 GiB (three runs: 0.73, 0.57, 0.57), peaked
at 0.56-0.62 GiB in four runs, for 24-27 s of wall time against 23-24 s (the pages given back are faulted in again
by the next stage; a small model pays most for that, relative to its work).  Fixing the threshold instead
(MALLOC_MMAP_THRESHOLD_) kept the AWQ run at 1.5 GiB but made it 1.8x slower: every block then comes from fresh,
zero-filled pages.

A trim is not free: it walks the heap, and the pages it hands back are faulted in again (zero-filled) by the
next stage that allocates as much.  Asked for after each of the demo's 150 stages and 272 tensors, trims made its
GGUF --imatrix run 25.6 s against 20.2-20.7 s without them (2026-12-05).  So a release trims only when the
resident set stands GROWTH above where the last trim left it (read from /proc/self/statm, ~20 µs): on the demo
72-85 trims instead of 230-238, 22.8-23.4 s, peak 0.65-0.66 GiB against 0.61-0.62 with every trim and 0.57-0.92
with 1-6 trims (the heap is bimodal: whether it reuses a stage's freed blocks differs from run to run).

A fresh process starts with glibc's mmap threshold at 128 KiB: every tensor above it is mapped, zero-filled page
by page and unmapped on free, until the first freed block raises the threshold (to at most 32 MiB).  The work of a
process's first seconds therefore ran slower than the same work later: timed first in a fresh process, the demo's
EXL2 probes came out 1.3-1.5x above the same probes a few seconds later (407 s against 258-272 s of estimated own
work; the run itself measured 274 s, so dry runs overestimated by 1.4-1.5x).  `warm_start` maps and frees one
block just under that cap, so a process runs from its start with the threshold its work would soon give it
(the estimate, timed first: 208 s against 211-229 s after it).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys


@functools.cache
def _glibc():
    """glibc, or None (another system, or a C library without malloc_trim such as musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim
    except (OSError, AttributeError):
        return None
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    return libc


def _malloc_trim():
    libc = _glibc()
    return None if libc is None else libc.malloc_trim


# how far the resident set may rise above where the last trim left it before a release trims again: above one
# demo stage's temporaries (~100 MiB, which 64 MiB made every release trim), far below the 0.3-0.5 GiB a heap
# that does not reuse them keeps
GROWTH = 128 * 2**20
_last_trim = {"rss": None}     # the resident set right after the last trim


# glibc raises the mmap threshold to the size of a freed mapped block up to 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX on
# 64-bit systems); a block of this size (plus malloc's header) stays under it
_WARM_BLOCK = 31 * 2**20


@functools.cache
def warm_start() -> None:
    """Raise the C heap's mmap threshold the way a running process's work soon would, once per process (see the
    module docstring); a no-op outside glibc."""
    libc = _glibc()
    if libc is None:
        return
    block = libc.malloc(_WARM_BLOCK)
    if block:
        libc.free(block)


def resident_bytes() -> int | None:
    """This process's resident set in bytes (/proc/self/statm), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_free_memory() -> None:
    """Return the C heap's free pages to the system (glibc) when the resident set stands GROWTH above where the
    last trim left it (always, where it cannot be read); a no-op elsewhere."""
    trim = _malloc_trim()
    if trim is None:
        return
    rss, level = resident_bytes(), _last_trim["rss"]
    if rss is not None and level is not None and rss < level + GROWTH:
        return
    trim(0)
    _last_trim["rss"] = resident_bytes()
