"""``Store("s3://…")`` (a store whose home is a ckptstore.home.bucket.BucketHome) against a real moto S3 server:
processes racing on one tag, writers and GCs SIGKILLed at random instants, GC beside
a writer, a server failing requests, and hostile objects on the bucket.

Every state a worker commits is a pure function of its commit's metadata
(tests/unit/home/bucket_workers.py: ``state``), so what a tag must check out to is known from
the commit id it names. Random choices print their seed (``CKPTSTORE_SEED=<n>``
replays one)."""

from __future__ import annotations

import itertools
import os
import random
import signal
import time
import uuid
from datetime import timedelta

import pytest

import ckptstore
from ckptstore.home.bucket import BucketHome

from tests.unit.home import bucket_workers
from tests.conftest import assert_bit_equal


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
        for cid, i, _ in results:
            made[cid] = {"w": w, "i": int(i), "n": 16, "alt": 0}
    assert len(made) == 80

    store = ckptstore.Store(url)
    assert type(store) is ckptstore.Store and isinstance(store.home, BucketHome)
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
    # one chain: each commit's only parent is the commit the tag named before its move, and
    # log (newest first by creation time) lists the chain in order: a record is dated when built on its parent
    log = store.log("latest")
    assert {c.id: c.parents for c in log} == {m["new_commit"]: (m["old_commit"],) if m["old_commit"] else () for m in moves}
    assert [c.id for c in log] == [m["new_commit"] for m in moves][::-1]
    store.close()


# --- 2. writers and GCs SIGKILLed at random instants -----------------------------------------------


def _check_tags(store: ckptstore.Store, writers: dict, seed: int, why: str) -> dict:
    """Every tag names a commit of the writer that moves it, at least the last one that
    writer saw return (or the next, if it died between its CAS and its report), and
    checks out bit-exactly to the state of that commit's metadata. ``writers``: tag ->
    (writer, last step that returned or -1, last step started). Returns {tag: step}."""
    tags = store.tags()
    out = {}
    for tag, (w, done, started) in writers.items():
        if done < 0 and tag not in tags:
            continue
        cid = tags[tag]
        meta = store.info(cid).metadata
        assert meta["w"] == w and done <= meta["i"] <= started, f"seed {seed}: {why}: tag {tag} names step {meta['i']} of writer " \
            f"{meta['w']}; writer {w} last returned step {done} and started {started}"
        _assert_state(store.checkout(tag), meta, f"seed {seed}: {why}: tag {tag}")
        out[tag] = meta["i"]
    return out


def _progress(log: str, first: int, seed: int) -> tuple[int | None, int]:
    """(last step that returned or None, last step started) from the log of a writer
    that started at step ``first``; any line but a returned commit fails the test."""
    lines = bucket_workers.read_log(log)[1:]
    assert all(len(line.split()[0]) == 32 for line in lines), f"seed {seed}: {[line for line in lines if len(line.split()[0]) != 32]}"
    done = [int(line.split()[1]) for line in lines]
    return (done[-1] if done else None), (done[-1] + 1 if done else first)


def _run_and_kill(procs: dict, logs: dict, rng: random.Random, low: float, high: float) -> None:
    """Start ``procs``; once each says ``ready``, SIGKILL them in a random order, the first
    ``low`` to ``high`` seconds later, the others up to 0.15 s apart."""
    for p in procs.values():
        p.start()
    deadline = time.monotonic() + 60
    while not all(bucket_workers.read_log(logs[name])[:1] == ["ready"] for name in procs):
        assert time.monotonic() < deadline and all(p.is_alive() for p in procs.values()), {k: bucket_workers.read_log(logs[k]) for k in procs}
        time.sleep(0.01)
    time.sleep(rng.uniform(low, high))
    for name in rng.sample(sorted(procs), len(procs)):
        time.sleep(rng.uniform(0, 0.15))
        procs[name].kill()
        procs[name].join(30)
        assert procs[name].exitcode == -signal.SIGKILL, (name, procs[name].exitcode, bucket_workers.read_log(logs[name])[-2:])


def test_writers_and_gcs_killed_at_random_instants_lose_nothing_a_tag_holds(tmp_path, url):
    """10 rounds: two writers (tags ``a`` and ``b``; 256 KiB of new floats a commit and a
    256 KiB blob reused from an older commit) are SIGKILLed at random instants (mid-upload,
    mid-CAS...), and so is a GC looping ``gc(keep_last=1)`` (mid-mark, mid-sweep...): with a
    grace period of 0.5 s beside the writers (3 such rounds in a row, so the third one
    sweeps what the second marked); with grace 0 once they are dead (a grace period of 0
    marks and sweeps in one run, so it may delete the pack of a commit in flight:
    docs/design.md, "GC on object storage"). After each round: fsck(deep) finds nothing,
    every tag names a commit of its writer no older than the last one that returned and
    checks out bit-exactly; after a grace-0 round, a gc(grace=0) collects what the killed
    ones left, and all of that holds again. The next round's writers go on from there."""
    seed = _seed()
    rng = random.Random(seed)
    ctx = bucket_workers.context()
    store = ckptstore.Store(url)
    base = {"w": 2, "i": 0, "n": 1 << 16, "alt": 1}
    store.commit(bucket_workers.state(base), tag="base", metadata=base)  # a tag no one moves, sharing blobs with no one
    writers = {"a": (0, -1, 0), "b": (1, -1, 0), "base": (2, 0, 0)}
    steps = {"a": 0, "b": 0}
    kills = []
    for r in range(10):
        grace = 0.0 if r % 4 == 3 else 0.5  # 3 rounds of grace 0.5 s in a row: the third sweeps what the second marked
        logs = {t: str(tmp_path / f"r{r}-{t}.log") for t in steps} | {"gc": str(tmp_path / f"r{r}-gc.log")}
        # the GC shares this process's cache, which the checks keep up to date: it starts with every record cached
        gc = ctx.Process(target=bucket_workers.collector, args=(_env(os.environ["XDG_CACHE_HOME"]), url, grace, 1, logs["gc"]))
        procs = {t: ctx.Process(target=bucket_workers.writer, args=(_env(tmp_path / f"cache-{t}"), url, t, w, steps[t], None, 1 << 16, 1, logs[t], 0.25))
                 for t, (w, _, _) in writers.items() if t in steps}
        _run_and_kill(procs | ({"gc": gc} if grace else {}), logs, rng, 0.3, 1.2)
        if not grace:
            _run_and_kill({"gc": gc}, logs, rng, 0.0, 1.0)
        for t, first in steps.items():
            done, started = _progress(logs[t], first, seed)
            writers[t] = (writers[t][0], writers[t][1] if done is None else done, started)  # it may have landed `started` unseen
            steps[t] = started + 1
        runs = [line.split() for line in bucket_workers.read_log(logs["gc"])[1:]]
        kills.append(f"round {r}: grace {grace}, steps {[writers[t][1] for t in steps]}, {len(runs)} gc runs, "
                     f"{sum(int(x[2]) for x in runs)} packs deleted")
        why = f"round {r} (grace {grace})"
        report = store.fsck(deep=True)
        assert report.ok, f"seed {seed}: {why}: {report.problems}"
        _check_tags(store, writers, seed, why)
        if not grace:  # a last GC collects what the killed ones left: the next round's GC has little to read
            store.gc(grace=0, keep_last=1)
            report = store.fsck(deep=True)
            assert report.ok, f"seed {seed}: {why}, after a gc: {report.problems}"
            assert len(store.log()) == len(_check_tags(store, writers, seed, f"{why}, after a gc"))
    print("\n".join(kills))
    _check_tags(_fresh(url, tmp_path), writers, seed, "from a cold cache")
    store.close()


# --- 3. GC beside a writer --------------------------------------------------------------------------


def _sleep_past(mtime: float, grace: float) -> None:
    """Wait until an object of server time ``mtime`` is older than ``grace`` by the server's clock, read in whole
    seconds (the GC reads "now" as a probe object's time: up to a second behind) and a whole second more (the step
    of the object's own time)."""
    time.sleep(max(0.0, mtime + grace + 2.05 - time.time()))


def test_a_blob_in_a_marked_pack_is_written_again_and_survives_the_sweep(tmp_path, url):
    """Commit A; drop its tag; a GC marks its pack (grace 1 s: not swept in that run);
    committing A's state again under a new tag writes every blob again (a reused blob
    in a marked pack is never relied on); the sweep a grace period later deletes the old
    pack and record, and the new tag checks out bit-exactly, from a cold cache too."""
    from ckptstore.backends import open_backend
    from ckptstore.objects.bucketformat import commit_key

    grace = 1.0
    meta = {"w": 3, "i": 0, "n": 4096, "alt": 1}
    s = ckptstore.Store(url)
    a = s.commit(bucket_workers.state(meta), tag="t1", metadata=meta)
    b = open_backend(url)
    (old_pack,) = [o for o in b.list("blobs") if o.key.endswith(".pack")]
    s.delete_tag("t1")
    _sleep_past(old_pack.mtime, grace)
    first = s.gc(grace=grace, keep_last=1)
    (mark,) = b.list("gc")
    assert first.packs_deleted == 0 and first.commits_dropped == 0
    waiting = old_pack.size + b.head(old_pack.key[:-5] + ".idx").size + b.head(commit_key(a.id)).size  # marked: pending the grace period
    assert (first.commits_pending, first.blobs_pending, first.bytes_pending) == (1, 3, waiting)
    assert b.head(old_pack.key) is not None and b.head(commit_key(a.id)) is not None
    again = s.commit(bucket_workers.state(meta), tag="t2", metadata=meta)
    assert again.id != a.id and (again.shards_new, again.shards_total) == (3, 3)  # own, step, base: all written again
    packs = [o.key for o in b.list("blobs") if o.key.endswith(".pack")]
    assert len(packs) == 2 and old_pack.key in packs
    _sleep_past(mark.mtime, grace)
    second = s.gc(grace=grace, keep_last=1)
    assert second.packs_deleted == 1 and second.dropped == [a.id]
    assert b.head(old_pack.key) is None and b.head(commit_key(a.id)) is None and b.head(mark.key) is None
    for store in (s, _fresh(url, tmp_path)):
        assert store.tags() == {"t2": again.id}
        _assert_state(store.checkout("t2"), meta, "the commit that wrote the marked blobs again")
        assert store.fsck(deep=True).ok
    b.close()
    s.close()


def test_grace_counts_from_the_write_not_from_the_servers_whole_second(tmp_path, url):
    """S3 (and moto) give object times in whole seconds: an object written at x.5 reads as
    written at x.0. Half a second later (at x+1.05), under a grace period of 1 s, a pack
    no commit uses is not dead yet and a GC mark is not old enough to sweep: the grace
    period is never cut short by the clock's step. Once it has passed, both go.

    The scenario needs its writes inside one second and its first GC to read the clock
    before x+2 (after that the pack is truly older than the grace period); on a machine too
    loaded for that it runs again on a fresh prefix (at most 4 times), and says so."""
    for attempt in range(4):
        if _grace_scenario(f"{url}/attempt-{attempt}"):
            return
        print(f"attempt {attempt}: the machine was too slow for the scenario's timing; again on a fresh prefix")
    pytest.skip("the machine was too slow 4 times for this timing scenario (no GC outcome was checked)")


def _grace_scenario(url: str) -> bool:
    """One run of the scenario above; False if the machine was too slow for its timing (nothing asserted)."""
    import json

    from ckptstore.backends import open_backend
    from ckptstore.objects.packindex import pack_key

    meta = {"w": 6, "i": 0, "n": 16, "alt": 0}
    with ckptstore.Store(url) as s, open_backend(url) as b:
        s.commit(bucket_workers.state(meta), tag="t", metadata=meta)  # makes the store
        time.sleep(1.5 - time.time() % 1)  # x.5
        before = time.time()
        writer = s.pack_writer()  # a pack whose writer died before its commit: no record uses it
        writer.append(memoryview(b"orphan" * 100))
        writer.finish()
        (pid, _), = writer.pack_ids
        mark = f"gc/{time.time_ns():020d}-{uuid.uuid4().hex}.json"
        b.put_new(mark, json.dumps({"at": time.time(), "commits": [], "objects": [], "packs": [pid]}).encode())
        after = time.time()
        if int(after) != int(before):
            return False  # the writes straddled a second
        assert b.head(pack_key(pid)).mtime == b.head(mark).mtime == int(before)
        time.sleep(max(0.0, int(before) + 1.05 - time.time()))
        dry = s.gc(grace=1.0, dry_run=True)
        report = s.gc(grace=1.0)
        if time.time() >= int(before) + 2:
            return False  # a GC may have read the clock once the pack was truly older than the grace period
        assert dry.packs_deleted == 0  # the pack is at most 1.5 s old by the server's clock, its time says 1 to 2 s
        assert report.packs_deleted == 0 and b.head(pack_key(pid)) is not None and b.head(mark) is not None
        time.sleep(max(0.0, int(before) + 2.1 - time.time()))
        report = s.gc(grace=1.0)
        assert report.packs_deleted == 1 and b.head(pack_key(pid)) is None and b.head(mark) is None
        _assert_state(s.checkout("t"), meta, "the tag beside them")
    return True


def test_a_pack_stays_while_a_record_that_needs_it_stays(tmp_path, url):
    """A record that is on the bucket but not yet old enough to mark (here: rewritten
    late, as by a writer whose CAS retried past the grace period, or whose pack and record
    straddled the GC's cutoff) keeps its pack: the GC marks the pack only with the record,
    and sweeps both together. fsck finds nothing at every step."""
    import json

    from ckptstore.backends import open_backend
    from ckptstore.objects.bucketformat import commit_key

    grace = 0.5
    meta = {"w": 7, "i": 0, "n": 4096, "alt": 0}
    s = ckptstore.Store(url)
    a = s.commit(bucket_workers.state(meta), tag="t", metadata=meta)
    s.delete_tag("t")
    b = open_backend(url)
    (pack,) = [o for o in b.list("blobs") if o.key.endswith(".pack")]
    _sleep_past(max(o.mtime for o in [pack, *b.list("reflog")]), grace)  # (the tag moves may be a second younger)
    text = b.get(commit_key(a.id))
    b.delete(commit_key(a.id))
    b.put_new(commit_key(a.id), text)  # the record, written again now: young, though its commit is old
    s.gc(grace=grace, keep_last=1)
    marks = [json.loads(b.get(o.key)) for o in b.list("gc")]
    assert [m for m in marks if m["packs"] or m["commits"]] == [], "a pack was marked while a record that needs it stays"
    assert [sorted(k for k, _, _ in m["reflog"]) for m in marks] == [sorted(o.key for o in b.list("reflog"))]  # both moves: their commit is dropped
    assert s.fsck(deep=True).ok
    _sleep_past(b.head(commit_key(a.id)).mtime, grace)
    second = s.gc(grace=grace, keep_last=1)  # now both are old: marked together (the first run's mark of the reflog may be swept)
    marks = [json.loads(b.get(o.key)) for o in b.list("gc")]
    assert [(m["commits"], m["packs"]) for m in marks if m["packs"] or m["commits"]] == [([a.id], [pack.key.rsplit("/", 1)[1][:-5]])]
    assert s.fsck(deep=True).ok
    _sleep_past(max(o.mtime for o in b.list("gc")), grace)
    report = s.gc(grace=grace, keep_last=1)
    assert report.dropped == [a.id] and report.packs_deleted == 1 and b.list("blobs") == [] and b.list("commits") == []
    # retention governs the reflog: no commit left to tell of (each object counted once, by the run that deleted it)
    assert second.reflog_removed + report.reflog_removed == 2 and b.list("reflog") == []
    assert s.fsck(deep=True).ok
    b.close()
    s.close()


def test_gc_beside_a_writer_that_reuses_old_blobs(tmp_path, url):
    """A writer commits 60 states (pausing 60 ms after each, so that it outlasts the first
    sweeps even on an idle machine), each with new floats and one of two
    64 KiB blobs in turn (so it keeps reusing blobs from older packs that GC marks once
    the tag names the other one), while this process runs gc(grace=0.5 s, keep_last=1)
    again and again (a grace period and the server clock's 1 s step: the sweeps start
    3 s in). Then the tag names the writer's last commit, it checks out bit-exactly,
    fsck finds nothing, and a final GC leaves only that commit."""
    ctx = bucket_workers.context()
    log = str(tmp_path / "writer.log")
    p = ctx.Process(target=bucket_workers.writer, args=(_env(tmp_path / "cache-w"), url, "live", 4, 0, 60, 1 << 14, 1, log, 0.06))
    p.start()
    store = ckptstore.Store(url)
    runs, dropped, deleted = 0, 0, 0
    while p.is_alive():
        if bucket_workers.read_log(log)[1:2]:  # the first commit made the store
            r = store.gc(grace=0.5, keep_last=1)
            runs, dropped, deleted = runs + 1, dropped + r.commits_dropped, deleted + r.packs_deleted
        time.sleep(0.05)
    p.join()
    assert p.exitcode == 0, bucket_workers.read_log(log)[-3:]
    results = [line.split() for line in bucket_workers.read_log(log)[1:-1]]
    assert [int(r[1]) for r in results] == list(range(60)), results
    fewest = min(int(r[2]) for r in results)  # new floats and step; more: a reused blob was written again
    rewritten = [int(r[1]) for r in results if int(r[1]) >= 2 and int(r[2]) > fewest]
    print(f"{runs} gc runs beside the writer: {dropped} commits dropped, {deleted} packs deleted; "
          f"commits that wrote a reused blob again: {rewritten}")
    assert dropped > 0 and deleted > 0  # the sweeps ran beside the writer
    last = {"w": 4, "i": 59, "n": 1 << 14, "alt": 1}
    assert store.tags() == {"live": results[-1][0]}
    _assert_state(store.checkout("live"), last, "the writer's last commit")
    assert store.fsck(deep=True).ok
    store.gc(grace=0, keep_last=1)
    cold = _fresh(url, tmp_path)
    assert [c.id for c in cold.log()] == [results[-1][0]]
    _assert_state(cold.checkout("live"), last, "after the last gc, from a cold cache")
    assert cold.fsck(deep=True).ok
    store.close()


# --- 4. a server that fails requests ----------------------------------------------------------------

FAST_RETRIES = {"max_retries": 3, "backoff": {"init_backoff": timedelta(milliseconds=10), "max_backoff": timedelta(milliseconds=50), "base": 2}}


def _faults(rng: random.Random, prefix: str) -> list[dict]:
    """1 to 3 random fault rules on the requests of a commit or a checkout under ``prefix``:
    counts up to 3 are ridden out by the retries (3), more fail the call."""
    areas = [("PUT", "blobs/"), ("PUT", "commits/"), ("PUT", "refs/latest"), ("PUT", "reflog/"), ("PUT", "ckptstore.json"),
             ("GET", "refs/latest"), ("GET", "blobs/"), ("GET", "commits/"), ("GET", "gc/"), ("HEAD", "blobs/"), ("HEAD", "commits/")]
    rules = []
    for _ in range(rng.randint(1, 3)):
        method, key = rng.choice([*areas, ("GET", "")])  # GET "": any GET, listings included
        key = f"/{prefix}/{key}" if key else "/ckpt"
        rules.append({"method": method, "key": key, "action": rng.choice(["500-before", "500-after", "drop-after"]),
                      "count": rng.choice([1, 1, 1, 2, 3, 8])})
    return rules


def test_commits_and_checkouts_through_a_failing_server(tmp_path, url, s3_server):
    """Each round commits state k under random faults (HTTP 500 before or after doing the
    request, dropped responses), then checks ``latest`` out under others, by a warm and
    a cold cache: every call returns right or raises a ckptstore error; a checkout that
    returns holds exactly the state of a commit the tag may name (the last one that
    returned, or a later one whose call failed after its CAS). With the faults off the
    tag names a whole commit, it checks out bit-exactly and fsck finds nothing."""
    from ckptstore.backends import S3Backend
    from ckptstore.errors import CkptStoreError

    seed = _seed()
    rng = random.Random(seed)
    prefix = url.split("/", 3)[3]
    store = ckptstore.Store(url, backend=S3Backend(url, retry_config=FAST_RETRIES), cache=tmp_path / "warm")
    last_ok, failures, reads = -1, [], 0

    def meta(k: int) -> dict:
        return {"w": 5, "i": k, "n": 2048, "alt": 1}

    def attempt(what: str, call):
        try:
            return call()
        except CkptStoreError as exc:
            failures.append(f"{what}: {type(exc).__name__}")
            return None
        except Exception as exc:  # a raw error escaped: the test's point
            raise AssertionError(f"seed {seed}: {what} raised {type(exc).__name__}, not a ckptstore error: {exc}") from exc

    def cold_checkout(k: int):
        """Open a store with a new cache (faults may hit that too) and check out."""
        with ckptstore.Store(url, backend=S3Backend(url, retry_config=FAST_RETRIES), cache=tmp_path / f"cold{k}") as reader:
            return reader.checkout("latest")

    try:
        for k in range(12):
            s3_server.set_faults(_faults(rng, prefix))
            if attempt(f"commit {k}", lambda k=k: store.commit(bucket_workers.state(meta(k)), tag="latest", metadata=meta(k))) is not None:
                last_ok = k
            for cold in (False, True):
                s3_server.set_faults(_faults(rng, prefix))
                got = attempt(f"checkout {k} ({'cold' if cold else 'warm'})", lambda k=k, cold=cold: cold_checkout(k) if cold else store.checkout("latest"))
                if got is not None:
                    j = int(got["step"][1])
                    assert last_ok <= j <= k, f"seed {seed}: round {k}: latest checks out to commit {j}, last returned {last_ok}"
                    _assert_state(got, meta(j), f"seed {seed}: round {k}: checkout of commit {j}")
                    reads += 1
    finally:
        s3_server.set_faults([])
    print(f"{12 - sum(f.startswith('commit') for f in failures)} of 12 commits and {reads} of 24 checkouts returned; failed: {failures}")
    check = _fresh(url, tmp_path)
    tags = check.tags()
    if last_ok >= 0 or tags:
        cid = tags["latest"]
        j = check.info(cid).metadata["i"]
        assert j >= last_ok, f"seed {seed}: the tag names commit {j}, an older one than the last that returned ({last_ok})"
        _assert_state(check.checkout("latest"), meta(j), f"seed {seed}: the final tag")
    report = check.fsck(deep=True)
    assert report.ok, f"seed {seed}: {report.problems}"
    info = store.commit(bucket_workers.state(meta(12)), tag="latest", metadata=meta(12))  # the faulted store works on
    assert info.parents == ((tags["latest"],) if tags else ())
    _assert_state(check.checkout("latest"), meta(12), f"seed {seed}: a commit after the faults")
    store.close()


# --- 5. hostile objects on the bucket -------------------------------------------------------------


def _raw_put(url: str, key: str, data: bytes) -> None:
    """Overwrite object ``key`` under ``url`` behind ckptstore's back (obstore, unconditional PUT)."""
    import obstore
    from obstore.store import S3Store

    from ckptstore.backends.s3 import parse_s3_url

    bucket, prefix = parse_s3_url(url)
    obstore.put(S3Store(bucket, prefix=prefix), key, data)


def _fresh(url: str, tmp_path) -> ckptstore.Store:
    """A store on ``url`` with an empty cache of its own (a machine that never saw it)."""
    return ckptstore.Store(url, cache=tmp_path / f"cache-{uuid.uuid4().hex[:8]}")


def _committed(url: str, tmp_path, n: int = 4096) -> tuple[str, dict]:
    meta = {"w": 9, "i": 0, "n": n, "alt": 1}
    with ckptstore.Store(url, cache=tmp_path / "writer-cache") as s:
        return s.commit(bucket_workers.state(meta), tag="latest", metadata=meta).id, meta


def test_a_tag_naming_a_missing_or_forged_record_is_an_integrity_error(tmp_path, url):
    from ckptstore.backends import open_backend
    from ckptstore.errors import IntegrityError
    from ckptstore.objects.bucketformat import commit_key, ref_payload

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
    from ckptstore.objects.packindex import decode_index, index_key, pack_key
    from ckptstore.objects.packs import BLOB_HEADER

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


def test_a_damaged_or_missing_index_affects_only_its_pack_and_is_repaired_from_the_pack(tmp_path, url):
    """A pack's ``.idx`` flipped, replaced by junk or deleted (the pack intact): from a cold
    cache the tag checks out exactly (the pack is walked instead), a commit of unrelated
    data to a new tag works, shallow fsck passes, deep fsck names the index (from a warm
    cache too: it reads the bucket, not the cache; a missing one is listed, not a problem), and ``fsck --repair`` rebuilds it from
    the pack, byte for byte as it was written."""
    from ckptstore.backends import open_backend
    from ckptstore.objects.packindex import index_key

    _, meta = _committed(url, tmp_path)
    with open_backend(url) as b:
        (key,) = [o.key for o in b.list("blobs") if o.key.endswith(".idx")]
        good = b.get(key)
    pid = key.rsplit("/", 1)[1][:-4]
    flipped = bytearray(good)
    flipped[20] ^= 0xFF
    warm = ckptstore.Store(url, cache=tmp_path / "writer-cache")
    for n, damage in enumerate((bytes(flipped), b"not an index", None)):
        with open_backend(url) as b:
            b.delete(key)
            if damage is not None:
                _raw_put(url, key, damage)
        s = _fresh(url, tmp_path)
        _assert_state(s.checkout("latest"), meta, f"damage {n}: the pack walked instead of its index")
        other = {"w": 5, "i": n, "n": 512, "alt": 0}
        s.commit(bucket_workers.state(other), tag=f"other-{n}", metadata=other)
        assert s.fsck().ok
        for who in (s, warm):
            report = who.fsck(deep=True)
            if damage is None:  # a missing index loses nothing (a writer killed between pack and index leaves one): listed
                assert report.ok and report.missing_indexes == [pid] and report.damaged_indexes == [], report
                continue
            assert not report.ok and report.damaged_indexes == [pid] and report.damaged_commits == [], report
            assert len(report.problems) == 1 and key in report.problems[0]
        report = s.fsck(repair=True)
        assert report.repaired == [index_key(pid)] and report.ok, report
        with open_backend(url) as b:
            assert b.get(key) == good
        assert _fresh(url, tmp_path).fsck(deep=True).ok
        s.close()
    warm.close()


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


def test_recover_rebuilds_the_cache_and_names_what_the_bucket_cannot_give_back(url, tmp_path, monkeypatch, capsys):
    """``Store.recover("s3://…")``: a damaged ``.idx`` is rebuilt from its pack (and the
    commit comes back); a deleted pack and a damaged record each lose their commit and the
    tag naming it, named in the report; the CLI exits 1 with one line on stderr."""
    import torch

    from ckptstore.objects.packindex import decode_index, index_key, pack_key

    from tests.unit.top.test_cli import cli

    s = ckptstore.Store(url)
    ids = [s.commit({"w": torch.full((1000,), float(i))}, tag=tag).id for i, tag in enumerate("abc")]
    pack = {c: next(iter({loc.pack for loc in s.locate([k for leaf in s.record(c).leaves for k in leaf.keys]).values()})) for c in ids}
    sizes = {o.key: o.size for o in s.backend.list("blobs")}
    _raw_put(url, index_key(pack[ids[0]]), b"not an index")
    s.backend.delete(pack_key(pack[ids[1]]))
    _raw_put(url, f"commits/{ids[2][:2]}/{ids[2]}", b'["damaged"]')
    s.close()
    report = ckptstore.Store.recover(url)
    assert (report.ok, report.installed, report.commits, report.blobs, report.packs, report.bad_records) == (False, True, 1, 2, 2, 1)
    assert report.repaired == [index_key(pack[ids[0]])] and report.incomplete_commits == [ids[1]]
    assert report.tags == {"a": ids[0]} and sorted(report.dropped_tags) == ["b", "c"] and sorted(report.dropped_commits) == sorted(ids[1:])
    assert "1 of its blobs are in no readable pack" in report.dropped_commits[ids[1]]
    assert "does not hash to commit id" in report.dropped_commits[ids[2]]
    assert len(report.lost()) == 4
    with ckptstore.Store(url) as again:
        raw = again.backend.get(index_key(pack[ids[0]]))
        assert len(decode_index(raw, pack[ids[0]], sizes[pack_key(pack[ids[0]])], "idx")) == 1  # its one blob, walked from the pack
        assert_bit_equal(again.checkout("a")["w"], torch.full((1000,), 0.0))
    _raw_put(url, index_key(pack[ids[0]]), b"not an index")
    code, out, err = cli(monkeypatch, capsys, "recover", "--store", url)
    assert code == 1 and "recovered 1 commit, 1 tag" in out and f"tag c: it names commit {ids[2]}" in out
    assert f"rewritten on the bucket (1):\n  {index_key(pack[ids[0]])}\n" in out  # the one write recover makes is said
    assert err.strip().splitlines() == [
        "error: recover could not restore 2 tag(s) and 2 commit(s) the packs hold (0 unreadable pack(s) or record(s)); see the list above"
    ]
    with pytest.raises(ckptstore.errors.NotAStoreError):
        ckptstore.Store.recover(f"s3://ckpt/empty-{uuid.uuid4().hex[:8]}")
    with pytest.raises(ckptstore.errors.InvalidArgumentError, match="unsupported store location"):
        ckptstore.Store.recover("gs://ckpt/x")
