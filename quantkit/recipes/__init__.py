"""Batch recipes: a YAML file of models × formats (schema.py, validated with pydantic), expanded into jobs with
stable ids grouped by model and split into shards (jobs.py), run resumably with a result.json per finished job
(runner.py), and merged across shards into one report (report.py)."""
from .jobs import parse_shard, shard_from_environment
from .report import Report, collect
from .runner import RunSummary, run_recipe
from .schema import load_recipe

__all__ = ["Report", "RunSummary", "collect", "load_recipe", "parse_shard", "run_recipe", "shard_from_environment"]
