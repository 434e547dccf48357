"""Workers for the backend race tests, run in spawned processes (no torch, no pytest)."""

from __future__ import annotations

import json

from ckptstore.backends import open_backend, update_ref
from ckptstore.errors import RefConflictError


def append_ids(location: str, ref: str, worker: int, count: int, start, out) -> None:
    """Append ``"<worker>-<i>"`` for i in 0..count-1 to the JSON list in ``ref``, one CAS loop each;
    put the number of attempts taken on queue ``out``."""
    backend = open_backend(location)
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
