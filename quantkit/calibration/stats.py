"""Statistics of a linear's inputs that quantizers share (GPTQ and EXL2 use the Hessian XᵀX)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch


@contextmanager
def _bf16_products_on_cpu(active: bool):
    """Let oneDNN compute a float32 matmul with bf16 multiplies and float32 accumulation.  Exact when the
    inputs are bf16 values (every product of two bf16 numbers fits a float32), and ~3× faster here."""
    mkldnn = getattr(torch.backends, "mkldnn", None)
    matmul = getattr(mkldnn, "matmul", None)
    if not active or matmul is None or not hasattr(matmul, "fp32_precision"):
        yield
        return
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before


class HessianAccumulator:
    """Running XᵀX / n in float32 over batches of input rows (tokens × in_features).

    The mean (not the sum) keeps values in a fixed range however many tokens are seen; GPTQ's damping is
    relative to diag(H), so the scale does not change the result.  Pass the inputs in the dtype the linear
    computes in: bf16 inputs are accumulated exactly (float32 sums of exact products)."""

    def __init__(self, features: int, device: torch.device):
        self.H = torch.zeros(features, features, dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        exact_bf16 = x.dtype == torch.bfloat16 and self.H.device.type == "cpu"
        x = x.reshape(-1, x.shape[-1]).to(self.H.device, torch.float32)
        n = x.shape[0]
        total = self.rows + n
        self.H.mul_(self.rows / total)
        with _bf16_products_on_cpu(exact_bf16):
            self.H.addmm_(x.T, x, alpha=1.0 / total)
        self.rows = total

    def value(self) -> torch.Tensor:
        return self.H


def native_bf16(device) -> bool:
    """Whether `device` is a CPU that multiplies bf16 in hardware (AVX512-BF16 or AMX): there a bf16 matmul takes
    about half a float32 one's time (0.049 s against 0.106 s for a 1536 × 4096 × 1536 product on an AMD EPYC with
    AVX512-BF16); without them torch may emulate it, slower than float32."""
    if torch.device(device).type != "cpu":
        return False
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


class Fold(NamedTuple):
    """One half of a ReferenceHessian's paired rows: W·D and H over them, and how many there are."""
    WD: torch.Tensor
    H: torch.Tensor
    rows: int


class ReferenceHessian:
    """H = XᵀX / n of a linear's inputs X as the quantized model produces them, and D = (X_ref − X)ᵀX / m with
    X_ref the unquantized model's inputs for the same tokens: what a quantizer needs to aim at the unquantized
    model's output, W·x_ref, rather than at W·x (the least-squares target is W + W·D·H⁻¹).  The reference may cover
    only the first rows of a batch (the pass carries the unquantized stream for a share of the windows,
    context.paired_spans, or none inside a routed expert): D is then the mean over the m rows that have one, and
    the target's H⁻¹ comes from those same rows (`paired_value`), so that the two estimate one regression of
    X_ref − X on X: its error then shrinks with what X does not explain, not with all of X_ref − X.

    The paired rows accumulate in two halves (the first half of each batch's, and the rest), so that a quantizer
    can test the regression fitted on one on the other (`folds`); the unpaired rows apart; `value`, `paired_value`
    and `D` combine them (every row counts in H).  Each row is added once: the halves cost one K × K more, no time.

    With `project` (the group's weights W, O × K, see output_projection) D is kept as W·D (O × K) instead:
    W·(X_ref − X)ᵀX / m costs 2·O·K per token where D costs K², the lesser for a wide MLP's down projection
    (`projected` says which).

    D's products (and W·D's, `shift` / `folds`) take bf16 factors, summed in float32 and rounded to bf16 per
    product, where the CPU does that natively (`native_bf16`), unless `bf16_products` says otherwise: D is a
    mean over tokens whose sampling noise, the noise the quantizer's trust in it guards against, is far above
    bf16's rounding (2⁻⁹ relative), and the products cost about what H's do.  H stays float32: GPTQ's loop
    inverts it."""

    def __init__(self, features: int, device: torch.device, bf16_products: bool | None = None):
        self.features, self.device = features, device
        self.bf16_products = native_bf16(device) if bf16_products is None else bf16_products
        self.halves: list[HessianAccumulator | None] = [None, None]   # the rows with a reference
        self.D_halves: list[torch.Tensor | None] = [None, None]
        self.unpaired: HessianAccumulator | None = None               # the rest
        self.projected = False

    @property
    def paired_rows(self) -> int:
        return sum(half.rows for half in self.halves if half is not None)

    @property
    def rows(self) -> int:
        return self.paired_rows + (self.unpaired.rows if self.unpaired is not None else 0)

    def add(self, x: torch.Tensor, reference: torch.Tensor | None = None,
            project: torch.Tensor | None = None) -> None:
        x = x.reshape(-1, x.shape[-1])
        m = 0 if reference is None else reference.numel() // x.shape[-1]    # a reference is of the first rows
        if m < x.shape[0]:
            self.unpaired = self.unpaired or HessianAccumulator(self.features, self.device)
            self.unpaired.add(x[m:])
        if not m:
            return
        if any(D is not None for D in self.D_halves) and self.projected != (project is not None):
            raise ValueError("a group's reference batches must all be projected or none")
        self.projected = project is not None
        low = torch.bfloat16 if self.bf16_products else torch.float32
        if x.dtype == reference.dtype == low:   # bf16 streams: a bf16 difference is float32's, rounded once
            xs = x[:m].to(self.device)
            delta = reference.reshape(m, -1).to(self.device) - xs
        else:
            xs = x[:m].to(self.device, torch.float32)
            delta = (reference.reshape(m, -1).to(self.device, torch.float32) - xs).to(low)
            xs = xs.to(low)
        if project is not None:
            delta = delta @ project.to(self.device, delta.dtype).T
        h = m // 2
        for i, rows in enumerate((slice(0, h), slice(h, m))):
            if rows.stop == rows.start:
                continue
            half = self.halves[i] = self.halves[i] or HessianAccumulator(self.features, self.device)
            before = half.rows
            half.add(x[rows])
            if self.D_halves[i] is None:
                self.D_halves[i] = torch.zeros(delta.shape[1], xs.shape[1], dtype=torch.float32, device=self.device)
            D = self.D_halves[i]
            D.mul_(before / half.rows)
            if delta.dtype == D.dtype:    # float32: in place, no K × K temporary on the hot path
                D.addmm_(delta[rows].T, xs[rows], alpha=1.0 / half.rows)
            else:                         # bf16 factors: addmm_ wants one dtype, so the product is summed in
                D.add_(delta[rows].T @ xs[rows], alpha=1.0 / half.rows)

    @staticmethod
    def _mean(parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor | None:
        parts = [(t, n) for t, n in parts if n]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0][0]
        total = sum(n for _, n in parts)
        return sum(t * (n / total) for t, n in parts)

    def value(self) -> torch.Tensor:
        """H over every row."""
        parts = [part for part in (*self.halves, self.unpaired) if part is not None]
        return self._mean([(part.H, part.rows) for part in parts])

    def paired_value(self) -> torch.Tensor | None:
        """H over the rows that have a reference (the target's, see the class docstring), or None."""
        return self._mean([(half.H, half.rows) for half in self.halves if half is not None])

    @property
    def D(self) -> torch.Tensor | None:
        return self._mean([(D, half.rows) for D, half in zip(self.D_halves, self.halves) if half is not None])

    def shift(self, W: torch.Tensor, rows: torch.Tensor | slice | None = None) -> torch.Tensor | None:
        """W·D for weights W (N × K), or None before any reference: with a projected D, its `rows` (those of
        W among the group's O), else W @ D."""
        D = self.D
        return None if D is None else self._times(W, D, rows)

    def folds(self, W: torch.Tensor, rows: torch.Tensor | slice | None = None) -> tuple[Fold, Fold] | None:
        """Each half of the paired rows' `shift` and `paired_value`, for testing the regression fitted on one on
        rows it was not fitted to (gguf.feedback.trusted_shift); None unless both halves have rows."""
        if any(half is None for half in self.halves):
            return None
        return tuple(Fold(self._times(W, D, rows), half.H, half.rows) for D, half in zip(self.D_halves, self.halves))

    @property
    def all_paired(self) -> bool:
        """Every row has a reference: `paired_value` is then `value`."""
        return self.unpaired is None

    def _times(self, W: torch.Tensor, D: torch.Tensor, rows) -> torch.Tensor:
        if self.projected:
            return D[rows if rows is not None else slice(None)].to(W.device)
        if self.bf16_products:      # as D's own products (see the class docstring)
            return (W.to(torch.bfloat16) @ D.to(W.device, torch.bfloat16)).float()
        return W.float() @ D.to(W.device)


def output_projection(source: dict[str, torch.Tensor], linears, device) -> torch.Tensor | None:
    """The stacked source weights (O × K, float32) of a group's linears, for ReferenceHessian's `project`, when
    keeping W·D is the cheaper (2·O < K: a down projection wider than twice its output); else None."""
    weights = [source[f"{name}.weight"] for name in linears]
    rows, features = sum(w.shape[0] for w in weights), weights[0].shape[1]
    if 2 * rows >= features:
        return None
    return torch.cat([w.to(device, torch.float32) for w in weights])


class SquareMeanAccumulator:
    """Per input column, the mean of x² over all tokens: llama.cpp's importance matrix for one linear."""

    def __init__(self, features: int, device: torch.device):
        self.sum = torch.zeros(features, dtype=torch.float64, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.sum.device, torch.float32)
        self.sum += x.square().sum(dim=0, dtype=torch.float64)
        self.rows += x.shape[0]

    def float_sums(self) -> np.ndarray:
        """The sums in float32, as llama-imatrix keeps them (and its files store them)."""
        return self.sum.to(torch.float32).cpu().numpy()

    def value(self) -> torch.Tensor:
        return torch.from_numpy(mean_of_sums(self.float_sums(), max(self.rows, 1)))


def mean_of_sums(sums: np.ndarray, count: int) -> np.ndarray:
    """float32 sums / the count as a float32, one correctly rounded division: how llama-quantize turns an
    importance-matrix file's sums and token count into the vector it weights with.  The collector's mean is made
    the same way, so that a matrix written to a file and read back is the one the collecting run used, bit for bit."""
    return np.asarray(sums, dtype=np.float32) / np.float32(count)


class GroupStats(dict):
    """Input group (the linears that read one input) -> an accumulator of that input, made on its first batch.
    A quantizer's job keeps one and pops a group's accumulator when it quantizes that group."""

    def __init__(self, accumulator=HessianAccumulator, device: torch.device | str = "cpu"):
        super().__init__()
        self.accumulator, self.device = accumulator, device

    def add(self, group, x: torch.Tensor, **more) -> None:
        acc = self.get(group.linears)
        if acc is None:
            acc = self[group.linears] = self.accumulator(x.shape[-1], self.device)
        acc.add(x, **more)
