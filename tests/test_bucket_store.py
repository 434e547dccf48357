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



# --- 5. hostile objects on the bucket -------------------------------------------------------------


def _raw_put(url: str, key: str, data: bytes) -> None:
    """Overwrite object ``key`` under ``url`` behind ckptstore's back (obstore, unconditional PUT)."""
    import obstore
    from obstore.store import S3Store

    from ckptstore.backends.s3 import parse_s3_url

    bucket, prefix = parse_s3_url(url)
    obstore.put(S3Store(bucket, prefix=prefix), key, data)


def _fresh(url: str, tmp_path) -> BucketStore:
    """A store on ``url`` with an empty cache of its own (a machine that never saw it)."""
    return ckptstore.Store(url, cache=tmp_path / f"cache-{uuid.uuid4().hex[:8]}")


def _committed(url: str, tmp_path, n: int = 4096) -> tuple[str, dict]:
    meta = {"w": 9, "i": 0, "n": n, "alt": 1}
    with ckptstore.Store(url, cache=tmp_path / "writer-cache") as s:
        return s.commit(bucket_workers.state(meta), tag="latest", metadata=meta).id, meta


def test_a_tag_naming_a_missing_or_forged_record_is_an_integrity_error(tmp_path, url):
    from ckptstore.backends import open_backend
    from ckptstore.errors import IntegrityError
    from ckptstore.remote import commit_key, ref_payload

    cid, meta = _committed(url, tmp_path)
    with open_backend(url) as b:
        text = b.get(commit_key(cid))
        _raw_put(url, commit_key(cid), text.replace(b'\\"i\\":0', b'\\"i\\":1', 1))  # the metadata forged
        assert b.get(commit_key(cid)) != text
        with pytest.raises(IntegrityError, match=f"{commit_key(cid)}: the record does not hash to commit id {cid}"):
            _fresh(url, tmp_path).checkout("latest")
        report = _fresh(url, tmp_path).fsck(deep=True)
        assert not report.ok and report.damaged_tags == ["latest"] and report.damaged_commits == [cid]

        b.delete(commit_key(cid))  # the record gone
        with pytest.raises(IntegrityError, match=f"commit {cid} is missing \\(no object {commit_key(cid)}\\)"):
            _fresh(url, tmp_path).checkout("latest")
        report = _fresh(url, tmp_path).fsck()
        assert not report.ok and report.damaged_tags == ["latest"]

        ghost = "ab" * 16  # a tag naming a commit that never existed
        b.cas_ref("ghost", ref_payload(ghost, None, "commit", 0.0), None)
        with pytest.raises(IntegrityError, match=f"commit {ghost} is missing"):
            _fresh(url, tmp_path).checkout("ghost")
        _raw_put(url, commit_key(cid), text)  # put back: everything reads again
    s = _fresh(url, tmp_path)
    _assert_state(s.checkout("latest"), meta, "the restored record")
    assert s.fsck(deep=True).damaged_tags == ["ghost"]


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_flipped_byte_in_a_pack_is_caught_by_checkout_and_fsck(tmp_path, url, where):
    from ckptstore.backends import open_backend
    from ckptstore.errors import BlobCorruptError, IntegrityError
    from ckptstore.packindex import decode_index, index_key, pack_key
    from ckptstore.packs import BLOB_HEADER

    cid, meta = _committed(url, tmp_path)
    with open_backend(url) as b:
        (key,) = [o.key for o in b.list("blobs") if o.key.endswith(".pack")]
        pid = key.rsplit("/", 1)[1][:-5]
        own = bucket_workers.state(meta)["own"]
        entries = decode_index(b.get(index_key(pid)), pid)
        (e,) = [e for e in entries if e.loc.raw_len == own.numel() * 4 and e.loc.digest == ckptstore.layout.digest(own.numpy().tobytes())]
        data = bytearray(b.get(key))
        at = e.loc.offset + (BLOB_HEADER.size + 100 if where == "payload" else 8)
        data[at] ^= 0x01
        _raw_put(url, pack_key(pid), bytes(data))
    for s in (ckptstore.Store(url, cache=tmp_path / "writer-cache"), _fresh(url, tmp_path)):  # a warm cache and a cold one
        with pytest.raises((BlobCorruptError, IntegrityError), match=f"pack {pid}|{e.loc.address}"):
            s.checkout("latest")
        got = s.checkout("latest", partial="step")  # other leaves still read
        assert_bit_equal(got["step"], bucket_workers.state(meta)["step"])
        report = s.fsck(deep=True)
        assert not report.ok and report.corrupt_blobs == [e.loc.address] and report.damaged_commits == [cid], report
        s.close()


def test_a_damaged_index_is_an_error_naming_it(tmp_path, url):
    from ckptstore.backends import open_backend
    from ckptstore.errors import CkptStoreError

    _, meta = _committed(url, tmp_path)
    with open_backend(url) as b:
        (key,) = [o.key for o in b.list("blobs") if o.key.endswith(".idx")]
        good = b.get(key)
    data = bytearray(good)
    data[20] ^= 0xFF
    _raw_put(url, key, bytes(data))
    s = _fresh(url, tmp_path)
    with pytest.raises(CkptStoreError, match=key):
        s.checkout("latest")
    with pytest.raises(CkptStoreError, match=key):
        s.fsck()
    _raw_put(url, key, b"not an index")
    with pytest.raises(CkptStoreError, match=key):
        _fresh(url, tmp_path).checkout("latest")
    _raw_put(url, key, good)  # put back: a cold cache reads it all again
    s = _fresh(url, tmp_path)
    _assert_state(s.checkout("latest"), meta, "the restored index")
    assert s.fsck(deep=True).ok


def test_missing_bucket_empty_prefix_and_create_false(tmp_path, s3_server):
    from ckptstore.errors import NotAStoreError

    with pytest.raises(NotAStoreError, match="bucket 'nosuchbucket' does not exist"):
        ckptstore.Store("s3://nosuchbucket/x")
    empty = f"s3://ckpt/empty-{uuid.uuid4().hex[:12]}"
    with pytest.raises(NotAStoreError, match="is not a ckptstore store"):
        ckptstore.Store(empty, create=False)
    s = ckptstore.Store(empty)
    assert s.tags() == {}
    for call in (lambda: s.checkout("x"), lambda: s.info("x"), lambda: s.log("x"), lambda: s.reflog("x"), lambda: s.reflog(),
                 lambda: s.resolve("x"), lambda: s.fsck(), lambda: s.gc(grace=0), lambda: s.delete_tag("x"), lambda: s.tag("y", "x")):
        with pytest.raises(NotAStoreError, match=f"{empty} is not a ckptstore store yet \\(no ckptstore.json"):
            call()
    assert s.log() == []
    with ckptstore.backends.open_backend(empty) as b:
        assert b.list() == [] and b.list_refs() == []  # reading wrote nothing
    s.close()
