"""The fused (AOTInductor-built) CPU path of the GGUF encoders against llama.cpp.

Large conversions run the K-quant searches as compiled kernels (see
quantkit/backends/gguf/fusion.py).  Here building is forced and the input
is large enough for whole chunks, so the compiled kernels really run: their
bytes must equal llama.cpp's, and each fused function must have been compiled
and accepted by its bit-for-bit check against the eager function.
"""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from quantkit.backends.gguf import encoders, fusion  # noqa: E402

try:
    from tests import _ggml_ref as ref  # type: ignore  # noqa: E402
    from tests.test_gguf_encoders import _special_rows  # type: ignore  # noqa: E402
except ImportError:  # pragma: no cover
    import _ggml_ref as ref  # type: ignore  # noqa: E402
    from test_gguf_encoders import _special_rows  # type: ignore  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not ref.available(), reason=ref.unavailable_reason()),
    pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None,
                       reason="no C++ compiler: AOTInductor cannot build CPU kernels here"),
]

# which fused functions each type goes through (without an importance matrix)
_FUSED = {
    QT.Q2_K: ("_qkx_init", "_qkx_search", "_qkx_levels"),
    QT.Q3_K: ("_q3_start", "_q3_pass"),
    QT.Q4_K: ("_qkx_init", "_qkx_search", "_qkx_levels"),
    QT.Q6_K: ("_qx_search",),
    QT.IQ4_NL: ("_iq4_candidate",),
    QT.IQ4_XS: ("_iq4_candidate",),
}


def _data() -> np.ndarray:
    """512 rows of 2304: normal weights with outliers, plus llama.cpp's edge cases
    (zeros, ties, subnormal ranges, signed zeros ...) tiled in: at least one
    full chunk for every type, so that kernels run."""
    g = np.random.default_rng(11)
    x = g.standard_normal((512, 2304)) * 0.02
    x[g.random(x.shape) < 0.01] *= 40.0
    x[::32] = np.tile(_special_rows(2304, 3), (2, 1))[:16]
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def forced_compile():
    old = os.environ.get("QUANTKIT_COMPILE")
    os.environ["QUANTKIT_COMPILE"] = "1"
    yield
    if old is None:
        os.environ.pop("QUANTKIT_COMPILE")
    else:
        os.environ["QUANTKIT_COMPILE"] = old


@pytest.mark.parametrize("qtype", sorted(_FUSED, key=int), ids=lambda t: t.name)
def test_fused_kernels_match_llama_cpp(forced_compile, qtype):
    x = _data()
    got = encoders.quantize(torch.from_numpy(x), qtype)
    want = ref.quantize_ref(x, int(qtype))
    assert np.array_equal(got.reshape(want.shape), want), f"{qtype.name}: fused bytes differ from llama.cpp"
    for name in _FUSED[qtype]:
        f = getattr(encoders, name)
        assert any(f.verdict.values()), f"{name}: no compiled kernel was used (verdicts {f.verdict})"
    if qtype == QT.Q3_K:
        # the later coordinate-descent passes run the same kernel on the shrinking active sets, whatever
        # their size: one that is not a whole number of vectors was checked and the kernel kept
        assert any(tail for _, tail in encoders._q3_pass.checked) and all(encoders._q3_pass.verdict.values())


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.IQ4_XS], ids=lambda t: t.name)
def test_fused_kernels_match_llama_cpp_with_imatrix(forced_compile, qtype):
    x = _data()
    imatrix = np.random.default_rng(5).random(x.shape[1]).astype(np.float32) + 0.1
    imatrix[::7] = 0.0                    # zero weights; whole zero groups: all-zero sums stay +0 as in C
    imatrix[:64] = 0.0
    got = encoders.quantize(torch.from_numpy(x), qtype, imatrix=torch.from_numpy(imatrix))
    want = ref.quantize_ref(x, int(qtype), imatrix)
    assert np.array_equal(got.reshape(want.shape), want)


@pytest.mark.parametrize("qtype", [QT.IQ3_XXS, QT.IQ3_S, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ1_S, QT.IQ1_M],
                         ids=lambda t: t.name)
def test_the_lattice_types_kernels_match_llama_cpp(forced_compile, qtype):
    from quantkit.backends.gguf import grid_encoders
    from quantkit.backends.gguf.neighbours import _nearest_in_rows
    x = _data()
    imatrix = np.random.default_rng(7).lognormal(0, 1.5, x.shape[1]).astype(np.float32) ** 2
    got = encoders.quantize(torch.from_numpy(x), qtype, imatrix=torch.from_numpy(imatrix))
    want = ref.quantize_ref(x, int(qtype), imatrix)
    assert np.array_equal(got.reshape(want.shape), want)
    # IQ1's split search runs its neighbour search op by op around the row kernel; the others' trials are kernels
    used = [_nearest_in_rows] if qtype in (QT.IQ1_S, QT.IQ1_M) else \
        [grid_encoders._trial_points, grid_encoders._grid_sums]
    for f in used:
        assert any(f.verdict.values()), f.verdict


def _forget(f, monkeypatch) -> None:
    """An encoder's fused step as a new process finds it: no kernel loaded or checked yet."""
    for slot, empty in (("kernels", {}), ("checked", set()), ("absent", set()), ("ready", {})):
        monkeypatch.setattr(f, slot, empty)


def test_kernel_is_built_once_loaded_later_and_refused_when_wrong(tmp_path, monkeypatch):
    """The package cache: built on first use under QUANTKIT_COMPILE=1, loaded (not rebuilt) by a later
    user in auto mode, and refused, with the eager result returned, when it is broken or disagrees."""
    from quantkit.backends.gguf import fusion
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("QUANTKIT_COMPILE", "1")

    def step(x, y):  # rounding-sensitive: a division, a round, an fp16 round trip
        return torch.round(x / y).clamp(-8, 7), (x / y).to(torch.float16).float()

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 1024, generator=g), torch.rand(1024, generator=g) + 0.5
    want = step(x, y)

    built = fusion.fused(step)
    assert all(torch.equal(a, b) for a, b in zip(built(x, y), want))
    assert list(built.verdict.values()) == [True]
    packages = list(fusion.kernel_dir().glob("step-*.pt2"))
    assert len(packages) == 1
    stamp = packages[0].stat().st_mtime_ns

    monkeypatch.setenv("QUANTKIT_COMPILE", "auto")
    fusion.plan_work(0)                               # auto with nothing planned: load, never build
    loaded = fusion.fused(step)
    assert all(torch.equal(a, b) for a, b in zip(loaded(x, y), want))
    assert list(loaded.verdict.values()) == [True] and packages[0].stat().st_mtime_ns == stamp

    def other(x, y):  # what the kernel is checked against differs: the kernel must be refused
        return torch.round(x / y).clamp(-8, 7), (x / y)
    disagreeing = fusion.fused(step, eager=other)
    assert all(torch.equal(a, b) for a, b in zip(disagreeing(x, y), other(x, y)))
    assert list(disagreeing.verdict.values()) == [False]

    packages[0].write_bytes(b"not a package")        # broken file: eager, no exception, file dropped
    broken = fusion.fused(step)
    assert all(torch.equal(a, b) for a, b in zip(broken(x, y), want))
    assert list(broken.verdict.values()) == [False] and not packages[0].exists()

    absent = tmp_path / "elsewhere"                   # auto mode never builds a missing kernel for small work
    monkeypatch.setenv("QUANTKIT_CACHE", str(absent))
    assert list(fusion.fused(step)(x, y)[0].shape) == [4, 1024]
    assert not absent.exists()


def test_a_failed_build_runs_eagerly_and_is_not_retried(tmp_path, monkeypatch):
    """No C++ compiler (or any build failure): the eager result, and no second build attempt in the process."""
    from quantkit.backends.gguf import fusion
    monkeypatch.setenv("QUANTKIT_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("QUANTKIT_COMPILE", "1")
    monkeypatch.setattr(fusion, "_build_failed", False)
    attempts = []

    def failing_build(fn, args, path):
        attempts.append(fn.__name__)
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(fusion, "_build", failing_build)

    def double(x):
        return x * 2.0

    def halve(x):
        return x * 0.5
    x = torch.randn(4, 1024)
    assert torch.equal(fusion.fused(double)(x), x * 2.0)
    assert torch.equal(fusion.fused(halve)(x), x * 0.5)
    assert attempts == ["double"]


def test_shapes_seen_without_building_stay_buildable(tmp_path, monkeypatch):
    """Auto mode with little work neither builds nor settles a specialization: a later forced run still builds
    it, once for every block count."""
    from quantkit.backends.gguf import fusion
    monkeypatch.setenv("QUANTKIT_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(fusion, "_build_failed", False)
    built = []
    monkeypatch.setattr(fusion, "_build", lambda fn, args, path: built.append(args[0].shape[-1]))

    def triple(x):
        return x * 3.0
    f = fusion.fused(triple)
    monkeypatch.setenv("QUANTKIT_COMPILE", "auto")
    fusion.plan_work(0)
    before = fusion.missing_kernels()
    for m in (512, 1024, 4096, 100, 8):     # block counts of one specialization, and one too small for a kernel
        assert torch.equal(f(torch.ones(2, m)), torch.full((2, m), 3.0))
    f(torch.ones(3, 512))                  # another specialization: 3 positions
    assert built == [] and f.verdict == {}
    assert fusion.missing_kernels() - before == 2      # what the dry run's time estimate counts as to be built
    monkeypatch.setenv("QUANTKIT_COMPILE", "1")
    f(torch.ones(2, 8192))
    assert built == [8192]                              # attempted (the stub builds nothing, so no kernel)


def test_one_kernel_serves_every_block_count(tmp_path, monkeypatch):
    """The blocks dimension is symbolic: one package, built on the first call, gives the eager bits for block
    counts it was not built with, whole vectors of blocks or not (the first of each kind is checked)."""
    from quantkit.backends.gguf import fusion
    monkeypatch.setenv("QUANTKIT_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("QUANTKIT_COMPILE", "1")
    monkeypatch.setattr(fusion, "_build_failed", False)

    def step(x, y):
        return torch.round(x / y).clamp(-8, 7), (x * y).sum(0)

    g = torch.Generator().manual_seed(1)
    f = fusion.fused(step)
    for m in (1024, 4096, 100, 1000, 64):
        x, y = torch.randn(4, m, generator=g), torch.rand(m, generator=g) + 0.5
        assert all(torch.equal(a, b) for a, b in zip(f(x, y), step(x, y)))
    assert list(f.verdict.values()) == [True]
    assert len(list(tmp_path.glob("*/step-*.pt2"))) == 1
    assert len(f.checked) == 2
    # fewer blocks than a kernel takes (Q3_K's last passes): the checked kernel runs on padded copies
    f.eager = None          # this test's own function: not called (it would raise)
    for m in (1, 7, 63):
        x, y = torch.randn(4, m, generator=g), torch.rand(m, generator=g) + 0.5
        got = f(x, y)
        assert [t.shape for t in got] == [(4, m), (m,)]
        assert all(torch.equal(a, b) for a, b in zip(got, step(x, y)))


def test_prebuild_builds_what_the_probe_lacks_in_worker_processes(tmp_path, monkeypatch):
    """A cold run's kernels are built before it starts, in processes beside it: the probe's calls only record
    what is missing (nothing is built in the run's own process), the workers build it, the run loads it, and
    the kernel then gives the eager bits for another block count."""
    from quantkit.backends.gguf import fusion
    monkeypatch.setenv("QUANTKIT_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("QUANTKIT_COMPILE", "1")
    monkeypatch.setenv("QUANTKIT_SHIPPED_KERNELS", "0")     # the shipped set would have it
    monkeypatch.setattr(fusion, "_build_failed", False)

    def not_here(fn, args, path):
        raise AssertionError("built in the run's own process")
    monkeypatch.setattr(fusion, "_build", not_here)
    f = encoders._qkx_levels
    _forget(f, monkeypatch)
    g = torch.Generator().manual_seed(0)

    def args(m):
        return (torch.randn(32, m, generator=g), torch.rand(m, generator=g) + 0.5, -torch.rand(m, generator=g),
                torch.tensor(15.0))
    probe = args(300)
    assert fusion.prebuild(lambda: f(*probe)) == 1
    assert len(list(tmp_path.glob("*/_qkx_levels-*.pt2"))) == 1
    run = args(1000)
    assert all(torch.equal(a, b) for a, b in zip(f(*run), encoders._qkx_levels_vec(*run)))
    assert list(f.verdict.values()) == [True]
    assert fusion.prebuild(lambda: f(*probe)) == 0          # nothing left to build


_FRESH_MACHINE = """
import sys
from pathlib import Path
from quantkit.backends.gguf import encoders, fusion
from quantkit.backends.gguf.kernel_samples import EVERY_KIND, encode_samples

def no_build(*args):
    raise AssertionError("a kernel was built: the shipped set lacks it (run make kernels)")
fusion._build = no_build
encode_samples(EVERY_KIND)
used = {(f.fn.__name__, str(spec)): ok for f in fusion._ALL for spec, ok in f.verdict.items()}
assert used and all(used.values()), used
assert all(f.checked for f in fusion._ALL if f.kernels), "every kernel used was held to the eager bits"
assert not any(Path(sys.argv[1]).rglob("*.pt2")), "nothing is written to the machine's own folder"
print(len(used))
"""


def _shipped_torch_versions() -> set[str]:
    return {d.name.split("-")[1] for d in fusion.SHIPPED.glob("torch-*")}


@pytest.mark.skipif(not fusion._runs_shipped(),
                    reason="this CPU cannot run the shipped kernels (x86-64 with AVX2 only): it builds its own")
def test_a_new_machine_runs_the_shipped_kernels_and_builds_none(tmp_path):
    """The contract of the shipped set (fusion.SHIPPED, `make kernels`): on a machine whose own kernel folder is
    empty, every kind of fused encode (every fused type, with and without an importance vector) finds its
    kernels there, none is built, and each passes its bit-for-bit check.  Fails when the encoders changed and
    the set was not rebuilt."""
    import subprocess
    import torch as _torch
    version = _torch.__version__.split("+")[0]
    if _shipped_torch_versions() and version not in _shipped_torch_versions():
        pytest.skip(f"the shipped kernels are for torch {sorted(_shipped_torch_versions())}, this is {version}")
    env = {**os.environ, "QUANTKIT_KERNEL_DIR": str(tmp_path), "QUANTKIT_COMPILE": "1"}
    env.pop("QUANTKIT_SHIPPED_KERNELS", None)
    out = subprocess.run([sys.executable, "-c", _FRESH_MACHINE, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) >= 9          # the K-quant and IQ4 steps, each in the forms the types use


def test_the_shipped_set_is_left_aside_when_asked_or_unusable(tmp_path, monkeypatch):
    """QUANTKIT_SHIPPED_KERNELS=0, or a CPU without the shipped set's instructions: the kernel is built for this
    machine as before (here the build is a stub that records it)."""
    from quantkit.backends.gguf import fusion
    monkeypatch.setenv("QUANTKIT_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("QUANTKIT_COMPILE", "1")
    monkeypatch.setattr(fusion, "_build_failed", False)
    built = []
    monkeypatch.setattr(fusion, "_build", lambda fn, args, path, portable=False: built.append(path))
    f = encoders._qx_search
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4096, generator=g)
    for how in ("env", "cpu"):
        _forget(f, monkeypatch)
        if how == "env":
            monkeypatch.setenv("QUANTKIT_SHIPPED_KERNELS", "0")
        else:
            monkeypatch.delenv("QUANTKIT_SHIPPED_KERNELS")
            monkeypatch.setattr(fusion, "_runs_shipped", lambda: False)
        encoders.quantize(x, QT.Q6_K)
        assert built and all(p.is_relative_to(tmp_path) for p in built), how
        built.clear()
