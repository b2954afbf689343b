"""A recipe as jobs: one job per (model, format), grouped by model so that one read of the source and one
calibration pass serve every format of the model; stable ids; shards.

A job's id hashes everything its artifact depends on — the model and its resolved revision, the format, the
convert options, the calibration and the quantkit version — so a rerun recognises finished work and a change
to any of them makes a new job instead of silently reusing an old artifact.  (Evaluation and push settings
are not in the id: changing them does not redo a finished conversion; `--force` does.)"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..artifact import model_base_name
from ..errors import UsageError
from .schema import Recipe, Settings


@dataclass
class Job:
    id: str
    model: str
    format: str
    group: str                       # the model group's key
    settings: dict                   # options, calibration, eval, push (resolved, plain JSON)

    def to_dict(self) -> dict:
        return {"id": self.id, "model": self.model, "format": self.format, "settings": self.settings}


@dataclass
class Group:
    key: str
    model: str
    name: str
    revision: str | None
    jobs: list[Job] = field(default_factory=list)
    resources: dict = field(default_factory=lambda: {"num_cpus": 1, "num_gpus": 0})
    command: str | None = None   # what made its artifacts, for their records and cards


def _merged(defaults: Settings, entry: Settings) -> dict:
    """The model's settings: its own lists replace the defaults', its options are merged over them."""
    options = {**(defaults.options.model_dump(exclude_unset=True) if defaults.options else {}),
               **(entry.options.model_dump(exclude_unset=True) if entry.options else {})}
    pick = lambda key: getattr(entry, key) if getattr(entry, key) is not None else getattr(defaults, key)  # noqa: E731
    return {"formats": pick("formats") or [], "options": options,
            "resources": pick("resources").model_dump() if pick("resources") else {"num_cpus": 1, "num_gpus": 0},
            "calibration": pick("calibration").model_dump() if pick("calibration") else None,
            "eval": pick("eval").model_dump() if pick("eval") else None,
            "push": pick("push").model_dump() if pick("push") else None}


def plan_jobs(recipe: Recipe, resolve_revision=None) -> list[Group]:
    """Every model group with its jobs, in recipe order.  `resolve_revision(model) -> str | None` pins a Hub
    model's revision (None: the spec's own @rev, if any)."""
    groups: dict[str, Group] = {}
    for entry in recipe.models:
        s = _merged(recipe.defaults, entry)
        if not s["formats"]:
            raise UsageError(f"{entry.model}: no formats (set `formats:` under defaults or for the model)")
        revision = resolve_revision(entry.model) if resolve_revision else _spec_revision(entry.model)
        key = f"{entry.model}@{revision or ''}"
        if key in groups:
            raise UsageError(f"{entry.model} is listed twice in the recipe; give it one entry with all its formats")
        name = entry.name or model_base_name(entry.model.split("@")[0])
        group = groups[key] = Group(key, entry.model, name, revision, resources=s["resources"])
        for fmt in dict.fromkeys(s["formats"]):
            settings = {k: s[k] for k in ("options", "calibration", "eval", "push")}
            if settings["push"]:
                settings["push"] = {**settings["push"], "repo": _repo(settings["push"]["repo"], name, fmt)}
            # what the artifact depends on; evaluation and push settings are not part of it
            digest = hashlib.sha256(json.dumps({"model": entry.model, "revision": revision, "format": fmt,
                                                "quantkit": __version__, "options": settings["options"],
                                                "calibration": settings["calibration"]}, sort_keys=True).encode())
            group.jobs.append(Job(digest.hexdigest()[:16], entry.model, fmt, key, settings))
    return list(groups.values())


def _spec_revision(model: str) -> str | None:
    return model.split("@", 1)[1] if "@" in model and not Path(model).exists() else None


def _repo(template: str, name: str, fmt: str) -> str:
    backend, _, variant = fmt.partition(":")
    try:
        return template.format(name=name, format=backend, variant=variant)
    except (KeyError, IndexError, ValueError):
        raise UsageError(f"push repo {template!r}: only {{name}}, {{format}} and {{variant}} can be filled in") from None


def shard(groups: list[Group], index: int, total: int) -> list[Group]:
    """Shard `index` of `total`: every total-th model group by the order of their keys, so the split depends
    only on the recipe, and shards 0 … total-1 together hold every group exactly once."""
    if total < 1 or not 0 <= index < total:
        raise UsageError(f"--shard {index}/{total}: expected I/N with 0 <= I < N")
    ordered = sorted(groups, key=lambda g: hashlib.sha256(g.key.encode()).hexdigest())
    return [g for i, g in enumerate(ordered) if i % total == index]


def shard_from_environment(env=os.environ) -> tuple[int, int] | None:
    """(index, total) from the usual CI variables: GitLab's parallel jobs (CI_NODE_INDEX is 1-based), Slurm job
    arrays, Kubernetes indexed jobs (JOB_COMPLETION_INDEX with QUANTKIT_SHARD_TOTAL, which Kubernetes does not
    provide); None when none is set.  GitHub Actions passes `--shard` from its matrix."""
    if env.get("CI_NODE_INDEX") and env.get("CI_NODE_TOTAL"):
        return int(env["CI_NODE_INDEX"]) - 1, int(env["CI_NODE_TOTAL"])
    if env.get("SLURM_ARRAY_TASK_ID") and env.get("SLURM_ARRAY_TASK_COUNT"):
        return (int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", 0)),
                int(env["SLURM_ARRAY_TASK_COUNT"]))
    if env.get("JOB_COMPLETION_INDEX") and env.get("QUANTKIT_SHARD_TOTAL"):
        return int(env["JOB_COMPLETION_INDEX"]), int(env["QUANTKIT_SHARD_TOTAL"])
    return None


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = text.split("/")
        return int(i), int(n)
    except ValueError:
        raise UsageError(f"--shard {text!r}: expected I/N, e.g. 0/4") from None
