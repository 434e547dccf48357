"""The store inside the training process: fork and signal handlers (issue 41, invariant 15).

Real ``os.fork`` and ``multiprocessing`` children (fork start method), real subprocesses,
real signals. A Store, Checkpointer or run lease carried into a forked child refuses at
once with ForkedStoreError (docs/operations.md, "Processes: threads, fork, signals"); a
Store the child opens itself works; a child that only exits changes nothing; the run
lease ends with its holder; the Checkpointer's signal handlers chain to and give back the
ones it found.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

import ckptstore
from ckptstore import Checkpointer
from ckptstore.errors import ForkedStoreError, RunBusyError

from tests.conftest import assert_bit_equal

BOUND = 60.0  # seconds a child may take before it counts as hung (a hang is a failure, not a timing)
BIG = 5 << 20  # bytes: above the 4 MiB from which commits and checkouts use the store's threads


def in_child(fn, timeout: float = BOUND) -> dict:
    """Run ``fn()`` in a forked child; ``{"ok": its JSON result}`` or ``{"error": class name,
    "message": ...}``; ``{"hang": True}`` (the child killed) past ``timeout`` seconds."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        faulthandler.dump_traceback_later(max(1.0, timeout - 5), exit=True)  # a hang shows where, then ends the child
        try:
            out = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {"error": type(exc).__name__, "message": str(exc)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"hang": True}
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.waitpid(pid, 0)
        return json.loads(data)
    finally:
        os.close(r)


def big_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(BIG // 4, generator=g), "step": seed}


# --- a Store carried into a forked child refuses at once -----------------------------------------


def test_a_child_committing_through_the_inherited_store_is_refused_while_the_parent_closes(tmp_path):
    path = tmp_path / "s"
    store = ckptstore.Store(path, create=True)
    store.commit({"w": torch.zeros(8)}, tag="before")
    go_r, go_w = os.pipe()

    def child():
        os.read(go_r, 1)  # the parent has closed its Store
        try:
            store.commit({"w": torch.ones(8)}, tag="child")
        except ForkedStoreError as exc:
            return f"refused: {exc}"
        return "committed"

    pid_result = {}
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = child()
        except BaseException as exc:  # noqa: BLE001
            out = f"{type(exc).__name__}: {exc}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    store.close()  # the end of the parent's script, `with Store(...)`, a Checkpointer's teardown
    os.write(go_w, b"x")
    ready, _, _ = select.select([r], [], [], BOUND)
    assert ready, "the child hung"
    pid_result["out"] = os.read(r, 65536).decode()
    os.waitpid(pid, 0)
    assert pid_result["out"].startswith("refused: ") and "Open a new ckptstore.Store" in pid_result["out"], pid_result
    with ckptstore.Store(path, create=False) as fresh:
        assert set(fresh.tags()) == {"before"}  # nothing acknowledged and then missing: the child was refused
        assert fresh.fsck().ok


@pytest.mark.parametrize("op", ["commit", "checkout", "commit_async", "log", "tags"])
def test_every_use_of_an_inherited_store_is_refused_at_once_never_hangs(tmp_path, op):
    store = ckptstore.Store(tmp_path / "s", create=True)
    state = big_state(1)
    store.commit(state, tag="big")  # > 4 MiB: pooled hashing and reading
    store.commit(state, tag="again")  # the pool's threads exist in the parent now

    def child():
        if op == "commit":
            store.commit(big_state(2), tag="child")
        elif op == "checkout":
            store.checkout("big")
        elif op == "commit_async":
            store.commit_async(big_state(2), tag="child").result()
        elif op == "log":
            store.log()
        else:
            store.tags()
        return "no error"

    out = in_child(child)
    assert out.get("error") == "ForkedStoreError", out
    assert "a Store does not cross fork" in out["message"] and str(tmp_path / "s") in out["message"]
    store.commit(big_state(3), tag="parent")  # the parent goes on
    assert set(store.tags()) == {"big", "again", "parent"}
    assert_bit_equal(store.checkout("parent")["w"], big_state(3)["w"])
    store.close()


def test_a_future_inherited_unfinished_fails_in_the_child_instead_of_waiting_for_ever(tmp_path):
    store = ckptstore.Store(tmp_path / "s", create=True)
    store.commit({"w": torch.zeros(4)}, tag="first")
    with store.catalog.lock:  # the committer waits for the catalog: every future is unfinished at the fork
        futures = [store.commit_async(big_state(i), tag=f"a{i}") for i in range(3)]

        def child():
            outcomes = []
            for f in futures:
                try:
                    outcomes.append(f.result().id)
                except ForkedStoreError as exc:
                    outcomes.append("refused" if "asynchronous commit" in str(exc) else str(exc))
            return outcomes

        out = in_child(child)
    assert out.get("ok") == ["refused"] * 3, out
    assert [f.result().tags for f in futures] == [("a0",), ("a1",), ("a2",)]  # the parent's own commits go on
    assert set(store.tags()) == {"first", "a0", "a1", "a2"}
    store.close()


def test_a_child_opens_its_own_store_and_its_commits_survive_the_parent_closing(tmp_path):
    path = tmp_path / "s"
    store = ckptstore.Store(path, create=True)
    store.commit({"w": torch.zeros(8)}, tag="p0")
    busy = store.commit_async(big_state(5), tag="p-async")  # a commit running in a thread at the fork
    go_r, go_w = os.pipe()

    def child():
        with ckptstore.Store(path) as own:
            own.commit({"w": torch.ones(8)}, tag="c1")
            os.read(go_r, 1)  # the parent closed its Store meanwhile
            infos = [own.commit({"w": torch.full((8,), float(i))}, tag=f"c{i}") for i in range(2, 5)]
            own.commit(big_state(6), tag="c-big")  # pooled: the child's own threads
            return [i.id for i in infos]

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = {"ok": child()}
        except BaseException as exc:  # noqa: BLE001
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    busy.result()
    store.commit({"w": torch.full((8,), 9.0)}, tag="p1")
    store.close()
    os.write(go_w, b"x")
    ready, _, _ = select.select([r], [], [], BOUND)
    assert ready, "the child hung"
    out = json.loads(os.read(r, 65536))
    os.waitpid(pid, 0)
    assert "ok" in out, out
    with ckptstore.Store(path, create=False) as fresh:  # every acknowledged commit of both processes is there
        assert set(fresh.tags()) == {"p0", "p-async", "p1", "c1", "c2", "c3", "c4", "c-big"}
        assert [fresh.resolve(f"c{i}") for i in range(2, 5)] == out["ok"]
        assert fresh.checkout("c3")["w"].tolist() == [3.0] * 8
        assert_bit_equal(fresh.checkout("c-big")["w"], big_state(6)["w"])
        assert fresh.fsck().ok


EXITING_CHILD = """
import gc, os, sys, torch, ckptstore
path, how = sys.argv[1], sys.argv[2]
store = ckptstore.Store(path, create=True)
store.commit({"w": torch.arange(8.0)}, tag="p0")
store.commit_async({"w": torch.arange(8.0) + 1}, tag="p1").result()
ckpt = ckptstore.Checkpointer(store, {"w": torch.zeros(4)}, every_n_steps=1, run="r")
ckpt.step()
import subprocess
HASH = "import hashlib, os, sys; print(sorted((p, hashlib.sha256(open(os.path.join(sys.argv[1], p), 'rb').read()).hexdigest()) for p in os.listdir(sys.argv[1]) if p.startswith('catalog.sqlite')))"
def files():  # read by another process: closing a descriptor of the catalog here would drop this process's SQLite locks
    return subprocess.run([sys.executable, "-c", HASH, path], capture_output=True, text=True, check=True).stdout
before = files()
pid = os.fork()
if pid == 0:
    if how == "close":
        ckpt.close(); store.close()
    elif how == "drop":
        del ckpt, store; gc.collect()
    elif how == "pending":
        store.commit_async({"w": torch.zeros(8)}, tag="child")  # refused: the child then exits with it raised
    sys.exit(0)  # atexit handlers, finalizers, the interpreter's teardown
_, status = os.waitpid(pid, 0)
after = files()
assert after == before and "catalog.sqlite-wal" in after, ("the child changed the catalog files", before, after)
for i in range(2, 5):
    ckpt.step()
store.commit({"w": torch.zeros(8)}, tag="p-last")
print(sorted(store.tags()), os.WEXITSTATUS(status), flush=True)
"""


@pytest.mark.parametrize("how", ["exit", "close", "drop", "pending"])
def test_a_child_that_only_exits_changes_nothing(tmp_path, how):
    path = tmp_path / "s"
    out = subprocess.run([sys.executable, "-c", EXITING_CHILD, str(path), how], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    tags, status = out.stdout.strip().rsplit(" ", 1)
    assert status == ("1" if how == "pending" else "0"), out.stderr
    assert tags == str(["p-last", "p0", "p1", "r/latest", "r/step-2", "r/step-3", "r/step-4"])
    with ckptstore.Store(path, create=False) as fresh:
        assert fresh.checkout("r/latest")["checkpointer"]["step"] == 4
        assert fresh.fsck().ok


def _mp_child(conn, store_path: str, store):
    try:
        store.commit({"w": torch.ones(4)}, tag="mp-inherited")
        out = "committed"
    except ForkedStoreError:
        out = "refused"
    with ckptstore.Store(store_path) as own:
        own.commit({"w": torch.full((4,), 7.0)}, tag="mp-own")
    conn.send(out)
    conn.close()


def test_multiprocessing_fork_children_are_refused_the_inherited_store_and_work_with_their_own(tmp_path):
    path = tmp_path / "s"
    store = ckptstore.Store(path, create=True)
    store.commit({"w": torch.zeros(4)}, tag="p0")
    ctx = multiprocessing.get_context("fork")
    results = []
    for _ in range(3):
        a, b = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_mp_child, args=(b, str(path), store))
        proc.start()
        proc.join(BOUND)
        assert proc.exitcode == 0, "the child hung or failed"
        results.append(a.recv())
    assert results == ["refused"] * 3
    store.commit({"w": torch.zeros(4)}, tag="p1")
    assert set(store.tags()) == {"p0", "p1", "mp-own"}
    assert store.checkout("mp-own")["w"].tolist() == [7.0] * 4
    store.close()


def test_object_storage_in_a_forked_child_is_refused_at_once_never_hangs(tmp_path, s3_server):
    # obstore's runtime threads are not in a forked child: every s3:// store there, the inherited
    # one and a new one, refuses at once (a request would wait for ever)
    url = f"s3://ckpt/fork-{uuid.uuid4().hex[:12]}"
    store = ckptstore.Store(url, create=True, cache=tmp_path / "cache-parent")
    store.commit(big_state(1), tag="p0")

    def child():
        out = []
        for use in (lambda: store.tags(), lambda: ckptstore.Store(url, cache=tmp_path / "cache-child").tags()):
            try:
                use()
                out.append("used")
            except ForkedStoreError as exc:
                out.append("refused" if "fork" in str(exc) else str(exc))
        return out

    out = in_child(child)
    assert out.get("ok") == ["refused", "refused"], out
    store.commit(big_state(3), tag="p1")  # the parent's client and threads still work
    store.close()
    with ckptstore.Store(url, cache=tmp_path / "cache-fresh") as fresh:
        assert set(fresh.tags()) == {"p0", "p1"}
        assert_bit_equal(fresh.checkout("p1")["w"], big_state(3)["w"])


BUCKET_CHILD = """
import os, sys, torch, ckptstore
url, cache = sys.argv[1], sys.argv[2]
pid = os.fork()  # before the first s3:// use: the child's own Store works
if pid == 0:
    with ckptstore.Store(url, create=True, cache=cache + "-child") as own:
        own.commit({"w": torch.full((4,), 2.0)}, tag="c1")
    os._exit(0)
_, status = os.waitpid(pid, 0)
with ckptstore.Store(url, cache=cache) as s:
    s.commit({"w": torch.full((4,), 3.0)}, tag="p1")
    print(os.WEXITSTATUS(status), sorted(s.tags()), flush=True)
"""


def test_a_child_forked_before_the_first_object_storage_use_works_with_its_own_store(tmp_path, s3_server):
    url = f"s3://ckpt/fork-{uuid.uuid4().hex[:12]}"
    out = subprocess.run([sys.executable, "-c", BUCKET_CHILD, url, str(tmp_path / "cache")], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["0", "['c1',", "'p1']"], out.stderr


def test_a_checkpointer_in_a_forked_child_is_refused(tmp_path):
    store = ckptstore.Store(tmp_path / "s", create=True)
    ckpt = Checkpointer(store, {"w": torch.zeros(4)}, every_n_steps=1, on_signal=())
    ckpt.step()

    def child():
        try:
            ckpt.commit()
        except ForkedStoreError as exc:
            return str(exc)
        return "committed"

    out = in_child(child)
    assert "fork" in out.get("ok", "") and "committed" != out.get("ok"), out
    ckpt.step()
    assert store.checkout("latest")["checkpointer"]["step"] == 2
    ckpt.close()
    store.close()


# --- the run lease ends with its holder, not with a forked child ------------------------------------

HOLDER = """
import os, sys, time, torch, ckptstore
store = ckptstore.Store(sys.argv[1], create=True)
ckpt = ckptstore.Checkpointer(store, {"w": torch.zeros(4)}, every_n_steps=1)
ckpt.step()
pid = os.fork()
if pid == 0:
    time.sleep(600)  # a helper process that outlives its parent
    os._exit(0)
print(pid, flush=True)
time.sleep(600)
"""


def test_a_forked_child_does_not_keep_a_killed_holders_run_busy(tmp_path):
    path = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        with pytest.raises(RunBusyError, match=f"pid {proc.pid}"):  # the holder is alive: refused
            Checkpointer(ckptstore.Store(path), {"w": torch.zeros(4)}, every_n_steps=1)
        proc.kill()
        proc.wait()
        os.kill(child, 0)  # the child still lives
        store = ckptstore.Store(path)
        ckpt = Checkpointer(store, {"w": torch.zeros(4)}, every_n_steps=1, on_signal=())  # the run is taken at once
        assert ckpt.resume() == 1
        ckpt.step()
        assert store.checkout("latest")["checkpointer"]["step"] == 2
        ckpt.close()
        store.close()
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- signals are borrowed ----------------------------------------------------------------------------


@pytest.fixture
def sigterm_saved():
    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGTERM, saved[0])
    signal.signal(signal.SIGUSR1, saved[1])


def test_a_user_handler_installed_before_is_chained_and_restored_on_close(tmp_path, sigterm_saved):
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    signal.signal(signal.SIGTERM, mine)
    store = ckptstore.Store(tmp_path / "s", create=True)
    ckpt = Checkpointer(store, {"w": torch.zeros(4)}, every_n_steps=100)
    assert signal.getsignal(signal.SIGTERM) is not mine
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # (delivered at the next bytecode boundary of the main thread)
    assert seen == [signal.SIGTERM] and ckpt.stop_requested == signal.SIGTERM  # both ran: the Checkpointer's, then mine
    ckpt.stop_requested = None
    ckpt.close()
    assert signal.getsignal(signal.SIGTERM) is mine
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    assert seen == [signal.SIGTERM, signal.SIGTERM] and ckpt.stop_requested is None
    store.close()


def test_nested_checkpointers_restore_in_lifo_order_and_leave_a_later_handler_alone(tmp_path, sigterm_saved):
    def user(signum, frame):
        pass

    signal.signal(signal.SIGTERM, user)
    store = ckptstore.Store(tmp_path / "s", create=True)
    a = Checkpointer(store, {"w": torch.zeros(4)}, run="a", on_signal=(signal.SIGTERM,))
    ha = signal.getsignal(signal.SIGTERM)
    b = Checkpointer(store, {"w": torch.zeros(4)}, run="b", on_signal=(signal.SIGTERM,))
    b.close()
    assert signal.getsignal(signal.SIGTERM) is ha
    a.close()
    assert signal.getsignal(signal.SIGTERM) is user
    # closed out of order: the handler found by the first is back all the same
    a = Checkpointer(store, {"w": torch.zeros(4)}, run="a", on_signal=(signal.SIGTERM,))
    b = Checkpointer(store, {"w": torch.zeros(4)}, run="b", on_signal=(signal.SIGTERM,))
    a.close()
    b.close()
    assert signal.getsignal(signal.SIGTERM) is user
    # a handler someone installed after the Checkpointer stays
    c = Checkpointer(store, {"w": torch.zeros(4)}, run="c", on_signal=(signal.SIGTERM,))

    def later(signum, frame):
        pass

    signal.signal(signal.SIGTERM, later)
    c.close()
    assert signal.getsignal(signal.SIGTERM) is later
    store.close()


def test_a_collected_checkpointer_gives_its_handlers_back(tmp_path, sigterm_saved):
    import gc

    def user(signum, frame):
        pass

    signal.signal(signal.SIGTERM, user)
    store = ckptstore.Store(tmp_path / "s", create=True)
    ckpt = Checkpointer(store, {"w": torch.zeros(4)}, every_n_steps=10)
    assert signal.getsignal(signal.SIGTERM) is not user
    del ckpt
    gc.collect()
    assert signal.getsignal(signal.SIGTERM) is user
    store.close()


CLOSED_THEN_TERM = """
import signal, sys, time, torch, ckptstore
store = ckptstore.Store(sys.argv[1], create=True)
ckpt = ckptstore.Checkpointer(store, {"w": torch.zeros(4)}, every_n_steps=1)
ckpt.step()
ckpt.close()
print("closed", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
time.sleep(120)
"""


def test_sigterm_terminates_a_process_that_closed_its_checkpointer(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CLOSED_THEN_TERM, str(tmp_path / "s")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().split() == ["closed", "True"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM  # the default action again: terminated by the signal


USER_THEN_CKPT = """
import signal, sys, time, torch, ckptstore
def mine(signum, frame):
    print("user handler", signum, flush=True)
signal.signal(signal.SIGTERM, mine)
store = ckptstore.Store(sys.argv[1], create=True)
w = torch.zeros(4)
ckpt = ckptstore.Checkpointer(store, {"w": w}, every_n_steps=10**6)
print("ready", flush=True)
while True:
    w += 1
    ckpt.step()
    time.sleep(0.001)
"""


def test_sigterm_runs_the_users_handler_and_the_checkpointer_commits_and_exits(tmp_path):
    path = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-c", USER_THEN_CKPT, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert proc.stdout.read().split() == ["user", "handler", str(int(signal.SIGTERM))]
    with ckptstore.Store(path, create=False) as s:
        info = s.info("latest")
        assert info.metadata["stopped_by"] == "SIGTERM"
        assert s.checkout("latest")["w"].tolist() == [float(info.metadata["step"])] * 4


FORKED_WORKER_TERM = """
import os, signal, sys, time, torch, ckptstore
store = ckptstore.Store(sys.argv[1], create=True)
ckpt = ckptstore.Checkpointer(store, {"w": torch.zeros(4)}, every_n_steps=1)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, b"x")  # (a signal that reaches a child before CPython's fork hooks end is dropped by them)
    time.sleep(120)  # a DataLoader-like worker that never calls step()
    os._exit(0)
os.read(r, 1)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, flush=True)
"""


def test_sigterm_terminates_a_forked_worker_of_a_process_with_a_checkpointer(tmp_path):
    out = subprocess.run([sys.executable, "-c", FORKED_WORKER_TERM, str(tmp_path / "s")], capture_output=True, text=True, timeout=180)
    assert out.stdout.strip() == "True", out.stderr
