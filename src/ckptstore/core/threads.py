"""Thread pools that keep working while the interpreter exits, and in a forked child.

An asynchronous commit still running when a script ends is finished by its thread
before the interpreter exits (``concurrent.futures`` joins its threads), but by then
every ``ThreadPoolExecutor`` refuses new work with ``RuntimeError``. The pools the
commit uses are :class:`Pool` s, which then run the work in the calling thread.

A forked child has none of its parent's threads: work handed to an inherited
``ThreadPoolExecutor`` would wait for ever. A :class:`Pool` used in a process other
than the one that made it runs the work in the calling thread, and
:func:`fail_inherited` (called by the store's fork hook) fails the futures the child
inherited unfinished, so that no ``result()`` in the child waits for a thread that
does not exist there.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures._base import PENDING, RUNNING
from typing import Any

_POOLS: weakref.WeakSet[Pool] = weakref.WeakSet()  # every live Pool of this process (and, in a child, of its parent)


class Pool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` whose ``submit`` (and so ``map``) runs ``fn`` in the
    calling thread, its result or exception in a done future, once the pool takes no
    new work (the interpreter is exiting, or the pool was shut down) or when called in
    a forked child of the process that made the pool (whose threads are not there)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._pid = os.getpid()
        self._futures: weakref.WeakSet[Future] = weakref.WeakSet()  # submitted to the threads, for fail_inherited
        _POOLS.add(self)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._pid == os.getpid():
            try:
                future = super().submit(fn, *args, **kwargs)
            except RuntimeError:
                pass
            else:
                self._futures.add(future)
                return future
        done: Future = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed over through the future, as the pool would
            done.set_exception(exc)
        return done


def fail_inherited(error: Callable[[], BaseException]) -> int:
    """In a forked child: fail with ``error()`` every future the pools of the parent
    had not finished at the fork (queued or running in a thread the child does not
    have), so that ``result()`` raises at once; returns how many. Their condition and
    waiters (the parent's threads') are replaced first: a lock a parent thread held at
    the fork stays locked in the child."""
    failed = 0
    for pool in list(_POOLS):
        for future in list(pool._futures):
            if future._state in (PENDING, RUNNING):  # (read without its lock: see above)
                future._condition = threading.Condition()  # (the child's only thread is this one)
                future._waiters = []
                future.set_exception(error())
                failed += 1
        pool._futures = weakref.WeakSet()
    return failed
