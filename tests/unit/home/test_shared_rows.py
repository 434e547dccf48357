"""Catalog rows shared between commits (schema 4, issue 22 items 7 and 8): a component
committed unchanged points at the rows of the commit that holds its leaves
(``components.rows_of``) instead of writing a ``leaves`` row per leaf and a ``shards`` row
per shard again; GC moves the rows to a kept sharer when it drops their owner."""

from __future__ import annotations

import shutil

import pytest
import torch

import ckptstore
from ckptstore.home.catalog import SCHEMA_VERSION

from tests.conftest import assert_bit_equal
from tests import paths

SHARD = 256 << 10
FIXTURE = paths.FIXTURES / "schema_v3"


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(4096, 64, generator=g), "b": torch.randn(4096, 64, generator=g), "cfg": {"lr": 1e-3, "name": "x/y"}}


def two_modules(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"m1": torch.nn.Linear(64, 64), "m2": torch.nn.Linear(64, 64)}


def counts(s: ckptstore.Store) -> tuple[int, int, int]:
    """(leaves, shards, components) rows in the catalog."""
    return tuple(s.catalog.rows(f"SELECT COUNT(*) FROM {t}", raw=True)[0][0] for t in ("leaves", "shards", "components"))


def rows_of(s: ckptstore.Store, cid: str) -> dict[str, str | None]:
    return dict(s.catalog.rows("SELECT path, rows_of FROM components WHERE commit_id = ?", (cid,), raw=True))


def leaves_of(s: ckptstore.Store, cid: str) -> int:
    return s.catalog.rows("SELECT COUNT(*) FROM commit_leaves WHERE commit_id = ?", (cid,), raw=True)[0][0]


def check_all(s: ckptstore.Store, expected: dict[str, dict]) -> None:
    """Every commit of ``expected`` checks out bit-exact, and fsck (deep) is clean."""
    for cid, value in expected.items():
        got = s.checkout(cid)
        for k in value:
            if isinstance(value[k], torch.Tensor):
                assert_bit_equal(got[k], value[k])
            else:
                assert {n: got[k, n] for n in value[k]} == value[k]
    report = s.fsck(deep=True)
    assert report.ok, report.problems


def module_state(mods: dict) -> dict:
    return {f"{name}/{k}": v.detach().clone() for name, m in mods.items() for k, v in m.state_dict().items()}


def check_modules(s: ckptstore.Store, expected: dict[str, dict]) -> None:
    for cid, want in expected.items():
        target = two_modules(99)
        s.checkout(cid, into=target)
        assert module_state(target).keys() == want.keys()
        for k, v in module_state(target).items():
            assert_bit_equal(v, want[k])
    report = s.fsck(deep=True)
    assert report.ok, report.problems


def test_an_unchanged_recommit_writes_no_leaf_or_shard_rows(tmp_path):
    with ckptstore.Store(tmp_path / "s", create=True, shard_bytes=SHARD) as s:
        sd = state()
        first = s.commit(sd, tag="t")
        assert counts(s) == (4, 8, 1) and rows_of(s, first.id) == {"": None}
        again = s.commit(sd, tag="t")
        assert counts(s) == (4, 8, 2)  # one components row, no leaves or shards rows
        assert rows_of(s, again.id) == {"": first.id}
        assert (again.shards_total, again.shards_new, again.parents) == (8, 0, (first.id,))
        third = s.commit(sd, tag="t")
        assert counts(s) == (4, 8, 3) and rows_of(s, third.id) == {"": first.id}  # the owner itself, never a chain
        assert leaves_of(s, again.id) == leaves_of(s, third.id) == 4
        assert s.record(again.id).leaves == s.record(first.id).leaves  # the record still lists the whole manifest
        shown = s.show(third.id)
        assert [leaf["path"] for leaf in shown["leaves"]] == ["a", "b", "cfg/lr", "cfg/name"]
        assert [leaf["shared_with_parent"] for leaf in shown["leaves"]] == [4, 4, 0, 0]
        assert s.diff(first.id, third.id).count("unchanged") == 4
        check_all(s, {first.id: sd, again.id: sd, third.id: sd})


def test_a_partly_changed_state_shares_its_unchanged_components_only(tmp_path):
    with ckptstore.Store(tmp_path / "s", create=True) as s:
        mods = two_modules()
        first = s.commit(mods, tag="t")
        want = {first.id: module_state(mods)}
        assert counts(s) == (4, 4, 2)
        with torch.no_grad():
            mods["m2"].weight += 1
        second = s.commit(mods, tag="t")
        want[second.id] = module_state(mods)
        assert rows_of(s, second.id) == {"m1": first.id, "m2": None}
        assert counts(s) == (6, 6, 4)  # m2's two leaves and shards again, nothing of m1
        third = s.commit(mods, tag="t")
        want[third.id] = module_state(mods)
        assert rows_of(s, third.id) == {"m1": first.id, "m2": second.id} and counts(s) == (6, 6, 6)
        assert s.record(third.id).text.count('"m1/weight"') == 1
        check_modules(s, want)


def test_gc_moves_shared_rows_to_a_kept_sharer(tmp_path):
    with ckptstore.Store(tmp_path / "s", create=True, shard_bytes=SHARD) as s:
        sd = state()
        c1 = s.commit(sd, tag="one")
        c2 = s.commit(sd, tag="two")
        c3 = s.commit(sd, tag="three")
        s.delete_tag("one")
        report = s.gc(grace=0)
        assert report.dropped == [c1.id]
        assert rows_of(s, c3.id) == {"": c3.id} and rows_of(s, c2.id) == {"": c3.id}  # the newest sharer owns them
        assert counts(s) == (4, 8, 2)
        assert s.catalog.rows("SELECT DISTINCT commit_id FROM leaves", raw=True) == [(c3.id,)]
        check_all(s, {c2.id: sd, c3.id: sd})
        s.delete_tag("three")
        assert s.gc(grace=0).dropped == [c3.id]
        assert rows_of(s, c2.id) == {"": c2.id} and counts(s) == (4, 8, 1)
        check_all(s, {c2.id: sd})
        s.delete_tag("two")
        s.gc(grace=0)
        assert counts(s) == (0, 0, 0) and s.catalog.rows("SELECT COUNT(*) FROM blobs", raw=True)[0][0] == 0


def test_a_gc_in_another_process_between_commits(tmp_path):
    """The digest cache's owner and last commit were dropped by another Store's GC, their
    blobs freed: the next commit writes its rows (and the blobs) again."""
    with ckptstore.Store(tmp_path / "s", create=True, shard_bytes=SHARD) as s:
        sd = state()
        s.commit(sd, tag="t")
        s.commit({"other": torch.ones(3)}, tag="t")  # moves the tag away
        with ckptstore.Store(tmp_path / "s") as other:
            assert len(other.gc(grace=0).dropped) == 1
        again = s.commit(sd, tag="u")
        assert rows_of(s, again.id) == {"": None} and again.shards_new == 8
        check_all(s, {again.id: sd})
        # The owner dropped, its rows moved to the last commit: the next commit finds them there.
        c2 = s.commit(sd, tag="v")
        assert rows_of(s, c2.id) == {"": again.id}
        with ckptstore.Store(tmp_path / "s") as other:
            other.delete_tag("u")
            assert other.gc(grace=0).dropped == [again.id]
        assert rows_of(s, c2.id) == {"": c2.id}
        c3 = s.commit(sd, tag="v")
        assert rows_of(s, c3.id) == {"": c2.id} and c3.shards_new == 0 and counts(s)[:2] == (5, 9)  # and {"other": ...}
        check_all(s, {c2.id: sd, c3.id: sd})


def test_recover_rebuilds_every_sharing_commit_exactly(tmp_path):
    with ckptstore.Store(tmp_path / "s", create=True) as s:
        mods = two_modules()
        ids = [s.commit(mods, tag="t").id]
        want = {ids[0]: module_state(mods)}
        for _ in range(2):
            ids.append(s.commit(mods, tag="t").id)
            want[ids[-1]] = module_state(mods)
        with torch.no_grad():
            mods["m1"].bias -= 1
        ids.append(s.commit(mods, tag="t").id)
        want[ids[-1]] = module_state(mods)
        texts = {c: s.record(c).text for c in ids}
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / "s" / f"catalog.sqlite{suffix}").unlink(missing_ok=True)
    ckptstore.Store.recover(tmp_path / "s")
    with ckptstore.Store(tmp_path / "s") as s:
        assert {c.id for c in s.log()} == set(ids) and {c: s.record(c).text for c in ids} == texts
        check_modules(s, want)
        again = s.commit(two_modules(), tag="t")  # a new process: new tensors, nothing shared
        assert set(rows_of(s, again.id).values()) == {None}


def test_a_schema_3_store_migrates_and_then_shares(tmp_path):
    """tests/fixtures/schema_v3: written by the code before schema 4 (a dict of two tensors
    committed twice, tag ``t``; then ``{"x": arange(6.)}``, tag ``x``)."""
    shutil.copytree(FIXTURE, tmp_path / "s")
    (tmp_path / "s" / "tmp").mkdir()  # (git keeps no empty folder)
    with ckptstore.Store(tmp_path / "s") as s:
        assert s.catalog.migrated_from == 3 and s.catalog.user_version == SCHEMA_VERSION == 5
        assert (tmp_path / "s" / "catalog.sqlite.v3.bak").exists()
        first, second = [c.id for c in reversed(s.log("t"))]
        expected = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.full((5,), 7, dtype=torch.int64)}
        check_all(s, {first: expected, second: expected, s.resolve("x"): {"x": torch.arange(6.0)}})
        assert rows_of(s, second) == {"": None}
        c = s.commit(expected, tag="t")
        again = s.commit(expected, tag="t")
        assert rows_of(s, again.id) == {"": c.id}
        check_all(s, {again.id: expected})


def test_a_read_only_schema_3_store_is_read(tmp_path):
    from tests.unit.top.test_hardening import read_only_view

    shutil.copytree(FIXTURE, tmp_path / "src" / "s")
    (tmp_path / "src" / "s" / "tmp").mkdir()
    with read_only_view(tmp_path / "src", tmp_path / "ro") as ro, ckptstore.Store(ro / "s", create=False) as s:
        assert not s.catalog.writable and s.catalog.user_version == 3
        assert_bit_equal(s.checkout("x")["x"], torch.arange(6.0))
        assert s.show("t")["leaves"][0]["shards"] == 1
        assert s.fsck().ok


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_stale_fingerprint_is_caught_in_a_shared_component(tmp_path, asynchronous):
    """A write torch does not count (through ``.data``) to every element of one tensor of an
    otherwise unchanged component: the sample catches it, the component gets rows of its own."""
    with ckptstore.Store(tmp_path / "s", create=True) as s:
        mods = two_modules()
        commit = (lambda: s.commit_async(mods, tag="t").result()) if asynchronous else (lambda: s.commit(mods, tag="t"))
        first = commit()
        mods["m1"].weight.data.mul_(2)
        with pytest.warns(ckptstore.errors.StaleFingerprintWarning):
            second = commit()
        assert rows_of(s, second.id) == {"m1": None, "m2": first.id}
        third = commit()
        assert rows_of(s, third.id) == {"m1": second.id, "m2": first.id}
        check_modules(s, {third.id: module_state(mods)})
