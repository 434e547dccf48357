"""Homes: where a store's objects, refs and index live, behind one interface.

A store (:class:`ckptstore.store.Store`, the facade) is a **home** and the protocols that
run against it. A home provides three parts:

- **objects**: the packs of blobs and records: :meth:`Home.pack_writer`,
  :meth:`Home.pack_reader`, :meth:`Home.pack_size`;
- **refs**: the tags, moved by compare-and-swap (:attr:`Home.refs`: a
  :class:`~ckptstore.home.refs.CatalogRefs` locally, a :class:`~ckptstore.home.refs.BucketRefs` on
  object storage);
- **the index**: a SQLite catalog (``catalog.sqlite`` under :attr:`Home.root`): where the
  local store lives, a cache of the bucket's immutable objects on object storage. The home
  owns it: opening it (:meth:`Home.open`, :meth:`Home.open_catalog`: creating, migrating,
  the settings, :meth:`Home.backfill_records`), its connection (:attr:`Home.catalog`) and
  its close, its write transaction that adds records (:meth:`Home.write`), the commit's
  index step (:meth:`Home.index_commit`), the index's upkeep (:meth:`Home.refresh_index`,
  :meth:`Home.relocate_reused`) and the queries that read refs, commits, records and blob
  locations (:meth:`Home.resolve`, :meth:`Home.tags`, :meth:`Home.tag`, :meth:`Home.info`,
  :meth:`Home.log`, :meth:`Home.show`, :meth:`Home.du`, :meth:`Home.record`,
  :meth:`Home.manifest`, :meth:`Home.locate`, :meth:`Home.lookup`...) are written here
  against the catalog; a home whose index is a cache overrides some of them to bring the
  cache up to date first.

:class:`Home` is that shared part (the index as a catalog);
:class:`ckptstore.home.local.LocalHome` is the store in a folder,
:class:`ckptstore.home.bucket.BucketHome` the store on object storage. A home knows nothing of
the store above it (the store owns its home, never the reverse) and imports no protocol:
the commit's index step on the catalog, and what the commit protocol hands to it, are
:mod:`ckptstore.home.index_step`.
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..core import jsonvalue
from ..core.errors import (
    AmbiguousRefError,
    BlobMissingError,
    CatalogCorruptError,
    CkptStoreError,
    InvalidArgumentError,
    NotAStoreError,
    RefNotFoundError,
    StoreWriteError,
)
from ..core.layout import DEFAULT_SHARD_BYTES, address, under
from ..objects import records
from ..objects.packs import BLOB_HEADER, DEFAULT_PACK_BYTES, BlobLoc, PackWriter, walk_store
from ..objects.records import CommitInfo, LeafRecord, check_tag
from .catalog import Catalog, CatalogMissing, backfill_records, damaged, keep_reserve, release_reserve, reserve_path
from .index_step import index_commit
from .refs import CatalogRefs, Refs

#: The catalog's file name, under the home's :attr:`Home.root`.
CATALOG = "catalog.sqlite"
# The only names in a store's folder: one with others and no catalog is not a store (leases: ckptstore.run).
_FULL_ID = re.compile(r"[0-9a-f]{32}")
_STORE_NAMES = re.compile(r"^(catalog\.sqlite(-wal|-shm|-journal|-reserve|\.v\d+\.bak)?|blobs|tmp|gc\.lock|leases)$")


def _setting(name: str, value: Any, low: int, high: int) -> Any:
    """Validate an integer setting (None passes through). Raises InvalidArgumentError."""
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise InvalidArgumentError(f"invalid {name} {value!r}: must be an integer in [{low}, {high}]")
    return value


def weakly(owner: Any, *names: str) -> list:
    """Callables returning ``owner.<name>`` (called, for a method) that do not keep ``owner``
    alive: the home owns its refs, not the reverse (no reference cycle, so a store
    dropped without ``close`` still frees its catalog connection at once)."""
    me = weakref.ref(owner)

    def one(name: str):
        if callable(getattr(type(owner), name, None)):
            return lambda *args: getattr(me(), name)(*args)
        return lambda: getattr(me(), name)

    return [one(n) for n in names]


class Home:
    """The part of a home both homes share: the index is a SQLite catalog under
    :attr:`root`, owned by the home (opened by :meth:`open`, closed by :meth:`close`), with
    the store's settings, its refs and the queries. Subclasses provide the objects and the refs.

    Args:
        root: the folder of the catalog (locally the store's folder).
        shard_bytes / compression_level / pack_bytes: the settings as ``Store`` was given
            them (``None``: the store's own, or the defaults); checked by :meth:`open`.

    Attributes:
        root: the folder of the catalog (locally the store's folder).
        shard_bytes: target shard size in bytes of new commits (asked, else stored, else 256 KiB).
        compression_level: zstandard level of new blobs (asked, else stored, else 3).
        pack_bytes: packs roll over past this size in bytes (asked, else the home's default).
        refs: the tags (:mod:`ckptstore.home.refs`): every tag read and move goes through them.
        location: where the store lives, as ``Store(location)`` opens it.
    """

    pack_bytes = DEFAULT_PACK_BYTES
    #: Whether the index holds only copies (a damaged one is moved aside and rebuilt).
    disposable_index = False

    def __init__(self, root: Path, shard_bytes: int | None = None, compression_level: int | None = None, pack_bytes: int | None = None):
        self.root = root
        self._asked = shard_bytes, compression_level
        self.shard_bytes = DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes
        self.compression_level = 3 if compression_level is None else compression_level
        if pack_bytes is not None:
            self.pack_bytes = pack_bytes
        self._records: dict[str, records.CommitRecord] = {}  # verified commit records by id (immutable)
        self._catalog: Catalog | None = None
        self._catalog_lock = threading.Lock()
        #: The home's refs (:mod:`ckptstore.home.refs`): every tag read and move goes through them.
        self.refs: Refs = self.make_refs()

    @property
    def location(self) -> str:
        """Where the store lives, as ``Store(location)`` opens it (here: the folder)."""
        return str(self.root)

    def settings(self, shard_bytes: int | None, compression_level: int | None) -> tuple[int | None, int | None]:
        """The store's settings as asked, completed from the home's own (a bucket's marker)."""
        return shard_bytes, compression_level

    def create_index(self, create: bool | None) -> bool:
        """Whether opening the store creates its catalog now (``create`` as ``Store`` takes it)."""
        return bool(create)

    def make_refs(self) -> Refs:
        """The home's refs: tags in the catalog, moved in its transactions."""
        return CatalogRefs(*weakly(self, "catalog", "write"), str(self.root))

    def open(self, create: bool | None) -> None:
        """Check the settings asked and open the store's index as ``Store(create=...)`` says:
        ``None``: if it exists; ``True``: created now if missing; ``False``: it must exist.
        A damaged index that holds only copies (:attr:`disposable_index`) is moved aside and
        built again.

        Raises:
            InvalidArgumentError: a setting out of range.
            NotAStoreError: no store here (``create=False``), or the folder holds other files.
            CatalogCorruptError / SchemaVersionError: see :meth:`open_catalog`.
        """
        self._asked = shard_bytes, compression_level = self.asked_settings(*self._asked)
        self.shard_bytes = DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes
        self.compression_level = 3 if compression_level is None else compression_level
        try:
            opened = self.open_catalog(create=self.create_index(create))
        except CatalogCorruptError:
            if not self.disposable_index:
                raise
            self.discard_index()  # it held only copies: moved aside, a new one is built
            opened = self.open_catalog(create=True)
        if opened is None and create is False:
            raise NotAStoreError(f"{self.root} {self.missing()}")

    @property
    def catalog(self) -> Catalog:
        """The catalog connection, opened on first use.

        Raises:
            NotAStoreError: the store does not exist (yet: see ``create``).
        """
        cat = self._catalog if self._catalog is not None else self.open_catalog(create=False)
        if cat is None:
            raise NotAStoreError(f"{self.root} {self.missing()}; a first commit creates a store there")
        return cat

    def open_catalog(self, create: bool) -> Catalog | None:
        """Open the catalog (:meth:`open_index`), then load the stored settings; ``None`` if
        there is no store and ``create`` is false (with ``create``: create it). A writable
        catalog keeps its reserve (room for the journal on a full disk) and finishes a
        migration's record backfill (:meth:`backfill_records`)."""
        with self._catalog_lock:
            if self._catalog is not None:
                return self._catalog
            cat = self.open_index(create)
            if cat is None:
                return None
            try:
                self.shard_bytes, self.compression_level = self.stored_settings(cat, self._asked, (self.shard_bytes, self.compression_level))
            except BaseException:
                cat.close()
                raise
            self._catalog = cat
        if cat.writable:
            keep_reserve(self.root / CATALOG)  # room for the journal when the disk fills up
        if cat.writable and cat.backfill_pending:  # a migration (this open's, or one killed before) to finish
            self.backfill_records()
        return cat

    def spend_reserve(self) -> None:
        """Before a GC that frees room: release the catalog's reserve (docs/operations.md); a
        catalog opened read-only for want of room is opened again, for writing."""
        if release_reserve(self.root / CATALOG) and not self.catalog.writable:
            with self._catalog_lock:  # a full disk: with the reserve's room, the catalog opens for writing
                self._catalog.close()
                self._catalog = None
            self.open_catalog(create=False)

    def keep_reserve(self) -> None:
        """After a GC: take the catalog's reserve back, from the room it freed (a writable catalog only)."""
        if self.catalog.writable:
            keep_reserve(self.root / CATALOG)

    def close(self) -> None:
        """Release the catalog connection (and, in a subclass, what else the home holds)."""
        if self._catalog is not None:
            self._catalog.close()

    # --- opening the index -----------------------------------------------------------------

    def asked_settings(self, shard_bytes: int | None, compression_level: int | None) -> tuple[int | None, int | None]:
        """The settings ``Store`` was given, completed by :meth:`settings` and checked.

        Raises:
            InvalidArgumentError: ``shard_bytes`` outside [1, 2**34] or ``compression_level`` outside [0, 22].
        """
        shard_bytes, compression_level = self.settings(shard_bytes, compression_level)
        return _setting("shard_bytes", shard_bytes, 1, 1 << 34), _setting("compression_level", compression_level, 0, 22)

    def stored_settings(self, cat: Catalog, asked: tuple[int | None, int | None], defaults: tuple[int, int]) -> tuple[int, int]:
        """``(shard_bytes, compression_level)`` of the store: those ``asked`` where given, else
        the catalog's. The first open of a new store saves ``defaults`` in the catalog; later
        opens read them (arguments win).

        Raises:
            CatalogCorruptError: a stored setting is invalid.
        """
        shard_bytes, level = asked
        rows = {r["key"]: jsonvalue.loads(r["value"]) for r in cat.rows("SELECT key, value FROM settings")}
        missing = {k: v for k, v in zip(("shard_bytes", "compression_level"), defaults) if k not in rows}
        if missing and cat.writable:
            with cat.write():
                cat.db["settings"].insert_all(({"key": k, "value": jsonvalue.dumps(v)} for k, v in missing.items()), ignore=True)
        rows = {**missing, **rows}
        try:  # the arguments were checked by asked_settings; the stored values are checked here
            return (shard_bytes or _setting("shard_bytes", rows["shard_bytes"], 1, 1 << 34),
                    level if level is not None else _setting("compression_level", rows["compression_level"], 0, 22))
        except InvalidArgumentError as exc:
            raise CatalogCorruptError(f"{self.root / CATALOG}: stored setting is invalid: {exc}") from None

    def open_index(self, create: bool) -> Catalog | None:
        """Open the catalog under :attr:`root` (``None``: no store here and not ``create``;
        with ``create``: create it, and ``blobs/`` and ``tmp/``); only SQLite looks at the
        catalog file (invariant 6).

        Raises:
            NotAStoreError: :attr:`root` is a file, or a folder holding other files and no
                catalog; it cannot be created.
            CatalogCorruptError: a damaged catalog, or none beside packs (both naming
                ``ckptstore recover``).
            StoreWriteError: the folder cannot be written.
        """
        root, catalog = self.root, self.root / CATALOG
        if root.exists() and not root.is_dir():
            raise NotAStoreError(f"{root} is a file, not a ckptstore store")
        for attempt in range(2):
            try:
                return Catalog(catalog, create=False)
            except CatalogMissing:
                pass
            except (CatalogCorruptError, StoreWriteError) as exc:
                if "ckptstore recover" in str(exc):
                    raise
                raise type(exc)(f"{exc}; if the catalog is lost or damaged, `ckptstore recover --store {root}` rebuilds it from the packs") from None
            packs = next((rel for kind, rel, _ in walk_store(root) if kind == "pack"), None)  # (no link followed: invariant 13)
            if packs is None:
                break
            if attempt:  # packs and no catalog: the catalog was deleted
                raise CatalogCorruptError(
                    f"{catalog} is missing or empty but {root / 'blobs'} holds packs: the catalog was lost; "
                    f"`ckptstore recover --store {root}` rebuilds it from the packs"
                )
            time.sleep(0.05)  # or a concurrent creator has just made its first commit: look again
        others = sorted(p.name for p in root.iterdir() if not _STORE_NAMES.match(p.name)) if root.is_dir() else []
        if others:  # a folder that holds other things than a store's files
            raise NotAStoreError(f"{root} is not a ckptstore store (no {CATALOG}) and is not empty: {', '.join(others[:5])}")
        if not create:
            return None
        try:
            root.mkdir(parents=True, exist_ok=True)
            cat = Catalog(catalog, create=True)
        except OSError as exc:
            raise NotAStoreError(f"cannot create a store at {root}: {exc}") from None
        except CatalogMissing:
            raise StoreWriteError(f"cannot create a store at {root}: the folder cannot be written") from None
        for sub in ("blobs", "tmp"):
            (root / sub).mkdir(exist_ok=True)
        return cat

    def missing(self) -> str:
        """Why there is no store at :attr:`root` (for NotAStoreError)."""
        if not self.root.exists():
            return "does not exist"
        if (self.root / CATALOG).exists():
            return f"is not a ckptstore store yet ({CATALOG} was never initialised: its creation was interrupted)"
        return f"is not a ckptstore store (no {CATALOG})"

    def backfill_records(self) -> None:
        """Finish the migration of an older catalog: write the records a store migrated from
        schema 1 lacks in packs (each commit's, each tag's last move) and clear the pending
        mark, in one transaction (:func:`ckptstore.home.catalog.backfill_records`); run by every
        writable open that finds the mark, so a migration killed at any instant is finished
        by the next one."""
        backfill_records(self.catalog, self.root, self.pack_bytes)

    @contextmanager
    def write(self):
        """A catalog write transaction that may add records (commit, ref moves).

        Yields a list to append ``(kind, name, seq, text)`` to. Before COMMIT the
        records are written to a new pack under :attr:`root`, made durable, and indexed,
        so every record the catalog describes exists in a pack (invariant 7); if the
        transaction does not commit, the pack is removed again.
        """
        batch: list[tuple[int, str, int | None, str]] = []
        self.open_catalog(create=True)
        with PackWriter(self.root, 0, self.pack_bytes) as writer:
            try:
                with self.catalog.write():
                    yield batch
                    if batch:
                        locs = [writer.append_record(kind, text.encode()) for kind, _, _, text in batch]
                        writer.finish()
                        self.catalog.conn.executemany(
                            "INSERT INTO packs (id, size, created_at) VALUES (?, ?, ?)", [(pid, size, time.time()) for pid, size in writer.pack_ids]
                        )
                        self.catalog.conn.executemany(
                            "INSERT INTO records (kind, name, seq, digest, pack, offset, raw_len, stored_len) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            [(k, n, q, loc.digest, loc.pack, loc.offset, loc.raw_len, loc.stored_len) for (k, n, q, _), loc in zip(batch, locs)],
                        )
            except BaseException:
                writer.discard()
                raise

    # --- the commit's index step -----------------------------------------------------------

    def before_commit(self) -> None:
        """Ready the index for a commit's dedup lookups (nothing here: the catalog is current)."""

    def dated(self, info: CommitInfo) -> CommitInfo:
        """The CommitInfo a commit returns (its time as the record says; here as built)."""
        return info

    def prepare_shared_commit(self) -> None:
        """The home's part of :meth:`ckptstore.store.Store.prepare_shared_commit` (nothing here)."""

    def checkout_target(self, ref: str) -> str:
        """``ref`` as checkout takes it (a home whose index is a cache resolves it first, copying the record)."""
        return ref

    def index_commit(
        self, components, leaves, keys, known, written, writer, tags, message, meta_json, explicit_parents, created_at, t0, expect=None, given_packs=(),
    ):
        """Step 4 of the commit protocol: in one catalog transaction, check that the
        reused blobs (``known``: address -> blob id) still exist (else
        :class:`~ckptstore.home.index_step.ReusedBlobsGone`), index the new blobs (``written``)
        and the commit, and move ``tags``. ``expect``: the id the record must hash to
        (IntegrityError otherwise). Returns ``(commit id, parent ids, seconds, {address: blob
        id})``: :func:`ckptstore.home.index_step.index_commit`."""
        return index_commit(self, components, leaves, keys, known, written, writer, tags, message, meta_json, explicit_parents, created_at, t0,
                            expect, given_packs)

    # --- blobs known to be bad (invariant 14) -------------------------------------------------

    def has_bad_blobs(self) -> bool:
        """Whether the index holds any blob marked bad (one probe: the table is almost always empty)."""
        return bool(self.catalog.rows("SELECT EXISTS (SELECT 1 FROM bad_blobs)", raw=True)[0][0])

    def bad_blob_ids(self, pairs: list[tuple[tuple[bytes, int], int]]) -> list[tuple[bytes, int]]:
        """The addresses of ``pairs`` (``(address, blob id)``) whose blob id is marked bad."""
        if not pairs or not self.has_bad_blobs():
            return []
        rows = self.catalog.rows(
            "SELECT j.key FROM json_each(?) j JOIN bad_blobs x ON x.blob_id = j.value", (json.dumps([i for _, i in pairs]),), raw=True)
        return [pairs[k][0] for (k,) in rows]

    def repoint_bad(self, written: dict) -> int:
        """In the commit's transaction: point each blob row marked bad whose address the commit
        wrote again (``written``: ``{address: BlobLoc}``) at the new copy, and delete its mark,
        so every commit that references the address reads the good copy. Returns the rows
        repointed."""
        if not self.has_bad_blobs():
            return 0
        conn = self.catalog.conn
        rows = conn.execute("SELECT b.id, b.hash, b.raw_len FROM bad_blobs x JOIN blobs b ON b.id = x.blob_id").fetchall()
        fixed = [(written[(bytes(h), n)], i) for i, h, n in rows if (bytes(h), n) in written]
        conn.executemany("UPDATE blobs SET pack = ?, offset = ?, stored_len = ?, codec = ? WHERE id = ?",
                         [(loc.pack, loc.offset, loc.stored_len, loc.codec, i) for loc, i in fixed])
        conn.executemany("DELETE FROM bad_blobs WHERE blob_id = ?", [(i,) for _, i in fixed])
        return len(fixed)

    def mark_bad(self, bad: list[tuple[BlobLoc, str]]) -> int:
        """Record that the copies at ``bad`` (``(location, why)``: a read that failed
        verification, fsck) are damaged, so that dedup never reuses them: the next commit of
        their content writes a new copy, which replaces them (invariant 14). Only where the
        blob row still points at that copy (a GC or a commit may have moved it meanwhile).

        Never raises and never writes a catalog that cannot be written here (a read-only
        store), nor inside a transaction of this connection; returns the blobs newly marked."""
        cat = self._catalog
        if not bad or cat is None or not cat.writable:
            return 0
        try:
            with cat.lock:
                if cat.conn.in_transaction:
                    return 0
                with cat.write():
                    before = cat.conn.total_changes
                    cat.conn.executemany(
                        "INSERT OR IGNORE INTO bad_blobs (blob_id, pack, offset, found_at, reason) "
                        "SELECT id, pack, offset, ?, ? FROM blobs WHERE hash = ? AND raw_len = ? AND pack = ? AND offset = ?",
                        [(time.time(), why[:1000], loc.digest, loc.raw_len, loc.pack, loc.offset) for loc, why in bad],
                    )
                    return cat.conn.total_changes - before
        except CkptStoreError:  # (busy, disk full, damaged): the read's own error is what the caller reports
            return 0

    def marked(self) -> list[BlobLoc]:
        """Where the index's rows marked bad point now (few: each one is replaced by the next
        commit of its bytes)."""
        return [BlobLoc(bytes(h), n, p, o, sl, c) for h, n, p, o, sl, c in self.catalog.rows(
            "SELECT b.hash, b.raw_len, b.pack, b.offset, b.stored_len, b.codec FROM bad_blobs x JOIN blobs b ON b.id = x.blob_id", raw=True)]

    def replace_copy(self, loc: BlobLoc, good: BlobLoc) -> bool:
        """Point the blob row of the bad copy ``loc`` at ``good`` (another copy of the same
        address, verified by the caller, in a pack the index knows and a GC has not retired)
        and delete its mark: fsck's repair. True when the row points at ``good`` afterwards;
        False when it points elsewhere or that pack is retired or gone (a GC deletes a pack
        only while no row points into it).

        Raises:
            StoreWriteError: the catalog cannot be written here.
            CatalogBusyError: it stayed locked."""
        cat = self.catalog
        with cat.write():
            if not cat.rows("SELECT 1 FROM packs WHERE id = ? AND retired_at IS NULL", (good.pack,), raw=True):
                return False
            n = cat.conn.execute(
                "UPDATE blobs SET pack = ?, offset = ?, stored_len = ?, codec = ? WHERE hash = ? AND raw_len = ? AND pack = ? AND offset = ?",
                (good.pack, good.offset, good.stored_len, good.codec, loc.digest, loc.raw_len, loc.pack, loc.offset)).rowcount
            if not n:  # (moved there meanwhile: a cache's refresh)
                n = len(cat.rows("SELECT 1 FROM blobs WHERE hash = ? AND raw_len = ? AND pack = ? AND offset = ?",
                                 (loc.digest, loc.raw_len, good.pack, good.offset), raw=True))
            if n:
                cat.conn.execute("DELETE FROM bad_blobs WHERE blob_id IN (SELECT id FROM blobs WHERE hash = ? AND raw_len = ?)", (loc.digest, loc.raw_len))
        return n > 0

    def relocate_reused(self, keys: list[tuple[bytes, int]]) -> dict[tuple[bytes, int], int]:
        """Blob ids of those of ``keys`` (addresses a commit meant to reuse, which a GC
        removed meanwhile) that the store holds elsewhere. A local GC updates the catalog
        in its own transaction, so a blob it moved is found by the next lookup; {} here
        means every one is written again."""
        return {}

    def refresh_index(self, only: list[str] | None = None) -> int:
        """Bring the index up to date with the objects before a lookup that must see every
        blob the store holds; returns the packs read. A local store's catalog is updated by
        every commit in its own transaction: nothing to do (0). On object storage the cache
        reads the pack indexes it has not seen (:meth:`ckptstore.home.bucket.BucketHome.refresh_index`)."""
        return 0

    def held(self, cid: str) -> str:
        """``cid`` (named by a tag), once the index holds its commit: the catalog does
        already (the refs checked it)."""
        return cid

    def find_commit(self, ref: str) -> str:
        """The commit a full id or unique id prefix ``ref`` names, from the index."""
        ref_l = ref.lower()
        if len(ref_l) >= records.MIN_PREFIX and all(c in "0123456789abcdef" for c in ref_l):
            rows = self.catalog.rows("SELECT id FROM commits WHERE substr(id, 1, ?) = ? LIMIT 10", (len(ref_l), ref_l))
            if len(rows) == 1:
                return rows[0]["id"]
            if len(rows) > 1:
                ids = ", ".join(r["id"][:12] for r in rows)
                raise AmbiguousRefError(f"ref {ref!r} is an ambiguous commit id prefix: matches {ids}")
        raise RefNotFoundError(records.unknown_ref(ref, self.root, [t for t in self.tags() if t.startswith(ref + "/")]))

    def tagged(self) -> dict[str, CommitInfo]:
        """``{tag name: CommitInfo of the commit it names}``, sorted by name, read in one
        snapshot (a concurrent GC cannot drop a tagged commit in between). On object storage
        a tag whose commit record is missing or damaged is listed all the same, its info
        saying so (``created_at`` 0, no parents, zero counts)."""
        with self.catalog.read():
            named = self.tags()
            infos = self.index_infos(list(set(named.values())))
        for name, cid in named.items():
            if cid not in infos:
                raise damaged(self.catalog.path, f"tag {name!r} points to commit {cid}, which is not in the catalog")
        return {name: infos[cid] for name, cid in named.items()}

    def has_commit(self, cid: str) -> bool:
        """Does the store hold commit ``cid`` (a full id)? ``False`` for a store not created yet."""
        return self.has_cached(cid)

    def info(self, ref: str) -> CommitInfo:
        """The :class:`CommitInfo` of one commit.

        Raises:
            RefNotFoundError / AmbiguousRefError: bad ref.
        """
        with self.catalog.read():  # one snapshot: a GC cannot drop the commit between its ref and its row
            cid = self.resolve(ref)
            found = self.index_infos([cid]).get(cid)
        if found is None:
            raise RefNotFoundError(f"commit {cid} is not in {self.root}")
        return found

    def infos(self, ids: list[str]) -> dict[str, CommitInfo]:
        """``{commit id: CommitInfo}`` of the full commit ids ``ids`` the store holds (others are
        left out; on object storage the records the cache lacks are copied from the bucket first).

        Raises:
            BackendError: the storage failed.
        """
        return self.index_infos(ids)

    def index_infos(self, ids: list[str]) -> dict[str, CommitInfo]:
        """:meth:`infos` from the index alone (what the index holds; on object storage, the cache)."""
        rows = self.catalog.chunked("SELECT * FROM commits WHERE id IN ({})", ids)
        parents: dict[str, list[str]] = {}
        for r in self.catalog.chunked("SELECT commit_id, parent_id FROM parents WHERE commit_id IN ({}) ORDER BY position", ids):
            parents.setdefault(r["commit_id"], []).append(r["parent_id"])
        tags: dict[str, list[str]] = {}
        for r in self.catalog.chunked("SELECT name, commit_id FROM tags WHERE commit_id IN ({}) ORDER BY name", ids):
            tags.setdefault(r["commit_id"], []).append(r["name"])
        return {
            r["id"]: CommitInfo(
                id=r["id"], tags=tuple(tags.get(r["id"], ())), parents=tuple(parents.get(r["id"], ())),
                created_at=r["created_at"], message=r["message"], metadata=jsonvalue.loads(r["metadata"]),
                logical_bytes=r["logical_bytes"], new_bytes=r["new_bytes"], stored_bytes=r["stored_bytes"],
                shards_total=r["shards_total"], shards_new=r["shards_new"], seconds=r["seconds"],
            )
            for r in rows
        }

    def log(self, ref: str | None = None, limit: int | None = None) -> list[CommitInfo]:
        """Lineage of ``ref`` (itself and all its ancestors), newest first.

        Without ``ref``, every commit in the store, newest first. ``limit``
        (>= 1) keeps the newest ones. Raises InvalidArgumentError for a bad limit.
        """
        if limit is not None and (type(limit) is not int or limit < 1):
            raise InvalidArgumentError(f"invalid limit {limit!r}: must be an integer >= 1")
        if ref is None:
            ids = [r["id"] for r in self.catalog.rows("SELECT id FROM commits ORDER BY created_at DESC, id")]
        else:
            seen: list[str] = []
            frontier = [self.resolve(ref)]
            known: set[str] = set()
            while frontier:
                known.update(frontier)
                seen += frontier
                rows = self.catalog.chunked("SELECT parent_id FROM parents WHERE commit_id IN ({})", frontier)
                frontier = list(dict.fromkeys(r["parent_id"] for r in rows if r["parent_id"] not in known))
            ids = seen
        infos = self.index_infos(ids)
        out = sorted((infos[i] for i in ids if i in infos), key=lambda c: (-c.created_at, c.id))
        return out[:limit] if limit else out

    def show(self, ref: str) -> dict:
        """What one commit holds, for ``ckptstore show``.

        Returns ``{"commit": CommitInfo, "components": {path: {...}}, "leaves": [...]}``
        where each leaf has ``path``, ``component``, ``kind``, ``dtype``, ``shape``,
        ``logical_bytes``, ``stored_bytes`` (its blobs in packs, headers included),
        ``shards`` and ``shared_with_parent`` (shards whose blob the first parent
        also references).
        """
        info = self.info(ref)
        parent = info.parents[0] if info.parents else ""
        stats = {
            r["path"]: r
            for r in self.catalog.rows(
                "SELECT l.path, COUNT(*) AS shards, SUM(b.stored_len + ?) AS stored, "
                "SUM(s.blob_id IN (SELECT s2.blob_id FROM shards s2 JOIN commit_leaves l2 ON l2.id = s2.leaf_id WHERE l2.commit_id = ?)) AS shared "
                "FROM commit_leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id WHERE l.commit_id = ? GROUP BY l.path",
                (BLOB_HEADER.size, parent, info.id),
            )
        }
        leaves = []
        for r in self.catalog.rows(  # component by component (a commit may share another's rows for some)
            "SELECT l.* FROM commit_leaves l LEFT JOIN components c ON c.commit_id = l.commit_id AND c.path = l.component "
            "WHERE l.commit_id = ? ORDER BY c.rowid, l.id", (info.id,)):
            st = stats.get(r["path"])
            leaves.append({
                "path": r["path"], "component": r["component"], "kind": r["kind"], "dtype": r["dtype"],
                "shape": None if r["shape"] is None else jsonvalue.loads(r["shape"]),
                "logical_bytes": r["nbytes"], "stored_bytes": st["stored"] if st else 0,
                "shards": st["shards"] if st else 0, "shared_with_parent": st["shared"] if st else 0,
            })
        return {"commit": info, "components": self.components(info.id), "leaves": leaves}

    def du(self) -> dict:
        """Space accounting in bytes, for ``ckptstore du``.

        ``logical_bytes``: tensor bytes summed over all commits (what saving
        each commit in full would write); ``unique_bytes``: raw bytes of distinct
        blobs; ``stored_bytes``: bytes of live blobs in packs; ``pack_bytes``:
        pack file sizes on disk (dead blobs included, until GC repacks);
        ``catalog_bytes``: the catalog's files (the index; on a bucket the local cache);
        ``reserve_bytes``: ``catalog.sqlite-reserve``, the room kept for the catalog's journal
        on a full disk (docs/operations.md); ``dedup_ratio`` = logical / unique;
        ``compression_ratio`` = unique / stored.
        """
        c = self.catalog.rows("SELECT COUNT(*) AS n, COALESCE(SUM(logical_bytes), 0) AS logical FROM commits")[0]
        b = self.catalog.rows(
            "SELECT COUNT(*) AS n, COALESCE(SUM(raw_len), 0) AS raw, COALESCE(SUM(stored_len + ?), 0) AS stored FROM blobs",
            (BLOB_HEADER.size,),
        )[0]
        p = self.catalog.rows("SELECT COUNT(*) AS n, COALESCE(SUM(size), 0) AS size FROM packs")[0]
        files = {f.name: f.stat().st_size for f in self.root.glob(CATALOG + "*") if f.is_file() and not f.name.endswith(".bak")}
        reserve = files.pop(reserve_path(self.root / CATALOG).name, 0)
        catalog = sum(files.values())
        tmp = sum(st.st_size for kind, _, st in walk_store(self.root) if kind == "tmp")  # (no tmp/ folder: none)
        return {
            "commits": c["n"], "tags": len(self.tags()), "blobs": b["n"], "packs": p["n"],
            "logical_bytes": c["logical"], "unique_bytes": b["raw"], "stored_bytes": b["stored"],
            "pack_bytes": p["size"], "catalog_bytes": catalog, "reserve_bytes": reserve, "tmp_bytes": tmp,
            "dedup_ratio": c["logical"] / b["raw"] if b["raw"] else None,
            "compression_ratio": b["raw"] / b["stored"] if b["stored"] else None,
        }

    # --- refs ----------------------------------------------------------------------------------

    def resolve(self, ref: str) -> str:
        """The commit id a ref names: a tag, a full commit id, or a unique id prefix of at
        least 4 hex digits (as git: a shorter one is too easily a mistyped tag).

        Raises:
            RefNotFoundError: nothing matches.
            AmbiguousRefError: a prefix matches several commits (they are listed).
            IntegrityError: the tag is damaged (or names a commit the store lacks).
        """
        if type(ref) is not str or not ref or not jsonvalue.is_text(ref):
            raise RefNotFoundError(f"invalid ref {ref!r}")
        if _FULL_ID.fullmatch(ref) and self.has_cached(ref):
            return ref  # a commit the index holds (no tag is named by hex digits: check_tag); records are immutable
        cid = self.refs.read(ref)
        return self.held(cid) if cid is not None else self.find_commit(ref)

    def tags(self) -> dict[str, str]:
        """``{tag name: commit id}``, sorted by name (on object storage: the refs as on the
        bucket now, never the commits they name)."""
        return self.refs.list()

    def tag(self, name: str, ref: str, *, expect: str | None | type[Ellipsis] = ...) -> str:
        """Create or move tag ``name`` to the commit ``ref`` names; returns its id.

        Atomic: one transaction moves the tag and appends a reflog row. With
        ``expect`` (a commit id, or ``None`` for "no such tag yet") it is a
        compare-and-swap: RefConflictError, and nothing changes, when the tag
        names something else at that moment.
        """
        check_tag(name)
        with self.refs.transaction() as txn:  # locally one catalog transaction; on object storage each move is a CAS
            cid = self.resolve(ref)
            self.refs.move({name: (expect, cid)}, "tag", None, txn)
        return cid

    def delete_tag(self, name: str) -> str:
        """Delete tag ``name`` (its commits stay until GC); returns the commit it named
        (on object storage ``""`` for a tag whose payload was malformed: it is removed all the same).

        Raises:
            RefNotFoundError: no such tag.
        """
        return self.refs.delete(name)

    def reflog(self, tag: str | None = None) -> list[dict]:
        """Every tag move, newest first: ``{tag, old_commit, new_commit, at, action}``.

        Raises RefNotFoundError for a tag that never existed.
        """
        return self.refs.reflog(tag)

    def has_cached(self, cid: str) -> bool:
        """Does the index hold commit ``cid``'s rows? (Locally the index is the store.)"""
        return self.open_catalog(create=False) is not None and bool(self.catalog.rows("SELECT 1 FROM commits WHERE id = ?", (cid,)))

    # --- records, manifests and blob locations ---------------------------------------------

    def record(self, ref: str) -> records.CommitRecord:
        """The commit record of ``ref`` (see :mod:`ckptstore.objects.records`), checked against its id.

        Checkout, export, diff and verify read a commit's manifest only from
        here, so a catalog row edited or rotted after the commit is detected
        (IntegrityError naming the commit), never returned.

        Raises:
            RefNotFoundError / AmbiguousRefError: bad ref.
            IntegrityError: the record is missing, damaged or malformed.
        """
        cid = self.resolve(ref)
        cached = self._records.get(cid)
        if cached is None:
            rows = self.catalog.rows("SELECT record FROM commits WHERE id = ?", (cid,))
            cached = records.parse_commit(rows[0]["record"] if rows else None, cid)
            if len(self._records) > 8:
                self._records.clear()
            self._records[cid] = cached
        return cached

    def components(self, ref: str) -> dict[str, dict]:
        """``{component path: {"adapter", "version", "meta"}}`` of a commit."""
        return self.record(ref).components

    def manifest(self, ref: str, prefixes: list[str] | None = None) -> list[LeafRecord]:
        """Leaf records of a commit (under path ``prefixes`` if given), each tensor
        leaf's ``shards`` located in the packs.

        Raises:
            IntegrityError: the record is damaged (see :meth:`record`).
            BlobMissingError: a shard's blob is not in the catalog.
        """
        rec = self.record(ref)
        leaves = [
            LeafRecord(r.path, r.component, r.kind, r.dtype, r.shape, r.nbytes, r.shard_bytes, r.value, r.stride, keys=r.keys)
            for r in rec.leaves
            if prefixes is None or any(under(r.path, p) for p in prefixes)
        ]
        found = self.locate([k for r in leaves for k in r.keys])
        for r in leaves:
            for i, key in enumerate(r.keys):
                loc = found.get(key)
                if loc is None:
                    raise BlobMissingError(f"commit {rec.id}, leaf {r.path}: shard {i} (blob {address(*key)}) is not in the catalog")
                r.shards.append(loc)
        return leaves

    def locate(self, keys: list[tuple[bytes, int]]) -> dict[tuple[bytes, int], BlobLoc]:
        """Where the catalog says each blob (``(XXH3-128 digest, length)`` address) is; absent ones are left out."""
        wanted = set(keys)
        rows = self.catalog.chunked(
            "SELECT hash, raw_len, pack, offset, stored_len, codec FROM blobs WHERE hash IN ({})", list({d for d, _ in wanted}), raw=True
        )
        return {(h, n): BlobLoc(h, n, p, o, sl, c) for h, n, p, o, sl, c in rows if (h, n) in wanted}

    def relocate(self, loc: BlobLoc) -> BlobLoc | None:
        """The current location of the blob at ``loc`` (a GC may have repacked it), or ``None``."""
        return self.locate([(loc.digest, loc.raw_len)]).get((loc.digest, loc.raw_len))

    def lookup(self, keys: list[tuple[bytes, int]]) -> dict[tuple[bytes, int], int]:
        """Blob ids of the addresses the catalog already holds, less those marked bad
        (``bad_blobs``: a read or fsck found the copy damaged): dedup never reuses a bad blob;
        the commit writes the address again and its index step points the row at the new copy."""
        wanted = set(keys)
        rows = self.catalog.chunked("SELECT hash, raw_len, id FROM blobs WHERE hash IN ({})", list({d for d, _ in keys}), raw=True)
        found = {(h, n): i for h, n, i in rows if (h, n) in wanted}
        if found:  # (a few rows at most, almost always none: one probe; in the SQL above it cost 3x the lookup)
            bad = {r[0] for r in self.catalog.rows("SELECT blob_id FROM bad_blobs", raw=True)}
            if bad:
                found = {k: i for k, i in found.items() if i not in bad}
        return found

    def newest_commit(self, adapter: str) -> str | None:
        """Id of the newest commit holding a component stored by ``adapter``, or ``None``."""
        rows = self.catalog.rows(
            "SELECT c.id FROM commits c JOIN components k ON k.commit_id = c.id WHERE k.adapter = ? ORDER BY c.created_at DESC, c.id LIMIT 1",
            (adapter,),
        )
        return rows[0]["id"] if rows else None

    def leaf_blobs(self, commits: Sequence[str], paths: Sequence[str]) -> dict[str, dict[tuple[bytes, int], int]]:
        """``{leaf path: {address: blob id}}`` of the shards that leaves ``paths`` of ``commits``
        (commit ids) reference, from the catalog's index. Hints only: a commit that reuses
        these ids passes them as ``prior``, and its transaction rechecks each one."""
        out: dict[str, dict[tuple[bytes, int], int]] = {}
        for cid in dict.fromkeys(commits):
            rows = self.catalog.chunked(
                "SELECT l.path, b.hash, b.raw_len, b.id FROM commit_leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id "
                "WHERE l.commit_id = ? AND l.path IN ({})", list(dict.fromkeys(paths)), (cid,), raw=True,
            )
            for path, h, n, i in rows:
                out.setdefault(path, {})[(h, n)] = i
        return out

    # --- objects (each home's own) ---------------------------------------------------------

    def pack_writer(self):
        """A writer of new packs for one commit (:class:`ckptstore.objects.packs.PackWriter`'s interface)."""
        raise NotImplementedError

    def pack_reader(self, sparse: bool = False):
        """A reader of this store's packs (:class:`ckptstore.objects.packs.PackReader`'s interface);
        ``sparse``: a few blobs will be read, no readahead."""
        raise NotImplementedError

    def pack_size(self, pack: str) -> int | None:
        """Bytes of pack ``pack`` (an id) as the store holds it now, or ``None`` if it holds no such pack."""
        raise NotImplementedError

    # --- the maintenance protocols' sides (each home's own: :mod:`ckptstore.home.upkeep`) --------------

    def gc_side(self):
        """This home's primitives of the GC protocol (an :class:`ckptstore.home.upkeep.GCSide`)."""
        raise NotImplementedError

    def fsck_side(self):
        """This home's primitives of the fsck protocol (an :class:`ckptstore.home.upkeep.FsckSide`)."""
        raise NotImplementedError

__all__ = ["CATALOG", "Home", "weakly"]
