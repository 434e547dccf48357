"""The store in a folder: :class:`LocalHome` (its objects are pack files under ``blobs/``,
its refs and index the catalog beside them) and the primitives it gives the two
maintenance protocols written once elsewhere: :class:`LocalFsck` (:mod:`ckptstore.protocols.fsck`)
and :class:`LocalGC` (:mod:`ckptstore.protocols.gc`). What the index does is shared with the bucket
home and lives in :class:`ckptstore.home.base.Home`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..backends.local import ForeignEntryError, describe_mode, lstat_beneath, open_dir, open_regular, unlink_beneath
from ..core import progress
from ..core.errors import BlobCorruptError, BlobMissingError, CkptStoreError, IntegrityError, ResourceLimitError, StoreWriteError
from ..core.layout import ShardPlan, itemsize
from ..objects import records
from ..objects.bucketformat import GCMarks
from ..objects.packs import (
    BLOB_HEADER,
    BLOB_MAGIC,
    CODEC_RAW,
    RECORD_MAGIC,
    BlobLoc,
    PackReader,
    PackWriter,
    check_entry,
    pack_path,
    scan,
    walk_store,
)
from ..objects.records import KIND_COMMIT, KIND_REF
from .base import Home
from .catalog import drop_commit_rows, rebuild_record
from .upkeep import FsckReport, FsckSide, GCReport, GCSide, PackStat, gc_lock, packed, unlocked


class LocalHome(Home):
    """A store in a folder: packs under ``blobs/`` (:mod:`ckptstore.objects.packs`), the catalog
    beside them, tags in the catalog::

        catalog.sqlite   the catalog (commits, manifests, lineage, tags, reflog, blobs)
        blobs/           pack files of content-addressed blobs, fanned out by id prefix
        tmp/             files being written
    """

    def pack_writer(self) -> PackWriter:
        """As :meth:`ckptstore.home.base.Home.pack_writer`, on this home."""
        return PackWriter(self.root, self.compression_level, self.pack_bytes)

    def pack_reader(self, sparse: bool = False) -> PackReader:
        """As :meth:`ckptstore.home.base.Home.pack_reader`, on this home."""
        return PackReader(self.root, sparse, locate=self.relocate)

    def pack_size(self, pack: str) -> int | None:
        """As :meth:`ckptstore.home.base.Home.pack_size`, on this home."""
        try:  # (a link, FIFO, socket or device in its place is no pack: invariant 13)
            st = lstat_beneath(self.root, pack_path(self.root, pack))
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def gc_side(self) -> LocalGC:
        """This home's primitives of the GC protocol (:func:`ckptstore.protocols.gc.collect`)."""
        return LocalGC(self)

    def fsck_side(self) -> LocalFsck:
        """This home's primitives of the fsck protocol (:func:`ckptstore.protocols.fsck.check`)."""
        return LocalFsck(self)


class LocalFsck(FsckSide):
    """The primitives of the fsck protocol (:mod:`ckptstore.protocols.fsck`) on a folder: the catalog
    (its rows against each record, its blob rows, SQLite's own checks) against the pack files."""

    def __init__(self, home: LocalHome):
        self.home, self.root, self.location = home, home.root, home.location

    #: A commit exists once its catalog transaction commits: no record exists before its tags move.
    attempts_leave_records = False

    def start(self, repair: bool) -> None:
        """Before any read: ``repair`` on a store that cannot be written here is refused
        (StoreWriteError). A local store has no pack indexes: its repair replaces bad blob
        copies by good ones found in other packs (:meth:`replace_bad`); a lost or damaged
        catalog is rebuilt from the packs by ``recover``."""
        if repair and not self.home.catalog.writable:
            raise StoreWriteError(f"{self.root} is read-only here (mount, permissions or a full disk): fsck --repair cannot write it")

    def replace_bad(self, report: FsckReport, locs: list[BlobLoc]):
        """For each bad copy of ``locs``, another copy of its address in a pack the catalog
        knows (not retired by a GC): the packs' entry headers walked once, a candidate reread
        and rehashed, the blob row pointed at the first good one and its mark deleted; yields
        ``(bad loc, good loc)`` for each one replaced. Cost: one walk of the packs' headers."""
        want = {(loc.digest, loc.raw_len): loc for loc in locs}
        reader = PackReader(self.root)
        try:
            for (pid,) in self.home.catalog.rows("SELECT id FROM packs WHERE retired_at IS NULL ORDER BY created_at DESC, id", raw=True):
                if not want:
                    break
                entries, _ = scan(pack_path(self.root, pid), pid)  # (a walk stopped by damage still gives the entries before it)
                for e in entries:
                    k = (e.loc.digest, e.loc.raw_len)
                    bad = want.get(k)
                    if bad is None or e.magic != BLOB_MAGIC or (e.loc.pack, e.loc.offset) == (bad.pack, bad.offset):
                        continue
                    try:
                        reader.read(e.loc, f"fsck --repair, another copy of blob {e.loc.address}")
                    except ResourceLimitError:
                        raise
                    except CkptStoreError:
                        continue  # a bad copy too
                    if self.home.replace_copy(bad, e.loc):
                        del want[k]
                        yield bad, e.loc
        finally:
            reader.close()

    def resolve(self, ref: str) -> str:
        """The commit id ``ref`` names (:meth:`ckptstore.home.base.Home.resolve`)."""
        return self.home.resolve(ref)

    def snapshot(self):
        """One read transaction of the catalog: tags, commits and blob rows agree with each other."""
        return self.home.catalog.read()

    def tags(self, report: FsckReport) -> dict[str, str]:
        """``{tag: commit id}`` from the catalog."""
        return dict(self.home.catalog.rows("SELECT name, commit_id FROM tags", raw=True))

    def commits(self, report: FsckReport, ids: list[str] | None, deep: bool) -> dict[str, Any]:
        """``{commit id: CommitRecord, or None when its record does not hash to its id}`` of
        ``ids`` (every commit when ``None``). Reported in ``report``: a damaged record, rows
        (leaves, shards, components, parents, message) that disagree with the record, a
        leaf whose shard rows do not fit its shape and dtype (damaged commits), and a commit
        with no copy of its record in a pack (a problem: recover could not rebuild it)."""
        cat = self.home.catalog
        ids = [r[0] for r in cat.rows("SELECT id FROM commits", raw=True)] if ids is None else ids
        texts = dict(cat.chunked("SELECT id, record FROM commits WHERE id IN ({})", ids, raw=True))
        copies = {r[0] for r in cat.chunked(f"SELECT name FROM records WHERE kind = {records.KIND_COMMIT} AND name IN ({{}})", ids, raw=True)}
        unfinished = "; the store's upgrade is unfinished: one writable open writes it" if cat.backfill_pending else ""
        out: dict[str, Any] = {}
        for cid in ids:
            try:
                out[cid] = records.parse_commit(texts.get(cid), cid)
            except IntegrityError as exc:
                out[cid] = None
                report.problems.append(str(exc))
                report.damaged_commits.append(cid)
                continue
            if rebuild_record(cat.conn, cid) != texts[cid]:
                report.problems.append(f"commit {cid}: the catalog's rows (leaves, shards, components, parents or message) disagree with its record")
                report.damaged_commits.append(cid)
            if cid not in copies:
                report.problems.append(f"commit {cid}: no copy of its record in a pack (recover could not rebuild it){unfinished}")
        where, params = ("WHERE l.commit_id = ?", (ids[0],)) if len(ids) == 1 else ("", ())
        shards: dict[tuple[str, str], list[int]] = {}
        for cid, path, raw_len in cat.rows(
            f"SELECT l.commit_id, l.path, b.raw_len FROM commit_leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id {where} "
            "ORDER BY l.commit_id, l.path, s.seq", params, raw=True,
        ):
            shards.setdefault((cid, path), []).append(raw_len)
        for cid, path, dtype, shape, nbytes, shard_bytes in cat.rows(
            f"SELECT commit_id, path, dtype, shape, nbytes, shard_bytes FROM commit_leaves l {where} {'AND' if where else 'WHERE'} kind = 'tensor'",
            params, raw=True,
        ):
            got = shards.get((cid, path), [])
            try:
                plan = ShardPlan(nbytes, shard_bytes)
                ok = math.prod(json.loads(shape)) * itemsize(dtype) == nbytes and len(got) == plan.count and all(
                    n == plan.bounds(i)[1] - plan.bounds(i)[0] for i, n in enumerate(got))
            except (TypeError, ValueError, AttributeError):
                ok = False
            if not ok:
                report.problems.append(f"commit {cid}, leaf {path}: manifest and shard rows disagree (shape, dtype, sizes or count)")
                report.damaged_commits.append(cid)
        return out

    def locate(self, report: FsckReport, keys: list[tuple[bytes, int]], deep: bool, repair: bool) -> dict:
        """Where the catalog says each blob of ``keys`` is (``{address: BlobLoc}``); for most of
        the store's blobs, from one scan of the blob rows rather than one lookup each."""
        (top,), = self.home.catalog.rows("SELECT COALESCE(MAX(id), 0) FROM blobs", raw=True)
        if len(keys) * 4 < top:
            return self.home.locate(keys)
        wanted = set(keys)
        rows = self.home.catalog.rows("SELECT hash, raw_len, pack, offset, stored_len, codec FROM blobs", raw=True)
        return {(h, n): BlobLoc(h, n, *rest) for h, n, *rest in rows if (h, n) in wanted}

    def read(self, locs: list[BlobLoc], reread: set):
        """``(loc, error)`` for each blob of ``locs`` whose pack file is missing or shorter
        than it (a BlobMissingError), and for each of ``reread`` (addresses) reread and
        rehashed (``None`` when intact, else the error). A GC beside fsck may move (repack)
        or free a blob after the catalog was read: one that looks missing or bad is looked
        up again, and only reported if it still is."""
        home = self.home
        reader = PackReader(self.root, locate=home.relocate)
        sizes: dict[str, int | None] = {}

        def gap(loc: BlobLoc) -> str | None:  # why the pack does not hold the blob whole, or None
            if loc.pack not in sizes:
                sizes[loc.pack] = self.home.pack_size(loc.pack)
            size = sizes[loc.pack]
            if size is None:
                return f"blob {loc.address}: pack {loc.pack}.pack is missing"
            return None if loc.offset + BLOB_HEADER.size + loc.stored_len <= size else f"blob {loc.address}: pack {loc.pack}.pack is truncated"

        def still_bad(loc: BlobLoc, read: bool) -> bool:
            now = home.relocate(loc)
            if now is None:
                return False  # freed meanwhile: no kept commit references it
            sizes.pop(now.pack, None)
            if gap(now) is not None:
                return True
            try:
                if read:
                    reader.read(now, "fsck")
            except ResourceLimitError:
                raise
            except CkptStoreError:
                return True
            return False

        try:
            for loc in locs:
                why = gap(loc)
                if why is not None and still_bad(loc, read=False):
                    yield loc, BlobMissingError(why)
                elif (loc.digest, loc.raw_len) in reread:
                    try:
                        reader.read(loc, "fsck")
                        yield loc, None
                    except ResourceLimitError:
                        raise
                    except CkptStoreError as exc:
                        yield loc, (BlobCorruptError(str(exc)) if still_bad(loc, read=True) else None)
        finally:
            reader.close()

    def extra(self, report: FsckReport, ids: list[str], whole: bool, deep: bool, repair: bool) -> None:
        """The checks of the catalog itself (``whole``: SQLite's integrity and foreign-key
        checks; the orphans: pack files without a catalog row, unreferenced blob rows, files
        in ``tmp/``) and, with ``deep``, every record copy in the packs (of commits ``ids``,
        and with ``whole`` the ref-move records) reread: a damaged copy of a commit's
        record damages the commit; one that differs from the catalog's is a problem."""
        cat = self.home.catalog
        with cat.read():
            if whole:
                status = [r[0] for r in cat.rows("PRAGMA integrity_check", raw=True)]
                if status != ["ok"]:
                    report.problems += [f"catalog: {s}" for s in status[:20]]
                for r in cat.rows("PRAGMA foreign_key_check", raw=True):
                    report.problems.append(f"catalog: row {r[1]} of table {r[0]} references a missing {r[2]} row")
                report.unreferenced_blobs = cat.rows("SELECT COUNT(*) FROM blobs b WHERE NOT EXISTS (SELECT 1 FROM shards s WHERE s.blob_id = b.id)",
                                                     raw=True)[0][0]
                packs = {r[0] for r in cat.rows("SELECT id FROM packs", raw=True)}
            if deep:
                texts = dict(cat.chunked("SELECT id, record FROM commits WHERE id IN ({})", ids, raw=True))
                rows = cat.chunked(f"SELECT * FROM records WHERE kind = {records.KIND_COMMIT} AND name IN ({{}})", ids)
                if whole:
                    rows += cat.rows(f"SELECT * FROM records WHERE kind = {records.KIND_REF}")
        if whole:
            for kind, rel, st in walk_store(self.root):
                if kind == "pack" and Path(rel).stem not in packs:
                    report.orphan_packs.append(Path(rel).stem)
                elif kind == "tmp":
                    report.tmp_files += 1
                elif kind == "foreign":
                    report.foreign.append(f"{rel} is {describe_mode(st.st_mode)}, not made by ckptstore")
            report.orphan_packs.sort()
        if not deep:
            return
        reader = PackReader(self.root, locate=self.home.relocate)

        def copy(r) -> str:
            loc = BlobLoc(bytes(r["digest"]), r["raw_len"], r["pack"], r["offset"], r["stored_len"], CODEC_RAW)
            return bytes(reader.read(loc, "fsck", magic=RECORD_MAGIC)).decode(errors="replace")

        try:
            for r in rows:
                try:
                    text = copy(r)
                except ResourceLimitError:
                    raise
                except CkptStoreError as exc:
                    now = cat.rows("SELECT * FROM records WHERE id = ?", (r["id"],))  # a GC may have dropped or moved it meanwhile
                    if not now:
                        continue
                    try:
                        r = now[0]
                        text = copy(r)
                    except ResourceLimitError:
                        raise
                    except CkptStoreError:
                        report.problems.append(f"record of {r['name']} in pack {r['pack']}: {exc}")
                        if r["kind"] == records.KIND_COMMIT:
                            report.damaged_commits.append(r["name"])
                        continue
                if r["kind"] == records.KIND_COMMIT and text != texts.get(r["name"]):
                    report.problems.append(f"commit {r['name']}: its record in pack {r['pack']} differs from the catalog's")
        finally:
            reader.close()


# --- the GC primitives of a folder (ckptstore.protocols.gc.GCSide) ------------------------------------

_BATCH_COMMITS = 500
_BATCH_BLOBS = 2000
_BATCH_PACKS = 500
# Ref-move records that a newer move of the same tag supersedes (recovery needs only the newest).
_SUPERSEDED = f"kind = {KIND_REF} AND seq < (SELECT MAX(r.seq) FROM records r WHERE r.kind = {KIND_REF} AND r.name = records.name)"


def retired_marks(rows) -> GCMarks:
    """A folder's GC marks, by the rule of :class:`~ckptstore.objects.bucketformat.GCMarks`: each pack's
    ``retired_at`` in the catalog (``rows``: ``(pack id, retired_at)`` pairs, ``NULL`` ones
    left out or not). A finite number is a mark made then that names the pack; anything else
    (text, an infinity: a damaged row) is a mark that cannot be read: it withholds that pack
    (``withholds``: its name is the row's) and deletes nothing (``oldest`` leaves it out: the
    GC marks the pack again if it is dead, and sweeps it a grace period later)."""
    marks, unreadable = [], []
    for pid, at in rows:
        if at is None:
            continue
        if type(at) in (int, float) and math.isfinite(at):
            marks.append((float(at), pid, {"packs": [pid], "commits": [], "objects": [], "reflog": []}))
        else:
            unreadable.append((pid, None, frozenset((pid,))))
    return GCMarks(tuple(marks), tuple(unreadable))


#: A pack row whose ``retired_at`` is no readable mark (:func:`retired_marks`): the GC may mark it (again).
_UNMARKED = "(retired_at IS NULL OR typeof(retired_at) NOT IN ('integer', 'real') OR abs(retired_at) = 9e999)"


class LocalGC(GCSide):
    """The primitives of the GC protocol (:mod:`ckptstore.protocols.gc`) on a folder: ``gc.lock``
    (``flock``), this machine's clock, the catalog as the index. Commits, and the blob rows
    only they referenced, leave the catalog at once, in write transactions that first check
    that no tag moved since the roots were computed (computing them again if one did); a
    commit's final transaction takes the same write lock and re-checks every blob it reuses
    (invariant 4). The mark is a pack's ``retired_at``; the sweep deletes the rows and
    unlinks the files (500 per transaction, each folder fsynced once at the end: a file a
    power cut brings back has no row, an orphan the next GC removes). A copy writes each
    live entry as stored (verified) into new durable packs, then one transaction indexes
    them, repoints the rows and retires the old packs. Pack files without a row (a crashed
    commit) and files in ``tmp/`` are removed when older than the grace period and not
    ``flock``ed by a running commit."""

    def __init__(self, home):
        self.home = home
        self.cat = home.catalog
        self._now: float | None = None
        self._dying: tuple = ("0", (), "0")
        self._victims: list = []
        self._token: tuple = ()

    def lock(self, dry_run: bool):
        return gc_lock(self.home.root, read_only_ok=dry_run)

    def now(self, fresh: bool) -> float:
        if fresh or self._now is None:
            self._now = time.time()
        return self._now

    @contextmanager
    def snapshot(self):
        """A read transaction; the tags' state (:meth:`refs_token`) is noted in it, for :meth:`drop`."""
        with self.cat.read():
            self._token = self.refs_token()
            yield

    def commits(self, keep: set) -> dict:
        return {c: (t, None, 0) for c, t in self.cat.rows("SELECT id, created_at FROM commits", raw=True)}

    def packs(self, keep: set, victims: list, cutoff: float) -> list[PackStat]:
        """Per pack, from the catalog: entries and bytes that stay once ``victims`` are dropped,
        and the blob rows that then die (no other commit's shard, created before ``cutoff``);
        bulk SQL (one pass over the blobs), however many commits."""
        self._victims = victims
        with self._dropping(victims):
            if victims:
                # (a leaf row is kept by its owner, or by a kept commit that shares it: components.rows_of)
                blob_dies = ("created_at < ? AND NOT EXISTS (SELECT 1 FROM shards s JOIN leaves l ON l.id = s.leaf_id "
                             "WHERE s.blob_id = blobs.id AND (l.commit_id NOT IN (SELECT id FROM gc_dropped) OR EXISTS (SELECT 1 FROM "
                             "components c WHERE c.rows_of = l.commit_id AND c.path = l.component AND c.commit_id != c.rows_of "
                             "AND c.commit_id NOT IN (SELECT id FROM gc_dropped))))")
            else:
                blob_dies = "created_at < ? AND NOT EXISTS (SELECT 1 FROM shards s WHERE s.blob_id = blobs.id)"
            record_dies = f"(kind = {KIND_COMMIT} AND name IN (SELECT id FROM gc_dropped)) OR ({_SUPERSEDED})"
            self._dying = (blob_dies, (cutoff,), record_dies)
            h = BLOB_HEADER.size
            blobs = {r[0]: r[1:] for r in self.cat.rows(
                f"SELECT pack, COUNT(*) - SUM(d), SUM((1 - d) * (stored_len + {h})), SUM(d), SUM(d * (stored_len + {h})) "
                f"FROM (SELECT pack, stored_len, ({blob_dies}) AS d FROM blobs) GROUP BY pack", (cutoff,), raw=True)}
            recs = {r[0]: r[1:] for r in self.cat.rows(
                f"SELECT pack, COUNT(*), SUM(stored_len + {h}) FROM records WHERE NOT ({record_dies}) GROUP BY pack", raw=True)}
            packs = self.cat.rows("SELECT id, size, created_at, retired_at FROM packs", raw=True)
        out = []
        marked = retired_marks((pid, retired) for pid, _, _, retired in packs).oldest()
        for pid, size, created, _ in packs:
            n, live, dies, dies_bytes = blobs.get(pid, (0, 0, 0, 0))
            rn, rlive = recs.get(pid, (0, 0))
            out.append(PackStat(pid, size, created, marked.get(pid), n + rn, live + rlive, size, dies, dies_bytes))
        return out

    @contextmanager
    def _dropping(self, victims: list):
        """A read transaction whose temporary table ``gc_dropped`` holds ``victims``."""
        with self.cat.read():
            self.cat.conn.execute("CREATE TEMP TABLE IF NOT EXISTS gc_dropped (id TEXT PRIMARY KEY)")
            self.cat.conn.execute("DELETE FROM gc_dropped")
            self.cat.conn.execute("INSERT OR IGNORE INTO gc_dropped SELECT value FROM json_each(?)", (json.dumps(victims),))
            yield

    def busy(self, pack: str) -> bool:
        fd = unlocked(pack_path(self.home.root, pack))
        if fd is None:
            return True  # held by a running process (or gone): left for a later run
        os.close(fd)  # nothing locks a pack again once it has its final name
        return False

    def drop(self, c, victims: list, cutoff: float, report: GCReport) -> None:
        if report.dry_run:
            report.dropped += victims
            return
        cat, state = self.cat, self._token  # the tags as the roots saw them
        while victims:
            with cat.write():
                if self.refs_token() != state:  # a tag moved since: the roots again
                    keep = c.retained()
                    victims = [v for (v, t) in cat.rows("SELECT id, created_at FROM commits ORDER BY created_at", raw=True)
                               if v not in keep and t <= cutoff]
                state = self.refs_token()
                batch, victims = victims[:_BATCH_COMMITS], victims[_BATCH_COMMITS:]
                drop_commit_rows(cat, batch)  # (rows a kept commit shares move to it)
                cat.chunked(f"DELETE FROM records WHERE kind = {KIND_COMMIT} AND name IN ({{}})", batch)
                cat.chunked("DELETE FROM commits WHERE id IN ({})", batch)
                report.dropped += batch
        with cat.write():  # of each tag's ref-move records, the newest is what recovery needs
            cat.conn.execute(f"DELETE FROM records WHERE {_SUPERSEDED}")
        last = -1  # the blob rows no shard references, walked once in id order (a batch never rescans the rows kept before it)
        while True:
            with cat.write():
                rows = cat.rows(
                    "SELECT id, stored_len FROM blobs b WHERE id > ? AND created_at < ? AND NOT EXISTS "
                    "(SELECT 1 FROM shards s WHERE s.blob_id = b.id) ORDER BY id LIMIT ?", (last, cutoff, _BATCH_BLOBS), raw=True)
                cat.chunked("DELETE FROM blobs WHERE id IN ({})", [r[0] for r in rows])
            report.blobs_deleted += len(rows)
            report.blob_bytes += sum(r[1] + BLOB_HEADER.size for r in rows)
            if len(rows) < _BATCH_BLOBS:
                break
            last = rows[-1][0]

    def room(self) -> int:
        return shutil.disk_usage(self.home.root).free

    def _entries(self, packs: list[str], dying: tuple = ("0", (), "0")) -> dict[str, tuple[list, list]]:
        """``{pack: (blob rows, record rows)}`` of ``packs``, each in id order, less the rows
        ``dying`` selects (as :meth:`packs` last counted them: what a dry run's drop would have
        deleted); a few statements per 500 packs."""
        blob_dies, params, record_dies = dying
        out: dict[str, tuple[list, list]] = {p: ([], []) for p in packs}
        for table, dies, args, i in (("blobs", blob_dies, params, 0), ("records", record_dies, (), 1)):
            for r in self.cat.chunked(f"SELECT * FROM {table} WHERE NOT ({dies}) AND pack IN ({{}}) ORDER BY id", packs, args):
                out[r["pack"]][i].append(r)
        return out

    def copy_size(self, batch: list[PackStat]) -> int:
        with self._dropping(self._victims):
            rows = self._entries([p.id for p in batch], self._dying)
        sizes = [BLOB_HEADER.size + r["stored_len"] for p in batch for part in rows[p.id] for r in part]
        return sum(size for _, size in packed(sizes, self.home.pack_bytes))

    def copy(self, batch: list[PackStat], report: GCReport) -> int:
        home, now = self.home, self._now
        with PackWriter(home.root, home.compression_level, home.pack_bytes) as writer:
            moved, entries = [], self._entries([p.id for p in batch])
            for p in batch:
                where = f"repacking pack {p.id}"
                blobs, recs = entries[p.id]
                with os.fdopen(open_regular(home.root, pack_path(home.root, p.id)), "rb") as f, progress.task(f"repack {p.id[:12]}", sum(r["raw_len"] for r in blobs)) as advance:
                    for table, rows, magic in (("blobs", blobs, BLOB_MAGIC), ("records", recs, RECORD_MAGIC)):
                        for r in rows:
                            blob = table == "blobs"
                            loc = BlobLoc(bytes(r["hash" if blob else "digest"]), r["raw_len"], p.id, r["offset"], r["stored_len"],
                                          r["codec"] if blob else CODEC_RAW)
                            payload = check_entry(os.pread(f.fileno(), BLOB_HEADER.size + loc.stored_len, loc.offset), loc, where, magic)
                            new = writer.append_encoded(loc.digest, loc.raw_len, loc.codec, payload, magic, 0 if blob else r["kind"])
                            moved.append((table, r["id"], p.id, new))
                            advance(r["raw_len"] if blob else 0)
            writer.finish()  # durable under their final names before any row points at them
            with self.cat.write():
                self.cat.db["packs"].insert_all({"id": pid, "size": size, "created_at": now} for pid, size in writer.pack_ids)
                for table, row_id, old, loc in moved:
                    codec = ", codec = ?" if table == "blobs" else ""
                    self.cat.conn.execute(
                        f"UPDATE {table} SET pack = ?, offset = ?, stored_len = ?{codec} WHERE id = ? AND pack = ?",
                        (loc.pack, loc.offset, loc.stored_len, *((loc.codec,) if codec else ()), row_id, old),
                    )
                self.cat.chunked(f"UPDATE packs SET retired_at = {now!r} WHERE id IN ({{}})", [p.id for p in batch])
            return sum(size for _, size in writer.pack_ids)

    def mark(self, plan, report: GCReport) -> None:
        with self.cat.write():  # (the copied packs were retired with their copy)
            self.cat.chunked(f"UPDATE packs SET retired_at = {self._now!r} WHERE {_UNMARKED} AND id IN ({{}}) "
                             "AND NOT EXISTS (SELECT 1 FROM blobs b WHERE b.pack = packs.id) "
                             "AND NOT EXISTS (SELECT 1 FROM records r WHERE r.pack = packs.id)", [p.id for p in plan.dead])

    def refs_token(self) -> tuple:
        """Changes whenever a tag moves, is created or deleted (what retention depends on
        besides commits, which only ever get added, young)."""
        return (*self.cat.rows("SELECT MAX(id) FROM reflog", raw=True)[0],
                *self.cat.rows("SELECT COUNT(*), MAX(updated_at), TOTAL(updated_at) FROM tags", raw=True)[0])

    def delete(self, commits: list[str], packs: list[PackStat], token, report: GCReport) -> tuple[list, list]:
        """Rows, then files, then commit (each batch re-checks in its transaction that no row points into the packs)."""
        folders: set[Path] = set()
        gone: list[PackStat] = []
        for i in range(0, len(packs), _BATCH_PACKS):
            batch = {p.id: p for p in packs[i : i + _BATCH_PACKS]}
            with self.cat.write():
                used = {r[0] for r in self.cat.chunked("SELECT pack FROM blobs WHERE pack IN ({})", list(batch), raw=True)}
                used |= {r[0] for r in self.cat.chunked("SELECT pack FROM records WHERE pack IN ({})", list(batch), raw=True)}
                ids = [p for p in batch if p not in used]
                self.cat.chunked("DELETE FROM packs WHERE id IN ({})", ids)
                for pid in ids:
                    path = pack_path(self.home.root, pid)
                    try:
                        batch[pid].freed = unlink_beneath(self.home.root, path, sync=False)
                    except ForeignEntryError:  # not the pack ckptstore wrote (a link, a FIFO...): left alone, fsck names it
                        batch[pid].freed = 0
                    folders.add(path.parent)
                    gone.append(batch[pid])
        for folder in sorted(folders):  # the unlinks made durable once per folder, not per pack
            try:
                fd = open_dir(self.home.root, folder)
            except OSError:  # gone, or not the store's folder: nothing of ours to make durable there
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return [], gone

    def leftovers(self, cutoff: float, own_due: bool, report: GCReport) -> None:
        """Remove pack files without a row and files in ``tmp/`` older than ``cutoff`` that no
        running commit ``flock``s. Only regular files reached without a symbolic link are
        candidates (:func:`ckptstore.objects.packs.walk_store`), and each is unlinked through its
        folder's descriptor: a link (``tmp`` or ``blobs/zz`` pointing at another folder), a
        FIFO, socket or device is never followed, opened or deleted (invariant 13)."""
        known = {r[0] for r in self.cat.rows("SELECT id FROM packs", raw=True)}
        root = self.home.root
        candidates = [(root / rel, "orphan" if kind == "pack" else "tmp") for kind, rel, _ in walk_store(root)
                      if kind == "tmp" or (kind == "pack" and Path(rel).stem not in known)]
        for path, kind in candidates:
            try:
                st = lstat_beneath(root, path)
            except OSError:  # gone, or its folder replaced by a link meanwhile
                continue
            if st.st_mtime > cutoff or not stat.S_ISREG(st.st_mode):
                continue
            fd = unlocked(path)
            if fd is None:
                continue  # a running commit owns it
            try:
                if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != (st.st_dev, st.st_ino):
                    continue  # replaced between the two looks
                if kind == "orphan" and self.cat.rows("SELECT 1 FROM packs WHERE id = ?", (path.stem,)):
                    continue  # its commit finished meanwhile
                if not report.dry_run:
                    try:
                        unlink_beneath(root, path)
                    except ForeignEntryError:
                        continue
            finally:
                os.close(fd)
            report.bytes_freed += st.st_size
            if kind == "orphan":
                report.orphans_removed += 1
            else:
                report.tmp_removed += 1


__all__ = ["LocalFsck", "LocalGC", "LocalHome"]
