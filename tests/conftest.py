"""Shared fixtures and helpers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckptstore
from tests import paths


@pytest.fixture(autouse=True)
def _quiet_torchrl():
    logging.getLogger("torchrl").setLevel(logging.WARNING)
ROOT = paths.REPO


@pytest.fixture
def store(tmp_path: Path) -> ckptstore.Store:
    s = ckptstore.Store(tmp_path / "store", create=True)
    yield s
    s.close()


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a contiguous copy: exact for NaN payloads, -0.0, bool, complex, float8."""
    t = t.detach().cpu().contiguous()
    start = t.storage_offset() * t.element_size()
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return storage[start : start + t.numel() * t.element_size()].numpy().tobytes()


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same dtype, same shape, same bytes (the acceptance cases' "bit-equal")."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert raw_bytes(a) == raw_bytes(b)


def run_fresh(code: str, *args: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` in a new Python interpreter (nothing left in memory)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, env=env, timeout=300
    )
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"fresh process failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def commit_edited(store: ckptstore.Store, obj, tag: str, version: dict | None = None, drop: tuple[str, ...] = ()) -> str:
    """Commit ``obj`` as an older or newer writer would have: component ``version``
    overrides (``{component path: version}``) and leaves ``drop``-ped. The catalog's
    rows cannot be edited for that: checkout reads the manifest from the commit record."""
    comps = ckptstore.adapters.capture(obj, store.registry)
    for c in comps:
        c.version = (version or {}).get(c.path, c.version)
        for path in drop:
            c.leaves.pop(path, None)
    return store.commit_components(comps, tag=tag).id


def row_count(s: ckptstore.Store) -> dict[str, int]:
    """Rows per catalog table: proves a failed call changed nothing."""
    tables = ("commits", "parents", "components", "leaves", "shards", "blobs", "packs", "tags", "reflog")
    return {t: s.catalog.rows(f"SELECT COUNT(*) AS n FROM {t}")[0]["n"] for t in tables}


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server on loopback (tests/s3server.py), requests serialized so that
    conditional PUTs are atomic as on S3; the standard AWS_* environment points at it
    for the session (spawned processes inherit it). Bucket ``ckpt`` exists."""
    pytest.importorskip("moto", reason="the object-storage tests need moto[server] (the test extra)")
    from tests.s3server import MotoServer

    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ALLOW_HTTP", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "XDG_CACHE_HOME")}
    with MotoServer(buckets=["ckpt"], serialize=True) as server:
        os.environ.update(server.env)
        os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))  # the caches of Store("s3://...")
        try:
            yield server
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
