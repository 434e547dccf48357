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
import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backends.base import ref_segment
from .backends.local import ForeignEntryError, fsync_dir, open_regular
from .core.errors import (
    ForkedStoreError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    NotAStoreError,
    RefConflictError,
    RunBusyError,
    RunTakenOverError,
    StoreWriteError,
)
from .home.refs import Fence
from .objects.packs import BLOB_HEADER
from .objects.records import check_tag

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


class Lease(Fence):
    """The right of one live process to write run ``run`` of ``store``; see :func:`acquire`.

    A lease is also the holder's :class:`~ckptstore.home.refs.Fence`: it carries the run's
    **fencing token** (:attr:`token`, the generation this holder was issued: a number that
    only grows over the run's whole life, never reset by a release), and every tag move the
    holder makes inside :func:`ckptstore.home.refs.fenced` is refused once a newer one was issued
    (docs/design.md, "Fenced writers").

    Attributes:
        holder: ``{"pid", "host", "since"}`` of this process.
        token: the fencing token this holder was issued (``0``: none yet).
    """

    def __init__(self, store, run: str | None, seconds: float):
        self.where = f"{describe(run)} of {store.location}"
        self.holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        self.lost: str | None = None  # why this process no longer holds it (then commits are refused)
        self.token = 0
        self.newer: int | None = None  # the token that took this holder over, once seen
        self.forked_from: int | None = None  # (a forked child's copy) the pid of the holder: _after_fork_in_child

    def check(self) -> None:
        """Raises RunBusyError if this lease was lost (taken over, or superseded in this process);
        RunTakenOverError (a subclass) when a newer token was issued; ForkedStoreError in a
        process forked from the holder (the lease is the parent's)."""
        if self.forked_from is not None:
            raise ForkedStoreError(f"{self.where}: this process is a fork of the lease's holder (pid {self.forked_from}): "
                                   "the run is the parent's. Open a new Store and Checkpointer in this process, on another run")
        if self.lost is not None:
            if self.newer is not None:
                raise RunTakenOverError(f"{self.where}: this Checkpointer no longer holds the run: {self.lost}", self.newer)
            raise RunBusyError(f"{self.where}: this Checkpointer no longer holds the run: {self.lost}")

    def _taken_over(self, newer: int | None, by: dict | None, here: bool = False) -> RunTakenOverError:
        """Note (and return the error) that generation ``newer`` (issued to ``by``; ``here``:
        a newer Checkpointer of this process) took this holder over."""
        if self.lost is None:
            who = "a newer Checkpointer on the same run was made in this process" if here else "it was taken over"
            self.lost = (f"{who}: generation {newer} of the run was issued to {_holder_text(by)} after this one's "
                         f"generation {self.token}; none of its tag moves can happen any more (what it wrote stays untagged, for GC)")
        self.newer = newer if self.newer is None else self.newer
        return RunTakenOverError(f"{self.where}: this Checkpointer no longer holds the run: {self.lost}", newer)

    def guard(self, moves: list[dict]):
        """(no token: nothing to check)"""
        return nullcontext()

    def release(self) -> None:
        """Give the run up (idempotent)."""

    def abandon(self) -> None:
        """Give the run up from a finalizer (its owner was garbage-collected): as
        :meth:`release`, but with no I/O at that arbitrary point (any thread, a forked
        child, a lock held); a bucket lease is released at interpreter exit."""
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
    however it ends (SIGKILL included), so a killed run never blocks the next one; a paused
    process keeps it (the run is refused to others meanwhile).

    The run's fencing token is ``leases/<run>.token`` (``{"token", "holder"}``, replaced
    atomically: tmp, fsync, rename), advanced by each holder under the flock *inside a
    catalog write transaction*, and read by every fenced tag move inside the catalog
    transaction that moves the tags: the two are serialized by SQLite's write lock, so a
    move either commits before the new token exists or sees it and fails. It also fences a
    holder that lost its flock without knowing (its lock file deleted or replaced, a
    network filesystem's lock lost) and an older Checkpointer of this process."""

    _held: dict[str, FileLease] = {}  # lock path -> the lease this process holds there
    _lock = threading.Lock()

    def __init__(self, store, run: str | None, seconds: float):
        super().__init__(store, run, seconds)
        self.store = store
        self.folder = Path(os.path.realpath(store.root)) / "leases"  # one key per store, however its path is spelled
        self.path = str(self.folder / f"{_segment(run)}.lock")
        self.token_path = self.folder / f"{_segment(run)}.token"
        self.fd: int | None = None

    def _open(self, path, flags: int) -> int:
        """``os.open`` of a file of ``leases/`` that is the store's own: never through a
        symbolic link, never a FIFO, socket or device (invariant 13).

        Raises:
            StoreWriteError: the folder or the file is not what ckptstore makes there."""
        try:
            fd = open_regular(self.folder.parent, Path(path), flags)
        except OSError as exc:
            if isinstance(exc, ForeignEntryError) or exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise StoreWriteError(f"{path} is not a lease file made by ckptstore (a symbolic link, a FIFO, a socket, "
                                      "a device or a folder): left alone; the run cannot be leased until it is removed") from None
            raise
        os.set_blocking(fd, True)
        return fd

    def acquire(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with FileLease._lock:
            previous = FileLease._held.get(self.path)
            if previous is not None and previous.fd is not None:  # this process: the newer Checkpointer takes over
                self.fd, previous.fd = previous.fd, None
            else:
                previous = None
                fd = self._open(self.path, os.O_RDWR | os.O_CREAT)
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
            try:
                self._advance()
            except BaseException:
                if previous is None:
                    os.close(self.fd)
                else:
                    previous.fd = self.fd  # (the older one keeps the run)
                self.fd = None
                raise
            if previous is not None:
                previous._taken_over(self.token, self.holder, here=True)
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps({**self.holder, "token": self.token}).encode(), 0)
            FileLease._held[self.path] = self

    def _read_token(self) -> tuple[int, dict | None]:
        """The run's token now and whom it was issued to (``0``: never issued)."""
        try:
            fd = self._open(self.token_path, os.O_RDONLY)
            try:
                data = json.loads(os.pread(fd, 1 << 16, 0))
            finally:
                os.close(fd)
            token = data["token"]
            if type(token) is not int or token < 0:
                raise ValueError
            return token, data.get("holder") if type(data.get("holder")) is dict else None
        except FileNotFoundError:
            return 0, None
        except (ValueError, KeyError, TypeError):
            raise IntegrityError(f"{self.token_path} is not a fencing token written by ckptstore (damaged); "
                                 "delete it only when no process writes the run") from None

    def _advance(self) -> None:
        """Issue the next token to this holder (under the flock), inside a catalog write
        transaction when the store has a catalog (the barrier against moves in flight)."""
        try:
            cat = self.store.catalog
        except NotAStoreError:
            cat = None
        if cat is not None and not cat.writable:
            raise PermissionError("the store is read-only here")  # (as a lock file that cannot be written: no lease)
        with cat.write() if cat is not None else nullcontext():
            token = self._read_token()[0] + 1
            tmp = self.folder / f"{self.token_path.name}.{uuid.uuid4().hex}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, json.dumps({"token": token, "holder": self.holder}).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.token_path)
            fsync_dir(self.folder)
            self.token = token

    def _poll(self) -> None:
        if self.lost is None and self.token:
            token, by = self._read_token()
            if token != self.token:
                self._taken_over(token, by)

    def check(self) -> None:
        """Raises RunTakenOverError if a newer token was issued for the run (read from
        ``leases/<run>.token``), RunBusyError if this lease was released."""
        self._poll()
        super().check()

    @contextmanager
    def guard(self, moves: list[dict]):
        """Inside the catalog transaction that moves the tags: the run's token must still be this holder's."""
        token, by = self._read_token()
        if token != self.token:
            raise self._taken_over(token, by)
        yield

    def release(self) -> None:
        with FileLease._lock:
            if self.fd is not None:
                os.close(self.fd)  # drops the flock
                self.fd = None
            if FileLease._held.get(self.path) is self:
                del FileLease._held[self.path]


class BucketLease(Lease):
    """A lease on object storage, which has no lock a killed process drops: the run's
    **token cell** ``leases/<run>/fence`` (:meth:`~ckptstore.backends.Backend.cas_cell`:
    a small object moved only by conditional PUT, ``If-Match``), holding ``{"token",
    "holder", "intent"}``. It is never deleted: a release writes ``holder: null`` and keeps
    the token, so the token only grows over the run's whole life.

    Taking the run is one conditional write of the cell from the version read, to
    ``token + 1`` (of two processes, one wins). The holder renews by rewriting the cell
    every ``seconds / 3``, conditional on the version it last wrote, so a renewal of a
    taken-over holder fails (and is never seen as life by a claimant). A holder whose cell
    is older than ``seconds`` by the bucket's clock has expired. Acquiring watches the cell:
    one that changes is a live holder (refused at once, within about ``seconds / 3``), one
    that does not is waited for until it expires (a restarted job after a kill waits at
    most ``seconds``); a released one is taken at once.

    Every fenced tag move first writes its moves (``intent``) into the cell, conditional on
    the holder's version, then makes them; a new holder completes the intent of the version
    it replaced before it reads anything (each completion is the same conditional write of
    the tag from the version recorded, so exactly one of the two lands). So a taken-over
    holder's moves either happened before the takeover or never (docs/design.md)."""

    _held: dict[str, BucketLease] = {}  # url/prefix -> the lease this process holds there
    _lock = threading.Lock()

    def __init__(self, store, run: str | None, seconds: float):
        super().__init__(store, run, seconds)
        if not isinstance(seconds, (int, float)) or not seconds > 0:
            raise InvalidArgumentError(f"lease_seconds must be a number of seconds > 0, got {seconds!r}")
        self.store = store
        self.backend, self.seconds = store.backend, float(seconds)
        self.prefix = f"leases/{_segment(run)}"
        self.key = f"{self.prefix}/fence"
        self.gen: int | None = None
        self.version: str | None = None  # the cell's version as this holder last wrote it
        self._cell = threading.Lock()  # one write of the cell at a time (renewals, moves)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url_key(self) -> str:
        return f"{self.backend.url}/{self.prefix}"

    def _payload(self, token: int, holder: dict | None, intent: list | None = None) -> bytes:
        return json.dumps({"token": token, "holder": holder, "intent": intent}, sort_keys=True).encode()

    def _read(self) -> tuple[dict, str, float] | None:
        """``(cell, version, mtime)`` now, or ``None`` before any token was issued."""
        got = self.backend.read_cell(self.key)
        if got is None:
            return None
        try:
            data = json.loads(got[0])
            if type(data) is not dict or type(data.get("token")) is not int:
                raise ValueError
        except ValueError:
            raise IntegrityError(f"{self.backend.url}: {self.key} is not a run's token cell written by ckptstore (damaged)") from None
        return data, got[1], got[2]

    def acquire(self) -> None:
        key = self.url_key
        with BucketLease._lock:
            previous = BucketLease._held.get(key)
            own = None
            if previous is not None and previous.gen is not None:  # this process: the newer Checkpointer takes over
                own = previous.gen
            else:  # a lease this process abandoned (its Checkpointer was dropped): still this process's
                previous = None
                mine = [i for i, (lease, _) in enumerate(_ABANDONED) if lease.url_key == key]
                if mine:
                    own = _ABANDONED.pop(mine[-1])[1]
        self._take(own)
        with BucketLease._lock:
            if previous is not None:
                previous._taken_over(self.gen, self.holder, here=True)
                previous._stop.set()
                previous.gen = None
            BucketLease._held[key] = self
        self._thread = threading.Thread(target=self._renew, name="ckptstore-lease", daemon=True)
        self._thread.start()

    def _take(self, own: int | None) -> None:
        """Issue the next token to this holder: wait for the holder of the current one to
        release or expire (``own``: this process holds it), then one conditional write."""
        got = self._read()
        if got is None:
            legacy = self._wait_legacy()
            token = max(legacy, default=0) + 1
            try:
                self.version = self.backend.cas_cell(self.key, self._payload(token, self.holder), None)
            except RefConflictError:
                raise self._busy(self._read()) from None  # another process took it first
            self.gen = self.token = token
            for key in (k for keys in legacy.values() for k in keys):
                self.backend.delete(key)
            return
        data, version, _ = got
        if data.get("holder") is not None and data["token"] != own:
            data, version = self._wait_expired(got)
        for attempt in range(5):
            try:
                self.version = self.backend.cas_cell(self.key, self._payload(data["token"] + 1, self.holder), version)
                break
            except RefConflictError:
                got = self._read()
                if got is None or got[0]["token"] != own or attempt == 4:  # (this process's older holder wrote it meanwhile: again)
                    raise self._busy(got) from None  # renewed, or taken by another process first
                data, version, _ = got
        self.gen = self.token = data["token"] + 1
        self._complete(data.get("intent"))

    def _complete(self, intent) -> None:
        """Make the moves the previous holder recorded before its last one (each from the
        version it recorded: the previous holder's own write of it, if it was sent, and this
        one are the same conditional write, and one of them lands)."""
        if type(intent) is not list:
            return
        for m in intent:
            try:
                self.store.refs.swap(m["tag"], m.get("old"), m.get("version"), m.get("new"), m.get("action") or "commit", m.get("packs") or [])
            except RefConflictError:
                pass  # made already (by its holder), or moved on since
            except (KeyError, TypeError, AttributeError):
                continue

    def _wait_expired(self, got: tuple[dict, str, float]) -> tuple[dict, str]:
        """The cell once its holder released it or expired. A holder that renews meanwhile is
        alive: RunBusyError, within about a third of ``seconds``; a killed one is waited for
        until ``seconds`` after its last renewal (by the bucket's clock)."""
        data, version, mtime = got
        while True:
            if data.get("holder") is None:
                return data, version
            age = self.backend.now() - mtime
            if age >= self.seconds:
                return data, version
            time.sleep(min(self.seconds / 6, self.seconds - age + 0.1))
            now = self._read()
            if now is None or now[1] != version:
                raise self._busy(now)  # it renewed (or was taken) while this one waited
            data, version, mtime = now

    def _wait_legacy(self) -> dict[int, list[str]]:
        """(Buckets written before token cells) ``{generation: [keys]}`` of the numbered lease
        objects ``leases/<run>/<gen>[.<beat>]``, once the newest has expired."""
        seen = None
        while True:
            gens: dict[int, list] = {}
            for o in self.backend.list(self.prefix):
                head = o.key.rsplit("/", 1)[1].split(".", 1)[0]
                if head.isdigit():
                    gens.setdefault(int(head), []).append(o)
            if not gens:
                return {}
            newest = max(gens)
            state = (newest, frozenset(o.key for o in gens[newest]))
            if seen is not None and state != seen:
                raise RunBusyError(f"{self.where} is being written by another live Checkpointer (of an older ckptstore version)")
            seen = state
            age = self.backend.now() - max(o.mtime for o in gens[newest])
            if age >= self.seconds:
                return {g: [o.key for o in objs] for g, objs in gens.items()}
            time.sleep(min(self.seconds / 6, self.seconds - age + 0.1))

    def _busy(self, got) -> RunBusyError:
        holder = got[0].get("holder") if got is not None else None
        return RunBusyError(
            f"{self.where} is being written by another live Checkpointer: {_holder_text(holder)} "
            f"(it renews its lease every {self.seconds / 3:.3g} s). "
            "Stop that process, or give this one its own run: Checkpointer(..., run='<name>')"
        )

    def _write(self, holder: dict | None, intent: list | None = None) -> None:
        """Rewrite the cell (same token), conditional on this holder's last version; with
        ``self._cell`` held. Raises RunTakenOverError when the cell moved on without it."""
        gen = self.gen
        if gen is None:
            raise self._taken_over(self.newer, None) if self.newer is not None else RunBusyError(f"{self.where}: this lease was released")
        for attempt in range(2):
            try:
                self.version = self.backend.cas_cell(self.key, self._payload(gen, holder, intent), self.version)
                return
            except RefConflictError:
                got = self._read()
                data = got[0] if got is not None else {}
                if attempt == 0 and data.get("token") == gen:  # (only the holder of token gen writes it)
                    self.version = got[1]  # our own write whose outcome was unknown (a BackendError) landed: go on from it
                    continue
                self._stop.set()
                raise self._taken_over(data.get("token"), data.get("holder")) from None

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            if self.gen is None:
                return
            try:
                with self._cell:
                    self._write(self.holder)
            except RunBusyError:
                return  # taken over (or released): its renewals end here
            except Exception:  # noqa: BLE001 - the next beat tries again; a takeover is what check() reports
                continue

    def _poll(self) -> None:
        """Notes in :attr:`lost` a newer token in the cell (one small GET)."""
        gen = self.gen
        if self.lost is None and gen is not None:
            got = self._read()
            if got is None or got[0]["token"] != gen:
                self._taken_over(None if got is None else got[0]["token"], None if got is None else got[0].get("holder"))
                self._stop.set()

    def check(self) -> None:
        """Raises RunTakenOverError if the run's token moved past this holder's (it was
        taken over), RunBusyError if the lease was released or superseded in this process."""
        self._poll()
        super().check()

    @contextmanager
    def guard(self, moves: list[dict]):
        """Record ``moves`` in the cell (conditional on this holder's version: fails once a
        newer token was issued), then let the caller make them, the cell held meanwhile."""
        with self._cell:
            self._write(self.holder, [{k: m.get(k) for k in ("tag", "old", "version", "new", "action", "packs")} for m in moves])
            yield

    def release(self) -> None:
        self._stop.set()
        with BucketLease._lock:
            gen = self.gen
            if BucketLease._held.get(self.url_key) is self:
                del BucketLease._held[self.url_key]
        if gen is not None and os.getpid() == self.holder["pid"]:  # (a forked child's copy: the lease is its parent's)
            self._free()
        self.gen = None

    def _free(self) -> None:
        """Write the cell released (the token stays), if this holder still holds it."""
        try:
            with self._cell:
                if self.gen is not None:
                    self._write(None)
        except Exception:  # noqa: BLE001 - (taken over, the store was closed first, or the bucket failed) it expires by itself
            pass

    def abandon(self) -> None:
        self._stop.set()
        with BucketLease._lock:
            gen = self.gen
            if BucketLease._held.get(self.url_key) is self:
                del BucketLease._held[self.url_key]
        if gen is not None and os.getpid() == self.holder["pid"]:
            _ABANDONED.append((self, gen))


_ABANDONED: list[tuple[BucketLease, int]] = []  # bucket leases given up by finalizers: released at exit


@atexit.register
def _delete_abandoned() -> None:
    while _ABANDONED:
        lease, gen = _ABANDONED.pop()
        if os.getpid() == lease.holder["pid"] and lease.gen == gen:
            lease._free()


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
