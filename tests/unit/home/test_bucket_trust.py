"""The store on object storage loses nothing (issue "object-storage trust"): each test
reproduces one way it lost or misreported data, against the moto server on loopback.

- GC and a pack whose ``.idx`` is damaged or missing (liveness from records only);
- GC whose machine clock is an hour off (ages on the server's clock);
- a commit slower than the grace period (a delaying proxy between client and server);
- deep fsck from a warm cache (it reads the bucket, not the cache);
- a damaged marker, damaged reflog objects, reflog retention;
- a forged 1 TiB entry (bounded memory) and ``tags`` beside a damaged record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

import ckptstore
from ckptstore.backends import open_backend
from ckptstore.objects.bucketformat import MARKER, MARKER_COPY, commit_key
from ckptstore.objects.packindex import encode_index, index_key, pack_key

from tests.unit.home import bucket_workers
from tests.delay_proxy import DelayProxy
from tests.unit.home.test_bucket_store import _assert_state, _committed, _fresh, _raw_put, _sleep_past
from tests import paths


@pytest.fixture
def url(s3_server) -> str:
    return f"s3://ckpt/t-{uuid.uuid4().hex[:12]}"


def _flip(url: str, key: str, at: int) -> bytes:
    """Flip one byte of object ``key`` behind ckptstore's back; returns the intact bytes."""
    with open_backend(url) as b:
        good = b.get(key)
    data = bytearray(good)
    data[at % len(data)] ^= 0x20
    _raw_put(url, key, bytes(data))
    return good


def _only(url: str, suffix: str) -> str:
    with open_backend(url) as b:
        (key,) = [o.key for o in b.list("blobs") if o.key.endswith(suffix)]
    return key


def _worker(code: str, env: dict | None = None, skew: float = 0.0) -> subprocess.Popen:
    """A fresh interpreter running ``code`` (``url`` and the helpers of tests.unit.home.bucket_workers in
    scope); ``skew`` shifts that machine's wall clock, as a badly set clock would."""
    prelude = textwrap.dedent(f"""
        import time
        _time, _ns = time.time, time.time_ns
        time.time = lambda: _time() + {skew!r}
        time.time_ns = lambda: _ns() + {int(skew * 1e9)!r}
        import json, sys
        import ckptstore
        from tests.unit.home import bucket_workers
    """)
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=paths.REPO)


def _done(proc: subprocess.Popen, timeout: float = 120) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{out}\n{err}"
    return out


# --- 1. GC never deletes a live pack for its index's sake ------------------------------------------


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_gc_keeps_a_live_pack_whose_index_is_damaged_or_missing_and_rebuilds_the_index(tmp_path, url, damage):
    """Tag ``a`` holds one tensor in pack P; P's ``.idx`` is flipped or deleted (P intact).
    A GC whose cache had already indexed P runs twice, a grace period apart: P stays (its
    blobs are named by a kept record), the index is rebuilt from P byte for byte, and a
    fresh machine checks ``a`` out exactly. Before: P was taken for an orphan and deleted."""
    grace = 1.0
    cid, meta = _committed(url, tmp_path)
    key = _only(url, ".idx")
    warm = ckptstore.Store(url, cache=tmp_path / "writer-cache")
    warm.checkout("latest")  # this machine's cache indexed P
    if damage == "flip":
        good = _flip(url, key, 40)
    else:
        with open_backend(url) as b:
            good = b.get(key)
            b.delete(key)
    with open_backend(url) as b:
        _sleep_past(b.head(_only(url, ".pack")).mtime, grace)
    first = warm.gc(grace=grace, keep_last=1)
    with open_backend(url) as b:
        _sleep_past(max([o.mtime for o in b.list("gc")] or [0.0]), grace)
    second = warm.gc(grace=grace, keep_last=1)
    assert (first.packs_deleted, second.packs_deleted, first.indexes_repaired + second.indexes_repaired) == (0, 0, 1)
    with open_backend(url) as b:
        assert b.get(key) == good and b.head(pack_key(key.rsplit("/", 1)[1][:-4])) is not None
    _assert_state(_fresh(url, tmp_path).checkout("latest"), meta, "after two GCs")
    assert _fresh(url, tmp_path).fsck(deep=True).ok
    warm.close()


# --- 2 and 3. the server's clock, and a commit slower than the grace period ---------------------------


@pytest.fixture
def slow_link(s3_server):
    """A delaying proxy between a client and the moto server: its endpoint, and the proxy to set rules on."""
    proxy = DelayProxy(s3_server.endpoint).start()
    yield proxy
    proxy.stop()


_SLOW_COMMIT = """
    store = ckptstore.Store(sys.argv[1])
    meta = json.loads(sys.argv[2])
    print(store.commit(bucket_workers.state(meta), tag="slow", metadata=meta).id)
"""


def _slow_commit(url: str, proxy: DelayProxy, meta: dict, tmp_path) -> subprocess.Popen:
    code = _SLOW_COMMIT.replace("sys.argv[1]", repr(url)).replace("sys.argv[2]", repr(json.dumps(meta)))
    return _worker(code, {"AWS_ENDPOINT_URL": proxy.endpoint, "XDG_CACHE_HOME": str(tmp_path / "slow-cache")})


def _wait_for_pack(url: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    with open_backend(url) as b:
        while time.monotonic() < deadline:
            packs = [o.key for o in b.list("blobs") if o.key.endswith(".pack")]
            if packs:
                return packs[0]
            time.sleep(0.05)
    raise AssertionError("the slow commit uploaded no pack")


@pytest.mark.parametrize("skew", [3600.0, -3600.0])
def test_a_gc_whose_clock_is_an_hour_off_measures_the_grace_period_on_the_servers_clock(tmp_path, url, slow_link, skew):
    """A commit whose record PUT is held 8 s (its packs already uploaded) beside a GC
    process whose clock runs an hour ahead (or behind) of the server, ``grace="600s"``,
    run twice: nothing of the commit in flight is marked, the commit returns and its tag
    checks out exactly. Before: the skewed GC marked and then swept the commit's pack."""
    slow_link.set_rules([{"method": "PUT", "key": "/commits/", "seconds": 8.0}])
    meta = {"w": 4, "i": 1, "n": 4096, "alt": 1}
    writer = _slow_commit(url, slow_link, meta, tmp_path)
    _wait_for_pack(url)
    _done(_worker(f"""
        s = ckptstore.Store({url!r})
        s.gc(grace="600s", keep_last=1)
        time.sleep(1.0)
        s.gc(grace="600s", keep_last=1)
    """, {"XDG_CACHE_HOME": str(tmp_path / "gc-cache")}, skew=skew))
    with open_backend(url) as b:
        marks = [json.loads(b.get(o.key)) for o in b.list("gc")]
    assert [m for m in marks if m["packs"] or m["commits"]] == []
    cid = _done(writer).strip()
    s = _fresh(url, tmp_path)
    assert s.tags() == {"slow": cid}
    _assert_state(s.checkout("slow"), meta, "the commit made beside a skewed GC")


def test_a_commit_slower_than_the_grace_period_keeps_its_own_new_packs(tmp_path, url, slow_link):
    """A commit that takes 8 s between uploading its pack and writing its record, beside a
    GC looping with ``grace="2s"`` that marks and then sweeps that pack: the commit finds
    its pack gone after its record is on the bucket (before its ref move), writes the
    blobs again, and its tag checks out exactly from a fresh machine. Before: the tag
    named a commit whose blobs were gone."""
    slow_link.set_rules([{"method": "PUT", "key": "/commits/", "seconds": 8.0}])
    meta = {"w": 6, "i": 2, "n": 4096, "alt": 0}
    writer = _slow_commit(url, slow_link, meta, tmp_path)
    first = _wait_for_pack(url)
    gc = ckptstore.Store(url, cache=tmp_path / "gc-cache")
    deleted = 0
    while writer.poll() is None:
        deleted += gc.gc(grace="2s", keep_last=1).packs_deleted
        if deleted:
            slow_link.set_rules([])  # the link recovers: the record PUT held now goes on, the rewritten blobs' commit is quick
        time.sleep(0.2)
    cid = _done(writer).strip()
    with open_backend(url) as b:
        assert b.head(first) is None and deleted >= 1, "the GC did not sweep the slow commit's first pack: the case did not happen"
    s = _fresh(url, tmp_path)
    assert s.tags() == {"slow": cid}
    _assert_state(s.checkout("slow"), meta, "the slow commit")
    assert s.fsck(deep=True).ok
    gc.close()


# --- 4. deep fsck reads the bucket ---------------------------------------------------------------


def test_deep_fsck_from_a_warm_cache_finds_a_damaged_record_on_the_bucket(tmp_path, url):
    """The cache holds the commit's record intact; the bucket's copy has a flipped byte.
    Deep fsck from that warm cache reports the commit and its tag, as from a fresh one.
    Before: it reported clean while every fresh machine failed to check the tag out."""
    cid, _ = _committed(url, tmp_path)
    warm = ckptstore.Store(url, cache=tmp_path / "writer-cache")
    _flip(url, commit_key(cid), 60)
    for s in (warm, _fresh(url, tmp_path)):
        report = s.fsck(deep=True)
        assert (report.damaged_tags, report.damaged_commits) == (["latest"], [cid]), report.problems
    warm.close()


# --- 5 is tests/unit/home/test_bucket_store.py::test_a_damaged_or_missing_index_affects_only_its_pack_and_is_repaired_from_the_pack


# --- 6. the marker and the reflog ----------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_marker_loses_nothing_fsck_names_it_and_repair_rewrites_it(tmp_path, url, damage):
    """One flipped byte of ``ckptstore.json`` (or the object deleted): every machine still
    opens the store, checks the tag out and commits; deep fsck reports the marker and
    only it; ``fsck --repair`` rewrites it from its copy, byte for byte. Before: the
    whole store was ``NotAStoreError`` for everyone."""
    cid, meta = _committed(url, tmp_path)
    with open_backend(url) as b:
        good = b.get(MARKER)
        assert b.get(MARKER_COPY) == good
        if damage == "delete":
            b.delete(MARKER)
    if damage == "flip":
        _flip(url, MARKER, 25)
    s = _fresh(url, tmp_path)
    _assert_state(s.checkout("latest"), meta, "beside a damaged marker")
    other = {"w": 1, "i": 3, "n": 256, "alt": 0}
    s.commit(bucket_workers.state(other), tag="other", metadata=other)
    assert s.shard_bytes == json.loads(good)["shard_bytes"]  # the copy's settings, not defaults
    report = s.fsck(deep=True)
    if damage == "delete":
        # what a first writer killed between its copy and the marker leaves: the next commit completes it (found by a
        # tester: the store stayed "broken" for fsck through any number of commits)
        assert report.ok and not report.damaged_marker, report.problems
        with open_backend(url) as b:
            assert b.get(MARKER) == good
            b.delete(MARKER)  # and once more, for the repair below
        report = s.fsck(deep=True)
    assert report.damaged_marker and len(report.problems) == 1 and MARKER in report.problems[0], report.problems
    assert s.fsck(repair=True).repaired == [MARKER]
    with open_backend(url) as b:
        assert b.get(MARKER) == good
    assert _fresh(url, tmp_path).fsck(deep=True).ok
    s.close()


def test_with_both_markers_damaged_repair_rewrites_nothing_and_says_why(tmp_path, url):
    """``ckptstore.json`` and its copy both flipped, on a store of non-default settings: the
    tag still checks out; ``fsck --repair`` rewrites neither (guessing the settings would
    change every later commit's shard size and dedup) and reports both, naming why.
    Before the fix (found by a newcomer) the repair wrote the default settings."""
    with ckptstore.Store(url, cache=tmp_path / "writer-cache", shard_bytes=64 << 10, compression_level=9) as s:
        s.commit({"x": torch.arange(1 << 16, dtype=torch.float32)}, tag="latest")
    for key in (MARKER, MARKER_COPY):
        _flip(url, key, 40)
    with open_backend(url) as b:
        damaged = {k: b.get(k) for k in (MARKER, MARKER_COPY)}
    s = _fresh(url, tmp_path)
    assert torch.equal(s.checkout("latest")["x"], torch.arange(1 << 16, dtype=torch.float32))
    report = s.fsck(repair=True)
    assert report.repaired == [] and report.damaged_marker and MARKER in report.problems[0] and MARKER_COPY in report.problems[0]
    assert "cannot be read back" in report.problems[0]
    with open_backend(url) as b:
        assert {k: b.get(k) for k in (MARKER, MARKER_COPY)} == damaged
    s.close()


def test_fsck_reports_a_damaged_reflog_object_and_gc_collects_the_reflog_of_dropped_commits(tmp_path, url):
    """Ten commits move ``latest``: ten reflog objects. One flipped byte in one is
    reported by deep fsck, naming it, and so is one whose flip leaves JSON of the right
    shape (each record carries its digest). After ``gc(keep_last=2)`` (and its sweep) only
    the reflog objects naming a kept commit remain (the damaged ones stay for fsck).
    Before: reflog objects were never checked nor collected."""
    s = ckptstore.Store(url, cache=tmp_path / "cache")
    ids = []
    for i in range(10):
        meta = {"w": 2, "i": i, "n": 256, "alt": i % 2}
        ids.append(s.commit(bucket_workers.state(meta), tag="latest", metadata=meta).id)
    with open_backend(url) as b:
        keys = [o.key for o in b.list("reflog")]
        moves = {k: json.loads(b.get(k)) for k in keys}
    assert len(keys) == 10
    damaged = next(k for k, m in moves.items() if m["new"] == ids[0])
    _flip(url, damaged, 0)  # "{" becomes "[": not JSON
    quiet = next(k for k, m in moves.items() if m["new"] == ids[1])
    with open_backend(url) as b:
        at = b.get(quiet).index(b'"commit"') + 3
    _flip(url, quiet, at)  # still JSON of the right shape ("coMmit"): only the record's digest tells
    report = s.fsck(deep=True)
    assert report.damaged_reflog == sorted([damaged, quiet]) and len(report.problems) == 2, report.problems
    grace = 1.0
    with open_backend(url) as b:
        _sleep_past(max(o.mtime for o in b.list("reflog")), grace)
    s.gc(keep_last=2, grace=grace)
    with open_backend(url) as b:
        _sleep_past(max(o.mtime for o in b.list("gc")), grace)
    report = s.gc(keep_last=2, grace=grace)
    with open_backend(url) as b:
        left = sorted(o.key for o in b.list("reflog"))
    kept = sorted(k for k, m in moves.items() if m["new"] in ids[-2:]) + [damaged, quiet]
    assert left == sorted(kept) and report.reflog_removed == 6
    assert [c.id for c in s.log("latest")] == ids[::-1][:2]
    s.close()


# --- 7. sizes validated before allocating -----------------------------------------------------------


def test_deep_fsck_rereads_a_pack_in_batches_of_at_most_fsck_batch_bytes(tmp_path, url, monkeypatch):
    """Deep fsck rereads the blobs of all commits together, one pack's at a time in ranged
    reads of at most ``BucketFsck.fsck_batch`` bytes: 10 blobs of 16 KiB in one pack, a
    batch of 40 KiB: 5 reads of 2 entries, and the same report as in one read."""
    from ckptstore.home.bucket_upkeep import BucketFsck
    from ckptstore.objects.packs import BLOB_HEADER

    with ckptstore.Store(url, cache=tmp_path / "w", shard_bytes=16 << 10, compression_level=0) as s:
        s.commit({"x": torch.arange(40 << 10, dtype=torch.float32)}, tag="latest")  # 160 KiB: 10 shards
    one = _fresh(url, tmp_path).fsck(deep=True)
    assert (one.ok, one.blobs_checked, one.bytes_checked) == (True, 10, 160 << 10)
    monkeypatch.setattr(BucketFsck, "fsck_batch", 40 << 10)
    s = _fresh(url, tmp_path)
    reads = []
    get_ranges = s.home.backend.get_ranges
    monkeypatch.setattr(s.home.backend, "get_ranges", lambda key, ranges: reads.append((key, list(ranges))) or get_ranges(key, ranges))
    report = s.fsck(deep=True)
    assert report == one
    assert sorted(len(r) for k, r in reads if k.endswith(".pack")) == [2] * 5
    assert all(sum(b - a for a, b in r) == 2 * (BLOB_HEADER.size + (16 << 10)) for _, r in reads)
    s.close()


def test_verify_and_deep_fsck_refuse_a_forged_one_tebibyte_entry_without_allocating_it(tmp_path, url):
    """A forged commit whose manifest and ``.idx`` entry claim a 1 TiB zstd blob (its
    payload a few bytes): ``verify`` and ``fsck --deep`` report the blob as corrupt, in
    bounded memory, and the CLI exits 1 with no traceback. Before: a raw MemoryError."""
    import zstandard

    from ckptstore.layout import digest
    from ckptstore.objects.packs import CODEC_ZSTD, BlobLoc, Entry, entry_header, pack_header
    from ckptstore.objects.records import commit_id

    _committed(url, tmp_path)
    size = 1 << 40
    payload = zstandard.ZstdCompressor().compress(b"\0" * 4096)
    dig = digest(b"forged")
    pid = uuid.uuid4().hex
    header = entry_header(dig, size, CODEC_ZSTD, len(payload))
    entry = Entry(BlobLoc(dig, size, pid, 16, len(payload), CODEC_ZSTD), 0, b"CKBL")
    text = json.dumps([[], 1.0, "", "{}", [["", "dict", 1, json.dumps({"class": "builtins.dict", "ckptstore.keys": True})]],
                       [["w", "", "tensor", "uint8", [size], None, None, f"{dig.hex()}-{size}"]]], separators=(",", ":"))
    cid = commit_id(text)
    with open_backend(url) as b:
        b.put_new(pack_key(pid), pack_header() + header + payload)
        b.put_new(index_key(pid), encode_index([entry]))
        b.put_new(commit_key(cid), text.encode())
    s = _fresh(url, tmp_path)
    report = s.verify(cid)
    assert report.corrupt_blobs == [f"{dig.hex()}-{size}"] and report.damaged_commits == [cid]
    report = s.fsck(deep=True)
    assert report.corrupt_blobs == [f"{dig.hex()}-{size}"] and report.damaged_commits == [cid]
    for cmd in (["verify", cid], ["fsck", "--deep"]):
        proc = subprocess.run([sys.executable, "-m", "ckptstore.cli", *cmd, "--store", url], capture_output=True, text=True,
                              env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cli-cache")}, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
        assert "content hash mismatch" in proc.stdout
    s.close()


# --- 8. listing tags whatever the state of their commits ---------------------------------------------


def test_tags_from_a_fresh_cache_lists_a_tag_whose_record_is_damaged(tmp_path, url):
    """Two tags; one commit record flipped on the bucket. ``Store.tags``, ``tagged`` and the
    CLI's ``tags`` from a fresh cache list both (the damaged one saying so); checking the
    damaged one out is the error. Before: a raw KeyError from ``tagged``."""
    s = ckptstore.Store(url, cache=tmp_path / "cache")
    a = s.commit({"x": torch.arange(4)}, tag="a").id
    b = s.commit({"x": torch.arange(5)}, tag="b").id
    _flip(url, commit_key(a), 50)
    fresh = _fresh(url, tmp_path)
    assert fresh.tags() == {"a": a, "b": b}
    tagged = fresh.tagged()
    assert sorted(tagged) == ["a", "b"] and tagged["a"].id == a and "damaged" in tagged["a"].message and tagged["b"].id == b
    with pytest.raises(ckptstore.errors.IntegrityError, match=commit_key(a)):
        fresh.checkout("a")
    proc = subprocess.run([sys.executable, "-m", "ckptstore.cli", "tags", "--store", url, "--json"], capture_output=True, text=True,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cli-cache")}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"a": a, "b": b}
    s.close()


# --- listing costs O(what changed), not O(history) (issue "scale trust", item 6) -----------------------


def _counting(proxy: DelayProxy, method: str, key: str):
    """A counter of the requests through ``proxy`` whose method and path match: call it for the count so far."""
    proxy.set_rules([{"method": method, "key": key, "seconds": 0}])
    start = proxy.status()["delayed"]
    return lambda: proxy.status()["delayed"] - start


def test_tags_reads_only_refs_and_only_the_refs_that_moved(tmp_path, url, slow_link):
    """50 tags. A fresh machine's ``tags()`` reads the 50 refs and no record nor index; a
    second machine-start with that cache reads none (one listing revalidates every ref by
    its ETag); after 3 tags move, it reads exactly those 3. Before: every call read every
    ref, and a fresh one every record and index too."""
    s = ckptstore.Store(url, cache=tmp_path / "writer")
    first = s.commit({"x": torch.arange(8)}, tag="t0").id
    for i in range(1, 50):
        s.tag(f"t{i}", first)
    env = {"AWS_ENDPOINT_URL": slow_link.endpoint}
    code = """
        s = ckptstore.Store({url!r}, cache={cache!r})
        print(len(s.tags()))
    """.format(url=url, cache=str(tmp_path / "reader"))
    for method, key, want in (("GET", "/refs/", 50), ("GET", "/commits/", 0), ("GET", "/blobs/", 0)):
        (tmp_path / "reader" / "refs.json").unlink(missing_ok=True)
        count = _counting(slow_link, method, key)
        assert _done(_worker(code, env)).split() == ["50"]
        assert count() == want, (method, key)
    refs = _counting(slow_link, "GET", "/refs/")
    assert _done(_worker(code, env)).split() == ["50"] and refs() == 0
    second = s.commit({"x": torch.arange(9)}, tag="t1").id
    s.tag("t2", second)
    s.delete_tag("t3")
    refs = _counting(slow_link, "GET", "/refs/")
    assert _done(_worker(code, env)).split() == ["49"] and refs() == 3
    s.close()


def test_log_with_a_limit_fetches_about_that_many_records(tmp_path, url, slow_link):
    """A lineage of 40 commits; a fresh machine's ``log("latest", limit=3)`` returns the 3
    newest, exactly, and fetches at most 6 records (the 3, the next generation's
    frontier, and the parents whose blobs tell each one's new bytes). Before: the whole lineage, one record at a time."""
    s = ckptstore.Store(url, cache=tmp_path / "writer")
    ids = [s.commit({"x": torch.arange(i + 1)}, tag="latest").id for i in range(40)]
    records = _counting(slow_link, "GET", "/commits/")
    out = _done(_worker(f"""
        s = ckptstore.Store({url!r}, cache={str(tmp_path / "reader")!r})
        print(" ".join(c.id for c in s.log("latest", limit=3)))
    """, {"AWS_ENDPOINT_URL": slow_link.endpoint}))
    assert out.split() == ids[::-1][:3] and 3 <= records() <= 6
    s.close()


def _fresh_queries(url: str, proxy: DelayProxy, monkeypatch, tmp_path, first: str) -> dict:
    """Requests (of any kind) that a fresh machine's ``log("latest", limit=3)``, ``info``, ``show``,
    ``tagged`` and ``diff`` each make, each from an empty cache; and what they returned."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    calls = {
        "log": lambda s: [c.id for c in s.log("latest", limit=3)],
        "info": lambda s: s.info("latest").id,
        "show": lambda s: len(s.show("latest")["leaves"]),
        "tagged": lambda s: sorted(s.tagged()),
        "diff": lambda s: len(s.diff(first, "latest").leaves),
    }
    out = {}
    for name, call in calls.items():
        with ckptstore.Store(url, cache=tmp_path / f"fresh-{name}-{uuid.uuid4().hex[:6]}") as s:
            count = _counting(proxy, "*", "/")
            got = call(s)
            out[name] = (count(), got)
    monkeypatch.undo()
    return out


def _figures(s: ckptstore.Store) -> list[tuple]:
    return [(c.id, c.parents, c.created_at, c.logical_bytes, c.new_bytes, c.stored_bytes, c.shards_total, c.shards_new)
            for c in s.log("latest", limit=3)]


def test_a_fresh_log_info_show_tagged_and_diff_cost_the_same_requests_at_20_and_80_packs(tmp_path, s3_server, slow_link, monkeypatch):
    """Stores of N = 20 and N = 80 commits, each commit in a pack of its own. On a fresh
    machine ``log("latest", limit=3)``, ``info``, ``show``, ``tagged`` and ``diff`` each make
    exactly as many requests at N = 80 as at N = 20: records and refs (and the indexes of the
    packs the tag names), never every pack's ``.idx``. The log is exact, and once a checkout
    has located the blobs every figure equals the writer's. Before, the copy of a record read
    every pack's ``.idx`` first: ``log`` made 31 and 91 requests, ``show`` 29 and 89,
    ``tagged`` 25 and 85, ``diff`` 28 and 88 (``info`` 7 and 7: the tag's hint)."""
    counts, ids = {}, {}
    for n in (20, 80):
        url = f"s3://ckpt/t-{uuid.uuid4().hex[:12]}"
        with ckptstore.Store(url, cache=tmp_path / f"writer-{n}") as w:
            ids[n] = [w.commit({"x": torch.arange(i + 1)}, tag="latest").id for i in range(n)]
            with open_backend(url) as b:
                assert sum(o.key.endswith(".pack") for o in b.list("blobs")) == n
            got = _fresh_queries(url, slow_link, monkeypatch, tmp_path, ids[n][0])
            assert got["log"][1] == ids[n][::-1][:3] and got["info"][1] == ids[n][-1]
            assert got["show"][1] == 1 and got["tagged"][1] == ["latest"] and got["diff"][1] == 1
            counts[n] = {name: c for name, (c, _) in got.items()}
            fresh = _fresh(url, tmp_path)
            assert [c.id for c in fresh.log("latest", limit=3)] == ids[n][::-1][:3]
            assert torch.equal(fresh.checkout(ids[n][-2])["x"], torch.arange(n - 1))
            assert _figures(fresh) == _figures(w)
            fresh.close()
    assert counts[20] == counts[80], counts


def test_blobs_a_listing_left_unlocated_are_never_garbage_and_read_back_exact(tmp_path, url):
    """A machine whose cache holds records copied by ``log(limit=...)`` without their blobs'
    places: its GC keeps every pack a kept commit needs, its fsck is clean, its checkouts are
    bit-exact, and its commit that reuses a blob it never located reuses it (written again
    only if no pack holds it)."""
    w = ckptstore.Store(url, cache=tmp_path / "writer")
    ids = [w.commit({"x": torch.arange(10 * (i + 1))}, tag="latest").id for i in range(6)]
    w.tag("old", ids[1])
    m = _fresh(url, tmp_path)
    m.commit({"y": torch.ones(3)}, tag="other")  # its index is current now; the writer goes on
    more = [w.commit({"x": torch.arange(n)}, tag="latest").id for n in (70, 80)]
    listed = m.log("latest", limit=3)
    assert [c.id for c in listed] == [more[1], more[0], ids[5]]
    assert listed[1].stored_bytes is None  # its blob is in a pack whose .idx this machine has not read
    again = m.commit({"x": torch.arange(70)}, tag="mine")  # that blob: reused, not written again
    assert (again.shards_new, again.new_bytes) == (0, 0)
    assert m.info(more[0]).stored_bytes == w.info(more[0]).stored_bytes  # located by that commit
    report = m.gc(keep_last=2, grace=0)
    assert set(report.dropped) == {ids[2], ids[3], ids[4], ids[5]}  # "old" keeps ids[1] and ids[0]
    assert m.fsck(deep=True).ok
    fresh = _fresh(url, tmp_path)
    for ref, n in (("latest", 80), ("old", 20), (more[0], 70), ("mine", 70)):
        assert torch.equal(fresh.checkout(ref)["x"], torch.arange(n))
    assert torch.equal(m.checkout(ids[0])["x"], torch.arange(10))
    for s in (w, m, fresh):
        s.close()


def test_a_ranged_read_of_a_swept_pack_whose_id_holds_416_is_missing_not_truncated(url):
    """A ranged GET of a pack a GC deleted is ``ObjectNotFoundError`` (the reader then finds
    the blob's new place), also when the key's hex id holds the digits 416. Found by the
    harness: such a key was taken for an HTTP 416 (a truncated object), a checkout failed
    with BlobCorruptError beside a GC that had repacked the blob."""
    from ckptstore.errors import ObjectNotFoundError

    key = "blobs/13/13b0f6f89a6a4167a16d3f570883756e.pack"
    with open_backend(url) as b:
        b.put_new(key, b"x" * 100)
        assert bytes(b.get_ranges(key, [(10, 20)])[0]) == b"x" * 10
        b.delete(key)
        with pytest.raises(ObjectNotFoundError):
            b.get_ranges(key, [(10, 20)])


@pytest.mark.timeout(60)
def test_a_commit_reusing_a_blob_whose_pack_is_gone_writes_it_again(tmp_path, url):
    """The writer's cache locates a blob in a pack the bucket no longer holds (deleted, or
    swept while the cache still held a commit naming it): the commit writes the blob again
    and the tag checks out. Before the fix (found by the harness) the commit looked for a
    repacked copy, took the cache's row naming the gone pack for one, and looped forever."""
    x = torch.arange(1 << 12, dtype=torch.float32)
    with ckptstore.Store(url, cache=tmp_path / "writer") as s:
        first = s.commit({"x": x}, tag="a").id
        (pack,) = {loc.pack for loc in s.locate([k for leaf in s.record(first).leaves for k in leaf.keys]).values()}
        with open_backend(url) as b:
            b.delete(pack_key(pack))
        second = s.commit({"x": x, "step": 1}, tag="b")
        assert (second.shards_total, second.shards_new) == (1, 1)  # written again, not reused from the gone pack
    fresh = _fresh(url, tmp_path)
    assert torch.equal(fresh.checkout("b")["x"], x)
    fresh.close()
