"""``Store("s3://…")`` (ckptstore.bucket.BucketStore) against a real moto S3 server:
processes racing on one tag, writers and GCs SIGKILLed at random instants, GC beside
a writer, a server failing requests, and hostile objects on the bucket.

Every state a worker commits is a pure function of its commit's metadata
(tests/bucket_workers.py: ``state``), so what a tag must check out to is known from
the commit id it names. Random choices print their seed (``CKPTSTORE_SEED=<n>``
replays one)."""

from __future__ import annotations

import itertools
import os
import random
import time
import uuid

import pytest

import ckptstore
from ckptstore.bucket import BucketStore

from . import bucket_workers
from .conftest import assert_bit_equal


def _seed() -> int:
    seed = int(os.environ.get("CKPTSTORE_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (CKPTSTORE_SEED={seed} replays it)")
    return seed


@pytest.fixture
def url(s3_server) -> str:
    return f"s3://ckpt/b-{uuid.uuid4().hex[:12]}"


def _env(cache) -> dict:
    """The environment of a worker: the server's AWS_* variables and its own cache folder."""
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    env["XDG_CACHE_HOME"] = str(cache)
    return env


def _assert_state(got, meta: dict, why: str) -> None:
    want = bucket_workers.state(meta)
    assert sorted(got.keys()) == sorted(want), why
    for k, v in want.items():
        try:
            assert_bit_equal(got[k], v)
        except AssertionError as exc:
            raise AssertionError(f"{why}: leaf {k} differs ({exc})") from None


# --- 1. processes racing on one tag -------------------------------------------------------------


def test_four_processes_commit_to_one_tag_and_no_update_is_lost(tmp_path, url):
    """4 processes × 20 commits to ``latest``: every call returns, every commit checks out
    by id bit-exactly, the bucket's reflog holds exactly 80 moves chained old → new, and
    the lineage of ``latest`` is one chain of all 80. Processes 0 and 1 share a cache
    folder, 2 and 3 have their own."""
    ctx = bucket_workers.context()
    caches = [tmp_path / "shared", tmp_path / "shared", tmp_path / "own2", tmp_path / "own3"]
    logs = [str(tmp_path / f"w{w}.log") for w in range(4)]
    procs = [ctx.Process(target=bucket_workers.writer, args=(_env(caches[w]), url, "latest", w, 0, 20, 16, 0, logs[w]))
             for w in range(4)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        assert p.exitcode == 0, (p.exitcode, bucket_workers.read_log(logs[procs.index(p)])[-3:])
    print(f"80 racing commits in {time.monotonic() - t0:.1f} s")
    made: dict[str, dict] = {}
    for w in range(4):
        lines = bucket_workers.read_log(logs[w])
        assert lines[0] == "ready" and lines[-1] == "done", lines
        results = [line.split() for line in lines[1:-1]]
        assert [r[1] for r in results] == [str(i) for i in range(20)] and all(len(r[0]) == 32 for r in results), results
        for cid, i in results:
            made[cid] = {"w": w, "i": int(i), "n": 16, "alt": 0}
    assert len(made) == 80

    store = ckptstore.Store(url)
    assert isinstance(store, BucketStore)
    for cid, meta in made.items():
        _assert_state(store.checkout(cid), meta, f"commit {cid} of writer {meta['w']}, step {meta['i']}")
        assert store.info(cid).metadata == meta
    moves = store.reflog("latest")[::-1]  # oldest first
    assert len(moves) == 80
    assert sorted(m["new_commit"] for m in moves) == sorted(made)
    assert moves[0]["old_commit"] is None
    for before, move in itertools.pairwise(moves):
        assert move["old_commit"] == before["new_commit"], (before, move)
    assert store.tags() == {"latest": moves[-1]["new_commit"]}
    # one chain: each commit's only parent is the commit the tag named before its move
    # (log sorts by created_at, which a commit takes before its CAS retries: not the chain's order)
    lineage = {c.id: c.parents for c in store.log("latest")}
    assert lineage == {m["new_commit"]: (m["old_commit"],) if m["old_commit"] else () for m in moves}
    store.close()

