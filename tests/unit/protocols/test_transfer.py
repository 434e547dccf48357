"""push / pull between stores: commit ids kept, only missing blobs copied, tags moved
only as fast-forwards (compare-and-swap), nothing written when nothing is missing,
and a push killed at any instant leaves the destination consistent."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckptstore
from ckptstore.errors import NotAStoreError, RefConflictError

from tests.conftest import assert_bit_equal

ROWS = 4096  # x 64 float32: 1 MiB, 4 shards of 256 KiB


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(ROWS, 64, generator=g), "cfg": {"lr": 1e-3, "betas": (0.9, 0.999)}, "x/y": torch.arange(5)}


def files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "catalog" not in p.name)


def test_push_copies_lineage_with_ids_and_only_missing_blobs(tmp_path):
    local = ckptstore.Store(tmp_path / "local", create=True)
    sd = state()
    first = local.commit(sd, tag="latest", metadata={"step": (1, None)})
    sd["w"][:40] += 1  # 1 % of the rows: one shard
    second = local.commit(sd, tag="latest")
    report = local.push(tmp_path / "remote", "latest")  # a missing folder becomes a store
    assert (report.commit, report.tag, report.previous) == (second.id, "latest", None)
    assert report.commits_copied == [first.id, second.id]
    assert report.blobs_copied == 4 + 1 + 1  # w's 4 shards, x/y, then the one changed shard
    remote = ckptstore.Store(tmp_path / "remote")
    assert remote.tags() == {"latest": second.id}
    assert [c.id for c in remote.log("latest")] == [second.id, first.id]
    assert remote.info(first.id).metadata == {"step": (1, None)}
    back = remote.checkout("latest")
    assert_bit_equal(back["w"], sd["w"])
    assert back["cfg", "betas"] == (0.9, 0.999)
    assert remote.fsck(deep=True).ok

    before = (files(remote.root), len(remote.reflog()))
    again = local.push(remote, "latest")
    assert (again.commits_copied, again.blobs_copied, again.bytes_copied) == ([], 0, 0)
    assert (files(remote.root), len(remote.reflog())) == before  # nothing at all was written

    sd["w"][-40:] -= 1
    third = local.commit(sd, tag="latest")
    report = local.push(remote, "latest")
    assert (report.commits_copied, report.blobs_copied, report.previous) == ([third.id], 1, second.id)
    assert report.bytes_copied == 256 << 10  # its payload as stored (random floats stay raw)


def test_a_diverged_tag_is_refused_naming_both_commits_unless_forced(tmp_path):
    local = ckptstore.Store(tmp_path / "local", create=True)
    base = local.commit(state(), tag="latest")
    local.push(tmp_path / "remote", "latest")
    remote = ckptstore.Store(tmp_path / "remote")
    theirs = remote.commit(state(1), tag="latest")
    ours = local.commit(state(2), tag="latest")
    with pytest.raises(RefConflictError, match=f"names commit {theirs.id}, which is not an ancestor of {ours.id}"):
        local.push(remote, "latest")
    assert remote.tags() == {"latest": theirs.id}
    assert local.push(remote, "latest", force=True).previous == theirs.id
    assert remote.tags() == {"latest": ours.id}
    assert [c.id for c in remote.log("latest")] == [ours.id, base.id]


def test_pull_into_a_missing_folder_creates_the_store(tmp_path):
    remote = ckptstore.Store(tmp_path / "remote", create=True)
    info = remote.commit(state(), tag="step-1")
    local = ckptstore.Store(tmp_path / "local")  # not created by opening it
    assert not (tmp_path / "local").exists()
    report = local.pull(tmp_path / "remote", "step-1")
    assert report.commits_copied == [info.id]
    assert_bit_equal(local.checkout("step-1")["w"], state()["w"])


def test_tag_compare_and_swap(store):
    a = store.commit(state(), tag="t")
    b = store.commit(state(1))
    c = store.commit(state(2))
    with pytest.raises(RefConflictError, match=f"tag 't' names {a.id}, not {b.id}"):
        store.tag("t", c.id, expect=b.id)
    assert store.tags()["t"] == a.id
    assert store.tag("t", c.id, expect=a.id) == c.id
    with pytest.raises(RefConflictError):
        store.tag("new", c.id, expect=a.id)
    assert store.tag("new", c.id, expect=None) == c.id


def test_cli_push_and_pull(tmp_path, monkeypatch, capsys):
    from tests.unit.top.test_cli import cli

    local = ckptstore.Store(tmp_path / "local", create=True)
    info = local.commit(state(), tag="latest")
    code, out, _ = cli(monkeypatch, capsys, "push", str(tmp_path / "remote"), "latest", "--store", str(tmp_path / "local"))
    assert code == 0 and out.startswith(f"pushed {info.id[:12]}: 1 commit, 5 blobs")
    code, out, _ = cli(monkeypatch, capsys, "pull", str(tmp_path / "remote"), "latest", "--store", str(tmp_path / "other"), "--json")
    assert code == 0 and json.loads(out)["commit"] == info.id
    ckptstore.Store(tmp_path / "remote").commit(state(3), tag="latest")
    local.commit(state(4), tag="latest")
    code, out, err = cli(monkeypatch, capsys, "push", str(tmp_path / "remote"), "latest", "--store", str(tmp_path / "local"))
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1 and "not an ancestor" in err


PUSHER = """
import sys, ckptstore
ckptstore.Store(sys.argv[1]).push(sys.argv[2], "latest")
"""


def test_push_killed_at_random_instants_leaves_the_remote_consistent(tmp_path):
    seed = int(os.environ.get("CKPTSTORE_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (CKPTSTORE_SEED={seed} replays it)")
    rng = random.Random(seed)
    local = ckptstore.Store(tmp_path / "local", create=True, shard_bytes=64 << 10)
    sd = state()
    ids = []
    for k in range(6):  # a lineage of 6 commits, 16 MiB each, 4 % changed between them
        sd.setdefault("big", torch.randn(4 << 20, generator=torch.Generator().manual_seed(k)))
        sd["big"][k * 1000 : k * 1000 + 160000] += 1
        ids.append(local.commit(sd, tag="latest").id)
    remote = tmp_path / "remote"
    for _ in range(6):  # an uninterrupted push takes ~0.3 s here, its process starts in ~0.05 s
        proc = subprocess.Popen([sys.executable, "-c", PUSHER, str(local.root), str(remote)], stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.02, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        try:
            r = ckptstore.Store(remote)
            r.tags()
        except NotAStoreError as exc:  # killed before the store existed, or while SQLite created the catalog
            assert "does not exist" in str(exc) or "catalog.sqlite was never initialised: its creation was interrupted" in str(exc)
        else:
            assert r.fsck().ok, r.fsck().problems
            tag = r.tags().get("latest")
            assert tag in (None, ids[-1])  # the tag moves last, and only to the pushed commit
            for c in r.log():  # every copied commit is whole and keeps its id
                assert c.id in ids
            r.close()
    final = local.push(remote, "latest")  # running it again copies only what is missing
    r = ckptstore.Store(remote)
    assert r.tags() == {"latest": ids[-1]} and {c.id for c in r.log()} == set(ids)
    assert final.blobs_copied <= sum(local.info(i).shards_new for i in ids)
    assert_bit_equal(r.checkout("latest")["big"], sd["big"])
    assert r.fsck(deep=True).ok
