"""The capture pass: calibration samples go through the model one decoder layer at a time, and every
calibrated artifact of the run quantizes each layer from what its linears saw.

For layer i the source weights are read once.  Each `LayerQuantizer` (one per calibrated artifact) owns a
stream of hidden states — the outputs of ITS already-quantized layers 0..i−1, so an artifact made in a run
with others is the same as one made alone — and the layer is walked in the adapter's true-sequential input
groups, one stage per group over all samples:

    stage 1  x = norm1(h)                  observe(q/k/v)   -> q/k/v quantized
    stage 2  a = attention(x)              observe(o)       -> o quantized
    stage 3  h = h + o(a);  x = norm2(h)   observe(gate/up) -> gate/up quantized
    stage 4  m = silu(gate(x))·up(x)       observe(down)    -> down quantized
    stage 5  h = h + down(m)               (the quantized layer's output, in place)

Each stage reuses what the earlier stages left in `h`, so a layer costs about two forward passes instead of
one per group plus one.  Matmuls run in `compute_dtype` (bf16 where the hardware has fast bf16: AMX CPUs,
CUDA), the residual stream, norms and every statistic in float32.  Peak memory: one layer's weights, the
streams (samples × seqlen × hidden float32 each) and one batch's intermediates.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..errors import UnsupportedArchitectureError
from ..model.adapters import ArchAdapter
from ..model.adapters.base import InputGroup
from ..model.decoder import attention, rms_norm, rope_tables
from ..progress import Progress, null_progress


class LayerQuantizer(Protocol):
    """One calibrated artifact's side of the pass."""
    label: str

    def observe(self, layer: int, group: InputGroup, x: torch.Tensor) -> None:
        """x: (tokens, in_features), the input of `group`'s linears for one batch, in the compute dtype."""

    def quantize_group(self, layer: int, group: InputGroup, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Quantize `group`'s linears from `weights` (the layer's source tensors, as stored); return their
        dequantized weights by name ("mlp.up_proj.weight")."""

    def finish_layer(self, layer: int, source: dict[str, torch.Tensor]) -> None:
        """The layer is done (write it out); `source` holds its original tensors."""


def default_compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 matmuls where they are fast (8× fp32 on AMX CPUs here), float32 elsewhere."""
    if device.type == "cuda":
        return torch.bfloat16
    try:
        fast = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    except AttributeError:  # older torch: stay exact
        fast = False
    return torch.bfloat16 if fast else torch.float32


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def _check_groups(adapter: ArchAdapter) -> tuple[InputGroup, ...]:
    groups = adapter.input_groups
    expected = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
    if tuple(g.linears for g in groups) != expected:  # the stages below follow the llama block
        raise UnsupportedArchitectureError(f"calibrated formats do not know the {adapter.family} block layout yet")
    return groups


@torch.no_grad()
def quantize_layer(layer: int, h: torch.Tensor, source: dict[str, torch.Tensor], cfg, adapter: ArchAdapter,
                   rope, quantizer: LayerQuantizer, *, device: torch.device, compute_dtype: torch.dtype,
                   batch: int) -> None:
    """Run the staged pass of one layer for one quantizer; `h` (samples, seqlen, hidden) is updated in place."""
    g_qkv, g_o, g_up, g_down = _check_groups(adapter)
    eps = cfg.rms_norm_eps
    w = {k: v.to(device=device, dtype=compute_dtype) for k, v in source.items()}
    norm1 = source["input_layernorm.weight"].to(device, torch.float32)
    norm2 = source["post_attention_layernorm.weight"].to(device, torch.float32)
    spans = [slice(s, s + batch) for s in range(0, h.shape[0], batch)]

    def rows(x: torch.Tensor) -> torch.Tensor:  # what the linears see: their input in the compute dtype
        return x.reshape(-1, x.shape[-1]).to(compute_dtype)

    def take(group: InputGroup) -> None:  # quantizers get the weights in their source precision
        new = quantizer.quantize_group(layer, group, source)
        w.update({k: v.to(device=device, dtype=compute_dtype) for k, v in new.items()})

    def attn(hs: torch.Tensor) -> torch.Tensor:
        return attention(rms_norm(hs, norm1, eps).to(compute_dtype), w, cfg, adapter, rope)

    def mlp_hidden(hs: torch.Tensor) -> torch.Tensor:
        x = rms_norm(hs, norm2, eps).to(compute_dtype)
        return F.silu(_linear(x, w["mlp.gate_proj.weight"])) * _linear(x, w["mlp.up_proj.weight"])

    for sl in spans:
        quantizer.observe(layer, g_qkv, rows(rms_norm(h[sl].to(device), norm1, eps)))
    take(g_qkv)
    for sl in spans:
        quantizer.observe(layer, g_o, rows(attn(h[sl].to(device))))
    take(g_o)
    for sl in spans:
        hs = h[sl].to(device)
        hs = hs + _linear(attn(hs), w["self_attn.o_proj.weight"]).float()
        h[sl] = hs.to(h.device)
        quantizer.observe(layer, g_up, rows(rms_norm(hs, norm2, eps)))
    take(g_up)
    for sl in spans:
        quantizer.observe(layer, g_down, rows(mlp_hidden(h[sl].to(device))))
    take(g_down)
    for sl in spans:
        hs = h[sl].to(device)
        h[sl] = (hs + _linear(mlp_hidden(hs), w["mlp.down_proj.weight"]).float()).to(h.device)


def batch_for(seqlen: int, tokens_per_batch: int = 4096) -> int:
    return max(1, tokens_per_batch // seqlen)


@torch.no_grad()
def run_capture(model, tokens: torch.Tensor, quantizers: list[LayerQuantizer], *, device: torch.device,
                compute_dtype: torch.dtype | None = None, progress: Progress = null_progress) -> None:
    """Walk every decoder layer once for all quantizers (see the module docstring)."""
    if not quantizers:
        return
    cfg, adapter = model.config, model.adapter
    compute_dtype = compute_dtype or default_compute_dtype(device)
    # Streams stay on the device when it is the CPU, or when they take under a quarter of free GPU memory.
    stream_bytes = tokens.numel() * cfg.hidden_size * 4 * len(quantizers)
    home = device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        home = device if stream_bytes < free // 4 else torch.device("cpu")
    emb = model.embed_weight()
    first = emb[tokens].to(home, torch.float32)
    del emb
    streams = [first] + [first.clone() for _ in quantizers[1:]]
    rope = rope_tables(cfg, tokens.shape[1], device, compute_dtype)
    batch = batch_for(tokens.shape[1])
    task = progress.task("calibrate + quantize layers", total=model.num_layers)
    for i in range(model.num_layers):
        source = model.layer(i)
        for quantizer, h in zip(quantizers, streams):
            quantize_layer(i, h, source, cfg, adapter, rope, quantizer, device=device,
                           compute_dtype=compute_dtype, batch=batch)
            quantizer.finish_layer(i, source)
        del source
        task.advance()
    task.done()
