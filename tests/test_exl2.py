"""EXL2: the row layouts and their bit costs, the packed tensors against a slow bit-by-bit decoder written from
../shared/docs/formats/exl2.md, and the quantizer (act-order GPTQ with 4-bit scale codes)."""
import math
import random

import numpy as np
import pytest
import torch

from quantkit.backends.exl2 import algorithm, allocate, layouts, packing
from quantkit.backends.exl2.layouts import ATTENTION_OPTIONS, HEAD_OPTIONS, MLP_OPTIONS, RowLayout

ALL_LAYOUTS = sorted({lay for table in (ATTENTION_OPTIONS, MLP_OPTIONS) for option in table for lay in option}
                     | set(HEAD_OPTIONS.values()), key=lambda lay: lay.desc)


def reference_total_bits(layout: RowLayout, rows: int, columns: int, bias: bool) -> int:
    # exl2.md §5.2: weights + 16-bit q_scale_max + 32 bits of q_groups per group, 4-bit scales per group and
    # column, 32-bit q_invperm per row, float16 bias; groups per width ceil(min(rows·p, left) / gs)
    groups, left, weight_bits = 0, rows, 0
    for b, p, gs in zip(layout.bits, layout.proportions, layout.group_sizes):
        g = max(0, math.ceil(min(rows * p, left) / gs))
        taken = min(g * gs, max(left, 0))
        weight_bits += taken * columns * b
        groups += g
        left -= g * gs
    return weight_bits + groups * 48 + groups * columns * 4 + rows * 32 + (16 * columns if bias else 0)


@pytest.mark.parametrize("rows", [64, 100, 576, 1536, 8960])
def test_every_table_layout_counts_bits_as_exllamav2(rows):
    for lay in ALL_LAYOUTS:
        groups = lay.groups(rows)
        assert groups[0].start == 0 and groups[-1].end == rows
        assert all(a.end == b.start for a, b in zip(groups, groups[1:]))
        assert [g.bits for g in groups] == sorted((g.bits for g in groups), reverse=True)
        assert all(g.end - g.start == lay.group_sizes[lay.bits.index(g.bits)] for g in groups[:-1])
        for bias in (False, True):
            assert lay.total_bits(rows, 320, bias) == reference_total_bits(lay, rows, 320, bias), lay.desc


def test_tables_and_dict_round_trip():
    assert len(ATTENTION_OPTIONS) == 19 and all(len(o) == 4 for o in ATTENTION_OPTIONS)
    assert len(MLP_OPTIONS) == 17 and all(len(o) == 3 for o in MLP_OPTIONS)
    assert HEAD_OPTIONS[6].desc == "0.15:8b_128g/0.85:6b_128g s4"
    for lay in ALL_LAYOUTS:
        assert abs(sum(lay.proportions) - 1) < 1e-9
        assert RowLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(ValueError):
        RowLayout.of(64, [2, 3], [0.5, 0.5])     # widths must decrease
    # the options a measurement quantizes: distinct per position, far fewer than options × positions
    assert [len(x) for x in layouts.distinct(MLP_OPTIONS)] == [13, 13, 14]


# --- packing ----------------------------------------------------------------------------------------------------

def bit_reader_decode(t: dict, rows: int, columns: int) -> torch.Tensor:
    """Slow reference from exl2.md §3, one bit at a time: the dequantized (columns, rows) weight."""
    q_weight = t["q_weight"].tolist()
    pairs = t["q_groups"].tolist()
    invperm = t["q_invperm"].tolist()
    perm = [0] * rows
    for i, k in enumerate(invperm):
        perm[k] = i                                 # processing position k holds input row perm[k]
    q_scale = t["q_scale"].tolist()
    scale_max = t["q_scale_max"].float().tolist()
    groups = [(pairs[2 * i], pairs[2 * i + 1]) for i in range(len(pairs) // 2)]
    out = [[0.0] * rows for _ in range(columns)]
    k = 0
    for gi, (bits, first) in enumerate(groups):
        n = ((groups[gi + 1][1] - first) * 32 // bits) if gi + 1 < len(groups) else rows - k
        for col in range(columns):
            word = q_scale[gi][col // 8] & 0xFFFFFFFF
            qs = ((word >> (4 * (col % 8))) & 0xF) + 1
            # exl2.md §3.3, in the kernels' float16: max × (1/256) (the loader), then (qs)² × that
            scale = np.float16(qs * qs) * (np.float16(scale_max[gi]) * np.float16(1 / 256))
            for r in range(n):
                code = 0
                for bit in range(bits):
                    pos = bits * r + bit
                    word = q_weight[first + pos // 32][col] & 0xFFFFFFFF
                    code |= ((word >> (pos % 32)) & 1) << bit
                out[col][perm[k + r]] = float(np.float16(code - 2 ** (bits - 1)) * scale)
        k += n
    return torch.tensor(out)


def random_linear(rows: int, columns: int, layout: RowLayout, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = layout.groups(rows)
    codes = torch.cat([torch.randint(0, 2 ** gr.bits, (gr.end - gr.start, columns), generator=g) for gr in groups])
    qscale = torch.randint(1, 17, (len(groups), columns), generator=g)
    scale_max = (torch.rand(len(groups), generator=g) * 0.01 + 1e-4).half()
    perm = torch.randperm(rows, generator=g)
    return codes, groups, qscale, scale_max, perm


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("rows", [32, 64, 7, 37, 100])
def test_every_width_round_trips(bits, rows):
    codes = torch.randint(0, 2 ** bits, (rows, 9), generator=torch.Generator().manual_seed(bits * rows))
    packed = packing.pack_group(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (math.ceil(rows * bits / 32), 9)
    assert torch.equal(packing.unpack_group(packed, rows, bits), codes)


def test_scale_codes_round_trip():
    qs = torch.randint(1, 17, (5, 40), generator=torch.Generator().manual_seed(3))
    packed = packing.pack_scales(qs)
    assert packed.shape == (5, 5) and torch.equal(packing.unpack_scales(packed), qs)


@pytest.mark.parametrize("case", range(8))
def test_reader_agrees_with_a_bit_by_bit_decoder_on_random_layouts(case):
    rnd = random.Random(case)
    widths = sorted(rnd.sample(layouts.WIDTHS, rnd.randint(1, 3)), reverse=True)
    props = [rnd.random() + 0.1 for _ in widths]
    props = [p / sum(props) for p in props]
    lay = RowLayout(tuple(widths), tuple(props), tuple(rnd.choice([32, 64, 128]) for _ in widths))
    rows = rnd.choice([64, 96, 130, 200])          # partial last groups
    columns = rnd.choice([32, 40, 57])             # padded columns
    codes, groups, qscale, scale_max, perm = random_linear(rows, columns, lay, case)
    stored = packing.pack_linear(codes, groups, qscale, scale_max, perm)
    assert stored["q_weight"].shape[1] == packing.padded_columns(columns)
    assert [g for g in stored["q_groups"].tolist()[::2]] == [gr.bits for gr in groups]
    back = packing.unpack_linear(stored, columns)
    assert torch.equal(back[0], codes) and back[1] == groups and torch.equal(back[2], qscale)
    assert torch.equal(back[4], perm)
    assert torch.equal(algorithm.dequantize(*back), bit_reader_decode(stored, rows, columns).float())


def test_padding_columns_hold_zero_weights():
    lay = RowLayout.of(32, [4], [1])
    codes, groups, qscale, scale_max, perm = random_linear(64, 40, lay, 0)
    stored = packing.pack_linear(codes, groups, qscale, scale_max, perm)
    padded = packing.unpack_linear(stored, 64)
    assert (padded[0][:, 40:] == 8).all() and (padded[2][:, 40:] == 16).all()


# --- the quantizer ----------------------------------------------------------------------------------------------

def correlated_problem(K=256, N=96, samples=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(K, K, generator=g) / K ** 0.5 + torch.eye(K)
    X = (torch.randn(samples, K, generator=g) @ mix) * (0.5 + 2 * torch.rand(K, generator=g))
    W = torch.randn(N, K, generator=g) * 0.05
    return W, X, X.t() @ X / samples


def output_error(W, Q, X):
    return (((X @ (Q - W).t()) ** 2).mean() / ((X @ W.t()) ** 2).mean()).item()


@pytest.mark.parametrize("layout", [RowLayout.of(64, [3, 2], [0.25, 0.75]), RowLayout.of(128, [4], [1]),
                                    RowLayout.of([32, 64], [8, 4], [0.05, 0.95])])
def test_error_feedback_beats_rounding_and_dequantizes_to_its_own_weight(layout):
    W, X, H = correlated_problem()
    prep = algorithm.prepare(H)
    q = algorithm.quantize(W, prep, layout)
    assert torch.equal(algorithm.dequantize(q.codes, q.groups, q.qscale, q.scale_max, q.perm), q.weight)
    # the same scales without error feedback: every row rounded on its own
    identity = algorithm.Prepared(prep.perm, torch.eye(W.shape[1]), prep.damp)
    rtn = algorithm.quantize(W, identity, layout)
    assert output_error(W, q.weight, X) < 0.8 * output_error(W, rtn.weight, X)
    # the codes stay in range, the scale codes in 1 … 16, the maxima finite in float16
    assert all(0 <= q.codes[g.start:g.end].min() and q.codes[g.start:g.end].max() < 2 ** g.bits for g in q.groups)
    assert q.qscale.min() >= 1 and q.qscale.max() <= 16 and torch.isfinite(q.scale_max).all()


def test_more_bits_less_error_and_act_order_puts_active_rows_first():
    W, X, H = correlated_problem(seed=1)
    prep = algorithm.prepare(H)
    errors = [output_error(W, algorithm.quantize(W, prep, RowLayout.of(64, [b], [1])).weight, X) for b in (2, 3, 4, 6, 8)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-4
    assert torch.equal(prep.perm, torch.argsort(torch.diag(H), descending=True))


def test_large_weights_stay_finite_in_float16():
    # exllamav2's users hit float16 overflow at load: a group maximum is stored in float16, so weights up to
    # its range must come back finite
    W, X, H = correlated_problem(K=128, N=32)
    W = W * 2e4
    q = algorithm.quantize(W, algorithm.prepare(H), RowLayout.of(32, [4], [1]))
    assert torch.isfinite(q.weight).all() and torch.isfinite(q.scale_max).all()
    assert output_error(W, q.weight, X) < 0.05


def test_singular_and_non_finite_inputs_fail_with_a_sentence():
    from quantkit.errors import QuantizationError
    H = torch.zeros(64, 64)
    H[0, 0] = float("nan")
    with pytest.raises(QuantizationError, match="not finite"):
        algorithm.prepare(H)
    W = torch.randn(8, 64)
    W[0, 0] = float("inf")
    with pytest.raises(QuantizationError, match="NaN or inf"):
        algorithm.quantize(W, algorithm.prepare(torch.eye(64)), RowLayout.of(32, [4], [1]))


# --- the bit allocation -----------------------------------------------------------------------------------------

def random_slots(n, options, seed):
    rnd = random.Random(seed)
    slots = []
    for _ in range(n):
        costs = sorted(rnd.randint(1000, 9000) for _ in range(options))
        errors = sorted((rnd.random() * 0.1 for _ in range(options)), reverse=True)
        slots.append([allocate.Option(c, e) for c, e in zip(costs, errors)])
        if rnd.random() < 0.3:   # a dominated option: more bits, more error
            slots[-1].append(allocate.Option(costs[-1] + 10, errors[0] + 0.01))
    return slots


@pytest.mark.parametrize("seed", range(6))
def test_solver_finds_the_exact_optimum_of_small_problems(seed):
    import itertools
    slots = random_slots(5, 4, seed)
    budget = sum(s[len(s) // 2].bits for s in slots)
    brute = min((sum(s[i].error for s, i in zip(slots, c)), c) for c in itertools.product(*[range(len(s)) for s in slots])
                if sum(s[i].bits for s, i in zip(slots, c)) <= budget)
    got = allocate.solve(slots, budget, units=budget)      # one bit per step: the DP is exact
    assert got.bits <= budget and got.error == pytest.approx(brute[0])


@pytest.mark.parametrize("seed", range(6))
def test_solver_beats_greedy_and_never_exceeds_the_budget(seed):
    slots = random_slots(60, 17, seed)
    for fraction in (0.2, 0.5, 0.8):
        lo, hi = (sum(f(o.bits for o in s) for s in slots) for f in (min, max))
        budget = int(lo + fraction * (hi - lo))
        got, base = allocate.solve(slots, budget), allocate.greedy(slots, budget)
        assert got.bits <= budget and base.bits <= budget
        assert got.error <= base.error + 1e-12
        assert got.bits >= budget - max(o.bits for s in slots for o in s)   # nothing large left unspent


def test_an_impossible_budget_is_one_sentence():
    slots = random_slots(3, 3, 0)
    with pytest.raises(ValueError, match="smallest options already need"):
        allocate.solve(slots, 10)


@pytest.mark.parametrize("bits", [2, 3, 4, 6])
def test_coarse_to_fine_p_search_matches_the_full_scan(bits):
    # the search evaluates 28 of exllamav2's 97 grid points; on weight-like groups it lands where the full scan
    # does, or on a point within a fraction of a percent of the full scan's error
    torch.manual_seed(bits)
    for _ in range(10):
        x = torch.distributions.StudentT(4.0).sample((64, 96)) * 0.02
        full_qs, full_max = algorithm.find_scales(x, bits, coarse=1)
        qs, top = algorithm.find_scales(x, bits)
        assert torch.equal(qs, full_qs)

        def err(m):
            s = algorithm.stored_scale(qs.to(torch.int32), m)
            q = torch.clamp(torch.round(x / s), -2 ** (bits - 1), 2 ** (bits - 1) - 1) * s
            return (q - x).abs().pow(3.5).sum().item()
        assert err(top) <= err(full_max) * 1.005
