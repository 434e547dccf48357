"""Workers for tests/unit/home/test_bucket_store.py: processes that commit to, or collect, a
``Store("s3://…")`` until they are done or SIGKILLed.

They run forked from a forkserver that has imported this module (so torch and
ckptstore) once: a worker starts in milliseconds, not seconds. Each worker reports
by appending whole lines to its own file (one ``os.write`` per line, ``O_APPEND``),
which a SIGKILL cannot tear: ``ready`` once its store is open, then one line per
finished call. The state a writer commits is a pure function of the metadata it
commits with (:func:`state`), so a test recovers what any commit must hold from the
commit id alone.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback

import torch

import ckptstore
from ckptstore.errors import CkptStoreError, NotAStoreError, RefBusyError

_CTX = None


def _warm() -> None:
    """Import what a first commit imports lazily (the adapters, tensordict, parts of torch:
    about a second), so that the forkserver holds it and a worker starts committing at once."""
    from ckptstore.home import bucket  # noqa: F401
    from ckptstore.protocols import checkout  # noqa: F401
    from ckptstore.adapters import REGISTRY, capture

    capture(state({"w": 0, "i": 0, "n": 4, "alt": 1}), REGISTRY)


def context():
    """The forkserver context whose server has torch and ckptstore imported."""
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload([__name__])
    return _CTX


def state(meta: dict) -> dict:
    """The state committed with metadata ``meta`` = ``{"w": writer, "i": step, "n": floats,
    "alt": 0 or 1}``: ``own`` (n floats) unique to (w, i); with ``alt``, ``base`` (n floats)
    takes one of two values by the parity of i (a blob an older commit already wrote)."""
    w, i, n = meta["w"], meta["i"], meta["n"]
    g = torch.Generator().manual_seed(1_000_003 * (w + 1) + i)
    out = {"own": torch.randn(n, generator=g), "step": torch.tensor([w, i], dtype=torch.int64)}
    if meta.get("alt"):
        out["base"] = torch.randn(n, generator=torch.Generator().manual_seed(7919 * (w + 1) + i % 2))
    return out


def _say(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def writer(env: dict, url: str, tag: str, w: int, first: int, count: int | None, n: int, alt: int, log: str, pause: float = 0.0) -> None:
    """Commit ``state({"w": w, "i": i, ...})`` to ``tag`` for i = first, first + 1, ...
    (``count`` commits, or until killed); log ``<commit id> <i> <blobs written>`` per commit that
    returned, ``busy <i>`` for a RefBusyError, ``error <i> <type>: <message>`` for any
    other ckptstore error (and carry on), ``done`` at the end; ``pause`` seconds between commits."""
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        store = ckptstore.Store(url)
        _say(fd, "ready")
        i = first
        while count is None or i < first + count:
            meta = {"w": w, "i": i, "n": n, "alt": alt}
            try:
                info = store.commit(state(meta), tag=tag, metadata=meta)
                _say(fd, f"{info.id} {i} {info.shards_new}")
            except RefBusyError:
                _say(fd, f"busy {i}")
            except CkptStoreError as exc:
                _say(fd, f"error {i} {type(exc).__name__}: {str(exc).splitlines()[0]}")
            i += 1
            time.sleep(pause)
        store.close()
        _say(fd, "done")
    except BaseException:
        _say(fd, "crash " + traceback.format_exc().replace("\n", " | "))
        raise
    finally:
        os.close(fd)


def collector(env: dict, url: str, grace: float, keep_last: int, log: str) -> None:
    """Run ``store.gc(grace=grace, keep_last=keep_last)`` over and over until killed;
    log one line per finished run (``gc <commits dropped> <packs deleted>``)."""
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        store = ckptstore.Store(url)
        _say(fd, "ready")
        while True:
            try:
                r = store.gc(grace=grace, keep_last=keep_last)
            except NotAStoreError:  # no writer has committed yet
                time.sleep(0.01)
                continue
            _say(fd, f"gc {r.commits_dropped} {r.packs_deleted}")
    except BaseException:
        _say(fd, "crash " + traceback.format_exc().replace("\n", " | "))
        raise
    finally:
        os.close(fd)


def read_log(log: str) -> list[str]:
    """The whole lines a worker wrote (none if it never opened its log)."""
    try:
        with open(log) as f:
            return [line.rstrip("\n") for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


_warm()
