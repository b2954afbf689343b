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
from ..model.decoder import decoder_layer, rms_norm, rope_tables
from ..progress import Progress, null_progress


class DenseModel(Protocol):
    """What the harness needs from a model: a checkpoint, or an artifact dequantized by its reader."""
    name: str
    config: object
    adapter: object
    num_layers: int

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
    cfg, adapter = model.config, model.adapter
    emb = model.embed_weight()
    h = emb[tokens].to(dtype)  # (windows, ctx, hidden) on the CPU; moved per batch
    del emb
    rope = rope_tables(cfg, tokens.shape[1], device, dtype)
    task = progress.task(f"{label} layers", total=model.num_layers)
    for i in range(model.num_layers):
        w = {k: v.to(device) for k, v in model.layer(i).items()}
        for s in range(0, h.shape[0], batch):
            chunk = h[s:s + batch].to(device)
            h[s:s + batch] = decoder_layer(chunk, w, cfg, adapter, rope).to(h.device)
        del w
        task.advance()
    task.done()
    return rms_norm(h, model.final_norm_weight().to(dtype), cfg.rms_norm_eps)


@torch.no_grad()
def evaluate(model: DenseModel, tokens: torch.Tensor, *, base: DenseModel | None = None, device="cpu",
             dtype=torch.float32, data_name: str = "", progress: Progress = null_progress) -> EvalResult:
    """Perplexity of `model` on `tokens` (windows × ctx); with `base`, KL(base ‖ model) and top-1 agreement."""
    h = final_hidden_states(model, tokens, device=device, dtype=dtype, progress=progress, label=model.name)
    hb = None
    if base is not None:
        hb = final_hidden_states(base, tokens, device=device, dtype=dtype, progress=progress, label=base.name)
    head = model.lm_head_weight().to(device, dtype)
    head_b = base.lm_head_weight().to(device, dtype) if base is not None else None
    nll = nll_b = kld = 0.0
    agree = 0
    targets = tokens[:, 1:]
    n = targets.numel()
    task = progress.task("scoring windows", total=tokens.shape[0])
    for wi in range(tokens.shape[0]):
        tgt = targets[wi].to(device)
        logp = torch.log_softmax(h[wi, :-1].to(device) @ head.T, dim=-1)
        nll -= logp.gather(-1, tgt[:, None]).sum().item()
        if hb is not None:
            logp_b = torch.log_softmax(hb[wi, :-1].to(device) @ head_b.T, dim=-1)
            nll_b -= logp_b.gather(-1, tgt[:, None]).sum().item()
            kld += (logp_b.exp() * (logp_b - logp)).sum().item()
            agree += (logp_b.argmax(-1) == logp.argmax(-1)).sum().item()
        task.advance()
    task.done()
    return EvalResult(
        model=model.name, base=None if base is None else base.name, data=data_name,
        ctx=tokens.shape[1], windows=tokens.shape[0], tokens_scored=n,
        perplexity=math.exp(nll / n),
        base_perplexity=None if base is None else math.exp(nll_b / n),
        mean_kld=None if base is None else kld / n,
        top1_agreement=None if base is None else agree / n,
    )
