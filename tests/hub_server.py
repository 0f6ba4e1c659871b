"""A small in-memory Hugging Face Hub for tests: the HTTP endpoints the real `huggingface_hub` client calls.

It serves `create_repo`, `preupload`, `commit` (NDJSON, base64 "regular" files only), `validate-yaml`,
`model_info`/`repo_info`, the repo tree, `list_repo_refs`, branches, pull requests (`create_pr`), `whoami` and
`resolve` (HEAD and GET), so that `upload_folder`, `hf_hub_download` and every `from_pretrained(repo_id)` work
against it unchanged with `HF_ENDPOINT` pointing at it.

What keeps it small, and why it is still faithful for our use:
- preupload answers `uploadMode: "regular"` for every file, so contents arrive base64 inside the commit payload:
  no LFS batch API, no Xet. No `X-Xet-*` header is ever sent, so downloads take the plain HTTP path.
- Every response closes the connection (HTTP/1.0), so the client's connection pool never holds a socket that
  a stopped server left behind.
- State is per repo: branches -> commit sha -> {path: bytes}; pull requests are refs `refs/pr/<n>`.

Deliberately left out: LFS/Xet uploads, copies between repos, tags, gated repos, pagination of large trees.
Failures for tests: `hub.fail_with(500)` (or 401, ...) answers every request (or those whose path contains a
given string) with that status until `hub.fail_with(None)`; `hub.requests` logs every request received
(method, path, query, authenticated).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

# The largest request body read; a bound so that a broken client can never make the server allocate without end.
MAX_BODY_BYTES = 512 * 1024 * 1024
DEFAULT_BRANCH = "main"
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha1(data: bytes) -> str:
    """Git's object id of a blob (what the Hub reports as a regular file's oid and ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    sha: str
    files: dict[str, bytes]
    message: str
    parent: str | None
    date: str


@dataclass
class Repo:
    repo_id: str
    private: bool
    owner: str
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # "main", "my-branch", "refs/pr/1" -> commit sha
    pull_requests: dict[int, dict] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        """The commit a branch, a PR ref or a (full) commit sha names; None when it names nothing."""
        if revision in self.refs:
            return self.commits[self.refs[revision]]
        return self.commits.get(revision)

    def branches(self) -> list[str]:
        return [name for name in self.refs if not name.startswith("refs/")]


class HubError(Exception):
    """An error answer: HTTP status, `X-Error-Code` and a message (sent as JSON `error` and `X-Error-Message`)."""

    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra or {}


class LocalHub:
    """The in-memory Hub and its HTTP server on 127.0.0.1:`port` (0: any free port).

    `tokens` maps an access token to the user it authenticates; users may write to their own namespace and to
    the organisations listed in `orgs[user]`. Reads of public repos need no token, as on the Hub.
    """

    def __init__(self, port: int = 0, tokens: dict[str, str] | None = None, orgs: dict[str, list[str]] | None = None):
        self.port = port
        self.tokens = dict(tokens or {})
        self.orgs = {user: list(names) for user, names in (orgs or {}).items()}
        self.repos: dict[str, Repo] = {}
        self.requests: list[dict] = []
        self.failure: tuple[int, str | None, str] | None = None
        self._lock = threading.Lock()
        self._commit_counter = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> "LocalHub":
        """Listen on 127.0.0.1:`port` and serve from a daemon thread. The state survives a stop/start."""
        if self._server is not None:
            return self
        hub = self

        class Handler(_HubRequestHandler):
            pass

        Handler.hub = hub
        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        # A short poll interval keeps `stop()` (which waits for the serve loop to notice) fast.
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=f"local-hub-{self.port}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket: the port then refuses connections (a Hub that is down)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server, self._thread = None, None

    def reset(self) -> None:
        """Forget every repo, logged request and failure switch."""
        with self._lock:
            self.repos.clear()
            self.requests.clear()
            self.failure = None

    def fail_with(self, status: int | None, code: str | None = None, path_contains: str = "") -> None:
        """Answer every request whose path contains `path_contains` (default: all) with HTTP `status` (and
        `X-Error-Code: code`), until `fail_with(None)`."""
        self.failure = None if status is None else (status, code, path_contains)

    # ---- helpers for tests ---------------------------------------------------------------------------------------
    def add_token(self, token: str, user: str, orgs: list[str] | None = None) -> None:
        self.tokens[token] = user
        if orgs:
            self.orgs[user] = list(orgs)

    def files(self, repo_id: str, revision: str = DEFAULT_BRANCH) -> dict[str, bytes]:
        """{path: content} of `repo_id` at `revision` (a branch, `refs/pr/<n>` or a commit sha)."""
        commit = self.repos[repo_id].resolve(revision)
        if commit is None:
            raise KeyError(f"{repo_id} has no revision {revision!r}")
        return dict(commit.files)

    # ---- state changes (called by the handler under the lock) -----------------------------------------------------
    def _new_sha(self, repo_id: str, message: str) -> str:
        self._commit_counter += 1
        return hashlib.sha1(f"{repo_id}\n{self._commit_counter}\n{message}".encode()).hexdigest()

    def _commit(self, repo: Repo, ref: str, files: dict[str, bytes], message: str) -> Commit:
        parent = repo.refs.get(ref)
        commit = Commit(
            sha=self._new_sha(repo.repo_id, message),
            files=files,
            message=message,
            parent=parent,
            date=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z"),
        )
        repo.commits[commit.sha] = commit
        repo.refs[ref] = commit.sha
        return commit


class _HubRequestHandler(BaseHTTPRequestHandler):
    """Routes one request to the matching Hub endpoint. `hub` is set on a per-server subclass."""

    hub: LocalHub
    # HTTP/1.0: one request per connection, so no client ever reuses a socket of a stopped server.
    protocol_version = "HTTP/1.0"
    server_version = "LocalHub/1.0"

    def log_message(self, format, *args):  # noqa: A002 - silence the per-request stderr line
        pass

    # ---- plumbing ------------------------------------------------------------------------------------------------
    def do_GET(self):
        self._handle("GET")

    def do_HEAD(self):
        self._handle("HEAD")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_DELETE(self):
        self._handle("DELETE")

    def _read_body(self) -> bytes:
        # Always drain the body, even for requests answered with an error: an unread body can reset the
        # connection before the client reads our answer.
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks, total = [], 0
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                total += size
                if total > MAX_BODY_BYTES:
                    raise HubError(413, "Request body too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise HubError(413, "Request body too large")
        return self.rfile.read(length) if length else b""

    def _user(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return self.hub.tokens.get(auth[len("Bearer "):])
        return None

    def _handle(self, method: str) -> None:
        split = urlsplit(self.path)
        hub = self.hub
        try:
            body = self._read_body()
        except HubError as err:
            self._send_error(err, method)
            return
        with hub._lock:
            hub.requests.append(
                {
                    "method": method,
                    "path": unquote(split.path),
                    "query": {k: v[-1] for k, v in parse_qs(split.query).items()},
                    "authenticated": self._user() is not None,
                }
            )
            failure = hub.failure
        if failure is not None and failure[2] in unquote(split.path):
            status, code, _ = failure
            self._send_error(HubError(status, f"Simulated failure (HTTP {status})", code), method)
            return
        try:
            with hub._lock:
                status, headers, payload = self._route(method, split.path, parse_qs(split.query), body)
        except HubError as err:
            self._send_error(err, method)
            return
        except Exception as err:  # a bug in this server must surface as a 500 in the test, not a hung client
            self._send_error(HubError(500, f"LocalHub internal error: {type(err).__name__}: {err}"), method)
            return
        self._send(status, headers, payload, method)

    def _send(self, status: int, headers: dict, payload, method: str) -> None:
        if isinstance(payload, (dict, list)):
            data = json.dumps(payload).encode()
            headers = {"Content-Type": "application/json", **headers}
        else:
            data = payload or b""
        self.send_response(status)
        headers.setdefault("Content-Length", str(len(data)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)

    def _send_error(self, err: HubError, method: str) -> None:
        headers = {"X-Error-Message": err.message}
        if err.code:
            headers["X-Error-Code"] = err.code
        self._send(err.status, headers, {"error": err.message, **err.extra}, method)

    # ---- routing -------------------------------------------------------------------------------------------------
    def _route(self, method: str, raw_path: str, query: dict, body: bytes):
        # Split before unquoting: a quoted revision such as `refs%2Fpr%2F1` is one segment.
        parts = [unquote(p) for p in raw_path.strip("/").split("/")]
        if parts[:2] == ["api", "whoami-v2"] and method == "GET":
            return self._whoami()
        if parts[:3] == ["api", "repos", "create"] and method == "POST":
            return self._create_repo(json.loads(body or b"{}"))
        if parts[:2] == ["api", "validate-yaml"] and method == "POST":
            return self._validate_yaml(json.loads(body or b"{}"))
        if len(parts) >= 4 and parts[:2] == ["api", "models"]:
            repo_id, rest = f"{parts[2]}/{parts[3]}", parts[4:]
            return self._repo_api(method, repo_id, rest, query, body)
        if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
            return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
        raise HubError(404, f"LocalHub does not implement {method} {raw_path}", "NotImplemented")

    def _repo_api(self, method: str, repo_id: str, rest: list[str], query: dict, body: bytes):
        if not rest and method == "GET":
            return self._info(repo_id, DEFAULT_BRANCH)
        head = rest[0] if rest else ""
        if head == "revision" and len(rest) >= 2 and method == "GET":
            return self._info(repo_id, "/".join(rest[1:]))
        if head == "tree" and len(rest) >= 2 and method == "GET":
            return self._tree(repo_id, rest[1], "/".join(rest[2:]), query)
        if head == "refs" and method == "GET":
            return self._refs(repo_id, query)
        if head == "preupload" and len(rest) == 2 and method == "POST":
            return self._preupload(repo_id, rest[1], json.loads(body or b"{}"), query)
        if head == "commit" and len(rest) == 2 and method == "POST":
            return self._commit(repo_id, rest[1], body, query)
        if head == "branch" and len(rest) >= 2 and method == "POST":
            return self._create_branch(repo_id, "/".join(rest[1:]), json.loads(body or b"{}"))
        if head == "discussions" and len(rest) == 1 and method == "POST":
            return self._create_pull_request(repo_id, json.loads(body or b"{}"))
        if head == "discussions" and len(rest) == 2 and method == "GET":
            return self._discussion(repo_id, int(rest[1]))
        raise HubError(404, f"LocalHub does not implement {method} /api/models/{repo_id}/{'/'.join(rest)}",
                       "NotImplemented")

    # ---- access --------------------------------------------------------------------------------------------------
    def _readable(self, repo_id: str) -> Repo:
        repo = self.hub.repos.get(repo_id)
        user = self._user()
        if repo is None or (repo.private and not self._may_write(user, repo_id)):
            # As the Hub does: an anonymous caller gets 401, everyone else 404, and both say RepoNotFound.
            status = 401 if user is None else 404
            raise HubError(status, "Repository not found", "RepoNotFound")
        return repo

    def _may_write(self, user: str | None, repo_id: str) -> bool:
        namespace = repo_id.split("/")[0]
        return user is not None and (namespace == user or namespace in self.hub.orgs.get(user, []))

    def _writable(self, repo_id: str) -> Repo:
        user = self._user()
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        repo = self._readable(repo_id)
        if not self._may_write(user, repo_id):
            raise HubError(403, f"You don't have the rights to write to {repo_id}")
        return repo

    def _revision(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    # ---- endpoints -----------------------------------------------------------------------------------------------
    def _whoami(self):
        user = self._user()
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        orgs = [{"name": name, "type": "org"} for name in self.hub.orgs.get(user, [])]
        return 200, {}, {"type": "user", "name": user, "fullname": user, "orgs": orgs,
                         "auth": {"type": "access_token", "accessToken": {"role": "write"}}}

    def _create_repo(self, payload: dict):
        user = self._user()
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        if payload.get("type", "model") != "model":
            raise HubError(400, "LocalHub only hosts model repos")
        repo_id = f"{payload.get('organization') or user}/{payload['name']}"
        url = f"{self.hub.url}/{repo_id}"
        if not self._may_write(user, repo_id):
            raise HubError(403, f"You don't have the rights to create a repo under {repo_id.split('/')[0]}")
        if repo_id in self.hub.repos:
            raise HubError(409, "You already created this model repo", extra={"url": url})
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        repo = Repo(repo_id=repo_id, private=private, owner=user)
        self.hub.repos[repo_id] = repo
        # The Hub starts every repo with one commit holding `.gitattributes`.
        self.hub._commit(repo, DEFAULT_BRANCH, {".gitattributes": GITATTRIBUTES}, "initial commit")
        return 200, {}, {"url": url, "name": repo_id, "id": repo_id}

    def _validate_yaml(self, payload: dict):
        content = payload.get("content", "")
        errors = []
        if content.startswith("---"):
            front = content.split("---", 2)
            try:
                meta = yaml.safe_load(front[1]) if len(front) == 3 else None
                if meta is not None and not isinstance(meta, dict):
                    errors.append({"message": "metadata must be a YAML mapping"})
            except yaml.YAMLError as err:
                errors.append({"message": f"invalid YAML: {err}"})
        if errors:
            raise HubError(400, "Invalid metadata in README.md", extra={"errors": errors})
        return 200, {}, {"errors": [], "warnings": []}

    def _info(self, repo_id: str, revision: str):
        repo = self._readable(repo_id)
        commit = self._revision(repo, revision)
        siblings = [{"rfilename": path, "size": len(data), "blobId": git_blob_sha1(data)}
                    for path, data in sorted(commit.files.items())]
        return 200, {}, {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
            "author": repo_id.split("/")[0], "sha": commit.sha, "lastModified": commit.date,
            "createdAt": repo.commits[next(iter(repo.commits))].date, "private": repo.private, "gated": False,
            "disabled": False, "downloads": 0, "likes": 0, "tags": [], "siblings": siblings,
        }

    def _tree(self, repo_id: str, revision: str, path: str, query: dict):
        repo = self._readable(repo_id)
        commit = self._revision(repo, revision)
        recursive = query.get("recursive", ["false"])[-1].lower() in ("1", "true")
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        files, folders = [], set()
        for file_path, data in sorted(commit.files.items()):
            if not file_path.startswith(prefix):
                continue
            rel = file_path[len(prefix):].split("/")
            # Folders between the listed path and the file (all of them when recursive, else the first).
            for depth in range(1, len(rel) if recursive else min(len(rel), 2)):
                folders.add(prefix + "/".join(rel[:depth]))
            if recursive or len(rel) == 1:
                files.append({"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": file_path})
        if prefix and not files and not folders:
            raise HubError(404, f"{path} does not exist on {revision}", "EntryNotFound")
        entries = [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                   for f in sorted(folders)]
        return 200, {}, entries + files

    def _refs(self, repo_id: str, query: dict):
        repo = self._readable(repo_id)
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": repo.refs[b]} for b in repo.branches()]
        answer = {"branches": branches, "converts": [], "tags": []}
        if query.get("include_prs", ["false"])[-1].lower() in ("1", "true"):
            answer["pullRequests"] = [{"name": ref.split("/")[-1], "ref": ref, "targetCommit": sha}
                                      for ref, sha in repo.refs.items() if ref.startswith("refs/pr/")]
        return 200, {}, answer

    def _preupload(self, repo_id: str, revision: str, payload: dict, query: dict):
        repo = self._writable(repo_id)
        current = repo.resolve(revision)
        if current is None and not query.get("create_pr"):
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        existing = current.files if current is not None else {}
        files = []
        for entry in payload.get("files", []):
            old = existing.get(entry["path"])
            files.append({
                "path": entry["path"],
                # "regular": the content comes base64 inside the NDJSON commit; no LFS, no Xet.
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": git_blob_sha1(old) if old is not None else None,
            })
        return 200, {}, {"files": files, "commitOid": current.sha if current else None}

    def _commit(self, repo_id: str, revision: str, body: bytes, query: dict):
        repo = self._writable(repo_id)
        base = self._revision(repo, revision)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The first NDJSON line of a commit must be its header")
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent is not None and not base.sha.startswith(parent):
            raise HubError(412, f"A commit has happened since {parent}", "PreconditionFailed")
        files = dict(base.files)
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, f"Unsupported encoding {value.get('encoding')!r}")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if value["path"] not in files:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                del files[value["path"]]
            elif key == "deletedFolder":
                folder = value["path"].rstrip("/") + "/"
                files = {p: d for p, d in files.items() if not p.startswith(folder)}
            else:
                # lfsFile / copies: preupload never asks for LFS, so a client sending one is a bug worth seeing.
                raise HubError(400, f"LocalHub does not support commit operation {key!r}")
        message = header.get("summary") or "commit"
        pr_url = None
        if query.get("create_pr", ["0"])[-1] in ("1", "true"):
            num = self._open_pull_request(repo, message, base_ref=revision)
            ref = f"refs/pr/{num}"
            pr_url = f"{self.hub.url}/{repo_id}/discussions/{num}"
        elif revision in repo.refs:
            ref = revision
        else:
            raise HubError(400, f"Cannot commit to {revision}: not a branch", "RevisionNotFound")
        commit = self.hub._commit(repo, ref, files, message)
        return 200, {}, {
            "success": True,
            "commitOid": commit.sha,
            "commitUrl": f"{self.hub.url}/{repo_id}/commit/{commit.sha}",
            "pullRequestUrl": pr_url,
            "hookOutput": "",
        }

    def _create_branch(self, repo_id: str, branch: str, payload: dict):
        repo = self._writable(repo_id)
        if branch in repo.refs:
            raise HubError(409, f"Reference already exists: {branch}")
        start = self._revision(repo, payload.get("startingPoint") or DEFAULT_BRANCH)
        repo.refs[branch] = start.sha
        return 200, {}, {}

    def _open_pull_request(self, repo: Repo, title: str, base_ref: str = DEFAULT_BRANCH) -> int:
        num = len(repo.pull_requests) + 1
        repo.refs[f"refs/pr/{num}"] = self._revision(repo, base_ref).sha
        repo.pull_requests[num] = {"title": title, "base": base_ref, "author": self._user() or "anonymous"}
        return num

    def _create_pull_request(self, repo_id: str, payload: dict):
        repo = self._writable(repo_id)
        if not payload.get("pullRequest"):
            raise HubError(400, "LocalHub only opens pull requests, not discussions")
        num = self._open_pull_request(repo, payload.get("title", "Pull request"))
        return 200, {}, {"num": num, "url": f"{self.hub.url}/{repo_id}/discussions/{num}"}

    def _discussion(self, repo_id: str, num: int):
        repo = self._readable(repo_id)
        if num not in repo.pull_requests:
            raise HubError(404, f"Discussion {num} not found")
        pr = repo.pull_requests[num]
        created = repo.commits[repo.refs[f"refs/pr/{num}"]].date
        return 200, {}, {
            "num": num, "title": pr["title"], "status": "draft", "isPullRequest": True, "createdAt": created,
            "author": {"name": pr["author"]}, "repo": {"name": repo_id, "type": "model"}, "events": [],
            "changes": {"base": f"refs/heads/{pr['base']}"}, "filesWithConflicts": [], "diff": "",
        }

    def _resolve(self, repo_id: str, revision: str, path: str):
        repo = self._readable(repo_id)
        commit = self._revision(repo, revision)
        if path not in commit.files:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        data = commit.files[path]
        headers = {
            "Content-Type": "application/octet-stream",
            "X-Repo-Commit": commit.sha,
            "ETag": f'"{git_blob_sha1(data)}"',
        }
        start = self._range_start(len(data))
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return 206, headers, data[start:]
        return 200, headers, data

    def _range_start(self, size: int) -> int:
        # The client resumes an interrupted download with `Range: bytes=<n>-`; nothing else is needed.
        value = self.headers.get("Range", "")
        if value.startswith("bytes=") and value.endswith("-"):
            start = int(value[len("bytes="):-1] or 0)
            return start if 0 < start < size else 0
        return 0
