"""Runs that share a store (issue 24): namespaced tags, lineage and retention per run, the
default run's rule, ``runs`` listing, and the lease that refuses a second live writer."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore import Checkpointer
from ckptstore.errors import InvalidNameError, RunBusyError
from ckptstore.objects.packs import BLOB_HEADER
from ckptstore.run import runs

from tests.unit.top.test_cli import cli
from tests import paths

SRC = str(paths.SRC)


def _ckpt(store, objects, **kw) -> Checkpointer:
    return Checkpointer(store, objects, every_n_steps=100, on_signal=(), **kw)


def _python(code: str, *args: str, script: Path | None = None, **kw) -> subprocess.Popen:
    """A real child interpreter running ``code`` (as ``script`` when given: its name is the run's script)."""
    env = {**os.environ, "PYTHONPATH": SRC}
    if script is not None:
        script.write_text(textwrap.dedent(code))
        argv = [sys.executable, str(script), *args]
    else:
        argv = [sys.executable, "-c", textwrap.dedent(code), *args]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _done(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out


def test_runs_namespace_tags_lineage_and_retention(tmp_path):
    """Two runs interleaved in one store: each keeps its own step tags (keep_last prunes
    only its own), and each commit's parent is its own run's previous commit."""
    store = ckptstore.Store(tmp_path / "s", create=True)
    wa, wb = torch.zeros(8), torch.zeros(8)
    a = _ckpt(store, {"w": wa}, run="exp-a", keep_last=2)
    b = _ckpt(store, {"w": wb}, run="exp-b", keep_last=3)
    made = {"exp-a": [], "exp-b": []}
    for _ in range(5):
        wa.add_(1)
        made["exp-a"].append(a.step(100).id)
        wb.sub_(1)
        made["exp-b"].append(b.step(100).id)
    assert sorted(store.tags()) == ["exp-a/latest", "exp-a/step-400", "exp-a/step-500",
                                    "exp-b/latest", "exp-b/step-300", "exp-b/step-400", "exp-b/step-500"]
    for run, ids in made.items():
        log = store.log(f"{run}/latest")
        assert [c.id for c in log] == ids[::-1]  # only its own commits, newest first
        assert [c.parents for c in log] == [(p,) for p in ids[-2::-1]] + [()]
        assert {c.metadata["run"] for c in log} == {run}
    assert a.latest_tag == "exp-a/latest" and b.tag_format == "exp-b/step-{step}"
    for bad in ("a/b", "", " a", "-a", 3):
        with pytest.raises(InvalidNameError, match="invalid"):
            _ckpt(store, {"w": wa}, run=bad)


def test_gc_keep_last_keeps_each_runs_newest_commits(tmp_path, monkeypatch, capsys):
    """`gc --keep-last 3` over two interleaved runs keeps each run's tags and, of each tag's
    lineage (that run's alone), the three newest commits: step-400's reaches back to
    step-200, so each run loses only its step-100."""
    path = tmp_path / "s"
    store = ckptstore.Store(path, create=True)
    wa, wb = torch.zeros(8), torch.zeros(8)
    a = _ckpt(store, {"w": wa}, run="exp-a")
    b = _ckpt(store, {"w": wb}, run="exp-b")
    made = {"exp-a": [], "exp-b": []}
    for _ in range(6):
        wa.add_(1)
        made["exp-a"].append(a.step(100).id)
        wb.sub_(1)
        made["exp-b"].append(b.step(100).id)
    store.close()
    code, out, err = cli(monkeypatch, capsys, "gc", "--keep-last", "3", "--grace", "0", "--store", str(path))
    assert code == 0, err
    with ckptstore.Store(path) as s:
        assert {c.id for c in s.log()} == set(made["exp-a"][1:]) | set(made["exp-b"][1:])
        assert sorted(s.tags()) == ["exp-a/latest", "exp-a/step-400", "exp-a/step-500", "exp-a/step-600",
                                    "exp-b/latest", "exp-b/step-400", "exp-b/step-500", "exp-b/step-600"]
        assert torch.equal(s.checkout("exp-b/step-400")["w"], torch.full((8,), -4.0))


def test_runs_lists_latest_step_commits_and_bytes(tmp_path, monkeypatch, capsys):
    path = tmp_path / "s"
    store = ckptstore.Store(path, create=True, compression_level=0)
    same = torch.arange(1000, dtype=torch.float32)  # 4000 bytes, one blob shared by every commit
    a = Checkpointer(store, {"w": same}, run="exp-a", every_n_steps=1, on_signal=())
    for _ in range(3):
        a.step()
    moving = torch.zeros(1000)
    b = Checkpointer(store, {"w": moving}, run="exp-b", every_n_steps=1, on_signal=())
    for _ in range(2):
        moving.add_(1)  # a new 4000-byte blob per commit
        last_b = b.step()
    default = Checkpointer(store, {"w": same}, every_n_steps=1, on_signal=())
    default.step()
    store.commit({"x": torch.ones(3)}, tag="plain")  # not a Checkpointer's: in no run
    store.commit({"x": torch.ones(4)}, tag="step-1000", metadata={"step": 1000})  # the README's plain commit: in no run either
    one = 4000 + BLOB_HEADER.size
    expected = [
        ("exp-a", 3, 3, one, ("exp-a/latest", "exp-a/step-1", "exp-a/step-2", "exp-a/step-3")),
        ("exp-b", 2, 2, 2 * one, ("exp-b/latest", "exp-b/step-1", "exp-b/step-2")),
        (None, 1, 1, one, ("latest", "step-1")),
    ]
    found = runs(store)
    assert [(r.name, r.latest_step, r.commits, r.bytes, r.tags) for r in found] == expected
    assert found[1].latest_commit == last_b.id
    store.close()
    code, out, err = cli(monkeypatch, capsys, "runs", "--store", str(path), "--json")
    assert code == 0, err
    assert [(r["name"], r["latest_step"], r["commits"], r["bytes"], tuple(r["tags"])) for r in json.loads(out)] == expected
    code, out, err = cli(monkeypatch, capsys, "runs", "--store", str(path))
    assert code == 0, err
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│")]
    assert [[c.strip() for c in r] for r in rows] == [
        ["exp-a", "3", found[0].latest_commit[:12], "3", "3.9 KiB"],
        ["exp-b", "2", last_b.id[:12], "2", "7.9 KiB"],
        ["(default)", "1", found[2].latest_commit[:12], "1", "3.9 KiB"],
    ]


#: A store written by main's code before runs existed (commit 4766831), with this script:
#:     torch.manual_seed(0); w, rng = torch.randn(64), ckptstore.RNGState()
#:     ckpt = ckptstore.Checkpointer(path, {"w": w, "rng": rng}, every_n_steps=100, on_signal=())
#:     for _ in range(5): w.add_(torch.randn(64)); ckpt.step(100)
#: and beside it the raw float32 bytes of w at step 500 and of the next 8 draws of torch.randn.
BEFORE_RUNS = paths.FIXTURES / "default_run_before_runs"


def test_a_store_written_before_runs_existed_resumes_exactly(tmp_path):
    """The single-run script needs no change: a store written before runs existed (plain
    `latest` / `step-N`) resumes bit-exactly (parameters and RNG stream), and the next
    commits continue its lineage and prune its step tags."""
    path = tmp_path / "s"
    shutil.copytree(BEFORE_RUNS, path)
    expected = BEFORE_RUNS.with_suffix(".expected").read_bytes()
    store = ckptstore.Store(path)
    old_latest = store.resolve("latest")
    assert sorted(store.tags()) == ["latest", "step-300", "step-400", "step-500"]
    assert store.info("latest").metadata == {"step": 500}
    w = torch.zeros(64)
    ckpt = _ckpt(store, {"w": w, "rng": ckptstore.RNGState()})
    assert ckpt.resume() == 500
    assert w.numpy().tobytes() == expected[:256]
    assert torch.randn(8).numpy().tobytes() == expected[256:]
    info = ckpt.step(100)
    assert info.parents == (old_latest,)
    assert sorted(store.tags()) == ["latest", "step-400", "step-500", "step-600"]
    assert [(r.name, r.latest_step, r.commits) for r in runs(store)] == [(None, 600, 6)]


_SCRIPT = """
import sys, torch, ckptstore
for spec in sys.argv[2:]:  # "<run>:<objects>", one Checkpointer each (each takes the run over from the one before)
    run, kind = spec.split(":")
    objects = {"policy": torch.nn.Linear(2, 2)} if kind == "policy" else {"w": torch.zeros(int(kind))}
    ckpt = ckptstore.Checkpointer(sys.argv[1], objects, every_n_steps=100, on_signal=(), **({"run": run} if run else {}))
    try:
        start = ckpt.resume()
    except ckptstore.errors.TargetMismatchError as exc:
        print("refused:", exc)
        continue
    print("resumed:", start)
    ckpt.step(900 - (start or 0))
"""


def test_a_second_script_cannot_resume_the_default_run(tmp_path):
    """Default settings: the script that made the default run resumes it; another script
    (same objects, or other objects) is refused with a message naming the run and how to
    pick one, and with its own run= it starts fresh."""
    path = str(tmp_path / "s")
    train, other = tmp_path / "train_a.py", tmp_path / "train_b.py"
    assert _done(_python(_SCRIPT, path, ":4", script=train)).splitlines() == ["resumed: None"]
    # its own restart resumes; the same script with other objects (names, or shapes) is refused
    restart, names, shapes = _done(_python(_SCRIPT, path, ":4", ":policy", ":5", script=train)).splitlines()
    assert restart == "resumed: 900"
    for out in (names, shapes):
        assert out.startswith(f"refused: the default run of {path}: 'latest' (commit ") and ", step 900) " in out
        assert out.endswith("To start a separate experiment in this store, give it its own run: Checkpointer(..., run='<name>'); "
                            "to continue this run on purpose, resume(ref=...) explicitly")
    assert "holds components ['w'], these objects are ['policy']." in names
    assert "does not fit these objects: " in shapes
    # another script with the same objects is refused; with its own run it starts fresh
    refused, fresh = _done(_python(_SCRIPT, path, ":4", "exp-b:4", script=other)).splitlines()
    assert "step 900) was made by script 'train_a', this is 'train_b'. To start a separate" in refused
    assert fresh == "resumed: None"
    with ckptstore.Store(path) as s:
        assert [(r.name, r.latest_step, r.commits) for r in runs(s)] == [("exp-b", 900, 1), (None, 900, 1)]
        assert s.info("latest").metadata == {"step": 900, "script": "train_a"}


_HOLDER = """
import sys, time, torch, ckptstore
ckpt = ckptstore.Checkpointer(sys.argv[1], {"w": torch.zeros(4)}, run="exp-a", on_signal=(), lease_seconds=float(sys.argv[2]))
print("held", flush=True)
time.sleep(600)
"""


def _hold_in_child(location: str, seconds: float = 60.0) -> subprocess.Popen:
    proc = _python(_HOLDER, location, str(seconds))
    assert proc.stdout.readline().strip() == "held", proc.stderr.read()
    return proc


def _sigkill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()
    proc.stderr.close()


def test_a_second_live_checkpointer_is_refused_and_a_sigkilled_one_taken_over(tmp_path):
    path = tmp_path / "s"
    ckptstore.Store(path, create=True).close()
    child = _hold_in_child(str(path))
    try:
        with pytest.raises(RunBusyError) as exc:
            _ckpt(path, {"w": torch.zeros(4)}, run="exp-a")
        assert f"run 'exp-a' of {path} is being written by another live Checkpointer: pid {child.pid} on host {socket.gethostname()!r}" in str(exc.value)
        assert "run='<name>'" in str(exc.value)
        other = _ckpt(path, {"w": torch.zeros(4)}, run="exp-b")  # another run of the same store is free
        other.commit()
    finally:
        _sigkill(child)
    taken = _ckpt(path, {"w": torch.ones(4)}, run="exp-a")
    assert taken.commit().tags == ("exp-a/step-0", "exp-a/latest")


def test_in_one_process_a_newer_checkpointer_takes_the_run_over(tmp_path):
    """Re-running a notebook cell: the newer Checkpointer holds the run, the older one's
    commits are refused; a closed one commits no more and frees the run."""
    store = ckptstore.Store(tmp_path / "s", create=True)
    old = _ckpt(store, {"w": torch.zeros(4)})
    new = _ckpt(store, {"w": torch.zeros(4)})
    with pytest.raises(RunBusyError, match="a newer Checkpointer on the same run was made in this process"):
        old.commit()
    assert new.commit().tags == ("step-0", "latest")
    new.close()
    with pytest.raises(RunBusyError, match="was closed"):
        new.commit()
    code = """
import sys, torch, ckptstore
ckptstore.Checkpointer(sys.argv[1], {"w": torch.zeros(4)}, on_signal=()).commit({"by": "child"})
"""
    _done(_python(code, str(tmp_path / "s")))  # the closed one no longer holds the run
    assert store.info("latest").metadata == {"step": 0, "by": "child"}
    with _ckpt(store, {"w": torch.zeros(4)}) as again:  # nor does the child's, gone
        assert again.commit().tags == ("step-0", "latest")


def test_a_lease_on_object_storage_is_renewed_and_expires_when_its_holder_is_killed(s3_server):
    """On a bucket there is no lock a killed process drops: a live holder renews its lease
    (seen renewing: refused), a SIGKILLed one stops, and the next Checkpointer waits for
    the lease to expire and takes the run over."""
    url = "s3://ckpt/runs-lease"
    seconds = 3.0
    child = _hold_in_child(url, seconds)
    try:
        with pytest.raises(RunBusyError, match=rf"run 'exp-a' of {url} is being written by another live Checkpointer: pid {child.pid} on host"):
            _ckpt(url, {"w": torch.zeros(4)}, run="exp-a", lease_seconds=seconds)
    finally:
        _sigkill(child)
    taken = _ckpt(url, {"w": torch.ones(4)}, run="exp-a", lease_seconds=seconds)  # waits out the dead holder's lease
    assert taken.commit().tags == ("exp-a/step-0", "exp-a/latest")
    taken.close()
    with ckptstore.Store(url) as s:
        assert [(r.name, r.latest_step, r.commits, r.bytes) for r in runs(s)] == [("exp-a", 0, 1, s.du()["stored_bytes"])]
        assert json.loads(s.backend.read_cell("leases/run-exp-a/fence")[0])["holder"] is None  # closed: released (the token stays)



def test_resuming_the_default_run_says_so_and_a_named_run_does_not(tmp_path):
    """Another seed of the same script looks like a restart to the default run: its resume
    warns, naming the step and commit, so the mix-up is visible; a named run resumes quietly."""
    import warnings

    store = ckptstore.Store(tmp_path / "s", create=True)
    for run in (None, "exp-a"):
        with _ckpt(store, {"w": torch.arange(4.0)}, run=run) as first:
            first.commit()
            cid = store.resolve(first.latest_tag)
        w = torch.zeros(4)
        with _ckpt(store, {"w": w}, run=run) as again, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert again.resume() == 0
        assert torch.equal(w, torch.arange(4.0))
        notices = [str(x.message) for x in seen if issubclass(x.category, ckptstore.errors.DefaultRunResumedWarning)]
        assert len(notices) == (1 if run is None else 0)
        if run is None:
            assert f"commit {cid[:12]}, step 0" in notices[0] and "run='<name>'" in notices[0]


@pytest.mark.parametrize("home", ["local", "s3"])
def test_a_run_name_given_as_a_ref_names_the_runs_tags(tmp_path, home, request):
    """``log exp-b`` where exp-b is a run: the error says so and names its tags, on both homes."""
    where = str(tmp_path / "s") if home == "local" else (request.getfixturevalue("s3_server"), "s3://ckpt/runs-as-refs")[1]
    store = ckptstore.Store(where, create=True)
    with _ckpt(store, {"w": torch.ones(3)}, run="exp-b") as c:
        c.commit()
    with pytest.raises(ckptstore.errors.RefNotFoundError, match=r"'exp-b' is a run: name one of its tags, e.g. 'exp-b/latest', 'exp-b/step-0'"):
        store.log("exp-b")


def test_a_forked_child_leaves_its_parents_bucket_lease_alone(s3_server):
    """A process forked while a Checkpointer holds a lease on a bucket (a DataLoader worker,
    a test harness's child) gets a copy of the lease; its release (a finalizer run by the
    child's garbage collector) must neither touch the bucket from the forked client (that
    hung forever) nor delete the parent's lease."""
    url = "s3://ckpt/runs-fork"
    held = _ckpt(url, {"w": torch.zeros(4)}, run="exp-f", lease_seconds=30.0)
    try:
        with ckptstore.Store(url) as s:
            before = sorted(o.key for o in s.backend.list("leases"))
        assert before
        pid = os.fork()
        if pid == 0:  # the child: release its copy, then leave at once
            try:
                held._lease.release()
            finally:
                os._exit(0)
        for _ in range(300):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's release hung")
        assert os.waitstatus_to_exitcode(status) == 0
        with ckptstore.Store(url) as s:
            assert sorted(o.key for o in s.backend.list("leases")) == before  # the parent's lease is intact
        assert held.commit().tags == ("exp-f/step-0", "exp-f/latest")
    finally:
        held.close()


def test_a_dropped_checkpointer_gives_its_bucket_lease_up_without_io_then_at_exit(s3_server):
    """A Checkpointer dropped without close(): its finalizer may run anywhere, so it does no
    I/O (the lease objects stay); the process's exit deletes them, so the next run of the
    script is not kept waiting for the lease to expire."""
    import gc

    url = "s3://ckpt/runs-dropped"
    code = f"""
        import gc, torch, ckptstore
        c = ckptstore.Checkpointer({url!r}, {{"w": torch.zeros(2)}}, run="exp-d", on_signal=())
        c.commit()
        del c
        gc.collect()
        with ckptstore.Store({url!r}) as s:
            print(json.loads(s.backend.read_cell("leases/run-exp-d/fence")[0])["holder"] is not None)
    """
    assert _done(_python(code.replace("import gc,", "import json, gc,"))).split() == ["True"]  # dropped: still held (no I/O from the finalizer)
    with ckptstore.Store(url) as s:
        assert json.loads(s.backend.read_cell("leases/run-exp-d/fence")[0])["holder"] is None  # released at the child's exit
    held = _ckpt(url, {"w": torch.zeros(2)}, run="exp-d", lease_seconds=30.0)
    del held
    gc.collect()
    with ckptstore.Store(url) as s:
        assert json.loads(s.backend.read_cell("leases/run-exp-d/fence")[0])["holder"] is not None
    again = _ckpt(url, {"w": torch.zeros(2)}, run="exp-d", lease_seconds=30.0)  # this process gave it up: taken at once
    again.close()
