"""The format registry.

A format is a plugin: a `Backend` object registered under the entry-point group
`quantkit.backends` (quantkit's own formats register themselves the same way in
pyproject.toml), so a third party can add one without touching the core.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from ..errors import QuantkitError, UsageError
from ..options import RunOptions

ENTRY_POINT_GROUP = "quantkit.backends"
# Formats the project plans; listed in messages so a user knows what exists and what is coming.
PLANNED = ("gguf", "gptq", "awq", "exl2", "bnb")


@dataclass
class PlanRow:
    tensor: str
    shape: tuple[int, ...]
    kind: str          # the target type, e.g. "Q4_K" or "gptq 4-bit g128"
    bytes: int
    note: str = ""


@dataclass
class Plan:
    format: str
    variant: str
    output: str
    rows: list[PlanRow] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    resources: Any = None     # quantkit.preflight.Resources: what the job takes (RAM, disk, time)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def weights(self) -> int:
        n = 0
        for r in self.rows:
            k = 1
            for d in r.shape:
                k *= d
            n += k
        return n

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.total_bytes / max(self.weights, 1)


class Backend:
    """The contract every format implements.

    The run's options reach a format once, through `settings`, which parses the options it owns
    (`owned_options`) and the shared `RunOptions` into its own typed settings; every other method gets those.

    A format that quantizes from calibration statistics sets `calibrated = True` and, instead of
    `write_all`, implements `needs_calibration` and `make_job`: the job is an `ArtifactJob`
    (quantkit.calibration.jobs) in the shared capture pass and writes its artifact into the folder it is given.
    An uncalibrated format may still want something from the pass (GGUF's importance matrix): `pass_jobs`
    returns those participants, and `write_all` gets them back as `collected` once the pass is over."""
    name: str = ""
    summary: str = ""
    calibrated: bool = False
    # option key -> what it does; setting one without this format in the run is a usage error
    owned_options: dict[str, str] = {}

    def settings(self, options: dict) -> Any:
        """This format's typed settings for a run, from the options dict (raise UsageError for bad values)."""
        return RunOptions.from_dict(options)

    def pass_jobs(self, model, items: list[tuple[Any, "Plan"]], settings) -> list:
        """Participants (LayerJob) this uncalibrated format adds to the capture pass; [] for none."""
        return []

    def variants(self) -> list[str]:
        """Spec strings this format accepts after the colon (for help and error messages)."""
        raise NotImplementedError

    def parse_variant(self, text: str) -> Any:
        """Validate a spec string; raise UsageError naming the valid choices."""
        raise NotImplementedError

    def plan(self, model, variant, out_dir: Path, settings) -> Plan:
        raise NotImplementedError

    def write_all(self, model, items: list[tuple[Any, Plan]], out_dir: Path, settings, progress,
                  collected: list | None = None) -> list[Path]:
        """Write one artifact per (variant, plan) from one read of the model; return their paths.
        `collected`: this format's `pass_jobs`, after the pass.  Must never leave a partial artifact behind."""
        raise NotImplementedError

    def record_fields(self, settings, collected: list) -> dict:
        """Entries the api adds to each written file's record after `write_all` (for formats whose bytes cannot
        carry them, GGUF); {} for none."""
        return {}

    def needs_calibration(self, variant, settings) -> bool:
        return False

    def make_job(self, model, variant, plan: Plan, folder: Path, settings, calibration):
        """The variant's `ArtifactJob` (quantkit.calibration.jobs), writing into `folder`."""
        raise NotImplementedError

    def can_read(self, path: Path) -> bool:
        return False

    def open_artifact(self, path: Path, base=None, activations: str = "exact"):
        """A DenseModel view of an artifact (dequantized by this format's own reader), for eval.
        `activations` names a runtime whose activation rounding to reproduce ("exact": none)."""
        raise NotImplementedError

    def describe_artifact(self, path: Path) -> dict:
        raise NotImplementedError

    # runtimes other than quantkit's own reader that load this format's artifacts (for eval --runtime, verify)
    runtimes: tuple[str, ...] = ()
    # those of them that can keep the K/V cache quantized: runtime_logits(..., kv_cache=TYPE)
    kv_cache_runtimes: tuple[str, ...] = ()

    def runtime_logits(self, path: Path, runtime: str, tokens):
        """Each window's logits (ctx, vocab) from `runtime` (one of `runtimes`) running the artifact: by default
        through the first of `runtime_loaders` that loads (quantkit.verify.sessions)."""
        from ..verify.sessions import session_window_logits
        return session_window_logits(self.runtime_loaders(path, runtime, tokens.shape[1]), tokens)

    # the Python packages each runtime needs, for `verify`'s "not installed"
    runtime_packages: dict[str, tuple[str, ...]] = {}

    def runtime_missing(self, runtime: str) -> str | None:
        import importlib.util
        missing = [m for m in self.runtime_packages.get(runtime, ()) if importlib.util.find_spec(m) is None]
        if missing:
            return f"needs {', '.join(missing)} (not installed here)"
        import torch
        if runtime in GPU_RUNTIMES and not torch.cuda.is_available():
            return f"{runtime} runs only on a CUDA GPU (none here)"
        return None

    def runtime_loaders(self, path: Path, runtime: str, ctx: int) -> list:
        """The ways a user loads the artifact in `runtime`, the one they would try first first: (how, a callable
        returning a quantkit.verify.sessions session) pairs, for `quantkit verify`.  Here: the GPU runtimes,
        which load a folder one way whatever its format."""
        from ..verify.sessions import ExLlamaV2Session, VLLMSession
        if runtime == "vllm":
            return [(VLLM_WAY, lambda: VLLMSession(Path(path), ctx, VLLM_WAY))]
        if runtime == "exllamav2":
            return [(EXLLAMAV2_WAY, lambda: ExLlamaV2Session(Path(path), ctx, EXLLAMAV2_WAY))]
        raise NotImplementedError(f"{self.name}: no way to load it in {runtime}")


# runtimes that run only on a GPU: verify says so instead of trying them on a machine without one
GPU_RUNTIMES = ("vllm", "exllamav2")
VLLM_WAY = "vllm.LLM(folder)"
EXLLAMAV2_WAY = "ExLlamaV2(ExLlamaV2Config(folder))"


# quantkit's own formats, also found when the package runs from a source tree without installed metadata.
BUILTIN = {"gguf": "quantkit.backends.gguf:BACKEND", "gptq": "quantkit.backends.gptq:BACKEND",
           "awq": "quantkit.backends.awq:BACKEND", "bnb": "quantkit.backends.bnb:BACKEND",
           "exl2": "quantkit.backends.exl2:BACKEND"}


def _load_builtin(ref: str) -> Backend:
    import importlib
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def registered_backends() -> dict[str, Backend]:
    found: dict[str, Backend] = {name: _load_builtin(ref) for name, ref in BUILTIN.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as e:  # a broken third-party plugin must not break quantkit
            raise QuantkitError(f"format plugin {ep.name!r} ({ep.value}) failed to load: {e}") from e
        backend = obj() if isinstance(obj, type) else obj
        found[ep.name] = backend
    return found


def get_backend(name: str) -> Backend:
    backends = registered_backends()
    if name in backends:
        return backends[name]
    if backends:
        raise UsageError(f"unknown format {name!r}; available: {', '.join(sorted(backends))}")
    raise UsageError(f"unknown format {name!r}: no output format is installed yet (planned: {', '.join(PLANNED)})")


def parse_format_spec(spec: str) -> tuple[Backend, str, Any]:
    """'gguf:Q4_K_M' -> (backend, 'Q4_K_M', parsed variant)."""
    name, sep, variant = spec.partition(":")
    if not sep or not name or not variant:
        raise UsageError(f"format {spec!r} should look like FORMAT:VARIANT, e.g. gguf:Q4_K_M")
    backend = get_backend(name.lower())
    return backend, variant, backend.parse_variant(variant)


def backend_for_artifact(path: Path) -> Backend | None:
    for backend in registered_backends().values():
        if backend.can_read(path):
            return backend
    return None
