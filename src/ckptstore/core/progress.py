"""Progress of long work (export, import, fsck --deep, GC repacks, large commits and checkouts).

The library reports; whoever installed a reporter shows it. The command line
installs rich progress bars on stderr (``reporting(...)``); with none installed,
:func:`task` costs one context-variable lookup. Counts are bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar

Advance = Callable[[int], None]
Reporter = Callable[[str, int], AbstractContextManager[Advance]]

_reporter: ContextVar[Reporter | None] = ContextVar("ckptstore_progress", default=None)
MIN_BYTES = 64 << 20  # smaller work finishes before a bar is worth drawing


def _nothing(n: int) -> None:
    pass


@contextmanager
def task(description: str, total: int) -> Iterator[Advance]:
    """Report ``total`` bytes of work; yields ``advance(n)``, safe to call from any thread."""
    reporter = _reporter.get()
    if reporter is None or total < MIN_BYTES:
        yield _nothing
        return
    with reporter(description, total) as advance:
        yield advance


@contextmanager
def reporting(reporter: Reporter) -> Iterator[None]:
    """Install ``reporter(description, total)`` for the work done inside."""
    token = _reporter.set(reporter)
    try:
        yield
    finally:
        _reporter.reset(token)
