"""Pausing Python's cyclic garbage collector (not the store's GC, :mod:`ckptstore.gc`)
around work that allocates many small objects: a commit, a snapshot, a checkout."""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

_gc_pause = threading.Lock()
_gc_paused: list[bool] = []  # one entry per pause in progress, in any thread: whether the collector was enabled before the first


@contextmanager
def paused_gc():
    """Pause Python's cyclic garbage collector around a commit, a snapshot or a checkout.

    They allocate a few small objects per shard; with the many objects torch
    and TorchRL keep alive, that can trigger a full collection costing a
    quarter of a second in the middle of a commit (in a background commit, holding
    the GIL the training loop needs). Pauses may overlap across threads; the
    collector resumes when the last one ends, if it was enabled before the first.
    """
    with _gc_pause:
        _gc_paused.append(gc.isenabled() if not _gc_paused else _gc_paused[0])
        gc.disable()
    try:
        yield
    finally:
        with _gc_pause:
            enabled = _gc_paused.pop()
            if not _gc_paused and enabled:
                gc.enable()


__all__ = ["paused_gc"]
