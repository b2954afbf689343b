"""quantkit's Python API.  The CLI only parses arguments, calls these and renders the results."""
from __future__ import annotations

from pathlib import Path
from typing import Any


import logging

from . import __version__
from .device import resolve_device
from .backends import Plan, backend_for_artifact, parse_format_spec, registered_backends, PLANNED
from .errors import INTERRUPTS, OutputError, QuantkitError, UsageError
from .eval.harness import EvalResult, evaluate as _evaluate, load_windows
from .heap import warm_start
from .model.checkpoint import Checkpoint
from .model.source import open_model
from .preflight import Resources, RunEstimate, calibration_seconds, check as check_resources, combine, note_startup
from .progress import Progress, null_progress

log = logging.getLogger("quantkit")


def list_formats() -> dict[str, Any]:
    """Installed formats with their variants, and the planned ones not installed yet."""
    installed = {name: {"summary": b.summary, "variants": b.variants()} for name, b in registered_backends().items()}
    return {"installed": installed, "planned": [p for p in PLANNED if p not in installed]}


def open_any(spec: str, base: Checkpoint | None = None, activations: str = "exact"):
    """A model spec, or an artifact file/folder that an installed format can read."""
    path = Path(spec).expanduser()
    if path.exists():
        backend = backend_for_artifact(path)
        if backend is not None:
            return backend.open_artifact(path, base=base, activations=activations)
    if activations != "exact":
        raise UsageError(f"--activations {activations}: only quantized artifacts have a runtime to emulate")
    return open_model(spec)


def inspect(spec: str) -> dict[str, Any]:
    path = Path(spec).expanduser()
    if path.exists():
        backend = backend_for_artifact(path)
        if backend is not None:
            return backend.describe_artifact(path)
    model = open_model(spec)
    cfg = model.config
    return {
        "kind": "checkpoint",
        "name": model.name,
        "folder": str(model.folder),
        "revision": model.revision,
        "architecture": cfg.model_type,
        "family": model.adapter.family,
        "parameters": model.parameter_count(),
        "size_on_disk": model.size_on_disk(),
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
        "tied_embeddings": model.tied_embeddings,
        "tensors": [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype} for e in model.weights.entries.values()],
    }


RUNTIMES = ("quantkit", "llama.cpp", "transformers", "vllm", "exllamav2")


def evaluate(spec: str, data: str | Path, *, base: str | None = None, ctx: int = 512, windows: int = 40,
             device: str | None = None, runtime: str = "quantkit", activations: str = "exact",
             kv_cache: str | None = None, progress: Progress = null_progress) -> EvalResult:
    """Score a model or artifact.  runtime="quantkit" dequantizes with quantkit's own readers; another runtime
    runs the artifact in the runtime its format names (llama.cpp for GGUF; transformers + GPTQModel for GPTQ,
    transformers + bitsandbytes for bnb; vLLM for GPTQ and AWQ and exllamav2 for GPTQ and EXL2, on a GPU); the
    base model, if any, always runs in quantkit.
    activations="llama.cpp" makes quantkit's runtime round activations as llama.cpp does before each matmul.
    kv_cache (a runtime's cache type, e.g. "q8_0") keeps the runtime's K/V cache in that type."""
    if runtime not in RUNTIMES:
        raise UsageError(f"--runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    if kv_cache is not None:
        from .eval.kv_cache import parse_types
        backend = backend_for_artifact(Path(spec)) if Path(spec).exists() else None
        if backend is None or runtime not in backend.kv_cache_runtimes:
            raise UsageError("--kv-cache: the K/V cache is quantized by the runtime that runs the artifact: "
                             "a GGUF file with --runtime llama.cpp, a GPTQ, AWQ or bnb folder with --runtime "
                             "transformers")
        (kv_cache,) = parse_types(kv_cache, runtime)
    base_model = open_model(base) if base else None
    model = open_any(spec, base=base_model, activations=activations)
    tokens = load_windows((base_model or model).tokenizer, Path(data), ctx, windows)
    logits = None
    if runtime != "quantkit":
        backend = backend_for_artifact(Path(spec)) if Path(spec).exists() else None
        if backend is None or runtime not in backend.runtimes:
            loads = {r: [b.name for b in registered_backends().values() if r in b.runtimes] for r in RUNTIMES[1:]}
            raise UsageError(f"--runtime {runtime} runs {', '.join(loads[runtime])} artifacts; {spec} is not one")
        logits = backend.runtime_logits(Path(spec), runtime, tokens, **({"kv_cache": kv_cache} if kv_cache else {}))
    result = _evaluate(model, tokens, base=base_model, device=resolve_device(device), data_name=str(data),
                       progress=progress, model_logits=logits)
    result.runtime = runtime
    if kv_cache is not None:
        from .eval.kv_cache import cache_bytes
        result.kv_cache, result.kv_cache_bytes = kv_cache, cache_bytes(model.config, ctx, kv_cache, runtime)
    return result


def verify(artifact, *, base: str | None = None, runtimes: list[str] | None = None, tokens: int = 128,
           generate: int = 32, record: bool = True):
    """The artifact's integrity and its runs in the real runtimes (quantkit.verify)."""
    from .verify import verify as _verify
    return _verify(artifact, base=base, runtimes=runtimes, tokens=tokens, generate=generate, record=record)


def push(artifacts, repo: str, *, revision: str | None = None, private: bool = False, create_pr: bool = False,
         message: str | None = None, token: str | None = None, card: bool = True, base_model: str | None = None,
         license: str | None = None, no_verify: bool = False, progress: Progress = null_progress):
    """Upload finished artifacts to the Hub repo `repo` as one commit, with its model card regenerated
    (quantkit.publish.push); an artifact whose recorded verify failed is refused unless `no_verify`."""
    from .publish import push as _push
    return _push(artifacts, repo, revision=revision, private=private, create_pr=create_pr, message=message,
                 token=token, card=card, base_model=base_model, license=license, no_verify=no_verify,
                 progress=progress)


def card(artifacts, repo: str, out: str | Path, *, base_model: str | None = None,
         license: str | None = None) -> list[Path]:
    """The model card (README.md and its plot) a push of `artifacts` to `repo` would write, into `out`."""
    from .artifact import atomic_file, ensure_output_dir
    from .publish import card_files, placement, row_for
    from .publish.contents import artifact_files
    artifact_files([Path(a) for a in artifacts])   # the same completeness checks as a push
    rows = [row_for(a, place) for a, place in placement([Path(a) for a in artifacts]).items()]
    written = []
    for name, data in card_files(repo, rows, base_model=base_model, license=license).items():
        target = ensure_output_dir(Path(out)) / name
        with atomic_file(target) as tmp:
            tmp.write_bytes(data)
        written.append(target)
    return written


def check_recordable(spec: str) -> None:
    """A usage error unless `spec` is a quantized artifact on disk (what --record can store figures in)."""
    path = Path(spec).expanduser()
    if not path.exists() or backend_for_artifact(path) is None:
        raise UsageError(f"--record: {spec} is not a quantized artifact on disk; figures are recorded in an "
                         f"artifact's quantkit.json")


def record_metrics(artifact: str | Path, result: EvalResult, data: str | Path, runtime: str,
                   activations: str) -> Path:
    """Store an evaluation of `artifact` in its record (quantkit.json, or NAME.gguf.quantkit.json)."""
    from .publish import write_metrics
    return write_metrics(Path(artifact), result, Path(data), runtime, activations)


def check_repo_id(repo: str) -> None:
    """A usage error unless `repo` is a valid ORG/NAME."""
    from .publish.hub import check_repo_id as _check
    _check(repo)


def plan(spec: str, formats: list[str], out: str | Path, options: dict | None = None) -> list[Plan]:
    note_startup()
    warm_start()    # its probes time work as the run will do it: see quantkit.heap
    parsed = _parse_formats(formats)
    options = {**(options or {}), "estimate_time": True}
    settings = _settings(parsed, options)
    model = open_model(spec)
    plans = [b.plan(model, v, Path(out), settings[b.name]) for b, _, v in parsed]
    calibrated = [p.resources for p in plans if p.resources is not None and p.resources.calibrated]
    if calibrated and options.get("calib"):
        try:
            setup = calibration_seconds(model, calibration_spec(options, [f"{p.format}:{p.variant}" for p in plans]))
        except QuantkitError:    # bad calibration data is the real run's error to give, with its own message
            setup = 0.0
        for r in calibrated:
            r.setup_seconds = setup
    return plans


def estimate(plans: list[Plan], options: dict | None = None) -> RunEstimate:
    """What the run of these plans takes at its peak: RAM, GPU memory, disk (final + temporary), time."""
    options = options or {}
    return combine([p.resources or Resources() for p in plans], str(resolve_device(options.get("device"))),
                   resume=options.get("resume", True) is not False)


def convert(spec: str, formats: list[str], out: str | Path, *, options: dict | None = None,
            progress: Progress = null_progress, command: str | None = None) -> list[Path]:
    """Write one artifact per format spec, in the order asked.  `command` (what the user ran, for the model
    card) is stored in each artifact's record."""
    parsed = _parse_formats(formats)  # reject bad formats and options before touching the model
    options = options or {}
    settings = _settings(parsed, options)
    warm_start()
    model = open_model(spec)
    plans = [backend.plan(model, variant, Path(out), settings[backend.name]) for backend, _, variant in parsed]
    groups: dict[str, tuple] = {}  # one write_all per format: each format reads the source once for all its variants
    for (backend, _, variant), plan_ in zip(parsed, plans):
        groups.setdefault(backend.name, (backend, []))[1].append((variant, plan_))
    calibrated = [(b, v, p) for b, items in groups.values() if b.calibrated for v, p in items]
    collected = {name: b.pass_jobs(model, items, settings[name]) for name, (b, items) in groups.items()
                 if not b.calibrated}
    written: list[Path] = []
    from .artifact import output_locks
    with output_locks([Path(p.output) for p in plans]):   # first: an unwritable output is said as such
        if options.get("preflight", True):
            check_resources(estimate(plans, options), Path(out))
        if calibrated or any(collected.values()):
            written = _convert_calibrated(model, calibrated, settings, [j for js in collected.values() for j in js],
                                          options, progress, [Path(p.output) for p in plans], Path(out))
        for name, (backend, items) in groups.items():
            if not backend.calibrated:
                files = backend.write_all(model, items, Path(out), settings[name], progress, collected[name])
                fields = backend.record_fields(settings[name], collected[name])
                if fields:
                    from .publish.record import update_record
                    for path in files:
                        update_record(path, fields)
                written += files
    # in the order the formats were asked for (the writing order groups them by format and calibration)
    asked = [Path(p.output) for p in plans]
    assert sorted(map(str, written)) == sorted(map(str, asked)), (written, asked)
    if command:
        import os
        from concurrent.futures import ThreadPoolExecutor
        from .publish.record import write_origin
        source = {"model": model.name, "revision": model.revision}
        # each record holds its file's sha256, read back from the disk: the files side by side (hashlib lets go
        # of the GIL on large blocks), ~0.7 s a GiB each
        with ThreadPoolExecutor(max(1, min(len(asked), os.cpu_count() or 1))) as pool:
            list(pool.map(lambda path: write_origin(path, command, source), asked))
    return asked


def calibration_spec(options: dict, formats: list[str]):
    """The CalibrationSpec the options ask for; a usage error naming the flags if there is none."""
    from .calibration import CalibrationSpec, calibration_size
    if not options.get("calib"):
        raise UsageError(f"{', '.join(formats)} needs calibration data: add --calib FILE (.txt/.jsonl/.parquet), "
                         f"--calib hf:NAME[:CONFIG]:SPLIT[:COLUMN] or --calib self")
    samples, seqlen = calibration_size(options)
    return CalibrationSpec(source=str(options["calib"]), samples=samples, seqlen=seqlen,
                           seed=int(options.get("seed") or 0), column=options.get("calib_column"))


def _settings(parsed, options: dict) -> dict:
    """Each format's typed settings, parsed once; an option owned by a format that is not in the run is refused
    rather than silently ignored."""
    in_run = {b.name: b for b, _, _ in parsed}
    for backend in registered_backends().values():
        if backend.name in in_run:
            continue
        for key, what in backend.owned_options.items():
            if options.get(key) not in (None, False, [], ()):
                flag = "--" + key.replace("_", "-")
                raise UsageError(f"{flag} {what} ({backend.name} option); add -f {backend.name}:VARIANT, or drop {flag}")
    return {name: b.settings(options) for name, b in in_run.items()}


def _convert_calibrated(model, items, settings: dict, collectors: list, options: dict,
                        progress: Progress, outputs: list[Path], out: Path) -> list[Path]:
    """Every calibrated artifact of the run, and what uncalibrated formats collect (GGUF's importance matrix),
    from one capture pass over the model; resumed from a previous run's last finished layer when that run had
    the same inputs (quantkit.calibration.resume), unless options["resume"] is False."""
    from contextlib import ExitStack
    from .artifact import atomic_folder
    from .calibration import load_calibration
    from .calibration.capture import run_capture
    device = resolve_device(options.get("device"))
    calibrated_names = [f"{b.name}:{p.variant}" for b, v, p in items if b.needs_calibration(v, settings[b.name])]
    calibrated_names += [c.label for c in collectors]
    calibration = None
    if calibrated_names:
        spec = calibration_spec(options, calibrated_names)
        calibration = load_calibration(spec, model, device=device, progress=progress)
        for collector in collectors:
            collector.calibration = calibration
    checkpoint, point, saved = _run_checkpoint(model, items, collectors, options, calibration, outputs, out, device)
    with ExitStack() as stack:
        jobs = []
        try:
            for backend, variant, plan in items:
                folder = stack.enter_context(atomic_folder(
                    Path(plan.output), resume=None if checkpoint is None else point is not None,
                    keep_on_interrupt=lambda: checkpoint.saved is not None))
                jobs.append(backend.make_job(model, variant, plan, folder, settings[backend.name], calibration))
            capture_jobs = [j for j in jobs if j.needs_calibration] + collectors
            if point is not None:
                # every job made before any is restored: a job's shape (its passes) must be the one it had in
                # the run being resumed, not one seen through another job's restored state
                for job, (state, _) in zip(jobs + collectors, saved):
                    job.restore(state)
            for job in jobs:
                try:
                    job.open()
                except OSError as e:
                    if point is None:
                        raise
                    raise OutputError(f"{job.folder}: the previous run's partial files cannot be taken up ({e}); "
                                      f"rerun with --no-resume") from None
            if point is not None:
                passes = max(getattr(j, "passes", 1) for j in capture_jobs)
                log.info(f"resuming from layer {point.layer} of {model.num_layers}"
                         + (f" (pass {point.pass_index + 1}/{passes})" if passes > 1 else "")
                         + f": {checkpoint.folder.name} holds the previous run's state")
            resume = None
            if point is not None:
                resume = (point, {j: saved[k][1] for k, j in enumerate(jobs + collectors) if saved[k][1] is not None})
            if checkpoint is not None:
                checkpoint.bind(jobs + collectors)     # the numbering of the checkpoint's files
            run_capture(model, calibration.tokens if calibration is not None else None, capture_jobs,
                        device=device, progress=progress, resume=resume, checkpoint=checkpoint)
            plain = [j for j in jobs if not j.needs_calibration]
            for job in plain:
                job.run_uncalibrated(progress.task(f"{job.label} layers", total=model.num_layers))
            for job in jobs:
                job.finish()
        except BaseException as e:
            for job in jobs:
                job.abort()
            if checkpoint is not None:
                checkpoint.settle()
            if checkpoint is None or not isinstance(e, INTERRUPTS) or checkpoint.saved is None:
                for collector in collectors:    # what a collector spilled for the writer (GGUF's error feedback)
                    if hasattr(collector, "discard"):
                        collector.discard()
            if checkpoint is not None:
                if isinstance(e, INTERRUPTS) and checkpoint.saved is not None:
                    e.resume_note = (f"rerun the same command to resume after layer {checkpoint.saved.layer}"
                                     + (f" of pass {checkpoint.saved.pass_index + 1}" if checkpoint.saved.pass_index else "")
                                     + f" (its state is in {checkpoint.folder})")
                else:
                    checkpoint.remove()
            raise
    if checkpoint is not None:
        checkpoint.remove()
    return [Path(p.output) for _, _, p in items]


def _run_checkpoint(model, items, collectors, options, calibration, outputs, out, device):
    """(checkpoint, resume point or None, [(state, stream)] by run job number) for a calibrated run."""
    from .artifact import partial_folder
    from .calibration.resume import RunCheckpoint, model_fingerprint
    if calibration is None:
        return None, None, []
    manifest = {"quantkit": __version__, "model": model_fingerprint(model), "device": str(device),
                "calibration": calibration.token_hash,
                "formats": [f"{b.name}:{p.variant}" for b, _, p in items] + [c.label for c in collectors],
                "options": {k: v for k, v in options.items() if k not in _NOT_IN_MANIFEST}}
    checkpoint = RunCheckpoint(Path(out), outputs, manifest)
    if options.get("resume") is False:     # --no-resume: no state is kept, and an old one is dropped
        checkpoint.remove()
        return None, None, []
    point, why = checkpoint.find()
    saved = []
    if point is not None:
        missing = [Path(p.output).name for _, _, p in items if not partial_folder(Path(p.output)).is_dir()]
        if missing:
            point, why = None, f"its partial folder of {missing[0]} is gone"
    if point is not None:
        try:
            saved = [checkpoint.load_job(k, point) for k in range(len(items) + len(collectors))]
        except Exception as e:       # a torn or foreign file: what matters is that the run starts afresh
            point, why = None, f"its state cannot be read ({type(e).__name__})"
    if why:
        log.info(f"starting afresh, not resuming the previous run: {why}")
    if point is None:
        checkpoint.start_fresh()
    else:
        checkpoint.continue_from(point)
    return checkpoint, point, saved


# options that change nothing in the artifacts' bytes: a rerun with other values still resumes (--imatrix-out
# changes only a metadata string, written when the run ends, not what the pass collects)
_NOT_IN_MANIFEST = {"resume", "estimate_time", "push_to_hub", "token", "preflight", "imatrix_out", "imatrix_format"}


def _parse_formats(formats: list[str]):
    if not formats:
        raise UsageError("no output format given; add -f FORMAT:VARIANT (e.g. -f gguf:Q4_K_M)")
    return [parse_format_spec(f) for f in formats]
