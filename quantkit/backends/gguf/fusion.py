"""Fused CPU kernels for the encoders' hot loops, built ahead of time by torch's AOTInductor.

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
every sum is written as explicit left-to-right additions.  Still, a kernel is
used only after it reproduced the eager function bit for bit on real input in
this process; otherwise (no C++ compiler, an unsupported torch, a different
result) the eager function runs.

Each (function, constants, shapes but the number of blocks) is exported once
(torch.export, the blocks dimension symbolic) and built by AOTInductor into a
package in quantkit's cache, keyed by torch version, this CPU, and the
encoders' source: one kernel serves every chunk of every model.  Later
processes load the package's shared library in milliseconds: no tracing and no
Inductor start-up, which cost torch.compile 3-4 s in every process.
QUANTKIT_COMPILE=0 always runs eagerly; =1 builds missing kernels from the
first call; the default (auto) uses the kernels already built and builds
missing ones only when the planned conversion is large enough for that to pay
(see plan_work).  CUDA runs eagerly: its kernels
are already fused enough, and Triton's float division is not guaranteed to be
correctly rounded.

Building costs 10-100 s per kernel on 2 cores (the candidate-search runs are the
long ones; once ~8 s more for Inductor's CPU probe); a K-quant file type uses
4-9 kernels.  quantkit ships them built for x86-64 CPUs with AVX2 (see SHIPPED),
so on those only another torch or changed encoders build anything.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch

__all__ = ["fused", "compile_mode", "plan_work", "will_compile", "would_compile", "missing_kernels", "prebuild",
           "build_workers", "build_seconds", "AUTO_MIN_ELEMENTS", "BUILD_SECONDS"]

log = logging.getLogger("quantkit")


# Building a kernel costs 10-100 s (2 cores), once per machine where the shipped
# set does not serve, so by default (QUANTKIT_COMPILE=auto) missing kernels are
# built only when the planned run encodes at least this many elements in fused
# types: about 10 s of eager work, and more for every later run.
# Kernels built earlier are used by every run.  Which path runs changes the
# speed, never the bytes.
AUTO_MIN_ELEMENTS = 100_000_000
_planned_elements = 0
# what each round of building (one kernel per core) adds to a first run on a 2-core machine, for the dry run's
# time estimate (measured: bench/results/gguf_cold_start.md, the own-build cold run against the warm one)
BUILD_SECONDS = 35.0
_ALL: list = []           # every fused function, for missing_kernels()


def plan_work(elements: int) -> bool:
    """Tell the auto mode how many elements the run will encode in FUSED_TYPES;
    returns whether missing kernels will be built."""
    global _planned_elements
    _planned_elements = int(elements)
    return will_compile()


def will_compile() -> bool:
    return would_compile(_planned_elements)


def would_compile(elements: int) -> bool:
    """Whether a run encoding `elements` weights in FUSED_TYPES builds the kernels it lacks."""
    mode = compile_mode()
    return mode == "always" or (mode == "auto" and elements >= AUTO_MIN_ELEMENTS)


_OFF = ("0", "false", "no", "off", "never")


def _switched_off(variable: str) -> bool:
    return os.environ.get(variable, "").strip().lower() in _OFF


def compile_mode() -> str:
    """QUANTKIT_COMPILE: 0 = never, 1 = from the first call, auto (default) = once the work pays."""
    if _switched_off("QUANTKIT_COMPILE"):
        return "never"
    v = os.environ.get("QUANTKIT_COMPILE", "auto").strip().lower()
    if v in ("1", "true", "yes", "on", "always"):
        return "always"
    return "auto"


# A kernel is built for its function's constants and every dimension of its
# tensors except the last, the blocks, which stays symbolic: one kernel serves
# every chunk size of every model (a full chunk's, a tensor's last chunk's,
# Q3_K's shrinking active sets), so a run builds one kernel per function and
# specialization, not one per shape.  It is built for at least _MIN_COLUMNS
# blocks (fewer would leave its threads too little to share); a call with fewer
# runs it on padded blocks (_Fused._few).
_MIN_COLUMNS = 64


def _kernel_shape(m: int) -> bool:
    return m >= _MIN_COLUMNS


# One step is a few hundred point-wise nodes; Inductor's default cap on a
# fused kernel (64 nodes) would cut it into loops that store and reload
# intermediate rows.  Without emulate_precision_casts Inductor drops the
# float32 -> float16 -> float32 round trips that ggml's fp16 scales need
# (the bit check caught that).
_INDUCTOR_OPTIONS = {"max_fusion_size": 1 << 16, "emulate_precision_casts": True}


@functools.cache
def _source_key() -> str:
    """What every built kernel depends on besides the machine: torch, Inductor's options and the source of the
    fused functions."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in ("fusion.py", "encoders.py", "exact.py", "neighbours.py", "iq1_splits.py", "grid_encoders.py"):
        h.update((here / f).read_bytes())
    h.update(f"{torch.__version__}|{_INDUCTOR_OPTIONS}|{_PORTABLE}|{_PORTABLE_ISA}".encode())
    return h.hexdigest()[:16]


@functools.cache
def _cpu_description() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            lines = fh.read().splitlines()
        return "|".join(next((ln for ln in lines if ln.startswith(k)), "") for k in ("model name", "flags", "Features"))
    except OSError:
        return platform.processor()


@functools.cache
def _machine_key() -> str:
    """What a kernel built here depends on besides its function: this CPU (kernels are built with
    -march=native) and the thread count baked into the loops' schedule."""
    h = hashlib.sha256(f"{_source_key()}|{platform.machine()}|{_cpu_description()}|{os.cpu_count()}".encode())
    return h.hexdigest()[:16]


# The kernels quantkit ships (quantkit/backends/gguf/kernels, built by `make kernels`): a first run on a new
# machine would otherwise spend a minute or two building them.  They are built for any x86-64 CPU with AVX2
# (x86-64-v3: -march and Inductor's vector ISA) with the thread count read when they run, so one build serves
# every such machine (measured: as fast as a -march=native AVX-512 build or faster).  Where it has the kernel,
# it comes before the machine's own build; other CPUs, or another torch, build their own as before.
SHIPPED = Path(__file__).resolve().parent / "kernels"
_PORTABLE = {"cpp.march": "x86-64-v3", "cpp.dynamic_threads": True}
_PORTABLE_ISA = "avx2"                # ATEN_CPU_CAPABILITY, which Inductor reads once per process
_PORTABLE_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})  # x86-64-v3


def shipped_dir() -> Path:
    return SHIPPED / f"torch-{torch.__version__.split('+')[0]}-{_source_key()}"


def _use_shipped() -> bool:
    """Whether the shipped set is looked at: QUANTKIT_SHIPPED_KERNELS=0 leaves it aside (a benchmark's cold
    start without it), and so does a CPU that cannot run it."""
    return not _switched_off("QUANTKIT_SHIPPED_KERNELS") and _runs_shipped()


@functools.cache
def _runs_shipped() -> bool:
    """Whether this CPU runs the shipped kernels' instructions (a missing one would crash, not fail a check)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = next((ln.split(":", 1)[1].split() for ln in _cpu_description().split("|") if ln.startswith("flags")), [])
    return _PORTABLE_FLAGS <= set(flags)


def kernel_dir() -> Path:
    """Where built kernels live: $QUANTKIT_KERNEL_DIR (a CI cache, a benchmark's fresh start), else the
    cache's kernels/ folder; one subfolder per machine key."""
    from ...model.source import cache_dir
    base = Path(os.environ["QUANTKIT_KERNEL_DIR"]) if os.environ.get("QUANTKIT_KERNEL_DIR") else \
        cache_dir() / "kernels"
    return base / f"torch-{torch.__version__.split('+')[0]}-{_machine_key()}"


_TENSOR = object()          # a tensor argument's slot in _Graph's template


class _Graph(torch.nn.Module):
    """fn with its non-tensor arguments fixed: the module that is exported."""

    def __init__(self, fn: Callable, template: tuple):
        super().__init__()
        self.fn, self.template = fn, template

    def forward(self, *tensors):
        it = iter(tensors)
        return self.fn(*(next(it) if a is _TENSOR else a for a in self.template))


# torch's C++ package loader (absent from some builds: then everything runs eagerly)
_LOADER = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
_build_failed = False     # one failed build (no C++ compiler, ...) stops further attempts in this process
_wanted: dict | None = None   # while prebuild's probe runs: package path -> (fused function, example arguments)
_shipping = False             # while ship() runs: kernels are looked for (and built) in the shipped set only


def _may_build() -> bool:
    return not _build_failed and will_compile()


class _Kernel:
    """A loaded AOTInductor package: called with the tensor arguments, returns
    the function's output structure (a tensor or a tuple of tensors)."""

    def __init__(self, path: Path):
        # the C++ loader: the Python wrapper (torch._inductor.aoti_load_package)
        # imports Inductor and costs ~1.5 s per process
        self.runner = _LOADER(str(path), "model", False, 1, -1)

    def __call__(self, args):
        out = self.runner.run([a for a in args if isinstance(a, torch.Tensor)])
        return out[0] if len(out) == 1 else tuple(out)


def _ends_in_blocks(t: torch.Tensor, m: int) -> bool:
    """Whether t's last dimension is the m blocks (a table's length is not)."""
    return t.dim() > 0 and t.shape[-1] == m


def _shape(t: torch.Tensor, m: int) -> tuple:
    """t's shape with its blocks dimension made symbolic."""
    return tuple(t.shape[:-1]) + ("blocks",) if _ends_in_blocks(t, m) else tuple(t.shape)


def _build(fn: Callable, args: tuple, path: Path, portable: bool = False) -> None:
    """Export fn for these constants and shapes, the last dimension symbolic, and build it into a package at
    path; `portable`: for the shipped set (the process runs with ATEN_CPU_CAPABILITY set to _PORTABLE_ISA)."""
    import torch._inductor
    import torch._inductor.config
    template = tuple(_TENSOR if isinstance(a, torch.Tensor) else a for a in args)
    tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    blocks = torch.export.Dim("blocks", min=_MIN_COLUMNS)
    m = args[0].shape[-1]
    dynamic = tuple({t.dim() - 1: blocks} if _ends_in_blocks(t, m) else None for t in tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(_Graph(fn, template), tensors, dynamic_shapes=(dynamic,), strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)   # another process may build it too
        os.close(fd)
        try:
            with torch._inductor.config.patch(_PORTABLE if portable else {}):
                # a copy of the options: it adds keys
                torch._inductor.aoti_compile_and_package(ep, package_path=tmp, inductor_configs=dict(_INDUCTOR_OPTIONS))
            if portable:
                _strip_libraries(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _strip_libraries(package: str) -> None:
    """Drop the symbol tables from a package's shared libraries (a shipped kernel: 1.7 MB -> 0.4 MB); the
    package stays an uncompressed zip, which is what torch's loader reads.  Without `strip`, left as it is."""
    import shutil
    import zipfile
    if shutil.which("strip") is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(package) as z:
            entries = [(info, z.read(info)) for info in z.infolist()]
        out = []
        for info, data in entries:
            if info.filename.endswith(".so"):
                lib = Path(tmp) / "lib.so"
                lib.write_bytes(data)
                subprocess.run(["strip", "--strip-unneeded", str(lib)], check=True, capture_output=True)
                data = lib.read_bytes()
            out.append((info, data))
        with zipfile.ZipFile(package, "w", zipfile.ZIP_STORED) as z:
            for info, data in out:
                z.writestr(info, data)


class _Fused:
    """Callable that runs `fn` as a built kernel on CPU tensors.  The first call
    of each specialization loads (or builds) its kernel; the first call with a
    whole number of vectors of blocks and the first without (the kernel's loop
    tail) run both the eager function and the kernel, which is kept only if the
    two agree bit for bit; anything else (no C++ compiler, an unsupported torch,
    a different result, too few blocks) runs eagerly.  The tensors' last
    dimension is the blocks (when its size is the first tensor's last one)."""

    def __init__(self, fn: Callable, eager: Callable | None = None):
        _ALL.append(self)
        self.fn = fn
        # what runs without a kernel; by default fn itself, else a vectorized
        # formulation of the same step that runs faster op by op
        self.eager = eager or fn
        self.kernels: dict = {}         # specialization -> _Kernel, or None (refused / unavailable)
        self.checked: set = set()       # (specialization, tail?) already held to the eager result
        self.absent: set = set()        # specializations with no package, while building is off
        # argument layouts (shapes, strides, dtypes, constants) whose kernel is loaded and checked -> (kernel,
        # specialization): such a call skips the bookkeeping below, which cost ~15 % of a kernel's run time
        self.ready: dict = {}

    @property
    def verdict(self) -> dict:
        """specialization -> was a kernel accepted?"""
        return {k: v is not None for k, v in self.kernels.items()}

    @staticmethod
    def _key(args) -> tuple:
        return tuple((_shape(a, args[0].shape[-1]), a.dtype) if isinstance(a, torch.Tensor) else ("v", a)
                     for a in args)

    def _path(self, spec: tuple, folder: Path) -> Path:
        name = f"{self.fn.__module__}.{self.fn.__qualname__}|{spec}"
        return folder / f"{self.fn.__name__}-{hashlib.sha256(name.encode()).hexdigest()[:16]}.pt2"

    def _load(self, args, spec) -> tuple:
        """(kernel or None, settled?).  Not settled: no package and building is
        off, so a later forced or large run may still build it."""
        global _build_failed
        if _LOADER is None:
            return None, True
        shipped = self._path(spec, shipped_dir())
        path = shipped if _shipping else self._path(spec, kernel_dir())
        try:
            # the shipped kernel first: on the one machine measured, a whole run was ~20 % faster with it than
            # with one built there for -march=native (bench/results/gguf_cold_start.md)
            if not _shipping and _use_shipped() and shipped.exists():
                path = shipped
            if not path.exists():
                if not _may_build():
                    return None, False
                if _wanted is not None:         # prebuild's probe: its workers build it
                    _wanted.setdefault(path, (self, args))
                    return None, False
                try:
                    _build(self.fn, args, path)
                except Exception:
                    _build_failed = True
                    raise
            try:
                return _Kernel(path), True
            except Exception:           # a damaged package file: drop it, a later large run rebuilds it
                if not path.is_relative_to(SHIPPED):     # what was installed stays as installed
                    path.unlink(missing_ok=True)
                raise
        except Exception:               # no C++ compiler, unsupported torch, ...: stay eager
            return None, True

    def __call__(self, *args):
        if not isinstance(args[0], torch.Tensor) or args[0].device.type != "cpu" or compile_mode() == "never":
            return self.eager(*args)
        if not _kernel_shape(args[0].shape[-1]):
            return self._few(args)
        layout = tuple((a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        ready = self.ready.get(layout)
        if ready is not None:
            return ready[0](args)
        # the kernels were built for contiguous inputs
        contiguous = all(a.is_contiguous() for a in args if isinstance(a, torch.Tensor))
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        spec = self._key(args)
        if spec not in self.kernels:
            if spec in self.absent and not _may_build():
                return self.eager(*args)
            kernel, settled = self._load(args, spec)
            if not settled:
                self.absent.add(spec)
                return self.eager(*args)
            self.absent.discard(spec)
            self.kernels[spec] = kernel
        kernel = self.kernels[spec]
        if kernel is None:
            return self.eager(*args)
        check = (spec, args[0].shape[-1] % _VECTOR_BLOCKS != 0)
        if check in self.checked:
            if contiguous:
                if len(self.ready) >= 256:      # block counts seen: a few per tensor shape
                    self.ready.clear()
                self.ready[layout] = (kernel, spec)
            return kernel(args)
        self.checked.add(check)
        want = self.eager(*args)
        try:
            got = kernel(args)
        except Exception:
            got = None
        if not _bits_equal(want, got):
            self.kernels[spec] = None
            self.ready = {k: v for k, v in self.ready.items() if v[1] != spec}
        return want

    def _few(self, args):
        """A call with fewer blocks than a kernel takes: the blocks are independent lanes, so once this
        specialization's kernel is loaded and checked it runs on the blocks padded with copies of the last one
        to _MIN_COLUMNS, and the copies' results are dropped; else the eager function.  Q3_K's last
        coordinate-descent passes leave a few groups of a chunk: the position-by-position eager ops took
        2.95 ms on 8 groups, the kernel 3.3 ms on all 65536 of the first pass (4096 blocks, 2026-12-06)."""
        m = args[0].shape[-1]
        if m == 0:
            return self.eager(*args)
        padded = tuple(_pad_blocks(a, m) if isinstance(a, torch.Tensor) else a for a in args)
        spec = self._key(padded)
        kernel = self.kernels.get(spec)
        if kernel is None or (spec, False) not in self.checked:
            return self.eager(*args)
        out = kernel(padded)
        return tuple(_unpad_blocks(t, m) for t in out) if isinstance(out, tuple) else _unpad_blocks(out, m)


def _pad_blocks(t: torch.Tensor, m: int) -> torch.Tensor:
    """t with its blocks (its last dimension, when that is m long) padded to _MIN_COLUMNS by repeating the
    last one; contiguous, as the kernels were built for."""
    if not _ends_in_blocks(t, m):
        return t.contiguous()
    return torch.cat([t, t[..., -1:].expand(*t.shape[:-1], _MIN_COLUMNS - m)], -1)


def _unpad_blocks(t: torch.Tensor, m: int) -> torch.Tensor:
    return t[..., :m] if _ends_in_blocks(t, _MIN_COLUMNS) else t


# blocks in a whole number of any CPU's float vectors (AVX-512: 16 lanes): calls with such a count and calls
# without run different loop code in a kernel, so the first call of each kind is checked
_VECTOR_BLOCKS = 64


def prebuild(probe: Callable[[], None], portable: bool = False) -> int:
    """Build the kernels a run will build, before it starts, in parallel processes (one per core): `probe`
    encodes a sample of each type the run encodes, which records the kernels it lacks instead of building
    them.  Each build is one core's work (tracing, code generation, a compiler), so the cores build side by
    side what the run would otherwise build one at a time between its encodes.  Returns the number built;
    any a worker could not build are built (or refused) by the run itself, as without prebuild.  `portable`:
    the workers build the shipped set's kind (ship())."""
    global _wanted
    if _LOADER is None or not _may_build():
        return 0
    _wanted = {}
    try:
        probe()
    finally:
        wanted, _wanted = _wanted, None
    if not wanted:
        return 0
    workers = min(len(wanted), build_workers())
    log.info(f"building {len(wanted)} fused CPU kernels for this machine, {workers} at a time (once per machine)")
    # one compiler at a time per worker: Inductor's own compile pool would only add processes to start
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    if portable:
        env["ATEN_CPU_CAPABILITY"] = _PORTABLE_ISA
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            for i in range(workers):
                share = [(f.fn.__module__, f.fn.__name__, args, str(path), portable)
                         for path, (f, args) in list(wanted.items())[i::workers]]
                job = Path(tmp) / f"job{i}.pt"
                torch.save(share, job)
                procs.append(subprocess.Popen([sys.executable, "-m", __name__, str(job)], env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for proc in procs:
                proc.wait()
        finally:                # interrupted: no worker outlives the run (a package is renamed into place whole)
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return sum(1 for path in wanted if path.exists())


def _build_jobs(job: str) -> None:
    """A prebuild worker: build each (module, function, example arguments, path, portable?) of the job file."""
    torch.set_num_threads(1)
    for module, name, args, path, portable in torch.load(job, weights_only=True):
        _build(getattr(importlib.import_module(module), name).fn, args, Path(path), portable)


def ship(probe: Callable[[], None]) -> tuple[int, int]:
    """Build the shipped set (`make kernels`): every kernel `probe` wants that the set for this torch and source
    lacks, portable, in worker processes; sets for other sources or torch versions are removed.  Returns
    (built, wanted)."""
    global _shipping, _wanted
    import shutil
    os.environ["QUANTKIT_COMPILE"] = "1"
    for old in SHIPPED.glob("torch-*"):
        if old != shipped_dir():
            shutil.rmtree(old)
    _shipping = True
    try:
        built = prebuild(probe, portable=True)
        _wanted = {}
        try:
            probe()
        finally:
            wanted, _wanted = _wanted, None
    finally:
        _shipping = False
    return built, built + len(wanted)


def build_workers() -> int:
    """How many kernels prebuild builds at a time: one per core."""
    return max(1, os.cpu_count() or 1)


def build_seconds(kernels: int) -> float:
    """What building this many kernels adds to a run."""
    return -(-kernels // build_workers()) * BUILD_SECONDS


def missing_kernels() -> int:
    """Kernels this process has wanted and found neither loaded nor built (calls ran eagerly instead): after a
    dry run's probe of the encoders on full chunks, the ones a real run would build.  Full chunks have the same
    shapes whatever the model, so the probe wants the kernels the run will."""
    return sum(len(f.absent) for f in _ALL)


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
    """Decorator: run the function as a built kernel on CPU tensors (see module
    docstring).  `eager`: an equivalent vectorized function to run without a
    kernel; the bit-for-bit check then also holds the two formulations to each other."""
    if fn is None:
        return lambda f: _Fused(f, eager)
    return _Fused(fn, eager)


if __name__ == "__main__":
    _build_jobs(sys.argv[1])
