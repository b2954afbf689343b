"""A local stand-in for the few Hugging Face Hub endpoints `snapshot_download` uses.

Serves the files of local folders as repos on 127.0.0.1, so the real Hub code
path is tested without the network.
"""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class HubStandIn:
    def __init__(self, repos: dict[str, Path], commit: str = "0123456789abcdef0123456789abcdef01234567"):
        self.repos = {k: Path(v) for k, v in repos.items()}
        self.commit = commit
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body=b"", headers=None, head=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self, head):
                path = unquote(urlparse(self.path).path)
                hub.requests.append(path)
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo = "/".join(parts[2:4])
                    if repo not in hub.repos:
                        return self._send(404, b'{"error": "Repository not found"}',
                                          {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"}, head)
                    files = sorted(p.relative_to(hub.repos[repo]).as_posix()
                                   for p in hub.repos[repo].rglob("*") if p.is_file())
                    if len(parts) >= 5 and parts[4] == "tree":
                        tree = [{"type": "file", "path": f, "size": (hub.repos[repo] / f).stat().st_size,
                                 "oid": hashlib.sha1((hub.repos[repo] / f).read_bytes()).hexdigest()} for f in files]
                        return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
                    body = json.dumps({"id": repo, "modelId": repo, "sha": hub.commit,
                                       "siblings": [{"rfilename": f} for f in files]}).encode()
                    return self._send(200, body, {"Content-Type": "application/json"}, head)
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
                    f = hub.repos.get(repo, Path("/nonexistent")) / filename
                    if not f.is_file():
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                    data = f.read_bytes()
                    etag = hashlib.sha256(data).hexdigest()
                    return self._send(200, data, {"X-Repo-Commit": hub.commit, "ETag": f'"{etag}"',
                                                  "Content-Type": "application/octet-stream"}, head)
                return self._send(404, b"")

            def do_GET(self):
                self._route(head=False)

            def do_HEAD(self):
                self._route(head=True)

        return Handler
