"""The SQLite catalog: schema, migrations, transactions and queries.

The catalog (``catalog.sqlite`` in the store folder) is the single source of
truth for which commits, tags and blobs exist. It runs in WAL mode, so
readers never block the writer, with ``synchronous=FULL`` so a returned commit
survives a power cut, and ``foreign_keys=ON`` so a referenced blob row can
never be deleted. Writes take the write lock up front (``BEGIN IMMEDIATE``);
a lock held by another process is waited for (busy timeout) and retried a
bounded number of times before :class:`~ckptstore.errors.CatalogBusyError`.

The schema version is ``PRAGMA user_version``. Opening an older catalog copies
it to ``catalog.sqlite.v<N>.bak`` and runs the ordered migrations N -> N+1 in one
transaction; a newer one is refused, never downgraded. Tables are created
through sqlite-utils.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlite_utils

from .errors import CatalogBusyError, CatalogCorruptError, SchemaVersionError, StoreWriteError

_SQLITE_MAGIC = b"SQLite format 3\x00"
BUSY_TIMEOUT_MS = 10_000
BUSY_RETRIES = 6
_CHUNK = 4000  # bound on SQL variables per statement (SQLite allows 32766)


@dataclass(frozen=True)
class Migration:
    """One schema step: ``apply(db)`` turns version ``version - 1`` into ``version``."""

    version: int
    description: str
    apply: Callable[[sqlite_utils.Database], None]


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


#: Ordered schema migrations; the last one's version is the current schema.
MIGRATIONS: list[Migration] = [
    Migration(1, "initial schema: settings, packs, blobs, commits, parents, components, leaves, shards, tags, reflog", _v1),
]
SCHEMA_VERSION = MIGRATIONS[-1].version


def is_busy(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


def translate(path: Path, exc: sqlite3.DatabaseError) -> Exception:
    """The ckptstore error for an SQLite error that is not a busy lock."""
    if "disk is full" in str(exc) or "I/O error" in str(exc):
        return StoreWriteError(f"{path}: writing the catalog failed: {exc}")
    return CatalogCorruptError(f"{path}: {exc}")


class Catalog:
    """One connection to a store's catalog.

    Args:
        path: the ``catalog.sqlite`` file.
        create: create and initialise the file when it is missing.
        migrations: the migration list (tests pass their own).

    Raises:
        CatalogCorruptError: the file is not SQLite, or not a ckptstore catalog.
        SchemaVersionError: the catalog is newer than ``migrations`` know, or
            predates schema versioning (version 0 with tables).
    """

    def __init__(self, path: Path, create: bool = True, migrations: list[Migration] = MIGRATIONS):
        self.path = path
        self.migrations = migrations
        self.lock = threading.RLock()  # one connection, shared by the store's threads
        exists = path.exists() and path.stat().st_size > 0
        if exists:
            with open(path, "rb") as f:
                if f.read(16) != _SQLITE_MAGIC:
                    raise CatalogCorruptError(f"{path} is not an SQLite database")
        elif not create:
            raise CatalogCorruptError(f"{path} does not exist")
        try:
            self.conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False)
            self.conn.row_factory = sqlite3.Row
            self.conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self._retry(lambda: self.conn.execute("PRAGMA journal_mode=WAL"))
            self.conn.execute("PRAGMA synchronous=FULL")
            self.conn.execute("PRAGMA foreign_keys=ON")
            self.db = sqlite_utils.Database(self.conn, execute_plugins=False)
            self._upgrade(exists)
        except sqlite3.DatabaseError as exc:
            if is_busy(exc):
                raise CatalogBusyError(f"{path}: the catalog stayed locked: {exc}") from None
            raise translate(path, exc) from None

    # --- versions -----------------------------------------------------------------

    @property
    def user_version(self) -> int:
        return self.conn.execute("PRAGMA user_version").fetchone()[0]

    def _upgrade(self, existed: bool) -> None:
        latest = self.migrations[-1].version
        version = self.user_version
        if version > latest:
            raise SchemaVersionError(
                f"{self.path}: unsupported schema version {version}; this ckptstore reads up to version {latest}. "
                "Upgrade ckptstore to open this store."
            )
        if version == latest:
            return
        tables = set(self.db.table_names())
        if version == 0 and tables:
            raise SchemaVersionError(
                f"{self.path}: unsupported schema version 0 (a catalog from before schema versioning, tables {sorted(tables)}); "
                "ckptstore cannot migrate it"
            )
        if version > 0:
            backup = self.path.with_name(f"{self.path.name}.v{version}.bak")
            with sqlite3.connect(backup) as dst:
                self.conn.backup(dst)
            dst.close()
        with self.write():
            version = self.user_version  # another process may have done it meanwhile
            for m in self.migrations:
                if m.version > version:
                    m.apply(self.db)
                    self.db["migrations"].insert({"version": m.version, "description": m.description, "applied_at": time.time()}, replace=True)
                    self.conn.execute(f"PRAGMA user_version={int(m.version)}")

    # --- transactions -------------------------------------------------------------

    def _retry(self, fn: Callable):
        for attempt in range(BUSY_RETRIES):
            try:
                return fn()
            except sqlite3.DatabaseError as exc:
                if not is_busy(exc):
                    raise translate(self.path, exc) from exc
                if attempt == BUSY_RETRIES - 1:
                    raise CatalogBusyError(
                        f"{self.path}: the catalog stayed locked by another process for "
                        f"{BUSY_RETRIES * BUSY_TIMEOUT_MS // 1000} s"
                    ) from None
                time.sleep(0.05 * (attempt + 1))

    @contextmanager
    def write(self) -> Iterator[sqlite_utils.Database]:
        """One write transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``).

        Rolls back on any exception. Raises CatalogBusyError when the write
        lock cannot be had after the bounded retries.
        """
        with self.lock:
            self._retry(lambda: self.conn.execute("BEGIN IMMEDIATE"))
            try:
                yield self.db
            except BaseException as exc:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.DatabaseError):
                    raise translate(self.path, exc) from exc
                raise
            try:
                self._retry(lambda: self.conn.execute("COMMIT"))
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise

    @contextmanager
    def read(self) -> Iterator[sqlite_utils.Database]:
        """A read transaction: every query inside sees one snapshot."""
        with self.lock:
            if self.conn.in_transaction:  # nested in a write
                yield self.db
                return
            self.conn.execute("BEGIN")
            try:
                yield self.db
            finally:
                self.conn.execute("ROLLBACK")

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

    def close(self) -> None:
        self.conn.close()
