"""Workers for the backend race tests, run in spawned processes (no torch, no pytest)."""

from __future__ import annotations

import json

from ckptstore.backends import LocalBackend, open_backend, update_ref
from ckptstore.errors import RefConflictError


def append_ids(location: str, ref: str, worker: int, count: int, start, out, prune_age: float | None = None) -> None:
    """Append ``"<worker>-<i>"`` for i in 0..count-1 to the JSON list in ``ref``, one CAS loop each;
    put the number of attempts taken on queue ``out``. ``prune_age``: a local folder pruning that eagerly."""
    backend = open_backend(location) if prune_age is None else LocalBackend(location, prune_age=prune_age)
    attempts = 0

    def add(item: str):
        def update(old: bytes | None) -> bytes:
            nonlocal attempts
            attempts += 1
            return json.dumps([*(json.loads(old) if old else []), item]).encode()

        return update

    start.wait()
    for i in range(count):
        update_ref(backend, ref, add(f"{worker}-{i}"), attempts=200)
    backend.close()
    out.put((worker, attempts))


def cas_once(location: str, ref: str, worker: int, version: str, start, out) -> None:
    """CAS ``ref`` from ``version`` once, after all workers reach ``start``; report won/lost."""
    backend = open_backend(location)
    start.wait()
    try:
        backend.cas_ref(ref, f"worker {worker}".encode(), version)
        out.put((worker, "won"))
    except RefConflictError:
        out.put((worker, "lost"))
    backend.close()


def append_forever(location: str, ref: str, worker: int, start, out) -> None:
    """Append ``"<worker>-<i>"`` for i = 0, 1, ... until killed; says "started" on ``out`` first."""
    backend = open_backend(location)
    start.wait()
    out.put((worker, "started"))
    i = 0
    while True:
        item = f"{worker}-{i}"
        update_ref(backend, ref, lambda old, item=item: json.dumps([*(json.loads(old) if old else []), item]).encode(), attempts=10_000)
        i += 1
