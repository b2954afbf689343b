"""A local stand-in for the Hugging Face Hub's HTTP API, enough for the real `huggingface_hub` client to download
(`snapshot_download`) and to publish (`create_repo`, `preupload_lfs_files`, `create_commit`, branches, pull
requests) without the network.

State is kept as the Hub keeps it: per repo, commits (each a full file table) and refs pointing at them; LFS
objects in one content-addressed store filled by the batch API's upload actions.  Repos given as local folders
start with one commit of their files (read lazily).

Failures are injected per endpoint: `hub.fail["commit"] = [503, "timeout", "reset"]` answers the next three
commit requests with a 503, a reply slower than the client's timeout (`delay` seconds) and a dropped
connection.  Endpoint names: create, info, revision, tree, paths-info, preupload, lfs-batch, lfs-put, commit,
branch, resolve.  `hub.fail["commit-reply"] = ["lost"]` makes the next commit but drops its reply.  `tokens` maps
token strings to "read" or "write"; when it is set, requests without a known token get 401 and writes with a
read token 403.
"""
from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".png", ".parquet")


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Entry:
    """One file of a commit: a regular blob (its bytes) or an LFS pointer (sha256 + size)."""
    size: int
    data: bytes | None = None       # regular file
    lfs: str | None = None          # LFS sha256
    path: Path | None = None        # a folder-backed repo's file, read when asked

    def bytes(self, store: dict[str, bytes]) -> bytes:
        if self.path is not None:
            return self.path.read_bytes()
        return self.data if self.lfs is None else store[self.lfs]


@dataclass
class Repo:
    commits: dict[str, dict[str, Entry]] = field(default_factory=dict)
    parents: dict[str, str | None] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    private: bool = False

    def resolve(self, rev: str) -> str | None:
        if rev in self.refs:
            return self.refs[rev]
        return rev if rev in self.commits else None


class HubStandIn:
    def __init__(self, repos: dict[str, Path] | None = None,
                 commit: str = "0123456789abcdef0123456789abcdef01234567",
                 tokens: dict[str, str] | None = None, delay: float = 3.0):
        self.commit = commit                    # the first commit of every folder-backed repo
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.tokens = tokens
        self.delay = delay
        self.fail: dict[str, list] = {}
        self.before_commit: list = []          # callables run as a commit request arrives (an outside change)
        self.requests: list[str] = []
        self.uploads: list[str] = []           # sha256 of every LFS object PUT
        self._lock = threading.Lock()
        self._counter = 0
        for name, folder in (repos or {}).items():
            folder = Path(folder)
            files = {p.relative_to(folder).as_posix(): self._folder_entry(p)
                     for p in sorted(folder.rglob("*")) if p.is_file()}
            self.repos[name] = Repo(commits={commit: files}, parents={commit: None},
                                    messages={commit: "initial"}, refs={"main": commit})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @staticmethod
    def _folder_entry(p: Path) -> Entry:
        if p.suffix in LFS_SUFFIXES:
            return Entry(size=p.stat().st_size, lfs=hashlib.sha256(p.read_bytes()).hexdigest(), path=p)
        return Entry(size=p.stat().st_size, data=p.read_bytes())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    # what tests look at
    def files(self, repo: str, rev: str = "main") -> dict[str, bytes]:
        r = self.repos[repo]
        return {p: e.bytes(self.lfs) for p, e in r.commits[r.resolve(rev)].items()}

    def history(self, repo: str, rev: str = "main") -> list[str]:
        """Commit messages, newest first."""
        r, sha, out = self.repos[repo], self.repos[repo].resolve(rev), []
        while sha is not None:
            out.append(r.messages[sha])
            sha = r.parents[sha]
        return out

    def outside_commit(self, repo: str, path: str, data: bytes, rev: str = "main") -> str:
        """Someone else's commit (to make a push's parent stale)."""
        with self._lock:
            return self._commit(self.repos[repo], rev, {path: Entry(size=len(data), data=data)}, "outside change")

    def _commit(self, repo: Repo, ref: str, changes: dict[str, Entry | None], message: str) -> str:
        head = repo.resolve(ref)
        files = dict(repo.commits[head]) if head else {}
        for path, entry in changes.items():
            if entry is None:
                files.pop(path, None)
            else:
                files[path] = entry
        self._counter += 1
        sha = hashlib.sha1(f"{head}:{self._counter}:{message}".encode()).hexdigest()
        repo.commits[sha], repo.parents[sha], repo.messages[sha] = files, head, message
        repo.refs[ref] = sha
        return sha

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code, body=b"", headers=None):
                if isinstance(body, (dict, list)):
                    body = json.dumps(body).encode()
                    headers = {"Content-Type": "application/json", **(headers or {})}
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _error(self, code, message, error_code=None):
                headers = {"X-Error-Message": message}
                if error_code:
                    headers["X-Error-Code"] = error_code
                return self._send(code, {"error": message}, headers)

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _inject(self, endpoint: str) -> str | None:
                """Play the next failure queued for this endpoint: "answered" or "dropped" when one was played."""
                with hub._lock:
                    queue = hub.fail.get(endpoint) or []
                    what = queue.pop(0) if queue else None
                if what is None:
                    return None
                if what == "timeout":
                    time.sleep(hub.delay)
                    self.close_connection = True
                    return "dropped"
                if what == "reset":
                    self.close_connection = True
                    return "dropped"
                self._error(int(what), f"injected {what}")
                return "answered"

            def _auth(self, write: bool) -> bool:
                if hub.tokens is None:
                    return True
                header = self.headers.get("Authorization", "")
                role = hub.tokens.get(header.removeprefix("Bearer ").strip()) if header.startswith("Bearer ") else None
                if role is None:
                    self._error(401, "Invalid credentials in Authorization header")
                    return False
                if write and role != "write":
                    self._error(403, "You don't have the rights to write to this repository")
                    return False
                return True

            def _route(self):
                url = urlparse(self.path)
                parts = [unquote(p) for p in url.path.strip("/").split("/")]
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                hub.requests.append(unquote(url.path))
                body = self._body() if self.command in ("POST", "PUT") else b""
                if parts[:2] == ["api", "validate-yaml"]:
                    return self._send(200, {"errors": [], "warnings": []})
                if parts[:3] == ["api", "repos", "create"]:
                    return self._create(json.loads(body or b"{}"))
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    return self._api("/".join(parts[2:4]), parts[4:], query, body)
                if parts[0] == "lfs-upload" and self.command == "PUT":
                    return self._lfs_put(parts[1], body)
                if len(parts) >= 4 and parts[1].endswith(".git") and parts[2:] == ["info", "lfs", "objects", "batch"]:
                    return self._lfs_batch(f"{parts[0]}/{parts[1][:-4]}", json.loads(body))
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
                return self._send(404, b"")

            def _create(self, payload):
                if self._inject("create") or not self._auth(write=True):
                    return
                name = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
                with hub._lock:
                    if name in hub.repos:   # the Hub's 409 carries the url, which huggingface_hub returns
                        return self._send(409, {"error": "You already created this model repo",
                                                "url": f"{hub.url}/{name}"})
                    hub.repos[name] = Repo(private=bool(payload.get("private")))
                    sha = hub._commit(hub.repos[name], "main", {}, "initial commit")
                    hub.repos[name].messages[sha] = "initial commit"
                return self._send(200, {"url": f"{hub.url}/{name}", "name": name})

            def _api(self, name, rest, query, body):
                repo = hub.repos.get(name)
                kind = rest[0] if rest else "info"
                if self._inject(kind):
                    return
                write = kind in ("preupload", "commit", "branch")
                if not self._auth(write=write):
                    return
                if repo is None:
                    return self._error(404, "Repository not found", "RepoNotFound")
                if kind == "branch":
                    start = json.loads(body or b"{}").get("startingPoint") or "main"
                    with hub._lock:
                        if rest[1] in repo.refs:
                            return self._error(409, "Reference already exists")
                        repo.refs[rest[1]] = repo.resolve(start)
                    return self._send(200, {})
                rev = rest[1] if len(rest) > 1 else "main"
                sha = repo.resolve(rev)
                if sha is None and not (kind == "commit" and query.get("create_pr")):
                    return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
                files = repo.commits.get(sha, {})
                if kind in ("info", "revision"):
                    return self._send(200, {"id": name, "modelId": name, "sha": sha, "private": repo.private,
                                            "siblings": [{"rfilename": f} for f in sorted(files)]})
                if kind == "tree":
                    under = "/".join(rest[2:])
                    listed = [self._tree_entry(p, e) for p, e in sorted(files.items())
                              if not under or p.startswith(under + "/")]
                    return self._send(200, listed)
                if kind == "paths-info":
                    asked = parse_qs(body.decode()).get("paths", [])
                    return self._send(200, [self._tree_entry(p, files[p]) for p in asked if p in files])
                if kind == "preupload":
                    listed = json.loads(body)["files"]
                    return self._send(200, {"files": [
                        {"path": f["path"], "uploadMode": self._mode(f["path"], f["size"]), "shouldIgnore": False,
                         "oid": self._oid(files[f["path"]]) if f["path"] in files else None} for f in listed]})
                if kind == "commit":
                    return self._commit(name, repo, rev, query, body)
                return self._send(404, b"")

            @staticmethod
            def _mode(path, size):
                return "lfs" if path.endswith(LFS_SUFFIXES) or size >= 10 << 20 else "regular"

            def _oid(self, e: Entry) -> str:
                return e.lfs if e.lfs else git_blob_oid(e.data)

            def _tree_entry(self, path, e: Entry):
                if e.lfs:
                    return {"type": "file", "path": path, "size": e.size,
                            "oid": git_blob_oid(f"oid sha256:{e.lfs}\nsize {e.size}\n".encode()),
                            "lfs": {"oid": e.lfs, "size": e.size, "pointerSize": 134}}
                return {"type": "file", "path": path, "size": e.size, "oid": git_blob_oid(e.data)}

            def _commit(self, name, repo, rev, query, body):
                while hub.before_commit:
                    hub.before_commit.pop(0)()
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                header = next(x["value"] for x in lines if x["key"] == "header")
                changes: dict[str, Entry | None] = {}
                for item in lines:
                    v = item["value"]
                    if item["key"] == "file":
                        data = base64.b64decode(v["content"])
                        changes[v["path"]] = Entry(size=len(data), data=data)
                    elif item["key"] == "lfsFile":
                        if v["oid"] not in hub.lfs:
                            return self._error(400, f"LFS object {v['oid']} was never uploaded")
                        changes[v["path"]] = Entry(size=v["size"], lfs=v["oid"])
                    elif item["key"] in ("deletedFile", "deletedFolder"):
                        changes[v["path"]] = None
                with hub._lock:
                    parent = header.get("parentCommit")
                    if query.get("create_pr"):
                        number = 1 + sum(r.startswith("refs/pr/") for r in repo.refs)
                        ref = f"refs/pr/{number}"
                        repo.refs[ref] = parent or repo.resolve(rev)
                        url_extra = {"pullRequestUrl": f"{hub.url}/{name}/discussions/{number}"}
                    else:
                        if parent is not None and parent != repo.resolve(rev):
                            return self._error(412, "A commit has happened since. Please refresh and try again.")
                        ref, url_extra = rev, {}
                    sha = hub._commit(repo, ref, changes, header["summary"])
                if hub.fail.get("commit-reply") and hub.fail["commit-reply"].pop(0) == "lost":
                    self.close_connection = True
                    return
                return self._send(200, {"success": True, "commitOid": sha,
                                        "commitUrl": f"{hub.url}/{name}/commit/{sha}", **url_extra})

            def _lfs_batch(self, name, payload):
                if self._inject("lfs-batch") or not self._auth(write=True):
                    return
                objects = []
                for o in payload["objects"]:
                    entry = {"oid": o["oid"], "size": o["size"]}
                    if o["oid"] not in hub.lfs:
                        entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}", "header": {}}}
                    objects.append(entry)
                return self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                                  {"Content-Type": "application/vnd.git-lfs+json"})

            def _lfs_put(self, oid, body):
                if self._inject("lfs-put"):
                    return
                if hashlib.sha256(body).hexdigest() != oid:
                    return self._error(400, "sha256 mismatch")
                with hub._lock:
                    hub.lfs[oid] = body
                    hub.uploads.append(oid)
                return self._send(200, b"")

            def _resolve(self, name, rev, path):
                if self._inject("resolve"):
                    return
                repo = hub.repos.get(name)
                if repo is None:
                    return self._error(404, "Repository not found", "RepoNotFound")
                sha = repo.resolve(rev)
                if sha is None:
                    return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
                e = repo.commits[sha].get(path)
                if e is None:
                    return self._error(404, "Entry not found", "EntryNotFound")
                headers = {"X-Repo-Commit": sha, "Content-Type": "application/octet-stream"}
                if e.lfs:
                    headers.update({"ETag": f'"{e.lfs}"', "X-Linked-Etag": f'"{e.lfs}"', "X-Linked-Size": str(e.size)})
                else:
                    headers["ETag"] = f'"{git_blob_oid(e.data)}"'
                return self._send(200, e.bytes(hub.lfs), headers)

            def do_GET(self):
                self._route()

            do_HEAD = do_POST = do_PUT = do_GET

        return Handler
