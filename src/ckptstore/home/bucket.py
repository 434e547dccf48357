"""The home of a store on object storage: ``Store("s3://bucket/prefix")``
(docs/design.md, "Object storage" and "A store on object storage").

:class:`BucketHome` is the :class:`~ckptstore.home.base.Home` that the
:class:`~ckptstore.store.Store` facade runs on for an ``s3://`` location: the three parts of
a home for object storage, everything else (the commit protocol, adapters, sharding,
hashing, the manifest, checkout's planning and restoring, GC and fsck) shared with the
local store:

- **objects**: new blobs go into packs assembled in memory (:class:`~ckptstore.objects.bucketformat.BucketPackWriter`, shared with push),
  each put whole with a create-only PUT, then its ``.idx``; reads are ranged GETs of
  only the needed blobs, coalesced and in parallel (:class:`~ckptstore.home.bucket_io.BucketReader`), each checked
  against its entry header and rehashed;
- **refs**: tags live on the bucket (``refs/<tag>``) and move by compare-and-swap
  (:class:`~ckptstore.home.refs.BucketRefs`, the facade's ``refs``); a commit takes the
  tag's current commit as its parent, and a lost race rebuilds the record on the new
  parent and tries again (bounded: ``RefBusyError``);
- **the index**: a SQLite catalog of the local store's schema under the user's cache
  folder (:func:`~ckptstore.home.bucket_cache.cache_folder`) holds copies of the pack indexes and of the commit
  records, so dedup lookups and blob lookups cost no round trips. Every row is a copy
  of an immutable object on the bucket (or a mirror of a ref read from it): deleting
  the folder loses nothing. Tags are always read from the bucket before a move, a
  checkout or a listing (a listing reads only the refs whose ETag changed). The home's
  queries (``held``, ``find_commit``, ``tagged``, ``info``, ``infos``, ``log``, ``show``,
  ``du``) copy the records they need into the cache, then answer from it as
  :class:`~ckptstore.home.base.Home` does. A record is copied without reading every pack's
  ``.idx``: a blob no index the cache has read holds gets a row in :data:`~ckptstore.home.bucket_cache.UNLOCATED`,
  located when a checkout, commit, fsck, GC or ``du`` needs it (:meth:`BucketHome.refresh_index`),
  so ``log(ref, limit=k)``, ``info``, ``show`` and ``tagged`` cost O(k) requests, not
  O(packs). Liveness never comes from these rows: GC reads every record and ``.idx``.

The bucket is the truth: a commit exists once ``commits/<xx>/<cid>`` exists and is
reachable once a ref names it (order: packs, ``.idx``, record, ref CAS, reflog object).
After its record is on the bucket and before its CAS, a commit checks every pack it
relies on (new and reused) against the GC marks (``gc/*.json``) and that the pack still
exists; a blob in a marked or missing pack is written again, so a commit slower than the
grace period loses nothing. GC marks, then sweeps a grace period later (:class:`~ckptstore.home.bucket_upkeep.BucketGC`, the primitives of :mod:`ckptstore.protocols.gc`). Tags are read
from the refs alone, revalidated by one listing of their ETags.

This module holds :class:`BucketHome` itself (objects, refs, the commit's index step, the
queries); the parts it is made of are modules of their own: the filling of its cache
(:class:`~ckptstore.home.bucket_cache.BucketCache`, a base class), its reader and detached pack
writer (:mod:`ckptstore.home.bucket_io`), its GC and fsck sides (:mod:`ckptstore.home.bucket_upkeep`),
and the objects' bytes (:mod:`ckptstore.objects.bucketformat`, shared with push and pull).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..backends import Backend, open_backend
from ..core.errors import (
    CkptStoreError,
    IntegrityError,
    NotAStoreError,
    RefBusyError,
    RefConflictError,
)
from ..core.layout import RANDOM
from ..core.threads import Pool
from ..objects.bucketformat import (
    MARKER,
    PACK_BYTES,
    REQUESTS,
    UPLOADS,
    BucketPackWriter,
    GCMarks,
    commit_key,
    complete_marker,
    ensure_marker,
    read_gc_marks,
    read_marker,
)
from ..objects.packindex import pack_key
from ..objects.packs import BLOB_HEADER
from ..objects.records import CommitInfo
from .base import Home, weakly
from .bucket_cache import UNLOCATED, BucketCache, cache_folder
from .bucket_io import BucketReader
from .bucket_upkeep import BucketFsck, BucketGC
from .catalog import drop_commit_rows
from .index_step import ReusedBlobsGone
from .refs import CAS_SECONDS, BucketRefs, guarded
from .refs import resolve_on_bucket as resolve_remote

#: Seconds: a cached commit the bucket's listing lacks is forgotten only once this old (its record may be in flight).
FORGET_AFTER = 3600.0
_CID = re.compile(r"[0-9a-f]{32}")


class BucketHome(BucketCache, Home):
    """The home of a store under ``s3://bucket/prefix``: ``Store("s3://…")`` builds one.

    The store (:class:`~ckptstore.store.Store`, the same class as for a folder) keeps its
    API (commit, checkout, tags, log, reflog, gc, fsck...), with these differences:

    - ``create``: the bucket is never created (a missing one is ``NotAStoreError``);
      an empty prefix becomes a store on the first commit (``ckptstore.json``). With
      ``create=False`` a prefix without ``ckptstore.json`` is ``NotAStoreError``.
    - ``pack_bytes``: packs roll over past this size (default 64 MiB; they upload in
      parallel, :data:`~ckptstore.objects.bucketformat.UPLOADS` at a time).
    - ``cache``: the folder of the local index (default :func:`cache_folder`).
    - ``gc``'s grace period defaults to 24 hours (:class:`BucketGC`).
    - ``push``, ``pull`` and ``export`` work as on a local store, to and from either home
      (a folder, or another prefix: :mod:`ckptstore.protocols.transfer`, :mod:`ckptstore.protocols.remote`);
      ``Store.recover("s3://…")`` rebuilds this cache from the bucket alone
      (:func:`ckptstore.protocols.recover.recover_bucket`).

    Credentials and endpoint come from the standard environment (``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ALLOW_HTTP``).

    Raises:
        NotAStoreError: a missing bucket, a foreign ``ckptstore.json``, or (``create=False``) none.
        BackendError: obstore is missing or the server cannot be reached.
    """

    pack_bytes = PACK_BYTES
    disposable_index = True

    def __init__(self, path: str, create: bool | None, cache: str | os.PathLike | None, backend: Backend | None,
                 shard_bytes: int | None = None, compression_level: int | None = None, pack_bytes: int | None = None):
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
        super().__init__(Path(cache or cache_folder(self.url)), shard_bytes, compression_level, pack_bytes)
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
        return BucketRefs(self.backend, *weakly(self, "catalog"), self.root, self.requests,
                          *weakly(self, "_has_store", "_need_store", "_packs_of"))

    @property
    def location(self) -> str:
        """``s3://bucket/prefix``: where the store lives (its cache is only a copy)."""
        return self.url

    def close(self) -> None:
        """Release the catalog connection, the upload and request threads and the client."""
        super().close()
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
        return BucketPackWriter(self.backend, self.compression_level, self.pack_bytes, self.uploads)

    def pack_reader(self, sparse: bool = False) -> BucketReader:
        return BucketReader(self)

    def pack_size(self, pack: str) -> int | None:
        info = self.backend.head(pack_key(pack))
        return None if info is None else info.size

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
        at = self.catalog.rows("SELECT created_at FROM commits WHERE id = ?", (info.id,), raw=True)[0][0]
        return replace(info, created_at=at)

    def has_commit(self, cid: str) -> bool:
        """Does the bucket hold commit ``cid`` (a full id)?"""
        return self.has_cached(cid) or (type(cid) is str and bool(_CID.fullmatch(cid)) and self.backend.head(commit_key(cid)) is not None)

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
            ensure_marker(self.backend, self)
            self.marker = read_marker(self.backend)
        self.refresh_index()

    def _check_packs(self, known: dict, written: dict) -> None:
        """After the commit's record is on the bucket and before its ref CAS (invariant 6):
        no blob it relies on, reused (``known``) or new (``written``), may sit in a pack a
        GC marked or swept; those are raised as :class:`~ckptstore.home.index_step.ReusedBlobsGone`
        and written again. Checked after the record exists, a pack no mark names now can
        be marked only by a GC that lists the record at its sweep and so keeps the pack,
        whatever the grace period and however slow the commit was until now."""
        where = self.locate(list(known)) if known else {}
        packs = ({loc.pack for loc in where.values()} | {loc.pack for loc in written.values()}) - {UNLOCATED}
        marked = self.marked_packs() if packs else GCMarks()
        if len(packs) > REQUESTS:  # one listing costs less than many HEADs
            listed = {o.key: o for o in self.backend.list("blobs")}
            present = {p: listed.get(pack_key(p)) for p in packs}
        else:
            present = dict(zip(packs, self.requests.map(lambda p: self.backend.head(pack_key(p)), packs)))
        # (a pack made after a damaged mark, as this commit's rewrite, is one it cannot name)
        bad = {p for p in packs if not present[p] or marked.withholds(p, present[p].mtime)} | {UNLOCATED}  # a blob never located: found again, or written again
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
        if marked.withholds_all:  # no pack may be reused: every blob is written again
            return {}
        self.refresh_index(avoid=marked.packs)
        where = self.locate(list(keys))
        held = {o.key for o in self.backend.list("blobs")}  # a row may still name a pack gone from the bucket
        return self.lookup([k for k, loc in where.items() if loc.pack not in marked and pack_key(loc.pack) in held])

    def mark_bad(self, bad: list) -> int:
        """As :meth:`ckptstore.home.base.Home.mark_bad`, in this machine's cache; then the cache is
        brought up to date, so that a copy of a marked address in a pack it has not read yet
        (a newer commit's, written elsewhere) replaces the bad one for the next read."""
        n = super().mark_bad(bad)
        if n:
            try:
                self.refresh_index()
            except CkptStoreError:  # (a failing server: the read's own error is what the caller reports)
                pass
        return n

    def replace_copy(self, loc, good) -> bool:
        """As :meth:`ckptstore.home.base.Home.replace_copy`, once the cache knows every pack (``good``'s among them)."""
        self.refresh_index()
        return super().replace_copy(loc, good)

    def marked_packs(self) -> GCMarks:
        """The GC marks (``gc/*.json``, :func:`~ckptstore.objects.bucketformat.read_gc_marks`): ``pack in``
        the result when a mark names it, or may (a mark that cannot be read withholds every pack
        made no later than it: :meth:`~ckptstore.objects.bucketformat.GCMarks.withholds`)."""
        return read_gc_marks(self.backend)

    def index_commit(self, components, leaves, keys, known, written, writer, tags, message, meta_json, explicit_parents, created_at, t0,
                     expect=None, given_packs=()):
        """Step 4 on object storage: check the reused packs, index the commit in the cache,
        put its record, then compare-and-swap each tag (a lost race rebuilds the record on
        the tag's new commit and tries again)."""
        if getattr(self._copying, "on", False):  # a commit of the bucket copied into the cache
            return super().index_commit(components, leaves, keys, known, written, writer, tags, message, meta_json, explicit_parents,
                                        created_at, t0, expect, given_packs)
        if self.marker is None:
            ensure_marker(self.backend, self)
            self.marker = read_marker(self.backend)
        elif not self._marker_complete:  # once per process: the first writer may have been killed between the copy and the marker
            complete_marker(self.backend)
        self._marker_complete = True
        if known and self.catalog.rows("SELECT 1 FROM blobs WHERE pack = ? LIMIT 1", (UNLOCATED,), raw=True) and self._located(known)[1]:
            self.refresh_index()  # reused blobs a listing copied without their places: located before the record goes out
        if written:  # blobs written again after a GC marked their old pack: the cache points here now
            with self.catalog.write():
                self.catalog.db["packs"].insert_all(  # first: a blob row must name a known pack (foreign key)
                    ({"id": pid, "size": size, "created_at": created_at} for pid, size in writer.pack_ids), ignore=True
                )
                self.catalog.conn.executemany(
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
            current = self.refs.versions(tags)
            if explicit_parents is not None:
                parents = explicit_parents
            else:
                parents = list(dict.fromkeys(p for t, (c, _) in current.items() for p in [before.get(t) if c in ours else c] if p))
            if expect is None:  # dated after its parents' moves were read: time order is lineage order
                created_at = time.time()
            cid, parent_ids, seconds, ids = super().index_commit(components, leaves, keys, known, written, writer, [], message, meta_json,
                                                                 parents, created_at, t0, expect, given_packs)
            ours.add(cid)
            text = self.catalog.rows("SELECT record FROM commits WHERE id = ?", (cid,))[0][0]
            self.backend.put_new(commit_key(cid), text.encode())
            self._check_packs(known, written)
            packs = self._packs_of(cid)
            lost = False
            todo = [{"tag": t, "old": current[t][0], "version": current[t][1], "new": cid, "action": "commit", "packs": packs}
                    for t in tags if current[t][0] != cid]
            with guarded(todo):  # a fenced holder: these moves are recorded in the run's token cell first (docs/design.md)
                for t in tags:
                    old, version = current[t]
                    if old == cid:
                        continue
                    try:
                        self.refs.swap(t, old, version, cid, "commit", packs)  # dated when sent, not the commit's time
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
        self.refs.mirror({t: cid for t in tags})
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
        keys = [k for leaf in self.record(cid).leaves for k in leaf.keys]
        where, unlocated = self._located(keys)
        hint = self.refs.hint(cid)
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
        named = self.tags()
        for cid in dict.fromkeys(named.values()):
            try:
                self._cache([cid])
            except IntegrityError:
                pass  # listed all the same, below; checking it out raises the error, and fsck reports it
        self.refs.mirror(named)
        infos = self.index_infos(list(set(named.values())))  # copied above: a damaged record is listed, not fetched again
        unreadable = "(the commit record is missing or damaged: see `ckptstore fsck --deep`)"
        return {name: infos.get(cid) or CommitInfo(cid, (name,), (), 0.0, unreadable, {}, 0, 0, 0, 0, 0, 0.0) for name, cid in named.items()}

    def held(self, cid: str) -> str:
        """``cid`` (named by a tag), once its record is in the cache (copied from the bucket,
        reading only the indexes of the packs its tag names, if it named any)."""
        self._cache([cid], packs=self.refs.hint(cid))
        return cid

    def find_commit(self, ref: str) -> str:
        """The commit a full id or unique id prefix ``ref`` names on the bucket; its record is then in the cache."""
        cid, _ = resolve_remote(self.backend, ref)
        self._cache([cid])
        return cid

    def info(self, ref: str):
        cid = self.resolve(ref)
        self.tags()
        return self.index_infos([cid])[cid]  # resolve copied it

    def infos(self, ids: list[str]):
        """As :meth:`~ckptstore.home.base.Home.infos`, the records of ``ids`` the cache lacks copied from the bucket
        first (one HEAD each; ids the bucket does not hold are left out).

        Raises:
            BackendError: the storage failed.
        """
        self._need_store()
        todo = [c for c in dict.fromkeys(ids) if not self.has_cached(c) and self.has_commit(c)]
        if todo:
            self._cache(todo)
        return self.index_infos(ids)

    def log(self, ref: str | None = None, limit: int | None = None):
        """Lineage of ``ref`` on the bucket (every commit without ``ref``: every record
        fetched), newest first; with ``ref`` and ``limit``, about ``limit`` records are
        fetched and no pack index but those the tag names (:meth:`_cache`)."""
        if limit is not None and (type(limit) is not int or limit < 1):
            return super().log(ref, limit)  # the facade's error for a bad limit
        refs = self.refs.read_all(strict=False) if self._has_store() else {}
        if ref is None:
            ids = [o.key.rsplit("/", 1)[1] for o in self.backend.list("commits")]
            self._cache([c for c in ids if _CID.fullmatch(c)])
            # A commit is indexed in the cache just before its record is put: in a cache folder shared with a writer,
            # only a commit older than FORGET_AFTER that the listing lacks is one the bucket lost.
            rows = self.catalog.rows("SELECT id FROM commits WHERE created_at < ?", (time.time() - FORGET_AFTER,), raw=True)
            listed = set(ids)
            self.forget([r[0] for r in rows if r[0] not in listed])
            self.refs.mirror(refs, complete=True)
            return [c for c in super().log(None) if c.id in listed][:limit]  # (a younger one the bucket lost is not listed either)
        ref = self.resolve(ref)
        self._cache([ref], lineage=True, limit=limit)
        self.refs.mirror(refs, complete=True)
        return super().log(ref, limit)

    def show(self, ref: str) -> dict:
        cid = self.resolve(ref)
        try:
            self._cache(list(self.record(cid).parents[:1]))  # its first parent, for shared_with_parent
        except IntegrityError:
            pass  # not on the bucket (an imported commit, or dropped by a GC): nothing is shared
        out = super().show(cid)
        unlocated = {r[0] for r in self.catalog.rows(
            "SELECT DISTINCT l.path FROM commit_leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id WHERE l.commit_id = ? AND b.pack = ?",
            (cid, UNLOCATED), raw=True)}
        for leaf in out["leaves"]:
            if leaf["path"] in unlocated:
                leaf["stored_bytes"] = None  # not known here until the cache locates its blobs (a checkout of it does)
        return out

    def du(self) -> dict:
        """Space accounting of the bucket, as :meth:`~ckptstore.home.base.Home.du`: ``pack_bytes`` sums the
        packs and indexes under ``blobs/``, ``catalog_bytes`` the local cache, ``tmp_bytes`` 0."""
        self.log()  # every commit record cached, the ones the bucket lost forgotten
        self.refresh_index()
        listed = {o.key: o.size for o in self.backend.list("blobs")}
        packs = [k.rsplit("/", 1)[1][:-5] for k in listed if k.endswith(".pack")]
        usage = super().du()
        b = self.catalog.chunked("SELECT COUNT(*), COALESCE(SUM(raw_len), 0), COALESCE(SUM(stored_len + ?), 0) FROM blobs WHERE pack IN ({})",
                                 packs, (BLOB_HEADER.size,), raw=True) if packs else []
        n, raw, stored = (sum(r[i] for r in b) for i in range(3)) if b else (0, 0, 0)
        usage.update(packs=len(packs), pack_bytes=sum(listed.values()), blobs=n, unique_bytes=raw, stored_bytes=stored, tmp_bytes=0,
                     dedup_ratio=usage["logical_bytes"] / raw if raw else None, compression_ratio=raw / stored if stored else None)
        return usage

    def forget(self, cids: list[str]) -> None:
        """Drop commits from the cache (the bucket no longer holds them)."""
        if not cids:
            return
        cat = self.catalog
        with cat.write():
            drop_commit_rows(cat, cids)  # (rows a kept commit shares move to it)
            cat.chunked("DELETE FROM tags WHERE commit_id IN ({})", cids)
            cat.chunked("DELETE FROM commits WHERE id IN ({})", cids)

    def checkout_target(self, ref: str) -> str:
        """``ref`` resolved on the bucket (its record copied into the cache, its blobs located) before checkout reads it."""
        cid = self.resolve(ref)
        self._locate_commit(cid)
        return cid

    # --- maintenance ----------------------------------------------------------------------------

    def gc_side(self) -> BucketGC:
        """This home's primitives of the GC protocol (:class:`BucketGC`: no lock, a mark swept a
        grace period later; ``grace`` defaults to 24 hours)."""
        self._need_store()
        return BucketGC(self)

    def fsck_side(self) -> BucketFsck:
        """This home's primitives of the fsck protocol (:class:`BucketFsck`)."""
        return BucketFsck(self)


__all__ = ["BucketHome"]
