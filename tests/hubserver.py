"""A small model hub of the suite's own: the Hugging Face hub's URL layout over HTTP, so that tests run the real
huggingface_hub client (metadata, ETags, the redirect of large files to a CDN path, ranged and resumed downloads,
401s) against it with HF_ENDPOINT. Repositories live in memory: {commit: {path: bytes}} and branches."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")
TOKEN = "hf_suite_token"


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False  # every request without the suite's token gets the hub's 401 GatedRepo
    sizes: dict[str, int] = field(default_factory=dict)  # sizes the listing claims instead of the real ones

    def push(self, files: dict[str, bytes], branch: str = "main") -> str:
        """A new commit of these files on `branch`; its hash."""
        digest = hashlib.sha1(json.dumps(sorted((p, hashlib.sha1(b).hexdigest()) for p, b in files.items()))
                              .encode() + str(len(self.commits)).encode()).hexdigest()
        self.commits[digest] = dict(files)
        self.refs[branch] = digest
        return digest


def directory_files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Hub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.drop_once: set[str] = set()  # file paths whose next download is cut halfway through
        self.blobs: dict[str, tuple[str, bytes]] = {}  # sha256 -> (path, bytes): what the CDN path serves
        # the hub, and its CDN (another origin: the client follows its redirects without the token, as the hub's)
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), self._handler()) for _ in range(2)]
        for server in self._servers:
            server.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    def start(self) -> Hub:
        for server in self._servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def downloads(self) -> list[str]:
        """The files whose bytes were fetched (GET on /resolve or the CDN path), in order."""
        return [path for method, path, _ in self.requests if method == "GET" and "/api/" not in path]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                parts = path.strip("/").split("/")
                if parts[0] == "cdn":
                    return self._cdn(parts[1], body)
                if parts[:2] == ["api", "models"] and len(parts) == 4:  # model_info of the default branch
                    return self._api("/".join(parts[2:4]), "revision", "main", "")
                if parts[:2] == ["api", "models"] and len(parts) >= 6:
                    return self._api("/".join(parts[2:4]), parts[4], parts[5], "/".join(parts[6:]))
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
                self._error(404, "EntryNotFound")

            def _repo(self, repo_id: str, revision: str) -> tuple[Repo, str] | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(401, "RepoNotFound")
                    return None
                if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._error(401, "GatedRepo")
                    return None
                commit = repo.refs.get(revision, revision)
                if commit not in repo.commits:
                    self._error(404, "RevisionNotFound")
                    return None
                return repo, commit

            def _api(self, repo_id: str, kind: str, revision: str, _rest: str) -> None:
                found = self._repo(repo_id, revision)
                if found is None:
                    return
                repo, commit = found
                files = repo.commits[commit]
                if kind == "revision":
                    return self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                                       "gated": False, "siblings": [{"rfilename": p} for p in sorted(files)]})
                if kind == "tree":
                    entries = []
                    for p, data in sorted(files.items()):
                        size = repo.sizes.get(p, len(data))
                        entry = {"type": "file", "oid": _git_oid(data), "size": size, "path": p}
                        if p.endswith(LFS_SUFFIXES):
                            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": size, "pointerSize": 134}
                        entries.append(entry)
                    return self._json(entries)
                self._error(404, "EntryNotFound")

            def _resolve(self, repo_id: str, revision: str, file: str, body: bool) -> None:
                found = self._repo(repo_id, revision)
                if found is None:
                    return
                repo, commit = found
                data = repo.commits[commit].get(file)
                if data is None:
                    return self._error(404, "EntryNotFound")
                if file.endswith(LFS_SUFFIXES):  # large files: the hub redirects to its CDN
                    sha = hashlib.sha256(data).hexdigest()
                    hub.blobs[sha] = (file, data)
                    self.send_response(302)
                    self.send_header("Location", f"{hub.cdn_url}/cdn/{sha}")
                    self.send_header("X-Repo-Commit", commit)
                    self.send_header("X-Linked-Etag", f'"{sha}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                    self.send_header("ETag", f'"{_git_oid(data)}"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{_git_oid(data)}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _cdn(self, sha: str, body: bool) -> None:
                if sha not in hub.blobs:
                    return self._error(404, "EntryNotFound")
                file, data = hub.blobs[sha]
                start = 0
                ranged = self.headers.get("Range")
                if ranged and ranged.startswith("bytes="):
                    start = int(ranged[len("bytes="):].split("-")[0])
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if not body:
                    return
                if file in hub.drop_once and not start:  # the connection drops halfway: the client resumes
                    hub.drop_once.discard(file)
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(data[start:])

            def _json(self, value: object) -> None:
                data = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(data)

            def _error(self, status: int, code: str) -> None:
                data = json.dumps({"error": code}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(data)

        return Handler
