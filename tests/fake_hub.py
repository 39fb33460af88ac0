"""A Hugging Face Hub on 127.0.0.1 for tests (HF_ENDPOINT points at it): the few routes huggingface_hub's
snapshot_download uses, answered from folders in memory, so downloads, tokens and the Hub's errors run
through the real client with no network.

    GET  /api/models/ORG/NAME/revision/REV        repo info: the commit (404 RepoNotFound / RevisionNotFound,
                                                  401 GatedRepo without the right Bearer token)
    GET  /api/models/ORG/NAME/tree/COMMIT          the file listing (recursive)
    HEAD /ORG/NAME/resolve/COMMIT/FILE             metadata: X-Repo-Commit, ETag, Content-Length
    GET  /ORG/NAME/resolve/COMMIT/FILE             the file

`requests` records every (method, path, Authorization header) seen.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self):
        self.repos: dict[
            str, dict
        ] = {}  # repo id -> {"refs": {name: commit}, "commits": {commit: {path: bytes}}, "token"}
        self.requests: list[tuple[str, str, str | None]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(
        self, repo_id: str, commit: str, files: dict[str, bytes], refs=("main",), token: str | None = None
    ):
        """`files`: path in the repo -> contents; `token`: the model is gated, readable with this token only."""
        repo = self.repos.setdefault(repo_id, {"refs": {}, "commits": {}, "token": token})
        repo["commits"][commit] = files
        for ref in refs:
            repo["refs"][ref] = commit

    def downloaded(self, repo_id: str) -> set[str]:
        marker = f"/{repo_id}/resolve/"
        return {
            p.split(marker, 1)[1].split("/", 1)[1] for m, p, _ in self.requests if m == "GET" and marker in p
        }

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def folder_files(folder: str) -> dict[str, bytes]:
    files = {}
    for root, _, names in os.walk(folder):
        for n in names:
            path = os.path.join(root, n)
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder).replace(os.sep, "/")] = f.read()
    return files


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._answer(head=True)

        def do_GET(self):
            self._answer(head=False)

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, status: int, code: str, head: bool):
            self._send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code}, head)

        def _answer(self, head: bool):
            path = unquote(urlsplit(self.path).path)
            auth = self.headers.get("Authorization")
            hub.requests.append((self.command, path, auth))
            api = path.startswith("/api/models/")
            parts = path.removeprefix("/api/models/" if api else "/").split("/")
            repo_id, rest = "/".join(parts[:2]), parts[2:]
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", head)
            if repo["token"] is not None and auth != f"Bearer {repo['token']}":
                return self._error(401, "GatedRepo", head)
            kind, rev, file_path = rest[0], rest[1] if len(rest) > 1 else "", "/".join(rest[2:])
            commit = repo["refs"].get(rev, rev if rev in repo["commits"] else None)
            if commit is None:
                return self._error(404, "RevisionNotFound", head)
            files = repo["commits"][commit]
            if api and kind == "revision":
                info = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": f} for f in sorted(files)]}
                return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
            if api and kind == "tree":
                tree = [
                    {
                        "type": "file",
                        "path": f,
                        "size": len(data),
                        "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                    }
                    for f, data in sorted(files.items())
                ]
                return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
            if not api and kind == "resolve" and file_path in files:
                data = files[file_path]
                etag = '"' + hashlib.sha256(data).hexdigest() + '"'
                return self._send(200, data, {"X-Repo-Commit": commit, "ETag": etag}, head)
            return self._error(404, "EntryNotFound", head)

    return Handler
