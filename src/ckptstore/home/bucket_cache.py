"""The cache of a store on object storage (docs/design.md, "A store on object storage"):
a SQLite catalog of the local store's schema under the user's cache folder
(:func:`cache_folder`) holding copies of the bucket's pack indexes and commit records, so
that dedup lookups and blob lookups cost no round trips. Every row is a copy of an
immutable object on the bucket: deleting the folder loses nothing.

:class:`BucketCache` is the part of :class:`~ckptstore.home.bucket.BucketHome` that fills it:
:meth:`~BucketCache.refresh_index` reads every ``.idx`` not seen before (and moves the rows
of blobs whose pack is gone); :meth:`~BucketCache._cache` and
:meth:`~BucketCache.index_records` copy verified commit records without reading every
pack's index (a blob no index the cache has read holds gets a row in :data:`UNLOCATED`);
the copied commits' figures are filled in once their blobs are located.
"""

from __future__ import annotations

import heapq
import os
import time
from pathlib import Path
from typing import Any

from ..core import jsonvalue
from ..core.errors import BlobMissingError, IntegrityError, RefNotFoundError, StoreWriteError
from ..core.layout import address, digest
from ..objects.bucketformat import REQUESTS, commit_key, fetch_record, pack_entries
from ..objects.packindex import index_key, pack_key
from ..objects.packs import BLOB_HEADER, BLOB_MAGIC, BlobLoc, Entry
from ..objects.records import check_checkable, recreate
from .index_step import ReusedBlobsGone

#: The pack of a cache ``blobs`` row whose blob no ``.idx`` this cache has read holds yet: a
#: commit record copied for a listing (``log``, ``tagged``, ``info``) is cached without reading
#: every pack's index; :meth:`BucketHome.refresh_index` fills these rows in when a checkout,
#: a commit, fsck, GC or ``du`` needs locations. Never a pack id (those are 32 hex digits).
UNLOCATED = "unlocated"


def cache_folder(url: str) -> Path:
    """The local cache of store ``url``: ``$XDG_CACHE_HOME/ckptstore/<hash>`` (default
    ``~/.cache``), one per endpoint (``AWS_ENDPOINT_URL``), bucket and prefix."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ckptstore" / digest(f"{os.environ.get('AWS_ENDPOINT_URL', '')}|{url}".encode()).hex()


class _NoPacks:
    """The pack writer of an index step that writes no blob (a record copied into the cache)."""

    pack_ids: tuple = ()
    stored_bytes = 0


class BucketCache:
    """The cache-filling part of :class:`~ckptstore.home.bucket.BucketHome` (one of its base
    classes, never used alone): it uses the home's catalog and queries, ``backend``, ``url``,
    ``requests`` (a thread pool), ``_index_lock``, ``_indexed``, ``_copying`` and
    ``pack_problems``, set by ``BucketHome.__init__``."""

    def refresh_index(self, only: list[str] | None = None, avoid: set[str] = frozenset()) -> int:
        """Bring the cache's blob index up to date with the bucket: read the ``.idx`` of
        every pack not seen before (each checked before use), and move the rows of blobs
        whose pack is gone, or is one of ``avoid`` (packs a GC marked), to another pack
        that holds them (a GC's repack copied them there); rows of blobs not located yet
        (:data:`UNLOCATED`) take the place an index read now gives them, and the copied
        commits' ``stored_bytes`` are filled in once their new blobs are located.
        ``only``: read just these packs' indexes, if not seen (a tag's hint; nothing is
        listed). Returns the packs read.

        A pack whose ``.idx`` is missing or damaged is indexed from the pack itself
        (:func:`~ckptstore.protocols.remote.pack_entries`); one that cannot be read at all is left
        out (fsck reports it), so a damaged object affects only what needs it.

        Raises:
            BackendError: the storage failed.
        """
        with self._index_lock:
            cat = self.catalog
            seen = {r[0] for r in cat.rows("SELECT id FROM packs", raw=True)}
            if only is not None and len(only) > REQUESTS:
                only = None  # a long hint costs more HEADs than one listing
            if only is not None:
                todo = [p for p in dict.fromkeys(only) if p not in seen]
                heads = dict(zip(todo, self.requests.map(lambda p: self.backend.head(pack_key(p)), todo)))
                packs = {p: o for p, o in heads.items() if o is not None}
                gone: set[str] = set()
            else:
                self._indexed = True
                listed = {o.key: o for o in self.backend.list("blobs")}
                packs = {k.rsplit("/", 1)[1][:-5]: o for k, o in listed.items() if k.endswith(".pack")}
                holding = {r[0] for r in cat.rows("SELECT DISTINCT pack FROM blobs WHERE pack != ?", (UNLOCATED,), raw=True)}
                gone = holding - set(packs)
            moving = gone | (holding & set(avoid)) if only is None else gone
            todo = list(packs) if moving else [p for p in packs if p not in seen]

            indexes = None if only is not None else {k for k in listed if k.endswith(".idx")}

            def load(pid: str) -> list[Entry] | None:
                found = pack_entries(self.backend, pid, packs[pid].size, indexes is None or index_key(pid) in indexes)
                if found.entries is None or found.index_problem is not None:
                    self.pack_problems[pid] = found  # for recover: what to report, which indexes to rebuild
                return found.entries

            entries = {pid: es for pid, es in zip(todo, self.requests.map(load, todo)) if es is not None}
            todo = list(entries)
            with cat.write():
                cat.db["packs"].insert_all(
                    ({"id": pid, "size": packs[pid].size, "created_at": packs[pid].mtime} for pid in todo if pid not in seen), ignore=True
                )
                # Newest pack first: of an address in several packs, a new cache takes the newest copy (a good
                # copy written after a bad one, invariant 14; a GC's repack copy rather than its marked source).
                rows = [(e.loc.digest, e.loc.raw_len, pid, e.loc.offset, e.loc.stored_len, e.loc.codec, packs[pid].mtime)
                        for pid, es in sorted(entries.items(), key=lambda pe: packs[pe[0]].mtime, reverse=True)
                        if pid not in avoid for e in es if e.magic == BLOB_MAGIC]
                conn = cat.conn
                conn.execute("CREATE TEMP TABLE IF NOT EXISTS gone_packs (id TEXT PRIMARY KEY)")
                conn.execute("DELETE FROM gone_packs")
                conn.executemany("INSERT INTO gone_packs VALUES (?)", [(p,) for p in moving | {UNLOCATED}])
                # A blob whose pack is gone (or avoided), or not located yet, moves to another pack that holds it, if one does.
                conn.executemany(
                    "INSERT INTO blobs (hash, raw_len, pack, offset, stored_len, codec, created_at) VALUES (?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(hash, raw_len) DO UPDATE SET pack = excluded.pack, offset = excluded.offset, "
                    "stored_len = excluded.stored_len, codec = excluded.codec WHERE blobs.pack IN (SELECT id FROM gone_packs)",
                    rows,
                )
                self._replace_marked(rows)
                if gone:  # rows of blobs found nowhere go, unless a cached commit refers to them (its reads fail, clearly)
                    conn.execute("DELETE FROM gone_packs WHERE id NOT IN ({})".format(",".join("?" * len(gone))), list(gone))
                    conn.execute("DELETE FROM blobs WHERE pack IN (SELECT id FROM gone_packs) AND id NOT IN (SELECT blob_id FROM shards)")
                    conn.execute("DELETE FROM packs WHERE id IN (SELECT id FROM gone_packs) AND id NOT IN (SELECT pack FROM blobs)")
        if todo:
            self._refigure()
        return len(todo)

    def _replace_marked(self, rows: list[tuple]) -> None:
        """In the refresh's transaction: a row marked bad (``bad_blobs``: a read here failed)
        whose address ``rows`` (newest pack first) hold in another place moves to the newest
        such copy, and its mark goes (a read of that copy marks it again if it is bad too)."""
        conn = self.catalog.conn
        marked = {(bytes(h), n): (i, p, o) for i, h, n, p, o in conn.execute(
            "SELECT b.id, b.hash, b.raw_len, x.pack, x.offset FROM bad_blobs x JOIN blobs b ON b.id = x.blob_id").fetchall()}
        if not marked:
            return
        for h, n, pid, offset, stored_len, codec, _ in rows:
            bad = marked.get((h, n))
            if bad is not None and (pid, offset) != bad[1:]:
                conn.execute("UPDATE blobs SET pack = ?, offset = ?, stored_len = ?, codec = ? WHERE id = ?", (pid, offset, stored_len, codec, bad[0]))
                conn.execute("DELETE FROM bad_blobs WHERE blob_id = ?", (bad[0],))
                del marked[(h, n)]

    def _cache(self, cids: list[str], lineage: bool = False, packs: list[str] | None = None, limit: int | None = None) -> None:
        """Copy the records of ``cids`` (and, with ``lineage``, of their ancestors) from the
        bucket into the cache, each checked against its id: records and refs only, no
        ``.idx`` but those of ``packs`` (:meth:`index_records`). Ancestors the bucket lacks are
        skipped (a GC dropped them: the lineage ends there). ``packs``: where their blobs
        are, as a tag says. ``limit``: with ``lineage``, only
        the ``limit`` newest commits of the lineage (a best-first walk by time, which is
        lineage order: a record is dated after its parents), so ``log(limit=k)`` fetches
        about k records, each generation's in parallel."""
        records: dict[str, Any] = {}
        seen: set[str] = set()
        heap: list[tuple[float, str]] = []
        required = set(cids)

        def fetch(c: str):
            try:
                return c, fetch_record(self.backend, c)
            except IntegrityError:
                if c in required or self.backend.head(commit_key(c)) is not None:
                    raise  # damaged, or a commit asked for by name
                return c, None  # an ancestor a GC dropped: the lineage ends there

        def visit(batch: list[str]) -> None:
            new = [c for c in dict.fromkeys(batch) if c not in seen]
            seen.update(new)
            for c in new:
                if self.has_cached(c):
                    t = self.catalog.rows("SELECT created_at FROM commits WHERE id = ?", (c,), raw=True)[0][0]
                    heapq.heappush(heap, (-t, c))
            for c, rec in self.requests.map(fetch, [c for c in new if not self.has_cached(c)]):
                if rec is not None:
                    records[c] = rec
                    heapq.heappush(heap, (-rec.created_at, c))

        visit(list(cids))
        taken = 0
        while heap and lineage and (limit is None or taken < limit):
            _, c = heapq.heappop(heap)
            taken += 1
            if c in records:
                visit(list(records[c].parents))
            else:
                visit([r[0] for r in self.catalog.rows("SELECT parent_id FROM parents WHERE commit_id = ?", (c,), raw=True)])
        self.index_records(records, packs)

    def index_records(self, records: dict[str, Any], packs: list[str] | None = None, located_only: bool = False) -> None:
        """Copy verified commit records (``{commit id: CommitRecord}``) into the cache, parents
        before children (time order). A blob no ``.idx`` the cache has read holds gets a row
        in :data:`UNLOCATED` (a listing reads records and refs only; :meth:`refresh_index`
        locates it when a checkout, commit, fsck, GC or ``du`` needs it), so copying costs
        no request but those of the indexes of ``packs`` (a tag's hint), read first if any
        blob is not located. ``located_only`` (recover, which has read every index): a
        record with a blob in no pack index is left out of the cache instead.
        """
        records = dict(sorted(records.items(), key=lambda kv: -kv[1].created_at))
        todo = list(reversed(records))  # parents before children
        if not todo:
            return
        if packs and not located_only and len(self._located(k for c in todo for leaf in records[c].leaves for k in leaf.keys)[1]):
            self.refresh_index(packs)
        for c in todo:
            rec = records[c]
            components, leaves = recreate(rec)
            keys = [k for leaf in leaves for k in leaf.keys]
            rows = self.locate(list(dict.fromkeys(keys)))  # rows in UNLOCATED included
            if located_only and (len(rows) < len(set(keys)) or any(loc.pack == UNLOCATED for loc in rows.values())):
                continue
            absent = [k for k in dict.fromkeys(keys) if k not in rows]

            given = ({k: BlobLoc(k[0], k[1], UNLOCATED, 0, 0, 0) for k in absent}, [(UNLOCATED, 0)]) if absent else None
            self._copying.on = True
            try:
                self._copy_commit(c, rec, components, leaves, keys, given)
            finally:
                self._copying.on = False
            self._figures(c, keys, rec.parents)

    def _copy_commit(self, cid: str, rec: Any, components: list, leaves: list, keys: list, given: tuple | None) -> None:
        """Index commit ``cid`` of the bucket (its verified record ``rec``, recreated as
        ``components``, ``leaves`` and shard addresses ``keys``) in the cache: the commit's
        index step (:meth:`~ckptstore.home.base.Home.index_commit`) for a commit made elsewhere,
        with its own id, parents and time, writing no blob. ``given``: ``({address: BlobLoc},
        packs)`` of the blobs no index the cache has read holds (:data:`UNLOCATED`).

        Raises:
            BlobMissingError: a blob the cache neither holds nor was given (one marked bad).
            StoreWriteError: the cache cannot be written here.
            InvalidNameError / InvalidArgumentError / IntegrityError: the record's leaves do not
                check out, or its content does not hash to ``cid``.
        """
        if not self.open_catalog(create=True).writable:
            raise StoreWriteError(f"{self.root} is read-only here (mount, permissions or a full disk): it can be read, not committed to")
        check_checkable(components, leaves)
        t0, meta_json = time.perf_counter(), jsonvalue.dumps(rec.metadata, "metadata")
        locs, given_packs = given or ({}, [])
        known = self.lookup(list(dict.fromkeys(keys)))
        written = {k: loc for k, loc in locs.items() if k not in known}
        absent = [k for k in dict.fromkeys(keys) if k not in known and k not in written]
        relocated: set = set()
        while True:
            if absent:
                raise BlobMissingError(f"{self.url}: commit {cid}: blob {address(*absent[0])} is in no pack index of the store")
            try:
                self.index_commit(components, leaves, keys, known, written, _NoPacks, [], rec.message, meta_json, list(rec.parents),
                                  rec.created_at, t0, cid, given_packs)
                return
            except ReusedBlobsGone as gone:  # a GC removed them meanwhile: found elsewhere, or missing
                for k in gone.keys:
                    known.pop(k, None)
                    written.pop(k, None)
                again = self.relocate_reused([k for k in gone.keys if k not in relocated])
                relocated.update(again)
                known.update(again)
                absent = [k for k in gone.keys if k not in again]

    def _located(self, keys) -> tuple[dict, list]:
        """``({address: BlobLoc}, [addresses not located])`` of ``keys`` as the cache holds them
        (a row in :data:`UNLOCATED`, or none, is not located)."""
        keys = list(dict.fromkeys(keys))
        where = {k: loc for k, loc in self.locate(keys).items() if loc.pack != UNLOCATED}
        return where, [k for k in keys if k not in where]

    def _refigure(self) -> None:
        """``stored_bytes`` of the copied commits whose new blobs were not located when they
        were copied (:meth:`_figures`), now that the index may hold them."""
        for (cid,) in self.catalog.rows("SELECT id FROM commits WHERE stored_bytes IS NULL", raw=True):
            try:
                rec = self.record(cid)
            except IntegrityError:
                continue  # a damaged cache row: its checkout and fsck report it
            self._figures(cid, [k for leaf in rec.leaves for k in leaf.keys], rec.parents)

    def _figures(self, cid: str, keys: list, parents: list[str]) -> None:
        """A copied commit's ``new_bytes`` / ``shards_new`` / ``stored_bytes``: its blobs no
        parent holds (the same on every machine; the bucket does not keep what the
        committing machine measured, and ``seconds`` stays 0). ``stored_bytes`` is NULL
        (``None`` in its CommitInfo) while one of those blobs is not located (:data:`UNLOCATED`)."""
        had: set = set()
        for p in parents:
            try:
                rec = self.record(p) if self.has_cached(p) else fetch_record(self.backend, p)
            except (IntegrityError, RefNotFoundError):
                continue  # dropped by a GC: the lineage ends there
            had.update(k for leaf in rec.leaves for k in leaf.keys)
        new = [k for k in dict.fromkeys(keys) if k not in had]
        where, unlocated = self._located(new)
        stored = None if unlocated else sum(BLOB_HEADER.size + loc.stored_len for loc in where.values())
        with self.catalog.write():
            self.catalog.conn.execute(
                "UPDATE commits SET new_bytes = ?, shards_new = ?, stored_bytes = ? WHERE id = ?", (sum(n for _, n in new), len(new), stored, cid),
            )


__all__ = ["UNLOCATED", "BucketCache", "cache_folder"]
