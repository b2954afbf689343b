"""GGUF with error feedback (--error-feedback): the algorithm (feedback.py) on random layers, and the files it
makes (same types and size as the importance-matrix file, loaded by llama.cpp, nothing left behind, resumed)."""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from conftest import make_checkpoint, run_cli
from quantkit import api
from quantkit.backends.gguf import encoders, llamacpp
from quantkit.backends.gguf.block_headers import block_grid
from quantkit.backends.gguf.feedback import SUPPORTED, feedback_quantize
from quantkit.backends.gguf.reader import GGUFModel
from quantkit.eval.harness import load_windows, window_logits
from quantkit.errors import QuantizationError
from quantkit.model.checkpoint import Checkpoint

TYPES = sorted(SUPPORTED, key=lambda q: q.name)


def layer(K=512, N=64, tokens=2048, seed=0):
    """A weight and the Hessian of correlated inputs whose columns differ in scale, as a real layer's do."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(K) + 0.5 * torch.randn(K, K, generator=g) / K ** 0.5
    X = torch.randn(tokens, K, generator=g) @ mix * (torch.rand(K, generator=g) * 2 + 0.1)
    return torch.randn(N, K, generator=g) * 0.05, X


def output_error(X, W, Wq) -> float:
    return float(((X @ (W - Wq).T) ** 2).mean())


@pytest.mark.parametrize("qtype", TYPES, ids=[q.name for q in TYPES])
def test_feedback_lowers_the_output_error_of_the_importance_matrix_quant(qtype):
    W, X = layer()
    H = X.T @ X / X.shape[0]
    r = feedback_quantize(W, H, qtype)
    assert r.data.shape == (W.shape[0], W.shape[1] // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1])
    # the weights the next layer is calibrated on are exactly what llama.cpp's decoder makes of the bytes
    assert torch.equal(encoders.dequantize(r.data, qtype, W.shape), r.weight)
    plain = encoders.dequantize(encoders.quantize(W, qtype, imatrix=torch.diag(H)), qtype, W.shape)
    assert output_error(X, W, r.weight) < 0.9 * output_error(X, W, plain)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_with_a_reference_it_aims_at_the_unquantized_models_output(qtype):
    """Inputs that earlier quantized layers disturbed (X) against the unquantized model's (X_ref): with
    W·D, D = E[(x_ref − x)xᵀ], the file's output comes closer to W·x_ref than quantizing W for X alone does."""
    W, X_ref = layer(seed=3)
    g = torch.Generator().manual_seed(4)
    X = X_ref @ (torch.eye(X_ref.shape[1]) + 0.05 * torch.randn(X_ref.shape[1], X_ref.shape[1], generator=g)
                 / X_ref.shape[1] ** 0.5) + 0.05 * torch.randn(X_ref.shape, generator=g)
    H, D = X.T @ X / X.shape[0], (X_ref - X).T @ X / X.shape[0]
    error = lambda Wq: float(((X_ref @ W.T - X @ Wq.T) ** 2).mean())
    plain, aimed = feedback_quantize(W, H, qtype), feedback_quantize(W, H, qtype, reference=W @ D)
    assert error(aimed.weight) < 0.8 * error(plain.weight)
    # and it is still an ordinary block of the type, decoded as llama.cpp decodes it
    assert torch.equal(encoders.dequantize(aimed.data, qtype, W.shape), aimed.weight)
    # no disturbance, no change
    assert torch.equal(feedback_quantize(W, H, qtype, reference=torch.zeros_like(W)).weight, plain.weight)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q4_0], ids=lambda q: q.name)
def test_the_lazy_batches_do_not_change_the_update(qtype, monkeypatch):
    """Each column's error reaches the later ones one by one inside a batch of INNER_COLUMNS and by matmul past
    it: the same update as one by one everywhere, up to float rounding (a dropped or misplaced batch update
    changes most codes)."""
    from quantkit.backends.gguf import feedback
    W, X = layer(seed=9)
    H = X.T @ X / X.shape[0]
    results = {}
    for inner in (1, 16, GGML_QUANT_SIZES[qtype][0]):
        monkeypatch.setattr(feedback, "INNER_COLUMNS", inner)
        results[inner] = feedback_quantize(W, H, qtype, plain_rows=False)
    one_by_one = results.pop(GGML_QUANT_SIZES[qtype][0])
    for r in results.values():
        assert (r.weight == one_by_one.weight).float().mean() > 0.999
        assert r.loss == pytest.approx(one_by_one.loss, rel=1e-4)


def test_the_target_from_the_loops_own_inverse_is_the_least_squares_one():
    """With no H of its own (every calibration row paired), the target W + W·D·H⁻¹ is made with the inverse the
    column loop factors anyway: the same file as with a separate inverse of the same H, up to float rounding."""
    W, X_ref = layer(seed=3)
    g = torch.Generator().manual_seed(4)
    X = X_ref + 0.1 * torch.randn(X_ref.shape, generator=g)
    H, D = X.T @ X / X.shape[0], (X_ref - X).T @ X / X.shape[0]
    shared = feedback_quantize(W, H, QT.Q4_K, reference=W @ D)
    apart = feedback_quantize(W, H, QT.Q4_K, reference=W @ D, reference_hessian=H.clone())
    plain = feedback_quantize(W, H, QT.Q4_K)
    assert (shared.weight == apart.weight).all(1).float().mean() > 0.9
    assert shared.loss == pytest.approx(apart.loss, rel=1e-3) and shared.loss != pytest.approx(plain.loss, rel=1e-2)


def test_the_reference_is_trusted_as_far_as_it_holds_on_rows_it_was_not_fitted_to():
    """The target's regression of x_ref − x on x has a coefficient per input and row.  When the disturbance is a
    linear function of x, half of the tokens predict the other half and the shift is kept; when it is noise
    x cannot explain, fitted on few tokens for the width, the regression learns that noise, the halves disagree,
    and the trust falls, and with it the error on tokens the calibration never saw."""
    from quantkit.backends.gguf.feedback import target_inverse, trusted_shift
    from quantkit.calibration.stats import ReferenceHessian
    K, N = 256, 64
    g = torch.Generator().manual_seed(5)
    W = torch.randn(N, K, generator=g) * 0.05
    mix = torch.eye(K) + 0.05 * torch.randn(K, K, generator=g) / K ** 0.5

    def tokens(n, linear):
        X = torch.randn(n, K, generator=g) * (torch.rand(K, generator=g) + 0.5)
        return X, (X @ mix if linear else X + 0.3 * torch.randn(n, K, generator=g))

    for linear, tokens_per_batch, want in ((True, 2048, lambda a: a.mean() > 0.9),
                                           (False, 160, lambda a: a.mean() < 0.5)):
        acc = ReferenceHessian(K, "cpu")
        for _ in range(2):
            X, R = tokens(tokens_per_batch, linear)
            acc.add(X, reference=R)
        P = target_inverse(acc.paired_value())
        shift, alpha = trusted_shift(acc.folds(W), P)
        assert alpha.shape == (N,) and want(alpha), (linear, alpha.mean())
        torch.testing.assert_close(shift, acc.shift(W) @ P, rtol=2e-2, atol=2e-2 * float(shift.abs().max()))
        X, R = tokens(8192, linear)          # tokens neither half saw
        error = lambda Wq: float(((R @ W.T - X @ Wq.T) ** 2).mean())
        H = acc.value()
        trusted = feedback_quantize(W, H, QT.Q4_K, reference_hessian=acc.paired_value(), folds=acc.folds(W))
        full = feedback_quantize(W, H, QT.Q4_K, reference=acc.shift(W), reference_hessian=acc.paired_value())
        assert trusted.trust == pytest.approx(float(alpha.mean()))
        if not linear:
            assert error(trusted.weight) < error(full.weight)


def test_the_trust_is_the_same_in_the_loops_visiting_order():
    """feedback_quantize hands trusted_shift the target's H⁻¹ in the column loop's order: the α per row must be
    what the file's own order gives, and the shift the same in that order, in trusted_shift and through
    feedback_quantize (K = 512: two Q4_K blocks, whose visiting order is not the file's)."""
    from quantkit.backends.gguf.feedback import target_inverse, trusted_shift
    from quantkit.calibration.stats import ReferenceHessian
    K = 512
    W, X = layer(K=K, N=48, tokens=1024, seed=6)
    g = torch.Generator().manual_seed(7)
    mix = torch.eye(K) + 0.05 * torch.randn(K, K, generator=g) / K ** 0.5
    acc = ReferenceHessian(K, "cpu", bf16_products=False)
    acc.add(X, reference=X @ mix + 0.2 * torch.randn(X.shape, generator=g))   # partly explained by x
    P = target_inverse(acc.paired_value())
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(8))
    folds = acc.folds(W)
    (shift, plain), (moved, permuted) = trusted_shift(folds, P), trusted_shift(folds, P[perm][:, perm], perm)
    assert ((plain > 0.05) & (plain < 0.95)).float().mean() > 0.5     # rows inside (0, 1), not clamped
    torch.testing.assert_close(permuted, plain, rtol=2e-2, atol=2e-3)   # bf16 products on a bf16-native CPU
    torch.testing.assert_close(moved, shift[:, perm], rtol=2e-2, atol=2e-2 * float(shift.abs().max()))
    r = feedback_quantize(W, acc.value(), QT.Q4_K, reference_hessian=acc.paired_value(), folds=folds)
    assert r.trust == pytest.approx(float(plain.mean()), rel=1e-2)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K], ids=lambda q: q.name)
def test_each_row_keeps_the_better_of_the_loop_and_the_plain_search(qtype):
    """Weights that already sit on the type's grid (a checkpoint dequantized from a GGUF of that type), inputs
    slightly disturbed: aimed at the reference through the column loop they leave the grid and come out worse
    than the importance-weighted search of the original rows; each row keeps the better of the two, so the
    file beats both.  A layer that never went through the grid keeps the loop's rows."""
    W, X_ref = layer(K=1024, N=128, tokens=4096, seed=3)
    on_grid = encoders.dequantize(encoders.quantize(W, qtype), qtype, W.shape).bfloat16().float()
    K = X_ref.shape[1]
    g = torch.Generator().manual_seed(4)
    X = (X_ref @ (torch.eye(K) + 0.02 * torch.randn(K, K, generator=g) / K ** 0.5)
         + 0.02 * torch.randn(X_ref.shape, generator=g))
    H, D = X.T @ X / X.shape[0], (X_ref - X).T @ X / X.shape[0]
    for weights, kept in ((on_grid, True), (W, False)):
        error = lambda Wq: float(((X_ref @ weights.T - X @ Wq.T) ** 2).mean())
        plain = encoders.quantize(weights, qtype, imatrix=torch.diag(H))
        loop = feedback_quantize(weights, H, qtype, reference=weights @ D, plain_rows=False)
        best = feedback_quantize(weights, H, qtype, reference=weights @ D)
        assert torch.equal(encoders.dequantize(best.data, qtype, W.shape), best.weight)
        from_plain = (best.data == plain).all(1)
        assert ((best.data == loop.data).all(1) | from_plain).all()   # every row is one of the two, whole
        assert best.plain_rows == int(from_plain.sum())
        if kept:
            assert error(loop.weight) > error(encoders.dequantize(plain, qtype, W.shape))
            assert best.plain_rows > W.shape[0] // 2
            assert error(best.weight) < error(encoders.dequantize(plain, qtype, W.shape))
        else:
            assert best.plain_rows == 0 and np.array_equal(best.data, loop.data)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q3_K, QT.Q6_K, QT.Q4_0, QT.IQ4_XS], ids=lambda q: q.name)
def test_the_first_block_header_is_llama_cpps_choice_for_the_weights(qtype):
    """No error reaches the first block visited (the one holding the most active input) before its search: its
    header (scales, minimums) is the one llama.cpp's importance-weighted search picks for the original weights;
    only the codes may move."""
    W, X = layer()
    H = X.T @ X / X.shape[0]
    bs, ts = GGML_QUANT_SIZES[qtype]
    r = feedback_quantize(W, H, qtype)
    b = int(torch.diag(H).argmax()) // bs
    cols = slice(b * bs, (b + 1) * bs)
    ref = encoders.quantize(W[:, cols], qtype, imatrix=torch.diag(H)[cols])
    got = r.data[:, b * ts:(b + 1) * ts]
    lay = encoders.CODE_LAYOUTS[qtype]
    header = np.ones(ts, bool)
    header[lay.start:lay.end] = False
    assert np.array_equal(got[:, header], ref[:, header])
    assert not np.array_equal(got, ref)      # the codes took the errors of the block's own columns


def test_block_grid_decodes_every_code_as_the_reference_decoder():
    """The grid read from the headers is exactly what gguf-py's decoder makes of every code, on rows of very
    different scales and signs (minimums above and below zero, sub-scales of every size)."""
    g = torch.Generator().manual_seed(1)
    W = torch.randn(48, 512, generator=g) * torch.logspace(-4, 1, 48).unsqueeze(1)
    W += torch.randn(48, 1, generator=g) * W.abs().amax(1, keepdim=True)       # offset rows: minimums of both signs
    W[5] = 0                                                                    # an all-zero row: zero scales
    for qtype in TYPES:
        for imatrix in (None, torch.rand(512, generator=g)):
            data = encoders.quantize(W, qtype, imatrix=imatrix)
            offset, scale = block_grid(data, qtype, W.shape)
            levels = encoders.CODE_LAYOUTS[qtype].levels
            codes = torch.randint(len(levels), W.shape, generator=g)
            for c in (0, 1, len(levels) - 1, codes):
                c = torch.full(W.shape, c) if isinstance(c, int) else c
                want = encoders.dequantize(encoders.with_codes(data, qtype, c), qtype, W.shape)
                got = offset + scale * torch.tensor(levels, dtype=torch.float32)[c]
                assert torch.equal(got, want), qtype.name


def test_refusals():
    W, X = layer(K=256)
    H = X.T @ X / X.shape[0]
    with pytest.raises(ValueError, match="block size"):
        feedback_quantize(W[:, :200], H[:200, :200], QT.Q4_K)
    with pytest.raises(QuantizationError, match="NaN"):
        feedback_quantize(W.index_fill(1, torch.tensor([3]), float("nan")), H, QT.Q4_K)


# --- files ------------------------------------------------------------------------------------------------

CALIB = ["--calib-samples", "8", "--calib-seqlen", "64"]


def tensors(path):
    return {t.name: (t.tensor_type, bytes(t.data)) for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def files(tiny_gguf_source, calib_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("feedback")
    made = {}
    for name, flag in (("imatrix", "--imatrix"), ("feedback", "--error-feedback")):
        r = run_cli("convert", str(tiny_gguf_source), "-o", str(out / name), "-f", "gguf:Q4_K_M", "-f", "gguf:Q2_K",
                    flag, "--calib", str(calib_text), *CALIB, "--tokenizer-pre", "gpt-2")
        assert r.returncode == 0, r.stderr
        made[name] = {ft: out / name / f"llama256-{ft}.gguf" for ft in ("Q4_K_M", "Q2_K")}
    return made, out


def test_same_types_and_size_as_the_importance_matrix_file_and_nothing_left(files):
    made, out = files
    for ft in ("Q4_K_M", "Q2_K"):
        imat, fb = tensors(made["imatrix"][ft]), tensors(made["feedback"][ft])
        assert {n: t for n, (t, _) in imat.items()} == {n: t for n, (t, _) in fb.items()}
        assert made["imatrix"][ft].stat().st_size == made["feedback"][ft].stat().st_size
        linears = [n for n in fb if n.startswith("blk.") and "norm" not in n] + ["output.weight"]
        changed = [n for n in linears if fb[n][1] != imat[n][1]]
        assert len(changed) == len(linears), ft             # every decoder linear and the head took the feedback
        assert all(fb[n][1] == imat[n][1] for n in fb if n not in linears)   # the rest is the usual encoding
    assert sorted(p.name for p in (out / "feedback").iterdir()) == sorted(
        [f"llama256-{ft}.gguf{x}" for ft in ("Q4_K_M", "Q2_K") for x in ("", ".quantkit.json")])


def test_the_record_and_the_card_name_the_method(files):
    from quantkit.publish.card import row_for
    from quantkit.publish.record import read_record
    made, _ = files
    for name, method in (("imatrix", "importance matrix"), ("feedback", "error feedback")):
        path = made[name]["Q4_K_M"]
        record = read_record(path)
        assert record["quantization"]["method"] == method
        assert record["calibration"]["samples"] == 8 and record["calibration"]["seqlen"] == 64
        assert row_for(path, path.name).variant == f"Q4_K_M ({method})"
    # how many rows kept the plain search instead of the column loop's, per file type of the run
    kept = read_record(made["feedback"]["Q4_K_M"])["quantization"]["rows_from_the_plain_search"]
    assert set(kept) == {"Q4_K_M", "Q2_K"} and all(" of " in v and not v.endswith(" of 0") for v in kept.values())


@pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python (quantkit[llamacpp]) not installed")
def test_loads_in_llama_cpp_as_quantkit_reads_it(files, tiny_gguf_source, calib_text):
    """llama.cpp runs the file as quantkit reads it (with llama.cpp's activation rounding), as closely as it runs
    the importance-matrix file: a misplaced row or code would put the two far apart (random model: near-ties,
    so the importance-matrix file is the yardstick)."""
    made, _ = files
    model = Checkpoint(tiny_gguf_source)
    tokens = load_windows(model.tokenizer, calib_text, ctx=64, windows=2)
    for ft in ("Q4_K_M", "Q2_K"):
        gap = {}
        for name in ("imatrix", "feedback"):
            theirs = torch.stack(list(llamacpp.window_logits(made[name][ft], tokens, threads=2)))
            ours = torch.stack(list(window_logits(GGUFModel(made[name][ft], base=model, activations="llama.cpp"),
                                                  tokens)))
            gap[name] = float((theirs - ours).abs().max() / theirs.abs().max())
        assert gap["feedback"] < max(2 * gap["imatrix"], 0.02), (ft, gap)


def test_a_tied_head_is_fed_back_in_the_embedding_it_shares(calib_text, tmp_path, monkeypatch):
    """A tied model stores the head once, as token_embd: that tensor takes the head's feedback (from the final
    norm's output), at the type llama-quantize gives it, and the file has no output.weight.  A head taller than
    HEAD_ROWS is fed back in slices of rows, which land in the file in order."""
    from quantkit.backends.gguf import feedback_job
    source = make_checkpoint(tmp_path / "tied", hidden=256, intermediate=512, heads=4, kv_heads=2, layers=1,
                             vocab=320, bpe=True, tie=True)
    made = {}
    for name, flag, rows in (("imatrix", "imatrix", 16384), ("feedback", "error_feedback", 16384),
                             ("sliced", "error_feedback", 100)):
        monkeypatch.setattr(feedback_job, "HEAD_ROWS", rows)
        [made[name]] = api.convert(str(source), ["gguf:Q4_K_M"], tmp_path / name,
                                   options={flag: True, "calib": str(calib_text), "calib_samples": 8,
                                            "calib_seqlen": 64, "tokenizer_pre": "gpt-2"})
    imat, fb, sliced = tensors(made["imatrix"]), tensors(made["feedback"]), tensors(made["sliced"])
    assert "output.weight" not in fb and fb["token_embd.weight"][0] == imat["token_embd.weight"][0] == QT.Q6_K
    assert fb["token_embd.weight"][1] != imat["token_embd.weight"][1]
    assert made["imatrix"].stat().st_size == made["feedback"].stat().st_size == made["sliced"].stat().st_size
    # rows are independent: slicing changes nothing but float rounding in the batched updates
    whole, parts = (np.frombuffer(x["token_embd.weight"][1], np.uint8).reshape(320, -1) for x in (fb, sliced))
    assert whole.shape[1] == GGML_QUANT_SIZES[QT.Q6_K][1]      # one block per row
    assert (whole == parts).all(axis=1).mean() > 0.95


def test_a_failure_in_the_pass_leaves_nothing(tiny_gguf_source, calib_text, tmp_path, monkeypatch):
    from quantkit.backends.gguf import feedback_job
    calls = {"n": 0}
    real = feedback_job.feedback.feedback_quantize

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] > 3:
            raise QuantizationError("stop here")
        return real(*a, **k)
    monkeypatch.setattr(feedback_job.feedback, "feedback_quantize", failing)
    with pytest.raises(QuantizationError):
        api.convert(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path / "out",
                    options={"error_feedback": True, "calib": str(calib_text), "calib_samples": 8, "calib_seqlen": 64,
                             "resume": False, "tokenizer_pre": "gpt-2"})
    assert not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("paired_tokens", [32768, 0], ids=["every window paired", "half of them"])
def test_an_interrupted_run_resumes_to_the_same_bytes(tiny_gguf_source, calib_text, tmp_path, monkeypatch,
                                                       paired_tokens):
    """The commit point keeps the file's own stream and the reference's together (512 tokens here: all windows
    paired, unless the floor on paired tokens is lifted and the job's share of half applies)."""
    from quantkit.backends.gguf.feedback_job import FeedbackEncoder
    monkeypatch.setattr(FeedbackEncoder, "reference_tokens", paired_tokens)
    options = {"error_feedback": True, "calib": str(calib_text), "calib_samples": 8, "calib_seqlen": 64,
               "tokenizer_pre": "gpt-2"}
    [whole] = api.convert(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path / "whole", options=dict(options))
    real = FeedbackEncoder.quantize_group

    def interrupted(self, ctx, group):
        if ctx.layer == 1:
            raise KeyboardInterrupt
        return real(self, ctx, group)
    monkeypatch.setattr(FeedbackEncoder, "quantize_group", interrupted)
    with pytest.raises(KeyboardInterrupt):
        api.convert(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path / "out", options=dict(options))
    assert list((tmp_path / "out").glob(".partial-*.feedback"))     # kept for the rerun
    monkeypatch.setattr(FeedbackEncoder, "quantize_group", real)
    [again] = api.convert(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path / "out", options=dict(options))
    assert tensors(again) == tensors(whole)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [again.name, again.name + ".quantkit.json"]


def test_needs_calibration_data(tiny_gguf_source, tmp_path):
    r = run_cli("convert", str(tiny_gguf_source), "-o", str(tmp_path), "-f", "gguf:Q4_K_M", "--error-feedback")
    assert r.returncode != 0 and "--calib" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr


def test_the_dry_run_counts_the_pass_and_the_scratch_file(tiny_gguf_source, calib_text, tmp_path):
    options = {"calib": str(calib_text), "calib_samples": 8, "calib_seqlen": 64, "tokenizer_pre": "gpt-2"}
    [plain] = api.plan(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path, options=dict(options))
    [fb] = api.plan(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path, options={**options, "error_feedback": True})
    assert not plain.resources.calibrated and fb.resources.calibrated
    assert [r.kind for r in fb.rows] == [r.kind for r in api.plan(
        str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path, options={**options, "imatrix": True})[0].rows]
    linears = sum(r.bytes for r in fb.rows if (r.tensor.startswith("blk.") and r.tensor.endswith(".weight")
                                                and "norm" not in r.tensor) or r.tensor == "output.weight")
    assert fb.resources.spill_disk == linears > 0
    assert fb.resources.own_seconds > plain.resources.own_seconds
    assert "error feedback's pass" in fb.extra["time (estimate)"]
    # 512 tokens: every window is paired (two streams); --feedback-reference 0 carries none
    [own] = api.plan(str(tiny_gguf_source), ["gguf:Q4_K_M"], tmp_path,
                     options={**options, "error_feedback": True, "feedback_reference": 0})
    assert fb.resources.stream == 2 * own.resources.stream > 0


@pytest.mark.parametrize("flags, says", [(["--error-feedback", "--feedback-reference", "1.5"], "from 0 to 1"),
                                         (["--feedback-reference", "0.5"], "--error-feedback")])
def test_a_bad_feedback_reference_is_refused_in_one_line(tiny_gguf_source, calib_text, tmp_path, flags, says):
    r = run_cli("convert", str(tiny_gguf_source), "-o", str(tmp_path), "-f", "gguf:Q4_K_M", "--calib", str(calib_text),
                *CALIB, *flags)
    assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert not list(tmp_path.iterdir())


def test_without_a_reference_it_aims_at_its_own_inputs_output(tiny_gguf_source, calib_text, tmp_path, monkeypatch):
    """--feedback-reference 0: the pass carries no reference stream (no group gets one) and each linear aims at
    W·x, as GPTQ does; another file than the paired one, and its record says which target it took."""
    from quantkit.backends.gguf.feedback_job import FeedbackEncoder
    from quantkit.publish.record import read_record
    options = {"error_feedback": True, "calib": str(calib_text), "calib_samples": 8, "calib_seqlen": 64,
               "tokenizer_pre": "gpt-2", "resume": False}
    seen = []
    real = FeedbackEncoder.observe

    def observe(self, ctx, group, x, reference=None):
        seen.append(reference is not None)
        return real(self, ctx, group, x, reference)
    monkeypatch.setattr(FeedbackEncoder, "observe", observe)
    [own] = api.convert(str(tiny_gguf_source), ["gguf:Q2_K"], tmp_path / "own",
                        options={**options, "feedback_reference": 0})
    assert seen and not any(seen)
    seen.clear()
    [paired] = api.convert(str(tiny_gguf_source), ["gguf:Q2_K"], tmp_path / "paired", options=dict(options))
    assert all(seen)
    assert tensors(own) != tensors(paired)
    assert "own inputs" in read_record(own)["quantization"]["target"]
    assert "100% of the calibration windows" in read_record(paired)["quantization"]["target"]
