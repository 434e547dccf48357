"""Thread pools that keep working while the interpreter exits.

An asynchronous commit still running when a script ends is finished by its thread
before the interpreter exits (``concurrent.futures`` joins its threads), but by then
every ``ThreadPoolExecutor`` refuses new work with ``RuntimeError``. The pools the
commit uses are :class:`Pool` s, which then run the work in the calling thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Pool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` whose ``submit`` (and so ``map``) runs ``fn`` in the
    calling thread, its result or exception in a done future, once the pool takes no
    new work (the interpreter is exiting, or the pool was shut down)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        try:
            return super().submit(fn, *args, **kwargs)
        except RuntimeError:
            done: Future = Future()
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed over through the future, as the pool would
                done.set_exception(exc)
            return done
