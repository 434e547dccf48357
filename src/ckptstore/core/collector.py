"""Pausing Python's cyclic garbage collector (not the store's GC, :mod:`ckptstore.protocols.gc`)
around work that allocates many small objects: a commit, a snapshot, a checkout."""

from __future__ import annotations

import gc
import os
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


def _after_fork_in_child() -> None:
    """A forked child has none of the pauses of its parent's other threads: the lock is
    new and the collector runs again if it ran before the first of them."""
    global _gc_pause
    _gc_pause = threading.Lock()
    if _gc_paused:
        if _gc_paused[0]:
            gc.enable()
        _gc_paused.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["paused_gc"]
