"""The capture pass: calibration samples go through the model one decoder layer at a time, and every job of
the run (each calibrated artifact, the importance-matrix collector) quantizes or measures each layer from what
its linears saw.  The job protocol is `quantkit.calibration.jobs`; what a job can do with a layer is
`quantkit.calibration.context.LayerContext`.

For layer i the source weights are read once per pass.  Each job owns a stream of hidden states — the outputs
of ITS already-quantized layers 0..i−1, so an artifact made in a run with others is the same as one made
alone — and the layer is walked through its block description (quantkit.model.block) by the one engine
(quantkit.model.engine), residual sub-block by sub-block and stage by stage:

    for each residual sub-block (attention, MLP …):
        for each stage of its op (q/k/v, then o; gate/up, then down …):
            run the sub-block over all samples up to that stage   -> observe(group inputs)
            quantize_group(each group of the stage)                 -> the stream's weights now the quantized ones
        h = h + sub-block(h)                                         (with every group of it quantized)

so each group's inputs are those of a layer whose earlier groups are already quantized, and a layer costs
about two forward passes.  A job with a `reference` share (jobs.py) also gets, for each group outside a routed
MoE block, the input the UNQUANTIZED model gives the first samples of each batch (that share of them,
context.paired_spans): the pass carries a second stream for those samples, walked with the source weights beside
the job's own (the share more stream memory; since those weights never change, the reference's walk to a
sub-block's last stage runs on to its end and advances its stream: one forward of the share where the job's own
stream takes about 1.6 of every sample).  Matmuls run
in `compute_dtype` (bf16 where the hardware has fast bf16: AMX CPUs, CUDA), the residual stream, norms and every
statistic in float32.  Peak memory: one layer's weights, the
streams (samples × seqlen × hidden float32 each) and one batch's intermediates.
"""
from __future__ import annotations

import torch

from ..errors import QuantizationError
from ..heap import release_free_memory
from ..model.block import Block, MoE
from ..model.engine import Runtime, embed, run_residual
from ..progress import Progress, null_progress
from .context import LayerContext, reference_samples, reference_share
from .jobs import LayerJob


def default_compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 matmuls where they are fast (8× fp32 on AMX CPUs here), float32 elsewhere."""
    if device.type == "cuda":
        return torch.bfloat16
    try:
        fast = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    except AttributeError:  # older torch: stay exact
        fast = False
    return torch.bfloat16 if fast else torch.float32


def working_weights(block: Block, source: dict[str, torch.Tensor], device, compute_dtype) -> dict[str, torch.Tensor]:
    """The layer's tensors as the engine computes with them: linears (and their biases) in the compute dtype,
    norms in float32."""
    linears = set(block.linears)
    return {k: v.to(device=device, dtype=compute_dtype if k.rsplit(".", 1)[0] in linears else torch.float32)
            for k, v in source.items()}


@torch.no_grad()
def quantize_layer(ctx: LayerContext, job: LayerJob, release_memory: bool = True) -> None:
    """Run the staged pass of one layer for one job; `ctx.stream` (samples, seqlen, hidden) is updated in place.
    `release_memory`: hand freed pages back after each stage's walk (quantkit.heap); the pre-flight's timing probe
    turns it off, since a run pays it once per stage over all its windows, the probe over a few."""
    h, w, rt, device = ctx.stream, ctx.weights, ctx.runtime, ctx.runtime.device
    ref, ref_w = ctx.reference, ctx.reference_weights
    # each batch of the job's stream, and where the reference keeps its first samples (None: no reference)
    spans = ctx.paired_spans() if ref is not None else [(sl, None) for sl in ctx.spans()]

    for sub in ctx.block.residuals:
        paired = ref is not None and not isinstance(sub.op, MoE)   # routed tokens differ between the two streams
        ref_walks_to_end = paired and bool(sub.stages)   # its last stage's walk advances it (below)
        for index, stage in enumerate(sub.stages):
            refs = {}   # this batch's reference inputs by group, emptied after each batch

            def keep(group, x, stage=stage):
                if group in stage:
                    refs[group] = x

            def observe(group, x, stage=stage):  # the run passes earlier stages' inputs too: those are done
                if group in stage:
                    if ref is None:
                        job.observe(ctx, group, x)
                    else:
                        job.observe(ctx, group, x, reference=refs.get(group))

            last = index == len(sub.stages) - 1
            for sl, rsl in spans:
                if paired and last:   # the reference weights never change: its last walk also advances its stream
                    rs = ref[rsl].to(device)
                    ref[rsl] = (rs + run_residual(sub, rs, ref_w, rt, observe=keep).float()).to(ref.device)
                elif paired:
                    run_residual(sub, ref[rsl].to(device), ref_w, rt, observe=keep, stop=index)
                run_residual(sub, h[sl].to(device), w, rt, observe=observe, stop=index)
                refs.clear()
            if release_memory:
                release_free_memory()   # the walk's intermediates, before the quantizers allocate (quantkit.heap)
            for group in stage:  # quantizers get the weights in their source precision through ctx.source
                new = job.quantize_group(ctx, group)
                w.update({k: v.to(device=device, dtype=w[k].dtype) for k, v in new.items()})
        walks = [(h, w, [sl for sl, _ in spans])]
        if ref is not None and not ref_walks_to_end:
            walks.append((ref, ref_w, [rsl for _, rsl in spans]))
        for stream, weights, slices in walks:
            for sl in slices:
                hs = stream[sl].to(device)
                stream[sl] = (hs + run_residual(sub, hs, weights, rt).float()).to(stream.device)


def _refuse_non_finite(model, i: int, source: dict[str, torch.Tensor]) -> None:
    """A NaN or inf weight would poison every statistic after it: name the tensor before any work is done."""
    for name, t in source.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise QuantizationError(f"{model.adapter.prefix(i)}{name}: contains NaN or infinite values; cannot quantize")


def batch_for(seqlen: int, tokens_per_batch: int = 4096) -> int:
    return max(1, tokens_per_batch // seqlen)


@torch.no_grad()
def run_capture(model, tokens: torch.Tensor, jobs: list[LayerJob], *, device: torch.device,
                compute_dtype: torch.dtype | None = None, progress: Progress = null_progress,
                checkpoint=None, resume: tuple | None = None) -> None:
    """Walk every decoder layer once per pass for all jobs (see the module docstring).

    `checkpoint` (quantkit.calibration.resume.RunCheckpoint) gets a commit point after every layer;
    `resume` = (ResumePoint, {job: stream}) starts where a previous run's last commit point left off
    (the jobs' own states already restored): earlier passes are skipped but for their end_pass."""
    if not jobs:
        return
    cfg = model.config
    compute_dtype = compute_dtype or default_compute_dtype(device)
    passes = max(getattr(j, "passes", 1) for j in jobs)
    batch = batch_for(tokens.shape[1])
    rt = Runtime(tokens.shape[1], device, compute_dtype)
    point, saved_streams = resume if resume is not None else (None, {})
    shares = {id(j): reference_share(j, *tokens.shape) for j in jobs}
    for index in range(passes):
        active = [j for j in jobs if getattr(j, "first_pass", 0) <= index < getattr(j, "passes", 1)]
        start = point.layer if point is not None and index == point.pass_index else 0
        if point is None or index >= point.pass_index:
            # Streams stay on the device when it is the CPU, or when they take under a quarter of free GPU memory.
            stream_bytes = tokens.numel() * cfg.hidden_size * 4 * sum(1 + shares[id(j)] for j in active)
            home = device
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                home = device if stream_bytes < free // 4 else torch.device("cpu")
            # a job with a reference stream keeps both in one tensor along the samples: its own (all samples), then
            # the unquantized one's (its share, context.paired_spans); a commit point saves and restores them together
            samples = tokens.shape[0]
            if start:
                streams = [saved_streams[j].to(home) for j in active]
            else:
                first = embed(model, tokens).to(home)
                streams = [torch.cat([first, first[reference_samples(samples, batch, shares[id(j)])]])
                           if shares[id(j)] else first.clone() for j in active]
                del first
            label = "calibrate + quantize layers" if passes == 1 else f"pass {index + 1}/{passes}: layers"
            task = progress.task(label, total=model.num_layers)
            task.advance(start)
            for i in range(start, model.num_layers):
                source, block = model.layer(i), model.block(i)
                _refuse_non_finite(model, i, source)
                for job, h in zip(active, streams):
                    ctx = LayerContext(i, block, source, weights=working_weights(block, source, device, compute_dtype),
                                       stream=h[:samples], runtime=rt, batch=batch, pass_index=index)
                    if shares[id(job)]:
                        ctx.reference, ctx.reference_share = h[samples:], shares[id(job)]
                        ctx.reference_weights = working_weights(block, source, device, compute_dtype)
                    quantize_layer(ctx, job)
                    job.finish_layer(ctx)
                del source
                release_free_memory()   # see quantkit.heap: a fragmented heap would keep every layer's temporaries
                # the last layer of the last pass is not committed: what follows it (the head, finish) is redone
                if checkpoint is not None and not (index == passes - 1 and i == model.num_layers - 1):
                    checkpoint.save(index, i + 1, list(zip(active, streams)))
                task.advance()
            task.done()
            del streams
        waiting = [j for j in jobs if j not in active and index < getattr(j, "passes", 1)]
        for job in active + waiting:
            job.end_pass(index)
    if checkpoint is not None:
        checkpoint.wait()
