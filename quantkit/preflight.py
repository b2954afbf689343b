"""What a run will take, said before it starts, and a refusal up front when the machine cannot hold it.

Each format's plan carries a `Resources` estimate of its own job.  A run combines them the way the run goes:
the calibrated formats share one calibration pass (the layer read once, its working set held once, each
artifact's own stream, statistics and work on top; each walks the layer with its own stream, so the forwards are
counted per artifact), the others run one after another once the pass is over.  The disk a
run needs is every artifact's final bytes, which are written in place under `.partial-*` names, plus the crash-
resume commit points beside them (two generations of every calibrated artifact's stream)."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import ResourceError
from .heap import resident_bytes

GiB = 2**30
# python + torch + transformers + quantkit imported, a tokenizer loaded: 0.3-0.45 GiB here (bench/results/
# preflight.md).  The per-format texts of the plan count the upper end; the run's figure counts what this process
# holds when it plans (measured) plus what a calibrated run loads beside it (the tokenizer, the calibration text
# and its tokens).
RUNTIME_BYTES = 450 * 2**20
CALIBRATION_LOAD_BYTES = 160 * 2**20


@dataclass
class Resources:
    """One format job's estimate.  `shared_ram` is what a calibrated job has in common with the run's other
    calibrated jobs (the pass: one layer read and its working copy, one batch); `forward_seconds` its walk of
    the layers with its own stream; `own_*` the rest of its work.  Uncalibrated jobs put everything in `own_*`."""
    own_ram: int = 0
    shared_ram: int = 0
    own_seconds: float = 0.0
    forward_seconds: float = 0.0
    final_disk: int = 0         # the artifact as written: tensors, headers, tokenizer, configs, record
    scratch_disk: int = 0       # beside it while the run goes: commit points for crash resume
    spill_disk: int = 0         # bytes a job keeps on disk until its file is written from them (GGUF error feedback)
    stream: int = 0             # a calibrated job's hidden states: what a commit point copies and writes
    setup_seconds: float = 0.0  # a calibrated run's tokenizer and calibration tokens, loaded once for all its jobs
    after_pass_ram: int = 0     # a calibrated job's work once the pass is over (GGUF --imatrix encodes then)
    written_after_pass: bool = False   # its file is written once the pass's commit points are gone (GGUF)
    calibrated: bool = False    # in the calibration pass (with the other calibrated jobs) or after it, alone
    on_device: bool = False     # a CUDA run: the working set (shared + own) is on the GPU as well


_startup = {"seconds": 0.0, "rss": 0}


def note_startup() -> None:
    """Record how long this process took to get here (interpreter, torch, transformers, quantkit imported) and
    what it holds: a run pays both too, and they are measured rather than guessed (tens of seconds on a busy
    2-core machine).  The RSS is taken before the plans' probes, which leave memory behind that a run's base
    does not have."""
    _startup["rss"] = _own_rss()
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        _startup["seconds"] = max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        _startup["seconds"] = 0.0


def read_seconds(model) -> float:
    """Reading the source once at 500 MiB/s, a local SSD's pace (a file still in the page cache reads faster)."""
    return model.size_on_disk() / (500 * 2**20)


def stream_bytes(model, samples: int, seqlen: int) -> int:
    """One job's residual stream in the pass: samples × seqlen × hidden float32."""
    return samples * seqlen * model.config.hidden_size * 4


def _layer_groups(model) -> list[list]:
    """Each decoder layer's stored tensors (their index entries), read from the index once per model."""
    key = str(model.folder)
    if key not in _groups:
        groups: list[list] = [[] for _ in range(model.num_layers)]
        prefixes = [model.adapter.prefix(i) for i in range(model.num_layers)]
        for name, entry in model.weights.entries.items():
            for i, prefix in enumerate(prefixes):
                if name.startswith(prefix):
                    groups[i].append(entry)
                    break
        _groups[key] = groups
    return _groups[key]


_groups: dict[str, list] = {}


def largest_layer(model) -> int:
    """The decoder layer with the most stored bytes: the pass holds one layer at a time, so the largest sets the
    peak (a mixture whose first layers are dense — mlp_only_layers, first_k_dense_replace — is sized by a
    mixture layer, not by layer 0).  The first of equals."""
    sizes = [sum(e.nbytes for e in group) for group in _layer_groups(model)]
    return sizes.index(max(sizes))


def layer_entries(model) -> list:
    """The stored tensors of the largest decoder layer."""
    return _layer_groups(model)[largest_layer(model)]


def layer_params(model) -> int:
    """Weights of the largest decoder layer (the pass holds one at a time)."""
    return sum(e.numel for e in layer_entries(model))


def pass_ram(model, seqlen: int) -> int:
    """The calibration pass's own working set, shared by its jobs: one layer in float32 with the copy the
    forwards run on, and one batch's MLP intermediates (gate, up, their product, the activation's output)."""
    from .calibration.capture import batch_for
    return layer_params(model) * 4 * 2 + batch_for(seqlen) * seqlen * model.config.intermediate_size * 4 * 4


def pass_seconds(model, samples: int, seqlen: int, device, accumulator=None, reference: float = 0.0) -> float:
    """One calibrated job's walk through the layers: its forwards over every calibration window (each job runs
    its own, on its own stream), timed here on the largest layer with the pass's own code and a job that does nothing
    but gather `accumulator`'s statistics of each input group (`accumulator(features, device).add(x)` per batch,
    as the run's job does), then scaled by tokens and layers.  Counting FLOPs at the peak matmul rate came out
    5-12x short on the demo: its small matmuls, attention, norms and copies run far from that rate; and the
    statistics timed apart from the walk came to 1.2 s where a profile of the demo's run showed 2.7 s.
    `reference`: the share of the windows for which a job also walks the unquantized model's stream (jobs.py),
    `accumulator.add(x, reference=…)`."""
    per_layer, per_window = layer_walk(model, seqlen, device, accumulator, reference)
    return (per_layer + per_window * samples) * model.num_layers


def layer_shapes(model) -> dict[str, tuple[int, ...]]:
    """The largest layer's tensors' shapes by name without ".weight" (the block's linear names), read once per
    model in this process: every format's probe asks for them."""
    key = str(model.folder)
    if key not in _shapes:
        _shapes[key] = {n.removesuffix(".weight"): tuple(t.shape) for n, t in model.layer(largest_layer(model)).items()}
    return _shapes[key]


_shapes: dict[str, dict] = {}


def held_second_moments(model) -> int:
    """Bytes of the float32 second moments (K×K per input group) the widest stage of the largest layer holds
    until it is quantized (q/k/v's one, or every expert's gate/up, then down, of a mixture), plus the two K×K
    working copies GPTQ and AWQ make of the widest while they quantize a group."""
    shapes = layer_shapes(model)
    block = model.block(largest_layer(model))
    held = max(sum(shapes[g.linears[0]][1] ** 2 * 4 for g in stage) for r in block.residuals for stage in r.stages)
    return held + max(shape[-1] for shape in shapes.values()) ** 2 * 4 * 2


def layer_walk(model, seqlen: int, device, accumulator=None, reference: float = 0.0) -> tuple[float, float]:
    """(seconds to read a layer and make its working copy, seconds per calibration window of its staged walk,
    about two forwards of the layer, with `accumulator`'s statistics gathered on the way), probed once per model,
    window length and statistics in this process."""
    key = (str(model.folder), seqlen, str(device), accumulator, reference)
    if key not in _pass_probe:
        _pass_probe[key] = _time_layer_walk(model, seqlen, device, accumulator, reference)
    return _pass_probe[key]


_pass_probe: dict[tuple, tuple[float, float]] = {}


def _gathering_job(accumulator, device, reference: float = 0.0):
    """A pass job that quantizes nothing and gathers `accumulator`'s statistics of each input group the way the
    quantizers' jobs keep them (GroupStats); without an accumulator, a job that does nothing."""
    from .calibration.jobs import PassJob
    from .calibration.stats import GroupStats, output_projection
    if accumulator is None:
        return PassJob()

    class Gathering(PassJob):
        def __init__(self):
            self.stats = GroupStats(accumulator, device)
            self.reference = reference

        def observe(self, ctx, group, x, reference=None):
            if reference is None:
                self.stats.add(group, x)
            else:      # as GGUF's error feedback keeps it (calibration.stats.output_projection)
                self.stats.add(group, x, reference=reference,
                               project=output_projection(ctx.source, group.linears, device))
    return Gathering()


def _time_layer_walk(model, seqlen: int, device, accumulator=None, reference: float = 0.0) -> tuple[float, float]:
    """quantize_layer with a job that gathers `accumulator`'s statistics and quantizes nothing (with `reference`,
    walking a reference stream beside its own as the pass does for such a job), on one batch of windows as the pass
    makes them (batch_for: 4096 tokens; at half that, the demo's walk read ~15 % faster per
    token), after warm-ups."""
    import time

    import torch

    from .calibration.capture import batch_for, default_compute_dtype, quantize_layer, working_weights
    from .calibration.context import LayerContext, reference_samples
    from .model.engine import Runtime
    dtype = default_compute_dtype(device)
    t0 = time.perf_counter()
    i = largest_layer(model)
    block, source = model.block(i), model.layer(i)
    weights = working_weights(block, source, device, dtype)
    per_layer = time.perf_counter() - t0
    runtime = Runtime(seqlen, device, dtype)
    windows = batch_for(seqlen)
    generator = torch.Generator().manual_seed(0)
    seconds = 0.0
    # a walk's first run at a batch size pays for its buffers and kernel choices (the demo's full batch: 1.5x the
    # next in a fresh process): the last of these is timed
    for n in (1, windows, windows):
        stream = torch.randn(n, seqlen, model.config.hidden_size, generator=generator)
        ctx = LayerContext(i, block, source, weights=weights, stream=stream, runtime=runtime, batch=n)
        if reference:    # the share of the windows the pass pairs, as it pairs them
            ctx.reference = stream[reference_samples(n, n, reference)].clone()
            ctx.reference_share, ctx.reference_weights = reference, working_weights(block, source, device, dtype)
        job = _gathering_job(accumulator, device, reference)
        t0 = time.perf_counter()
        quantize_layer(ctx, job, release_memory=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - t0) / n
    return per_layer, seconds


def column_loop_cost(quantize_rows, rows: int, columns: int):
    """cost(rows, columns) in seconds of a column-by-column quantizer (GPTQ's) here: a fixed amount per
    column (the loop's Python steps and launches) plus an amount per weight, solved from timing
    `quantize_rows(r)` on the first r rows of a probe matrix of `columns` columns at `rows` and at an eighth of
    it, after a warm-up (first-call set-up is not per column)."""
    import time
    quantize_rows(8)

    def timed(r: int) -> float:
        t0 = time.perf_counter()
        quantize_rows(r)
        return time.perf_counter() - t0
    low, high = max(8, rows // 8), rows
    t_low, t_high = timed(low), timed(high)
    per_weight = max(t_high - t_low, 0.0) / (max(high - low, 1) * columns)
    per_column = max(t_low - per_weight * low * columns, 0.0) / columns
    return lambda r, c: c * (per_column + per_weight * r)


def layer_column_loop_seconds(groups: dict, quantize, device) -> float:
    """Seconds of a column-by-column quantizer over one layer's linears here.  `groups` maps a key whose first
    item is the input width (the rest: what else changes the cost, e.g. a GGUF type) to its linears; each key is
    probed once, `quantize(w, h, key)` on random weights as tall as its tallest linear, since the error feedback
    into the columns not yet quantized makes a weight's cost grow with the width (one probe at 1024 columns
    read the synthetic llama's 4096-wide down_proj at 0.7x)."""
    import torch
    gen = torch.Generator().manual_seed(0)
    total = 0.0
    for key, same in groups.items():
        k, n = key[0], max(lin.out_features for lin in same)
        x = torch.randn(2 * k, k, generator=gen)
        h = (x.T @ x / x.shape[0]).to(device)
        w = torch.randn(n, k, generator=gen).to(device)
        cost = column_loop_cost(lambda rows, w=w, h=h, key=key: quantize(w[:rows], h, key), n, k)
        total += sum(cost(lin.out_features, k) for lin in same)
    return total


def calibration_seconds(model, spec) -> float:
    """Loading the tokenizer and drawing the calibration windows, timed here by doing it: for a local text file
    the same work the run does (seconds on a large file); for a Hub dataset or `self` only the tokenizer, since a
    download or a generation cannot be timed without doing it."""
    import time

    from .calibration.data import read_file_documents, windows_from_documents
    t0 = time.perf_counter()
    tokenizer = model.tokenizer
    source = spec.parsed
    if source.kind not in ("hf", "self"):
        documents, _ = read_file_documents(source, spec.text_column)
        windows_from_documents(tokenizer, documents, spec, source.text)
    return time.perf_counter() - t0


# a safetensors header entry (name, dtype, shape, offsets as JSON), config files, the record, the card
_HEADER_PER_TENSOR, _FOLDER_FILES = 120, 64 * 1024


def folder_disk(model, plan) -> int:
    """An HF-folder artifact's bytes: its tensors, their headers, and the tokenizer files copied from the source."""
    from .backends.hf_folder import COPIED_FILES
    side = sum((model.folder / n).stat().st_size for n in COPIED_FILES if (model.folder / n).is_file())
    return plan.total_bytes + len(plan.rows) * _HEADER_PER_TENSOR * 3 + side + _FOLDER_FILES


@dataclass
class RunEstimate:
    peak_ram: int
    peak_device: int
    final_disk: int
    scratch_disk: int
    seconds: float
    device: str

    @property
    def disk(self) -> int:
        return self.final_disk + self.scratch_disk

    def to_dict(self) -> dict:
        return {"peak_ram_bytes": self.peak_ram, "peak_device_bytes": self.peak_device,
                "disk_final_bytes": self.final_disk, "disk_temporary_bytes": self.scratch_disk,
                "seconds": round(self.seconds, 1), "device": self.device}

    def lines(self) -> list[str]:
        gpu = f"{self.peak_device / GiB:.2f} GiB" if self.device.startswith("cuda") else "none (a CPU run)"
        return [f"peak RAM {self.peak_ram / GiB:.2f} GiB, peak GPU memory {gpu}",
                f"disk {self.disk / GiB:.2f} GiB ({self.final_disk / GiB:.2f} GiB final + "
                f"{self.scratch_disk / GiB:.2f} GiB temporary)",
                f"time about {self.seconds:.0f} s on {self.device}"]


def combine(estimates: list[Resources], device: str, resume: bool = True) -> RunEstimate:
    """The run's figures from its jobs' (see the module docstring).  With `resume`, every commit point copies
    each calibrated stream (RAM, while it is written) and keeps two generations of them on disk."""
    calibrated = [r for r in estimates if r.calibrated]
    others = [r for r in estimates if not r.calibrated]
    copies = sum(r.stream for r in calibrated) if resume else 0
    runtime = max(_startup["rss"] or _own_rss(), 200 * 2**20)
    pass_ram = (runtime + CALIBRATION_LOAD_BYTES + max((r.shared_ram for r in calibrated), default=0)
                + sum(r.own_ram for r in calibrated) + copies) if calibrated else 0
    after_pass = [runtime + CALIBRATION_LOAD_BYTES + r.after_pass_ram for r in calibrated]
    peak_ram = max([pass_ram] + after_pass + [runtime + r.own_ram for r in others])
    on_gpu = [r for r in estimates if r.on_device]
    pass_device = max((r.shared_ram for r in on_gpu if r.calibrated), default=0) + \
        sum(r.own_ram for r in on_gpu if r.calibrated)
    peak_device = max([pass_device] + [r.own_ram for r in on_gpu if not r.calibrated])
    seconds = (_startup["seconds"] + max((r.setup_seconds for r in calibrated), default=0.0)
               + sum(r.forward_seconds + r.own_seconds for r in calibrated)
               + sum(r.own_seconds for r in others))
    # the commit points live beside what the pass writes, and are removed before the files written after it
    final = sum(r.final_disk for r in estimates)
    during = sum(r.final_disk for r in calibrated if not r.written_after_pass)
    scratch = sum(r.scratch_disk for r in estimates) + 2 * copies
    # a spill is there during the pass and still beside the file written from it after the pass
    spill = sum(r.spill_disk for r in estimates)
    peak = max(during + scratch, final) + spill
    return RunEstimate(peak_ram, peak_device, final, peak - final, seconds, device)


def available_ram() -> int:
    """What the kernel says a new allocation can have without swapping (MemAvailable), plus what this process
    already holds (the estimate counts the whole process)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        avail = info["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return avail + _own_rss()


def _own_rss() -> int:
    return resident_bytes() or 0


def free_disk(out: Path) -> int:
    """Free bytes on the file system `out` is (or will be) on."""
    p = Path(out).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def already_written(out: Path) -> int:
    """Bytes of earlier runs' `.partial-*` folders in `out`: a resumed run does not need that space again."""
    total = 0
    for partial in Path(out).glob(".partial-*"):
        for p in partial.rglob("*") if partial.is_dir() else [partial]:
            if p.is_file():
                total += p.stat().st_size
    return total


def check(run: RunEstimate, out: Path) -> None:
    """Refuse (ResourceError, one line with the figures) a run the disk or the memory here cannot hold."""
    need = run.disk - already_written(out) if Path(out).is_dir() else run.disk
    free = free_disk(out)
    if need > free:
        raise ResourceError(f"{out}: the run needs {need / GiB:.2f} GiB of disk ({run.final_disk / GiB:.2f} GiB "
                            f"final + {run.scratch_disk / GiB:.2f} GiB temporary) and {free / GiB:.2f} GiB is free; "
                            f"free space, write elsewhere with -o, or --no-preflight to try anyway")
    avail = available_ram()
    if run.peak_ram > avail:
        raise ResourceError(f"the run needs about {run.peak_ram / GiB:.2f} GiB of RAM at its peak and "
                            f"{avail / GiB:.2f} GiB is available; fewer --calib-samples or a shorter --calib-seqlen "
                            f"shrink it (one format per run too), or --no-preflight to try anyway")
    if run.device.startswith("cuda"):
        import torch
        free_gpu, _ = torch.cuda.mem_get_info(torch.device(run.device))
        if run.peak_device > free_gpu:
            raise ResourceError(f"the run needs about {run.peak_device / GiB:.2f} GiB of GPU memory and "
                                f"{free_gpu / GiB:.2f} GiB is free on {run.device}; --device cpu, fewer "
                                f"--calib-samples, or --no-preflight to try anyway")
