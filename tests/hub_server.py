"""An in-memory Hugging Face Hub on 127.0.0.1 that the real ``huggingface_hub`` client can talk to.

No Hub is reachable from the tests, so this speaks just enough of its HTTP API for
``create_repo``, ``create_branch``, ``create_commit``/``upload_file`` (regular, non-LFS files),
``repo_info``, ``list_repo_files`` and ``hf_hub_download``: repos hold git-like commits (a full
snapshot of the files each) and branches pointing at them, so a branch name and a commit sha
both work as revisions. Errors carry the ``X-Error-Code`` the client turns into typed
exceptions (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import count
from typing import Any
from urllib.parse import unquote, urlsplit

REPO_TYPES = ("model", "dataset", "space")
# Actions that may follow a repo id in /api/{type}s/{repo_id}/{action}/...
API_ACTIONS = ("preupload", "commit", "tree", "revision", "branch")


def git_blob_sha(data: bytes) -> str:
    """The git blob id of ``data``: the Hub's ETag and preupload ``oid`` for a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubError(Exception):
    """An error answer: HTTP status, the Hub's ``X-Error-Code`` and a message."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.headers = status, code, headers or {}


@dataclass(frozen=True)
class Commit:
    oid: str
    title: str
    files: dict[str, bytes]


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit:
        """The commit a branch name or a commit sha points at."""
        commit = self.commits.get(self.branches.get(revision, revision))
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def add_commit(self, branch: str, title: str, files: dict[str, bytes], serial: int) -> Commit:
        parent = self.branches.get(branch, "")
        digest = json.dumps([parent, title, serial, sorted((p, git_blob_sha(d)) for p, d in files.items())])
        commit = Commit(hashlib.sha1(digest.encode()).hexdigest(), title, dict(files))
        self.commits[commit.oid] = commit
        self.branches[branch] = commit.oid
        return commit


@dataclass
class Request:
    method: str
    path: str  # raw (still percent-encoded) path, without the query
    query: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"{}")


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_json(cls, data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
        return cls(status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})})


class FakeHub:
    """In-memory Hub state plus the routing of requests to it; ``requests`` logs every call as (method, path)."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.url = ""
        self._serial = count()
        self._lock = threading.Lock()

    def handle(self, request: Request) -> Response:
        with self._lock:
            self.requests.append((request.method, request.path))
            try:
                return self._route(request)
            except HubError as error:
                headers = {"X-Error-Message": str(error), **error.headers}
                if error.code:
                    headers["X-Error-Code"] = error.code
                return Response.of_json({"error": str(error)}, error.status, headers)

    def _route(self, request: Request) -> Response:
        parts = request.path.strip("/").split("/")
        if request.method == "POST" and parts == ["api", "repos", "create"]:
            return self._create_repo(request.json())
        if request.method == "POST" and parts == ["api", "validate-yaml"]:
            return Response.of_json({"errors": [], "warnings": []})
        if parts[0] == "api" and len(parts) > 2 and parts[1].rstrip("s") in REPO_TYPES:
            return self._api(request, parts[1].rstrip("s"), parts[2:])
        if "resolve" in parts[:4] and request.method in ("GET", "HEAD"):
            return self._resolve(request, parts)
        raise HubError(404, f"no route for {request.method} {request.path}")

    def _create_repo(self, payload: dict[str, Any]) -> Response:
        repo_type = payload.get("type") or "model"
        repo_id = "/".join(part for part in (payload.get("organization"), payload["name"]) if part)
        url = self._repo_url(repo_type, repo_id)
        if (repo_type, repo_id) in self.repos:
            return Response.of_json({"error": "You already created this repo", "url": url}, 409)
        repo = Repo(repo_type, repo_id, private=payload.get("visibility") == "private")
        repo.add_commit("main", "initial commit", {".gitattributes": b""}, next(self._serial))
        self.repos[repo_type, repo_id] = repo
        return Response.of_json({"url": url, "name": repo_id, "id": repo_id})

    def _api(self, request: Request, repo_type: str, parts: list[str]) -> Response:
        """Dispatch /api/{type}s/{repo_id}[/{action}/{revision}[/{path}]]; repo ids have one or two parts."""
        split = next((i for i in (2, 1) if len(parts) > i and parts[i] in API_ACTIONS), len(parts))
        repo = self._repo(repo_type, "/".join(parts[:split]))
        action, args = (parts[split], [unquote(p) for p in parts[split + 1:]]) if split < len(parts) else ("", [])
        if request.method == "GET" and action in ("", "revision"):
            return self._info(repo, args[0] if args else "main")
        if request.method == "GET" and action == "tree":
            return self._tree(repo, args[0], "/".join(args[1:]), "recursive=true" in request.query.lower())
        if request.method == "POST" and action == "preupload":
            return self._preupload(repo, args[0], request.json())
        if request.method == "POST" and action == "commit":
            return self._commit(repo, args[0], request.body)
        if request.method == "POST" and action == "branch":
            return self._create_branch(repo, args[0], request.json())
        raise HubError(404, f"no route for {request.method} {request.path}")

    def _repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _repo_url(self, repo_type: str, repo_id: str) -> str:
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        return f"{self.url}/{prefix}{repo_id}"

    def _info(self, repo: Repo, revision: str) -> Response:
        commit = repo.resolve(revision)
        return Response.of_json({
            "id": repo.repo_id,
            "sha": commit.oid,
            "private": repo.private,
            "siblings": [{"rfilename": path} for path in sorted(commit.files)],
        })

    def _tree(self, repo: Repo, revision: str, folder: str, recursive: bool) -> Response:
        commit = repo.resolve(revision)
        prefix = f"{folder}/" if folder else ""
        below = {path[len(prefix):]: data for path, data in commit.files.items() if path.startswith(prefix)}
        if folder and not below:
            raise HubError(404, f"{folder} does not exist on {revision}", "EntryNotFound")
        entries: dict[str, dict[str, Any]] = {}
        for relative, data in sorted(below.items()):
            names = relative.split("/")
            folders = len(names) - 1 if recursive else min(len(names) - 1, 1)
            for level in range(1, folders + 1):
                path = prefix + "/".join(names[:level])
                entries.setdefault(path, {"type": "directory", "path": path, "oid": git_blob_sha(path.encode())})
            if recursive or len(names) == 1:
                path = prefix + relative
                entries[path] = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha(data)}
        return Response.of_json(list(entries.values()))

    def _preupload(self, repo: Repo, revision: str, payload: dict[str, Any]) -> Response:
        head = repo.resolve(revision).files
        files = [
            {
                "path": entry["path"],
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": git_blob_sha(head[entry["path"]]) if entry["path"] in head else None,
            }
            for entry in payload["files"]
        ]
        return Response.of_json({"files": files, "commitOid": repo.resolve(revision).oid})

    def _commit(self, repo: Repo, branch: str, body: bytes) -> Response:
        if branch not in repo.branches:
            raise HubError(404, f"Invalid rev id: {branch} (commits go to a branch)", "RevisionNotFound")
        files = dict(repo.resolve(branch).files)
        title = ""
        for line in body.decode().splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                title = value["summary"]
                if value.get("parentCommit") not in (None, repo.branches[branch]):
                    raise HubError(412, "A commit has happened since the parent commit; pull and retry")
            elif key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise HubError(404, f"A file with this name doesn't exist: {value['path']}", "EntryNotFound")
            elif key == "deletedFolder":
                files = {p: d for p, d in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
            else:
                raise HubError(400, f"this test Hub does not support {key!r} operations (LFS)")
        commit = repo.add_commit(branch, title, files, next(self._serial))
        url = f"{self._repo_url(repo.repo_type, repo.repo_id)}/commit/{commit.oid}"
        return Response.of_json({"commitUrl": url, "commitOid": commit.oid, "success": True})

    def _create_branch(self, repo: Repo, branch: str, payload: dict[str, Any]) -> Response:
        if branch in repo.branches:
            raise HubError(409, f"Branch {branch} already exists")
        repo.branches[branch] = repo.resolve(payload.get("startingPoint") or "main").oid
        return Response.of_json({})

    def _resolve(self, request: Request, parts: list[str]) -> Response:
        """HEAD/GET /[{type}s/]{repo_id}/resolve/{revision}/{path}: the file with the headers hf_hub_download needs."""
        repo_type = parts[0].rstrip("s") if parts[0] in ("datasets", "spaces") else "model"
        parts = parts[1:] if repo_type != "model" else parts
        at = parts.index("resolve")
        repo = self._repo(repo_type, "/".join(parts[:at]))
        commit = repo.resolve(unquote(parts[at + 1]))
        path = unquote("/".join(parts[at + 2:]))
        if path not in commit.files:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        data = commit.files[path]
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{git_blob_sha(data)}"', "Content-Type": "application/octet-stream"}
        return Response(200, data, headers)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes; don't wait for a delayed ACK
    server: _Server

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        url = urlsplit(self.path)
        request = Request(self.command, url.path, url.query, self.rfile.read(length) if length else b"")
        response = self.server.hub.handle(request)
        self.send_response(response.status)
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output quiet
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: FakeHub) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hub = hub


@contextmanager
def serve() -> Iterator[FakeHub]:
    """Run a fresh, empty FakeHub on a free port of 127.0.0.1; ``hub.url`` is the endpoint to pass."""
    hub = FakeHub()
    server = _Server(hub)
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, name="fake-hub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()

