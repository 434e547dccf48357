"""push / pull to and from object storage (ckptstore.protocols.remote) against a real moto S3
server on loopback: commit ids kept, only missing blobs uploaded, nothing written when
nothing is missing, tags moved by compare-and-swap only as fast-forwards, remote objects
checked on the way in, and a pusher killed at any instant leaves the remote consistent."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
import warnings
from datetime import timedelta

import pytest
import torch

import ckptstore
from ckptstore.backends import S3Backend, open_backend
from ckptstore.objects.bucketformat import commit_key, fetch_record, read_tag
from ckptstore.errors import BackendError, BlobCorruptError, IntegrityError, NotAStoreError, RefConflictError
from ckptstore.objects.packindex import decode_index, encode_index
from ckptstore.objects.packs import BLOB_HEADER, PACK_HEADER, Entry

from tests.conftest import assert_bit_equal, row_count

ROWS = 4096  # x 64 float32: 1 MiB, 4 shards of 256 KiB (random floats stay raw)
SHARD = 256 << 10
FAST_RETRIES = {"max_retries": 3, "backoff": {"init_backoff": timedelta(milliseconds=10), "max_backoff": timedelta(milliseconds=50), "base": 2}}


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(ROWS, 64, generator=g), "cfg": {"lr": 1e-3, "betas": (0.9, 0.999)}, "x/y": torch.arange(5)}


@pytest.fixture
def url(s3_server) -> str:
    return f"s3://ckpt/r-{uuid.uuid4().hex[:12]}"


def objects(url: str) -> dict[str, int]:
    """Every object under the prefix (refs are not objects) and its size in bytes."""
    with open_backend(url) as b:
        return {o.key: o.size for o in b.list()}


def new(before: dict, after: dict) -> dict:
    return {k: v for k, v in after.items() if k not in before}


def entry(text: str) -> int:
    return BLOB_HEADER.size + len(text.encode())


def test_push_to_an_empty_prefix_then_pull_into_a_fresh_store(tmp_path, url):
    local = ckptstore.Store(tmp_path / "local", create=True)
    sd = state()
    first = local.commit(sd, tag="latest", metadata={"step": (1, None)})
    sd["w"][:40] += 1  # 1 % of the rows: one shard
    second = local.commit(sd, tag="latest")
    report = local.push(url, "latest")
    assert (report.commit, report.tag, report.previous) == (second.id, "latest", None)
    assert report.commits_copied == [first.id, second.id]
    assert (report.blobs_copied, report.bytes_copied) == (4 + 1 + 1, 5 * SHARD + 40)
    got = objects(url)
    packs = [k for k in got if k.endswith(".pack")]
    assert len(packs) == 1 and packs[0][:-5] + ".idx" in got
    recs = [local.record(c).text for c in (first.id, second.id)]
    # one pack: its header, 6 blob entries (5 shards of 256 KiB, x/y's 40 bytes), then the two records
    assert got[packs[0]] == PACK_HEADER.size + 6 * BLOB_HEADER.size + 5 * SHARD + 40 + sum(entry(t) for t in recs)
    assert got[packs[0][:-5] + ".idx"] == 16 + 8 * 48 + 16
    assert {k for k in got if k.startswith("commits/")} == {commit_key(first.id), commit_key(second.id)}
    assert "ckptstore.json" in got and len([k for k in got if k.startswith("reflog/latest/")]) == 1
    assert len(got) == 2 + 2 + 2 + 1  # marker and its copy, pack + idx, 2 records, 1 reflog record (the ref is no object)
    assert (report.objects_written, report.bytes_written) == (len(got) + 1, sum(got.values()))  # + the ref
    with open_backend(url) as b:
        assert read_tag(b, "latest")[0] == second.id
        marker = json.loads(b.get("ckptstore.json"))
        assert marker.pop("digest") == ckptstore.layout.digest(json.dumps(marker, sort_keys=True).encode()).hex()
        assert marker == {"compression_level": 3, "format": "ckptstore", "shard_bytes": SHARD, "version": 1}
        assert b.get("marker/ckptstore.json") == b.get("ckptstore.json")

    other = ckptstore.Store(tmp_path / "other")
    pulled = other.pull(url, "latest")
    assert pulled.commits_copied == [first.id, second.id] and pulled.blobs_copied == 6
    assert other.tags() == {"latest": second.id}
    assert [c.id for c in other.log("latest")] == [second.id, first.id]
    assert other.info(first.id).metadata == {"step": (1, None)}
    back = other.checkout("latest")
    assert_bit_equal(back["w"], sd["w"])
    assert_bit_equal(back["x/y"], sd["x/y"])
    assert back["cfg", "betas"] == (0.9, 0.999)
    assert other.fsck(deep=True).ok
    again = other.pull(url, "latest")  # nothing missing: nothing at all written
    assert (again.commits_copied, again.blobs_copied) == ([], 0) and len(other.reflog()) == 1


def test_a_second_push_writes_nothing_and_a_1_percent_change_uploads_one_shard(tmp_path, url):
    local = ckptstore.Store(tmp_path / "local", create=True)
    sd = state()
    local.commit(sd, tag="latest")
    local.push(url, "latest")
    before = objects(url)
    with open_backend(url) as b:
        version = b.read_ref("latest").version
    again = local.push(url, "latest")
    assert (again.commits_copied, again.blobs_copied, again.objects_written, again.bytes_written) == ([], 0, 0, 0)
    assert objects(url) == before
    with open_backend(url) as b:
        assert b.read_ref("latest").version == version  # the ref was not rewritten either

    sd["w"][-40:] -= 1  # 1 % of the rows: the last shard
    third = local.commit(sd, tag="latest")
    report = local.push(url, "latest")
    assert (report.commits_copied, report.blobs_copied, report.bytes_copied) == ([third.id], 1, SHARD)
    added = new(before, objects(url))
    text = local.record(third.id).text
    pack = next(k for k in added if k.endswith(".pack"))
    assert added == {
        pack: PACK_HEADER.size + BLOB_HEADER.size + SHARD + entry(text),  # 262 264 + the record's entry
        pack[:-5] + ".idx": 16 + 2 * 48 + 16,
        commit_key(third.id): len(text.encode()),
        next(k for k in added if k.startswith("reflog/")): added[next(k for k in added if k.startswith("reflog/"))],
    }
    assert report.objects_written == 5  # pack, idx, record, ref, reflog record
    print(f"1 % re-push: {report.bytes_written} bytes in {report.objects_written} objects; pack {added[pack]} bytes")


def test_a_diverged_remote_tag_is_refused_naming_both_commits_unless_forced(tmp_path, url):
    a = ckptstore.Store(tmp_path / "a", create=True)
    base = a.commit(state(), tag="latest")
    a.push(url, "latest")
    b = ckptstore.Store(tmp_path / "b")
    b.pull(url, "latest")
    theirs = b.commit(state(1), tag="latest")
    b.push(url, "latest")
    ours = a.commit(state(2), tag="latest")
    before = objects(url)
    with pytest.raises(RefConflictError, match=f"names commit {theirs.id}, which is not an ancestor of {ours.id}"):
        a.push(url, "latest")
    assert objects(url) == before  # refused before anything was written
    with open_backend(url) as be:
        assert read_tag(be, "latest")[0] == theirs.id
    # pull refuses the other way round, and writes nothing locally
    rows = row_count(a)
    with pytest.raises(RefConflictError, match=f"names commit {ours.id}, which is not an ancestor of {theirs.id}"):
        a.pull(url, "latest")
    assert row_count(a) == rows
    forced = a.push(url, "latest", force=True)
    assert (forced.previous, forced.commits_copied) == (theirs.id, [ours.id])
    with open_backend(url) as be:
        assert read_tag(be, "latest")[0] == ours.id
    c = ckptstore.Store(tmp_path / "c")
    c.pull(url, "latest")
    assert [i.id for i in c.log("latest")] == [ours.id, base.id]
    assert c.pull(url, theirs.id[:8]).commits_copied == [theirs.id]  # by commit id prefix: no tag moves
    assert c.tags() == {"latest": ours.id}


RACER = """
import os, sys, time, ckptstore
from ckptstore.errors import RefConflictError
while not os.path.exists(sys.argv[3]):
    time.sleep(0.001)
try:
    r = ckptstore.Store(sys.argv[1]).push(sys.argv[2], "latest")
    print("won", r.commit)
except RefConflictError as exc:
    print("lost", exc)
"""


def test_four_pushers_race_on_one_tag_and_exactly_one_wins(tmp_path, url):
    """4 processes, each with its own commit on a common base, push to the same tag at
    once: one CAS lands, the three others get RefConflictError naming both commits."""
    base = ckptstore.Store(tmp_path / "base", create=True)
    base_id = base.commit(state(), tag="latest").id
    base.push(url, "latest")
    mine = []
    for w in range(4):
        s = ckptstore.Store(tmp_path / f"w{w}")
        s.pull(url, "latest")
        mine.append(s.commit(state(10 + w), tag="latest").id)
        s.close()
    go = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path / f"w{w}"), url, str(go)], stdout=subprocess.PIPE, text=True)
        for w in range(4)
    ]
    time.sleep(1.0)
    go.touch()
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    won = [w for w, o in enumerate(outs) if o.startswith("won")]
    assert len(won) == 1, outs
    winner = mine[won[0]]
    with open_backend(url) as b:
        assert read_tag(b, "latest")[0] == winner
    for w, o in enumerate(outs):
        if w != won[0]:
            assert o.startswith("lost") and f"names commit {winner}, which is not an ancestor of {mine[w]}" in o, o
    check = ckptstore.Store(tmp_path / "check")
    check.pull(url, "latest")
    assert [c.id for c in check.log("latest")] == [winner, base_id]


PUSHER = """
import sys, ckptstore
ckptstore.Store(sys.argv[1]).push(sys.argv[2], "latest")
"""


def assert_consistent(url: str, ids: list[str], allowed: tuple) -> str | None:
    """Every commit record under the prefix verifies and its blobs are indexed; the tag
    names one of ``allowed``; returns it."""
    with open_backend(url) as b:
        from ckptstore.objects.bucketformat import RemoteIndex

        index = RemoteIndex(b).refresh()
        for o in b.list("commits"):
            cid = o.key.rsplit("/", 1)[1]
            assert cid in ids
            rec = fetch_record(b, cid)
            assert all(k in index.blobs for leaf in rec.leaves for k in leaf.keys)
        tag = read_tag(b, "latest")[0]
        assert tag in allowed
        return tag


def test_push_killed_at_random_instants_leaves_the_remote_consistent(tmp_path, url):
    """Each round commits one more change (4 MiB, 4 % of it new) and SIGKILLs a pusher
    at a random instant: the remote's records all verify, their blobs are all indexed,
    and the tag names what it named before the round or the pushed commit."""
    seed = int(os.environ.get("CKPTSTORE_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (CKPTSTORE_SEED={seed} replays it)")
    rng = random.Random(seed)
    sd = state()
    sd["big"] = torch.randn(1 << 20, generator=torch.Generator().manual_seed(seed))
    ids: list[str] = []
    tag, interrupted = None, 0
    for k in range(10):  # an uninterrupted push of a round takes ~0.1-0.3 s here, its process starts in ~0.05 s
        sd["big"][k * 1000 : k * 1000 + 40000] += 1
        with ckptstore.Store(tmp_path / "local", create=True, shard_bytes=64 << 10) as local:
            ids.append(local.commit(sd, tag="latest").id)
        proc = subprocess.Popen([sys.executable, "-c", PUSHER, str(tmp_path / "local"), url], stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.02, 0.3))
        proc.send_signal(signal.SIGKILL)
        interrupted += proc.wait() == -signal.SIGKILL
        tag = assert_consistent(url, ids, (tag, ids[-1]))
    print(f"{interrupted} of 10 pushes killed before they finished")
    final = ckptstore.Store(tmp_path / "local").push(url, "latest")  # running it again completes
    assert assert_consistent(url, ids, (ids[-1],)) == ids[-1] and final.tag == "latest"
    other = ckptstore.Store(tmp_path / "other")
    other.pull(url, "latest")
    assert [c.id for c in other.log("latest")] == ids[::-1]
    assert_bit_equal(other.checkout("latest")["big"], sd["big"])
    assert other.fsck(deep=True).ok


def test_push_and_pull_through_a_failing_server(tmp_path, s3_server):
    """HTTP 500s before and after requests, and dropped responses, on every kind of request:
    the retries and the read-back settle them; a ref PUT that never lands is a BackendError
    that moves nothing, and running the push again completes."""
    prefix = f"f-{uuid.uuid4().hex[:12]}"
    url = f"s3://ckpt/{prefix}"
    local = ckptstore.Store(tmp_path / "local", create=True)
    sd = state()
    local.commit(sd, tag="latest")
    sd["w"][:40] += 1
    second = local.commit(sd, tag="latest")
    backend = S3Backend(url, retry_config=FAST_RETRIES)
    try:
        s3_server.set_faults([
            {"method": "PUT", "key": f"/{prefix}/blobs/", "action": "500-before", "count": 1},
            {"method": "PUT", "key": f"/{prefix}/blobs/", "action": "drop-after", "count": 1},
            {"method": "PUT", "key": f"/{prefix}/commits/", "action": "500-after", "count": 1},
            {"method": "GET", "key": f"/{prefix}/refs/latest", "action": "500-before", "count": 1},
            {"method": "PUT", "key": f"/{prefix}/refs/latest", "action": "drop-after", "count": 1},
        ])
        report = local.push(backend, "latest")
        assert s3_server.faults() == [] and report.commit == second.id
        assert read_tag(backend, "latest")[0] == second.id

        s3_server.set_faults([
            {"method": "GET", "key": f"/{prefix}/blobs/", "action": "500-before", "count": 2},
            {"method": "GET", "key": f"/{prefix}/commits/", "action": "drop-after", "count": 1},
        ])
        other = ckptstore.Store(tmp_path / "other")
        assert other.pull(backend, "latest").commits_copied == [c.id for c in reversed(local.log("latest"))]
        assert s3_server.faults() == []
        assert_bit_equal(other.checkout("latest")["w"], sd["w"])

        sd["w"][-40:] -= 1
        third = local.commit(sd, tag="latest")
        s3_server.set_faults([{"method": "PUT", "key": f"/{prefix}/refs/latest", "action": "500-before", "count": 100}])
        with pytest.raises(BackendError, match="did not move"):
            local.push(backend, "latest")
        s3_server.set_faults([])
        assert read_tag(backend, "latest")[0] == second.id  # no torn or half-moved ref
        report = local.push(backend, "latest")  # the rerun reuses what the failed push uploaded
        assert (report.commits_copied, report.blobs_copied, report.previous) == ([], 0, second.id)
        assert read_tag(backend, "latest")[0] == third.id
    finally:
        s3_server.set_faults([])
        backend.close()


def _pushed(tmp_path, url) -> tuple[ckptstore.Store, str]:
    local = ckptstore.Store(tmp_path / "local", create=True)
    cid = local.commit(state(), tag="latest").id
    local.push(url, "latest")
    return local, cid


def _victim(tmp_path) -> tuple[ckptstore.Store, dict]:
    victim = ckptstore.Store(tmp_path / "victim", create=True)
    victim.commit(state(7), tag="mine")
    return victim, row_count(victim)


def test_pull_refuses_a_record_that_does_not_hash_to_its_id(tmp_path, url):
    _, cid = _pushed(tmp_path, url)
    with open_backend(url) as b:
        text = b.get(commit_key(cid)).replace(b',"",', b',"forged",', 1)  # its message changed
        b.delete(commit_key(cid))
        b.put_new(commit_key(cid), text)
    victim, rows = _victim(tmp_path)
    with pytest.raises(IntegrityError, match=f"commits/{cid[:2]}/{cid}: the record does not hash to commit id {cid}"):
        victim.pull(url, "latest")
    assert row_count(victim) == rows and victim.tags() == {"mine": victim.tags()["mine"]}


def test_pull_refuses_an_index_that_lies(tmp_path, url):
    _, cid = _pushed(tmp_path, url)
    with open_backend(url) as b:
        key = next(o.key for o in b.list("blobs") if o.key.endswith(".idx"))
        pid = key.rsplit("/", 1)[1][:-4]
        entries = decode_index(b.get(key), pid)
        i, j = [n for n, e in enumerate(entries) if e.loc.raw_len == SHARD][:2]  # two 256 KiB shards: swap their hashes
        e0, e1 = entries[i], entries[j]
        entries[i] = Entry(dataclasses.replace(e0.loc, digest=e1.loc.digest), e0.kind, e0.magic)
        entries[j] = Entry(dataclasses.replace(e1.loc, digest=e0.loc.digest), e1.kind, e1.magic)
        b.delete(key)
        b.put_new(key, encode_index(entries))  # a well-formed index (its trailer fits) that lies
    victim, rows = _victim(tmp_path)
    with pytest.raises(BlobCorruptError, match=f"commit {cid}, pack {pid}, blob .*: the entry header does not match"):
        victim.pull(url, "latest")
    assert row_count(victim) == rows


def test_pull_refuses_a_ref_naming_a_missing_commit(tmp_path, url):
    _pushed(tmp_path, url)
    ghost = "ab" * 16
    with open_backend(url) as b:
        b.cas_ref("latest", json.dumps({"action": "push", "at": 0, "commit": ghost, "previous": None}).encode(), b.read_ref("latest").version)
    victim, rows = _victim(tmp_path)
    with pytest.raises(IntegrityError, match=f"commit {ghost} \\(named by tag 'latest'\\) is missing"):
        victim.pull(url, "latest")
    assert row_count(victim) == rows


def test_missing_bucket_and_prefix_without_a_store(tmp_path, s3_server):
    local = ckptstore.Store(tmp_path / "local", create=True)
    local.commit(state(), tag="latest")
    with pytest.raises(NotAStoreError, match="bucket 'nope' does not exist"):
        local.push("s3://nope/x", "latest")
    with pytest.raises(NotAStoreError, match="is not a ckptstore store \\(no ckptstore.json"):
        local.pull(f"s3://ckpt/empty-{uuid.uuid4().hex[:8]}", "latest")


def test_cli_push_and_pull_s3(tmp_path, url, monkeypatch, capsys):
    from tests.unit.top.test_cli import cli

    local = ckptstore.Store(tmp_path / "local", create=True)
    info = local.commit(state(), tag="latest")
    code, out, _ = cli(monkeypatch, capsys, "push", url, "latest", "--store", str(tmp_path / "local"))
    assert code == 0 and len(out.strip().splitlines()) == 1 and out.startswith(f"pushed {info.id[:12]}: 1 commit, 5 blobs")
    code, out, _ = cli(monkeypatch, capsys, "pull", url, "latest", "--store", str(tmp_path / "other"), "--json")
    assert code == 0 and json.loads(out)["commit"] == info.id
    ckptstore.Store(tmp_path / "other").commit(state(3), tag="latest")
    ckptstore.Store(tmp_path / "other").push(url, "latest")
    local.commit(state(4), tag="latest")
    code, out, err = cli(monkeypatch, capsys, "push", url, "latest", "--store", str(tmp_path / "local"))
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1 and "not an ancestor" in err
    code, out, err = cli(monkeypatch, capsys, "pull", "s3://nope/x", "latest", "--store", str(tmp_path / "local"))
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1 and "does not exist" in err


def test_push_and_pull_on_a_local_backend(tmp_path):
    """The same protocol on a plain folder through LocalBackend (no server)."""
    from ckptstore.backends import LocalBackend

    local = ckptstore.Store(tmp_path / "local", create=True)
    sd = state()
    info = local.commit(sd, tag="latest")
    with LocalBackend(tmp_path / "remote", create=True) as b:
        assert local.push(b, "latest").commits_copied == [info.id]
        assert local.push(b, "latest").objects_written == 0
        other = ckptstore.Store(tmp_path / "other")
        assert other.pull(b, "latest").commits_copied == [info.id]
    assert_bit_equal(other.checkout("latest")["w"], sd["w"])


def test_checkpointer_pushes_in_the_background(tmp_path, url):
    sd = state()
    ckpt = ckptstore.Checkpointer(tmp_path / "local", {"sd": sd}, every_n_steps=1, on_signal=(), push_to=url)
    ckpt.step()
    sd["w"][:40] += 1
    second = ckpt.step()
    report = ckpt.wait_pushed(timeout=60)
    assert report.commit == second.id and ckpt.push_error is None
    other = ckptstore.Store(tmp_path / "other")
    other.pull(url, "latest")
    assert other.tags() == {"latest": second.id}
    assert_bit_equal(other.checkout("latest")["sd", "w"], sd["w"])


def test_checkpointer_reports_a_failed_push_and_keeps_the_local_commit(tmp_path, s3_server):
    from ckptstore.errors import PushFailedWarning

    ckpt = ckptstore.Checkpointer(tmp_path / "local", {"sd": state()}, every_n_steps=1, on_signal=(),
                                  push_to="s3://nope/x", push_attempts=2, push_backoff=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = ckpt.step()  # the commit returns at once; the push fails in the background
        with pytest.raises(NotAStoreError, match="bucket 'nope' does not exist"):
            ckpt.wait_pushed(timeout=60)
    assert [w.category for w in caught] == [PushFailedWarning]
    assert str(caught[0].message).startswith("pushing 'latest' to s3://nope/x failed after 2 attempt(s): s3://nope/x: bucket 'nope' does not exist")
    assert isinstance(ckpt.push_error, NotAStoreError)
    assert ckptstore.Store(tmp_path / "local").tags()["latest"] == info.id


def test_pull_of_a_lineage_a_gc_shortened_before_the_push(tmp_path, url):
    local = ckptstore.Store(tmp_path / "local", create=True)
    for i in range(3):
        last = local.commit({"w": torch.full((4,), float(i))}, tag="latest")
    local.gc(keep_last=1, grace=0)  # drops the two older commits: the lineage ends at `last`
    assert [c.id for c in local.log("latest")] == [last.id]
    assert local.push(url, "latest").commits_copied == [last.id]
    other = ckptstore.Store(tmp_path / "other", create=True)
    assert other.pull(url, "latest").commits_copied == [last.id]
    assert_bit_equal(other.checkout("latest")["w"], torch.full((4,), 2.0))
