"""`quantkit push` through the real huggingface_hub client against the local Hub stand-in (tests/hub_standin.py):
one commit per push, nothing re-sent, transient failures ridden out, stale parents and bad tokens refused in
one line, the token never shown, incomplete artifacts never sent."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_cli
from hub_standin import HubStandIn
from quantkit import api
from quantkit.errors import NetworkError, SourceError, UsageError

WRITE, READ = "hf_writeTOKENabc123", "hf_readTOKENxyz789"
REPO = "org/tiny-quants"


@pytest.fixture(scope="module")
def artifacts(tiny_gguf_source, tmp_path_factory) -> list[Path]:
    out = tmp_path_factory.mktemp("artifacts")
    folder, gguf = api.convert(str(tiny_gguf_source), ["bnb:nf4", "gguf:Q8_0"], out, options={"device": "cpu", "tokenizer_pre": "gpt-2"})
    return [folder, gguf]


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))       # no stored login
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("QUANTKIT_HUB_BACKOFF", "0.01")
    monkeypatch.setenv("QUANTKIT_HUB_TIMEOUT", "1")
    with HubStandIn(tokens={WRITE: "write", READ: "read"}, delay=2.0) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield hub


def local_files(artifacts: list[Path]) -> dict[str, bytes]:
    """Where a push puts them: one folder at the repo's root, a GGUF file by its name."""
    folder, gguf = artifacts
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    return {**files, gguf.name: gguf.read_bytes()}


def same_files(remote: dict[str, bytes], local: dict[str, bytes]) -> bool:
    """The repo holds the local files byte for byte, and the card quantkit made (tests/test_publish_card.py)."""
    card = remote.pop("README.md", b"")
    return b"quantkit-rows" in card and sorted(remote) == sorted(local) and all(remote[k] == local[k] for k in local)


def downloaded(hub, tmp_path, revision="main") -> dict[str, bytes]:
    """The repo as a user gets it: snapshot_download through the real client."""
    from huggingface_hub import snapshot_download
    folder = Path(snapshot_download(REPO, revision=revision, endpoint=hub.url, token=WRITE,
                                    cache_dir=tmp_path / "dl"))
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_two_artifacts_make_one_commit_with_identical_files(artifacts, hub_env, tmp_path):
    result = api.push(artifacts, REPO, token=WRITE, message="first ladder")
    assert hub_env.history(REPO) == ["first ladder", "initial commit"]
    assert result.commit == hub_env.repos[REPO].refs["main"] and not result.unchanged
    assert same_files(downloaded(hub_env, tmp_path), local_files(artifacts))
    # the LFS files went to LFS storage, once each
    big = [p for p in local_files(artifacts) if p.endswith((".safetensors", ".gguf"))]
    assert len(hub_env.uploads) == len(big) == len(set(hub_env.uploads))


def test_pushing_again_uploads_nothing_and_says_so(artifacts, hub_env):
    api.push(artifacts, REPO, token=WRITE)
    uploads, history = list(hub_env.uploads), hub_env.history(REPO)
    r = run_cli("push", *map(str, artifacts), "--repo", REPO, "--token", WRITE)
    assert r.returncode == 0, r.stderr
    assert "nothing to upload" in r.stdout and REPO in r.stdout
    assert hub_env.uploads == uploads and hub_env.history(REPO) == history


def test_a_changed_file_alone_is_sent(artifacts, hub_env, tmp_path):
    api.push(artifacts, REPO, token=WRITE)
    folder = tmp_path / artifacts[0].name
    shutil.copytree(artifacts[0], folder)
    (folder / "generation_config.json").write_text('{"changed": true}\n')
    result = api.push([folder, artifacts[1]], REPO, token=WRITE)
    assert result.uploaded == ["generation_config.json"]
    assert len(hub_env.history(REPO)) == 3 and len(hub_env.uploads) == 2   # no LFS file sent again


def test_transient_failures_on_every_endpoint_still_make_one_commit(artifacts, hub_env, tmp_path):
    for endpoint in ("create", "revision", "paths-info", "preupload", "lfs-batch", "lfs-put", "commit"):
        hub_env.fail[endpoint] = [503, "timeout"] if endpoint != "lfs-put" else [500, "reset"]
    hub_env.fail["commit-reply"] = ["lost"]   # the commit is made but its reply never arrives
    result = api.push(artifacts, REPO, token=WRITE, message="through the storm")
    assert all(not q for q in hub_env.fail.values()), hub_env.fail    # every failure was played
    assert hub_env.history(REPO) == ["through the storm", "initial commit"]
    assert result.commit == hub_env.repos[REPO].refs["main"]
    assert same_files(downloaded(hub_env, tmp_path), local_files(artifacts))


def test_a_hub_that_stays_down_fails_in_one_line(artifacts, hub_env, monkeypatch):
    monkeypatch.setenv("QUANTKIT_HUB_RETRIES", "2")
    hub_env.fail["create"] = [503] * 3
    with pytest.raises(NetworkError, match="after 3 tries.*503"):
        api.push(artifacts, REPO, token=WRITE)
    assert REPO not in hub_env.repos


def test_a_stale_parent_is_reported_not_overwritten(artifacts, hub_env):
    api.push([artifacts[1]], REPO, token=WRITE)
    hub_env.before_commit.append(lambda: hub_env.outside_commit(REPO, "NOTES.md", b"someone else\n"))
    with pytest.raises(NetworkError, match="moved while pushing"):
        api.push(artifacts, REPO, token=WRITE)
    files = hub_env.files(REPO)
    assert files["NOTES.md"] == b"someone else\n" and "config.json" not in files


@pytest.mark.parametrize("token, status", [("hf_wrongTOKEN000", "401"), (READ, "403")])
def test_bad_tokens_fail_in_one_line_and_the_token_is_never_shown(artifacts, hub_env, token, status, tmp_path):
    r = run_cli("push", *map(str, artifacts), "--repo", REPO, "--token", token)
    assert r.returncode == 5
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and status in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert token not in r.stdout + r.stderr
    r = run_cli("push", *map(str, artifacts), "--repo", REPO, env={"HF_TOKEN": token})
    assert r.returncode == 5 and token not in r.stdout + r.stderr


def test_the_token_is_in_no_pushed_file_and_no_output(artifacts, hub_env):
    r = run_cli("push", *map(str, artifacts), "--repo", REPO, "--json", env={"HF_TOKEN": WRITE})
    assert r.returncode == 0, r.stderr
    assert WRITE not in r.stdout + r.stderr
    assert json.loads(r.stdout)["uploaded"]
    for data in hub_env.files(REPO).values():
        assert WRITE.encode() not in data
    for p in [artifacts[1], *artifacts[0].rglob("*")]:
        assert not p.is_file() or WRITE.encode() not in p.read_bytes()


def test_no_token_at_all_is_one_line(artifacts, hub_env):
    r = run_cli("push", *map(str, artifacts), "--repo", REPO)
    assert r.returncode == 5 and "no Hugging Face token" in r.stderr and not hub_env.requests


def test_branch_and_pull_request_leave_main_alone(artifacts, hub_env, tmp_path):
    api.push([artifacts[1]], REPO, token=WRITE)
    main = hub_env.repos[REPO].refs["main"]
    r = api.push([artifacts[0]], REPO, token=WRITE, revision="nf4")
    assert hub_env.repos[REPO].refs["main"] == main and r.revision == "nf4"
    assert set(downloaded(hub_env, tmp_path, "nf4")) >= {"config.json", "quantkit.json", artifacts[1].name}
    pr = api.push([artifacts[0]], REPO, token=WRITE, create_pr=True)
    assert pr.pr_url and hub_env.repos[REPO].refs["main"] == main
    assert "config.json" in hub_env.files(REPO, "refs/pr/1")


def test_incomplete_artifacts_are_refused_before_any_request(artifacts, hub_env, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(artifacts[0], folder)
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(SourceError, match="does not match its sha256"):
        api.push([folder], REPO, token=WRITE)
    weights.unlink()
    with pytest.raises(SourceError, match="missing"):
        api.push([folder], REPO, token=WRITE)
    short = tmp_path / "short.gguf"
    short.write_bytes(artifacts[1].read_bytes()[:-4096])
    with pytest.raises(SourceError, match="short.gguf"):
        api.push([short], REPO, token=WRITE)
    partial = tmp_path / ".partial-x"
    shutil.copytree(artifacts[0], partial)
    with pytest.raises(SourceError, match="unfinished"):
        api.push([partial], REPO, token=WRITE)
    with pytest.raises(SourceError, match="no such artifact"):
        api.push([tmp_path / "nope"], REPO, token=WRITE)
    assert not hub_env.requests


@pytest.mark.parametrize("repo", ["no-owner", "org/bad name", "org//x", "-org/x"])
def test_invalid_repo_ids_are_usage_errors(artifacts, hub_env, repo):
    with pytest.raises(UsageError):
        api.push(artifacts, repo, token=WRITE)
    assert not hub_env.requests


def test_unreachable_hub_is_one_line(artifacts, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    r = run_cli("push", str(artifacts[1]), "--repo", REPO, "--token", WRITE,
                env={"HF_ENDPOINT": "http://127.0.0.1:9", "QUANTKIT_HUB_RETRIES": "1", "QUANTKIT_HUB_BACKOFF": "0"})
    assert r.returncode == 5 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_convert_push_to_hub(tiny_gguf_source, hub_env, tmp_path, tmp_path_factory):
    out = tmp_path / "out"
    r = run_cli("convert", str(tiny_gguf_source), "-f", "gguf:Q8_0", "-o", str(out), "--tokenizer-pre", "gpt-2", "--push-to-hub", REPO,
                "--token", WRITE)
    assert r.returncode == 0, r.stderr
    (gguf,) = out.glob("*.gguf")
    assert hub_env.files(REPO)[gguf.name] == gguf.read_bytes()
    r = run_cli("convert", str(tiny_gguf_source), "-f", "gguf:Q8_0", "-o", str(out), "--push-to-hub", "bad name")
    assert r.returncode == 2 and "not valid" in r.stderr


def test_a_split_gguf_is_pushed_whole(tiny_gguf_source, hub_env, tmp_path):
    (first,) = api.convert(str(tiny_gguf_source), ["gguf:Q8_0"], tmp_path / "split",
                           options={"device": "cpu", "tokenizer_pre": "gpt-2", "split_max_size": "300K"})
    parts = sorted(first.parent.glob("*.gguf"))
    assert len(parts) > 1
    result = api.push([first], REPO, token=WRITE)
    assert sorted(result.uploaded) == sorted([p.name for p in parts] + ["README.md"])
    assert all(hub_env.files(REPO)[p.name] == p.read_bytes() for p in parts)


def test_a_gguf_above_the_file_limit_is_pushed_split(artifacts, hub_env, monkeypatch):
    monkeypatch.setenv("QUANTKIT_PUSH_SPLIT_SIZE", "400K")   # stands for the Hub's 50 GB
    gguf_file = artifacts[1]
    result = api.push([gguf_file], REPO, token=WRITE, card=False)
    parts = sorted((gguf_file.parent / (gguf_file.stem + ".split")).glob("*.gguf"))
    assert len(parts) > 1 and sorted(result.uploaded) == [p.name for p in parts]
    assert gguf_file.name not in hub_env.files(REPO)


def test_an_artifact_whose_verify_failed_is_refused_unless_no_verify(artifacts, hub_env, tmp_path):
    from quantkit.publish.record import write_verify
    folder = tmp_path / artifacts[0].name
    shutil.copytree(artifacts[0], folder)
    write_verify(folder, {"passed": False, "date": "2026-12-02", "integrity": {"verdict": "pass"},
                          "runtimes": [{"runtime": "transformers", "verdict": "fail", "why": "top-1 agreement 0.41 < 0.98"}]})
    with pytest.raises(UsageError, match="quantkit verify failed .*top-1 agreement 0.41.*--no-verify"):
        api.push([folder], REPO, token=WRITE)
    assert REPO not in hub_env.repos or hub_env.history(REPO) == ["initial commit"]
    result = api.push([folder], REPO, token=WRITE, no_verify=True)
    assert result.commit
