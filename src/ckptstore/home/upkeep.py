"""What a home provides to the maintenance protocols, and what it reports to them: the
primitives of GC (:class:`GCSide`, :class:`PackStat`, :class:`GCReport`, the folder's
``gc.lock``: :func:`gc_lock`, :func:`unlocked`) and of fsck (:class:`FsckSide`,
:class:`FsckReport`). The protocols themselves (every decision, the mapping of damage to
commits and tags) are written once above the homes, in :mod:`ckptstore.protocols.gc` and
:mod:`ckptstore.protocols.fsck`; each home implements its sides (:class:`ckptstore.home.local.LocalGC`,
:class:`ckptstore.home.local.LocalFsck`, :class:`ckptstore.home.bucket_upkeep.BucketGC`,
:class:`ckptstore.home.bucket_upkeep.BucketFsck`). This module is in the home layer
(``home/upkeep`` in the package tree) and imports nothing above it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import GCLockedError, StoreWriteError
from ..objects.packs import PACK_HEADER

#: Seconds: the grace period of a GC on a folder when none is given.
DEFAULT_GRACE = 3600.0


# --- GC ---------------------------------------------------------------------------------------


@dataclass
class GCReport:
    """What a GC run freed (or, with ``dry_run``, would free).

    Byte counts are bytes on disk (in the bucket). ``bytes_freed`` is the net number of
    bytes the home lost in this run: the packs (and, on a bucket, their ``.idx`` and the
    commit records), orphans and temporary files deleted, less the packs (and ``.idx``) the
    run wrote to hold the live entries it copied out of half-dead and small packs; so it can
    be negative while the deleted packs wait for the grace period. ``commits_pending``,
    ``blobs_pending`` and ``bytes_pending`` count what waits for the grace period:
    what a run with a grace period of 0 (``--grace 0 --dry-run``) would drop
    beyond what this run drops (commits, blobs, bytes freed); 0 with a grace period of 0.
    Both homes fill the same fields (:func:`pending`).
    """

    dry_run: bool
    commits_dropped: int = 0
    blobs_deleted: int = 0
    blob_bytes: int = 0  # stored bytes (headers included) of the deleted blob rows
    packs_repacked: int = 0  # half-dead packs rewritten (live bytes below ``repack_below`` of their size)
    packs_consolidated: int = 0  # small packs (below ``small_pack_bytes``) merged into large ones
    packs_deleted: int = 0
    orphans_removed: int = 0
    indexes_repaired: int = 0  # object storage: missing or damaged pack indexes rebuilt from their packs
    reflog_removed: int = 0  # object storage: ref-move records whose commits were all dropped
    tmp_removed: int = 0
    bytes_freed: int = 0
    commits_pending: int = 0
    blobs_pending: int = 0
    bytes_pending: int = 0
    dropped: list[str] = field(default_factory=list)
    withheld: list[str] = field(default_factory=list)  # what this run would not collect, and why
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class PackStat:
    """One pack as a home reports it to the protocol (:meth:`GCSide.packs`), with the
    victims gone. Sizes in bytes (entry headers included), times on the home's clock.

    ``n``/``live``: the live entries held only here (another, unmarked pack's copy of a blob
    does not keep this one); ``dies_now``/``dies_now_bytes``: blobs that die in this run
    whatever becomes of the pack (locally the rows :meth:`GCSide.drop` deletes);
    ``dies_with``/``dies_with_bytes``: blobs that die only with the pack (on a bucket);
    ``freed``: bytes deleting it frees (on a bucket with its ``.idx``); ``keep``: never
    collected (cannot be read, or what it holds cannot be known)."""

    id: str
    size: int
    created: float
    marked: float | None
    n: int
    live: int
    freed: int
    dies_now: int = 0
    dies_now_bytes: int = 0
    dies_with: int = 0
    dies_with_bytes: int = 0
    keep: bool = False


class GCSide:
    """The primitives a home provides to the protocol (the home's ``gc_side()``);
    every decision is made in :mod:`ckptstore.protocols.gc`, from what they report.

    Attributes:
        default_grace: the grace period (seconds) when ``grace`` is None.
        clock_step: seconds an object's time may lie behind its real age (whole seconds on S3);
            a grace period above 0 waits that much longer.
    """

    default_grace = DEFAULT_GRACE
    clock_step = 0.0

    def lock(self, dry_run: bool):
        """A context manager excluding a second GC (GCLockedError), or nothing where none is needed."""
        raise NotImplementedError

    def now(self, fresh: bool) -> float:
        """The home's clock (seconds since the epoch); ``fresh``: read the home's state again
        (the sweep's re-read), else the state of this run's first read."""
        raise NotImplementedError

    def snapshot(self):
        """A context manager over one consistent read of the index, for :meth:`ckptstore.protocols.gc.Collector.retained`."""
        raise NotImplementedError

    def commits(self, keep: set) -> dict:
        """``{commit id: (time, marked, bytes)}`` of every commit the home holds: its age on the
        home's clock, when a mark took it (None: not marked) and the bytes deleting it frees
        (0 where its record lives in a pack); ``keep``: what retention keeps."""
        raise NotImplementedError

    def packs(self, keep: set, victims: list, cutoff: float) -> list[PackStat]:
        """Every pack, as if ``victims`` were dropped and the blobs that then die (older than ``cutoff``) gone."""
        raise NotImplementedError

    def busy(self, pack: str) -> bool:
        """Whether a running writer holds ``pack`` (it is not copied now)."""
        return False

    def withheld(self) -> list[str]:
        """What the state read keeps this run from collecting, and why."""
        return []

    def drop(self, c: Any, victims: list, cutoff: float, report: GCReport) -> None:
        """(``c``: the run, a :class:`ckptstore.protocols.gc.Collector`.) Take the victims out of the index now where the home can do so at once (and the
        blobs that then die, older than ``cutoff``), adding them to ``report.dropped``; in a
        dry run only add them. A home that cannot leaves them to :meth:`mark`."""

    def room(self) -> int | None:
        """Bytes free for copies, or None when unbounded."""
        return None

    def copy_size(self, batch: list[PackStat]) -> int:
        """Bytes :meth:`copy` of ``batch`` writes."""
        raise NotImplementedError

    def copy(self, batch: list[PackStat], report: GCReport) -> int:
        """Copy the live entries of ``batch`` into new packs, verified; returns the bytes written."""
        raise NotImplementedError

    def mark(self, plan: Any, report: GCReport) -> None:
        """Mark the packs of ``plan`` (a :class:`ckptstore.protocols.gc.Plan`) (and what else dies with the victims) at this run's time."""
        raise NotImplementedError

    def delete(self, commits: list[str], packs: list[PackStat], token, report: GCReport) -> tuple[list, list] | None:
        """Delete the swept commits and packs (each still unneeded when deleted) and the marks
        swept; returns those deleted, or None, deleting nothing, when a ref moved since
        ``token`` (the sweep starts over)."""
        raise NotImplementedError

    def refs_token(self):
        """A value that changes whenever a ref moves, as of the state last read (:meth:`now`)."""
        raise NotImplementedError

    def anything_due(self, cutoff: float) -> bool:
        """Whether a mark older than ``cutoff`` may be waiting (else the sweep's second read is skipped)."""
        return True

    def leftovers(self, cutoff: float, own_due: bool, report: GCReport) -> None:
        """Remove (count, in a dry run) what the home leaves beside packs and commits: orphans,
        stale temporary files, marks' other objects; ``own_due``: this run's mark is swept now."""


def packed(sizes: list[int], pack_bytes: int) -> list[tuple[int, int]]:
    """``(entries, bytes)`` of each pack a pack writer fills with entries of ``sizes`` bytes
    (a pack rolls over once the next entry would pass ``pack_bytes``)."""
    out: list[list[int]] = []
    for s in sizes:
        if not out or (out[-1][0] and out[-1][1] + s > pack_bytes):
            out.append([0, PACK_HEADER.size])
        out[-1][0] += 1
        out[-1][1] += s
    return [(n, size) for n, size in out]


@contextmanager
def gc_lock(root: Path, read_only_ok: bool = False):
    """Hold ``<store>/gc.lock``; raise GCLockedError if another GC has it.

    On a store that cannot be written, ``read_only_ok`` (a dry run) goes on
    without the lock; otherwise StoreWriteError says the store is read-only.
    """
    try:  # (no link followed, no FIFO waited on: invariant 13)
        fd = os.open(root / "gc.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file")
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EINVAL, errno.ENXIO):
            raise StoreWriteError(f"{root / 'gc.lock'} is {'a symbolic link' if exc.errno == errno.ELOOP else 'not a regular file'}, "
                                  "not made by ckptstore: remove it (GC and recover lock the store with it)") from None
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC):
            raise
        if read_only_ok:
            yield
            return
        raise StoreWriteError(f"{root} is read-only here ({exc.strerror}): a GC cannot run; `gc --dry-run` reports") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise GCLockedError(f"{root}: another GC is running on this store") from None
            raise
        yield
    finally:
        os.close(fd)


def unlocked(path: Path) -> int | None:
    """An fd holding an exclusive lock on ``path``, or None if a running commit holds it (or it
    is gone, or is not a regular file: a link, FIFO, socket or device is left alone)."""
    try:  # a link, FIFO, socket or device is not a pack: never followed, opened or locked (invariant 13)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC) if stat.S_ISREG(os.lstat(path).st_mode) else None
    except OSError:
        return None
    if fd is None:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


# --- fsck -------------------------------------------------------------------------------------


@dataclass
class FsckReport:
    """Result of :func:`ckptstore.protocols.fsck.check`. ``ok`` is false when ``problems`` is not empty."""

    problems: list[str] = field(default_factory=list)
    missing_blobs: list[str] = field(default_factory=list)  # addresses of needed blobs no pack holds whole (each once)
    corrupt_blobs: list[str] = field(default_factory=list)  # addresses of reread blobs whose header or hash is wrong
    damaged_commits: list[str] = field(default_factory=list)
    damaged_tags: list[str] = field(default_factory=list)
    orphan_packs: list[str] = field(default_factory=list)
    orphan_commits: list[str] = field(default_factory=list)  # object storage: records no tag reaches whose blobs are gone (GC drops them)
    damaged_packs: list[str] = field(default_factory=list)  # packs that cannot be read or walked
    damaged_indexes: list[str] = field(default_factory=list)  # object storage: packs whose .idx is damaged (a problem)
    missing_indexes: list[str] = field(default_factory=list)  # object storage: needed packs without .idx (walked instead; not a problem)
    damaged_reflog: list[str] = field(default_factory=list)  # object storage: reflog objects that are not ref-move records
    damaged_marker: bool = False  # object storage: ckptstore.json fails its check
    repaired: list[str] = field(default_factory=list)  # what ``repair`` rebuilt (object keys)
    marked_bad: int = 0  # blobs newly marked bad in the index (dedup never reuses them; the next commit of their bytes writes a good copy)
    replaced_blobs: list[str] = field(default_factory=list)  # addresses whose bad copy ``repair`` replaced by a good one found in a pack
    unreferenced_blobs: int = 0
    tmp_files: int = 0
    # a folder: entries ckptstore did not make (a symbolic link, FIFO, socket, device, a stray file), one line each,
    # e.g. "blobs/zz is a symbolic link, not made by ckptstore"; left alone by GC, never followed (not a problem)
    foreign: list[str] = field(default_factory=list)
    commits: int = 0  # commits checked, damaged ones included
    blobs_checked: int = 0  # blobs reread and rehashed (each once), intact or not
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


class FsckSide:
    """The primitives a home provides to the protocol (its ``fsck_side()``); every check and
    the mapping of damage to commits and tags is made in :mod:`ckptstore.protocols.fsck`, from
    what they report. ``report`` arguments are the run's :class:`FsckReport`, to which a
    primitive adds what only it can see.

    Attributes:
        location: where the store lives, for messages.
        attempts_leave_records: whether a commit's record may exist before its ref moves
            (then a record no tag reaches whose blobs are gone is an orphan, not damage).
    """

    location = ""
    attempts_leave_records = False

    def start(self, repair: bool) -> None:
        """Before any read: the refusals (e.g. ``repair`` where there is nothing to repair)."""
        raise NotImplementedError

    def resolve(self, ref: str) -> str:
        """The commit id that ``ref`` (a tag or a commit id) names, for ``verify``."""
        raise NotImplementedError

    def snapshot(self):
        """A context manager over one consistent read of :meth:`tags`, :meth:`commits` and :meth:`locate`."""
        raise NotImplementedError

    def tags(self, report: FsckReport) -> dict[str, str]:
        """``{tag: commit id}``; a malformed ref is reported as a damaged tag."""
        raise NotImplementedError

    def commits(self, report: FsckReport, ids: list[str] | None, deep: bool) -> dict:
        """``{commit id: CommitRecord, or None when damaged}`` of ``ids`` (every commit when None)."""
        raise NotImplementedError

    def locate(self, report: FsckReport, keys: list[tuple[bytes, int]], deep: bool, repair: bool) -> dict:
        """``{address: BlobLoc}`` of the blobs of ``keys`` the home holds (absent: in no pack)."""
        raise NotImplementedError

    def read(self, locs: list, reread: set):
        """Yield ``(loc, error or None)``: a BlobMissingError for a blob of ``locs`` whose pack
        does not hold it, and each of ``reread`` (addresses) reread and rehashed."""
        raise NotImplementedError

    def extra(self, report: FsckReport, ids: list[str], whole: bool, deep: bool, repair: bool) -> None:
        """The checks only this home has (``whole``: of the whole store; ``ids``: the commits checked)."""
        raise NotImplementedError

    def replace_bad(self, report: FsckReport, locs: list):
        """With ``repair``: for each bad copy of ``locs`` (BlobLocs that failed), look for another
        copy of the same address in the home's packs, verify it and point the index at it; yield
        ``(loc, good loc)`` for each one replaced. Here: none (a home without it)."""
        return iter(())


__all__ = ["DEFAULT_GRACE", "FsckReport", "FsckSide", "GCReport", "GCSide", "PackStat", "gc_lock", "packed", "unlocked"]
