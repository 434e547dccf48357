"""Runs: the experiments that share a store, each a namespace of tags, lineage and retention.

A run is what one :class:`~ckptstore.Checkpointer` writes: run ``"exp-a"`` tags its commits
``exp-a/step-<n>`` and ``exp-a/latest`` and records ``"run": "exp-a"`` in their metadata;
the default run (``run=None``) keeps the plain ``step-<n>`` and ``latest`` tags of stores
written before runs existed (docs/training.md, "Runs that share a store"). This module
checks run names, lists the runs of a store (:func:`runs`) and holds the lease
(:class:`Lease`) that lets only one live process write a run.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backends.base import ref_segment
from .errors import ForkedStoreError, InvalidArgumentError, InvalidNameError, ObjectNotFoundError, RunBusyError, StoreWriteError
from .packs import BLOB_HEADER
from .records import check_tag

#: Name printed for the default run (``run=None``), whose tags have no prefix.
DEFAULT_RUN = "(default)"
#: Seconds a lease on object storage lasts without renewal (a killed holder's lease expires then).
LEASE_SECONDS = 60.0


def check_run(run: Any) -> str | None:
    """``run`` if it can name a run (``None``: the default run): a tag name without ``/``.

    Raises:
        InvalidNameError: not a str, empty, contains ``/`` or edge spaces, or not valid as a tag prefix.
    """
    if run is None:
        return None
    if type(run) is not str or not run or "/" in run or run != run.strip():
        raise InvalidNameError(f"invalid run name {run!r}: a tag name without '/' (its tags are '<run>/step-<n>', '<run>/latest')")
    check_tag(f"{run}/latest")  # (control characters, a leading '-', too long)
    return run


def run_tag(run: str | None, tag: str) -> str:
    """The tag ``tag`` of run ``run``: ``<run>/<tag>``, or ``tag`` itself for the default run."""
    return tag if run is None else f"{run}/{tag}"


def describe(run: str | None) -> str:
    """``run 'exp-a'`` or ``the default run``, for messages."""
    return "the default run" if run is None else f"run {run!r}"


@dataclass(frozen=True)
class RunInfo:
    """One run of a store, as :func:`runs` lists it.

    Attributes:
        name: the run name; ``None`` for the default run (plain ``latest`` / ``step-<n>``).
        latest_step: the step count of the run's newest commit.
        latest_commit: that commit's id (32 hex digits).
        commits: commits of the run in the store.
        bytes: stored bytes (compressed, with blob headers) of the distinct blobs the run's
            commits reference; a blob two runs share counts in both.
        tags: the tags that name the run's commits, sorted.
    """

    name: str | None
    latest_step: int
    latest_commit: str
    commits: int
    bytes: int
    tags: tuple[str, ...]


def runs(store) -> list[RunInfo]:
    """The runs of ``store`` (a :class:`~ckptstore.Store`), named runs by name, then the default run.

    A commit belongs to run ``metadata["run"]`` when a Checkpointer made it (its metadata
    holds an int ``step`` and its message is ``"step <step>"``, as every Checkpointer's has
    been); one without ``run`` belongs to the default run. Commits made otherwise
    (``Store.commit``, even with a ``step`` in their metadata, imports) belong to no run.

    Raises:
        NotAStoreError: there is no store at ``store``'s location.
    """
    commits = store.log()  # (on object storage: every commit record cached first)
    tags = store.tags()
    cat = store.catalog
    with cat.read():
        members: dict[str | None, list] = {}
        for info in commits:  # newest first
            step, run = info.metadata.get("step"), info.metadata.get("run")
            if type(step) is int and (run is None or type(run) is str) and (info.message == f"step {step}" or info.message.startswith(f"step {step}, ")):
                members.setdefault(run, []).append(info)
        out = []
        for name, infos in members.items():
            ids = [i.id for i in infos]
            blob_ids = {r[0] for r in cat.chunked(
                "SELECT DISTINCT s.blob_id FROM commit_leaves l JOIN shards s ON s.leaf_id = l.id WHERE l.commit_id IN ({})", ids, raw=True)}
            size = sum(r[0] for r in cat.chunked("SELECT stored_len FROM blobs WHERE id IN ({})", sorted(blob_ids), raw=True))
            mine = set(ids)
            out.append(RunInfo(name=name, latest_step=infos[0].metadata["step"], latest_commit=infos[0].id, commits=len(infos),
                               bytes=size + BLOB_HEADER.size * len(blob_ids), tags=tuple(sorted(t for t, c in tags.items() if c in mine))))
    return sorted(out, key=lambda r: (r.name is None, r.name or ""))


class Lease:
    """The right of one live process to write run ``run`` of ``store``; see :func:`acquire`.

    Attributes:
        holder: ``{"pid", "host", "since"}`` of this process.
    """

    def __init__(self, store, run: str | None, seconds: float):
        self.where = f"{describe(run)} of {store.location}"
        self.holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        self.lost: str | None = None  # why this process no longer holds it (then commits are refused)
        self.forked_from: int | None = None  # (a forked child's copy) the pid of the holder: _after_fork_in_child

    def check(self) -> None:
        """Raises RunBusyError if this lease was lost (taken over, or superseded in this process);
        ForkedStoreError in a process forked from the holder (the lease is the parent's)."""
        if self.forked_from is not None:
            raise ForkedStoreError(f"{self.where}: this process is a fork of the lease's holder (pid {self.forked_from}): "
                                   "the run is the parent's. Open a new Store and Checkpointer in this process, on another run")
        if self.lost is not None:
            raise RunBusyError(f"{self.where}: this Checkpointer no longer holds the run: {self.lost}")

    def release(self) -> None:
        """Give the run up (idempotent)."""

    def abandon(self) -> None:
        """Give the run up from a finalizer (its owner was garbage-collected): as
        :meth:`release`, but with no I/O at that arbitrary point (any thread, a forked
        child, a lock held); a bucket lease's objects are deleted at interpreter exit."""
        self.release()


def _segment(run: str | None) -> str:
    """``default`` or ``run-<escaped name>``: the key segment of a run's lease."""
    return "default" if run is None else f"run-{ref_segment(run)}"


def _holder_text(holder: dict | None) -> str:
    if not holder:
        return "another process (it has not written its pid yet)"
    return f"pid {holder.get('pid')} on host {holder.get('host')!r}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('since', 0)))}"


class FileLease(Lease):
    """A lease on a store folder: an exclusive ``flock`` on ``leases/<run>.lock`` in the store
    (its content names the holder). The kernel drops the lock when the holding process ends,
    however it ends (SIGKILL included), so a killed run never blocks the next one."""

    _held: dict[str, FileLease] = {}  # lock path -> the lease this process holds there
    _lock = threading.Lock()

    def __init__(self, store, run: str | None, seconds: float):
        super().__init__(store, run, seconds)
        self.folder = Path(os.path.realpath(store.root)) / "leases"  # one key per store, however its path is spelled
        self.path = str(self.folder / f"{_segment(run)}.lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with FileLease._lock:
            previous = FileLease._held.get(self.path)
            if previous is not None and previous.fd is not None:  # this process: the newer Checkpointer takes over
                previous.lost = "a newer Checkpointer on the same run was made in this process"
                self.fd, previous.fd = previous.fd, None
            else:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    try:
                        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
                    except ValueError:
                        holder = None
                    os.close(fd)
                    raise RunBusyError(
                        f"{self.where} is being written by another live Checkpointer: {_holder_text(holder)}. "
                        "Stop that process, or give this one its own run: Checkpointer(..., run='<name>')"
                    ) from None
                self.fd = fd
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps(self.holder).encode(), 0)
            FileLease._held[self.path] = self

    def release(self) -> None:
        with FileLease._lock:
            if self.fd is not None:
                os.close(self.fd)  # drops the flock
                self.fd = None
            if FileLease._held.get(self.path) is self:
                del FileLease._held[self.path]


class BucketLease(Lease):
    """A lease on object storage, which has no lock a killed process drops: a numbered
    **generation** object ``leases/<run>/<gen>`` (naming the holder), created only if absent
    (so of two processes taking generation ``gen`` one wins), and renewed every
    ``seconds / 3`` by a heartbeat thread that writes ``<gen>.<beat>`` objects. A generation
    whose newest object is older than ``seconds`` by the bucket's clock has expired: the
    next process takes generation ``gen + 1``. Acquiring watches the holder: one that renews
    is alive (refused at once, within about ``seconds / 3``), one that does not is waited
    for until it expires (a restarted job after a kill waits at most ``seconds``). A holder
    that sees a newer generation (it was paused past ``seconds``, then taken over) has lost
    the lease, and its commits are refused."""

    _held: dict[str, BucketLease] = {}  # url/prefix -> the lease this process holds there
    _lock = threading.Lock()

    def __init__(self, store, run: str | None, seconds: float):
        super().__init__(store, run, seconds)
        if not isinstance(seconds, (int, float)) or not seconds > 0:
            raise InvalidArgumentError(f"lease_seconds must be a number of seconds > 0, got {seconds!r}")
        self.backend, self.seconds = store.backend, float(seconds)
        self.prefix = f"leases/{_segment(run)}"
        self.gen: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _generations(self) -> dict[int, list]:
        """``{generation: [its objects]}`` now on the bucket."""
        gens: dict[int, list] = {}
        for o in self.backend.list(self.prefix):
            head = o.key.rsplit("/", 1)[1].split(".", 1)[0]
            if head.isdigit():
                gens.setdefault(int(head), []).append(o)
        return gens

    def acquire(self) -> None:
        key = self.url_key
        with BucketLease._lock:
            previous = BucketLease._held.get(key)
            if previous is not None and previous.gen is not None:  # this process: the newer Checkpointer takes over
                previous.lost = "a newer Checkpointer on the same run was made in this process"
                previous._stop.set()
                self.gen, previous.gen = previous.gen, None
                BucketLease._held[key] = self
            else:  # a lease this process abandoned (its Checkpointer was dropped): still this process's
                mine = [i for i, (lease, _) in enumerate(_ABANDONED) if lease.url_key == key]
                if mine:
                    self.gen = _ABANDONED.pop(mine[-1])[1]
                    BucketLease._held[key] = self
        if self.gen is None:
            gens = self._wait_expired()
            newest = max(gens, default=0)
            if not self.backend.put_new(f"{self.prefix}/{newest + 1:012d}", json.dumps(self.holder).encode()):
                raise self._busy(newest + 1)  # another process took it first
            self.gen = newest + 1
            for old in (o for g, objs in gens.items() for o in objs):
                self.backend.delete(old.key)
            with BucketLease._lock:
                BucketLease._held[key] = self
        self._thread = threading.Thread(target=self._renew, name="ckptstore-lease", daemon=True)
        self._thread.start()

    @property
    def url_key(self) -> str:
        return f"{self.backend.url}/{self.prefix}"

    def _wait_expired(self) -> dict[int, list]:
        """The generations on the bucket once the newest has expired (none: at once).
        A holder that renews meanwhile is alive: RunBusyError, within about a third of
        ``seconds``; a killed one is waited for until ``seconds`` after its last renewal."""
        seen = None
        while True:
            gens = self._generations()
            if not gens:
                return gens
            newest = max(gens)
            state = (newest, frozenset(o.key for o in gens[newest]))
            if seen is not None and state != seen:
                raise self._busy(newest)  # it renewed (or was taken) while this one waited
            seen = state
            age = self.backend.now() - max(o.mtime for o in gens[newest])
            if age >= self.seconds:
                return gens
            time.sleep(min(self.seconds / 6, self.seconds - age + 0.1))

    def _busy(self, gen: int) -> RunBusyError:
        try:
            holder = json.loads(self.backend.get(f"{self.prefix}/{gen:012d}"))
        except (ObjectNotFoundError, ValueError):
            holder = None
        return RunBusyError(
            f"{self.where} is being written by another live Checkpointer: {_holder_text(holder)} "
            f"(it renews its lease every {self.seconds / 3:.3g} s). "
            "Stop that process, or give this one its own run: Checkpointer(..., run='<name>')"
        )

    def _renew(self) -> None:
        beat, last = 0, None
        while not self._stop.wait(self.seconds / 3):
            gen = self.gen
            if gen is None:
                return
            try:
                beat += 1
                self.backend.put_new(f"{self.prefix}/{gen:012d}.{beat:08d}", b"")
                if last is not None:
                    self.backend.delete(last)
                last = f"{self.prefix}/{gen:012d}.{beat:08d}"
                self._poll()
            except Exception:  # noqa: BLE001 - the next beat tries again; a takeover is what check() reports
                continue

    def _poll(self) -> None:
        """Notes in :attr:`lost` a newer generation on the bucket (one listing request)."""
        gen = self.gen
        if self.lost is None and gen is not None:
            newer = [g for g in self._generations() if g > gen]
            if newer:
                self.lost = f"its lease expired and generation {max(newer)} was taken by another process"
                self._stop.set()

    def check(self) -> None:
        """Raises RunBusyError if the lease was taken over (a newer generation on the bucket)
        or superseded in this process."""
        self._poll()
        super().check()

    def release(self) -> None:
        self._stop.set()
        with BucketLease._lock:
            gen, self.gen = self.gen, None
            if BucketLease._held.get(self.url_key) is self:
                del BucketLease._held[self.url_key]
        if gen is not None and os.getpid() == self.holder["pid"]:  # (a forked child's copy: the lease is its parent's)
            self._delete(gen)

    def _delete(self, gen: int) -> None:
        try:
            for o in self._generations().get(gen, ()):
                self.backend.delete(o.key)
        except Exception:  # noqa: BLE001 - (the store was closed first, or the bucket failed) it expires by itself
            pass

    def abandon(self) -> None:
        self._stop.set()
        with BucketLease._lock:
            gen, self.gen = self.gen, None
            if BucketLease._held.get(self.url_key) is self:
                del BucketLease._held[self.url_key]
        if gen is not None and os.getpid() == self.holder["pid"]:
            _ABANDONED.append((self, gen))


_ABANDONED: list[tuple[BucketLease, int]] = []  # bucket leases given up by finalizers: deleted at exit


@atexit.register
def _delete_abandoned() -> None:
    while _ABANDONED:
        lease, gen = _ABANDONED.pop()
        if os.getpid() == lease.holder["pid"]:
            lease._delete(gen)


def _after_fork_in_child() -> None:
    """In a forked child, the leases held are the parent's: the child closes its copy of
    each lock file's descriptor (the parent's ``flock`` stays, and ends with the parent, not
    with the child), has no renewal thread, and never renews, releases or deletes a lease
    object of the parent's (at exit included); :meth:`Lease.check` then raises ForkedStoreError."""
    parent = os.getppid()
    FileLease._lock = threading.Lock()  # (a parent thread may have held them at the fork)
    BucketLease._lock = threading.Lock()
    for lease in list(FileLease._held.values()):
        fd, lease.fd = lease.fd, None
        if fd is not None:
            try:
                os.close(fd)  # the child's reference to the open file description; the parent's lock stays
            except OSError:
                pass
        lease.forked_from, lease.lost = parent, "the lease is the parent's (this process is a fork of its holder)"
    for lease in list(BucketLease._held.values()) + [lease for lease, _ in _ABANDONED]:
        lease.gen = None
        lease._stop = threading.Event()
        lease._stop.set()
        lease._thread = None
        lease.forked_from, lease.lost = parent, "the lease is the parent's (this process is a fork of its holder)"
    FileLease._held.clear()
    BucketLease._held.clear()
    _ABANDONED.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def acquire(store, run: str | None, seconds: float = LEASE_SECONDS, create: bool = True) -> Lease | None:
    """Take the lease of run ``run`` of ``store`` for this process; ``None`` when the store's
    folder does not exist and not ``create`` (the first commit takes it: nothing is created
    by a Checkpointer that only reads), or when it cannot be written and not ``create``.

    In one process, a newer lease on the same run takes over from the older one (whose
    :meth:`Lease.check` then raises): re-running a notebook cell replaces its Checkpointer.

    Raises:
        RunBusyError: another live process holds it (names its pid and host).
        StoreWriteError: (``create``) the lease file cannot be written (a read-only store).
        InvalidArgumentError: ``seconds`` not > 0 (object storage).
    """
    bucket = hasattr(store, "backend")
    if not bucket and not create and not Path(store.root).is_dir():
        return None
    lease = (BucketLease if bucket else FileLease)(store, run, seconds)
    try:
        lease.acquire()
    except OSError as exc:  # a store folder this process cannot write: reading it needs no lease, committing does
        if not create:
            return None
        raise StoreWriteError(f"cannot take the lease of {lease.where} in {Path(store.root) / 'leases'}: {exc}") from None
    return lease
