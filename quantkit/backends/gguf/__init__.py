"""GGUF for llama.cpp: every legacy and K-quant type, IQ4, and llama-quantize's file-type mixtures."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import torch

from .. import Backend, Plan, PlanRow
from ...artifact import model_base_name, model_stem
from ...calibration.capture import batch_for
from ...calibration.context import paired_share, reference_samples
from ...calibration.stats import ReferenceHessian, SquareMeanAccumulator
from ...device import resolve_device
from ...errors import UsageError
from ...model.checkpoint import Checkpoint
from ...options import RunOptions
from ...preflight import (RUNTIME_BYTES, Resources, layer_column_loop_seconds, pass_ram, pass_seconds, read_seconds,
                           stream_bytes)
from ...progress import Progress, null_progress
from . import encoders, fusion, imatrix_file, mixtures
from .grid_encoders import NEEDS_IMATRIX
from .reader import GGUFModel, describe
from .split import parse_size
from .tensors import expert_count, gguf_tensors, sliding_layers
from .writer import FileJob, tensor_nbytes, write_files


def output_name(model: Checkpoint, file_type: str) -> str:
    return f"{model_stem(model.name)}-{file_type}.gguf"


@dataclass(frozen=True)
class GGUFSettings:
    run: RunOptions
    overrides: tuple[tuple[str, str], ...] = ()   # --tensor-type REGEX=TYPE, in order
    pure: bool = False
    tokenizer_pre: str | None = None
    imatrix: bool = False                          # collect an importance matrix in the calibration pass
    imatrix_out: str | None = None                 # --imatrix-out: and write it as llama-imatrix's file
    imatrix_format: str = "gguf"                   # that file's layout (imatrix_file.FORMATS)
    imatrix_loaded: imatrix_file.Imatrix | None = field(default=None, compare=False)   # --imatrix-file, read
    split_max_bytes: int | None = None             # --split-max-size: llama.cpp's split layout (split.py)
    feedback: bool = False                         # --error-feedback: GPTQ's error feedback (feedback.py)
    feedback_reference: float = 0.5                # --feedback-reference: share of windows paired with the
                                                   # unquantized model's (feedback_job.FeedbackEncoder.reference)


class GGUFBackend(Backend):
    name = "gguf"
    summary = "llama.cpp GGUF v3: legacy, K-quant and IQ4 types, llama-quantize mixtures"
    owned_options = {"tensor_type": "per-tensor GGUF types", "pure": "GGUF without mixture rules",
                     "tokenizer_pre": "llama.cpp's pre-tokenizer name", "imatrix": "weights GGUF quantization",
                     "imatrix_file": "weights GGUF quantization", "imatrix_out": "writes GGUF's importance matrix",
                     "imatrix_format": "writes GGUF's importance matrix",
                     "split_max_size": "splits GGUF files", "error_feedback": "quantizes GGUF with error feedback",
                     "feedback_reference": "aims GGUF's error feedback"}

    def settings(self, options: dict) -> GGUFSettings:
        out, fmt, loaded = imatrix_file.file_options(options, collecting=bool(options.get("imatrix")))
        return GGUFSettings(run=RunOptions.from_dict(options),
                            overrides=tuple(_split_override(o) for o in options.get("tensor_type") or ()),
                            pure=bool(options.get("pure")), tokenizer_pre=options.get("tokenizer_pre"),
                            imatrix=bool(options.get("imatrix")),
                            imatrix_out=out, imatrix_format=fmt, imatrix_loaded=loaded,
                            split_max_bytes=parse_size(options["split_max_size"]) if options.get("split_max_size") else None,
                            feedback=bool(options.get("error_feedback")),
                            feedback_reference=_feedback_reference(options))

    def pass_jobs(self, model, items, settings: GGUFSettings) -> list:
        """The importance matrix, when asked for: llama-imatrix's statistics from the shared capture pass; with
        --error-feedback, each file's decoder linears, quantized in the pass (feedback_job.py)."""
        device = resolve_device(settings.run.device)
        jobs = []
        if settings.imatrix:
            from ...calibration.imatrix import ImatrixCollector
            jobs.append(ImatrixCollector(model, device))
        if settings.feedback:
            from .feedback_job import FeedbackEncoder
            jobs += [FeedbackEncoder(model, spec.name, Path(plan.output), _planned_types(plan), device,
                                     reference=settings.feedback_reference) for spec, plan in items]
        return jobs

    def variants(self) -> list[str]:
        return list(mixtures.FILE_TYPES)

    def parse_variant(self, text: str) -> mixtures.FileTypeSpec:
        try:
            return mixtures.resolve_file_type(text)
        except ValueError as e:
            raise UsageError(str(e)) from None

    def plan(self, model: Checkpoint, variant: mixtures.FileTypeSpec, out_dir: Path, settings: GGUFSettings) -> Plan:
        tensors = gguf_tensors(model)
        cfg = model.config
        overrides = list(settings.overrides)
        weighted = settings.imatrix or settings.imatrix_loaded is not None or settings.feedback
        try:
            choices = mixtures.plan_types([(t.name, t.ne) for t in tensors], variant.name,
                                          n_layer=cfg.num_layers, n_head=cfg.num_heads, n_head_kv=cfg.num_kv_heads,
                                          n_expert=expert_count(model),
                                          tied_embeddings=all(t.name != "output.weight" for t in tensors),
                                          overrides=overrides, pure=settings.pure,
                                          has_imatrix=weighted)
        except ValueError as e:
            raise UsageError(str(e)) from None
        _refuse_impossible_overrides(tensors, overrides)
        needs = [c for c in choices if mixtures.requires_imatrix(c.name, c.qtype, variant.name)]
        if needs and not weighted:
            raise UsageError(f"gguf:{variant.name} writes {needs[0].name} as {needs[0].qtype.name}, which llama.cpp "
                             f"only writes with an importance matrix: add --imatrix (collected in the calibration "
                             f"pass) or --imatrix-file FILE")
        if settings.imatrix_loaded is not None:   # a matrix that does not fit the model is refused before writing
            imatrix_file.importance_for(model, settings.imatrix_loaded,
                                        {t.name: c.qtype for t, c in zip(tensors, choices)}, variant.name)
        rows = []
        for t, c in zip(tensors, choices):
            rows.append(PlanRow(t.name, t.ne, c.qtype.name, tensor_nbytes(t, c.qtype), c.reason))
        largest = max(int(np.prod(t.shape)) for t in tensors)
        job = FileJob(Path(out_dir) / output_name(model, variant.name), 0,
                      {t.name: c.qtype for t, c in zip(tensors, choices)}, settings.split_max_bytes)
        paths, _ = job.parts(tensors)
        plan = Plan("gguf", variant.name, str(paths[0]), rows)
        if len(paths) > 1:
            plan.extra["split"] = (f"{len(paths)} files of at most {settings.split_max_bytes / 1e9:g} GB of tensor "
                                   f"data ({paths[0].name} … {paths[-1].name}); llama.cpp loads the first")
        plan.extra["peak memory (estimate)"] = f"{(largest * ENCODE_BYTES_PER_WEIGHT + RUNTIME_BYTES) / 2**30:.2f} " \
                                               f"GiB (largest tensor {largest:,} weights, {ENCODE_BYTES_PER_WEIGHT} " \
                                               f"bytes each while encoded, + runtime)"
        windowed = [i for i, slides in enumerate(sliding_layers(model)) if slides]
        if windowed and model.adapter.gguf_arch in ("llama", "phi3"):
            window = model.block(windowed[0]).residuals[0].op.window
            plan.extra["sliding window"] = (f"llama.cpp runs {model.adapter.gguf_arch} without the checkpoint's "
                                            f"{window}-token sliding window: past {window} tokens its outputs differ "
                                            f"from transformers'")
        beside = model.beside_language_model()
        if beside:
            parts = ", ".join(sorted({n.split(".")[0] + ".*" for n in beside}))
            plan.extra["left out"] = (f"{len(beside)} tensors beside the language model ({parts}): llama.cpp "
                                      f"reads a vision tower from a separate mmproj file")
        device = resolve_device(settings.run.device)
        if settings.imatrix:
            plan.extra["importance matrix"] = f"from the calibration pass over {settings.run.calibration_text()}"
            if settings.imatrix_out:
                plan.extra["importance matrix"] += f"; written to {settings.imatrix_out} ({settings.imatrix_format})"
        elif settings.imatrix_loaded is not None:
            plan.extra["importance matrix"] = settings.imatrix_loaded.describe()
        fused_n = sum(int(np.prod(r.shape)) for r in rows
                      if gguf.GGMLQuantizationType[r.kind] in encoders.FUSED_TYPES)
        compiled = device.type == "cpu" and fusion.would_compile(fused_n)
        seconds = collect = feedback_pass = feedback_own = 0.0
        if settings.run.estimate_time:      # a dry run: timing the encoders costs a second or two
            seconds, missing = _estimate_seconds(rows, device, weighted)
            seconds += read_seconds(model)
            text = f"{seconds:.0f} s on {device}"
            if compiled and missing:
                seconds += fusion.build_seconds(missing)
                text = (f"{seconds:.0f} s on {device}, {missing} fused kernels built first (~"
                        f"{fusion.BUILD_SECONDS:.0f} s each, {fusion.build_workers()} at a time, once per machine)")
            run = settings.run
            if settings.imatrix:
                collect = pass_seconds(model, run.calib_samples, run.calib_seqlen, device, SquareMeanAccumulator)
                text += f" + {collect:.0f} s for the importance matrix's pass"
            if settings.feedback:
                # two streams: the file's own and the unquantized model's (its reference), as the pass walks them
                feedback_pass = pass_seconds(model, run.calib_samples, run.calib_seqlen, device, ReferenceHessian,
                                             reference=_paired_share(settings))
                feedback_own = _feedback_seconds(model, rows, device)
                text += f" + {feedback_pass + feedback_own:.0f} s for the error feedback's pass"
            plan.extra["time (estimate)"] = text
        plan.resources = Resources(own_ram=largest * ENCODE_BYTES_PER_WEIGHT, own_seconds=seconds,
                                   on_device=device.type == "cuda",
                                   final_disk=plan.total_bytes + _metadata_bytes(model, len(rows)))
        if settings.imatrix:   # the pass that collects it (one stream, a few vectors per linear), then the encoding
            r = plan.resources
            r.calibrated, r.shared_ram, r.forward_seconds = True, pass_ram(model, settings.run.calib_seqlen), collect
            r.stream = r.own_ram = stream_bytes(model, settings.run.calib_samples, settings.run.calib_seqlen)
            r.after_pass_ram, r.written_after_pass = largest * ENCODE_BYTES_PER_WEIGHT, True
        if settings.feedback:
            # its own pass with two streams (its own, and the unquantized model's for a share of the windows), a
            # second copy of the layer's weights for the latter; a layer's linears (float32, three copies), one
            # Hessian and its reference term
            from .feedback_job import HEAD_ROWS, head_tensor
            r = plan.resources
            run = settings.run
            share = _paired_share(settings)
            reference_windows = len(reference_samples(run.calib_samples, batch_for(run.calib_seqlen), share)) if share else 0
            widest = max(lin.in_features for lin in model.stored_linears[0])
            tallest = max(lin.in_features * lin.out_features for lin in model.stored_linears[0])
            layer = sum(lin.in_features * lin.out_features for lin in model.stored_linears[0]) * 4
            r.calibrated, r.shared_ram = True, pass_ram(model, settings.run.calib_seqlen)
            r.stream = stream_bytes(model, settings.run.calib_samples + reference_windows, settings.run.calib_seqlen)
            head = model.config.vocab_size * model.config.hidden_size   # read whole, fed back in slices
            # a slice's float32 rows, the feedback's working copies and the block search: ~17 bytes per weight
            # measured on the demo's head (2026-12-05: +216 MB over the pass for its 16384 × 576 slices)
            head_ram = head * 2 + 20 * min(model.config.vocab_size, HEAD_ROWS) * model.config.hidden_size
            # K × K float32s: H and its working copies; with a share, the paired rows' H apart (stats.ReferenceHessian)
            squares = 5 if 0 < share < 1 else 4
            r.own_ram = r.stream + layer + squares * widest ** 2 * 4 + max(12 * tallest, head_ram)
            r.forward_seconds += feedback_pass
            r.own_seconds += feedback_own
            r.after_pass_ram, r.written_after_pass = largest * ENCODE_BYTES_PER_WEIGHT, True
            # the decoder linears' and the head's bytes wait beside the output until the file is written
            stored = {f"{lin.name}.weight" for layer in model.stored_linears for lin in layer}
            spilled = {t.name for t in tensors if t.source in stored} | {head_tensor(_planned_types(rows))}
            r.spill_disk += sum(row.bytes for row in rows if row.tensor in spilled)
        if device.type == "cpu":
            how = ("off (QUANTKIT_COMPILE=0)" if fusion.compile_mode() == "never" else
                   "built if missing, then used" if compiled else "used where already built, else eager")
            plan.extra["fused CPU kernels"] = (
                f"{how} ({fused_n / 1e6:.0f} M weights in K-quant and IQ4 types; missing kernels are built from "
                f"{fusion.AUTO_MIN_ELEMENTS / 1e6:.0f} M, ~{fusion.BUILD_SECONDS:.0f} s each once per machine; "
                f"QUANTKIT_COMPILE overrides)")
        return plan

    def write_all(self, model: Checkpoint, items: list[tuple[mixtures.FileTypeSpec, Plan]], out_dir: Path,
                  settings: GGUFSettings, progress: Progress = null_progress, collected: list | None = None) -> list[Path]:
        tensors = gguf_tensors(model)
        # the collected matrix goes through llama-imatrix's file contents, so that it weights the rounding exactly
        # as llama-quantize given that file would
        from .feedback_job import FeedbackEncoder
        feedback = [c for c in collected or () if isinstance(c, FeedbackEncoder)]
        try:
            matrix = settings.imatrix_loaded
            for collector in collected or ():
                if not isinstance(collector, FeedbackEncoder):
                    matrix = imatrix_file.from_collector(model, collector, settings.run.calib,
                                                         settings.run.calib_seqlen, settings.imatrix_out)
            imatrix = imatrix_file.importance_for(model, matrix) if matrix is not None else None
            jobs = [FileJob(Path(out_dir) / output_name(model, spec.name), int(spec.file_type),
                            _planned_types(plan), settings.split_max_bytes)
                    for spec, plan in items]
            info = matrix.provenance() if matrix is not None else None
            for job, encoder in zip(jobs, feedback):   # one encoder per file, in the order of items
                job.encoded, job.imatrix = encoder.encoded, imatrix or encoder.importance
                # its search was weighted by the pass's mean squares: the keys llama-quantize writes for a matrix
                info = info or {"file": "quantkit calibration pass", "dataset": str(settings.run.calib or ""),
                                "entries": sum(1 for t in tensors if t.source in encoder.importance
                                               or any(n in encoder.importance for n in t.stack)),
                                "chunks": encoder.chunks}
            written = write_files(model, tensors, jobs, name=model_base_name(model.name),
                                  device=resolve_device(settings.run.device), tokenizer_pre=settings.tokenizer_pre,
                                  progress=progress, imatrix=imatrix, imatrix_info=info)
        finally:
            for encoder in feedback:
                encoder.discard()
        if settings.imatrix_out and collected:
            imatrix_file.save(matrix, settings.imatrix_out, settings.imatrix_format)
        return written

    def record_fields(self, settings: GGUFSettings, collected: list) -> dict:
        """What the files' records hold beyond their bytes: how the rounding was weighted and from which
        calibration tokens (the card shows the method beside the type)."""
        target = None
        if settings.feedback:
            method, importance = "error feedback", "the calibration pass's mean squares (diag of each Hessian)"
            share = _paired_share(settings)
            target = (f"the unquantized model's outputs, paired for {share:.0%} of the calibration windows" if share
                      else "each linear's output on its own inputs (GPTQ's)")
        elif settings.imatrix or settings.imatrix_loaded is not None:
            method = "importance matrix"
            importance = (settings.imatrix_loaded.describe() if settings.imatrix_loaded is not None
                          else "collected in the calibration pass")
        else:
            return {}
        fields = {"quantization": {"method": method, "importance": importance}}
        if target:
            fields["quantization"]["target"] = target
            from .feedback_job import FeedbackEncoder
            choices = {c.file_type: c.row_choices() for c in collected if isinstance(c, FeedbackEncoder)}
            fields["quantization"]["rows_from_the_plain_search"] = {t: f"{plain:,} of {rows:,}"
                                                                    for t, (plain, rows, _) in choices.items()}
            if share:
                fields["quantization"]["reference_trust"] = {t: round(trust, 4) for t, (_, _, trust) in choices.items()}
        calibration = next((c.calibration for c in collected if c.calibration is not None), None)
        if calibration is not None:
            fields["calibration"] = calibration.to_json()
        return fields

    def can_read(self, path: Path) -> bool:
        if not Path(path).is_file():
            return False
        if Path(path).suffix.lower() == ".gguf":   # a corrupt one is refused by the reader, naming what is wrong
            return True
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"

    def open_artifact(self, path: Path, base=None, activations: str = "exact") -> GGUFModel:
        return GGUFModel(path, base=base, activations=activations)

    def describe_artifact(self, path: Path) -> dict:
        return describe(Path(path))

    runtimes = ("llama.cpp",)
    kv_cache_runtimes = ("llama.cpp",)

    def runtime_logits(self, path: Path, runtime: str, tokens: torch.Tensor, kv_cache: str | None = None):
        from . import llamacpp
        return llamacpp.window_logits(Path(path), tokens, kv_cache=kv_cache)

    runtime_packages = {"llama.cpp": ("llama_cpp",)}

    def runtime_loaders(self, path: Path, runtime: str, ctx: int) -> list:
        from ...verify.sessions import LlamaCppSession
        how = "llama_cpp.Llama(file) with llama.cpp's defaults"
        return [(how, lambda: LlamaCppSession(Path(path), ctx, how))]


def _refuse_impossible_overrides(tensors, overrides) -> None:
    """llama-quantize silently swaps an override that does not fit a tensor's rows for a fallback type;
    an explicit --tensor-type is a request, so quantkit refuses it instead of ignoring it."""
    for t in tensors:
        if len(t.shape) < 2:
            continue
        for pattern, qname in overrides:
            if re.search(pattern.lower(), t.name):
                qtype = mixtures.parse_ggml_type(qname)
                block = gguf.GGML_QUANT_SIZES[qtype][0]
                if t.shape[-1] % block:
                    raise UsageError(f"--tensor-type {pattern}={qname}: {t.name} has rows of {t.shape[-1]}, which "
                                     f"{qtype.name} (blocks of {block}) cannot take; choose a type with blocks of 32")
                break


def _split_override(text: str) -> tuple[str, str]:
    pattern, sep, qtype = text.rpartition("=")
    if not sep or not pattern or not qtype:
        raise UsageError(f"--tensor-type {text!r}: expected REGEX=TYPE, e.g. 'ffn_down=q6_k'")
    return pattern, qtype


# a tensor being encoded: its float32 copy, the source it was read from, the encoders' working rows and the
# encoded bytes (demo: 5.6 bytes per weight of token_embd above the process's size; bench/results/preflight.md)
ENCODE_BYTES_PER_WEIGHT = 6


def _planned_types(plan_or_rows) -> dict[str, gguf.GGMLQuantizationType]:
    """GGUF tensor name -> the type the plan gives it."""
    rows = plan_or_rows.rows if isinstance(plan_or_rows, Plan) else plan_or_rows
    return {r.tensor: gguf.GGMLQuantizationType[r.kind] for r in rows}


def _feedback_seconds(model, rows, device: torch.device) -> float:
    """The error feedback's own work (column loop and searches) for every layer, timed here on layer 0's linears,
    per input width and type."""
    from .feedback import SUPPORTED, feedback_quantize
    from .feedback_job import HEAD_ROWS, head_tensor
    kinds = _planned_types(rows)
    by_source = {t.source: t.name for t in gguf_tensors(model) if t.source}
    groups: dict[tuple, list] = {}
    for lin in model.stored_linears[0]:
        qtype = kinds.get(by_source.get(f"{lin.name}.weight", ""))
        if qtype in SUPPORTED:
            groups.setdefault((lin.in_features, qtype), []).append(lin)

    def quantize(w, h, key):
        return feedback_quantize(w, h, key[1])
    seconds = layer_column_loop_seconds(groups, quantize, device) * model.num_layers
    head = head_tensor(kinds)
    if head is not None:   # each slice of HEAD_ROWS rows pays the column loop's per-column cost again
        probe = min(model.config.vocab_size, HEAD_ROWS)
        piece = SimpleNamespace(out_features=probe)
        seconds += (layer_column_loop_seconds({(model.config.hidden_size, kinds[head]): [piece]}, quantize, device)
                    * model.config.vocab_size / probe)
    return seconds


def _metadata_bytes(model, tensors: int) -> int:
    """The key-value section and the tensor infos: mostly the vocabulary and merges, which take about what
    they take in tokenizer.json (bench/results/preflight.md); plus alignment padding per tensor."""
    tokenizer = model.folder / "tokenizer.json"
    vocab = tokenizer.stat().st_size if tokenizer.is_file() else model.config.vocab_size * 16
    return vocab + tensors * (96 + 32) + 4096


def _estimate_seconds(rows, device: torch.device, imatrix: bool) -> tuple[float, int]:
    """(seconds, fused kernels missing here): time one full chunk of each type on this machine (weighted by an
    importance vector where the run will weight it: the decoder layers' linears) and scale by the number of
    weights of that type.  The probe runs the kernels that are built; those it wanted and lacked are counted."""
    by_type: dict[tuple[str, bool], int] = {}
    for r in rows:
        key = (r.kind, imatrix and r.tensor.startswith("blk."))
        by_type[key] = by_type.get(key, 0) + int(np.prod(r.shape))
    total, before = 0.0, fusion.missing_kernels()
    for (kind, weighted), n in by_type.items():
        qtype = gguf.GGMLQuantizationType[kind]
        width = 256 if gguf.GGML_QUANT_SIZES[qtype][0] <= 256 else gguf.GGML_QUANT_SIZES[qtype][0]
        x = torch.randn(256, width * 16, device=device)     # one chunk
        weights = torch.rand(width * 16, device=device) + 0.1 if weighted or qtype in NEEDS_IMATRIX else None
        # the first call on a full chunk is paid once, not per weight: set-up, and a built kernel's first use,
        # which runs the eager function beside it to check that the bytes agree (2x on the synthetic model)
        t0 = time.perf_counter()
        encoders.quantize(x, qtype, imatrix=weights)
        t1 = time.perf_counter()
        encoders.quantize(x, qtype, imatrix=weights)
        t2 = time.perf_counter()
        total += max(0.0, (t1 - t0) - (t2 - t1)) + (t2 - t1) * n / x.numel()
    return total, fusion.missing_kernels() - before


BACKEND = GGUFBackend()


def _feedback_reference(options: dict) -> float:
    """--feedback-reference SHARE, checked: a share of the windows, and only with --error-feedback."""
    from .feedback_job import FeedbackEncoder
    value = options.get("feedback_reference")
    if value is None:
        return FeedbackEncoder.reference
    if not options.get("error_feedback"):
        raise UsageError("--feedback-reference aims --error-feedback; add --error-feedback or drop it")
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = float("nan")
    if not 0 <= share <= 1:
        raise UsageError(f"--feedback-reference {value}: a share of the calibration windows, from 0 to 1")
    return share


def _paired_share(settings: GGUFSettings) -> float:
    """The share of the run's windows the error feedback's reference stream will pair (as the capture pass will
    find it: context.reference_share)."""
    from .feedback_job import FeedbackEncoder
    return paired_share(settings.feedback_reference, FeedbackEncoder.reference_tokens, settings.run.calib_samples,
                        settings.run.calib_seqlen)
