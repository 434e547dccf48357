"""The SQLite catalog: schema, migrations, transactions and queries.

The catalog (``catalog.sqlite`` in the store folder) is the single source of
truth for which commits, tags and blobs exist. It runs in WAL mode, so
readers never block the writer, with ``synchronous=FULL`` so a returned commit
survives a power cut, and ``foreign_keys=ON`` so a referenced blob row can
never be deleted. Writes take the write lock up front (``BEGIN IMMEDIATE``);
a lock held by another process is waited for (busy timeout) and retried a
bounded number of times before :class:`~ckptstore.core.errors.CatalogBusyError`.

The schema version is ``PRAGMA user_version``. Opening an older catalog copies
it to ``catalog.sqlite.v<N>.bak`` and runs the ordered migrations N -> N+1 in one
transaction; a newer one is refused, never downgraded. Tables are created
through sqlite-utils. That transaction also sets the ``records_backfill`` setting
(:data:`BACKFILL`): the records of the commits and tags in packs
(:func:`backfill_records`) are still to be written. Every writable open that finds it
writes them, and the transaction that indexes their pack deletes it, so a migration
killed at any instant is finished by the next writable open (invariant 16). A catalog
that cannot be written here is read at its older version where that reads the same
(:attr:`Migration.index_only`, :attr:`Migration.read_as`); otherwise it is refused
with a one-line :class:`~ckptstore.core.errors.SchemaVersionError` asking for one writable
open (docs/operations.md, "Upgrading a store").

Room for the journal: a writable catalog keeps ``catalog.sqlite-reserve``
(:data:`RESERVE_BYTES`, allocated, never read) beside it. A GC releases it first,
so that on a full disk SQLite has room for its WAL and the GC frees space; the
next writable open allocates it again when there is room (docs/operations.md).
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from ..core import jsonvalue
from ..core.errors import CatalogBusyError, CatalogCorruptError, CkptStoreError, ForkedStoreError, SchemaVersionError, StoreWriteError
from ..core.layout import address
from ..objects.packs import PackWriter
from ..objects.records import KIND_COMMIT, KIND_REF, commit_id, commit_text, ref_text

if TYPE_CHECKING:
    import sqlite_utils

RESERVE_BYTES = 4 << 20  # 4 MiB: a GC's WAL frames (about 1000 changed 4 KiB pages) and the 32 KiB -shm
BUSY_TIMEOUT_MS = 10_000
BUSY_RETRIES = 6
_CHUNK = 4000  # bound on SQL variables per statement (SQLite allows 32766)
#: The setting (``settings`` table) that says a migration's record backfill is not done yet.
BACKFILL = "records_backfill"


@dataclass(frozen=True)
class Migration:
    """One schema step: ``apply(db)`` turns version ``version - 1`` into ``version``."""

    version: int
    description: str
    apply: Callable[[sqlite_utils.Database], None]
    #: Only adds indexes: a catalog without it reads the same rows (slower), so one that
    #: cannot be written here is read at its older version instead of being refused.
    index_only: bool = False
    #: SQL that lets a catalog without this step be read as if it had it (a temporary view),
    #: where it cannot be written: run on opening instead of refusing it.
    read_as: str | None = None


def _v1(db: sqlite_utils.Database) -> None:
    db["migrations"].create({"version": int, "description": str, "applied_at": float}, pk="version")
    db["settings"].create({"key": str, "value": str}, pk="key", not_null={"value"})
    db["packs"].create({"id": str, "size": int, "created_at": float, "retired_at": float}, pk="id", not_null={"size", "created_at"})
    db["blobs"].create(
        {"id": int, "hash": bytes, "raw_len": int, "pack": str, "offset": int, "stored_len": int, "codec": int, "created_at": float},
        pk="id",
        foreign_keys=[("pack", "packs", "id")],
        not_null={"hash", "raw_len", "pack", "offset", "stored_len", "codec", "created_at"},
    )
    db["blobs"].create_index(["hash", "raw_len"], unique=True)
    db["blobs"].create_index(["pack"])
    db["commits"].create(
        {
            "id": str, "created_at": float, "message": str, "metadata": str,
            "logical_bytes": int, "new_bytes": int, "stored_bytes": int,
            "shards_total": int, "shards_new": int, "seconds": float,
        },
        pk="id",
        not_null={"created_at", "message", "metadata"},
    )
    db["parents"].create(
        {"commit_id": str, "position": int, "parent_id": str},
        pk=("commit_id", "position"),
        foreign_keys=[("commit_id", "commits", "id")],
        not_null={"parent_id"},
    )
    db["parents"].create_index(["parent_id"])
    db["components"].create(
        {"commit_id": str, "path": str, "adapter": str, "version": int, "meta": str},
        pk=("commit_id", "path"),
        foreign_keys=[("commit_id", "commits", "id")],
        not_null={"adapter", "version", "meta"},
    )
    db["leaves"].create(
        {
            "id": int, "commit_id": str, "path": str, "component": str, "kind": str,
            "dtype": str, "shape": str, "stride": str, "nbytes": int, "shard_bytes": int, "value": str,
        },
        pk="id",
        foreign_keys=[("commit_id", "commits", "id")],
        not_null={"commit_id", "path", "component", "kind", "nbytes"},
    )
    db["leaves"].create_index(["commit_id", "path"], unique=True)
    # One row per shard of every commit: kept narrow (integer keys, no rowid) since a
    # commit of a large buffer writes thousands of them, unchanged shards included.
    db.execute(
        "CREATE TABLE shards (leaf_id INTEGER NOT NULL REFERENCES leaves(id), seq INTEGER NOT NULL, "
        "blob_id INTEGER NOT NULL REFERENCES blobs(id), PRIMARY KEY (leaf_id, seq)) WITHOUT ROWID"
    )
    db["shards"].create_index(["blob_id"])
    db["tags"].create(
        {"name": str, "commit_id": str, "updated_at": float},
        pk="name",
        foreign_keys=[("commit_id", "commits", "id")],
        not_null={"commit_id", "updated_at"},
    )
    db["reflog"].create(
        {"id": int, "tag": str, "old_commit": str, "new_commit": str, "at": float, "action": str},
        pk="id",
        not_null={"tag", "at", "action"},
    )
    db["reflog"].create_index(["tag"])


def _v2(db: sqlite_utils.Database) -> None:
    db.execute("ALTER TABLE commits ADD COLUMN record TEXT")
    # Where each record (records.py) lives in the packs: the catalog can be rebuilt from them.
    db.execute(
        "CREATE TABLE records (id INTEGER PRIMARY KEY, kind INTEGER NOT NULL, name TEXT NOT NULL, seq INTEGER, "
        "digest BLOB NOT NULL, pack TEXT NOT NULL REFERENCES packs(id), offset INTEGER NOT NULL, "
        "raw_len INTEGER NOT NULL, stored_len INTEGER NOT NULL)"
    )
    db.execute("CREATE INDEX idx_records_kind_name ON records (kind, name)")
    db.execute("CREATE INDEX idx_records_pack ON records (pack)")
    for (cid,) in db.execute("SELECT id FROM commits").fetchall():
        text = rebuild_record(db.conn, cid)
        if text is not None and commit_id(text) == cid:  # else checkout and fsck report the commit as damaged
            db.execute("UPDATE commits SET record = ? WHERE id = ?", (text, cid))


def _v3(db: sqlite_utils.Database) -> None:
    # Indexes a store of many commits needs, so that GC costs O(n log n), not O(n^2): deleting a
    # commit checks the tags' foreign key (one lookup, not a scan of every tag), and "the newest
    # ref-move record of each tag" is one index probe per record.
    db.execute("CREATE INDEX IF NOT EXISTS idx_tags_commit_id ON tags (commit_id)")
    db.execute("CREATE INDEX IF NOT EXISTS idx_records_kind_name_seq ON records (kind, name, seq)")


#: Every commit's leaves: its own ``leaves`` rows, and those of the components whose rows
#: another commit holds (``components.rows_of``). ``rows_of`` is NULL for own rows; readers
#: of a commit's leaves (and, through ``id``, their ``shards`` rows) read this view.
COMMIT_LEAVES = (
    "SELECT id, commit_id, path, component, kind, dtype, shape, stride, nbytes, shard_bytes, value, NULL AS rows_of FROM leaves "
    "UNION ALL SELECT l.id, c.commit_id, l.path, l.component, l.kind, l.dtype, l.shape, l.stride, l.nbytes, l.shard_bytes, l.value, "
    "c.rows_of FROM components c JOIN leaves l ON l.commit_id = c.rows_of AND l.component = c.path WHERE c.rows_of != c.commit_id"
)


def _v4(db: sqlite_utils.Database) -> None:
    # Rows shared between commits: a component committed unchanged points at the commit whose
    # leaves and shards rows hold its leaves (rows_of; NULL: its own rows, in manifest order;
    # its own id: its own rows, which a GC moved to it from a dropped owner) instead of
    # writing a row per leaf and per shard again. Always the owner itself, never a chain.
    db.execute("ALTER TABLE components ADD COLUMN rows_of TEXT")
    db.execute("CREATE INDEX idx_components_rows_of_path ON components (rows_of, path)")
    db.execute("CREATE INDEX idx_leaves_commit_id_component ON leaves (commit_id, component)")
    db.execute(f"CREATE VIEW commit_leaves AS {COMMIT_LEAVES}")


#: What a catalog of version 3 (no shared rows) reads as schema 4 through, where it cannot be migrated.
#: (A temporary ``components`` view, which shadows the table for unqualified names, adds the
#: column, NULL: own rows; its ``rowid`` column keeps the table's order.)
_V4_READ_AS = (
    "CREATE TEMP VIEW IF NOT EXISTS commit_leaves AS SELECT id, commit_id, path, component, kind, dtype, shape, stride, nbytes, "
    "shard_bytes, value, NULL AS rows_of FROM leaves; "
    "CREATE TEMP VIEW IF NOT EXISTS components AS SELECT rowid AS rowid, commit_id, path, adapter, version, meta, NULL AS rows_of "
    "FROM main.components"
)


def _v5(db: sqlite_utils.Database) -> None:
    # Blobs known to be bad (a read that failed verification, fsck): dedup never reuses them.
    # One row per blob row (ON DELETE CASCADE: a GC that deletes the blob row deletes its mark);
    # ``pack`` and ``offset`` name the copy that was found bad, ``reason`` the error's text. A
    # commit that writes the address again points the blob row at its new copy and deletes
    # the mark (docs/design.md, "What dedup trusts").
    db.execute(
        "CREATE TABLE IF NOT EXISTS bad_blobs (blob_id INTEGER PRIMARY KEY REFERENCES blobs(id) ON DELETE CASCADE, pack TEXT NOT NULL, "
        "offset INTEGER NOT NULL, found_at REAL NOT NULL, reason TEXT NOT NULL)"
    )


#: What a catalog of version 4 reads as schema 5 through, where it cannot be migrated: no blob is known bad.
_V5_READ_AS = (
    "CREATE TEMP VIEW IF NOT EXISTS bad_blobs AS SELECT 0 AS blob_id, '' AS pack, 0 AS offset, 0.0 AS found_at, '' AS reason WHERE 0"
)


def drop_commit_rows(cat: Catalog, cids: list[str]) -> None:
    """Delete the rows of commits ``cids`` (shards, leaves, components, parents; not the
    commits rows, records or tags), inside the caller's write transaction. Rows a kept commit
    shares (``components.rows_of``) are not deleted: for each dropped owner's component,
    its newest kept sharer becomes the owner (the rows' ``commit_id`` moves to it, its
    ``rows_of`` becomes its own id) and the other sharers point at it."""
    conn = cat.conn
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS rows_dropped (id TEXT PRIMARY KEY)")
    conn.execute("DELETE FROM rows_dropped")
    conn.execute("INSERT OR IGNORE INTO rows_dropped SELECT value FROM json_each(?)", (json.dumps(cids),))
    heirs: dict[tuple[str, str], str] = {}
    for owner, path, sharer in conn.execute(
        "SELECT c.rows_of, c.path, c.commit_id FROM components c JOIN commits k ON k.id = c.commit_id "
        "WHERE c.rows_of IN (SELECT id FROM rows_dropped) AND c.rows_of != c.commit_id "
        "AND c.commit_id NOT IN (SELECT id FROM rows_dropped) ORDER BY k.created_at, c.commit_id"
    ).fetchall():
        heirs[(owner, path)] = sharer  # the newest one last
    for (owner, path), heir in heirs.items():
        conn.execute("UPDATE leaves SET commit_id = ? WHERE commit_id = ? AND component = ?", (heir, owner, path))
        conn.execute("UPDATE components SET rows_of = ? WHERE rows_of = ? AND path = ?", (heir, owner, path))
    conn.execute("DELETE FROM shards WHERE leaf_id IN (SELECT l.id FROM leaves l WHERE l.commit_id IN (SELECT id FROM rows_dropped))")
    for table in ("leaves", "components", "parents"):
        conn.execute(f"DELETE FROM {table} WHERE commit_id IN (SELECT id FROM rows_dropped)")
    conn.execute("DELETE FROM rows_dropped")


def rebuild_record(conn: sqlite3.Connection, cid: str) -> str | None:
    """The commit record (records.py) as the catalog's rows describe commit ``cid``.

    Equal to the stored record exactly when the rows agree with it: ``fsck``
    compares the two; migration 2 fills in the records of older stores with it.
    ``None`` when rows are missing.
    """
    head = conn.execute("SELECT created_at, message, metadata FROM commits WHERE id = ?", (cid,)).fetchone()
    if head is None:
        return None
    parents = [r[0] for r in conn.execute("SELECT parent_id FROM parents WHERE commit_id = ? ORDER BY position", (cid,))]
    try:  # schema 4 (shared rows); older catalogs (migration 2, one read where it cannot be migrated) have no rows_of
        comps = [list(r) for r in conn.execute(
            "SELECT path, adapter, version, meta, rows_of FROM components WHERE commit_id = ? ORDER BY rowid", (cid,))]
        leaves = "commit_leaves"
    except sqlite3.OperationalError as exc:
        if "no such" not in str(exc):
            raise
        comps = [[*r, None] for r in conn.execute("SELECT path, adapter, version, meta FROM components WHERE commit_id = ? ORDER BY rowid", (cid,))]
        leaves = "leaves"
    shards: dict[int, list[str]] = {}
    for leaf_id, h, n in conn.execute(
        f"SELECT s.leaf_id, b.hash, b.raw_len FROM {leaves} l JOIN shards s ON s.leaf_id = l.id LEFT JOIN blobs b ON b.id = s.blob_id "
        "WHERE l.commit_id = ? ORDER BY s.leaf_id, s.seq",
        (cid,),
    ):
        if h is None:
            return None
        shards.setdefault(leaf_id, []).append(address(bytes(h), n))
    rows = conn.execute(f"SELECT id, path, component, kind, dtype, shape, stride, value FROM {leaves} WHERE commit_id = ? ORDER BY id", (cid,)).fetchall()
    if any(c[4] is not None for c in comps):  # rows of several commits: the manifest lists them component by component
        order = {c[0]: i for i, c in enumerate(comps)}
        rows.sort(key=lambda r: (order.get(r[2], len(order)), r[0]))
    manifest = []
    try:
        for leaf_id, path, comp, kind, dtype, shape, stride, value in rows:
            manifest.append([
                path, comp, kind, dtype, None if shape is None else jsonvalue.loads(shape),
                None if stride is None else jsonvalue.loads(stride), value, " ".join(shards.get(leaf_id, [])),
            ])
    except CkptStoreError:
        return None
    return commit_text(parents, head[0], head[1], head[2], [c[:4] for c in comps], manifest)


#: Ordered schema migrations; the last one's version is the current schema.
MIGRATIONS: list[Migration] = [
    Migration(1, "initial schema: settings, packs, blobs, commits, parents, components, leaves, shards, tags, reflog", _v1),
    Migration(2, "commit records in the catalog and in packs (records table): manifests verifiable, catalog rebuildable", _v2),
    Migration(3, "indexes for large stores: tags by commit, ref-move records by tag and seq", _v3, index_only=True),
    Migration(4, "rows shared between commits: components.rows_of, the commit_leaves view", _v4, read_as=_V4_READ_AS),
    Migration(5, "blobs known to be bad (bad_blobs): dedup never reuses them; a good copy replaces them", _v5, read_as=_V5_READ_AS),
]
SCHEMA_VERSION = MIGRATIONS[-1].version


def backfill_records(cat: Catalog, root: Path, pack_bytes: int) -> int:
    """Finish a migration: write the records a catalog migrated from schema 1 lacks in packs
    (each commit's record, each tag's newest move) into a new pack under ``root``, made
    durable, then in one write transaction index the pack and its records and delete the
    :data:`BACKFILL` setting. Idempotent: what already has a copy is not written again, so
    a backfill killed at any instant is redone whole by the next call (the pack it may have
    left durable but unindexed is an orphan, which holds only copies). Returns the records
    written.

    Raises:
        StoreWriteError: the pack or the catalog cannot be written.
        CatalogBusyError: another process held the write lock throughout.
    """
    with PackWriter(root, 0, pack_bytes) as writer:
        try:
            with cat.write():
                batch = [
                    (KIND_COMMIT, cid, None, text) for cid, text in cat.rows(
                        "SELECT id, record FROM commits WHERE record IS NOT NULL "
                        f"AND id NOT IN (SELECT name FROM records WHERE kind = {KIND_COMMIT})", raw=True)
                ]
                batch += [
                    (KIND_REF, tag, seq, ref_text(seq, tag, old, new, at, action)) for seq, tag, old, new, at, action in cat.rows(
                        "SELECT id, tag, old_commit, new_commit, at, action FROM reflog WHERE id IN (SELECT MAX(id) FROM reflog GROUP BY tag) "
                        f"AND tag NOT IN (SELECT name FROM records WHERE kind = {KIND_REF})", raw=True)
                ]
                if batch:
                    locs = [writer.append_record(kind, text.encode()) for kind, _, _, text in batch]
                    writer.finish()  # durable under its final name before any row points at it
                    now = time.time()
                    cat.conn.executemany("INSERT INTO packs (id, size, created_at) VALUES (?, ?, ?)", [(pid, size, now) for pid, size in writer.pack_ids])
                    cat.conn.executemany(
                        "INSERT INTO records (kind, name, seq, digest, pack, offset, raw_len, stored_len) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        [(k, n, q, loc.digest, loc.pack, loc.offset, loc.raw_len, loc.stored_len) for (k, n, q, _), loc in zip(batch, locs)],
                    )
                cat.conn.execute("DELETE FROM settings WHERE key = ?", (BACKFILL,))
        except BaseException:
            writer.discard()
            raise
    return len(batch)


def is_busy(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


#: What reading a damaged catalog can raise besides busy locks: SQLite's errors, and text
#: columns (or schema text) that are not UTF-8 any more.
DAMAGE = (sqlite3.DatabaseError, UnicodeDecodeError)


def remedy(path: Path) -> str:
    """What to do about a damaged catalog at ``path``."""
    return f"`ckptstore recover --force --store {path.parent}` rebuilds it from the packs"


def translate(path: Path, exc: BaseException) -> Exception:
    """The ckptstore error for an SQLite error that is not a busy lock, or undecodable text."""
    if isinstance(exc, UnicodeDecodeError):
        return CatalogCorruptError(f"{path}: damaged catalog: text that is not UTF-8 ({exc}); {remedy(path)}")
    if "disk is full" in str(exc) or "I/O error" in str(exc) or "readonly" in str(exc):
        return StoreWriteError(f"{path}: writing the catalog failed: {exc}")
    if "not a database" in str(exc):
        return CatalogCorruptError(f"{path} is not an SQLite database ({exc}); {remedy(path)}")
    # (one line: SQLite quotes the damaged schema text, whose flipped bytes may be line breaks)
    said = " ".join(str(exc).split())
    return CatalogCorruptError(f"{path}: damaged catalog: {said}; {remedy(path)}")


def damaged(path: Path, what: str) -> CatalogCorruptError:
    """A catalog row that SQLite returned but that cannot be what ckptstore wrote."""
    return CatalogCorruptError(f"{path}: damaged catalog: {what}; {remedy(path)}")


class CatalogMissing(CkptStoreError):
    """No initialised catalog at the path (the file is absent or empty); the store decides what that means."""


def _uri(path: Path, **params: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return f"file:{quote(str(path.absolute()))}?{query}"


def reserve_path(catalog: Path) -> Path:
    """``catalog.sqlite-reserve``: the room kept for the journal of ``catalog``."""
    return catalog.with_name(catalog.name + "-reserve")


def keep_reserve(catalog: Path, size: int | None = None) -> bool:
    """Make sure ``size`` bytes are allocated (``posix_fallocate``, not a sparse file) in
    the reserve beside ``catalog``; False when there is no room or no permission now
    (no partial reserve is left then; a later open tries again). ``None``:
    :data:`RESERVE_BYTES`, or 1/64 of the filesystem when that is less (a small disk keeps
    its room for data)."""
    path = reserve_path(catalog)
    if size is None:
        try:
            fs = os.statvfs(path.parent)
            size = min(RESERVE_BYTES, fs.f_blocks * fs.f_frsize // 64)
        except OSError:
            return False
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return False  # a link, FIFO... in its place is not ours: never written through (invariant 13)
        if st.st_blocks * 512 >= size:
            return True
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        return True
    except OSError:
        release_reserve(catalog)
        return False


def release_reserve(catalog: Path) -> int:
    """Delete the reserve beside ``catalog``; the bytes it held (0 when there was none or it
    cannot be deleted here)."""
    path = reserve_path(catalog)
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return 0  # not ours: left alone
        held = st.st_blocks * 512
        path.unlink()
    except OSError:
        return 0
    return held


class Catalog:
    """One connection to a store's catalog.

    Only SQLite ever opens the catalog file and its ``-wal``/``-shm``: closing any
    other descriptor of them would drop the POSIX locks SQLite holds in this
    process for other connections (invariant 6). Whether the catalog exists, is
    empty or is a database at all is asked of SQLite, never of the filesystem,
    so concurrent creators and a crash in the middle of creation are safe:
    SQLite rolls back a hot journal, and the schema is created inside one
    ``BEGIN IMMEDIATE`` transaction that first checks nobody else did.

    A catalog that cannot be written (read-only mount, another user's store, a
    full disk) is opened for reading; ``writable`` tells, and a write raises
    StoreWriteError.

    Args:
        path: the ``catalog.sqlite`` file.
        create: create and initialise the catalog when it is missing or empty.
        migrations: the migration list (tests pass their own).

    Raises:
        CatalogMissing: no initialised catalog and ``create`` is false.
        CatalogCorruptError: the file is not SQLite, or not a ckptstore catalog.
        SchemaVersionError: the catalog is newer than ``migrations`` know, or
            predates schema versioning (version 0 with tables), or needs a migration
            that cannot be read around and cannot be written here (one line asking for
            one writable open).
    """

    def __init__(self, path: Path, create: bool = True, migrations: list[Migration] = MIGRATIONS):
        self.path = path
        self.migrations = migrations
        _refuse_leaked(path)  # (a forked child: docs/operations.md, "Processes: threads, fork, signals")
        self.lock = threading.RLock()  # one connection, shared by the store's threads
        _LIVE.add(self)
        self.writable = True
        self.migrated_from: int | None = None
        try:
            self.conn = self._connect(create)
            self._db = None
            self._upgrade(create)
        except DAMAGE as exc:
            if getattr(self, "conn", None) is not None:
                self.conn.close()
            if is_busy(exc):
                raise CatalogBusyError(f"{path}: the catalog stayed locked: {exc}") from None
            raise translate(path, exc) from None
        except BaseException:
            if getattr(self, "conn", None) is not None:
                self.conn.close()
            raise

    def _connect(self, create: bool) -> sqlite3.Connection:
        """Open read-write (creating the file only with ``create``); fall back to read-only."""
        def open_(uri: str) -> sqlite3.Connection:
            conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            return conn

        try:
            conn = open_(_uri(self.path, mode="rw"))
        except sqlite3.OperationalError:
            if not create:
                raise CatalogMissing(f"{self.path} does not exist") from None
            conn = open_(_uri(self.path, mode="rwc"))
        try:
            if not create and conn.execute("PRAGMA page_count").fetchone()[0] == 0:
                conn.close()  # an empty file: not initialised, and left exactly as it is
                raise CatalogMissing(f"{self.path} is empty")
            for attempt in range(BUSY_RETRIES):  # switching a new catalog to WAL needs a moment alone
                try:
                    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                    break
                except sqlite3.OperationalError as exc:
                    if not is_busy(exc) or attempt == BUSY_RETRIES - 1:
                        raise
                    time.sleep(0.05 * (attempt + 1))
            if mode.lower() != "wal":
                raise sqlite3.OperationalError("attempt to write a readonly database")
            if not os.access(self.path, os.W_OK):
                # SQLite opened a file it cannot write (a read-only mount, even for root) read-only
                # without a word; a WAL catalog whose -wal and -shm exist then seems writable
                # until the first write. (access() opens nothing: no lock of SQLite's is dropped.)
                raise sqlite3.OperationalError("attempt to write a readonly database")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            return conn
        except sqlite3.OperationalError as exc:
            conn.close()
            if not any(m in str(exc) for m in ("readonly", "unable to open", "disk is full", "disk I/O error")):
                raise
        # Read-only (mount, permissions, full disk): a plain read-only open reads a WAL catalog
        # whose -shm exists; without one, only an immutable open can read it.
        self.writable = False
        for params in ({"mode": "ro"}, {"mode": "ro", "immutable": "1"}):
            try:
                conn = open_(_uri(self.path, **params))
                conn.execute("PRAGMA user_version").fetchone()
                conn.execute("PRAGMA foreign_keys=ON")
                return conn
            except sqlite3.OperationalError:
                conn.close()
        raise StoreWriteError(f"{self.path}: the catalog can be neither written nor read here")

    # --- versions -----------------------------------------------------------------

    @property
    def user_version(self) -> int:
        return self.conn.execute("PRAGMA user_version").fetchone()[0]

    def _upgrade(self, create: bool) -> None:
        latest = self.migrations[-1].version
        version = self.user_version
        if version > latest:
            raise SchemaVersionError(
                f"{self.path}: unsupported schema version {version}; this ckptstore reads up to version {latest}. "
                "Upgrade ckptstore to open this store."
            )
        if version == latest:
            return
        tables = self._tables()
        if version == 0 and tables:
            version = self.user_version  # another process may have created the store between the two reads
            if version == latest:
                return
            if version == 0:
                raise SchemaVersionError(
                    f"{self.path}: unsupported schema version 0 (a catalog from before schema versioning, tables {sorted(tables)}); "
                    "ckptstore cannot migrate it"
                )
        if version == 0 and not (create and self.writable):
            raise CatalogMissing(f"{self.path} is empty: the store was never initialised")
        if not self.writable:
            later = [m for m in self.migrations if m.version > version]
            if version > 0 and all(m.index_only or m.read_as for m in later):
                for m in later:  # readable as it is, without the newer indexes, through temporary views
                    if m.read_as:
                        self.conn.executescript(m.read_as)
                return
            raise SchemaVersionError(
                f"{self.path}: this store (schema version {version}) needs a one-time upgrade to version {latest}, and its catalog "
                f"cannot be written here (read-only mount or permissions); open it writable once (any command), then it reads anywhere"
            )
        if version > 0:
            self.migrated_from = version
            backup = self.path.with_name(f"{self.path.name}.v{version}.bak")
            with sqlite3.connect(backup) as dst:
                self.conn.backup(dst)
            dst.close()
        with self.write():
            version = self.user_version  # another process may have done it meanwhile
            if version == 0 and self._tables():
                raise SchemaVersionError(f"{self.path}: unsupported schema version 0 with tables")
            for m in self.migrations:
                if m.version > version:
                    m.apply(self.db)
                    self.db["migrations"].insert({"version": m.version, "description": m.description, "applied_at": time.time()}, replace=True)
                    self.conn.execute(f"PRAGMA user_version={int(m.version)}")
            if version > 0:  # an existing catalog was migrated: its records are written next, by backfill_records
                self.conn.execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?, '1')", (BACKFILL,))

    @property
    def backfill_pending(self) -> bool:
        """Whether a migration's record backfill (:func:`backfill_records`) is not done yet:
        the :data:`BACKFILL` setting, set in the migration's transaction, deleted in the
        backfill's."""
        try:
            return bool(self.rows("SELECT 1 FROM settings WHERE key = ?", (BACKFILL,)))
        except CkptStoreError:
            return False  # (no settings table: a catalog of a test's own migrations)

    def _tables(self) -> set[str]:
        return {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    @property
    def db(self) -> sqlite_utils.Database:
        """The sqlite-utils view of the connection (imported on first use: reading needs only SQL)."""
        if self._db is None:
            import sqlite_utils

            self._db = sqlite_utils.Database(self.conn, execute_plugins=False)
        return self._db

    # --- transactions -------------------------------------------------------------

    def _retry(self, fn: Callable):
        for attempt in range(BUSY_RETRIES):
            try:
                return fn()
            except DAMAGE as exc:
                if not is_busy(exc):
                    raise translate(self.path, exc) from exc
                if attempt == BUSY_RETRIES - 1:
                    raise CatalogBusyError(
                        f"{self.path}: the catalog stayed locked by another process for "
                        f"{BUSY_RETRIES * BUSY_TIMEOUT_MS // 1000} s"
                    ) from None
                time.sleep(0.05 * (attempt + 1))

    @contextmanager
    def write(self) -> Iterator[None]:
        """One write transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``).

        Rolls back on any exception. Raises CatalogBusyError when the write
        lock cannot be had after the bounded retries.
        """
        if not self.writable:
            raise StoreWriteError(f"{self.path}: the store is read-only here (mount, permissions or a full disk); it can only be read")
        with self.lock:
            self._retry(lambda: self.conn.execute("BEGIN IMMEDIATE"))
            try:
                yield
            except BaseException as exc:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                if isinstance(exc, DAMAGE):
                    raise translate(self.path, exc) from exc
                raise
            try:
                self._retry(lambda: self.conn.execute("COMMIT"))
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise

    @contextmanager
    def read(self) -> Iterator[None]:
        """A read transaction: every query inside sees one snapshot.

        Raises CatalogCorruptError for SQLite errors and undecodable text inside it
        (queries on ``conn`` directly included)."""
        with self.lock:
            if self.conn.in_transaction:  # nested in a write
                yield
                return
            self._retry(lambda: self.conn.execute("BEGIN"))
            try:
                yield
            except DAMAGE as exc:
                if is_busy(exc):
                    raise CatalogBusyError(f"{self.path}: the catalog stayed locked: {exc}") from None
                raise translate(self.path, exc) from exc
            finally:
                if self.conn.in_transaction:  # an I/O error may have ended it already: never mask that error
                    try:
                        self.conn.execute("ROLLBACK")
                    except sqlite3.DatabaseError:
                        pass

    def rows(self, sql: str, params: Iterable = (), raw: bool = False) -> list:
        """All result rows: ``sqlite3.Row`` objects, or plain tuples with ``raw`` (faster)."""
        with self.lock:
            def run():
                cursor = self.conn.cursor()
                if raw:
                    cursor.row_factory = None
                return cursor.execute(sql, tuple(params)).fetchall()

            return self._retry(run)

    def chunked(self, sql: str, values: list, extra: tuple = (), raw: bool = False) -> list:
        """Run ``sql`` (with one ``{}`` for a list of ``?``) over ``values`` in chunks."""
        out: list = []
        for i in range(0, len(values), _CHUNK):
            part = values[i : i + _CHUNK]
            out += self.rows(sql.format(",".join("?" * len(part))), (*extra, *part), raw)
        return out

    def replace_with(self, other: Catalog) -> None:
        """Overwrite this catalog with ``other``'s content, through SQLite's backup API
        (which takes the locks a writer takes): used by recovery."""
        with self.lock:
            try:
                other.conn.backup(self.conn)
            except sqlite3.DatabaseError as exc:
                raise translate(self.path, exc) from None

    def close(self) -> None:
        _LIVE.discard(self)
        self.conn.close()


# --- fork -------------------------------------------------------------------------------
# A SQLite connection must not be used across fork(). Its lock bookkeeping is per process
# and is copied into the child, which holds none of the parent's POSIX locks: through the
# inherited connection, or through any new connection of the child to the same file while
# the inherited one stays open (SQLite shares one lock record per file in a process), the
# child reads and writes as if it held locks it does not, and its commits are lost when
# the parent closes. So the fork waits (up to FORK_WAIT_SECONDS) for each live catalog's
# current transaction to end, and the child closes the inherited connections that were
# idle: closing an idle WAL connection in the child releases only the child's own locks
# (none), and checkpoints nothing while another process holds the database open. A
# connection still in a transaction at the fork (the wait ran out) is kept open and
# referenced for the child's whole life (closing it would roll back into the parent's
# shared memory), and the child refuses to open that catalog again (ForkedStoreError).
# Either way the inherited Catalog object refuses every query in the child.

FORK_WAIT_SECONDS = 5.0
_LIVE: weakref.WeakSet[Catalog] = weakref.WeakSet()  # every Catalog of this process
_IDLE_AT_FORK: list[Catalog] = []  # (parent, during the fork) the catalogs whose lock the fork holds, idle
_BUSY_AT_FORK: list[Catalog] = []  # (parent, during the fork) the catalogs whose lock it holds, in a transaction
_LEAKED: list[sqlite3.Connection] = []  # (child) connections inherited in a transaction: never closed, never collected
_LEAKED_PATHS: set[str] = set()  # (child) their catalogs: not opened again in this process


class _ForkedConnection:
    """What a Catalog inherited across fork holds in the child instead of its connection:
    every use raises ForkedStoreError; ``close`` does nothing."""

    def __init__(self, path: Path):
        self.path = path

    in_transaction = False

    def close(self) -> None:
        pass

    def __getattr__(self, name: str):
        raise ForkedStoreError(
            f"{self.path}: this catalog connection was opened in the parent of this forked process, "
            "and a Store does not cross fork. Open a new ckptstore.Store(...) in this process"
        )


def _before_fork() -> None:
    deadline = time.monotonic() + FORK_WAIT_SECONDS
    for cat in list(_LIVE):
        if "conn" in cat.__dict__ and not isinstance(cat.conn, _ForkedConnection):
            if cat.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                try:
                    busy = cat.conn.in_transaction
                except sqlite3.Error:  # (closed meanwhile)
                    busy = True
                (_BUSY_AT_FORK if busy else _IDLE_AT_FORK).append(cat)


def _after_fork_in_parent() -> None:
    for cat in (*_IDLE_AT_FORK, *_BUSY_AT_FORK):
        cat.lock.release()
    _IDLE_AT_FORK.clear()
    _BUSY_AT_FORK.clear()


def _after_fork_in_child() -> None:
    idle = {id(c) for c in _IDLE_AT_FORK}
    _IDLE_AT_FORK.clear()
    _BUSY_AT_FORK.clear()
    for cat in list(_LIVE):
        conn = cat.__dict__.get("conn")
        if conn is None or isinstance(conn, _ForkedConnection):
            continue
        closed = False
        if id(cat) in idle:
            try:
                conn.close()
                closed = True
            except sqlite3.Error:
                pass
        if not closed:
            _LEAKED.append(conn)
            _LEAKED_PATHS.add(os.path.realpath(cat.path))
            try:  # a reference the interpreter's teardown never drops: the connection is never closed here
                import ctypes

                ctypes.pythonapi.Py_IncRef(ctypes.py_object(conn))
            except Exception:  # noqa: BLE001 - (no ctypes) the list above keeps it until the interpreter's teardown
                pass
        cat.conn = _ForkedConnection(cat.path)
        cat._db = None
        cat.lock = threading.RLock()


def _refuse_leaked(path: Path) -> None:
    """Raises ForkedStoreError if this forked process inherited a connection to ``path``
    in the middle of a transaction (it stays open here: a second one is not safe)."""
    if _LEAKED_PATHS and os.path.realpath(path) in _LEAKED_PATHS:
        raise ForkedStoreError(
            f"{path}: this process was forked while its parent was in a catalog transaction on this store; "
            "it cannot open this store safely. Fork before opening a Store (or while it is idle), or start "
            "the process with the 'spawn' start method"
        )


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
