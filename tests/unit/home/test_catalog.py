"""Catalog schema versions, migrations, and damaged catalog files."""

from __future__ import annotations

import sqlite3

import pytest
import torch

import ckptstore
from ckptstore.home.catalog import MIGRATIONS, SCHEMA_VERSION, Catalog, Migration
from ckptstore.errors import CatalogCorruptError, CkptStoreError, NotAStoreError, SchemaVersionError

from tests.conftest import assert_bit_equal


def test_new_store_records_schema_version_and_migrations(store):
    assert store.catalog.user_version == SCHEMA_VERSION == MIGRATIONS[-1].version
    rows = store.catalog.rows("SELECT version, description FROM migrations ORDER BY version")
    assert [r["version"] for r in rows] == [m.version for m in MIGRATIONS]
    assert store.catalog.rows("PRAGMA journal_mode")[0][0] == "wal"


def test_newer_store_is_refused_and_left_alone(tmp_path):
    s = ckptstore.Store(tmp_path / "s")
    s.commit({"x": torch.ones(2)}, tag="t")
    s.catalog.conn.execute("PRAGMA user_version=999")
    s.close()
    before = (tmp_path / "s" / "catalog.sqlite").read_bytes()
    with pytest.raises(SchemaVersionError, match="unsupported schema version 999"):
        ckptstore.Store(tmp_path / "s")
    assert (tmp_path / "s" / "catalog.sqlite").read_bytes() == before


def test_version_zero_catalog_with_tables_is_refused(tmp_path):
    (tmp_path / "s").mkdir()
    conn = sqlite3.connect(tmp_path / "s" / "catalog.sqlite")
    conn.execute("CREATE TABLE checkpoints (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(SchemaVersionError, match="version 0"):
        ckptstore.Store(tmp_path / "s")


def _add_note_column(db):
    db["commits"].add_column("note", str)


def _broken(db):
    db["commits"].add_column("half", str)
    raise RuntimeError("migration failed midway")


def test_migration_runs_in_order_with_a_backup(tmp_path):
    s = ckptstore.Store(tmp_path / "s")
    info = s.commit({"x": torch.arange(3)}, tag="t")
    s.close()
    path = tmp_path / "s" / "catalog.sqlite"
    newer = [*MIGRATIONS, Migration(SCHEMA_VERSION + 1, "add commits.note", _add_note_column)]
    cat = Catalog(path, migrations=newer)
    assert cat.user_version == SCHEMA_VERSION + 1
    assert "note" in cat.db["commits"].columns_dict
    assert [r["version"] for r in cat.rows("SELECT version FROM migrations ORDER BY version")] == [m.version for m in newer]
    assert cat.rows("SELECT id FROM commits")[0]["id"] == info.id
    cat.close()
    backup = tmp_path / "s" / f"catalog.sqlite.v{SCHEMA_VERSION}.bak"
    old = sqlite3.connect(backup)
    assert old.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    old.close()


def test_failed_migration_rolls_back_whole(tmp_path):
    s = ckptstore.Store(tmp_path / "s")
    s.commit({"x": torch.arange(3)}, tag="t")
    s.close()
    path = tmp_path / "s" / "catalog.sqlite"
    with pytest.raises(RuntimeError, match="midway"):
        Catalog(path, migrations=[*MIGRATIONS, Migration(SCHEMA_VERSION + 1, "broken", _broken)])
    with ckptstore.Store(tmp_path / "s") as again:
        assert again.catalog.user_version == SCHEMA_VERSION
        assert "half" not in again.catalog.db["commits"].columns_dict
        assert_bit_equal(again.checkout("t")["x"], torch.arange(3))


def test_catalog_that_is_not_sqlite(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "catalog.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(CatalogCorruptError, match="not an SQLite database"):
        ckptstore.Store(tmp_path / "s")


def test_c25_truncated_catalog_never_returns_wrong_data(tmp_path):
    s = ckptstore.Store(tmp_path / "s")
    data = {"w": torch.randn(300, 300), "b": torch.zeros(300)}
    for i in range(30):  # enough rows for a multi-page catalog
        s.commit({**data, "i": i}, tag=f"t{i}")
    s.close()
    path = tmp_path / "s" / "catalog.sqlite"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    try:
        s = ckptstore.Store(tmp_path / "s")
        back = s.checkout("t0")
    except CkptStoreError as exc:
        assert isinstance(exc, (CatalogCorruptError, NotAStoreError, ckptstore.errors.RefNotFoundError, ckptstore.errors.IntegrityError))
    else:  # it opened: then the data must be exact
        assert_bit_equal(back["w"], data["w"])
        assert_bit_equal(back["b"], data["b"])
