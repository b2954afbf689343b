"""Byte-identity tests of quantkit's torch GGML encoders against llama.cpp.

The reference bytes come from ``ggml_quantize_chunk`` in the libggml-base that
ships with llama-cpp-python (see tests/_ggml_ref.py); those tests skip when
llama_cpp is not installed.  Round-trip / error tests need only gguf + torch.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from quantkit.backends.gguf.encoders import SUPPORTED, dequantize, quantize  # noqa: E402
from quantkit.backends.gguf.grid_encoders import GRID_ENCODERS, NEEDS_IMATRIX  # noqa: E402
from quantkit.backends.gguf.iq1_encoders import IQ1_ENCODERS  # noqa: E402
from quantkit.backends.gguf.legacy_rows import ROW_ENCODERS  # noqa: E402

try:  # tests/ may or may not be a package
    from tests import _ggml_ref as ref  # type: ignore  # noqa: E402
except ImportError:  # pragma: no cover
    import _ggml_ref as ref  # type: ignore  # noqa: E402

TYPES = sorted(SUPPORTED, key=int)
QUANT_TYPES = [t for t in TYPES if t not in (QT.F32, QT.F16, QT.BF16)]
# types llama.cpp quantizes without an importance matrix (ggml-quants.c asserts on a missing one for the rest)
PLAIN_TYPES = [t for t in TYPES if t not in NEEDS_IMATRIX]
# types whose llama.cpp quantizer takes an importance matrix into account
IMATRIX_TYPES = [t for t in QUANT_TYPES if t not in (QT.Q8_0, QT.TQ1_0, QT.TQ2_0)]

needs_ref = pytest.mark.skipif(not ref.available(), reason=ref.unavailable_reason())


# ----------------------------------------------------------------------------
# test data
# ----------------------------------------------------------------------------

def _special_rows(n: int, seed: int) -> np.ndarray:
    """Edge cases, one per row (n is a multiple of 256)."""
    g = np.random.default_rng(1000 + seed)
    rows = []
    rows.append(np.zeros(n))                                    # all zero
    rows.append(np.full(n, 0.25))                               # constant
    rows.append(np.full(n, -1.5))                               # negative constant
    rows.append(g.standard_normal(n) * 1e-20)                   # tiny values
    rows.append(np.round(g.standard_normal(n) * 4) / 4)         # grid values: exact ties
    r = g.standard_normal(n) * 1e-3                             # one huge outlier per block
    r[::32] = 1e4 * np.sign(g.standard_normal(n // 32))
    rows.append(r)
    r = np.where(np.arange(n) % 2 == 0, -1.0, 1.0)              # +-a ties, first is negative
    r[n // 2:] *= -1                                            # ... and first positive
    rows.append(r)
    r = g.standard_normal(n) * (g.random(n) < 0.05)             # sparse, signed zeros
    r[:64] = -0.0
    r[64:96] = 0.0
    r[96] = -0.0
    rows.append(r)
    rows.append(np.abs(g.standard_normal(n)) + 0.5)             # positive only (min > 0)
    rows.append(-np.abs(g.standard_normal(n)) - 0.5)            # negative only
    rows.append(np.round(g.standard_normal(n) * 8))             # integer grid
    rows.append(g.standard_t(2, n) * 0.01)                      # heavy tails
    r = g.standard_normal(n) * np.repeat(np.logspace(-44, -34, n // 32), 32)
    r[::7] = 0.0
    rows.append(r)                                              # subnormal / overflowing 1/scale
    return np.stack(rows).astype(np.float32)


def _cases():
    """(id, float32 array) pairs; rows of 256*k elements, kept small."""
    out = []
    for seed, (rows, n) in enumerate([(8, 256), (4, 1024), (2, 2304)]):
        g = np.random.default_rng(seed)
        x = g.standard_normal((rows, n)) * 0.02
        x[g.random(x.shape) < 0.01] *= 40.0                     # outliers
        x[0, :64] = 0.0                                         # partially zero row
        out.append((f"normal{seed}_{rows}x{n}", x.astype(np.float32)))
    g = np.random.default_rng(7)
    out.append(("uniform_4x512", g.uniform(-1, 1, (4, 512)).astype(np.float32)))
    out.append(("scaled_rows_8x768", (g.standard_normal((8, 768))
                                      * np.logspace(-4, 2, 8)[:, None]).astype(np.float32)))
    for seed in range(2):
        out.append((f"special{seed}_512", _special_rows(512, seed)))
    return out


CASES = _cases()


def _block_mismatch(a: np.ndarray, b: np.ndarray, qtype) -> str:
    bs, ts = GGML_QUANT_SIZES[qtype]
    ga = a.reshape(-1, ts if bs > 1 else ts)
    gb = b.reshape(ga.shape)
    bad = (ga != gb).any(1)
    rows_bad = np.nonzero((a != b).any(1))[0][:8].tolist()
    return (f"{qtype.name}: {int(bad.sum())}/{bad.size} blocks differ "
            f"({bad.mean():.3%}); first differing rows {rows_bad}")


# ----------------------------------------------------------------------------
# byte identity against llama.cpp
# ----------------------------------------------------------------------------

@needs_ref
@pytest.mark.parametrize("qtype", PLAIN_TYPES, ids=lambda t: t.name)
def test_bytes_match_llama_cpp(qtype):
    failures = []
    for name, x in CASES:
        got = quantize(torch.from_numpy(x), qtype)
        want = ref.quantize_ref(x, qtype)
        assert got.dtype == np.uint8 and got.shape == want.shape, (name, got.shape, want.shape)
        if not np.array_equal(got, want):
            failures.append(f"[{name}] " + _block_mismatch(got, want, qtype))
    assert not failures, "\n".join(failures)


@needs_ref
@pytest.mark.parametrize("qtype", IMATRIX_TYPES, ids=lambda t: t.name)
def test_bytes_match_llama_cpp_imatrix(qtype):
    failures = []
    for i, (name, x) in enumerate(CASES[:4] + CASES[-1:]):
        g = np.random.default_rng(50 + i)
        im = (g.random(x.shape[1]) ** 2 * 4).astype(np.float32)
        im[:8] = 0.0                                            # unused columns
        got = quantize(torch.from_numpy(x), qtype, imatrix=torch.from_numpy(im))
        want = ref.quantize_ref(x, qtype, imatrix=im)
        if not np.array_equal(got, want):
            failures.append(f"[{name}] " + _block_mismatch(got, want, qtype))
    assert not failures, "\n".join(failures)


@needs_ref
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.TQ1_0, QT.TQ2_0], ids=lambda t: t.name)
def test_types_that_ignore_the_imatrix(qtype):
    x = CASES[0][1]
    im = np.random.default_rng(3).random(x.shape[1]).astype(np.float32)
    got = quantize(torch.from_numpy(x), qtype, imatrix=torch.from_numpy(im))
    np.testing.assert_array_equal(got, ref.quantize_ref(x, qtype))


@needs_ref
@pytest.mark.parametrize("qtype", sorted({**GRID_ENCODERS, **IQ1_ENCODERS}, key=int), ids=lambda t: t.name)
def test_lattice_types_on_a_model_sized_tensor(qtype):
    """Rows of 2048 (8 super-blocks), enough rows that every neighbour-list length and tie occurs."""
    g = np.random.default_rng(21)
    x = (g.standard_normal((48, 2048)) * 0.02).astype(np.float32)
    x[3, 512:768] = 0.0                                         # one all-zero super-block
    x[5, :32] = 0.0                                             # and a zero sub-block before non-zero ones
    im = (g.random(2048) ** 2 * 4).astype(np.float32)
    got = quantize(torch.from_numpy(x), qtype, imatrix=torch.from_numpy(im))
    want = ref.quantize_ref(x, qtype, imatrix=im)
    assert np.array_equal(got, want), _block_mismatch(got, want, qtype)


def _nearest_slowly(tab, u, x, w, s, values):
    """iq2/iq3_find_best_neighbour written out per group: each candidate of u's list in order, the distance
    summed position by position in float32, the first strictly smaller one kept."""
    out = []
    for k in range(u.numel()):
        row = int(tab.row_of[u[k]])
        lst = tab.flat[int(tab.start[row]):int(tab.start[row]) + int(tab.count[row])].tolist()
        best, pick = np.float32(np.inf), -1
        for c in lst:
            lev = tab.levels[c].numpy()
            q = (2 * lev + 1).astype(np.float32) if values is None else values[lev, k].numpy()
            d2 = np.float32(0)
            for i in range(tab.dim):
                diff = np.float32(s[k].item()) * q[i] - np.float32(x[i, k].item())
                d2 = np.float32(d2 + np.float32(np.float32(w[i, k].item()) * diff) * diff)
            if d2 < best:
                best, pick = d2, c
        out.append(pick)
    return out


@pytest.mark.parametrize("compile_mode", ["0", "1"], ids=["op by op", "kernel"])
@pytest.mark.parametrize("qtype", [QT.IQ3_XXS, QT.IQ3_S, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ1_S],
                         ids=lambda t: t.name)
def test_best_neighbour_is_the_first_nearest_candidate_of_the_list(qtype, compile_mode, monkeypatch):
    """The neighbour search of the lattice types against the C's loop written out: lists longer than a row of
    the kernel (IQ2_XS: up to 292 candidates), ties (zero weights: every candidate at distance 0, so the first
    wins), IQ1's per-group level values; op by op and as the fused kernel (which checks itself against the
    op-by-op function on its first calls)."""
    import shutil
    from quantkit.backends.gguf.grids import grid_tables
    from quantkit.backends.gguf.neighbours import _nearest_in_rows, best_neighbour
    if compile_mode == "1" and shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: AOTInductor cannot build the kernel here")
    monkeypatch.setenv("QUANTKIT_COMPILE", compile_mode)
    tab = grid_tables(qtype)
    g = torch.Generator().manual_seed(int(qtype))
    listed = (tab.row_of >= 0).nonzero().squeeze(1)
    n = 300
    u = listed[torch.randint(len(listed), (n,), generator=g)]
    x = torch.rand(tab.dim, n, generator=g) * 6
    w = torch.rand(tab.dim, n, generator=g)
    w[:, :20] = 0.0                                              # ties throughout the list
    s = torch.rand(n, generator=g) + 0.5
    values = None
    if qtype == QT.IQ1_S:
        values = torch.tensor([[-1.125, -0.125, 0.875, 0.0]]).t().expand(4, n).clone()
        values[:, ::2] += 0.25                                   # the other shift on every second group
    got = best_neighbour(tab, u, x, w, s, values).tolist()
    assert got == _nearest_slowly(tab, u, x, w, s, values)
    assert got[:20] == [int(tab.flat[tab.start[tab.row_of[v]]]) for v in u[:20]]
    if compile_mode == "1":
        assert any(_nearest_in_rows.verdict.values()), _nearest_in_rows.verdict


def _pick_slowly(a, b):
    """IQ1's running pick as the C makes it, every candidate in order (float32, columns side by side)."""
    a, b = a.numpy(), b.numpy()
    best = np.full(a.shape[1], -np.finfo(np.float32).max, dtype=np.float32)
    scale = np.zeros(a.shape[1], dtype=np.float32)
    chosen = np.full(a.shape[1], -1)
    with np.errstate(all="ignore"):
        for c in range(a.shape[0]):
            take = (b[c] > 0) & (a[c] * a[c] > best * b[c])
            scale = np.where(take, a[c] / b[c], scale)
            best = np.where(take, scale * a[c], best)
            chosen = np.where(take, c, chosen)
    return chosen, scale


def _split_sums(kind: str, m: int, g: torch.Generator) -> torch.Tensor:
    """Prefix sums of sub-blocks (sorted values, importance weights) with the columns that make the pick hard:
    zero weights (candidates with equal sums: exact ties), equal values (a dense top of near-equal keys), an
    all-zero sub-block (every key 0), one with no weight at all (no candidate) and tiny values (a·a and the C's
    other product near float32's subnormal range, where their rounding is absolute)."""
    n = 32 if kind == "s" else 16
    x = torch.sort(torch.randn(n, m, generator=g), 0).values
    w = torch.rand(n, m, generator=g)
    w[:, 1::5] *= torch.rand(n, m, generator=g)[:, 1::5] < 0.5
    x[:, 2::5] = torch.where(torch.rand(n, m, generator=g)[:, 2::5] < 0.5, 0.25, -0.25)
    x[:, 3::5] = x[:, 3::5].sort(0).values.round(decimals=1)
    x[:, 0], w[:, 4] = 0.0, 0.0
    x[:, 5], x[:, 10], x[:, 15] = x[:, 5] * 1e-19, x[:, 10] * 3e-20, x[:, 15] * 1e-21
    zero = torch.zeros(1, m)
    if kind == "s":
        return torch.stack([torch.cat([zero, (w * x).cumsum(0)]), torch.cat([zero, w.cumsum(0)])])
    half = torch.rand(n, m, generator=g) < 0.5                       # which group of 8 each sorted value is in
    sums = [torch.cat([zero, torch.where(half == h, t, 0).cumsum(0)]) for t in (w * x, w) for h in (False, True)]
    return torch.stack(sums)


@pytest.mark.parametrize("compile_mode", ["0", "1"], ids=["op by op", "kernel"])
@pytest.mark.parametrize("kind", ["s", "m"], ids=["IQ1_S", "IQ1_M"])
def test_iq1_split_pick_keeps_the_candidate_the_c_loop_keeps(kind, compile_mode, monkeypatch):
    """The exact split search's pick (thresholds above a gap, then the path of kept candidates) against the C's
    loop over every candidate, on sub-blocks with exact ties, dense tops, all-zero values and no weight; both the
    kernels' thresholds and the sorted fallback (_slow, run here on every sub-block) must agree with it."""
    import shutil
    from quantkit.backends.gguf import iq1_splits
    if compile_mode == "1" and shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: AOTInductor cannot build the kernels here")
    monkeypatch.setenv("QUANTKIT_COMPILE", compile_mode)
    P = _split_sums(kind, 640, torch.Generator().manual_seed(11))
    a, b, _ = iq1_splits._all_sums(P, kind)
    want_c, want_s = _pick_slowly(a, b)
    got_c, got_s = iq1_splits.pick(P, kind)
    assert got_c.tolist() == want_c.tolist()
    assert np.array_equal(got_s.numpy().view(np.int32), want_s.view(np.int32))
    assert want_c[4] == -1 and want_c[0] >= 0                       # no weight: no candidate; all zero: the first
    slow_c, slow_s = iq1_splits._slow(P, kind, a.shape[0])
    assert slow_c.tolist() == want_c.tolist()
    assert np.array_equal(slow_s.numpy().view(np.int32), want_s.view(np.int32))
    if compile_mode == "1":
        assert all(f.verdict and all(f.verdict.values()) for f in
                   (iq1_splits._best_key, iq1_splits._counts, iq1_splits._above))


@needs_ref
@pytest.mark.parametrize("qtype", sorted(ROW_ENCODERS, key=int), ids=lambda t: t.name)
def test_legacy_types_row_path_and_its_exact_fallback(qtype):
    """Q4_0 ... Q8_0 without a matrix encode blocks in row layout; blocks with a non-finite value, scale or
    reciprocal go to the general path.  Both are taken on the edge cases, and both give llama.cpp's bytes."""
    special = _special_rows(512, 0)
    blocks = torch.from_numpy(special).reshape(-1, 32)
    _, unsafe = ROW_ENCODERS[qtype](blocks)
    per_row = unsafe.view(special.shape[0], -1).any(1).tolist()
    assert per_row[-1] and not any(per_row[:-1])       # only the subnormal-scale row leaves the row path
    x = special.copy()
    x[2, 40], x[3, 100] = np.inf, -np.inf          # (NaN weights never reach an encoder: the writer refuses them)
    got, want = quantize(torch.from_numpy(x), qtype), ref.quantize_ref(x, qtype)
    assert np.array_equal(got, want), _block_mismatch(got, want, qtype)
    normal = torch.from_numpy(CASES[1][1]).to(torch.bfloat16).float().reshape(-1, 32)
    assert not ROW_ENCODERS[qtype](normal)[1].any()


def test_sqrt_is_correctly_rounded_on_both_paths():
    """sqrtf's bits: the CPU path (numpy's) and the general path (float64 with a midpoint fix, what a GPU runs)
    agree with each other and with a float64-exact test of the rounding, at the edges as well."""
    from quantkit.backends.gguf import exact
    g = torch.Generator().manual_seed(3)
    v = torch.rand(1 << 16, generator=g) * 10.0 ** torch.randint(-40, 38, (1 << 16,), generator=g).float()
    edges = torch.tensor([0.0, -0.0, 1e-45, 1.1754942e-38, 1.0, 2.0, 3.4028235e38, float("inf")])
    v = torch.cat([v, edges, torch.nextafter(v[:64], torch.zeros(64))])
    got = exact._sqrt(v)
    general = exact._sqrt(v.to(torch.float64)).to(torch.float32)      # float64 in: the device-neutral path
    assert torch.equal(got.view(torch.int32), general.view(torch.int32))
    r, vd = got.double(), v.double()
    up = torch.nextafter(got, torch.full_like(got, float("inf"))).double()
    dn = torch.nextafter(got, torch.zeros_like(got)).double()
    finite = torch.isfinite(v) & (v > 0)
    assert not ((vd > ((r + up) / 2) ** 2) & finite).any() and not ((vd < ((r + dn) / 2) ** 2) & finite).any()


def test_lattice_types_refuse_without_an_importance_matrix():
    for qtype in NEEDS_IMATRIX:
        with pytest.raises(ValueError, match="importance matrix"):
            quantize(torch.zeros(2, 256), qtype)


@needs_ref
def test_half_inputs_match_reference_on_their_float_values():
    g = np.random.default_rng(11)
    x32 = (g.standard_normal((4, 512)) * 0.05).astype(np.float32)
    for dt in (torch.float16, torch.bfloat16):
        xt = torch.from_numpy(x32).to(dt)
        xf = xt.to(torch.float32).numpy()
        for qtype in (QT.F16, QT.BF16, QT.F32, QT.Q4_K, QT.Q8_0):
            np.testing.assert_array_equal(quantize(xt, qtype), ref.quantize_ref(xf, qtype),
                                          err_msg=f"{dt} -> {qtype.name}")


@needs_ref
def test_bf16_f16_special_values():
    bits = np.random.default_rng(5).integers(0, 2**32, size=(4, 1024), dtype=np.uint64)
    x = bits.astype(np.uint32).view(np.float32).copy()         # NaN, inf, subnormals, ...
    x[0, :8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38, 65520.0]
    for qtype in (QT.F32, QT.F16, QT.BF16):
        np.testing.assert_array_equal(quantize(torch.from_numpy(x), qtype),
                                      ref.quantize_ref(x, qtype), err_msg=qtype.name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype):
    for name, x in CASES if qtype not in NEEDS_IMATRIX else ():
        xt = torch.from_numpy(x)
        cpu = quantize(xt, qtype)
        gpu = quantize(xt.cuda(), qtype)
        assert np.array_equal(cpu, gpu), f"[{name}] " + _block_mismatch(gpu, cpu, qtype)
    if qtype in IMATRIX_TYPES:
        x = CASES[1][1]
        im = torch.from_numpy((np.random.default_rng(9).random(x.shape[1]) ** 2).astype(np.float32))
        cpu = quantize(torch.from_numpy(x), qtype, im)
        gpu = quantize(torch.from_numpy(x).cuda(), qtype, im.cuda())
        assert np.array_equal(cpu, gpu), "[imatrix] " + _block_mismatch(gpu, cpu, qtype)


# ----------------------------------------------------------------------------
# round trip / API behaviour (no reference needed)
# ----------------------------------------------------------------------------

# max allowed  rms(dequant - x) / rms(x)  on gaussian data
_RTOL = {
    QT.F32: 0.0, QT.F16: 1e-3, QT.BF16: 5e-3, QT.Q8_0: 0.01,
    QT.Q6_K: 0.03, QT.Q5_K: 0.06, QT.Q5_0: 0.07, QT.Q5_1: 0.06,
    QT.Q4_K: 0.11, QT.Q4_0: 0.13, QT.Q4_1: 0.12, QT.IQ4_NL: 0.11, QT.IQ4_XS: 0.11,
    QT.Q3_K: 0.22, QT.Q2_K: 0.42, QT.IQ3_S: 0.18, QT.IQ3_XXS: 0.23, QT.IQ2_S: 0.28, QT.IQ2_XS: 0.32,
    QT.IQ2_XXS: 0.36, QT.IQ1_M: 0.62, QT.IQ1_S: 0.52,
    # ternary types are made for ternary-trained weights; on gaussian data they keep only the signs of the largest
    QT.TQ1_0: 0.82, QT.TQ2_0: 0.82,
}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_roundtrip_error(qtype):
    g = np.random.default_rng(123)
    x = (g.standard_normal((8, 1024)) * 0.02).astype(np.float32)
    im = torch.ones(1024) if qtype in NEEDS_IMATRIX else None
    data = quantize(torch.from_numpy(x), qtype, im)
    bs, ts = GGML_QUANT_SIZES[qtype]
    assert data.dtype == np.uint8
    assert data.shape == (8, 1024 // bs * ts)
    y = dequantize(data, qtype, x.shape)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and tuple(y.shape) == x.shape
    y = y.numpy()
    rel = np.sqrt(np.mean((y - x) ** 2)) / np.sqrt(np.mean(x ** 2))
    assert rel <= _RTOL[qtype], f"{qtype.name}: relative rms error {rel:.4f} > {_RTOL[qtype]}"
    # an all-zero tensor must come back exactly zero
    z = dequantize(quantize(torch.zeros(2, 256), qtype, None if im is None else im[:256]), qtype, (2, 256))
    assert torch.count_nonzero(z) == 0


@pytest.mark.parametrize("qtype", [t for t in TYPES if GGML_QUANT_SIZES[t][0] > 1],
                         ids=lambda t: t.name)
def test_bad_row_length_raises(qtype):
    bs = GGML_QUANT_SIZES[qtype][0]
    with pytest.raises(ValueError):
        quantize(torch.zeros(2, bs + 16), qtype)


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        quantize(torch.zeros(256), QT.Q8_0)                    # not 2-D
    with pytest.raises(ValueError):
        quantize(torch.zeros(2, 256), QT.MXFP4)                # unsupported type


def test_supported_set():
    assert SUPPORTED == frozenset({
        QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
        QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS, QT.TQ1_0, QT.TQ2_0,
        QT.IQ3_XXS, QT.IQ3_S, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ1_S, QT.IQ1_M})
