"""Hub fixtures for the tests: a local Hub on 127.0.0.1 and an offline-cache builder.

`tests/conftest.py` imports this module first, before anything imports `huggingface_hub`, because the client reads
its environment once, at import: `HF_ENDPOINT` must already name the local Hub's port and `HF_HOME` a temporary
folder, so that no test can reach huggingface.co or touch `~/.cache/huggingface`.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path

if "huggingface_hub" in sys.modules:
    raise RuntimeError(
        "tests/hub_fixtures.py must be imported before huggingface_hub (put `from tests.hub_fixtures import *` first "
        "in tests/conftest.py): the client reads HF_ENDPOINT and HF_HOME once, at import."
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The port is chosen now, because HF_ENDPOINT is read once; the server listens on it only while a test
# uses `local_hub`. At other times the port refuses connections, so a stray Hub call fails at once.
HUB_PORT = _free_port()
HUB_ENDPOINT = f"http://127.0.0.1:{HUB_PORT}"
_SESSION_DIR = tempfile.mkdtemp(prefix="hf_ppo_tests_")
atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)

for _var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
             "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_XET_CACHE", "HF_ASSETS_CACHE",
             "HF_DATASETS_CACHE", "HF_STORED_TOKENS_PATH"):
    os.environ.pop(_var, None)
os.environ.update(
    HF_ENDPOINT=HUB_ENDPOINT,
    HF_HOME=os.path.join(_SESSION_DIR, "hf_home"),
    HF_HUB_DISABLE_TELEMETRY="1",
    HF_HUB_DISABLE_PROGRESS_BARS="1",
)

import pytest  # noqa: E402

from tests.hub_server import LocalHub  # noqa: E402

__all__ = [
    "HUB_ENDPOINT", "TEST_ORG", "TEST_TOKEN", "TEST_USER", "hub_token", "local_hub", "seed_offline_cache",
]

TEST_USER = "hf-ppo-test"
TEST_ORG = "hf-ppo-org"
TEST_TOKEN = "hf_ppo_test_write_token"

# One server object for the session (its port is baked into HF_ENDPOINT); each test gets it empty.
_HUB = LocalHub(port=HUB_PORT, tokens={TEST_TOKEN: TEST_USER}, orgs={TEST_USER: [TEST_ORG]})


@pytest.fixture
def local_hub():
    """The local Hub at `HF_ENDPOINT`: empty, serving for this test, stopped at teardown.

    `TEST_TOKEN` authenticates `TEST_USER` (who may also write to `TEST_ORG`). `local_hub.requests` logs what was
    asked, `local_hub.fail_with(500)` makes every request fail, `local_hub.stop()`/`start()` take it down and up.
    """
    _HUB.reset()
    _HUB.start()
    try:
        yield _HUB
    finally:
        _HUB.stop()
        _HUB.reset()


@pytest.fixture
def hub_token() -> str:
    """A write token the local Hub accepts (user `TEST_USER`)."""
    return TEST_TOKEN


_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")


def seed_offline_cache(cache_dir, repo_id: str, src_folder, revision: str = "main") -> Path:
    """Lay the files of `src_folder` out as the Hub cache does for `repo_id` at `revision`; return the snapshot.

    Builds `<cache_dir>/models--<org>--<name>/{blobs,snapshots,refs}`: each file's content is stored once under
    `blobs/<sha256>`, `snapshots/<commit>/<path>` links to it, and `refs/<revision>` names the commit (a revision
    that is itself a 40-hex commit sha needs no ref). The commit sha is derived from repo id, revision and contents,
    so seeding two revisions gives two snapshots. Point `HF_HUB_CACHE` at `cache_dir` and set `HF_HUB_OFFLINE=1`
    (both before huggingface_hub is imported) to load the model by id without any request.
    """
    cache_dir, src = Path(cache_dir), Path(src_folder)
    files = sorted(p for p in src.rglob("*") if p.is_file())
    if not files:
        raise ValueError(f"{src} holds no file to seed the cache with")
    repo_dir = cache_dir / f"models--{repo_id.replace('/', '--')}"
    blobs: dict[str, str] = {}
    tree = hashlib.sha1(f"{repo_id}@{revision}".encode())
    for path in files:
        blob = hashlib.sha256(path.read_bytes()).hexdigest()
        rel = path.relative_to(src).as_posix()
        blobs[rel] = blob
        tree.update(f"{rel}\0{blob}\n".encode())
    commit = revision if _COMMIT_SHA.match(revision) else tree.hexdigest()
    snapshot = repo_dir / "snapshots" / commit
    for rel, blob in blobs.items():
        blob_path = repo_dir / "blobs" / blob
        if not blob_path.exists():
            blob_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, blob_path)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        try:
            # A relative link, as the real cache makes, so the cache folder can be moved.
            link.symlink_to(os.path.relpath(blob_path, link.parent))
        except OSError:  # no symlinks (some Windows setups): the client accepts plain copies too
            shutil.copyfile(blob_path, link)
    if commit != revision:
        ref = repo_dir / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    return snapshot
