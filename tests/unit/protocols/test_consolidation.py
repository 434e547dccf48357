"""GC consolidates small packs: a store's file count follows its data, not its number of
commits (ARCHITECTURE.md, data model "pack"; docs/design.md, "Garbage collection").

Each commit writes two small packs (its new blobs, and its record with its tag moves);
before consolidation a store of N commits kept all 2N of them through any GC that
dropped nothing. Every test here failed then: the pack count stayed 2N (or N + 1)."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.home import local as home_mod
from ckptstore.errors import InvalidArgumentError

from tests.conftest import assert_bit_equal
from tests.unit.protocols.test_faults import fork

CATALOG_FILES = ("catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm")


def step_state(i: int) -> dict:
    """Commit ``i``: a tiny tensor that changes every commit (so each writes a blob pack)."""
    return {"x": torch.arange(16, dtype=torch.float32) + i, "step": i}


def pack_files(path: Path) -> list[Path]:
    return sorted(path.glob("blobs/*/*.pack"))


def build(path: Path, n: int) -> tuple[list[str], dict[str, str]]:
    """``n`` small commits on ``latest``, every 20th also tagged; (commit ids, tags)."""
    ids = []
    with ckptstore.Store(path, create=True) as s:
        for i in range(n):
            ids.append(s.commit(step_state(i), tag="latest").id)
            if i % 20 == 0:
                s.tag(f"step-{i}", "latest")
        return ids, s.tags()


def check_every_commit(s: ckptstore.Store, ids: list[str], tags: dict[str, str]) -> None:
    assert s.tags() == tags
    assert [c.id for c in s.log("latest")] == ids[::-1]
    for i, cid in enumerate(ids):
        got = s.checkout(cid)
        assert_bit_equal(got["x"], step_state(i)["x"])
        assert got["step"] == i


def test_gc_merges_the_small_packs_of_200_commits_into_one(tmp_path):
    path = tmp_path / "s"
    n = 200
    ids, tags = build(path, n)
    assert len(pack_files(path)) == 2 * n + n // 20  # a blob and a record pack per commit, one per tag move
    with ckptstore.Store(path) as s:
        young = s.gc(keep_last=n)  # within the grace period: nothing is rewritten
        assert (young.packs_consolidated, young.packs_deleted) == (0, 0)
        assert s.gc(keep_last=n, grace=0, dry_run=True).packs_consolidated == 2 * n + n // 20
        report = s.gc(keep_last=n, grace=0)
        assert (report.commits_dropped, report.blobs_deleted, report.packs_repacked) == (0, 0, 0)
        assert (report.packs_consolidated, report.packs_deleted) == (2 * n + n // 20, 2 * n + n // 20)
        assert len(pack_files(path)) == 1
        assert s.fsck(deep=True).ok
        check_every_commit(s, ids, tags)
        again = s.gc(keep_last=n, grace=0)  # one pack left: nothing to merge it with
        assert (again.packs_consolidated, again.packs_deleted) == (0, 0)
    for name in CATALOG_FILES:  # recover finds every commit record and each tag's newest move in the merged pack
        (path / name).unlink(missing_ok=True)
    rep = ckptstore.Store.recover(path)
    assert (rep.ok, rep.commits, rep.packs, rep.tags) == (True, n, 1, tags)
    with ckptstore.Store(path) as s:
        check_every_commit(s, ids, tags)
        assert s.fsck(deep=True).ok


def test_the_file_count_after_gc_does_not_grow_with_the_commits(tmp_path):
    counts = {}
    for n in (30, 300):
        path = tmp_path / f"s{n}"
        with ckptstore.Store(path, create=True) as s:
            for _ in range(n):  # the same tiny state: one blob pack, then a record pack per commit
                s.commit(step_state(0), tag="latest")
            assert len(pack_files(path)) == n + 1
            report = s.gc(keep_last=n, grace=0)
            assert report.packs_consolidated == n + 1
            counts[n] = len(pack_files(path))
            assert s.fsck(deep=True).ok and len(s.log("latest")) == n
    assert counts == {30: 1, 300: 1}


def test_merged_packs_still_on_disk_beside_their_copy_recover_once(tmp_path):
    """Within its grace period a merged pack stays on disk (retired) beside the new one:
    recover then finds every record twice, and indexes each once."""
    path = tmp_path / "s"
    ids, tags = build(path, 10)
    aside = tmp_path / "aside"
    shutil.copytree(path / "blobs", aside)
    with ckptstore.Store(path) as s:
        assert s.gc(keep_last=10, grace=0).packs_consolidated == 21
    shutil.copytree(aside, path / "blobs", dirs_exist_ok=True)  # as a grace period keeps them
    assert len(pack_files(path)) == 22
    for name in CATALOG_FILES:
        (path / name).unlink(missing_ok=True)
    rep = ckptstore.Store.recover(path)
    # 11 moves: latest's 10 (the old packs still hold the superseded ones) and step-0's
    assert (rep.ok, rep.commits, rep.tags, rep.reflog) == (True, 10, tags, 11)
    with ckptstore.Store(path) as s:
        check_every_commit(s, ids, tags)
        assert s.catalog.rows("SELECT COUNT(*) FROM records", raw=True)[0][0] == 10 + 11


def test_packs_a_process_holds_or_too_young_or_large_are_left(tmp_path):
    path = tmp_path / "s"
    ids, tags = build(path, 6)
    packs = pack_files(path)
    held = os.open(packs[0], os.O_RDONLY)  # as a commit holds its packs until it returns
    try:
        fcntl.flock(held, fcntl.LOCK_SH)
        with ckptstore.Store(path) as s:
            report = s.gc(keep_last=6, grace=0)
            assert (report.packs_consolidated, report.packs_deleted) == (len(packs) - 1, len(packs) - 1)
            assert packs[0].exists() and len(pack_files(path)) == 2
    finally:
        os.close(held)
    with ckptstore.Store(path) as s:
        sizes = [p.stat().st_size for p in pack_files(path)]
        assert s.gc(keep_last=6, grace=0, small_pack_bytes=min(sizes)).packs_consolidated == 0  # neither is small
        assert s.gc(keep_last=6, grace=0, small_pack_bytes=0).packs_consolidated == 0  # off
        assert s.gc(keep_last=6, grace=0).packs_consolidated == 2
        assert len(pack_files(path)) == 1
        check_every_commit(s, ids, tags)
        with pytest.raises(InvalidArgumentError, match="small-pack size"):
            s.gc(small_pack_bytes=-1)


@pytest.mark.parametrize("at", ["after the new pack is durable", "after the catalog transaction"])
def test_sigkill_mid_consolidation_leaves_one_set_of_packs_indexed(tmp_path, at):
    path = tmp_path / "s"
    ids, tags = build(path, 20)
    before = pack_files(path)

    def die_after(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
            return out
        return wrapped

    def child():
        if at == "after the new pack is durable":
            home_mod.PackWriter.finish = die_after(home_mod.PackWriter.finish)
        else:
            home_mod.LocalGC.mark = die_after(lambda self, plan, report: None)
        ckptstore.Store(path).gc(keep_last=20, grace=0)

    pid = fork(child)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    with ckptstore.Store(path) as s:
        assert len(pack_files(path)) == len(before) + 1  # the old packs and the new one, all on disk
        indexed = {r["id"] for r in s.catalog.rows("SELECT id FROM packs WHERE retired_at IS NULL")}
        old = {p.stem for p in before}
        assert indexed == (old if at == "after the new pack is durable" else {p.stem for p in pack_files(path)} - old)
        fsck = s.fsck(deep=True)
        assert fsck.ok
        check_every_commit(s, ids, tags)
        s.gc(keep_last=20, grace=0)  # the orphan (or the retired packs) go; one pack is left
        assert len(pack_files(path)) == 1
        fsck = s.fsck(deep=True)
        assert fsck.ok and fsck.orphan_packs == []
        check_every_commit(s, ids, tags)
