"""Homes: where a store's objects, refs and index live, behind one interface.

A store (:class:`ckptstore.store.Store`, the facade) is a **home** and the protocols that
run against it. A home provides three parts:

- **objects**: the packs of blobs and records: :meth:`Home.pack_writer`,
  :meth:`Home.pack_reader`, :meth:`Home.pack_size`;
- **refs**: the tags, moved by compare-and-swap (:meth:`Home.make_refs`: a
  :class:`~ckptstore.refs.CatalogRefs` locally, a :class:`~ckptstore.refs.BucketRefs` on
  object storage);
- **the index**: a SQLite catalog (``catalog.sqlite`` under :attr:`Home.root`): where the
  local store lives, a cache of the bucket's immutable objects on object storage. Opening
  it (:meth:`Home.open_index`, the settings, :meth:`Home.backfill_records`), its write
  transaction that adds records (:meth:`Home.write`), the commit's index step
  (:meth:`Home.index_commit`), the index's upkeep
  (:meth:`Home.refresh_index`, :meth:`Home.relocate_reused`) and the queries that read refs
  and commits (:meth:`Home.held`, :meth:`Home.find_commit`, :meth:`Home.tagged`,
  :meth:`Home.info`, :meth:`Home.infos`, :meth:`Home.log`, :meth:`Home.show`, :meth:`Home.du`)
  are written here against the catalog; a home whose index is a cache overrides them to
  bring the cache up to date first.

:class:`Home` is that shared part (the index as a catalog), :class:`LocalHome` the store in
a folder; :class:`ckptstore.bucket.BucketHome` is the store on object storage. A home holds
its store weakly (the store owns its home, not the reverse).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import jsonvalue, progress, records
from .catalog import Catalog, CatalogMissing, damaged, rebuild_record, reserve_path
from .commit import CommitInfo, Reused, ReusedBlobsGone, given_stored, ints_json
from .errors import (
    AmbiguousRefError,
    BlobCorruptError,
    BlobMissingError,
    CatalogCorruptError,
    CkptStoreError,
    IntegrityError,
    InvalidArgumentError,
    NotAStoreError,
    RefNotFoundError,
    ResourceLimitError,
    StoreWriteError,
)
from .fsck import FsckReport
from .gc import GCReport, GCSide, PackStat, gc_lock, packed, unlocked
from .layout import ShardPlan, address, itemsize
from .packs import (
    BLOB_HEADER, BLOB_MAGIC, CODEC_RAW, DEFAULT_PACK_BYTES, RECORD_MAGIC, BlobLoc, PackReader, PackWriter, check_entry, fsync_dir, pack_path,
)
from .records import KIND_COMMIT, KIND_REF, LeafRecord
from .refs import ANY, CatalogRefs, Refs

if TYPE_CHECKING:
    from .store import Store

#: The catalog's file name, under the home's :attr:`Home.root`.
CATALOG = "catalog.sqlite"
# The only names in a store's folder: one with others and no catalog is not a store (leases: ckptstore.run).
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
    alive: the store owns its refs, not the reverse (no reference cycle, so a store
    dropped without ``close`` still frees its catalog connection at once)."""
    me = weakref.ref(owner)

    def one(name: str):
        if callable(getattr(type(owner), name, None)):
            return lambda *args: getattr(me(), name)(*args)
        return lambda: getattr(me(), name)

    return [one(n) for n in names]


class Home:
    """The part of a home both homes share: the index is a SQLite catalog (the store's
    ``catalog``) under :attr:`root`. Subclasses provide the objects and the refs.

    Attributes:
        root: the folder of the catalog (locally the store's folder).
        pack_bytes: the default pack size in bytes.
        location: where the store lives, as ``Store(location)`` opens it.
    """

    pack_bytes = DEFAULT_PACK_BYTES
    #: Whether the index holds only copies (a damaged one is moved aside and rebuilt).
    disposable_index = False

    def __init__(self, store: Store, root: Path):
        self._store = weakref.ref(store)
        self.root = root

    @property
    def store(self) -> Store:
        """The store (the facade) this home belongs to."""
        return self._store()

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
        return CatalogRefs(*weakly(self.store, "catalog"), *weakly(self, "write"), str(self.root))

    def close(self) -> None:
        """Release what the home holds beside the catalog (nothing here)."""

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
            packs = next(iter(root.glob("blobs/*/*.pack")), None)
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
        """Write the records a store migrated from schema 1 lacks: each commit's, and each tag's last move."""
        store = self.store
        with self.write() as batch:
            for cid, text in store.catalog.rows(
                f"SELECT id, record FROM commits WHERE record IS NOT NULL AND id NOT IN (SELECT name FROM records WHERE kind = {records.KIND_COMMIT})"
            ):
                batch.append((records.KIND_COMMIT, cid, None, text))
            for seq, tag, old, new, at, action in store.catalog.rows(
                "SELECT id, tag, old_commit, new_commit, at, action FROM reflog WHERE id IN (SELECT MAX(id) FROM reflog GROUP BY tag) "
                f"AND tag NOT IN (SELECT name FROM records WHERE kind = {records.KIND_REF})"
            ):
                batch.append((records.KIND_REF, tag, seq, records.ref_text(seq, tag, old, new, at, action)))

    @contextmanager
    def write(self):
        """A catalog write transaction that may add records (commit, ref moves).

        Yields a list to append ``(kind, name, seq, text)`` to. Before COMMIT the
        records are written to a new pack under :attr:`root`, made durable, and indexed,
        so every record the catalog describes exists in a pack (invariant 7); if the
        transaction does not commit, the pack is removed again.
        """
        store = self.store
        batch: list[tuple[int, str, int | None, str]] = []
        store._open(create=True)
        with PackWriter(self.root, 0, store.pack_bytes) as writer:
            try:
                with store.catalog.write():
                    yield batch
                    if batch:
                        locs = [writer.append_record(kind, text.encode()) for kind, _, _, text in batch]
                        writer.finish()
                        store.catalog.conn.executemany(
                            "INSERT INTO packs (id, size, created_at) VALUES (?, ?, ?)", [(pid, size, time.time()) for pid, size in writer.pack_ids]
                        )
                        store.catalog.conn.executemany(
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
        :class:`ReusedBlobsGone`), index the new blobs (``written``) and the commit, and move
        ``tags``. ``expect``: the id the record must hash to (IntegrityError otherwise).
        Returns ``(commit id, parent ids, seconds, {address: blob id})``."""
        store = self.store
        with self.write() as batch:
            shared = self._shared_rows(components)
            if shared:  # their blob ids are those of rows that exist: not checked again
                confirmed: dict[tuple[bytes, int], int] = {}
                for c in components:
                    if c.path in shared:
                        confirmed.update(c.blobs)
                check = {k: i for k, i in known.items() if k not in confirmed}
                known = {**check, **confirmed}
            else:
                check = known
            if check:
                # An id must still hold the same address: GC may have freed it and a new blob taken the id since.
                # The per-shard rows of a commit (thousands for a large buffer, most of them
                # unchanged shards) go to SQLite as one JSON array in one statement, here and for
                # the shards table below: executemany and fetchall release and retake the GIL once
                # per row, and a thread that does that thousands of times starves the others of
                # it (each waits a switch interval, 5 ms, to get it back), the training loop
                # beside an asynchronous commit among them. This one returns only the mismatches.
                reused = list(check.items())
                # First one cheap statement: the addresses the ids hold now, in the ids' order, as one text;
                # only if it differs, the one that names the ids that changed.
                (now,), = store.catalog.rows(
                    "SELECT group_concat(lower(hex(b.hash)) || '-' || b.raw_len, ' ') FROM json_each(?) j LEFT JOIN blobs b ON b.id = j.value",
                    (json.dumps([i for _, i in reused]),), raw=True,
                )
                same = now == " ".join([address(d, n) for (d, n), _ in reused])
                bad = [] if same else store.catalog.rows(
                    "SELECT j.key FROM json_each(?) j LEFT JOIN blobs b ON b.id = json_extract(j.value, '$[0]') "
                    "WHERE b.id IS NULL OR b.raw_len != json_extract(j.value, '$[2]') OR lower(hex(b.hash)) != json_extract(j.value, '$[1]')",
                    (json.dumps([[i, d.hex(), n] for (d, n), i in reused]),), raw=True,
                )
                gone = [reused[k][0] for (k,) in bad]
                if gone:
                    raise ReusedBlobsGone(gone)
            # Plain SQL, not sqlite-utils' tables: these look the schema up (several queries) on every call.
            run_many = store.catalog.conn.executemany
            run_many(
                "INSERT OR IGNORE INTO packs (id, size, created_at) VALUES (?, ?, ?)",
                [(pid, size, created_at) for pid, size in [*writer.pack_ids, *given_packs]],
            )
            run_many(
                "INSERT OR IGNORE INTO blobs (hash, raw_len, pack, offset, stored_len, codec, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(loc.digest, loc.raw_len, loc.pack, loc.offset, loc.stored_len, loc.codec, created_at) for loc in written.values()],
            )
            ids = dict(known)
            ids.update(store._lookup(list(written)))
            if explicit_parents is not None:
                parents = explicit_parents
            else:
                current = {r["name"]: r["commit_id"] for r in store.catalog.chunked("SELECT name, commit_id FROM tags WHERE name IN ({})", tags)}
                parents = list(dict.fromkeys(current[t] for t in tags if t in current))
            per_leaf = self._keys_per_leaf(leaves, keys)
            for r, keys_of in zip(leaves, per_leaf):
                if r.encoded is None:  # (set on the records of a Reused component)
                    r.encoded = (records.manifest_entry(r, keys_of), (
                        r.path, r.component, r.kind, r.dtype, None if r.shape is None else ints_json(r.shape),
                        None if r.stride is None else ints_json(r.stride), r.nbytes, r.shard_bytes, r.value,
                    ))
            manifest = [r.encoded[0] for r in leaves]
            components_json = [[c.path, c.adapter, c.version, jsonvalue.dumps(c.meta, c.path)] for c in components]  # (few)
            record = records.commit_text(parents, created_at, message, meta_json, components_json, manifest)
            cid = records.commit_id(record)
            seconds = time.perf_counter() - t0
            if expect is not None and cid != expect:
                raise IntegrityError(f"the commit's content hashes to {cid}, not to its recorded id {expect}")
            if store.catalog.rows("SELECT 1 FROM commits WHERE id = ?", (cid,)):  # imported before: only the tags move
                if tags:
                    store.refs.move(dict.fromkeys(tags, (ANY, cid)), "import", created_at, batch)
                return cid, parents, seconds, ids
            new_bytes = sum(n for _, n in written)
            store.catalog.conn.execute(
                "INSERT INTO commits (id, created_at, message, metadata, logical_bytes, new_bytes, stored_bytes, shards_total, shards_new, "
                "seconds, record) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (cid, created_at, message, meta_json, sum(r.nbytes for r in leaves if r.kind == "tensor"), new_bytes,
                 writer.stored_bytes + given_stored(written, given_packs), len(keys), len(written), seconds, record),
            )
            batch.append((records.KIND_COMMIT, cid, None, record))
            run_many("INSERT INTO parents (commit_id, position, parent_id) VALUES (?, ?, ?)", [(cid, i, p) for i, p in enumerate(parents)])
            run_many(
                "INSERT INTO components (commit_id, path, adapter, version, meta, rows_of) VALUES (?, ?, ?, ?, ?, ?)",
                [(cid, c.path, c.adapter, c.version, meta, shared.get(c.path)) for c, (_, _, _, meta) in zip(components, components_json)],
            )
            if shared:  # a shared component's leaves and shards are rows of its owner's
                per_leaf = [keys_of for r, keys_of in zip(leaves, per_leaf) if r.component not in shared]
                leaves = [r for r in leaves if r.component not in shared]
            run_many(
                "INSERT INTO leaves (commit_id, path, component, kind, dtype, shape, stride, nbytes, shard_bytes, value) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(cid, *r.encoded[1]) for r in leaves],
            )
            leaf_ids = dict(store.catalog.rows("SELECT path, id FROM leaves WHERE commit_id = ?", (cid,), raw=True))
            # A leaf's shard rows from one JSON array of blob ids, as the check above; the one row of a
            # one-shard leaf (most of a state of many small leaves) as a plain row: json_each costs more.
            single, multi = [], []
            for r, keys_of in zip(leaves, per_leaf):
                if len(keys_of) == 1:
                    single.append((leaf_ids[r.path], 0, ids[keys_of[0]]))
                elif keys_of:
                    multi.append((leaf_ids[r.path], json.dumps([ids[k] for k in keys_of])))
            run_many("INSERT INTO shards (leaf_id, seq, blob_id) VALUES (?, ?, ?)", single)
            run_many("INSERT INTO shards (leaf_id, seq, blob_id) SELECT ?, key, value FROM json_each(?)", multi)
            if tags:  # in this transaction: the commit's rows and its tag moves are one
                store.refs.move(dict.fromkeys(tags, (ANY, cid)), "commit", created_at, batch)
        return cid, parents, seconds, ids

    def _shared_rows(self, components: list) -> dict[str, str]:
        """``{component path: commit id}`` of the :class:`~ckptstore.commit.Reused` components
        whose rows exist now, in the caller's transaction, and the commit that owns them: that
        of the component's last commit (itself, or the owner it points at), else its owner's
        (if it still owns them). A GC that dropped both since leaves the component out: its
        rows are written again (and its blob ids checked). Each one's ``owner`` and
        ``confirmed`` are set to what was found."""
        out: dict[str, str] = {}
        for c in components:
            if type(c) is Reused:
                found = self.store.catalog.rows(
                    "SELECT COALESCE(rows_of, commit_id) FROM components WHERE path = ? AND commit_id IN (?, ?) "
                    "ORDER BY commit_id = ? DESC LIMIT 1", (c.path, c.last, c.owner, c.last), raw=True)
                c.confirmed = bool(found)
                if found:
                    c.owner = out[c.path] = found[0][0]
        return out

    @staticmethod
    def _keys_per_leaf(leaves: list[LeafRecord], keys: list[tuple[bytes, int]]) -> list[list[tuple[bytes, int]]]:
        out, i = [], 0
        for r in leaves:
            n = max(1, -(-r.nbytes // r.shard_bytes)) if r.kind == "tensor" else 0  # ShardPlan.count
            out.append(keys[i : i + n])
            i += n
        return out

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
        reads the pack indexes it has not seen (:meth:`ckptstore.bucket.BucketHome.refresh_index`)."""
        return 0

    def held(self, cid: str) -> str:
        """``cid`` (named by a tag), once the index holds its commit: the catalog does
        already (the refs checked it)."""
        return cid

    def find_commit(self, ref: str) -> str:
        """The commit a full id or unique id prefix ``ref`` names, from the index."""
        ref_l = ref.lower()
        if len(ref_l) >= records.MIN_PREFIX and all(c in "0123456789abcdef" for c in ref_l):
            rows = self.store.catalog.rows("SELECT id FROM commits WHERE substr(id, 1, ?) = ? LIMIT 10", (len(ref_l), ref_l))
            if len(rows) == 1:
                return rows[0]["id"]
            if len(rows) > 1:
                ids = ", ".join(r["id"][:12] for r in rows)
                raise AmbiguousRefError(f"ref {ref!r} is an ambiguous commit id prefix: matches {ids}")
        raise RefNotFoundError(records.unknown_ref(ref, self.store.root, [t for t in self.store.tags() if t.startswith(ref + "/")]))

    def tagged(self) -> dict[str, CommitInfo]:
        """``{tag name: CommitInfo of the commit it names}``, sorted by name, read in one
        snapshot (a concurrent GC cannot drop a tagged commit in between)."""
        with self.store.catalog.read():
            named = self.store.tags()
            infos = self.index_infos(list(set(named.values())))
        for name, cid in named.items():
            if cid not in infos:
                raise damaged(self.store.catalog.path, f"tag {name!r} points to commit {cid}, which is not in the catalog")
        return {name: infos[cid] for name, cid in named.items()}

    def has_commit(self, cid: str) -> bool:
        """As :meth:`ckptstore.Store.has_commit` (its docstring: returns, raises), on this home."""
        return self.store.has_cached(cid)

    def info(self, ref: str) -> CommitInfo:
        """As :meth:`ckptstore.Store.info` (its docstring: returns, raises), on this home."""
        with self.store.catalog.read():  # one snapshot: a GC cannot drop the commit between its ref and its row
            cid = self.store.resolve(ref)
            found = self.index_infos([cid]).get(cid)
        if found is None:
            raise RefNotFoundError(f"commit {cid} is not in {self.store.root}")
        return found

    def infos(self, ids: list[str]) -> dict[str, CommitInfo]:
        """``{commit id: CommitInfo}`` of the full commit ids ``ids`` the store holds (others are left out)."""
        return self.index_infos(ids)

    def index_infos(self, ids: list[str]) -> dict[str, CommitInfo]:
        """:meth:`infos` from the index alone (what the index holds; on object storage, the cache)."""
        rows = self.store.catalog.chunked("SELECT * FROM commits WHERE id IN ({})", ids)
        parents: dict[str, list[str]] = {}
        for r in self.store.catalog.chunked("SELECT commit_id, parent_id FROM parents WHERE commit_id IN ({}) ORDER BY position", ids):
            parents.setdefault(r["commit_id"], []).append(r["parent_id"])
        tags: dict[str, list[str]] = {}
        for r in self.store.catalog.chunked("SELECT name, commit_id FROM tags WHERE commit_id IN ({}) ORDER BY name", ids):
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
        """As :meth:`ckptstore.Store.log` (its docstring: returns, raises), on this home."""
        if limit is not None and (type(limit) is not int or limit < 1):
            raise InvalidArgumentError(f"invalid limit {limit!r}: must be an integer >= 1")
        if ref is None:
            ids = [r["id"] for r in self.store.catalog.rows("SELECT id FROM commits ORDER BY created_at DESC, id")]
        else:
            seen: list[str] = []
            frontier = [self.store.resolve(ref)]
            known: set[str] = set()
            while frontier:
                known.update(frontier)
                seen += frontier
                rows = self.store.catalog.chunked("SELECT parent_id FROM parents WHERE commit_id IN ({})", frontier)
                frontier = list(dict.fromkeys(r["parent_id"] for r in rows if r["parent_id"] not in known))
            ids = seen
        infos = self.index_infos(ids)
        out = sorted((infos[i] for i in ids if i in infos), key=lambda c: (-c.created_at, c.id))
        return out[:limit] if limit else out

    def show(self, ref: str) -> dict:
        """As :meth:`ckptstore.Store.show` (its docstring: returns, raises), on this home."""
        info = self.store.info(ref)
        parent = info.parents[0] if info.parents else ""
        stats = {
            r["path"]: r
            for r in self.store.catalog.rows(
                "SELECT l.path, COUNT(*) AS shards, SUM(b.stored_len + ?) AS stored, "
                "SUM(s.blob_id IN (SELECT s2.blob_id FROM shards s2 JOIN commit_leaves l2 ON l2.id = s2.leaf_id WHERE l2.commit_id = ?)) AS shared "
                "FROM commit_leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id WHERE l.commit_id = ? GROUP BY l.path",
                (BLOB_HEADER.size, parent, info.id),
            )
        }
        leaves = []
        rows = self.store.catalog.rows(
            "SELECT l.*, c.rowid AS pos, c.rows_of AS shares FROM commit_leaves l LEFT JOIN components c ON c.commit_id = l.commit_id "
            "AND c.path = l.component WHERE l.commit_id = ? ORDER BY l.id", (info.id,))
        if any(r["shares"] is not None for r in rows):  # rows of several commits: in manifest order, component by component
            rows.sort(key=lambda r: (r["pos"] or 0, r["id"]))
        for r in rows:
            st = stats.get(r["path"])
            leaves.append({
                "path": r["path"], "component": r["component"], "kind": r["kind"], "dtype": r["dtype"],
                "shape": None if r["shape"] is None else jsonvalue.loads(r["shape"]),
                "logical_bytes": r["nbytes"], "stored_bytes": st["stored"] if st else 0,
                "shards": st["shards"] if st else 0, "shared_with_parent": st["shared"] if st else 0,
            })
        return {"commit": info, "components": self.store.components(info.id), "leaves": leaves}

    def du(self) -> dict:
        """Space accounting in bytes, from the index: the fields of :meth:`ckptstore.Store.du`."""
        c = self.store.catalog.rows("SELECT COUNT(*) AS n, COALESCE(SUM(logical_bytes), 0) AS logical FROM commits")[0]
        b = self.store.catalog.rows(
            "SELECT COUNT(*) AS n, COALESCE(SUM(raw_len), 0) AS raw, COALESCE(SUM(stored_len + ?), 0) AS stored FROM blobs",
            (BLOB_HEADER.size,),
        )[0]
        p = self.store.catalog.rows("SELECT COUNT(*) AS n, COALESCE(SUM(size), 0) AS size FROM packs")[0]
        files = {f.name: f.stat().st_size for f in self.store.root.glob(CATALOG + "*") if f.is_file() and not f.name.endswith(".bak")}
        reserve = files.pop(reserve_path(self.store.root / CATALOG).name, 0)
        catalog = sum(files.values())
        tmp = sum(f.stat().st_size for f in (self.store.root / "tmp").iterdir() if f.is_file())
        return {
            "commits": c["n"], "tags": len(self.store.tags()), "blobs": b["n"], "packs": p["n"],
            "logical_bytes": c["logical"], "unique_bytes": b["raw"], "stored_bytes": b["stored"],
            "pack_bytes": p["size"], "catalog_bytes": catalog, "reserve_bytes": reserve, "tmp_bytes": tmp,
            "dedup_ratio": c["logical"] / b["raw"] if b["raw"] else None,
            "compression_ratio": b["raw"] / b["stored"] if b["stored"] else None,
        }


class LocalHome(Home):
    """A store in a folder: packs under ``blobs/`` (:mod:`ckptstore.packs`), the catalog
    beside them, tags in the catalog::

        catalog.sqlite   the catalog (commits, manifests, lineage, tags, reflog, blobs)
        blobs/           pack files of content-addressed blobs, fanned out by id prefix
        tmp/             files being written
    """

    def pack_writer(self) -> PackWriter:
        """As :meth:`ckptstore.Store.pack_writer` (its docstring: returns, raises), on this home."""
        return PackWriter(self.root, self.store.compression_level, self.store.pack_bytes)

    def pack_reader(self, sparse: bool = False) -> PackReader:
        """As :meth:`ckptstore.Store.pack_reader` (its docstring: returns, raises), on this home."""
        return PackReader(self.root, sparse, locate=self.store.relocate)

    def pack_size(self, pack: str) -> int | None:
        """As :meth:`ckptstore.Store.pack_size` (its docstring: returns, raises), on this home."""
        try:
            return pack_path(self.root, pack).stat().st_size
        except OSError:
            return None

    def gc_home(self) -> LocalGC:
        """This home's primitives of the GC protocol (:func:`ckptstore.gc.collect`)."""
        return LocalGC(self.store)

    # --- fsck's primitives (:func:`ckptstore.fsck.check`): the catalog against the packs ----------

    #: A commit exists once its catalog transaction commits: no record exists before its tags move.
    attempts_leave_records = False

    def fsck_start(self, repair: bool) -> None:
        """Before any read: ``repair`` is refused (InvalidArgumentError): the index of a local
        store is its catalog, rebuilt from the packs by ``recover``, not pack indexes."""
        if repair:
            raise InvalidArgumentError(f"{self.root}: a local store has no pack indexes to repair; its index is the catalog, "
                                       "rebuilt from the packs by `ckptstore recover`")

    def fsck_resolve(self, ref: str) -> str:
        """The commit id ``ref`` names (:meth:`ckptstore.Store.resolve`)."""
        return self.store.resolve(ref)

    def fsck_snapshot(self):
        """One read transaction of the catalog: tags, commits and blob rows agree with each other."""
        return self.store.catalog.read()

    def fsck_tags(self, report: FsckReport) -> dict[str, str]:
        """``{tag: commit id}`` from the catalog."""
        return dict(self.store.catalog.rows("SELECT name, commit_id FROM tags", raw=True))

    def fsck_commits(self, report: FsckReport, ids: list[str] | None, deep: bool) -> dict[str, Any]:
        """``{commit id: CommitRecord, or None when its record does not hash to its id}`` of
        ``ids`` (every commit when ``None``). Reported in ``report``: a damaged record, rows
        (leaves, shards, components, parents, message) that disagree with the record, a
        leaf whose shard rows do not fit its shape and dtype (damaged commits), and a commit
        with no copy of its record in a pack (a problem: recover could not rebuild it)."""
        cat = self.store.catalog
        ids = [r[0] for r in cat.rows("SELECT id FROM commits", raw=True)] if ids is None else ids
        texts = dict(cat.chunked("SELECT id, record FROM commits WHERE id IN ({})", ids, raw=True))
        copies = {r[0] for r in cat.chunked(f"SELECT name FROM records WHERE kind = {records.KIND_COMMIT} AND name IN ({{}})", ids, raw=True)}
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
                report.problems.append(f"commit {cid}: no copy of its record in a pack (recover could not rebuild it)")
        where, params = ("WHERE l.commit_id = ?", (ids[0],)) if len(ids) == 1 else ("", ())
        shards: dict[tuple[str, str], list[int]] = {}
        for cid, path, raw_len in cat.rows(
            f"SELECT l.commit_id, l.path, b.raw_len FROM leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id {where} "
            "ORDER BY l.commit_id, l.path, s.seq", params, raw=True,
        ):
            shards.setdefault((cid, path), []).append(raw_len)
        for cid, path, dtype, shape, nbytes, shard_bytes in cat.rows(
            f"SELECT commit_id, path, dtype, shape, nbytes, shard_bytes FROM leaves l {where} {'AND' if where else 'WHERE'} kind = 'tensor'",
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

    def fsck_locate(self, report: FsckReport, keys: list[tuple[bytes, int]], deep: bool, repair: bool) -> dict:
        """Where the catalog says each blob of ``keys`` is (``{address: BlobLoc}``); for most of
        the store's blobs, from one scan of the blob rows rather than one lookup each."""
        (top,), = self.store.catalog.rows("SELECT COALESCE(MAX(id), 0) FROM blobs", raw=True)
        if len(keys) * 4 < top:
            return self.store.locate(keys)
        wanted = set(keys)
        rows = self.store.catalog.rows("SELECT hash, raw_len, pack, offset, stored_len, codec FROM blobs", raw=True)
        return {(h, n): BlobLoc(h, n, *rest) for h, n, *rest in rows if (h, n) in wanted}

    def fsck_read(self, locs: list[BlobLoc], reread: set):
        """``(loc, error)`` for each blob of ``locs`` whose pack file is missing or shorter
        than it (a BlobMissingError), and for each of ``reread`` (addresses) reread and
        rehashed (``None`` when intact, else the error). A GC beside fsck may move (repack)
        or free a blob after the catalog was read: one that looks missing or bad is looked
        up again, and only reported if it still is."""
        store = self.store
        reader = PackReader(self.root, locate=store.relocate)
        sizes: dict[str, int | None] = {}

        def gap(loc: BlobLoc) -> str | None:  # why the pack does not hold the blob whole, or None
            if loc.pack not in sizes:
                sizes[loc.pack] = self.pack_size(loc.pack)
            size = sizes[loc.pack]
            if size is None:
                return f"blob {loc.address}: pack {loc.pack}.pack is missing"
            return None if loc.offset + BLOB_HEADER.size + loc.stored_len <= size else f"blob {loc.address}: pack {loc.pack}.pack is truncated"

        def still_bad(loc: BlobLoc, read: bool) -> bool:
            now = store.relocate(loc)
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

    def fsck_extra(self, report: FsckReport, ids: list[str], whole: bool, deep: bool, repair: bool) -> None:
        """The checks of the catalog itself (``whole``: SQLite's integrity and foreign-key
        checks; the orphans: pack files without a catalog row, unreferenced blob rows, files
        in ``tmp/``) and, with ``deep``, every record copy in the packs (of commits ``ids``,
        and with ``whole`` the ref-move records) reread: a damaged copy of a commit's
        record damages the commit; one that differs from the catalog's is a problem."""
        cat = self.store.catalog
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
            report.orphan_packs = sorted(f.stem for f in (self.root / "blobs").glob("*/*.pack") if f.stem not in packs)
            report.tmp_files = sum(1 for f in (self.root / "tmp").iterdir() if f.is_file())
        if not deep:
            return
        reader = PackReader(self.root, locate=self.store.relocate)

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


# --- the GC primitives of a folder (ckptstore.gc.GCSide) ------------------------------------

_BATCH_COMMITS = 500
_BATCH_BLOBS = 2000
_BATCH_PACKS = 500
# Ref-move records that a newer move of the same tag supersedes (recovery needs only the newest).
_SUPERSEDED = f"kind = {KIND_REF} AND seq < (SELECT MAX(r.seq) FROM records r WHERE r.kind = {KIND_REF} AND r.name = records.name)"


class LocalGC(GCSide):
    """The primitives of the GC protocol (:mod:`ckptstore.gc`) on a folder: ``gc.lock``
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

    def __init__(self, store):
        self.store = store
        self.cat = store.catalog
        self._now: float | None = None
        self._dying: tuple = ("0", (), "0")
        self._victims: list = []
        self._token: tuple = ()

    def lock(self, dry_run: bool):
        return gc_lock(self.store.root, read_only_ok=dry_run)

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
                blob_dies = ("created_at < ? AND NOT EXISTS (SELECT 1 FROM shards s JOIN leaves l ON l.id = s.leaf_id "
                             "WHERE s.blob_id = blobs.id AND l.commit_id NOT IN (SELECT id FROM gc_dropped))")
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
        for pid, size, created, retired in packs:
            n, live, dies, dies_bytes = blobs.get(pid, (0, 0, 0, 0))
            rn, rlive = recs.get(pid, (0, 0))
            out.append(PackStat(pid, size, created, retired, n + rn, live + rlive, size, dies, dies_bytes))
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
        fd = unlocked(pack_path(self.store.root, pack))
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
                cat.chunked("DELETE FROM shards WHERE leaf_id IN (SELECT id FROM leaves WHERE commit_id IN ({}))", batch)
                for table in ("leaves", "components", "parents"):
                    cat.chunked(f"DELETE FROM {table} WHERE commit_id IN ({{}})", batch)
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
        return shutil.disk_usage(self.store.root).free

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
        return sum(size for _, size in packed(sizes, self.store.pack_bytes))

    def copy(self, batch: list[PackStat], report: GCReport) -> int:
        store, now = self.store, self._now
        with PackWriter(store.root, store.compression_level, store.pack_bytes) as writer:
            moved, entries = [], self._entries([p.id for p in batch])
            for p in batch:
                where = f"repacking pack {p.id}"
                blobs, recs = entries[p.id]
                with open(pack_path(store.root, p.id), "rb") as f, progress.task(f"repack {p.id[:12]}", sum(r["raw_len"] for r in blobs)) as advance:
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
            self.cat.chunked(f"UPDATE packs SET retired_at = {self._now!r} WHERE retired_at IS NULL AND id IN ({{}}) "
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
                    path = pack_path(self.store.root, pid)
                    batch[pid].freed = _unlink(path, sync=False)
                    folders.add(path.parent)
                    gone.append(batch[pid])
        for folder in sorted(folders):  # the unlinks made durable once per folder, not per pack
            fsync_dir(folder)
        return [], gone

    def leftovers(self, cutoff: float, own_due: bool, report: GCReport) -> None:
        known = {r[0] for r in self.cat.rows("SELECT id FROM packs", raw=True)}
        root = self.store.root
        candidates = [(f, "orphan") for f in (root / "blobs").glob("*/*.pack") if f.stem not in known]
        candidates += [(f, "tmp") for f in (root / "tmp").iterdir() if f.is_file()]
        for path, kind in candidates:
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if st.st_mtime > cutoff:
                continue
            fd = unlocked(path)
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


__all__ = ["CATALOG", "Home", "LocalGC", "LocalHome", "weakly"]
