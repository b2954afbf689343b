"""`quantkit run RECIPE`: each model group converted in one run (one read, one calibration pass for all its
formats), then each job evaluated and pushed, and each finished job's `result.json` written atomically.

Killed at any moment (SIGKILL included), a rerun loses at most the jobs in flight: artifacts appear only when
complete (atomic folders and files), a job counts as finished only once its result.json exists, and the
leftover `.partial-*` folders of the killed run are removed when its group starts again."""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..artifact import atomic_file, sha256_file
from ..errors import DependencyError, QuantkitError, UsageError
from ..progress import Progress, null_progress
from ..publish.card import row_for
from .jobs import Group, Job, plan_jobs, shard
from .schema import load_recipe

RESULTS = "results"


@dataclass
class RunSummary:
    output: Path
    ran: list[dict] = field(default_factory=list)        # results written by this run
    skipped: list[str] = field(default_factory=list)     # ids already finished
    planned: list[dict] = field(default_factory=list)    # --dry-run: what would run

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.ran if r["status"] != "ok"]


def recipe_groups(path: Path, shard_spec: tuple[int, int] | None = None,
                  output: Path | None = None) -> tuple[Path, list[Group]]:
    """The output folder and the model groups (this shard's) of the recipe at `path`."""
    path = Path(path)
    recipe = load_recipe(path)
    here = path.resolve().parent
    for entry in recipe.models:   # paths in a recipe are relative to the recipe file
        entry.model = _local(here, entry.model)
    groups = plan_jobs(recipe, resolve_revision=_resolve_revision)
    for g in groups:
        for j in g.jobs:
            if j.settings["calibration"]:
                j.settings["calibration"]["source"] = _local(here, j.settings["calibration"]["source"])
            if j.settings["eval"]:
                j.settings["eval"]["data"] = _local(here, j.settings["eval"]["data"])
            if (j.settings["options"] or {}).get("imatrix_file"):
                j.settings["options"]["imatrix_file"] = _local(here, j.settings["options"]["imatrix_file"])
    for g in groups:
        g.command = f"quantkit run {path.name}"
    if shard_spec is not None:
        groups = shard(groups, *shard_spec)
    return Path(output) if output is not None else _local_path(here, recipe.output), groups


EXECUTORS = ("local", "ray")


def run_recipe(path: Path, *, shard_spec: tuple[int, int] | None = None, force: bool = False,
               dry_run: bool = False, output: Path | None = None, executor: str = "local",
               address: str | None = None, progress: Progress = null_progress) -> RunSummary:
    """`output` overrides the recipe's own output folder (one per CI runner, for instance).  executor="ray"
    runs each model group as a Ray task (the output folder must be one all workers see)."""
    if executor not in EXECUTORS:
        raise UsageError(f"--executor {executor!r}: expected one of {', '.join(EXECUTORS)}")
    output, groups = recipe_groups(path, shard_spec, output)
    summary = RunSummary(output)
    work = []
    for group in groups:
        pending = [j for j in group.jobs if force or not finished(output, j)]
        summary.skipped += [j.id for j in group.jobs if j not in pending]
        if dry_run:
            summary.planned += [{**j.to_dict(), "status": "would run" if j in pending else "finished"}
                                for j in group.jobs]
        elif pending:
            work.append((group, pending))
    if executor == "ray" and work:
        summary.ran += _run_on_ray(output, work, address)
    else:
        for group, pending in work:
            summary.ran += run_group(output, group, pending, progress)
    return summary


def _run_on_ray(output: Path, work: list, address: str | None) -> list[dict]:
    """Each model group as a Ray task with the group's resources, retried when its worker dies; a group whose
    task fails for good gets failed results (written here), so collect sees it."""
    try:
        import ray
    except ImportError:
        raise DependencyError("--executor ray needs ray: pip install 'quantkit[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
    task = ray.remote(max_retries=3)(_group_task)
    refs = [(g, jobs, task.options(num_cpus=g.resources["num_cpus"], num_gpus=g.resources["num_gpus"])
             .remote(str(output), g, jobs)) for g, jobs in work]
    ran = []
    for group, jobs, ref in refs:
        try:
            ran += ray.get(ref)
        except Exception as e:  # noqa: BLE001 - a task that failed for good (worker lost past its retries, …)
            reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
            ran += [_write(output, {**_result(group, j), "status": "failed", "error": f"ray: {reason}"}) for j in jobs]
    return ran


def _group_task(output: str, group: Group, jobs: list[Job]) -> list[dict]:
    return run_group(Path(output), group, jobs, null_progress)


def finished(output: Path, job: Job) -> bool:
    result = result_path(output, job.id)
    if not result.is_file():
        return False
    try:
        r = json.loads(result.read_text())
    except ValueError:
        return False
    return r.get("status") == "ok" and bool(r.get("artifact")) and Path(r["artifact"]).exists()


def result_path(output: Path, job_id: str) -> Path:
    return Path(output) / RESULTS / f"{job_id}.json"


def run_group(output: Path, group: Group, jobs: list[Job], progress: Progress) -> list[dict]:
    from .. import api
    folder = Path(output) / group.name
    for stale in folder.glob(".partial-*") if folder.is_dir() else []:   # a killed run's unfinished writes
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    settings = jobs[0].settings
    results = {j.id: _result(group, j) for j in jobs}
    t0 = time.perf_counter()
    try:
        paths = api.convert(group.model, [j.format for j in jobs], folder,
                            options=_convert_options(settings, jobs), progress=progress, command=group.command)
    except QuantkitError as e:
        return [_write(output, {**results[j.id], "status": "failed", "error": f"convert: {e.message}"}) for j in jobs]
    convert_s = round(time.perf_counter() - t0, 2)
    for job, path in zip(jobs, paths):
        r = results[job.id]
        row = row_for(path, path.name)
        r.update(artifact=str(path), files=_files(path), variant=row.variant, size=row.size,
                 bits_per_weight=row.bits_per_weight, timings={"convert_s": convert_s, "convert_jobs": len(jobs)})
        if job.settings["eval"]:
            t1 = time.perf_counter()
            try:
                r["metrics"] = _evaluate(group, path, job.settings["eval"], progress)
            except QuantkitError as e:
                r.update(status="failed", error=f"eval: {e.message}")
            r["timings"]["eval_s"] = round(time.perf_counter() - t1, 2)
        if not job.settings["push"] or r["status"] != "ok":   # finished now: a kill later does not undo it
            _write(output, r)
    for repo, members in _by_repo(jobs, results).items():
        push = members[0].settings["push"]
        t1 = time.perf_counter()
        try:
            pushed = api.push([results[j.id]["artifact"] for j in members], repo, revision=push["revision"],
                              private=push["private"], progress=progress)
            hub = {"repo": repo, "commit": pushed.commit, "uploaded": len(pushed.uploaded)}
            for j in members:
                results[j.id].update(hub=hub)
        except QuantkitError as e:
            for j in members:
                results[j.id].update(status="failed", error=f"push: {e.message}")
        for j in members:
            results[j.id]["timings"]["push_s"] = round(time.perf_counter() - t1, 2)
            _write(output, results[j.id])
    return [results[j.id] for j in jobs]


def _result(group: Group, job: Job) -> dict:
    return {"id": job.id, "status": "ok", "model": group.model, "name": group.name, "revision": group.revision,
            "format": job.format, "settings": job.settings, "quantkit_version": __version__}


def _by_repo(jobs: list[Job], results: dict) -> dict[str, list[Job]]:
    """The jobs to push, by target repo: one push (one commit) per repo."""
    out: dict[str, list[Job]] = {}
    for j in jobs:
        if j.settings["push"] and results[j.id]["status"] == "ok":
            out.setdefault(j.settings["push"]["repo"], []).append(j)
    return out


def _evaluate(group: Group, artifact: Path, ev: dict, progress: Progress) -> dict:
    from .. import api
    result = api.evaluate(str(artifact), ev["data"], base=group.model, ctx=ev["ctx"], windows=ev["windows"],
                          runtime=ev["runtime"], progress=progress)
    api.record_metrics(artifact, result, ev["data"], ev["runtime"], "exact")
    return {k: v for k, v in result.to_dict().items() if k in
            ("perplexity", "base_perplexity", "mean_kld", "top1_agreement", "tokens_scored", "ctx", "windows")}


def _convert_options(settings: dict, jobs: list[Job]) -> dict:
    """convert's options for these jobs.  A recipe's defaults serve models with different formats, so an
    option owned by a format none of these jobs has is left out (convert itself refuses such an option: on
    the command line it is a mistake)."""
    from ..backends import registered_backends
    in_run = {j.format.split(":")[0].lower() for j in jobs}
    foreign = {key for name, b in registered_backends().items() if name not in in_run for key in b.owned_options}
    options = {k: v for k, v in settings["options"].items() if k not in foreign}
    if "max_shard_size" in options:
        options["max_shard_bytes"] = int(options.pop("max_shard_size") * 2**30)
    cal = settings["calibration"]
    if cal:
        options.update(calib=cal["source"], calib_samples=cal["samples"], calib_seqlen=cal["seqlen"],
                       seed=cal["seed"], calib_column=cal["column"])
    return options


def _files(path: Path) -> dict[str, str]:
    path = Path(path)
    if path.is_file():
        return {path.name: sha256_file(path)}
    return {p.relative_to(path).as_posix(): sha256_file(p) for p in sorted(path.rglob("*")) if p.is_file()
            and p.name != "quantkit.json"}   # quantkit.json changes with timings and recorded metrics


def _write(output: Path, result: dict) -> dict:
    path = result_path(output, result["id"])
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _local(here: Path, spec: str) -> str:
    """A path in the recipe, relative to the recipe's folder, made absolute; anything else as written."""
    candidate = here / spec
    return str(candidate) if not Path(spec).is_absolute() and candidate.exists() else spec


def _local_path(here: Path, spec: str) -> Path:
    return Path(spec) if Path(spec).is_absolute() else here / spec


def _resolve_revision(model: str) -> str | None:
    """A Hub model's commit (its @rev, or main's current head); None for local folders and demos."""
    from ..model.source import HUB_ID, resolve_hub_revision
    m = HUB_ID.match(model)
    if model.startswith("demo:") or not m or Path(model).exists():
        return None
    return resolve_hub_revision(m["repo"], m["rev"])
