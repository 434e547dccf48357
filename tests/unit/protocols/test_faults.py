"""Fault injection with real processes: SIGKILL during commits, exports and GC,
concurrent writers beside a GC loop, and a full disk.

Children are forked from the test process (imports already done) and killed
with SIGKILL at random moments; the store is then reopened and checked.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

import pytest
import torch
import xxhash
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer

import ckptstore
from ckptstore.errors import GCLockedError, StoreWriteError

from tests.conftest import assert_bit_equal

SHARD = 16 << 10
TRIALS = int(os.environ.get("CKPTSTORE_CRASH_TRIALS", "30"))


def fork(fn, *args) -> int:
    """Run ``fn(*args)`` in a forked child; the child exits 0, or 1 on an exception."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 0
        try:
            torch.set_num_threads(1)
            fn(*args)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def wait_ok(pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def digest(state) -> str:
    """One hash over every leaf (path, dtype, shape, bytes) of a checked-out TensorDict."""
    h = xxhash.xxh3_128()
    for key in sorted(state.keys(include_nested=True, leaves_only=True), key=str):
        t = state[key].contiguous()
        h.update(f"{key}{t.dtype}{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# --- a changing replay buffer, rebuilt directly from its step number -------------------


def loop_state(k: int) -> dict:
    """Step ``k``: 20 chunks of 200 rows; chunk j changes every j+1 steps, so commits dedup partly."""
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(4000), batch_size=8)
    for j in range(20):
        g = torch.Generator().manual_seed(1000 * j + k // (j + 1))
        rb.extend(TensorDict({"obs": torch.randn(200, 256, generator=g), "act": torch.randint(0, 4, (200,), generator=g)}, [200]))
    net = torch.nn.Linear(64, 64)
    g = torch.Generator().manual_seed(k)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return {"rb": rb, "net": net}


def commit_loop(path: Path, start: int, log: Path) -> None:
    store = ckptstore.Store(path)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for k in itertools.count(start):
        info = store.commit(loop_state(k), tag="latest", metadata={"step": k})
        os.write(fd, f"{k} {info.id}\n".encode())


def check_latest(store: ckptstore.Store, allowed: set[int]) -> int:
    step = store.info("latest").metadata["step"]
    assert step in allowed, (step, allowed)
    target = loop_state(999_999)  # fresh objects, different content
    store.checkout("latest", into=target)
    expected = loop_state(step)
    assert_bit_equal(target["rb"].storage._storage["obs"], expected["rb"].storage._storage["obs"])
    assert_bit_equal(target["rb"].storage._storage["act"], expected["rb"].storage._storage["act"])
    assert_bit_equal(target["net"].weight, expected["net"].weight)
    assert target["rb"].writer._write_count == 4000
    return step


def test_sigkill_during_commit_loop(tmp_path):
    path, log = tmp_path / "s", tmp_path / "log"
    with ckptstore.Store(path, shard_bytes=SHARD) as s:
        s.commit(loop_state(0), tag="latest", metadata={"step": 0})
    rng = random.Random(7)
    last, made, wanted = 0, 0, 0
    for trial in range(TRIALS):
        pid = fork(commit_loop, path, last + 1, log)
        # the kill lands after 0 to 2 acknowledged commits of this child, then a random instant into the
        # next one: counted in the child's own commits, not in seconds, so a loaded machine kills as late
        want = rng.choice([0, 1, 1, 2])
        wanted += want
        deadline = time.monotonic() + 120
        while want and time.monotonic() < deadline and (not log.exists() or log.read_text().count("\n") < want):
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.15))
        kill(pid)
        logged = [int(line.split()[0]) for line in log.read_text().splitlines()] if log.exists() else []
        done = max([last, *logged])
        made += len(logged)
        log.unlink(missing_ok=True)
        with ckptstore.Store(path) as s:
            report = s.fsck(deep=True)
            assert report.ok, report.problems  # orphans are allowed, nothing else
            step = check_latest(s, {done, done + 1})  # the old commit or the new one, never a mix
            previous = s.resolve("latest")
            assert s.commit(loop_state(step + 1), tag="latest", metadata={"step": step + 1}).parents == (previous,)
            last = step + 1
            if trial % 10 == 9:
                s.gc(grace=0)
                report = s.fsck(deep=True)
                assert report.ok and report.orphan_packs == [] and report.tmp_files == 0
    assert made >= wanted > TRIALS // 2  # kills landed after many completed commits, not only at start-up


# --- C21: the whole training state, killed mid-commit and mid-export --------------------


def c21_state(seed: int, scratch: Path) -> dict:
    scratch = scratch / uuid.uuid4().hex  # memory-mapped files of a fresh buffer
    torch.manual_seed(seed)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(8, 256)).pow(2).mean().backward()
    opt.step()
    rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(10_000, scratch_dir=scratch), batch_size=8)
    rb.extend(TensorDict({"obs": torch.randn(10_000, 64)}, [10_000]))
    return {"net": net, "opt": opt, "rb": rb}


def c21_child(path: Path, scratch: Path, ready: int, export_to: Path | None) -> None:
    state = c21_state(2, scratch)
    store = ckptstore.Store(path)
    os.write(ready, b"x")
    store.commit(state, tag="latest")
    if export_to is not None:
        store.export("latest", export_to)


def test_c21_sigkill_mid_commit_and_mid_export(tmp_path):
    path = tmp_path / "s"
    with ckptstore.Store(path) as s:
        v1 = s.commit(c21_state(1, tmp_path / "m1"), tag="latest")
        ref = {1: digest(s.checkout("latest"))}
        t0 = time.perf_counter()
        s.commit(c21_state(2, tmp_path / "m2"), tag="v2-probe")
        duration = time.perf_counter() - t0 + 0.05
        ref[2] = digest(s.checkout("v2-probe"))
        s.delete_tag("v2-probe")
        s.gc(grace=0)
    assert ref[1] != ref[2] and v1.logical_bytes > 5_000_000
    rng = random.Random(21)
    seen = set()
    for trial in range(25):
        export_to = tmp_path / f"export-{trial}.zip" if trial % 5 == 4 else None
        r, w = os.pipe()
        pid = fork(c21_child, path, tmp_path / f"m-{trial}", w, export_to)
        os.close(w)
        os.read(r, 1)  # the child is about to commit
        os.close(r)
        time.sleep(rng.uniform(0, duration * (3 if export_to else 1.2)))
        kill(pid)
        with ckptstore.Store(path) as s:
            state = digest(s.checkout("latest"))
            assert state in (ref[1], ref[2])
            seen.add(state)
            assert s.verify("latest").ok
            if export_to is not None and export_to.exists():  # an export appears whole or not at all
                with ckptstore.Store(tmp_path / f"import-{trial}") as other:
                    assert digest(other.checkout(other.import_from(export_to).id)) == ref[2]
            s.commit(c21_state(1, tmp_path / "m1"), tag="latest")  # back to v1: the next commit works
            s.gc(grace=0)
            report = s.fsck(deep=True)
            assert report.ok and report.orphan_packs == [] and report.tmp_files == 0
            assert digest(s.checkout("latest")) == ref[1]
        shutil.rmtree(tmp_path / f"m-{trial}", ignore_errors=True)
        for leftover in tmp_path.glob(".export-*"):  # an export's staging folder killed midway
            shutil.rmtree(leftover)
    assert ref[1] in seen


# --- crash during GC ----------------------------------------------------------------------


def test_sigkill_during_gc(tmp_path):
    template = tmp_path / "template"
    expected = {}
    with ckptstore.Store(template, shard_bytes=SHARD) as s:
        for k in range(12):
            s.commit(loop_state(k), tag="latest", metadata={"step": k})
            if k in (3, 7):
                s.tag(f"keep-{k}", "latest")
        for name in s.tags():
            expected[name] = digest(s.checkout(name))
        probe = tmp_path / "probe"
        shutil.copytree(template, probe)
    with ckptstore.Store(probe) as p:
        t0 = time.perf_counter()
        report = p.gc(grace=0)
        duration = time.perf_counter() - t0
    assert report.commits_dropped == 9 and report.packs_repacked + report.packs_deleted > 0
    rng = random.Random(3)
    for trial in range(20):
        path = tmp_path / f"t{trial}"
        shutil.copytree(template, path)
        pid = fork(lambda path=path: ckptstore.Store(path).gc(grace=0))
        time.sleep(rng.uniform(0, duration * 1.5))
        kill(pid)
        with ckptstore.Store(path) as s:
            assert s.fsck(deep=True).ok
            for name, d in expected.items():
                assert digest(s.checkout(name)) == d
            s.gc(grace=0)
            report = s.fsck(deep=True)
            assert report.ok and report.orphan_packs == [] and report.tmp_files == 0
            assert {name: digest(s.checkout(name)) for name in expected} == expected
        shutil.rmtree(path)


# --- concurrency --------------------------------------------------------------------------


def writer_state(i: int, k: int) -> dict:
    g = torch.Generator().manual_seed(100 * i + k)
    shared = torch.Generator().manual_seed(0)
    return {"shared": torch.randn(64 * 1024, generator=shared), "own": torch.randn(16 * 1024, generator=g), "k": k}


def writer(path: Path, i: int, log: Path, deadline: float) -> None:
    store = ckptstore.Store(path)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for k in itertools.count():
        if time.time() > deadline:
            return
        info = store.commit(writer_state(i, k), tag=[f"p{i}-{k}", f"p{i}-latest", "latest"])
        os.write(fd, f"{i} {k} {info.id}\n".encode())


def collector(path: Path, log: Path, deadline: float) -> None:
    store = ckptstore.Store(path)
    runs = locked = 0
    while time.time() < deadline:
        try:
            store.gc(grace=0)
            runs += 1
        except GCLockedError:
            locked += 1
    log.write_text(f"{runs} {locked}")


def test_concurrent_writers_beside_a_gc_loop(tmp_path):
    path = tmp_path / "s"
    ckptstore.Store(path, shard_bytes=SHARD, create=True).close()
    deadline = time.time() + 4.0
    pids = [fork(writer, path, i, tmp_path / f"w{i}", deadline) for i in range(2)]
    pids += [fork(collector, path, tmp_path / f"gc{j}", deadline) for j in range(2)]
    for pid in pids:
        wait_ok(pid)  # no child died of "database is locked" or anything else
    runs = [tuple(map(int, (tmp_path / f"gc{j}").read_text().split())) for j in range(2)]
    assert sum(r for r, _ in runs) > 0
    with ckptstore.Store(path) as s:
        made = [line.split() for i in range(2) for line in (tmp_path / f"w{i}").read_text().splitlines()]
        assert len(made) > 4
        reflog = s.reflog()
        for i, k, cid in made:
            back = s.checkout(cid)
            want = writer_state(int(i), int(k))
            assert_bit_equal(back["own"], want["own"])
            assert_bit_equal(back["shared"], want["shared"])
            assert back["k"] == int(k)
            assert any(r["tag"] == f"p{i}-{k}" and r["new_commit"] == cid for r in reflog)
        assert sum(1 for r in reflog if r["tag"] == "latest") == len(made)
        assert s.fsck(deep=True).ok


# --- disk full ----------------------------------------------------------------------------


@contextlib.contextmanager
def small_filesystem(where: Path, size: str):
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_disk_full_during_commit(tmp_path):
    with small_filesystem(tmp_path / "small", "9m") as mount:
        s = ckptstore.Store(mount / "store")
        v1 = c21_state(1, tmp_path / "m1")
        s.commit(v1, tag="latest")
        ref = digest(s.checkout("latest"))
        with pytest.raises(StoreWriteError, match="No space left"):
            s.commit(c21_state(2, tmp_path / "m2"), tag="latest")
        assert digest(s.checkout("latest")) == ref
        assert list((mount / "store" / "tmp").iterdir()) == []
        s.gc(grace=0)
        report = s.fsck(deep=True)
        assert report.ok and report.orphan_packs == []
        small = s.commit({"step": 1, "x": torch.ones(10)}, tag="after")
        assert s.verify(small.id).ok
        s.close()


@pytest.mark.slow
def test_many_more_crash_trials(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "TRIALS", 500)
    test_sigkill_during_commit_loop(tmp_path)


def test_a_full_disk_still_opens_and_reads(tmp_path):
    """A store on a 100 %-full disk opens read-only: checkout, tags, verify work; a commit says why it cannot."""
    with small_filesystem(tmp_path / "small", "4m") as mount:
        with ckptstore.Store(mount / "store", create=True) as s:
            s.commit({"x": torch.arange(1000)}, tag="t")
        with open(mount / "fill", "wb") as f, contextlib.suppress(OSError):  # fill the disk to the last byte
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        with ckptstore.Store(mount / "store", create=False) as s:
            assert torch.equal(s.checkout("t")["x"], torch.arange(1000))
            assert list(s.tags()) == ["t"] and s.verify("t").ok
            with pytest.raises(ckptstore.errors.StoreWriteError, match="read-only here"):
                s.commit({"y": torch.ones(1)}, tag="u")
