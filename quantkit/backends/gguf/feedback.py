"""GGUF with GPTQ's error feedback: each linear quantized column by column in llama.cpp's own block format,
every column's rounding error pushed onto the columns not yet quantized through the inverse Hessian.

    W (N, K)  — a linear's weight as GGUF stores it (rows = outputs, each row a run of blocks along K).
    H (K, K)  — Σ xxᵀ/n of the linear's calibration inputs (the shared pass's HessianAccumulator).

For each block of `bs` columns (256 for the K-quants, 32 for the legacy and IQ4_NL types), in the order below:
1. llama.cpp's own search (encoders.quantize, importance-weighted) runs on the block's error-updated weights
   and fixes the block's header: the super-block scale and minimum and the sub-block scales, exactly as
   llama-quantize would choose them for these values.
2. The block's columns are then quantized one by one on that fixed grid: each value takes its nearest code
   (the grid is per value: offset + scale · level, CODE_LAYOUTS), e = (w − q) / U[i, i], and the error goes to
   the later columns: w_{j>i} −= e · U[i, j] (the GPTQ update, in lazy batches of whole blocks as in
   gptq/algorithm.py, and of 16 columns inside them).
3. The codes are packed into the block under the search's header (encoders.with_codes).

The order.  A block's header must be chosen before its columns are (the 6-bit sub-block scales of a K-quant
are quantized together against one super-block scale), so within a block the error of its first columns
reaches its later ones only through their codes, never through the header; the search sees every error of
the blocks visited before.  Act-order's permutation cannot be stored (the file keeps llama.cpp's order), but the
visiting order is free as long as each block is visited whole, its codes landing in their own places: blocks
are visited most active input first and the columns inside a block by activity (gptq's group-aware
`visiting_order`).  Measured on random layers with correlated inputs (tests/test_gguf_feedback.py's `layer`,
K = 1024): output error against the importance-matrix quant 0.750 in file order and 0.724 in this order at
Q4_K (Q3_K 0.756 / 0.731, Q6_K 0.738 / 0.713, Q2_K 0.788 / 0.768).  Searching a block's header a second time on
the values its columns had when they were rounded (and redoing the block) was tried and gave nothing
consistent (Q4_K 0.725, Q2_K 0.781, Q6_K 0.703) at twice the cost, so the header is searched once.

The target.  Each linear's inputs x come from the file's own already-quantized layers (true sequential), so they
carry the error of every layer before; plain GPTQ makes Q·x close to W·x and leaves that error in place.  Given
also the unquantized model's inputs for the same tokens, x_ref (the capture pass's reference stream), the
column loop runs on W' = W + W·D·H⁻¹ (D = E[(x_ref − x)xᵀ]), the least-squares weights that map the file's
inputs to the unquantized model's outputs, so the same loop makes Q·x close to W·x_ref: each layer takes back
what the layers before it lost, where its inputs let it (the asymmetric target of GPTAQ, Li et al. 2025; the
formula here is the plain least-squares one).  Measured on the demo at Q4_K_M, 128 × 512 calibration tokens,
wikitext-2 test in llama.cpp, same machine: mean KLD 0.0177 against 0.0265 without it (perplexity 29.66 against
29.82; the imatrix file: 0.0371, 30.03).  The reference stream costs about what the rest of the pass does, so by
default it covers half of the windows above 32 k tokens (calibration.context.reference_share), and the H⁻¹ of
the target is then that of the paired rows, D's own (`reference_hessian`): 0.0190 (2026-12-07), where H over
every row gave 0.0209.

How far to go toward the target is measured, not assumed.  W·D·H⁻¹ is a regression with a coefficient per input
and output row; fitted on few tokens for its width, it learns their noise: on the demo at 8 × 512 tokens
(every window paired; K = 1536 for down_proj) the target made the file worse than GPTQ's own-input target
(mean KLD 0.0358 against 0.0263), and on Qwen2.5-Coder at Q4_K_M (64 × 512, K = 8960) worse than the imatrix
file.  So the paired rows accumulate in two halves (ReferenceHessian.folds) and each row's shift is scaled by
the α ∈ [0, 1] under which each half's regression best predicts the other half (`trusted_shift`).
Measured on the demo at Q4_K_M (wikitext-2 test, 40 windows, in llama.cpp, 2026-12-07): at 8 × 512 tokens mean
KLD 0.0210 (mean α 0.19), at the default 128 × 512 (half paired) 0.0163 against 0.0188 at α = 1 (mean α 0.57);
Q3_K_M 0.0445 against 0.0601, Q2_K 0.1168 against 0.1401.  On Qwen2.5-Coder at Q4_K_M (64 × 512, every window
paired, with the row choice below): 0.0138 against 0.0158 at α = 1 and the imatrix file's 0.0147 (mean α 0.29).
Each half's regression goes through the target's own H⁻¹ (the loop's when every row is paired), not its own
H_A⁻¹: the halves then differ in D, whose noise is what the trust measures, and the trust costs four
products (bf16 where native) and no factorisation.  On Qwen's shapes (A/B in one process, 2026-12-07) that is
2.9 s against 9.6 s for a down_proj (1536 × 8960) and 1.7 s against 3.3 s for gate_up (17920 × 1536); each
half's own factorisation had cost a Qwen layer 12.7 s.  The shift itself is then the two fits' mean by rows (D
is the halves' mean), no product of its own.  Measured in one run with GPTQ each (2026-12-07 night,
bench/results/gguf_feedback.md): the demo at Q4_K_M 0.0168 (mean α 0.62) in 1.39x GPTQ's time, Qwen at Q4_K_M
0.0139 (mean α 0.33) in 1.51x, the shift (like the trust) from bf16 products; before it and the column loop's
runs of 16 (INNER_COLUMNS), with the shift a float32 product of its own, 0.0166 in 1.46x and 0.0140 in 1.70x.
The same code on Qwen at Q2_K (2026-12-07/08 night, one run with GPTQ): 0.2009 against the imatrix file's 0.2976 (mean α
0.53, 1,025 rows of 797,056 kept the plain search) in 1.52x.

Row by row, the better of two.  GGUF rows are independent (each is its own run of blocks) and so is the
objective, tr((W'−Q)·H·(W'−Q)ᵀ), row by row; so after the column loop each row keeps whichever of its two
candidates scores lower on it: the loop's, or the importance-weighted search of the original row (what the
imatrix file stores).  The loop is greedy and the target moves the row off any grid it already sat on; a
checkpoint dequantized from a GGUF of the same type re-finds its grid on the original rows almost exactly
(Qwen2.5-Coder's, ../shared/models/build.sh), where the target aimed through the loop came out worse than the
imatrix file (mean KLD 0.0165 against 0.0147, bench/results/gguf_feedback.md); with the choice (before the
trust above) 611,251 of its 797,056 rows kept the plain search and the file came to 0.0158, with the trust
400,639 rows and 0.0138.  On a model that
never went through the grid the loop's rows win nearly everywhere (the demo: 3,088 of 204,672 kept the plain).

The result is an ordinary block of the same type: same file size to the byte, loaded by every llama.cpp.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..gptq.algorithm import GPTQSettings, dampened_inverse, visiting_order
from ...calibration.stats import native_bf16
from ...errors import QuantizationError
from . import encoders
from .block_headers import block_grid

SUPPORTED = frozenset(encoders.CODE_LAYOUTS)
REFERENCE_DAMP = 0.01   # of mean diag H, for the least-squares target (see target_inverse)
LAZY_COLUMNS = 256   # columns quantized before the rest of the matrix gets their errors, in one matmul
# within those, the columns that pass their errors on one by one (the rest of the 256 get them by matmul too):
# a 17920 × 1536 gate_up at Q4_K took 7.6 s with all 256 one by one, 3.8 s with 16 (2026-12-07, 2 cores)
INNER_COLUMNS = 16


@dataclass
class FeedbackResult:
    data: np.ndarray        # (N, bytes per row) uint8: the GGUF tensor's rows
    weight: torch.Tensor    # (N, K) float32: what llama.cpp decodes them to
    damp: float             # the dampening used (relative to mean diag H)
    loss: float             # Σ e² / 2, the proxy GPTQ minimises, over the column loop's rows
    plain_rows: int = 0     # rows that kept the importance-weighted search of the original weights instead
    trust: float = 1.0      # mean over rows of trusted_shift's α (1 without folds)


def nearest_codes(w: torch.Tensor, offset: torch.Tensor, inverse: torch.Tensor, levels: torch.Tensor,
                  uniform: bool) -> torch.Tensor:
    """The code of the grid value nearest to each of w (same shapes as offset and inverse, the reciprocal of
    the scale, 0 where the scale is: every code then decodes to the offset, and code 0 is taken)."""
    t = (w - offset).mul_(inverse)
    if uniform:
        return t.sub_(levels[0]).round_().clamp_(0, levels.numel() - 1)
    return torch.bucketize(t, (levels[1:] + levels[:-1]) / 2).to(t.dtype)


def target_inverse(H: torch.Tensor, damp: float = REFERENCE_DAMP) -> torch.Tensor:
    """H⁻¹ for the target W' = W + W·D·H⁻¹ when its H is not the column loop's (only some rows paired), H
    dampened by `damp` × its mean diagonal as the loop dampens its own.  W' minimises Σ‖W·x_ref − W'·x‖² over the
    calibration tokens, given H = E[xxᵀ] and W·D, D = E[(x_ref − x)xᵀ] (calibration.stats.ReferenceHessian):
    quantizing W' with the usual H loss then aims at the unquantized model's output, ‖W·X_ref − Q·X‖² =
    ‖W'·X − Q·X‖² + a term Q does not change."""
    H = H.float().clone()
    diag = H.diagonal()
    dead = diag == 0
    diag.add_(damp * diag.mean())
    diag[dead] = 1
    return torch.cholesky_inverse(torch.linalg.cholesky(H))


def trusted_shift(folds, inverse: torch.Tensor, perm: torch.Tensor | None = None):
    """(shift, α): the target's shift W·D·H⁻¹ in the column loop's visiting order `perm`, and per row the
    α ∈ [0, 1] to scale it by, from the two halves of the paired rows (`folds`: ReferenceHessian.folds).

    α is the factor whose shift α·Δ_A, Δ_A = W·D_A·H⁻¹ fitted on one half, leaves the least error
    ‖W·x_ref − (W + α·Δ_A)·x‖² on the other half, both ways.  Per half B and row, that error is −2α·(W·D_B)·Δ_A +
    α²·Δ_A·H_B·Δ_A plus what α does not change, so α = Σ (W·D_B)·Δ_A / Σ Δ_A·H_B·Δ_A over the two ways.  The
    regression has a coefficient per input and row: fitted on few tokens for its width it learns their noise,
    and α falls to what carries over to other tokens.  D is the halves' mean by rows, so the shift is their
    Δ's mean: no product of its own.

    Both halves' regressions use `inverse`, the target's own H⁻¹ with its columns in visiting order; why, and
    what it saves, is in the module docstring.  The products are bf16 with float32 sums where the CPU multiplies
    bf16 natively (each product rounded to bf16): α is a ratio of sums over a row and the shift a mean over
    tokens, both far coarser than bf16's rounding; measured, the files kept their KLD (module docstring)."""
    device = inverse.device
    dtype = torch.bfloat16 if native_bf16(device) else torch.float32
    P = inverse.to(dtype)
    order = slice(None) if perm is None else perm.to(device)
    back = slice(None) if perm is None else torch.argsort(order)
    fitted = [(WD.to(device, torch.float32)[:, order].to(dtype) @ P) for WD, _, _ in folds]   # visiting order
    num = den = 0
    for Da, (WDb, Hb, _) in zip(fitted, folds[::-1]):
        Da = Da[:, back]
        num = num + (WDb.to(device, torch.float32) * Da.float()).sum(1)
        den = den + ((Da @ Hb.to(device, dtype)).float() * Da.float()).sum(1)
    alpha = torch.where(den > 0, num / den.clamp(min=torch.finfo(torch.float32).tiny), 0).clamp(0, 1)
    total = sum(rows for _, _, rows in folds)
    shift = sum(Da.float().mul_(rows / total) for Da, (_, _, rows) in zip(fitted, folds))
    return shift, alpha


def feedback_quantize(W: torch.Tensor, H: torch.Tensor, qtype: GGMLQuantizationType,
                      importance: torch.Tensor | None = None, settings: GPTQSettings = GPTQSettings(),
                      reference: torch.Tensor | None = None,
                      reference_hessian: torch.Tensor | None = None, plain_rows: bool = True,
                      folds=None) -> FeedbackResult:
    """Quantize W (N, K) to `qtype` given H (K, K); `importance` (K,) weights the search (default: diag H,
    the mean square of each input, which is what llama-imatrix collects).  `reference` (N, K): W·D (see
    `target_inverse`), to aim at the unquantized model's output instead of W·x; `reference_hessian`: the H of
    the rows D was taken from, when only some had a reference (calibration.stats.ReferenceHessian); `folds`
    (ReferenceHessian.folds): the shift from the two halves of the paired rows instead, each row's scaled by its
    trust (`trusted_shift`; `reference` is then ignored).  `plain_rows=False` keeps every
    row of the column loop (to compare with)."""
    qtype = GGMLQuantizationType(qtype)
    original, objective = W, H
    if qtype not in SUPPORTED:
        raise ValueError(f"error feedback does not cover {qtype.name}")
    W = W.float().clone()
    H = H.float().clone()
    N, K = W.shape
    bs, ts = GGML_QUANT_SIZES[qtype]
    if K % bs:
        raise ValueError(f"{qtype.name}: row length {K} is not a multiple of the block size {bs}")
    if not torch.isfinite(H).all():
        raise QuantizationError("the calibration Hessian is not finite (NaN/inf activations)")
    if not torch.isfinite(W).all():
        raise QuantizationError("the weights contain NaN or inf")
    if importance is None:
        importance = torch.diag(H).clone()
    importance = importance.float().cpu()
    dead = torch.diag(H) == 0      # inputs that never fire: their columns take no error and give none
    H[dead, dead] = 1
    # The visiting order is free as long as every block is visited whole: the bytes stay in the file's order.
    perm, _ = visiting_order(torch.diag(H), bs, settings)
    W, H = W[:, perm], H[perm][:, perm]
    inverse, U, damp = dampened_inverse(H, settings)
    del H
    trust = 1.0
    if reference is not None or folds is not None:
        # The target W + W·D·H⁻¹ in visiting order, from the loop's own H⁻¹ when its H is the target's (every
        # row paired: no factorisation of its own, 3 s of a Qwen2.5-Coder down_proj).
        if reference_hessian is not None:
            del inverse
            inverse = target_inverse(reference_hessian.to(W.device)[perm[:, None], perm])
        if folds is not None:
            shift, alpha = trusted_shift(folds, inverse, perm)
            shift.mul_(alpha.unsqueeze(1))
            trust = float(alpha.mean())
        else:
            shift = reference.to(W.device, torch.float32)[:, perm] @ inverse
        W.add_(shift)
        del shift
    del inverse
    target = W[:, torch.argsort(perm)] if plain_rows else None
    levels = torch.tensor(encoders.CODE_LAYOUTS[qtype].levels, dtype=torch.float32, device=W.device)
    uniform = bool((levels[1:] - levels[:-1] == 1).all())
    out = np.empty((N, K // bs * ts), dtype=np.uint8)
    Q = torch.empty_like(W)        # in visiting order
    d_list = torch.diag(U).tolist()
    loss = 0.0
    lazy = max(LAZY_COLUMNS // bs, 1) * bs
    for i1 in range(0, K, lazy):
        i2 = min(i1 + lazy, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        for b0 in range(0, i2 - i1, bs):
            c0 = i1 + b0
            cols = perm[c0:c0 + bs]                  # one block of the file, in visiting order
            first = int(cols.min())
            at = (cols - first).to(W.device)         # each visited column's place in its block
            stored = torch.empty_like(at)
            stored[at] = torch.arange(bs, device=W.device)
            data = encoders.quantize(W1[:, b0:b0 + bs][:, stored], qtype, imatrix=importance[first:first + bs])
            offset, scale = (t.to(W.device)[:, at].t().contiguous() for t in block_grid(data, qtype, (N, bs)))
            inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
            codes = torch.empty(bs, N, device=W.device)
            for s0 in range(b0, b0 + bs, INNER_COLUMNS):
                s1 = min(s0 + INNER_COLUMNS, b0 + bs)       # a run never leaves its block
                for i in range(s0, s1):
                    j = i - b0
                    w = W1[:, i]
                    c = nearest_codes(w, offset[j], inverse[j], levels, uniform)
                    q = torch.addcmul(offset[j], scale[j], c if uniform else levels[c.long()])
                    codes[j], Q[:, c0 + j] = c, q
                    err = q.neg_().add_(w).div_(d_list[c0 + j])          # (w − q) / U[i, i]
                    Err1[:, i] = err
                    W1[:, i + 1:s1].addr_(err, U1[i, i + 1:s1], alpha=-1)
                W1[:, s1:].addmm_(Err1[:, s0:s1], U1[s0:s1, s1:], alpha=-1)
            out[:, first // bs * ts:(first // bs + 1) * ts] = encoders.with_codes(data, qtype, codes[stored].t())
        W[:, i2:].addmm_(Err1, U[i1:i2, i2:], alpha=-1)
        loss += 0.5 * Err1.pow(2).sum().item()
    Q = Q[:, torch.argsort(perm)]
    kept = 0
    if plain_rows:
        plain = encoders.quantize(original, qtype, imatrix=importance)
        P = encoders.dequantize(plain, qtype, Q.shape).to(Q.device)
        # δ_P·H·δ_Pᵀ − δ_Q·H·δ_Qᵀ = (Q − P)·H·(2W' − P − Q)ᵀ for each row (δ = W' − ·, H symmetric): one product,
        # bf16 where native (a choice between two candidates: one within bf16's rounding of the other is a tie)
        low = torch.bfloat16 if native_bf16(Q.device) else torch.float32
        gain = ((Q - P).to(low) @ objective.to(Q.device, low)).float().mul_(2 * target - P - Q).sum(1)
        better = gain < 0
        kept = int(better.sum())
        if kept:
            rows = better.cpu().numpy()
            out[rows] = plain[rows]
            Q[better] = P[better]
    return FeedbackResult(out, Q, damp, loss, kept, trust)
