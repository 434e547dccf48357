"""A long-lived store: thousands of commits (two packs each) under a low open-files limit,
GC whose cost grows as n log n, recover that names what it could not restore, a damaged
catalog that never gives a raw traceback, and the CLI's tags at scale.

Every test failed before its fix: deep fsck and recover opened every pack at once (under
``ulimit -n 256`` a store of 1 500 commits gave 3 151 false fsck problems and a recovery of
0 commits reported as success), GC recomputed every tag's whole lineage once per 50
commits dropped, recover dropped a tag silently and exited 0, a flipped byte in the
catalog's schema text gave a raw UnicodeDecodeError, and ``tags`` sorted as strings.
"""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

import ckptstore
from benchmarks.scale import build, expected_x
from ckptstore.home.catalog import Catalog

from tests.conftest import run_fresh
from tests.unit.top.test_cli import cli

CATALOG_FILES = ("catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm")


def kept_by_retention(n: int, tag_every: int = 10) -> set[int]:
    """Steps of :func:`build`'s commits that ``gc(keep_last=1)`` keeps: the tagged ones."""
    return {i for i in range(n) if i % tag_every == 0} | {n - 1}


def shard_contents(step: int) -> set[tuple[int, tuple[int, ...]]]:
    """The eight 8-element shards of commit ``step``'s ``x`` (a blob each; equal shards share one)."""
    x = expected_x(step).tolist()
    return {tuple(x[8 * j : 8 * j + 8]) for j in range(8)}


SCALE = """
import json, os, resource, sys, threading
from pathlib import Path
import ckptstore
from benchmarks.scale import build

path, n, limit = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
tags = build(path, n)
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
peak = [0]
stop = threading.Event()
def count():
    while not stop.is_set():
        peak[0] = max(peak[0], len(os.listdir("/proc/self/fd")))
        stop.wait(0.005)
threading.Thread(target=count, daemon=True).start()
out = {"packs": len(list(path.glob("blobs/*/*.pack")))}
with ckptstore.Store(path) as s:
    rep = s.fsck(deep=True)
    out["fsck"] = [rep.ok, len(rep.problems), rep.problems[:3], rep.blobs_checked]
    out["tags"] = s.tags()
    out["log"] = [c.id for c in s.log("latest")]
    out["all"] = sorted(c.id for c in s.log())
for name in ("catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm"):
    (path / name).unlink(missing_ok=True)
rep = ckptstore.Store.recover(path)
out["recover"] = [rep.ok, rep.commits, len(rep.tags), rep.lost()[:3], rep.damaged_packs]
with ckptstore.Store(path) as s:
    out["tags_after"] = s.tags()
    out["log_after"] = [c.id for c in s.log("latest")]
    out["all_after"] = sorted(c.id for c in s.log())
    out["x_latest"] = s.checkout("latest")["x"].tolist()
    g = s.gc(keep_last=1, grace=0)
    out["gc"] = [g.commits_dropped, g.blobs_deleted, g.packs_deleted, g.packs_repacked, g.packs_consolidated]
    out["after_gc"] = {
        "commits": len(s.log()), "blobs": s.catalog.rows("SELECT COUNT(*) FROM blobs")[0][0],
        "tags": s.tags() == out["tags"], "fsck": s.fsck(deep=True).ok,
        "steps": {t: s.checkout(t)["step"] for t in s.tags()},
        "x": {t: s.checkout(t)["x"].tolist() for t in list(s.tags())[::25]},
    }
out["files_after_gc"] = len(list(path.glob("blobs/*/*.pack")))
stop.set()
out["peak_fds"] = peak[0]
print(json.dumps(out))
"""


def check_scale(tmp_path: Path, n: int, limit: int) -> None:
    proc = run_fresh(SCALE, str(tmp_path / "s"), str(n), str(limit))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    tags = {"latest": n - 1, **{f"step-{i}": i for i in range(0, n, 10)}}
    assert out["packs"] == 2 * n  # one pack of blobs and one of records per commit
    assert out["fsck"][:2] == [True, 0] and out["fsck"][3] == n, out["fsck"]
    assert len(out["tags"]) == len(tags) and len(out["log"]) == n
    # recover restores every commit and tag exactly, with open files bounded by the setting
    assert out["recover"] == [True, n, len(tags), [], {}], out["recover"]
    assert out["tags_after"] == out["tags"] and out["log_after"] == out["log"] and out["all_after"] == out["all"]
    assert out["x_latest"] == expected_x(n - 1).tolist()
    assert out["peak_fds"] < limit
    # GC frees exactly what retention allows: the untagged commits, their blobs and packs; the
    # small packs left (one per live blob, and each kept commit's record with its tags' newest
    # moves) are merged into one, so every one of the 2n packs goes
    kept = kept_by_retention(n)
    live = set().union(*(shard_contents(i) for i in kept))
    record_packs_kept = len(kept)
    assert out["gc"] == [n - len(kept), n - len(live), 2 * n, 0, len(live) + record_packs_kept], out["gc"]
    after = out["after_gc"]
    assert after["commits"] == len(kept) and after["blobs"] == len(live) and after["tags"] and after["fsck"]
    assert after["steps"] == tags
    assert after["x"] == {t: expected_x(tags[t]).tolist() for t in after["x"]}
    assert out["files_after_gc"] == 1


def test_a_store_of_1500_commits_under_a_256_open_files_limit(tmp_path):
    """3 000 packs, 256 descriptors: deep fsck clean, recover exact, GC exact."""
    check_scale(tmp_path, 1500, 256)


@pytest.mark.slow
def test_a_store_of_20000_commits_under_a_1024_open_files_limit(tmp_path):
    check_scale(tmp_path, 20_000, 1024)


# --- GC grows as n log n ------------------------------------------------------------------


def gc_work(path: Path, n: int) -> tuple[int, int, int]:
    """(SQLite VM steps / 1000, SQL statements, commits dropped) of a GC keeping the 10 newest
    of ``n`` commits (``latest`` only)."""
    build(path, n, tag_every=0)
    steps, statements = [0], [0]
    with ckptstore.Store(path) as s:
        conn = s.catalog.conn

        def tick() -> int:
            steps[0] += 1
            return 0

        conn.set_progress_handler(tick, 1000)
        conn.set_trace_callback(lambda sql: statements.__setitem__(0, statements[0] + 1))
        report = s.gc(keep_last=10, grace=0)
        conn.set_progress_handler(None, 0)
        conn.set_trace_callback(None)
        assert len(s.log()) == 10
    return steps[0], statements[0], report.commits_dropped


def test_gc_work_grows_no_faster_than_n_log_n(tmp_path):
    """10x the commits: the rows SQLite visits (VM steps) and the statements grow ~10x, not
    ~100x (before: 10x -> 75x the VM steps, as each batch of 50 re-read every commit)."""
    small = gc_work(tmp_path / "a", 300)
    large = gc_work(tmp_path / "b", 3000)
    assert (small[2], large[2]) == (290, 2990)
    assert large[0] < 30 * small[0], (small, large)
    assert large[1] < 30 * small[1], (small, large)


# --- recover names what it could not restore -------------------------------------------------


def flip_newest_record(path: Path) -> str:
    """Flip one byte inside the payload of the newest commit's record; returns its id."""
    with ckptstore.Store(path) as s:
        cid = s.resolve("latest")
        row = s.catalog.rows("SELECT pack, offset FROM records WHERE kind = 1 AND name = ?", (cid,))[0]
    pack = path / "blobs" / row["pack"][:2] / f"{row['pack']}.pack"
    data = bytearray(pack.read_bytes())
    data[row["offset"] + 40 + 20] ^= 0x01
    pack.write_bytes(bytes(data))
    return cid


def test_recover_names_the_tag_and_commit_it_could_not_restore_and_exits_1(tmp_path, monkeypatch, capsys):
    path = tmp_path / "s"
    build(path, 30)
    cid = flip_newest_record(path)
    for name in CATALOG_FILES:
        (path / name).unlink(missing_ok=True)
    code, out, err = cli(monkeypatch, capsys, "recover", "--store", str(path))
    assert code == 1
    assert "recovered 29 commits, 3 tags" in out
    assert f"tag latest: its newest move (seq 33) names commit {cid}, which could not be restored: its record is damaged" in out
    assert f"commit {cid}: its record is damaged" in out and "content hash mismatch" in out
    assert err.count("\n") == 1 and err.startswith("error: recover could not restore 1 tag(s) and 1 commit(s)")
    with ckptstore.Store(path) as s:  # the lost catalog's replacement was installed: the rest is there
        assert sorted(s.tags()) == ["step-0", "step-10", "step-20"] and len(s.log()) == 29


def test_an_incomplete_rebuild_replaces_an_existing_catalog_only_with_force(tmp_path, monkeypatch, capsys):
    path = tmp_path / "s"
    build(path, 30)
    cid = flip_newest_record(path)
    damaged = b"\0" * 8192  # a catalog SQLite cannot read: recover would replace it
    (path / "catalog.sqlite").write_bytes(damaged)
    code, out, err = cli(monkeypatch, capsys, "recover", "--store", str(path))
    assert code == 1 and err.count("\n") == 1 and "would lack" in err and cid in err and "--force" in err
    assert (path / "catalog.sqlite").read_bytes() == damaged  # left as it was
    code, out, err = cli(monkeypatch, capsys, "recover", "--force", "--store", str(path))
    assert code == 1 and "tag latest: its newest move" in out and "moved to" in out
    with ckptstore.Store(path) as s:
        assert len(s.log()) == 29


# --- a damaged catalog: one clean line, and recover --force always works ----------------------


def _flips(data: bytes, seed: int, schema: int, anywhere: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    starts = [i for i in range(len(data)) if data.startswith(b"CREATE ", i)]
    out = [(rng.choice(starts) + rng.randrange(7, 60), rng.randrange(8)) for _ in range(schema)]
    return out + [(rng.randrange(len(data)), rng.randrange(8)) for _ in range(anywhere)]


def test_catalog_byte_flips_give_one_clean_line_and_recover_force_restores_the_tags(tmp_path, monkeypatch, capsys):
    base = tmp_path / "base"
    tags = build(base, 25, tag_every=5)
    with ckptstore.Store(base) as s:
        ids = s.tags()
    data = (base / "catalog.sqlite").read_bytes()
    assert not (base / "catalog.sqlite-wal").exists()  # all of the catalog is in the file flipped
    for offset, bit in _flips(data, seed=7, schema=12, anywhere=24):
        path = tmp_path / "s"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(base, path)
        flipped = bytearray(data)
        flipped[offset] ^= 1 << bit
        (path / "catalog.sqlite").write_bytes(bytes(flipped))
        where = f"byte {offset} bit {bit}"
        for args in (("tags",), ("log",), ("fsck", "--deep")):
            code, out, err = cli(monkeypatch, capsys, *args, "--store", str(path))
            assert "Traceback" not in out + err, (where, args, err)
            assert code == 0 or (code == 1 and (err.count("\n") == 1 or args[0] == "fsck")), (where, args, code, err)
        try:
            with ckptstore.Store(path) as s:
                x = s.checkout("latest")["x"]
            assert torch.equal(x, expected_x(24)), where  # a checkout that succeeds returns the right data
        except ckptstore.errors.CkptStoreError:
            pass
        code, out, err = cli(monkeypatch, capsys, "recover", "--force", "--store", str(path))
        assert code == 0, (where, out, err)
        with ckptstore.Store(path) as s:
            assert s.tags() == ids and {t: s.checkout(t)["step"] for t in s.tags()} == tags, where
            assert torch.equal(s.checkout("latest")["x"], expected_x(24)), where


def test_a_flipped_schema_byte_is_catalog_corrupt_error_naming_the_remedy(tmp_path, monkeypatch, capsys):
    path = tmp_path / "s"
    build(path, 5)
    data = bytearray((path / "catalog.sqlite").read_bytes())
    data[data.index(b"CREATE TABLE") + 3] = 0xFF  # not UTF-8 any more: a raw UnicodeDecodeError before
    (path / "catalog.sqlite").write_bytes(bytes(data))
    code, out, err = cli(monkeypatch, capsys, "tags", "--store", str(path))
    assert code == 1 and err.count("\n") == 1 and "catalog.sqlite" in err and "recover --force" in err, err
    with pytest.raises(ckptstore.errors.CatalogCorruptError, match="recover --force"):
        ckptstore.Store(path).tags()


# --- the CLI's tags ----------------------------------------------------------------------------


def test_cli_tags_sort_naturally_in_a_constant_number_of_queries(tmp_path, monkeypatch, capsys):
    path = tmp_path / "s"
    with ckptstore.Store(path) as s:
        cid = s.commit({"x": torch.zeros(4)}).id
        for name in ("step-1000", "step-500", "step-20", "a10", "a2", "a01", "b"):
            s.tag(name, cid)
    want = ["a01", "a2", "a10", "b", "step-20", "step-500", "step-1000"]
    code, out, _ = cli(monkeypatch, capsys, "tags", "--store", str(path), "--json")
    assert code == 0 and list(json.loads(out)) == want
    code, out, _ = cli(monkeypatch, capsys, "tags", "--store", str(path))
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == want

    statements: list[str] = []
    connect = Catalog._connect

    def traced(self, create):
        conn = connect(self, create)
        conn.set_trace_callback(statements.append)
        return conn

    monkeypatch.setattr(Catalog, "_connect", traced)
    counts = []
    for more in (10, 490):  # 17 tags, then 507
        with ckptstore.Store(path) as s:
            for i in range(more):
                s.tag(f"many-{more}-{i}", cid)
        statements.clear()
        code, out, _ = cli(monkeypatch, capsys, "tags", "--store", str(path))
        assert code == 0
        counts.append(len([q for q in statements if q.lstrip().upper().startswith("SELECT")]))
    assert counts[0] == counts[1], counts  # 17 tags or 507: the same queries


def test_a_read_only_schema_2_catalog_is_read_without_the_new_indexes(tmp_path):
    """Schema 3 only adds indexes: a store of the previous version on a read-only mount is
    still read (a writable open migrates it, after a backup)."""
    from tests.unit.top.test_hardening import read_only_view

    src = tmp_path / "src"
    build(src / "s", 3)
    conn = sqlite3.connect(src / "s" / "catalog.sqlite")
    conn.executescript(
        "DROP VIEW commit_leaves; DROP INDEX idx_components_rows_of_path; DROP INDEX idx_leaves_commit_id_component; "
        "ALTER TABLE components DROP COLUMN rows_of; "
        "DROP INDEX idx_tags_commit_id; DROP INDEX idx_records_kind_name_seq; DELETE FROM migrations WHERE version >= 3; PRAGMA user_version = 2;"
    )
    conn.close()
    with read_only_view(src, tmp_path / "ro") as ro, ckptstore.Store(ro / "s", create=False) as s:
        assert not s.catalog.writable and s.catalog.user_version == 2
        assert s.tags() == {"latest": s.resolve("latest"), "step-0": s.resolve("step-0")}
        assert torch.equal(s.checkout("latest")["x"], expected_x(2))
    with ckptstore.Store(src / "s") as s:
        assert s.catalog.user_version == 5 and (src / "s" / "catalog.sqlite.v2.bak").exists()
        assert {r[0] for r in s.catalog.rows("SELECT name FROM sqlite_master WHERE type = 'index'")} >= {"idx_tags_commit_id", "idx_records_kind_name_seq"}
