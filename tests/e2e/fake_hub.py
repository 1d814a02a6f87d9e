"""A fake Hugging Face Hub on 127.0.0.1: one model repository in the Hub's HTTP layout.

`/api/models/{repo}/revision/{rev}` lists its files (`siblings`, with sizes); `/{repo}/resolve/{rev}/{file}`
serves a file with what download clients read: `ETag` (the sha256 of the bytes, as the Hub gives for weights),
`X-Repo-Commit`, and `Range` requests answered 206 with `Content-Range`. Any other repository is a 404
`RepoNotFound`. Every request path is recorded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repo: str, files: dict[str, bytes]):
        self.repo = repo
        self.files = files
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the http.server name)
                hub._answer(self)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def downloaded(self) -> set[str]:
        """The files requested through `resolve` so far."""
        return {p.split("/resolve/", 1)[1].split("/", 1)[1] for p in self.requests if "/resolve/" in p}

    def _answer(self, h: BaseHTTPRequestHandler) -> None:
        self.requests.append(h.path)
        path = h.path.split("?", 1)[0]
        resolve = f"/{self.repo}/resolve/"
        name = path[len(resolve):].split("/", 1)[-1] if path.startswith(resolve) else None
        if path.startswith(f"/api/models/{self.repo}/revision/"):
            siblings = [{"rfilename": n, "size": len(b)} for n, b in self.files.items()]
            body = json.dumps({"id": self.repo, "sha": COMMIT, "siblings": siblings}).encode()
            self._send(h, 200, body, {"Content-Type": "application/json"})
        elif name in self.files:
            data = self.files[name]
            headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": COMMIT,
                       "Accept-Ranges": "bytes"}
            rng = h.headers.get("Range", "")
            if rng.startswith("bytes="):
                first, _, last = rng[len("bytes="):].partition("-")
                start, end = int(first), min(int(last) + 1 if last else len(data), len(data))
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
                self._send(h, 206, data[start:end], headers)
            else:
                self._send(h, 200, data, headers)
        else:
            self._send(h, 404, b"{}", {"X-Error-Code": "RepoNotFound"})

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str]) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(body)
