"""A stand-in for the hub's HTTP API on 127.0.0.1, for the tests of `harness pin` and prefetch.

It serves what huggingface_hub asks for: ``GET /api/models/<repo>[/revision/<rev>]`` (the
commit a revision points to and the file list) and ``HEAD``/``GET /<repo>/resolve/<rev>/<file>``
(``X-Repo-Commit``, ``ETag``, ``Content-Length`` and the bytes). Unknown repositories and
revisions answer 404 with the hub's ``X-Error-Code``. Every request is recorded in ``requests``;
``fail_next`` answers that many API requests with 500, ``file_delay_s`` delays each file body.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class StandinHub:
    def __init__(self, repos: dict[str, dict]):
        """``repos``: repo id -> {"refs": {"main": commit}, "files": {name: bytes}}."""
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        self.fail_next = 0
        self.file_delay_s = 0.0
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub._handle(self, body=True)

            def do_HEAD(self):
                hub._handle(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def _commit(self, repo: str, rev: str) -> str | None:
        r = self.repos[repo]
        if rev in r["refs"]:
            return r["refs"][rev]
        return rev if rev in r["refs"].values() else None

    def _send(self, h, code: int, payload: bytes = b"", headers: dict | None = None, body: bool = True):
        h.send_response(code)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        if body and payload:
            h.wfile.write(payload)

    def _error(self, h, code: int, kind: str, message: str, body: bool):
        self._send(h, code, json.dumps({"error": message}).encode(),
                   {"X-Error-Code": kind, "X-Error-Message": message, "Content-Type": "application/json"}, body)

    def _handle(self, h, body: bool):
        path = unquote(urlparse(h.path).path)
        with self._lock:
            self.requests.append((h.command, path))
            fail = self.fail_next > 0
            if fail:
                self.fail_next -= 1
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            if fail:
                return self._error(h, 500, "ServerError", "stand-in hub: internal error", body)
            repo = "/".join(parts[2:4])
            rev = parts[5] if len(parts) > 5 and parts[4] == "revision" else "main"
            if repo not in self.repos:
                return self._error(h, 404, "RepoNotFound", "Repository not found", body)
            commit = self._commit(repo, rev)
            if commit is None:
                return self._error(h, 404, "RevisionNotFound", "Invalid rev id: " + rev, body)
            data = {"id": repo, "modelId": repo, "sha": commit, "private": False,
                    "siblings": [{"rfilename": f} for f in sorted(self.repos[repo]["files"])]}
            return self._send(h, 200, json.dumps(data).encode(), {"Content-Type": "application/json"}, body)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            if repo not in self.repos:
                return self._error(h, 404, "RepoNotFound", "Repository not found", body)
            commit = self._commit(repo, rev)
            data = self.repos[repo]["files"].get(name)
            if commit is None or data is None:
                return self._error(h, 404, "EntryNotFound", f"{name} not found", body)
            if body and self.file_delay_s:
                time.sleep(self.file_delay_s)
            etag = hashlib.sha256(data).hexdigest()
            return self._send(h, 200, data, {"X-Repo-Commit": commit, "ETag": f'"{etag}"',
                                             "Content-Type": "application/octet-stream"}, body)
        return self._error(h, 404, "NotFound", path, body)
