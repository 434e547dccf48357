"""The home of a store on object storage: ``Store("s3://bucket/prefix")``
(docs/design.md, "Object storage" and "A store on object storage").

:class:`BucketHome` is the :class:`~ckptstore.home.Home` that the
:class:`~ckptstore.store.Store` facade runs on for an ``s3://`` location: the three parts of
a home for object storage, everything else (the commit protocol, adapters, sharding,
hashing, the manifest, checkout's planning and restoring, GC and fsck) shared with the
local store:

- **objects**: new blobs go into packs assembled in memory (:class:`~ckptstore.remote.BucketPackWriter`, shared with push),
  each put whole with a create-only PUT, then its ``.idx``; reads are ranged GETs of
  only the needed blobs, coalesced and in parallel (:class:`BucketReader`), each checked
  against its entry header and rehashed;
- **refs**: tags live on the bucket (``refs/<tag>``) and move by compare-and-swap
  (:class:`~ckptstore.refs.BucketRefs`, the facade's ``refs``); a commit takes the
  tag's current commit as its parent, and a lost race rebuilds the record on the new
  parent and tries again (bounded: ``RefBusyError``);
- **the index**: a SQLite catalog of the local store's schema under the user's cache
  folder (:func:`cache_folder`) holds copies of the pack indexes and of the commit
  records, so dedup lookups and blob lookups cost no round trips. Every row is a copy
  of an immutable object on the bucket (or a mirror of a ref read from it): deleting
  the folder loses nothing. Tags are always read from the bucket before a move, a
  checkout or a listing (a listing reads only the refs whose ETag changed). The home's
  queries (``held``, ``find_commit``, ``tagged``, ``info``, ``infos``, ``log``, ``show``,
  ``du``) copy the records they need into the cache, then answer from it as
  :class:`~ckptstore.home.Home` does. A record is copied without reading every pack's
  ``.idx``: a blob no index the cache has read holds gets a row in :data:`UNLOCATED`,
  located when a checkout, commit, fsck, GC or ``du`` needs it (:meth:`BucketHome.refresh_index`),
  so ``log(ref, limit=k)``, ``info``, ``show`` and ``tagged`` cost O(k) requests, not
  O(packs). Liveness never comes from these rows: GC reads every record and ``.idx``.

The bucket is the truth: a commit exists once ``commits/<xx>/<cid>`` exists and is
reachable once a ref names it (order: packs, ``.idx``, record, ref CAS, reflog object).
After its record is on the bucket and before its CAS, a commit checks every pack it
relies on (new and reused) against the GC marks (``gc/*.json``) and that the pack still
exists; a blob in a marked or missing pack is written again, so a commit slower than the
grace period loses nothing. GC marks, then sweeps a grace period later (:class:`BucketGC`, the primitives of :mod:`ckptstore.gc`). Tags are read
from the refs alone, revalidated by one listing of their ETags.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import re
import shutil
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .backends import Backend, open_backend
from .catalog import drop_commit_rows
from .errors import (
    BlobCorruptError,
    BlobMissingError,
    IntegrityError,
    NotAStoreError,
    ObjectNotFoundError,
    RefBusyError,
    RefConflictError,
    RefNotFoundError,
)
from .fsck import FsckSide
from .gc import GCReport, GCSide, PackStat, packed
from .layout import RANDOM, address, digest
from .packindex import INDEX_ENTRY, INDEX_HEADER, index_key, pack_key
from .packindex import TRAILER as INDEX_TRAILER
from .packs import (
    BLOB_HEADER,
    BLOB_MAGIC,
    BlobLoc,
    Entry,
    check_entry,
    decode_entry,
)
from .records import recreate
from .refs import CAS_SECONDS, BucketRefs
from .remote import (
    MARKER,
    PACK_BYTES,
    UPLOADS,
    BucketPackWriter,
    commit_key,
    complete_marker,
    ensure_marker,
    fetch_record,
    marker_problem,
    pack_entries,
    parse_reflog,
    read_marker,
    read_tag,
    repair_index,
    repair_marker,
)
from .remote import resolve as resolve_remote
from .commit import CommitInfo, ReusedBlobsGone
from .home import Home, weakly
from .threads import Pool

#: Seconds: a cached commit the bucket's listing lacks is forgotten only once this old (its record may be in flight).
FORGET_AFTER = 3600.0
#: Parallel small requests (heads, refs, indexes); packs upload ``UPLOADS`` at a time.
REQUESTS = 16
#: The pack of a cache ``blobs`` row whose blob no ``.idx`` this cache has read holds yet: a
#: commit record copied for a listing (``log``, ``tagged``, ``info``) is cached without reading
#: every pack's index; :meth:`BucketHome.refresh_index` fills these rows in when a checkout,
#: a commit, fsck, GC or ``du`` needs locations. Never a pack id (those are 32 hex digits).
UNLOCATED = "unlocated"
_CID = re.compile(r"[0-9a-f]{32}")


def cache_folder(url: str) -> Path:
    """The local cache of store ``url``: ``$XDG_CACHE_HOME/ckptstore/<hash>`` (default
    ``~/.cache``), one per endpoint (``AWS_ENDPOINT_URL``), bucket and prefix."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ckptstore" / digest(f"{os.environ.get('AWS_ENDPOINT_URL', '')}|{url}".encode()).hex()


class BucketReader:
    """:class:`~ckptstore.packs.PackReader`'s interface for object storage.

    :meth:`prefetch` fetches the announced blobs with one coalesced, parallel ranged read
    per pack (:meth:`~ckptstore.backends.Backend.get_ranges`); each read then checks the
    entry header against the catalog's location, decodes and rehashes (invariant 5). A
    blob whose pack is gone (a GC swept it after repacking), or that the cache has not
    located yet (:data:`UNLOCATED`: once per reader), is looked up again after the cache
    has been refreshed from the bucket.
    """

    def __init__(self, home: BucketHome):
        self.home, self.backend = home, home.backend
        self._got: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()
        self._refreshed = False  # this reader brought the cache's index up to date for an unlocated blob
        self.blobs_read = 0
        self.bytes_read = 0

    def prefetch(self, locs: list[BlobLoc]) -> None:
        by_pack: dict[str, list[BlobLoc]] = {}
        for loc in locs:
            if loc.pack != UNLOCATED:  # located when read (_found)
                by_pack.setdefault(loc.pack, []).append(loc)

        def fetch(item: tuple[str, list[BlobLoc]]) -> None:
            pid, group = item
            try:
                bufs = self.backend.get_ranges(pack_key(pid), [loc.span for loc in group])
            except ObjectNotFoundError:
                return  # read_into finds the blob elsewhere, or reports it
            with self._lock:
                for loc, buf in zip(group, bufs):
                    self._got[(pid, loc.offset)] = buf

        list(self.home.requests.map(fetch, by_pack.items()))

    def _entry(self, loc: BlobLoc, where: str):
        with self._lock:
            buf = self._got.pop((loc.pack, loc.offset), None)
        if buf is None and loc.pack == UNLOCATED:
            raise BlobMissingError(f"{where}: no pack index of {self.backend.url} that the cache has read holds it")
        if buf is None:
            try:
                buf = self.backend.get_ranges(pack_key(loc.pack), [loc.span])[0]
            except ObjectNotFoundError:
                raise BlobMissingError(f"{where}: pack {loc.pack} is not on {self.backend.url}") from None
        with self._lock:
            self.blobs_read += 1
            self.bytes_read += len(buf)
        return memoryview(buf).cast("B")

    def _read(self, loc: BlobLoc, dest: memoryview, where: str, verify: bool, magic: bytes) -> None:
        where = f"{where}, blob {loc.address}"
        if len(dest) != loc.raw_len:
            raise BlobCorruptError(f"{where}: destination holds {len(dest)} bytes, blob {loc.raw_len}")
        view = self._entry(loc, where)
        decode_entry(view[: BLOB_HEADER.size], view[BLOB_HEADER.size :], loc, dest, where, verify, magic)

    def _found(self, loc: BlobLoc, read) -> tuple[BlobLoc, Any]:
        """``(where, read(where))``: ``loc``, or where the blob is now when its pack is gone."""
        try:
            return loc, read(loc)
        except BlobMissingError:
            if loc.pack != UNLOCATED or not self._refreshed:  # an unlocated blob: every new .idx read once per reader
                self.home.refresh_index()
                self._refreshed = True
            moved = self.home.store.relocate(loc)
            if moved is None or moved == loc:
                raise
            return moved, read(moved)

    def read_into(self, loc: BlobLoc, dest: memoryview, where: str, verify: bool = True, magic: bytes = BLOB_MAGIC) -> BlobLoc:
        """Read blob ``loc`` into ``dest``; returns where it was read (see :class:`~ckptstore.packs.PackReader`)."""
        return self._found(loc, lambda at: self._read(at, dest, where, verify, magic))[0]

    def stored(self, loc: BlobLoc, where: str) -> bytes:
        """The entry of blob ``loc`` as stored (header and payload), after checking its
        header and rehashing it (:func:`~ckptstore.packs.check_entry`): what push, pull and
        export copy.

        Raises:
            BlobMissingError: its pack is gone and no other pack holds it.
            BlobCorruptError: its header or bytes do not match.
        """
        where = f"{self.backend.url}: {where}"
        at, view = self._found(loc, lambda at: self._entry(at, where))
        check_entry(view, at, where)
        return bytes(view)

    def read(self, loc: BlobLoc, where: str, verify: bool = True, magic: bytes = BLOB_MAGIC) -> bytearray:
        out = bytearray(loc.raw_len)
        self.read_into(loc, memoryview(out), where, verify, magic)
        return out

    def close(self) -> None:
        with self._lock:
            self._got.clear()


class DetachedPackWriter(BucketPackWriter):
    """A :class:`~ckptstore.remote.BucketPackWriter` into ``s3://bucket/prefix`` with its
    own client and upload threads (:data:`UPLOADS` at a time), for a process that writes
    blobs of a commit another process makes and never opens the store (a DCP rank,
    :func:`ckptstore.store.pack_writer_at`). :meth:`close` releases the client and threads.

    Raises:
        NotAStoreError / BackendError: (from the uploads) a missing bucket, an unreachable server.
    """

    def __init__(self, url: str, level: int, pack_bytes: int):
        super().__init__(open_backend(url), level, pack_bytes, Pool(UPLOADS, thread_name_prefix="ckptstore-upload"))

    def close(self) -> None:
        super().close()
        self._uploads.shutdown()
        self.backend.close()


class BucketHome(Home):
    """The home of a store under ``s3://bucket/prefix``: ``Store("s3://…")`` builds one.

    The store (:class:`~ckptstore.store.Store`, the same class as for a folder) keeps its
    API (commit, checkout, tags, log, reflog, gc, fsck...), with these differences:

    - ``create``: the bucket is never created (a missing one is ``NotAStoreError``);
      an empty prefix becomes a store on the first commit (``ckptstore.json``). With
      ``create=False`` a prefix without ``ckptstore.json`` is ``NotAStoreError``.
    - ``pack_bytes``: packs roll over past this size (default 64 MiB; they upload in
      parallel, :data:`UPLOADS` at a time).
    - ``cache``: the folder of the local index (default :func:`cache_folder`).
    - ``gc``'s grace period defaults to 24 hours (:class:`BucketGC`).
    - ``push``, ``pull`` and ``export`` work as on a local store, to and from either home
      (a folder, or another prefix: :mod:`ckptstore.transfer`, :mod:`ckptstore.remote`);
      ``Store.recover("s3://…")`` rebuilds this cache from the bucket alone
      (:func:`ckptstore.recover.recover_bucket`).

    Credentials and endpoint come from the standard environment (``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ALLOW_HTTP``).

    Raises:
        NotAStoreError: a missing bucket, a foreign ``ckptstore.json``, or (``create=False``) none.
        BackendError: obstore is missing or the server cannot be reached.
    """

    pack_bytes = PACK_BYTES
    disposable_index = True

    def __init__(self, store, path: str, create: bool | None, cache: str | os.PathLike | None, backend: Backend | None):
        self.backend = backend if backend is not None else open_backend(path)
        self.url = self.backend.url
        try:
            self.marker = read_marker(self.backend)
            self._marker_complete = False
            if self.marker is None and create is False:
                raise NotAStoreError(f"{self.url} is not a ckptstore store (no {MARKER}; a first commit creates one)")
            self.uploads = Pool(UPLOADS, thread_name_prefix="ckptstore-upload")
            self.requests = Pool(REQUESTS, thread_name_prefix="ckptstore-request")
        except BaseException:
            self.backend.close()
            raise
        super().__init__(store, Path(cache or cache_folder(self.url)))
        self._index_lock = threading.Lock()
        self._indexed = False  # refresh_index ran in this object
        self._copying = threading.local()  # .on: this thread copies a commit of the bucket into the cache
        #: Packs the last refreshes could not index from their ``.idx`` (walked instead) or not at all: ``{pack id: PackEntries}``.
        self.pack_problems: dict[str, Any] = {}

    def settings(self, shard_bytes: int | None, compression_level: int | None) -> tuple[int | None, int | None]:
        """The settings asked, else the marker's (``ckptstore.json``)."""
        if self.marker is not None:
            shard_bytes = shard_bytes or self.marker.get("shard_bytes")
            compression_level = self.marker.get("compression_level") if compression_level is None else compression_level
        return shard_bytes, compression_level

    def create_index(self, create: bool | None) -> bool:
        """The cache is created on opening (it holds only copies)."""
        return True

    def discard_index(self) -> None:
        """Move a damaged cache aside and delete it (it holds only copies of the bucket)."""
        folder = self.root
        aside = folder.with_name(f"{folder.name}.damaged-{uuid.uuid4().hex[:8]}")
        try:
            folder.replace(aside)
        except FileNotFoundError:
            pass  # another process moved it first
        shutil.rmtree(aside, ignore_errors=True)

    def make_refs(self) -> BucketRefs:
        """Tags on the bucket (``refs/<tag>``), mirrored into the cache."""
        return BucketRefs(self.backend, *weakly(self.store, "catalog"), self.root, self.requests,
                          *weakly(self, "_has_store", "_need_store", "_packs_of"))

    @property
    def location(self) -> str:
        """``s3://bucket/prefix``: where the store lives (its cache is only a copy)."""
        return self.url

    def close(self) -> None:
        """Release the upload and request threads and the client."""
        self.uploads.shutdown()
        self.requests.shutdown()
        self.backend.close()

    def _has_store(self) -> bool:
        """Does the prefix hold a store (its marker)?"""
        return self.marker is not None or read_marker(self.backend) is not None

    def _need_store(self) -> None:
        if self.marker is None:
            self.marker = read_marker(self.backend)
            if self.marker is None:
                raise NotAStoreError(f"{self.url} is not a ckptstore store yet (no {MARKER}; a first commit creates one)")

    # --- objects -----------------------------------------------------------------------------

    def pack_writer(self) -> BucketPackWriter:
        return BucketPackWriter(self.backend, self.store.compression_level, self.store.pack_bytes, self.uploads)

    def pack_reader(self, sparse: bool = False) -> BucketReader:
        return BucketReader(self)

    def pack_size(self, pack: str) -> int | None:
        info = self.backend.head(pack_key(pack))
        return None if info is None else info.size

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
        (:func:`~ckptstore.remote.pack_entries`); one that cannot be read at all is left
        out (fsck reports it), so a damaged object affects only what needs it.

        Raises:
            BackendError: the storage failed.
        """
        with self._index_lock:
            cat = self.store.catalog
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
                rows = [(e.loc.digest, e.loc.raw_len, pid, e.loc.offset, e.loc.stored_len, e.loc.codec, packs[pid].mtime)
                        for pid, es in entries.items() if pid not in avoid for e in es if e.magic == BLOB_MAGIC]
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
                if gone:  # rows of blobs found nowhere go, unless a cached commit refers to them (its reads fail, clearly)
                    conn.execute("DELETE FROM gone_packs WHERE id NOT IN ({})".format(",".join("?" * len(gone))), list(gone))
                    conn.execute("DELETE FROM blobs WHERE pack IN (SELECT id FROM gone_packs) AND id NOT IN (SELECT blob_id FROM shards)")
                    conn.execute("DELETE FROM packs WHERE id IN (SELECT id FROM gone_packs) AND id NOT IN (SELECT pack FROM blobs)")
        if todo:
            self._refigure()
        return len(todo)

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
                if self.store.has_cached(c):
                    t = self.store.catalog.rows("SELECT created_at FROM commits WHERE id = ?", (c,), raw=True)[0][0]
                    heapq.heappush(heap, (-t, c))
            for c, rec in self.requests.map(fetch, [c for c in new if not self.store.has_cached(c)]):
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
                visit([r[0] for r in self.store.catalog.rows("SELECT parent_id FROM parents WHERE commit_id = ?", (c,), raw=True)])
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
            rows = self.store.locate(list(dict.fromkeys(keys)))  # rows in UNLOCATED included
            if located_only and (len(rows) < len(set(keys)) or any(loc.pack == UNLOCATED for loc in rows.values())):
                continue
            absent = [k for k in dict.fromkeys(keys) if k not in rows]

            def missing(writer, key, c=c):
                raise BlobMissingError(f"{self.url}: commit {c}: blob {address(*key)} is in no pack index of the store")

            given = ({k: BlobLoc(k[0], k[1], UNLOCATED, 0, 0, 0) for k in absent}, [(UNLOCATED, 0)]) if absent else None
            self._copying.on = True
            try:
                self.store.commit_manifest(components, leaves, keys, missing, [], rec.message, rec.metadata, None, time.perf_counter(),
                                           origin=(c, rec.parents, rec.created_at), written=given)
            finally:
                self._copying.on = False
            self._figures(c, keys, rec.parents)

    def _located(self, keys) -> tuple[dict, list]:
        """``({address: BlobLoc}, [addresses not located])`` of ``keys`` as the cache holds them
        (a row in :data:`UNLOCATED`, or none, is not located)."""
        keys = list(dict.fromkeys(keys))
        where = {k: loc for k, loc in self.store.locate(keys).items() if loc.pack != UNLOCATED}
        return where, [k for k in keys if k not in where]

    def _refigure(self) -> None:
        """``stored_bytes`` of the copied commits whose new blobs were not located when they
        were copied (:meth:`_figures`), now that the index may hold them."""
        for (cid,) in self.store.catalog.rows("SELECT id FROM commits WHERE stored_bytes IS NULL", raw=True):
            try:
                rec = self.store.record(cid)
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
                rec = self.store.record(p) if self.store.has_cached(p) else fetch_record(self.backend, p)
            except (IntegrityError, RefNotFoundError):
                continue  # dropped by a GC: the lineage ends there
            had.update(k for leaf in rec.leaves for k in leaf.keys)
        new = [k for k in dict.fromkeys(keys) if k not in had]
        where, unlocated = self._located(new)
        stored = None if unlocated else sum(BLOB_HEADER.size + loc.stored_len for loc in where.values())
        with self.store.catalog.write():
            self.store.catalog.conn.execute(
                "UPDATE commits SET new_bytes = ?, shards_new = ?, stored_bytes = ? WHERE id = ?", (sum(n for _, n in new), len(new), stored, cid),
            )

    def before_commit(self) -> None:
        """The first commit of this store object brings the cache's blob index up to date
        first, so that a fresh machine uploads only what the bucket lacks."""
        if getattr(self._copying, "on", False):
            return
        if not self._indexed:
            self.refresh_index()
        for sub in ("blobs", "tmp"):  # the cache folder may have been deleted under us: it holds only copies
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def dated(self, info):
        """The commit's time as its record says: dated when it was built, after its parents were read."""
        if getattr(self._copying, "on", False):
            return info
        at = self.store.catalog.rows("SELECT created_at FROM commits WHERE id = ?", (info.id,), raw=True)[0][0]
        return replace(info, created_at=at)

    def has_commit(self, cid: str) -> bool:
        """Does the bucket hold commit ``cid`` (a full id)?"""
        return self.store.has_cached(cid) or (type(cid) is str and bool(_CID.fullmatch(cid)) and self.backend.head(commit_key(cid)) is not None)

    # --- commit ------------------------------------------------------------------------------

    def prepare_shared_commit(self) -> None:
        """The home's part of :meth:`~ckptstore.store.Store.prepare_shared_commit`: the bucket holds
        ``ckptstore.json`` (written now if missing, so that the other processes' packs land in
        a store a GC can collect), and the cache indexes every pack on the bucket (one listing,
        the ``.idx`` of each pack not seen before).

        Raises:
            BackendError: the storage failed.
        """
        if self.marker is None:
            ensure_marker(self.backend, self.store)
            self.marker = read_marker(self.backend)
        self.refresh_index()

    def _check_packs(self, known: dict, written: dict) -> None:
        """After the commit's record is on the bucket and before its ref CAS (invariant 6):
        no blob it relies on, reused (``known``) or new (``written``), may sit in a pack a
        GC marked or swept; those are raised as :class:`~ckptstore.store.ReusedBlobsGone`
        and written again. Checked after the record exists, a pack no mark names now can
        be marked only by a GC that lists the record at its sweep and so keeps the pack,
        whatever the grace period and however slow the commit was until now."""
        where = self.store.locate(list(known)) if known else {}
        packs = ({loc.pack for loc in where.values()} | {loc.pack for loc in written.values()}) - {UNLOCATED}
        marked = self.marked_packs() if packs else set()
        if len(packs) > REQUESTS:  # one listing costs less than many HEADs
            listed = {o.key for o in self.backend.list("blobs")}
            present = {p: pack_key(p) in listed for p in packs}
        else:
            present = dict(zip(packs, self.requests.map(lambda p: self.backend.head(pack_key(p)) is not None, packs)))
        bad = {p for p in packs if p in marked or not present[p]} | {UNLOCATED}  # a blob never located: found again, or written again
        gone = [k for k in known if k not in where or where[k].pack in bad] + [k for k, loc in written.items() if loc.pack in bad]
        if gone:
            raise ReusedBlobsGone(gone)

    def relocate_reused(self, keys: list[tuple[bytes, int]]) -> dict[tuple[bytes, int], int]:
        """Blob ids of those of ``keys`` (addresses a commit meant to reuse from packs a GC
        has marked or swept) that another, unmarked pack on the bucket holds: a GC's repack
        copies a pack's live blobs before it marks the pack. Their cache rows move there
        (:meth:`refresh_index` with ``avoid``); the commit writes only the others again.

        Raises:
            BackendError: the storage failed.
        """
        marked = self.marked_packs()
        self.refresh_index(avoid=marked)
        where = self.store.locate(list(keys))
        held = {o.key for o in self.backend.list("blobs")}  # a row may still name a pack gone from the bucket
        return self.store._lookup([k for k, loc in where.items() if loc.pack not in marked and pack_key(loc.pack) in held])

    def marked_packs(self) -> set[str]:
        """Pack ids a GC mark (``gc/*.json``) names; every listed pack if a mark is unreadable."""
        out: set[str] = set()
        for o in self.backend.list("gc"):
            try:
                mark = json.loads(self.backend.get(o.key))
                out.update(p for p in mark["packs"] if type(p) is str)
            except ObjectNotFoundError:
                continue  # swept and removed meanwhile
            except (ValueError, KeyError, TypeError):
                return {r[0] for r in self.store.catalog.rows("SELECT id FROM packs", raw=True)}
        return out

    def index_commit(self, components, leaves, keys, known, written, writer, tags, message, meta_json, explicit_parents, created_at, t0,
                     expect=None, given_packs=()):
        """Step 4 on object storage: check the reused packs, index the commit in the cache,
        put its record, then compare-and-swap each tag (a lost race rebuilds the record on
        the tag's new commit and tries again)."""
        if getattr(self._copying, "on", False):  # a commit of the bucket copied into the cache
            return super().index_commit(components, leaves, keys, known, written, writer, tags, message, meta_json, explicit_parents,
                                        created_at, t0, expect, given_packs)
        if self.marker is None:
            ensure_marker(self.backend, self.store)
            self.marker = read_marker(self.backend)
        elif not self._marker_complete:  # once per process: the first writer may have been killed between the copy and the marker
            complete_marker(self.backend)
        self._marker_complete = True
        if known and self.store.catalog.rows("SELECT 1 FROM blobs WHERE pack = ? LIMIT 1", (UNLOCATED,), raw=True) and self._located(known)[1]:
            self.refresh_index()  # reused blobs a listing copied without their places: located before the record goes out
        if written:  # blobs written again after a GC marked their old pack: the cache points here now
            with self.store.catalog.write():
                self.store.catalog.db["packs"].insert_all(  # first: a blob row must name a known pack (foreign key)
                    ({"id": pid, "size": size, "created_at": created_at} for pid, size in writer.pack_ids), ignore=True
                )
                self.store.catalog.conn.executemany(
                    "UPDATE blobs SET pack = ?, offset = ?, stored_len = ?, codec = ? WHERE hash = ? AND raw_len = ?",
                    [(loc.pack, loc.offset, loc.stored_len, loc.codec, loc.digest, loc.raw_len) for loc in written.values()],
                )
        deadline = time.monotonic() + CAS_SECONDS
        before: dict[str, str | None] = {}  # tag -> the commit it named before this call moved it
        ours: set[str] = set()  # the records this call built (a lost race on one tag rebuilds it on new parents)
        delay = 0.01
        while True:
            # Every tag is re-read each attempt: one moved by an earlier attempt is moved on to this attempt's record,
            # so that all of them name one commit when the call returns. Our own earlier records are no parents.
            current = self.store.refs.versions(tags)
            if explicit_parents is not None:
                parents = explicit_parents
            else:
                parents = list(dict.fromkeys(p for t, (c, _) in current.items() for p in [before.get(t) if c in ours else c] if p))
            if expect is None:  # dated after its parents' moves were read: time order is lineage order
                created_at = time.time()
            cid, parent_ids, seconds, ids = super().index_commit(components, leaves, keys, known, written, writer, [], message, meta_json,
                                                                 parents, created_at, t0, expect, given_packs)
            ours.add(cid)
            text = self.store.catalog.rows("SELECT record FROM commits WHERE id = ?", (cid,))[0][0]
            self.backend.put_new(commit_key(cid), text.encode())
            self._check_packs(known, written)
            packs = self._packs_of(cid)
            lost = False
            for t in tags:
                old, version = current[t]
                if old == cid:
                    continue
                try:
                    self.store.refs.swap(t, old, version, cid, "commit", packs)  # dated when sent, not the commit's time
                except RefConflictError:
                    lost = True
                    break
                before.setdefault(t, old)
            if not lost:
                break
            if time.monotonic() > deadline:
                raise RefBusyError(f"{self.url}: tags {', '.join(repr(t) for t in tags)} kept moving for {CAS_SECONDS:.0f} s: "
                                   f"commit {cid} is stored but they may not all name it")
            time.sleep(delay * RANDOM.uniform(0.5, 1.5))
            delay = min(delay * 2, 1.0)
        self.store.refs.mirror({t: cid for t in tags})
        return cid, parent_ids, seconds, ids

    def _packs_of(self, cid: str | None) -> list[str]:
        """Ids of the packs holding commit ``cid``'s blobs, as the cache knows them once it has
        located them (:meth:`_locate_commit`): a tag's hint."""
        if cid is None:
            return []
        return sorted({loc.pack for loc in self._locate_commit(cid).values()})

    def _locate_commit(self, cid: str) -> dict:
        """``{address: BlobLoc}`` of the blobs of cached commit ``cid`` that the bucket's packs
        hold, after reading the indexes its tag's hint names, then every new ``.idx``, if
        some were not located yet (:data:`UNLOCATED`). Blobs in no pack are left out.

        Raises:
            BackendError: the storage failed.
        """
        keys = [k for leaf in self.store.record(cid).leaves for k in leaf.keys]
        where, unlocated = self._located(keys)
        hint = self.store.refs.hint(cid)
        if unlocated and hint:
            self.refresh_index(hint)
            where, unlocated = self._located(keys)
        if unlocated:
            self.refresh_index()
            where, unlocated = self._located(keys)
        return where

    def tagged(self) -> dict:
        """``{tag name: CommitInfo}`` as on the bucket now. A tag whose commit record is
        missing or damaged is listed all the same, its info saying so (``created_at`` 0,
        no parents, zero counts): listing tags never depends on the state of the commits."""
        named = self.store.tags()
        for cid in dict.fromkeys(named.values()):
            try:
                self._cache([cid])
            except IntegrityError:
                pass  # listed all the same, below; checking it out raises the error, and fsck reports it
        self.store.refs.mirror(named)
        infos = self.index_infos(list(set(named.values())))  # copied above: a damaged record is listed, not fetched again
        unreadable = "(the commit record is missing or damaged: see `ckptstore fsck --deep`)"
        return {name: infos.get(cid) or CommitInfo(cid, (name,), (), 0.0, unreadable, {}, 0, 0, 0, 0, 0, 0.0) for name, cid in named.items()}

    def held(self, cid: str) -> str:
        """``cid`` (named by a tag), once its record is in the cache (copied from the bucket,
        reading only the indexes of the packs its tag names, if it named any)."""
        self._cache([cid], packs=self.store.refs.hint(cid))
        return cid

    def find_commit(self, ref: str) -> str:
        """The commit a full id or unique id prefix ``ref`` names on the bucket; its record is then in the cache."""
        cid, _ = resolve_remote(self.backend, ref)
        self._cache([cid])
        return cid

    def info(self, ref: str):
        cid = self.store.resolve(ref)
        self.store.tags()
        return self.index_infos([cid])[cid]  # resolve copied it

    def infos(self, ids: list[str]):
        """As :meth:`~ckptstore.store.Store.infos`, the records of ``ids`` the cache lacks copied from the bucket
        first (one HEAD each; ids the bucket does not hold are left out).

        Raises:
            BackendError: the storage failed.
        """
        self._need_store()
        todo = [c for c in dict.fromkeys(ids) if not self.store.has_cached(c) and self.has_commit(c)]
        if todo:
            self._cache(todo)
        return self.index_infos(ids)

    def log(self, ref: str | None = None, limit: int | None = None):
        """Lineage of ``ref`` on the bucket (every commit without ``ref``: every record
        fetched), newest first; with ``ref`` and ``limit``, about ``limit`` records are
        fetched and no pack index but those the tag names (:meth:`_cache`)."""
        if limit is not None and (type(limit) is not int or limit < 1):
            return super().log(ref, limit)  # the facade's error for a bad limit
        refs = self.store.refs.read_all(strict=False) if self._has_store() else {}
        if ref is None:
            ids = [o.key.rsplit("/", 1)[1] for o in self.backend.list("commits")]
            self._cache([c for c in ids if _CID.fullmatch(c)])
            # A commit is indexed in the cache just before its record is put: in a cache folder shared with a writer,
            # only a commit older than FORGET_AFTER that the listing lacks is one the bucket lost.
            rows = self.store.catalog.rows("SELECT id FROM commits WHERE created_at < ?", (time.time() - FORGET_AFTER,), raw=True)
            listed = set(ids)
            self.forget([r[0] for r in rows if r[0] not in listed])
            self.store.refs.mirror(refs, complete=True)
            return [c for c in super().log(None) if c.id in listed][:limit]  # (a younger one the bucket lost is not listed either)
        ref = self.store.resolve(ref)
        self._cache([ref], lineage=True, limit=limit)
        self.store.refs.mirror(refs, complete=True)
        return super().log(ref, limit)

    def show(self, ref: str) -> dict:
        cid = self.store.resolve(ref)
        try:
            self._cache(list(self.store.record(cid).parents[:1]))  # its first parent, for shared_with_parent
        except IntegrityError:
            pass  # not on the bucket (an imported commit, or dropped by a GC): nothing is shared
        out = super().show(cid)
        unlocated = {r[0] for r in self.store.catalog.rows(
            "SELECT DISTINCT l.path FROM commit_leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id WHERE l.commit_id = ? AND b.pack = ?",
            (cid, UNLOCATED), raw=True)}
        for leaf in out["leaves"]:
            if leaf["path"] in unlocated:
                leaf["stored_bytes"] = None  # not known here until the cache locates its blobs (a checkout of it does)
        return out

    def du(self) -> dict:
        """Space accounting of the bucket, as :meth:`~ckptstore.store.Store.du`: ``pack_bytes`` sums the
        packs and indexes under ``blobs/``, ``catalog_bytes`` the local cache, ``tmp_bytes`` 0."""
        self.log()  # every commit record cached, the ones the bucket lost forgotten
        self.refresh_index()
        listed = {o.key: o.size for o in self.backend.list("blobs")}
        packs = [k.rsplit("/", 1)[1][:-5] for k in listed if k.endswith(".pack")]
        usage = super().du()
        b = self.store.catalog.chunked("SELECT COUNT(*), COALESCE(SUM(raw_len), 0), COALESCE(SUM(stored_len + ?), 0) FROM blobs WHERE pack IN ({})",
                                 packs, (BLOB_HEADER.size,), raw=True) if packs else []
        n, raw, stored = (sum(r[i] for r in b) for i in range(3)) if b else (0, 0, 0)
        usage.update(packs=len(packs), pack_bytes=sum(listed.values()), blobs=n, unique_bytes=raw, stored_bytes=stored, tmp_bytes=0,
                     dedup_ratio=usage["logical_bytes"] / raw if raw else None, compression_ratio=raw / stored if stored else None)
        return usage

    def forget(self, cids: list[str]) -> None:
        """Drop commits from the cache (the bucket no longer holds them)."""
        if not cids:
            return
        cat = self.store.catalog
        with cat.write():
            drop_commit_rows(cat, cids)  # (rows a kept commit shares move to it)
            cat.chunked("DELETE FROM tags WHERE commit_id IN ({})", cids)
            cat.chunked("DELETE FROM commits WHERE id IN ({})", cids)

    def checkout_target(self, ref: str) -> str:
        """``ref`` resolved on the bucket (its record copied into the cache, its blobs located) before checkout reads it."""
        cid = self.store.resolve(ref)
        self._locate_commit(cid)
        return cid

    # --- maintenance ----------------------------------------------------------------------------

    def gc_side(self) -> BucketGC:
        """This home's primitives of the GC protocol (:class:`BucketGC`: no lock, a mark swept a
        grace period later; ``grace`` defaults to 24 hours)."""
        self._need_store()
        return BucketGC(self.store)

    def fsck_side(self) -> BucketFsck:
        """This home's primitives of the fsck protocol (:class:`BucketFsck`)."""
        return BucketFsck(self)


class BucketFsck(FsckSide):
    """The primitives of the fsck protocol (:mod:`ckptstore.fsck`) on a bucket: the bucket's
    own objects (refs, ``commits/``, packs and their indexes, reflog, marker), never the cache."""

    def __init__(self, home: BucketHome):
        self.home, self.store, self.backend, self.requests = home, home.store, home.backend, home.requests
        self.url = self.location = home.url

    #: A commit's record is put before its ref moves: a killed commit may leave a record no tag reaches.
    attempts_leave_records = True
    #: Bytes: fsck rereads at most this much of one pack per ranged read (memory stays bounded).
    fsck_batch = 16 << 20

    def start(self, repair: bool) -> None:
        """Before any read: the prefix must hold a store (NotAStoreError); ``repair`` is allowed."""
        self.home._need_store()

    def resolve(self, ref: str) -> str:
        """The commit id ``ref`` (a tag or a full id) names on the bucket; nothing is copied into the cache."""
        cid = ref if type(ref) is str and _CID.fullmatch(ref) else None
        return cid if cid is not None else self.store.refs.read(ref) or resolve_remote(self.backend, ref)[0]

    def snapshot(self):
        """Nothing to hold: the objects are immutable, and the tags are read before the records they name."""
        return contextlib.nullcontext()

    def tags(self, report) -> dict[str, str]:
        """``{tag: commit id}`` from the refs on the bucket; a malformed ref is a damaged tag."""
        def read(name: str):
            try:
                return name, read_tag(self.backend, name)[0]
            except IntegrityError as exc:  # a malformed payload is a damaged tag, not the end of the check
                return name, exc

        out = {}
        for name, cid in self.requests.map(read, self.backend.list_refs()):
            if isinstance(cid, IntegrityError):
                report.damaged_tags.append(name)
                report.problems.append(f"tag {name!r}: {cid}")
            elif cid is not None:
                out[name] = cid
        return out

    def commits(self, report, ids: list[str] | None, deep: bool) -> dict[str, Any]:
        """``{commit id: CommitRecord, or None when damaged}`` of the ``commits/`` objects
        (``ids``, or every one listed), each fetched and checked against its id (without
        ``deep``, a record the cache holds is read from the cache); a damaged one is reported."""
        ids = [o.key.rsplit("/", 1)[1] for o in self.backend.list("commits")] if ids is None else ids

        def load(cid: str):
            try:
                return cid, fetch_record(self.backend, cid) if deep or not self.store.has_cached(cid) else self.store.record(cid)
            except IntegrityError as exc:
                return cid, exc

        out: dict[str, Any] = {}
        for cid, rec in self.requests.map(load, ids):
            out[cid] = None if isinstance(rec, IntegrityError) else rec
            if out[cid] is None:
                report.damaged_commits.append(cid)
                report.problems.append(f"commit {cid}: {rec}")
        return out

    def locate(self, report, keys: list[tuple[bytes, int]], deep: bool, repair: bool) -> dict:
        """``{address: BlobLoc}`` of the blobs of ``keys`` that packs on the bucket hold. With
        ``deep`` from each pack's entries as the bucket holds them: its ``.idx``, checked, or
        the pack walked when that is missing or damaged (``damaged_indexes``: a problem;
        ``missing_indexes`` for a pack ``keys`` need, else ``orphan_packs``: a writer killed
        between its pack and its index leaves that; ``damaged_packs``: neither can be read).
        ``repair`` rebuilds each such index from its walked pack (``repaired``). Without
        ``deep``, from the cache's index brought up to date, for the packs the bucket lists."""
        listed = {o.key: o for o in self.backend.list("blobs")}
        packs = {k.rsplit("/", 1)[1][:-5]: o for k, o in listed.items() if k.endswith(".pack")}
        if not deep:
            self.home.refresh_index()
            report.missing_indexes = sorted(p for p in packs if index_key(p) not in listed)
            return {k: loc for k, loc in self.store.locate(keys).items() if loc.pack in packs}
        needed = set(keys)
        where: dict = {}
        found = zip(packs, self.requests.map(lambda p: pack_entries(self.backend, p, packs[p].size, index_key(p) in listed), list(packs)))
        for pid, f in found:
            if f.entries is None:
                report.damaged_packs.append(pid)
                report.problems.append(f"pack {pid}: {f.pack_problem}" + (f" (and {f.index_problem})" if f.index_problem else ""))
                continue
            blobs = {(e.loc.digest, e.loc.raw_len): e.loc for e in f.entries if e.magic == BLOB_MAGIC}
            for k, loc in blobs.items():
                where.setdefault(k, loc)
            if f.index_problem is None:
                continue
            if repair:
                repair_index(self.backend, pid, f.entries)
                report.repaired.append(index_key(pid))
            elif index_key(pid) not in listed:
                # a writer killed between its pack and its index (the pack is whole: PUTs are atomic), or a deleted index:
                # nothing is lost, the pack is walked instead; GC removes it when nothing needs it, or rebuilds the index
                (report.missing_indexes if blobs.keys() & needed else report.orphan_packs).append(pid)
            else:
                report.damaged_indexes.append(pid)
                report.problems.append(f"pack {pid}: {f.index_problem} (its pack is intact: `ckptstore fsck --repair` rebuilds it)")
        return {k: where[k] for k in keys if k in where}

    def read(self, locs: list[BlobLoc], reread: set):
        """``(loc, error)`` for each blob of ``locs`` in ``reread`` (addresses), read from the
        bucket with coalesced ranged reads per pack (at most :attr:`fsck_batch` bytes at a
        time per pack, :data:`REQUESTS` packs at once) and checked in bounded memory
        (:func:`~ckptstore.packs.check_entry`, never allocating what a header claims):
        ``None`` when intact, a BlobCorruptError, or a BlobMissingError when the pack is
        gone or shorter since listed. The others are in packs listed with their entries."""
        by_pack: dict[str, list[BlobLoc]] = {}
        for loc in locs:
            if (loc.digest, loc.raw_len) in reread:
                by_pack.setdefault(loc.pack, []).append(loc)
        batches: list[list[BlobLoc]] = []
        for group in by_pack.values():
            batch, size = [], 0
            for loc in group:
                if batch and size + BLOB_HEADER.size + loc.stored_len > self.fsck_batch:
                    batches.append(batch)
                    batch, size = [], 0
                batch.append(loc)
                size += BLOB_HEADER.size + loc.stored_len
            batches.append(batch)

        def read(group: list[BlobLoc]):
            pid = group[0].pack
            try:
                bufs = self.backend.get_ranges(pack_key(pid), [loc.span for loc in group])
            except IntegrityError as exc:  # gone since listed, or shorter than its index says
                return [(loc, BlobMissingError(f"blob {loc.address} in pack {pid}: {exc}")) for loc in group]
            out = []
            for loc, buf in zip(group, bufs):
                try:
                    check_entry(buf, loc, f"{self.url}: fsck, pack {pid}")
                    out.append((loc, None))
                except BlobCorruptError as exc:
                    out.append((loc, exc))
            return out

        for results in self.requests.map(read, batches):
            yield from results

    def extra(self, report, ids: list[str], whole: bool, deep: bool, repair: bool) -> None:
        """With ``whole`` and ``deep``: every reflog object is a ref-move record of the tag its
        key names (``damaged_reflog``), and the store marker passes its check
        (``damaged_marker``; ``repair`` rewrites it from its intact copy, ``repaired``)."""
        if not (whole and deep):
            return

        def load(key: str):
            try:
                parse_reflog(self.backend.get(key), key, self.url)
            except ObjectNotFoundError:
                return None  # collected meanwhile
            except IntegrityError:
                return key
            return None

        for key in self.requests.map(load, [o.key for o in self.backend.list("reflog")]):
            if key is not None:
                report.damaged_reflog.append(key)
                report.problems.append(f"{key}: not a ref-move record (damaged); only the tag's history loses this entry")
        problem = marker_problem(self.backend)
        if problem is None:
            return
        if repair:
            try:
                repair_marker(self.backend, self.store)
                report.repaired.append(MARKER)
                return
            except IntegrityError as exc:
                problem = str(exc)
        report.damaged_marker = True
        report.problems.append(problem if repair else f"{problem} (`ckptstore fsck --repair` rewrites it from the intact copy)")


# --- the GC primitives of a bucket (ckptstore.gc.GCSide) -------------------------------------

#: Seconds: S3 (and moto) give object times in whole seconds, so an object may be this much younger than
#: its time says; a grace period above 0 waits this much longer, or a just-written pack or mark looks old.
MTIME_STEP = 1.0
#: The grace period's default on a bucket (seconds): a reader that resolved a tag before a mark has this long.
BUCKET_GRACE = 86400.0


@dataclass
class _GCState:
    """What the bucket holds at one read: refs, objects, pack entries, records' needs, marks."""

    refs: dict
    now: float  # the server's clock (invariant 5)
    objects: dict  # key -> ObjectInfo (everything under blobs/ and commits/)
    packs: dict  # pack id -> ObjectInfo
    entries: dict  # pack id -> [Entry] (its .idx, or the pack walked; a pack neither gives is absent: never garbage)
    bad_indexes: dict  # pack id -> why its .idx is missing or damaged (walked instead)
    needs: dict  # commit id -> blob addresses, for every record on the bucket and every commit a tag names
    blind: list  # commits a tag names whose record cannot be read: what they need is unknown, so no pack goes
    marks: list  # (mtime, key, mark dict) of every readable gc/*.json
    unreadable_marks: list  # keys of marks that do not parse (deleted by the sweep; writers treat every pack as marked)


class BucketGC(GCSide):
    """The primitives of the GC protocol (:mod:`ckptstore.gc`) on a bucket: no lock (any
    number of writers and GCs run beside it), the server's clock (``Backend.now()``, whole
    seconds: :data:`MTIME_STEP`; no time of this machine is compared with an object's),
    liveness from the records alone (invariant 4: a pack's entries from its ``.idx``, or the
    pack walked where that is missing or damaged, the index then rebuilt; a pack that cannot
    be read is never garbage, and no pack is while a tag names a commit whose record cannot
    be read). Nothing leaves at once (:meth:`drop` does nothing): the mark is
    ``gc/<time>-<uuid>.json`` = ``{"at", "packs", "commits", "objects", "reflog"}``
    (create-only), naming the dead and copied packs, the victims' records, ``.idx`` objects
    without pack and reflog objects whose commits are both dropped; the sweep of a mark a
    grace period old deletes what is still unneeded and the mark. A pack's live blob held by
    another, unmarked pack (a copy, or a writer's rewrite: invariant 6) does not keep a
    marked pack. A copy's live blobs are read by ranged GETs, verified, and written into new
    packs and ``.idx`` before the old packs are marked.

    ``BackendError``: the storage failed (what was deleted stays deleted; run again).
    """

    default_grace = BUCKET_GRACE
    clock_step = MTIME_STEP

    def __init__(self, store):
        self.store = store
        self.backend = store.backend
        self.st: _GCState | None = None
        self._cutoff = 0.0
        self._keep: set = set()
        self._reflog_seen: dict = {}  # reflog key -> [key, new, old] (None: unreadable)
        self._live_entries: dict = {}

    def lock(self, dry_run: bool):
        return nullcontext()

    def now(self, fresh: bool) -> float:
        if fresh or self.st is None:
            self.st = self._read()
        return self.st.now

    def _read(self) -> _GCState:
        """Mirror the bucket into the cache and read what liveness needs (every ref, record, ``.idx`` and mark)."""
        store, backend, requests = self.store, self.backend, self.store.home.requests
        store.log()  # mirrors the tags, caches every commit record, forgets the ones the bucket lost
        now = backend.now()
        objects = {o.key: o for o in backend.list("blobs")}
        objects.update({o.key: o for o in backend.list("commits")})
        packs = {k.rsplit("/", 1)[1][:-5]: o for k, o in objects.items() if k.endswith(".pack")}
        found = dict(zip(packs, requests.map(lambda pid: pack_entries(backend, pid, packs[pid].size, index_key(pid) in objects), list(packs))))
        entries = {pid: f.entries for pid, f in found.items() if f.entries is not None}
        bad_indexes = {pid: f.index_problem for pid, f in found.items() if f.index_problem is not None}
        ids = [k.rsplit("/", 1)[1] for k in objects if k.startswith("commits/")]
        needs = {cid: {k for leaf in store.record(cid).leaves for k in leaf.keys} for cid in ids if store.has_cached(cid)}

        def needed(cid):  # a record written since the cache was brought up to date
            try:
                return cid, {k for leaf in fetch_record(backend, cid).leaves for k in leaf.keys}
            except IntegrityError:
                return cid, None  # gone, or damaged (fsck reports it); a failing server raises

        # The refs read after the listings: a commit a ref names now whose record came after them is
        # fetched below (so its blobs are live), and the sweep's check that no ref moved covers only its decision.
        refs = store.refs.read_all()
        named = {c for c in refs.values() if c}
        needs.update(requests.map(needed, [c for c in set(ids) | named if c not in needs]))
        blind = sorted(c for c in named if needs.get(c) is None)
        needs = {c: keys for c, keys in needs.items() if keys is not None}
        marks, unreadable = [], []
        for o in backend.list("gc"):
            try:
                mark = json.loads(backend.get(o.key))
                mark = {"packs": [p for p in mark["packs"] if type(p) is str], "commits": [x for x in mark["commits"] if type(x) is str],
                        "objects": [x for x in mark.get("objects", []) if type(x) is str],
                        "reflog": [x for x in mark.get("reflog", []) if type(x) is list and len(x) == 3 and type(x[0]) is str
                                   and x[0].startswith("reflog/")]}
                marks.append((o.mtime, o.key, mark))
            except ObjectNotFoundError:
                continue  # another GC swept it
            except (ValueError, KeyError, TypeError):
                unreadable.append(o.key)
        return _GCState(refs, now, objects, packs, entries, bad_indexes, needs, blind, marks, unreadable)

    def snapshot(self):
        return self.store.catalog.read()  # one snapshot: a writer sharing this cache folder may add commits meanwhile

    def _marked(self, field_: str) -> dict:
        """``{name: time of the oldest mark naming it}`` for one field of the marks."""
        out: dict = {}
        for mtime, _, mark in self.st.marks:
            for x in mark[field_]:
                out[x] = min(out.get(x, mtime), mtime)
        return out

    def commits(self, keep: set) -> dict:
        marked = self._marked("commits")
        return {k.rsplit("/", 1)[1]: (o.mtime, marked.get(k.rsplit("/", 1)[1]), o.size)
                for k, o in self.st.objects.items() if k.startswith("commits/")}

    def packs(self, keep: set, victims: list, cutoff: float) -> list[PackStat]:
        st, store = self.st, self.store
        self._cutoff, self._keep = cutoff, keep
        dropping = set(victims) - keep
        live = set().union(*(keys for c, keys in st.needs.items() if c not in dropping or c in keep))
        live |= {k for c in keep if c not in st.needs and store.has_cached(c) for leaf in store.record(c).leaves for k in leaf.keys}
        marked = self._marked("packs")
        holders: dict = {}  # address -> the unmarked, readable packs holding it
        for pid, entries in st.entries.items():
            if pid not in marked:
                for e in entries:
                    if e.magic == BLOB_MAGIC:
                        holders.setdefault((e.loc.digest, e.loc.raw_len), set()).add(pid)
        out = []
        for pid, info in st.packs.items():
            idx = st.objects.get(index_key(pid))
            freed = info.size + (idx.size if idx is not None else 0)
            if pid not in st.entries:
                out.append(PackStat(pid, info.size, info.mtime, marked.get(pid), 1, info.size, freed, keep=True))
                continue
            blobs = [e for e in st.entries[pid] if e.magic == BLOB_MAGIC]
            alive = [e for e in blobs if (e.loc.digest, e.loc.raw_len) in live]
            only = [e for e in alive if pid not in marked or not holders.get((e.loc.digest, e.loc.raw_len))]
            dead = [e for e in blobs if (e.loc.digest, e.loc.raw_len) not in live]
            self._live_entries[pid] = alive
            size = lambda es: sum(BLOB_HEADER.size + e.loc.stored_len for e in es)
            out.append(PackStat(pid, info.size, info.mtime, marked.get(pid), len(only), size(only), freed,
                                dies_with=len(dead), dies_with_bytes=size(dead), keep=bool(st.blind)))
        return out

    def withheld(self) -> list[str]:
        if not self.st.blind:
            return []
        return [f"no pack is collected while tags name commits whose record is missing or damaged: "
                f"{', '.join(self.st.blind)} (`ckptstore fsck --deep` lists them)"]

    def copy_size(self, batch: list[PackStat]) -> int:
        sizes = [BLOB_HEADER.size + e.loc.stored_len for p in batch for e in self._live_entries[p.id]]
        return sum(size + INDEX_HEADER.size + n * INDEX_ENTRY.size + INDEX_TRAILER for n, size in packed(sizes, self.store.pack_bytes))

    def copy(self, batch: list[PackStat], report: GCReport) -> int:
        backend, writer = self.backend, self.store.pack_writer()
        with writer:
            for p in batch:
                live = self._live_entries[p.id]
                bufs = backend.get_ranges(pack_key(p.id), [e.loc.span for e in live])
                for e, buf in zip(live, bufs):
                    payload = check_entry(buf, e.loc, f"{backend.url}: pack {p.id}")
                    writer.append_encoded(e.loc.digest, e.loc.raw_len, e.loc.codec, bytes(payload))
            writer.finish()
        self.store.refresh_index()
        return writer.bytes_uploaded

    def mark(self, plan, report: GCReport) -> None:
        st, backend = self.st, self.backend
        dead = {p.id for p in plan.dead}
        for pid in st.bad_indexes:
            if pid in st.entries and pid not in dead:
                repair_index(backend, pid, st.entries[pid])
                report.indexes_repaired += 1
        old = lambda key: st.objects[key].mtime <= self._cutoff
        orphans = [k for k in st.objects if k.endswith(".idx") and old(k) and k.rsplit("/", 1)[1][:-4] not in st.packs]
        reflog = self._dead_reflog()
        packs = [p.id for p in plan.marked]
        if packs or plan.victims or orphans or reflog:
            mark = {"at": st.now, "commits": plan.victims, "objects": orphans, "packs": packs, "reflog": reflog}
            backend.put_new(f"gc/{time.time_ns():020d}-{uuid.uuid4().hex}.json", json.dumps(mark, sort_keys=True).encode())

    def _dead_reflog(self) -> list[list]:
        """``[key, new, old]`` of every reflog object older than the cutoff whose commits are
        both outside what retention keeps (retention governs the reflog too); one that cannot
        be read is kept (fsck reports it)."""
        backend, keep, seen = self.backend, self._keep, self._reflog_seen
        todo = [o.key for o in backend.list("reflog") if o.mtime <= self._cutoff]

        def load(key):
            try:
                m = parse_reflog(backend.get(key), key, backend.url)
                return key, [key, m["new"], m["old"]]
            except (ObjectNotFoundError, IntegrityError):
                return key, None

        seen.update(self.store.home.requests.map(load, [k for k in todo if k not in seen]))  # immutable: read once per run
        return [seen[k] for k in todo if seen[k] is not None and seen[k][1] not in keep and seen[k][2] not in keep]

    def _reflog_due(self, due: list, own: list = ()) -> set:
        """Keys of the reflog objects the marks ``due`` (and this run's ``own`` entries) name that are still on
        the bucket and whose commits are both outside what retention keeps."""
        named = [r for _, mark in due for r in mark["reflog"]] + list(own)
        if not named:
            return set()
        held = {o.key for o in self.backend.list("reflog")}
        return {key for key, new_, old_ in named if key in held and new_ not in self._keep and old_ not in self._keep}

    def refs_token(self) -> dict:
        return self.st.refs  # as the state just read saw them

    def delete(self, commits: list[str], packs: list[PackStat], token, report: GCReport) -> tuple[list, list] | None:
        st, backend = self.st, self.backend
        if self.store.refs.read_all() != token:
            return None
        due = [(key, mark) for mtime, key, mark in st.marks if mtime <= self._cutoff]
        for c in commits:
            backend.delete(commit_key(c))
        for p in packs:
            backend.delete(pack_key(p.id))
            backend.delete(index_key(p.id))
        for key in self._reflog_due(due):  # a ref move whose commits are all dropped has nothing left to tell
            backend.delete(key)
            report.reflog_removed += 1
        for obj in {obj for _, mark in due for obj in mark["objects"] if obj in st.objects}:
            backend.delete(obj)
            report.bytes_freed += st.objects[obj].size
            report.orphans_removed += 1
        self.store.home.forget(commits)
        for key in [k for k, _ in due] + st.unreadable_marks:
            backend.delete(key)
        self.store.refresh_index()
        return commits, packs

    def anything_due(self, cutoff: float) -> bool:
        return bool(self.st.unreadable_marks) or any(mtime <= cutoff for mtime, _, _ in self.st.marks)

    def leftovers(self, cutoff: float, own_due: bool, report: GCReport) -> None:
        """A dry run's count of the marks' other objects the sweep deletes (a real run's sweep deleted them)."""
        if not report.dry_run:
            return
        st = self.st
        objects = {obj for mtime, _, mark in st.marks if mtime <= cutoff for obj in mark["objects"] if obj in st.objects}
        if own_due:
            objects |= {k for k in st.objects if k.endswith(".idx") and st.objects[k].mtime <= cutoff and k.rsplit("/", 1)[1][:-4] not in st.packs}
        report.orphans_removed += len(objects)
        report.bytes_freed += sum(st.objects[k].size for k in objects)
        due = [(key, mark) for mtime, key, mark in st.marks if mtime <= cutoff]
        report.reflog_removed += len(self._reflog_due(due, self._dead_reflog() if own_due else ()))


__all__ = ["BucketGC", "BucketHome", "BucketReader", "DetachedPackWriter", "cache_folder"]
