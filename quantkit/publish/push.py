"""`quantkit push`: artifacts into one Hub repo as ONE commit, or nothing.

Order of work: check every artifact complete and hash every file (nothing leaves the machine before the whole
push is known to be good); create the repo (and the branch) if needed; read the branch head once — the parent
of the commit — and the remote files' hashes at it; upload the changed large files to LFS storage
(`preupload_lfs_files`: invisible until a commit names them); then one `create_commit` with `parent_commit`,
so the push becomes visible all at once and a concurrent change to the branch stops it instead of being
overwritten.  When the commit's reply is lost, the branch is read again: if it moved to exactly the pushed
files the push succeeded; if it moved otherwise, the push stops as stale; if not at all, the commit is retried.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import NetworkError
from ..progress import Progress, null_progress
from .card import card_files, merge_rows, row_for, rows_in
from .contents import artifact_files, check_digest, placement
from .hub import Hub, is_transient


@dataclass
class PushResult:
    repo: str
    revision: str
    commit: str | None                      # the new commit, or the head that already had every file
    uploaded: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    pr_url: str | None = None

    @property
    def nothing_to_upload(self) -> bool:
        return not self.uploaded

    def to_dict(self) -> dict:
        return {"repo": self.repo, "revision": self.revision, "commit": self.commit, "uploaded": self.uploaded,
                "unchanged": self.unchanged, "pull_request": self.pr_url}


def push(artifacts: list[str | Path], repo: str, *, revision: str | None = None, private: bool = False,
         create_pr: bool = False, message: str | None = None, token: str | None = None, card: bool = True,
         base_model: str | None = None, license: str | None = None, no_verify: bool = False,
         progress: Progress = null_progress) -> PushResult:
    """With `card`, the repo's README.md (and its plot) is regenerated with a row per artifact, keeping the
    rows of artifacts pushed before (card.py).  An artifact whose recorded `quantkit verify` failed is refused
    unless `no_verify`."""
    from huggingface_hub import CommitOperationAdd
    if not no_verify:
        refuse_failed_verify([Path(a) for a in artifacts])
    paths = [_within_file_limit(Path(a)) for a in artifacts]
    files = artifact_files(paths)
    hub = Hub(repo, token)
    task = progress.task("hashing files", total=len(files))
    additions: dict[str, CommitOperationAdd] = {}
    for f in files:
        op = CommitOperationAdd(path_in_repo=f.path_in_repo, path_or_fileobj=str(f.local))
        check_digest(f, op.upload_info.sha256.hex())
        additions[f.path_in_repo] = op
        task.advance()
    local_rows = [row_for(a, place) for a, place in placement(paths).items()] if card else []
    branch = revision or "main"

    hub.call("creating the repo", hub.api.create_repo, repo, private=private, exist_ok=True)
    if revision and not create_pr and not _branch_exists(hub, revision):
        hub.call(f"creating branch {revision}", hub.api.create_branch, repo, branch=revision, exist_ok=True)
    parent = _head(hub, branch)
    if card:
        rows = merge_rows(rows_in(_remote_text(hub, "README.md", parent)), local_rows)
        for name, data in card_files(repo, rows, base_model=base_model, license=license).items():
            additions[name] = CommitOperationAdd(path_in_repo=name, path_or_fileobj=data)
    changed = _changed(hub, additions, parent)
    result = PushResult(repo, branch, parent, unchanged=[p for p in additions if p not in changed])
    if not changed:
        return result

    ops = [additions[p] for p in changed]
    hub.call("uploading files", hub.api.preupload_lfs_files, repo, additions=ops, revision=branch,
             create_pr=create_pr)
    summary = message or _default_message(changed)
    result.commit, result.pr_url = _commit(hub, ops, summary, branch, parent, create_pr, additions)
    result.uploaded = changed
    return result


def refuse_failed_verify(artifacts: list[Path]) -> None:
    from ..errors import UsageError
    from .record import read_record
    for a in artifacts:
        report = read_record(a).get("verify") if a.exists() else None
        if report and not report.get("passed", True):
            why = [report["integrity"].get("why")] if report["integrity"].get("verdict") == "fail" else []
            why += [f"{r['runtime']}: {r['why']}" for r in report.get("runtimes", []) if r.get("verdict") == "fail"]
            raise UsageError(f"{a.name}: quantkit verify failed on {report.get('date', '?')} "
                             f"({'; '.join(w for w in why if w)[:300]}); fix it and verify again, or push anyway "
                             f"with --no-verify")


# the Hub takes files up to 50 GB; a larger GGUF file is pushed as llama.cpp's split layout, as
# llama-gguf-split --split-max-size 48G would make it
SPLIT_ABOVE = "48G"


def _within_file_limit(artifact: Path) -> Path:
    """The artifact, or for a GGUF file above the limit its split parts' first (written beside it, in
    NAME.split/, once; a later push reuses them)."""
    from ..backends.gguf.split import PART_NAME, parse_size, split_file
    limit = parse_size(os.environ.get("QUANTKIT_PUSH_SPLIT_SIZE") or SPLIT_ABOVE)
    if not (artifact.is_file() and artifact.suffix == ".gguf" and artifact.stat().st_size > limit
            and not PART_NAME.match(artifact.name)):
        return artifact
    folder = artifact.with_name(artifact.stem + ".split")
    existing = sorted(folder.glob("*-00001-of-*.gguf")) if folder.is_dir() else []
    if existing and existing[0].stat().st_mtime >= artifact.stat().st_mtime:
        return existing[0]
    shutil.rmtree(folder, ignore_errors=True)
    return split_file(artifact, limit, folder)[0]


def _branch_exists(hub: Hub, revision: str) -> bool:
    from huggingface_hub.errors import RevisionNotFoundError

    def probe() -> bool:
        try:
            hub.api.repo_info(hub.repo, revision=revision)
        except RevisionNotFoundError:
            return False
        return True
    return hub.call(f"reading branch {revision}", probe)


def _head(hub: Hub, branch: str) -> str:
    return hub.call(f"reading {branch}", hub.api.repo_info, hub.repo, revision=branch).sha


def _remote_text(hub: Hub, path: str, commit: str) -> str:
    """A small text file of the repo at `commit` ("" when there is none)."""
    import tempfile
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RemoteEntryNotFoundError

    def fetch() -> str:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                local = hf_hub_download(hub.repo, path, revision=commit, token=hub.token, cache_dir=tmp,
                                        endpoint=hub.api.endpoint)
            except (EntryNotFoundError, RemoteEntryNotFoundError):
                return ""
            return Path(local).read_text(encoding="utf-8", errors="replace")
    return hub.call(f"reading {path}", fetch)


def _remote(hub: Hub, paths: list[str], commit: str) -> dict:
    infos = hub.call("listing the remote files", hub.api.get_paths_info, hub.repo, paths, revision=commit)
    return {i.path: i for i in infos if hasattr(i, "blob_id")}


def _changed(hub: Hub, additions: dict, commit: str) -> list[str]:
    remote = _remote(hub, list(additions), commit)
    return [p for p, op in additions.items() if not _same(remote.get(p), op)]


def _same(remote, op) -> bool:
    """Whether the remote file at the parent commit already has these bytes (LFS: sha256; regular: git blob id)."""
    if remote is None:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == op.upload_info.sha256.hex()
    content = op.path_or_fileobj   # a file's path, or the card's bytes
    data = content if isinstance(content, bytes) else Path(content).read_bytes()   # regular files are small
    if remote.size != len(data):
        return False
    return remote.blob_id == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _commit(hub: Hub, ops, summary: str, branch: str, parent: str, create_pr: bool,
            additions) -> tuple[str, str | None]:
    """create_commit with parent_commit -> (commit, pull-request url); a lost reply is settled by reading the
    branch again (see the module)."""
    for attempt in range(hub.retries + 1):
        try:
            info = hub.api.create_commit(hub.repo, ops, commit_message=summary, revision=branch,
                                         parent_commit=parent, create_pr=create_pr)
            return info.oid, info.pr_url
        except Exception as e:  # noqa: BLE001 - sorted by hub.error / is_transient
            if not is_transient(e) or attempt == hub.retries:
                raise hub.error("committing", e) from None
            if create_pr:
                raise NetworkError(f"{hub.repo}: the Hub did not answer the pull-request commit "
                                   f"({type(e).__name__}); look at the repo's pull requests before pushing "
                                   f"again") from None
            time.sleep(min(30.0, hub.backoff * 2 ** attempt))
            head = _head(hub, branch)
            if head != parent:
                if not _changed(hub, additions, head):
                    return head, None
                raise NetworkError(f"{hub.repo}@{branch} moved to {head[:12]} while pushing (someone else "
                                   f"committed); nothing of this push was committed; push again") from None
    raise AssertionError("unreachable")


def _default_message(changed: list[str]) -> str:
    tops = sorted({p.split("/")[0] for p in changed})
    return f"quantkit: upload {', '.join(tops[:4])}{' …' if len(tops) > 4 else ''}"
