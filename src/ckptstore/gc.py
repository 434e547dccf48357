"""Garbage collection on both homes: one entry (:func:`collect`), one report (:class:`GCReport`),
one set of rules (retention :meth:`Collector.retained`, the pack rules :func:`pack_kind` and
:func:`choose_repacks`, what is :func:`pending`); the home's side does the rest: :class:`LocalGC`
here (below), :class:`ckptstore.bucketgc.BucketGC` on object storage (mark and sweep).

The local protocol (``shared/design/ARCHITECTURE.md``, GC section), as built:

1. **Lock.** An exclusive ``flock`` on ``<store>/gc.lock``; a second GC fails at
   once with :class:`~ckptstore.errors.GCLockedError`.
2. **Commits.** Roots are every tag, plus what retention keeps: the ``keep_last``
   newest commits of each tag's lineage, the whole lineage of tags matching a
   ``keep_tags`` glob, commits younger than ``keep_within`` and, always, commits
   younger than the grace period. Other commits are dropped from the catalog in
   batches; each batch's write transaction first checks that no tag moved since the
   roots were computed and computes them again if one did, so a tag moved meanwhile
   is honoured. The roots cost O(n log n) in the commits n, and each batch a few
   indexed statements, so a GC grows as n log n (``benchmarks/scale.py``).
3. **Blobs.** Rows no remaining manifest references and created before the grace
   period are deleted in batches (one walk in id order), each in one write transaction. A commit's final
   transaction holds the same write lock and re-checks every blob it reuses, so
   the two cannot interleave (invariant 4).
4. **Packs.** A pack with no live blob is retired. A pack whose live fraction is
   below ``repack_below`` (half-dead), and every pack smaller than
   ``small_pack_bytes`` (when there are two or more to rewrite), older than the grace
   period and held by no running commit (``flock``), has its live blobs and records
   copied (verified) into new durable packs of up to ``pack_bytes``, the rows repointed
   in one transaction per batch, and is retired: so the pack count follows the data,
   not the number of commits (two small packs each). A retired pack
   file is unlinked only once it has been retired for the grace period, so a
   reader that looked a blob up just before still finds it. Files are unlinked
   500 per transaction, and each folder fsynced once at the end (a file a power
   cut brings back has no row: an orphan, removed by the next GC).
5. **Leftovers.** Pack files without a catalog row (a crashed commit) and files in
   ``tmp/`` are removed when older than the grace period and not locked by a
   running commit (commits hold a ``flock`` on their packs until they return).
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import heapq
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from . import progress
from .errors import GCLockedError, InvalidArgumentError, StoreWriteError
from .packs import BLOB_HEADER, CODEC_RAW, RECORD_MAGIC, BlobLoc, PackReader, PackWriter, fsync_dir, pack_path
from .records import KIND_COMMIT, KIND_REF

DEFAULT_GRACE = 3600.0
REPACK_BELOW = 0.5
#: Packs smaller than this (bytes) are merged into large ones by GC (at most half the store's ``pack_bytes``).
SMALL_PACK_BYTES = 4 << 20
_BATCH_COMMITS = 500
_BATCH_BLOBS = 2000
_BATCH_PACKS = 500
# Ref-move records that a newer move of the same tag supersedes (recovery needs only the newest).
_SUPERSEDED = f"kind = {KIND_REF} AND seq < (SELECT MAX(r.seq) FROM records r WHERE r.kind = {KIND_REF} AND r.name = records.name)"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str | float) -> float:
    """Seconds from ``"90s"``, ``"15m"``, ``"1h"``, ``"2d"``, ``"1w"``, ``"0"`` or a number.

    Raises:
        InvalidArgumentError: anything else, or a negative value.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise InvalidArgumentError(f"invalid duration {text!r}: must not be negative")
        return float(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(text))
    if not m:
        raise InvalidArgumentError(f"invalid duration {text!r}: use a number with s, m, h, d or w (e.g. 30m, 1h, 7d)")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def check_glob(pattern: str) -> str:
    """Validate a tag glob (fnmatch syntax). Raises InvalidArgumentError."""
    if type(pattern) is not str or not pattern.strip() or any(c in pattern for c in "\x00\n\r"):
        raise InvalidArgumentError(f"invalid tag glob {pattern!r}")
    if pattern.count("[") != pattern.count("]"):
        raise InvalidArgumentError(f"invalid tag glob {pattern!r}: unbalanced brackets")
    return pattern


@dataclass
class GCReport:
    """What a GC run freed (or, with ``dry_run``, would free).

    Byte counts are bytes on disk (in the bucket): ``bytes_freed`` counts pack and
    temporary files (objects) deleted in this run. ``commits_pending``,
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


def pack_kind(size: int, live: int, n: int, repack_below: float, small_pack_bytes: int) -> str | None:
    """What a GC does with a pack older than the grace period, on either home: ``"dead"`` (no
    live entry: deleted), ``"half"`` (live bytes below ``repack_below`` of ``size``: its live
    entries are copied out, then it goes), ``"small"`` (below ``small_pack_bytes``: merged into
    large ones, if :func:`choose_repacks` takes it) or None (kept). Sizes in bytes."""
    if n <= 0:
        return "dead"
    if live < repack_below * size:
        return "half"
    if size < small_pack_bytes:
        return "small"
    return None


def choose_repacks(half: list, small: list) -> tuple[list, list]:
    """``(half-dead, small)`` packs to rewrite: the small ones only when there are at least two
    packs to rewrite (one alone would gain nothing)."""
    return half, small if len(half) + len(small) >= 2 else []


@contextmanager
def gc_lock(root: Path, read_only_ok: bool = False):
    """Hold ``<store>/gc.lock``; raise GCLockedError if another GC has it.

    On a store that cannot be written, ``read_only_ok`` (a dry run) goes on
    without the lock; otherwise StoreWriteError says the store is read-only.
    """
    try:
        fd = os.open(root / "gc.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
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


def _unlocked(path: Path) -> int | None:
    """An fd holding an exclusive lock on ``path``, or None if a running commit holds it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


class Collector:
    """One GC run over ``store`` (see the module docstring)."""

    def __init__(self, store, keep_last: int, keep_tags: list[str], keep_within: float | None, grace: float, repack_below: float,
                 small_pack_bytes: int = SMALL_PACK_BYTES):
        if type(keep_last) is not int or keep_last < 0:
            raise InvalidArgumentError(f"invalid keep-last {keep_last!r}: must be a whole number >= 0")
        if not 0 <= repack_below <= 1:
            raise InvalidArgumentError(f"invalid repack threshold {repack_below!r}: must be within [0, 1]")
        if type(small_pack_bytes) is not int or small_pack_bytes < 0:
            raise InvalidArgumentError(f"invalid small-pack size {small_pack_bytes!r}: must be a whole number of bytes >= 0")
        self.store = store
        self.cat = store.catalog
        self.options = (keep_last, keep_tags, keep_within, repack_below, small_pack_bytes)
        # a merged pack of up to pack_bytes must not count as small again (or every run rewrites it)
        self.small_pack_bytes = min(small_pack_bytes, store.pack_bytes // 2)
        self.keep_last = max(keep_last, 1)
        self.keep_tags = [check_glob(g) for g in keep_tags]
        self.keep_within = 0.0 if keep_within is None else parse_duration(keep_within)
        self.grace = parse_duration(grace)
        self.repack_below = repack_below
        self.now = time.time()
        self.doomed: dict[str, tuple[int, int]] = {}  # dry run: pack -> (entries, bytes) the real run would delete
        self.repacked_now: set[str] = set()  # dry run: packs the real run would repack (and so retire now)

    def at_grace_0(self) -> Collector:
        """The same run with a grace period of 0 (what :func:`pending` compares with)."""
        keep_last, keep_tags, keep_within, repack_below, small_pack_bytes = self.options
        return Collector(self.store, keep_last, keep_tags, keep_within, 0.0, repack_below, small_pack_bytes)

    # --- commits -----------------------------------------------------------------------

    def retained(self) -> set[str]:
        """Commit ids the roots and the retention policy keep (run inside a transaction).

        O(n log n) in the number of commits n (plus ``keep_last`` steps per tag): the
        ``keep_last`` newest commits of a lineage are found by a best-first walk from
        the tag, newest first, that stops as soon as no older step can hold a newer one.
        """
        rows = self.cat.rows("SELECT id, created_at FROM commits ORDER BY created_at, id", raw=True)
        created = {c: rank for rank, (c, _) in enumerate(rows)}  # newer: higher rank (ties by id)
        parents: dict[str, list[str]] = {}
        for c, p in self.cat.rows("SELECT commit_id, parent_id FROM parents ORDER BY commit_id, position", raw=True):
            if p in created and c in created:  # (rows of a commit made after the read above, by a caller outside one snapshot)
                parents.setdefault(c, []).append(p)
        newest = self._newest_ancestor(created, parents)
        tags = self.cat.rows("SELECT name, commit_id FROM tags", raw=True)
        keep: set[str] = set()
        whole: set[str] = set()  # the lineages of keep_tags matches, walked once for all of them
        for name, cid in tags:
            keep.add(cid)
            if cid not in created:
                continue
            if any(fnmatch.fnmatchcase(name, g) for g in self.keep_tags):
                frontier = [cid]
                while frontier:
                    c = frontier.pop()
                    if c not in whole:
                        whole.add(c)
                        frontier += parents.get(c, ())
            else:
                keep.update(self._newest_of_lineage(cid, created, parents, newest))
        keep |= whole
        young = self.now - max(self.keep_within, self.grace)
        keep.update(c for c, t in rows if t > young)
        return keep

    @staticmethod
    def _newest_ancestor(created: dict, parents: dict) -> dict:
        """``{commit: the highest rank (newest) of it and its ancestors}``. Commits are made
        after their parents, so that is the commit itself (one pass over the edges); a store
        with a parent newer than its child (a clock stepped back) gets a full walk."""
        if all(created[p] <= created[c] for c, ps in parents.items() for p in ps):
            return created
        best: dict = {}
        for root in created:
            stack = [(root, False)]
            while stack:
                c, done = stack.pop()
                if c in best:
                    continue
                if done:
                    best[c] = max([created[c], *(best[p] for p in parents.get(c, ()))])
                    continue
                stack.append((c, True))
                stack += [(p, False) for p in parents.get(c, ()) if p not in best]
        return best

    def _newest_of_lineage(self, cid: str, created: dict, parents: dict, newest: dict) -> list[str]:
        """The ``keep_last`` newest commits of ``cid``'s lineage (itself and its ancestors)."""
        found: list[tuple[int, str]] = []  # min-heap of the keep_last newest (rank, id) seen
        heap = [(-newest[cid], cid)]  # to walk, newest ancestor first
        seen = {cid}
        while heap:
            if len(found) == self.keep_last and -heap[0][0] <= found[0][0]:
                break  # nothing left to walk is newer than the keep_last found
            _, c = heapq.heappop(heap)
            if len(found) < self.keep_last:
                heapq.heappush(found, (created[c], c))
            elif created[c] > found[0][0]:
                heapq.heapreplace(found, (created[c], c))
            for p in parents.get(c, ()):
                if p not in seen:
                    seen.add(p)
                    heapq.heappush(heap, (-newest[p], p))
        return [c for _, c in found]

    def _tag_state(self) -> tuple:
        """Changes whenever a tag moves, is created or deleted (what :meth:`retained` depends
        on besides commits, which only ever get added, young)."""
        return (*self.cat.rows("SELECT MAX(id) FROM reflog", raw=True)[0],
                *self.cat.rows("SELECT COUNT(*), MAX(updated_at), TOTAL(updated_at) FROM tags", raw=True)[0])

    def drop_commits(self, report: GCReport) -> None:
        """Drop the commits outside :meth:`retained`, ``_BATCH_COMMITS`` per write transaction;
        each transaction first checks that no tag moved since the roots were computed (else
        they are computed again)."""
        if report.dry_run:
            with self.cat.read():
                keep = self.retained()
                victims = [c for (c,) in self.cat.rows("SELECT id FROM commits ORDER BY created_at", raw=True) if c not in keep]
            report.dropped += victims
            self._doom(
                f"SELECT pack, COUNT(*), SUM(stored_len + {BLOB_HEADER.size}) FROM records WHERE "
                f"(kind = {KIND_COMMIT} AND name IN (SELECT id FROM gc_dropped)) OR ({_SUPERSEDED}) GROUP BY pack",
                victims,
            )
            report.commits_dropped = len(report.dropped)
            return
        victims: list[str] = []
        state = None
        while True:
            with self.cat.write():
                if state is None or self._tag_state() != state:
                    state = self._tag_state()
                    keep = self.retained()
                    victims = [c for (c,) in self.cat.rows("SELECT id FROM commits ORDER BY created_at", raw=True) if c not in keep]
                batch, victims = victims[:_BATCH_COMMITS], victims[_BATCH_COMMITS:]
                self.cat.chunked("DELETE FROM shards WHERE leaf_id IN (SELECT id FROM leaves WHERE commit_id IN ({}))", batch)
                for table in ("leaves", "components", "parents"):
                    self.cat.chunked(f"DELETE FROM {table} WHERE commit_id IN ({{}})", batch)
                self.cat.chunked(f"DELETE FROM records WHERE kind = {KIND_COMMIT} AND name IN ({{}})", batch)
                self.cat.chunked("DELETE FROM commits WHERE id IN ({})", batch)
                report.dropped += batch
            if not victims:
                break
        report.commits_dropped = len(report.dropped)
        with self.cat.write():  # of each tag's ref-move records, the newest is what recovery needs
            self.cat.conn.execute(f"DELETE FROM records WHERE {_SUPERSEDED}")

    # --- blobs ---------------------------------------------------------------------------

    def delete_blobs(self, report: GCReport) -> None:
        cutoff = self.now - self.grace
        if report.dry_run:
            n, size = self._doom(
                f"SELECT pack, COUNT(*), SUM(stored_len + {BLOB_HEADER.size}) FROM blobs b WHERE created_at < {cutoff!r} AND NOT EXISTS "
                "(SELECT 1 FROM shards s JOIN leaves l ON l.id = s.leaf_id WHERE s.blob_id = b.id AND l.commit_id NOT IN (SELECT id FROM gc_dropped)) "
                "GROUP BY pack",
                report.dropped,
            )
            report.blobs_deleted, report.blob_bytes = n, size
            return
        last = -1  # walk the blob rows once, in id order (a batch never rescans the rows kept before it)
        while True:
            with self.cat.write():
                rows = self.cat.rows(
                    "SELECT id, stored_len FROM blobs b WHERE id > ? AND created_at < ? AND NOT EXISTS "
                    "(SELECT 1 FROM shards s WHERE s.blob_id = b.id) ORDER BY id LIMIT ?",
                    (last, cutoff, _BATCH_BLOBS),
                )
                self.cat.chunked("DELETE FROM blobs WHERE id IN ({})", [r["id"] for r in rows])
            report.blobs_deleted += len(rows)
            report.blob_bytes += sum(r["stored_len"] + BLOB_HEADER.size for r in rows)
            if len(rows) < _BATCH_BLOBS:
                break
            last = rows[-1]["id"]

    # --- packs -----------------------------------------------------------------------------

    def _doom(self, sql: str, dropped: list[str]) -> tuple[int, int]:
        """Dry run: note per pack the entries (and bytes) the real run would delete,
        as ``sql`` selects them (``gc_dropped`` holds ``dropped``); returns their totals."""
        with self.cat.read():
            self.cat.conn.execute("CREATE TEMP TABLE IF NOT EXISTS gc_dropped (id TEXT PRIMARY KEY)")
            self.cat.conn.execute("DELETE FROM gc_dropped")
            self.cat.conn.executemany("INSERT OR IGNORE INTO gc_dropped VALUES (?)", [(c,) for c in dropped])
            rows = self.cat.rows(sql, raw=True)
        for pack, n, size in rows:
            had = self.doomed.get(pack, (0, 0))
            self.doomed[pack] = (had[0] + n, had[1] + size)
        return sum(r[1] for r in rows), sum(r[2] for r in rows)

    def pack_stats(self) -> list[dict]:
        """Per pack: id, size, created_at, retired_at, ``n`` live entries (blobs and records),
        ``live`` bytes; in a dry run, less what the real run would have deleted by then."""
        rows = [dict(r) for r in self._pack_rows()]
        for r in rows:
            n, size = self.doomed.get(r["id"], (0, 0))
            r["n"] -= n
            r["live"] -= size
        return rows

    def _pack_rows(self) -> list:
        return self.cat.rows(
            "SELECT p.id, p.size, p.created_at, p.retired_at, COALESCE(b.n, 0) + COALESCE(r.n, 0) AS n, "
            "COALESCE(b.live, 0) + COALESCE(r.live, 0) AS live FROM packs p "
            "LEFT JOIN (SELECT pack, COUNT(*) AS n, SUM(stored_len + ?) AS live FROM blobs GROUP BY pack) b ON b.pack = p.id "
            "LEFT JOIN (SELECT pack, COUNT(*) AS n, SUM(stored_len + ?) AS live FROM records GROUP BY pack) r ON r.pack = p.id",
            (BLOB_HEADER.size, BLOB_HEADER.size),
        )

    def repack_candidates(self) -> tuple[list[dict], list[dict]]:
        """``(half-dead, small)`` packs to rewrite: older than the grace period, not retired,
        with live entries and no process holding them (a commit holds an exclusive
        ``flock`` on its packs until it returns); half-dead: live bytes below
        ``repack_below`` of the size; small: below ``small_pack_bytes`` (taken only when
        there are at least two packs to rewrite: one alone would gain nothing)."""
        cutoff = self.now - self.grace
        half, small = [], []
        for p in sorted(self.pack_stats(), key=lambda r: (r["created_at"], r["id"])):
            if p["retired_at"] is not None or p["created_at"] > cutoff:
                continue
            kind = pack_kind(p["size"], p["live"], p["n"], self.repack_below, self.small_pack_bytes)
            if kind not in ("half", "small"):
                continue  # dead packs go in delete_packs
            fd = _unlocked(pack_path(self.store.root, p["id"]))
            if fd is None:
                continue  # held by a running process (or gone): left for a later run
            os.close(fd)  # nothing locks a pack again once it has its final name
            (half if kind == "half" else small).append(p)
        return choose_repacks(half, small)

    def repack(self, report: GCReport) -> None:
        """Rewrite the half-dead and the small packs (:meth:`repack_candidates`) into new
        ones of up to ``pack_bytes``: per batch (``pack_bytes`` of live bytes), the live blobs and records are read (verified) and appended
        to new packs, which are made durable (fsync, rename, fsync the folders); then one
        transaction indexes them, repoints the rows and retires the old packs. A crash before
        that transaction leaves the old packs indexed and the new ones orphans."""
        half, small = self.repack_candidates()
        need = sum(p["live"] for p in half + small)
        free = shutil.disk_usage(self.store.root).free
        if half + small and free < need + (1 << 20):  # copies are written before the old packs go: a full disk first frees
            report.withheld.append(
                f"repacking {len(half + small)} packs needs {need} bytes of room and the disk has {free}: left for a later GC"
            )
            return
        if report.dry_run:  # what it moves out, the real run retires with the pack
            for p in half + small:
                self.doomed[p["id"]] = (self.doomed.get(p["id"], (0, 0))[0] + p["n"], p["size"])
                self.repacked_now.add(p["id"])
            report.packs_repacked += len(half)
            report.packs_consolidated += len(small)
            return
        kinds = {p["id"]: "packs_repacked" for p in half} | {p["id"]: "packs_consolidated" for p in small}
        batch: list[dict] = []
        live = 0
        for p in half + small:
            batch.append(p)
            live += p["live"]
            if live >= self.store.pack_bytes:  # by bytes alone: a batch's last pack is the only one not full
                self._rewrite(batch, kinds, report)
                batch, live = [], 0
        if batch:
            self._rewrite(batch, kinds, report)

    def _rewrite(self, packs: list[dict], kinds: dict, report: GCReport) -> None:
        """Copy the live entries of ``packs`` into new packs, then repoint and retire (one transaction)."""
        reader = PackReader(self.store.root)
        try:
            with PackWriter(self.store.root, self.store.compression_level, self.store.pack_bytes) as writer:
                moved = []
                for p in packs:
                    where = f"repacking pack {p['id']}"
                    blobs = self.cat.rows("SELECT * FROM blobs WHERE pack = ?", (p["id"],))
                    recs = self.cat.rows("SELECT * FROM records WHERE pack = ?", (p["id"],))
                    with progress.task(f"repack {p['id'][:12]}", sum(r["raw_len"] for r in blobs)) as advance:
                        for r in blobs:
                            loc = BlobLoc(bytes(r["hash"]), r["raw_len"], r["pack"], r["offset"], r["stored_len"], r["codec"])
                            moved.append(("blobs", r["id"], p["id"], writer.append(memoryview(reader.read(loc, where)), loc.digest)))
                            advance(r["raw_len"])
                    for r in recs:
                        loc = BlobLoc(bytes(r["digest"]), r["raw_len"], r["pack"], r["offset"], r["stored_len"], CODEC_RAW)
                        data = bytes(reader.read(loc, where, magic=RECORD_MAGIC))
                        moved.append(("records", r["id"], p["id"], writer.append_record(r["kind"], data)))
                writer.finish()  # durable under their final names before any row points at them
                with self.cat.write():
                    db = self.cat.db
                    db["packs"].insert_all({"id": pid, "size": size, "created_at": self.now} for pid, size in writer.pack_ids)
                    for table, row_id, old, loc in moved:
                        codec = ", codec = ?" if table == "blobs" else ""
                        self.cat.conn.execute(
                            f"UPDATE {table} SET pack = ?, offset = ?, stored_len = ?{codec} WHERE id = ? AND pack = ?",
                            (loc.pack, loc.offset, loc.stored_len, *((loc.codec,) if codec else ()), row_id, old),
                        )
                    self.cat.chunked(f"UPDATE packs SET retired_at = {self.now!r} WHERE id IN ({{}})", [p["id"] for p in packs])
        finally:
            reader.close()
        for p in packs:
            setattr(report, kinds[p["id"]], getattr(report, kinds[p["id"]]) + 1)

    def delete_packs(self, report: GCReport) -> None:
        cutoff = self.now - self.grace
        empty = [p for p in self.pack_stats() if p["n"] <= 0]
        if report.dry_run:
            for p in empty:
                retired = self.now if p["id"] in self.repacked_now else p["retired_at"]
                if (retired or self.now) <= cutoff:
                    report.bytes_freed += p["size"]
                    report.packs_deleted += 1
            return
        with self.cat.write():
            self.cat.chunked(f"UPDATE packs SET retired_at = {self.now!r} WHERE retired_at IS NULL AND id IN ({{}})", [p["id"] for p in empty])
        due = [p["id"] for p in empty if (p["retired_at"] or self.now) <= cutoff]
        folders: set[Path] = set()
        for i in range(0, len(due), _BATCH_PACKS):
            batch = due[i : i + _BATCH_PACKS]
            with self.cat.write():  # rows, then the files, then commit
                used = {r[0] for r in self.cat.chunked("SELECT pack FROM blobs WHERE pack IN ({})", batch, raw=True)}
                used |= {r[0] for r in self.cat.chunked("SELECT pack FROM records WHERE pack IN ({})", batch, raw=True)}
                batch = [p for p in batch if p not in used]
                self.cat.chunked("DELETE FROM packs WHERE id IN ({})", batch)
                paths = [pack_path(self.store.root, p) for p in batch]
                report.bytes_freed += sum(_unlink(path, sync=False) for path in paths)
                folders.update(path.parent for path in paths)
            report.packs_deleted += len(batch)
        # The unlinks made durable once per folder, not per pack: a file a power cut brings
        # back has no row any more, an orphan the next GC removes.
        for folder in sorted(folders):
            fsync_dir(folder)

    # --- leftovers --------------------------------------------------------------------------

    def leftovers(self, report: GCReport) -> None:
        cutoff = self.now - self.grace
        known = {r["id"] for r in self.cat.rows("SELECT id FROM packs")}
        blobs = self.store.root / "blobs"
        candidates = [(f, "orphan") for f in blobs.glob("*/*.pack") if f.stem not in known]
        candidates += [(f, "tmp") for f in (self.store.root / "tmp").iterdir() if f.is_file()]
        for path, kind in candidates:
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if st.st_mtime > cutoff:
                continue
            fd = _unlocked(path)
            if fd is None:
                continue  # a running commit owns it
            try:
                if kind == "orphan" and self.cat.rows("SELECT 1 FROM packs WHERE id = ?", (path.stem,)):
                    continue  # its commit finished meanwhile
                if not report.dry_run:
                    _unlink(path)
            finally:
                os.close(fd)
            report.bytes_freed += st.st_size
            if kind == "orphan":
                report.orphans_removed += 1
            else:
                report.tmp_removed += 1


def pending(report: GCReport, at_grace_0: GCReport) -> None:
    """Fill ``report``'s ``*_pending`` fields: what ``at_grace_0`` (a dry run with a grace
    period of 0 over the same state, on either home) drops beyond what ``report`` does."""
    report.commits_pending = max(0, at_grace_0.commits_dropped - report.commits_dropped)
    report.blobs_pending = max(0, at_grace_0.blobs_deleted - report.blobs_deleted)
    report.bytes_pending = max(0, at_grace_0.bytes_freed - report.bytes_freed)


def _unlink(path: Path, sync: bool = True) -> int:
    """Unlink ``path`` (and, with ``sync``, fsync its folder); its size in bytes, 0 if it was gone."""
    try:
        size = path.stat().st_size
        path.unlink()
        if sync:
            fsync_dir(path.parent)
        return size
    except FileNotFoundError:
        return 0


class LocalGC:
    """The local home's side of a GC (steps 1 to 5 above): ``gc.lock``, catalog transactions,
    packs retired, then unlinked a grace period later. What waits for the grace period
    (:func:`pending`) is a dry run with a grace period of 0, inside the same lock, before
    this run changes anything."""

    default_grace = DEFAULT_GRACE

    def __init__(self, store):
        self.store = store

    def lock(self, dry_run: bool):
        return gc_lock(self.store.root, read_only_ok=dry_run)

    def run(self, c: Collector, report: GCReport) -> GCReport | None:
        """Fill ``report``; returns the grace-0 dry run's report (None when ``c`` has a grace period of 0)."""
        at_grace_0 = _run(c.at_grace_0(), GCReport(dry_run=True)) if c.grace > 0 else None
        _run(c, report)
        return at_grace_0


def collect(store, *, keep_last: int = 1, keep_tags: list[str] | tuple[str, ...] = (), keep_within: str | float | None = None,
            grace: str | float | None = None, dry_run: bool = False, repack_below: float = REPACK_BELOW,
            small_pack_bytes: int = SMALL_PACK_BYTES) -> GCReport:
    """Run one GC over ``store``, on either home (see the module docstring and :meth:`Store.gc`).

    The protocol is the same on both: the arguments are checked, the retained commits and
    the packs to delete, repack or merge follow one set of rules (:meth:`Collector.retained`,
    :func:`pack_kind`, :func:`choose_repacks`), and the report has the same fields with
    the same meaning (:func:`pending`). The home's side (``store.gc_home()``: :class:`LocalGC`,
    or :class:`ckptstore.bucketgc.BucketGC` on object storage) holds what differs: how runs
    exclude each other, how commits and packs are dropped, and its default grace period
    (``grace=None``).
    """
    home = store.gc_home()
    c = Collector(store, keep_last, list(keep_tags), keep_within, home.default_grace if grace is None else grace, repack_below,
                  small_pack_bytes)
    report = GCReport(dry_run=dry_run)
    with home.lock(dry_run):
        at_grace_0 = home.run(c, report)
    if at_grace_0 is not None:
        pending(report, at_grace_0)
    return report


def _run(c: Collector, report: GCReport) -> GCReport:
    for phase, step in (("commits", c.drop_commits), ("blobs", c.delete_blobs), ("repack", c.repack),
                        ("packs", c.delete_packs), ("leftovers", c.leftovers)):
        t0 = time.perf_counter()
        step(report)
        report.seconds[phase] = time.perf_counter() - t0
    return report
