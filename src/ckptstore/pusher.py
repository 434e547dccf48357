"""The one background push worker of ckptstore: a daemon thread that runs push jobs one at a
time, the newest request winning, with retries, and the one error model of background
pushes (docs/training.md, "Background pushes and their errors").

Both :class:`~ckptstore.Checkpointer` ``push_to=`` (push the run's latest tag) and the
tiers of :mod:`ckptstore.tiers` (push a node's part, compose, move the bucket's tags) hand
their job to a :class:`Pusher`; only the job differs.

The error model: a request is a save (its step). A job that still fails after its retries is
warned (:class:`~ckptstore.core.errors.PushFailedWarning`) and recorded in :attr:`Pusher.failures`.
Once a *later* request's job succeeds, every earlier failure is **superseded** (the newer save
is durable and holds everything the failed one would have published): it moves to
:attr:`Pusher.superseded` with one warning, and :attr:`Pusher.error` no longer names it.
:attr:`Pusher.error` is the error of the newest save when it is not durable, else ``None``:
``Checkpointer.wait_pushed()`` raises exactly that.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .core.errors import CkptStoreError, InvalidArgumentError, PushFailedWarning

__all__ = ["PushFailure", "Pusher"]


@dataclass(frozen=True)
class PushFailure:
    """A background push that failed after its retries.

    Attributes:
        step: the step of the save it pushed (``None``: unknown).
        error: the last attempt's exception (a BackendError, RefConflictError, ...).
        seq: the request's number (1 for the first :meth:`Pusher.request`), which orders saves.
    """

    step: int | None
    error: Exception
    seq: int


class Pusher:
    """Runs ``job(step, item)`` in a daemon thread named ``name`` for the newest request.

    Args:
        remote: where the jobs push (for messages).
        job: ``job(step, item)`` pushes one save; its return value is kept in :attr:`report`;
            it returns ``False`` when the save was given up without error (a newer one waits).
            A :class:`~ckptstore.core.errors.CkptStoreError` it raises is retried.
        attempts: tries per job (an int >= 1); ``backoff``: seconds before the second try,
            doubling after each.
        skipped: ``skipped(step, item)`` for each request a newer one replaced before its job ran.
        retry: ``retry(exc)``: is this CkptStoreError worth another attempt (default: every one).
        label: ``label(step)``: how messages name a save (default ``"step <n>"``).

    Raises:
        InvalidArgumentError: ``attempts`` < 1 or ``backoff`` < 0.
    """

    def __init__(self, remote: str, job: Callable[[int | None, Any], Any], attempts: int, backoff: float, *,
                 name: str = "ckptstore-push", skipped: Callable[[int | None, Any], None] | None = None,
                 retry: Callable[[Exception], bool] | None = None, label: Callable[[int | None], str] | None = None):
        if type(attempts) is not int or attempts < 1 or not isinstance(backoff, (int, float)) or backoff < 0:
            raise InvalidArgumentError(f"push_attempts must be an int >= 1 and push_backoff seconds >= 0, got {attempts!r}, {backoff!r}")
        self.remote, self.job, self.attempts, self.backoff = str(remote), job, attempts, backoff
        self.name, self.skipped, self.retry = name, skipped, retry
        self.label = label or (lambda step: "a save" if step is None else f"step {step}")
        #: the last successful job's return value (``None`` before one)
        self.report: Any = None
        #: every job that failed after its retries, oldest first (superseded ones included)
        self.failures: list[PushFailure] = []
        #: the failures a later durable save superseded (warned once each, never raised)
        self.superseded: list[PushFailure] = []
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int | None, Any]] = []
        self._seq = 0  # requests made
        self._done = 0  # the newest request whose job finished (or was skipped)
        self._ok = 0  # the newest request whose job succeeded
        self._busy = False
        self._thread: threading.Thread | None = None

    def request(self, step: int | None, item: Any = None) -> None:
        """Ask for a push of the save at ``step`` (``item``: what the job needs); returns at once."""
        with self._cond:
            self._seq += 1
            self._queue.append((self._seq, step, item))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pending(self) -> bool:
        """Is a newer request waiting (a job may give its save up for it)?"""
        with self._cond:
            return bool(self._queue)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every request made so far has been served; ``False`` on timeout (seconds)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    @property
    def error(self) -> Exception | None:
        """The error of the newest requested save if its push failed (it is not durable),
        else ``None`` (no push failed, or a later save became durable and superseded them)."""
        with self._cond:
            last = self.failures[-1] if self.failures else None
            return last.error if last is not None and last.seq == self._seq and last.seq > self._ok else None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                *older, (seq, step, item) = self._queue
                self._queue.clear()
                self._busy = True
            error = None
            try:
                for _, s, it in older:  # the newest request wins
                    if self.skipped is not None:
                        self.skipped(s, it)
                for attempt in range(self.attempts):
                    try:
                        result = self.job(step, item)
                        error = None
                        break
                    except CkptStoreError as exc:
                        error = exc
                        if self.retry is not None and not self.retry(exc):
                            break
                        if attempt + 1 < self.attempts:
                            time.sleep(self.backoff * 2**attempt)
            except Exception as exc:  # noqa: BLE001 - reported below, the thread must keep serving
                error = exc
            what = self.label(step)
            superseded: list[PushFailure] = []
            with self._cond:
                if error is not None:
                    self.failures.append(PushFailure(step, error, seq))
                elif result is not False:
                    self.report, self._ok = result, seq
                    gone = {id(f) for f in self.superseded}
                    superseded = [f for f in self.failures if f.seq < seq and id(f) not in gone]
                    self.superseded += superseded
                self._done = seq
            if error is not None:
                warnings.warn(f"pushing {what} to {self.remote} failed after {self.attempts} attempt(s): {error} "
                              "(the local commit is intact; it is not durable there)", PushFailedWarning, stacklevel=1)
            for f in superseded:
                warnings.warn(f"the failed push of {self.label(f.step)} to {self.remote} ({type(f.error).__name__}: {f.error}) "
                              f"is superseded: the save of step {step} is durable there", PushFailedWarning, stacklevel=1)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
