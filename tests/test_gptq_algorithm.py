"""The GPTQ algorithm: it beats round-to-nearest, its outputs describe its weights exactly, act-order and
group layouts, dampening, and refusal of broken input."""
import pytest
import torch

from quantkit.backends.gptq.algorithm import GPTQSettings, gptq_quantize, rtn_quantize, visiting_order
from quantkit.errors import QuantizationError


def _problem(k=384, n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Correlated inputs with very different per-channel scales, as real activations have.
    x = torch.randn(2048, k, generator=g) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=g) / k ** 0.5)
    x = x * torch.rand(k, generator=g).pow(2) * 4
    w = torch.randn(n, k, generator=g) * 0.05
    return x, w, x.T @ x / x.shape[0]


def _output_error(x, w, q):
    return ((x @ (w - q).T) ** 2).mean().item()


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("act", [False, True])
def test_gptq_has_lower_output_error_than_round_to_nearest(bits, act):
    # (At 2 bits without act-order GPTQ can lose to RTN on a synthetic problem like this one.)
    x, w, h = _problem()
    s = GPTQSettings(bits=bits, group_size=64, act_order=act)
    assert _output_error(x, w, gptq_quantize(w, h, s).weight) < 0.9 * _output_error(x, w, rtn_quantize(w, s).weight)


def test_blocked_updates_equal_the_column_by_column_algorithm():
    from quantkit.backends.gptq.algorithm import _grid, inverse_cholesky
    x, w, h = _problem()
    s = GPTQSettings(bits=4, group_size=64, group_aware=False, block_size=128)
    fast = gptq_quantize(w, h, s)
    W = w.clone()
    U, _ = inverse_cholesky(h, s)
    Q = torch.zeros_like(W)
    for i in range(W.shape[1]):  # the textbook loop: every update applied to the whole matrix at once
        if i % 64 == 0:
            scale, zero = _grid(W[:, i:i + 64], s)
        Q[:, i] = scale * (torch.clamp(torch.round(W[:, i] / scale) + zero, 0, 15) - zero)
        err = (W[:, i] - Q[:, i]) / U[i, i]
        W[:, i:] -= err[:, None] * U[i, i:][None]
    assert torch.allclose(fast.weight, Q, atol=1e-6)


@pytest.mark.parametrize("settings", [GPTQSettings(), GPTQSettings(act_order=True), GPTQSettings(group_aware=False),
                                      GPTQSettings(act_order=True, static_groups=True), GPTQSettings(sym=False),
                                      GPTQSettings(bits=3, group_size=-1), GPTQSettings(mse_grid=True)])
def test_codes_scales_zeros_reconstruct_the_weights(settings):
    x, w, h = _problem()
    r = gptq_quantize(w, h, settings)
    g = r.g_idx.long()
    assert torch.equal(r.scales[:, g] * (r.codes.float() - r.zeros[:, g].float()), r.weight)
    assert torch.equal(r.scales, r.scales.half().float())  # what is stored is what was used
    assert int(r.codes.max()) <= 2 ** settings.bits - 1
    if settings.sym:
        assert (r.zeros == 2 ** (settings.bits - 1)).all()


def test_group_layouts():
    x, w, h = _problem(k=320)  # 2.5 groups of 128
    importance = torch.diag(h)
    natural = gptq_quantize(w, h, GPTQSettings(group_size=128, group_aware=False))
    aware = gptq_quantize(w, h, GPTQSettings(group_size=128))
    static = gptq_quantize(w, h, GPTQSettings(group_size=128, act_order=True, static_groups=True))
    plain_groups = torch.arange(320) // 128
    for r in (natural, aware, static):  # storage stays in original groups: every consumer reads it
        assert torch.equal(r.g_idx.long(), plain_groups)
    assert not torch.equal(natural.codes, aware.codes)  # the visiting order did change
    act = gptq_quantize(w, h, GPTQSettings(group_size=128, act_order=True))
    perm = torch.argsort(importance, descending=True)
    assert torch.equal(act.g_idx.long()[perm], torch.arange(320) // 128)  # runs in visiting order
    assert sorted(torch.bincount(act.g_idx.long()).tolist()) == [64, 128, 128]


def test_group_aware_order_keeps_whole_groups_and_the_partial_one_last():
    importance = torch.tensor([0.1, 0.2, 5.0, 0.3, 9.0, 0.4, 0.5])  # groups of 2: [0,1] [2,3] [4,5] [6]
    perm, fixed = visiting_order(importance, 2, GPTQSettings(group_size=2))
    assert fixed and perm.tolist() == [4, 5, 2, 3, 1, 0, 6]


def test_stacked_linears_quantize_as_separate_ones():
    x, w, h = _problem()
    s = GPTQSettings(act_order=True)
    both = gptq_quantize(w, h, s)
    top, bottom = gptq_quantize(w[:40], h, s), gptq_quantize(w[40:], h, s)
    assert torch.equal(both.codes, torch.cat([top.codes, bottom.codes]))
    assert torch.allclose(both.weight, torch.cat([top.weight, bottom.weight]))


def test_dead_inputs_get_zero_weights():
    x, w, h = _problem()
    h[5, :] = 0
    h[:, 5] = 0
    r = gptq_quantize(w, h, GPTQSettings())
    assert (r.weight[:, 5] == 0).all()


def test_dampening_grows_until_cholesky_succeeds():
    k = 64
    v = torch.randn(k, 1)
    v /= v.norm()
    h = torch.eye(k) - 1.03 * (v @ v.T)  # one eigenvalue −0.03: needs λ·mean(diag) > 0.03
    w = torch.randn(16, k)
    r = gptq_quantize(w, h, GPTQSettings(group_size=32, damp=0.01, damp_step=0.01))
    assert r.damp > 0.03
    with pytest.raises(QuantizationError, match="singular"):
        gptq_quantize(w, h, GPTQSettings(group_size=32, damp=0.01, damp_step=0.0))


def test_non_finite_input_is_refused():
    x, w, h = _problem()
    bad = h.clone()
    bad[3, 3] = float("nan")
    with pytest.raises(QuantizationError, match="Hessian is not finite"):
        gptq_quantize(w, bad, GPTQSettings())
    w2 = w.clone()
    w2[0, 0] = float("inf")
    with pytest.raises(QuantizationError, match="NaN or inf"):
        gptq_quantize(w2, h, GPTQSettings())
