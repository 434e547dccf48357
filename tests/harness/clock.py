"""A test process's wall clock, shifted: ``time.time`` and ``time.time_ns`` wrapped (``time.monotonic``
untouched), for the clock-skew and clock-jump nemeses of tests/harness/nemesis.py and tests/harness/bucket_stress.py.
Call it before ckptstore is imported, so that every read of the wall clock in the process sees it."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

FOLLOW_SECONDS = 0.05  # how often a clock file is read again


def shift_clock(offset: float | str | Path) -> None:
    """Shift this process's wall clock: by ``offset`` seconds (a number; 0 changes nothing), or
    by the number of seconds the file ``offset`` (a path) holds, read again every
    :data:`FOLLOW_SECONDS` by a daemon thread, so that another process can make the clock jump
    (an empty, missing or unparsable file: the last value read, 0 at first)."""
    if isinstance(offset, (int, float)):
        if not offset:
            return
        shift = [float(offset)]
    else:
        shift, path, real_sleep = [0.0], Path(offset), time.sleep

        def follow() -> None:
            while True:
                with contextlib.suppress(OSError, ValueError):
                    shift[0] = float(path.read_text() or 0)
                real_sleep(FOLLOW_SECONDS)

        threading.Thread(target=follow, daemon=True, name="shifted-clock").start()
    real_time, real_ns = time.time, time.time_ns
    time.time = lambda: real_time() + shift[0]
    time.time_ns = lambda: real_ns() + int(shift[0] * 1e9)
