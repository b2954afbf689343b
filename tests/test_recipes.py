"""Recipes: validation that names file, line and key; stable job ids; shards that together run every job
once; resumable runs (SIGKILL and rerun give the same files); collect's report and its exit code."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from quantkit.errors import UsageError
from quantkit.recipes import load_recipe, shard_from_environment
from quantkit.recipes.jobs import plan_jobs, shard


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, where", [
    ("models:\n  - model: demo:smollm2-135m\n    formats: [gguf:Q4_K_M]\n    colour: blue\n", r"r.yaml:4: models.0.colour: unknown key"),
    ("models:\n  - model: demo:smollm2-135m\n    formats: [gguf:Q9_X]\n", r"r.yaml:3: models.0.formats: .*Q9_X"),
    ("defaults:\n  eval:\n    data: x.txt\n    windows: many\n"
     "models:\n  - model: m\n", r"r.yaml:4: defaults.eval.windows: .*integer"),
    ("defaults:\n  options: {imatrx: true}\nmodels:\n  - model: m\n", r"r.yaml:2: defaults.options.imatrx: unknown key"),
    ("output: x\n", r"r.yaml:1: models: Field required"),
    ("models: [\n", r"r.yaml:2: not valid YAML"),
    ("- just a list\n", r"r.yaml: a recipe is a mapping"),
])
def test_bad_recipes_name_file_line_and_key(tmp_path, text, where):
    with pytest.raises(UsageError, match=where):
        load_recipe(write(tmp_path, text))


def test_bad_recipe_on_the_command_line_is_one_line(tmp_path):
    r = run_cli("run", str(write(tmp_path, "models:\n  - model: m\n    formats: [gguf:Q4_K_M]\n    bits: 4\n")))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "r.yaml:4" in r.stderr


def test_job_ids_are_stable_and_follow_what_the_artifact_depends_on(tmp_path):
    base = "models:\n  - model: demo:smollm2-135m\n    formats: [gguf:Q4_K_M, gguf:Q8_0]\n"
    ids = lambda text: [j.id for g in plan_jobs(load_recipe(write(tmp_path, text))) for j in g.jobs]  # noqa: E731
    assert ids(base) == ids(base) and len(set(ids(base))) == 2
    for change in ("    options: {pure: true}\n", "    calibration: {source: bundle:wikitext2-en}\n"):
        assert not set(ids(base + change)) & set(ids(base))
    assert ids(base + "    eval: {data: x.txt, windows: 2}\n") == ids(base)      # measuring is not converting
    assert ids(base.replace("[gguf:Q4_K_M, gguf:Q8_0]", "[gguf:Q8_0]")) == ids(base)[1:]


def test_defaults_and_overrides(tmp_path):
    recipe = load_recipe(write(tmp_path, "defaults:\n  formats: [gguf:Q8_0]\n  options: {pure: true, device: cpu}\n"
                                          "  push: {repo: 'org/{name}-{format}'}\n"
                                          "models:\n  - model: a/b\n  - model: c/d\n    formats: [gptq:4bit-g128]\n"
                                          "    options: {device: cuda}\n"))
    (a,), (c,) = (g.jobs for g in plan_jobs(recipe))
    assert a.format == "gguf:Q8_0" and a.settings["options"] == {"pure": True, "device": "cpu"}
    assert c.format == "gptq:4bit-g128" and c.settings["options"] == {"pure": True, "device": "cuda"}
    assert a.settings["push"]["repo"] == "org/b-gguf" and c.settings["push"]["repo"] == "org/d-gptq"


def test_shards_together_run_every_job_exactly_once(tmp_path):
    rng = random.Random(0)
    for trial in range(30):
        models = [f"org{rng.randrange(5)}/m{i}" for i in range(rng.randrange(1, 12))]
        text = "defaults:\n  formats: [gguf:Q4_K_M, gguf:Q8_0]\nmodels:\n" + "".join(f"  - model: {m}\n" for m in models)
        groups = plan_jobs(load_recipe(write(tmp_path, text)))
        every = sorted(j.id for g in groups for j in g.jobs)
        for n in (1, 2, 3, 5, 16):
            seen = sorted(j.id for i in range(n) for g in shard(groups, i, n) for j in g.jobs)
            assert seen == every
            # a model group is never split across shards
            assert all(len({i for i in range(n) if g.key in {h.key for h in shard(groups, i, n)}}) == 1 for g in groups)


def test_shard_from_ci_variables():
    assert shard_from_environment({"CI_NODE_INDEX": "2", "CI_NODE_TOTAL": "3"}) == (1, 3)
    assert shard_from_environment({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4",
                                   "SLURM_ARRAY_TASK_COUNT": "2"}) == (1, 2)
    assert shard_from_environment({"JOB_COMPLETION_INDEX": "0", "QUANTKIT_SHARD_TOTAL": "4"}) == (0, 4)
    assert shard_from_environment({}) is None


RECIPE = """output: out
defaults:
  formats: [gguf:Q4_0, gguf:Q8_0, bnb:nf4]
  options: {{tokenizer_pre: gpt-2, device: cpu}}
  eval: {{data: {text}, ctx: 32, windows: 2}}
models:
  - model: {a}
    name: first
  - model: {b}
    name: second
"""


@pytest.fixture
def two_models(tiny_gguf_source, tmp_path_factory, tiny_text):
    from conftest import make_checkpoint
    b = make_checkpoint(tmp_path_factory.mktemp("tiny") / "llama256b", hidden=256, intermediate=512, heads=4,
                        kv_heads=2, layers=2, vocab=320, bpe=True, seed=1)
    return RECIPE.format(a=tiny_gguf_source, b=b, text=tiny_text)


def shas(output: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text())["files"] for p in (output / "results").glob("*.json")}


def test_run_resume_after_sigkill_and_collect(two_models, tmp_path):
    (tmp_path / "whole").mkdir()
    whole = write(tmp_path / "whole", two_models)
    r = run_cli("run", str(whole), "--json")
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    assert len(first["ran"]) == 6 and all(x["status"] == "ok" and x["metrics"]["mean_kld"] >= 0 for x in first["ran"])
    assert all(x["format"].split(":")[1] in Path(x["artifact"]).name for x in first["ran"])   # each job its own
    from quantkit.publish.record import read_record
    assert {read_record(Path(x["artifact"]))["command"] for x in first["ran"]} == {f"quantkit run {whole.name}"}
    again = json.loads(run_cli("run", str(whole), "--json").stdout)
    assert not again["ran"] and len(again["skipped"]) == 6

    (tmp_path / "killed").mkdir()
    killed = write(tmp_path / "killed", two_models)
    results = tmp_path / "killed" / "out" / "results"
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", "run", str(killed)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and len(list(results.glob("*.json"))) < 3 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(list(results.glob("*.json")))
    assert 3 <= done_before < 6, "the kill should land between the two model groups"
    rerun = json.loads(run_cli("run", str(killed), "--json").stdout)
    assert len(rerun["ran"]) == 6 - done_before and len(rerun["skipped"]) == done_before
    assert shas(tmp_path / "killed" / "out") == shas(tmp_path / "whole" / "out")
    assert not list((tmp_path / "killed" / "out").rglob(".partial-*"))

    r = run_cli("collect", str(tmp_path / "killed" / "out"), "--recipe", str(killed))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "killed" / "out" / "report.json").read_text())
    assert report["complete"] and report["ok"] == 6
    assert len(list((tmp_path / "killed" / "out").glob("*-kld-vs-bpw.png"))) == 2


def test_collect_fails_with_a_missing_shard(two_models, tmp_path):
    recipe = write(tmp_path, two_models)
    r = run_cli("run", str(recipe), "--shard", "0/2", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["ran"]) == 3
    r = run_cli("collect", str(tmp_path / "out"), "--recipe", str(recipe))
    assert r.returncode == 1 and "3 missing" in r.stderr
    r = run_cli("run", str(recipe), "--json", env={"CI_NODE_INDEX": "2", "CI_NODE_TOTAL": "2"})
    assert len(json.loads(r.stdout)["ran"]) == 3
    assert run_cli("collect", str(tmp_path / "out"), "--recipe", str(recipe)).returncode == 0


def test_shipped_recipes_validate_and_plan():
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        load_recipe(recipe)
    r = run_cli("run", str(ROOT / "recipes" / "demo.yaml"), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    assert [j["format"] for j in json.loads(r.stdout)["planned"]] == \
        ["gguf:Q4_K_M", "gguf:Q8_0", "gptq:4bit-g64", "bnb:nf4", "bnb:int8"]


def comparable(output: Path) -> dict[str, dict]:
    """The result files without what differs by where and when a job ran."""
    out = {}
    for p in (output / "results").glob("*.json"):
        r = json.loads(p.read_text())
        for key in ("timings", "artifact"):
            r.pop(key, None)
        out[p.stem] = r
    return out


def test_ray_executor_gives_the_local_results(two_models, tmp_path):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'quantkit[ray]')")
    from quantkit.recipes import run_recipe
    recipe = write(tmp_path, two_models)
    local = run_recipe(recipe, output=tmp_path / "local")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = run_recipe(recipe, output=tmp_path / "ray", executor="ray")
    finally:
        ray.shutdown()
    assert not local.failed and not on_ray.failed and len(on_ray.ran) == 6
    assert comparable(tmp_path / "ray") == comparable(tmp_path / "local")
