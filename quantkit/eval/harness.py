"""Perplexity, KL divergence and top-1 agreement, the same way for every format.

The evaluated model and the base model are both run layer by layer over all
windows at once (one layer's weights in memory at a time); only the final hidden
states of each are kept, and logits are formed one window at a time, so memory
stays at one layer + activations + one window's logits whatever the model size.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..errors import DataError, UsageError
from ..model.engine import Runtime, apply_norm, embed, run_block, softcap
from ..progress import Progress, null_progress


class DenseModel(Protocol):
    """What the harness needs from a model: a checkpoint, or an artifact dequantized by its reader."""
    name: str
    config: object
    adapter: object
    num_layers: int

    def block(self, i: int): ...   # layer i's block description (quantkit.model.block.Block)
    pieces: object                   # ModelPieces: embedding scale, final norm, softcap
    def embed_weight(self) -> torch.Tensor: ...
    def layer(self, i: int) -> dict[str, torch.Tensor]: ...
    def final_norm_weight(self) -> torch.Tensor: ...
    def lm_head_weight(self) -> torch.Tensor: ...


@dataclass
class EvalResult:
    model: str
    base: str | None
    data: str
    ctx: int
    windows: int
    tokens_scored: int
    perplexity: float
    base_perplexity: float | None = None
    mean_kld: float | None = None
    top1_agreement: float | None = None
    runtime: str = "quantkit"
    kv_cache: str | None = None            # the runtime's K/V cache type, when one was asked for
    kv_cache_bytes: int | None = None      # that cache's bytes at ctx tokens

    def to_dict(self) -> dict:
        return asdict(self)


def load_windows(tokenizer, data: Path, ctx: int, windows: int) -> torch.Tensor:
    """Tokenize the whole text (no special tokens) and cut `windows` non-overlapping windows of `ctx`."""
    if ctx < 2 or windows < 1:
        raise UsageError("--ctx must be at least 2 and --windows at least 1")
    try:
        text = Path(data).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{data}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{data}: cannot read as UTF-8 text ({e})") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    have = len(ids) // ctx
    if have < windows:
        raise DataError(f"{data}: {len(ids)} tokens make only {have} windows of {ctx}; asked for {windows}")
    return torch.tensor(ids[: windows * ctx], dtype=torch.long).view(windows, ctx)


@torch.no_grad()
def final_hidden_states(model: DenseModel, tokens: torch.Tensor, *, device="cpu", dtype=torch.float32,
                        batch: int = 8, progress: Progress = null_progress, label: str = "") -> torch.Tensor:
    """Run every window through the model layer by layer; return the final-norm hidden states."""
    pieces = model.pieces
    h = embed(model, tokens, dtype)  # (windows, ctx, hidden) on the CPU; moved per batch
    rt = Runtime(tokens.shape[1], device, dtype)
    task = progress.task(f"{label} layers", total=model.num_layers)
    runtime_acts = getattr(model, "activation_fns", None)  # set when emulating a runtime's arithmetic
    runtime_linears = getattr(model, "linear_fns", None)
    for i in range(model.num_layers):
        w = {k: v.to(device) for k, v in model.layer(i).items()}
        layer_rt = rt
        if runtime_acts or runtime_linears:
            layer_rt = rt.with_acts(runtime_acts(i) if runtime_acts else None,
                                    runtime_linears(i) if runtime_linears else None)
        block = model.block(i)
        for s in range(0, h.shape[0], batch):
            chunk = h[s:s + batch].to(device)
            h[s:s + batch] = run_block(block, chunk, w, layer_rt).to(h.device)
        del w
        task.advance()
    task.done()
    return apply_norm(pieces.final_norm, h, {f"{pieces.final_norm.weight}.weight": model.final_norm_weight()})


class Scores:
    """Accumulates NLL (model and base), KL(base ‖ model) and top-1 agreement window by window."""

    def __init__(self):
        self.nll = self.nll_base = self.kld = 0.0
        self.agree = self.n = 0
        self.has_base = False

    def add(self, logits: torch.Tensor, targets: torch.Tensor, base_logits: torch.Tensor | None = None) -> None:
        """logits: (ctx-1, vocab) predicting targets (ctx-1,)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        self.nll -= logp.gather(-1, targets[:, None]).sum().item()
        self.n += targets.numel()
        if base_logits is not None:
            self.has_base = True
            logp_b = torch.log_softmax(base_logits.float(), dim=-1)
            self.nll_base -= logp_b.gather(-1, targets[:, None]).sum().item()
            self.kld += (logp_b.exp() * (logp_b - logp)).sum().item()
            self.agree += (logp_b.argmax(-1) == logp.argmax(-1)).sum().item()

    def result(self, *, model: str, base: str | None, data: str, ctx: int, windows: int) -> EvalResult:
        b = self.has_base
        return EvalResult(model=model, base=base, data=data, ctx=ctx, windows=windows, tokens_scored=self.n,
                          perplexity=math.exp(self.nll / self.n),
                          base_perplexity=math.exp(self.nll_base / self.n) if b else None,
                          mean_kld=self.kld / self.n if b else None,
                          top1_agreement=self.agree / self.n if b else None)


def window_logits(model: DenseModel, tokens: torch.Tensor, *, device="cpu", dtype=torch.float32,
                  progress: Progress = null_progress):
    """Yield each window's logits (ctx, vocab), computed from layer-by-layer hidden states."""
    h = final_hidden_states(model, tokens, device=device, dtype=dtype, progress=progress, label=model.name)
    head = model.lm_head_weight().to(device, dtype)
    head_act = getattr(model, "head_activation_fn", None)
    cap = model.pieces.logit_softcap
    for wi in range(tokens.shape[0]):
        x = h[wi].to(device)
        yield softcap((head_act(x) if head_act else x) @ head.T, cap)


@torch.no_grad()
def evaluate(model: DenseModel, tokens: torch.Tensor, *, base: DenseModel | None = None, device="cpu",
             dtype=torch.float32, data_name: str = "", progress: Progress = null_progress,
             model_logits=None) -> EvalResult:
    """Perplexity of `model` on `tokens` (windows × ctx); with `base`, KL(base ‖ model) and top-1 agreement.

    `model_logits` (optional) replaces quantkit's own forward for the evaluated model with another runtime's
    logits (an iterator of (ctx, vocab) tensors), e.g. llama.cpp's for a GGUF file."""
    ours = model_logits if model_logits is not None else window_logits(model, tokens, device=device, dtype=dtype,
                                                                       progress=progress)
    theirs = window_logits(base, tokens, device=device, dtype=dtype, progress=progress) if base is not None else None
    scores = Scores()
    task = progress.task("scoring windows", total=tokens.shape[0])
    for wi in range(tokens.shape[0]):
        logits = next(ours)
        base_logits = next(theirs) if theirs is not None else None
        scores.add(logits[:-1].to(device), tokens[wi, 1:].to(device),
                   None if base_logits is None else base_logits[:-1])
        task.advance()
    task.done()
    return scores.result(model=model.name, base=None if base is None else base.name, data=data_name,
                         ctx=tokens.shape[1], windows=tokens.shape[0])
