"""The process harness: what a training script does inside its own process, at random.

Beside the kill harness (tests/harness/stress.py), the damage harness and the bucket nemesis
(tests/harness/bucket_stress.py), which attack a store from outside, this one attacks it from inside
the process that uses it (issue 41). A seeded schedule (:func:`run_rounds`) runs rounds of four
scenario kinds, each in real processes and threads, and judges every round with one invariant
checker (:func:`check_invariants`).

Scenarios
---------
``threads``   a fresh interpreter holds a dict of tensors and a real TorchRL ``ReplayBuffer``;
              a writer thread mutates the tensors in place (``add_``, row writes, ``fill_``)
              and a collector thread calls ``rb.extend`` while the main thread commits,
              with ``commit`` or with ``commit_async`` whose future is resolved only after
              the next training step has already written the objects again. Every value a
              writer writes is a step number (each row of a row write is one number, each
              ``add_`` adds 1), so what a checkout may hold is a range per tensor, known at
              the call; the main thread's own tensor is written only between commits, so a
              ``commit_async`` snapshot of it is exact. A third of these rounds commit to a
              store on object storage (``s3://``, the moto server of tests/s3server.py, started
              once per run): the bucket home's writer uploads after the call returns.
``fork``      a fresh interpreter with an open ``Store`` (and, in half the rounds, a
              ``Checkpointer`` holding its run lease) forks children at random points:
              children that commit (small, over 4 MiB, ``commit_async``), read, only exit
              (with or without the exit functions), commit through the inherited
              Checkpointer, outlive the parent (and commit, or ``commit_async``, after it is
              gone: one such child in every round without a lease), or only hold the
              inherited lease. The parent ends by closing (``close``, ``with``, interpreter
              exit; half the time while its last children still work) or, in lease rounds,
              is SIGKILLed by the coordinator, which then takes the run over in a new
              Checkpointer while a forked child lives.
``signal``    a fresh interpreter installs its own SIGTERM handler, then a Checkpointer with
              the default ``on_signal``; SIGTERM comes from the coordinator at a random
              instant, during the training loop or after the Checkpointer was closed,
              left by ``with`` or garbage-collected.
``migrate``   a fresh interpreter copies fixture stores of every older schema
              (tests/fixtures: ``c26_schema_v1`` and ``procharness_schema_v1`` schema 1,
              ``procharness_schema_v2`` schema 2, ``schema_v3`` and ``default_run_before_runs``
              schema 3) and forks
              children that open a copy (the migration) and are SIGKILLed after a random
              delay drawn from the measured length of an uninterrupted open; the
              coordinator then opens each copy again.

The invariants (:func:`check_invariants`)
-----------------------------------------
``missing``      an acknowledged commit (a ``CommitInfo`` returned, a future resolved) is not
                 in the store afterwards, in a fresh ``Store`` of the coordinator;
``unreadable``   it is there but its checkout raises (``BlobCorruptError``: it does not read
                 back what it hashed);
``wrong-value``  it reads back a value its writer never wrote (outside the range known at the
                 call, a ``commit_async`` snapshot other than the state at its return, a fork
                 child's or a migrated tag's bytes other than expected);
``fsck``         ``fsck(deep=True)`` of the store is not clean;
``tag``          after a migration killed at random, a fixture tag is missing or points at
                 another commit;
``hang``         a process (fork child, scenario) ran past its bound and was SIGKILLed;
``lease``        the run of a SIGKILLed holder could not be taken within ``LEASE_BOUND``
                 seconds while a child forked from it lived;
``handler``      the user's SIGTERM handler did not run when SIGTERM came, or is not the
                 installed handler again after the Checkpointer closed (SIGUSR1 likewise
                 for its previous disposition);
``child-error``  an operation in a fork child raised something other than a
                 ``ckptstore.errors.CkptStoreError`` (a clean refusal is not a violation);
``crash``        a scenario process died of an error of the harness's own scenario code.

Replaying a seed
----------------
The seed decides the schedule: the scenario of each round, its operations, fork points and
roles, signal and kill delays (the interleavings stay the OS's). Round ``i`` of scenario
``X`` is drawn from ``(seed, i, X)`` whatever the other rounds are, so one round replays
alone. Every violation is printed as one line with the seed, the round, the scenario and the
command that replays it::

    python -m tests.harness.procharness --seed <seed> --rounds 1 --first-round <i> --scenario <X>
    python -m tests.harness.procharness --seed <seed> --rounds 8                 # the default test's run
    CKPT_PROC_SEED=<seed> pytest tests/harness/test_procharness.py              # the same, in pytest
    python -m tests.harness.procharness --seed <seed> --slow                     # the slow run's minimums

A run keeps its folder (stores, ``acks.jsonl`` and ``events.jsonl`` of each round) when it
found violations, and names it.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import faulthandler
import gc
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from tensordict import TensorDict

import ckptstore
from ckptstore.errors import CkptStoreError, RunBusyError
from tests import paths

ROOT = paths.REPO
SRC = Path(ckptstore.__file__).resolve().parents[1]  # children import the same ckptstore as we do
FIXTURES = paths.FIXTURES
#: fixture stores of every older schema: name -> schema version (procharness_schema_v1/v2: 40 commits,
#: 11 tags, written by tools/make_procharness_fixtures.py with the code of that schema)
MIGRATION_FIXTURES = {"c26_schema_v1": 1, "procharness_schema_v1": 1, "procharness_schema_v2": 2, "schema_v3": 3,
                      "default_run_before_runs": 3}
SCENARIOS = ("threads", "fork", "signal", "migrate")
SHARD_BYTES = 64 << 10
HANG_BOUND = 20.0  # seconds a fork child may take (a commit over 4 MiB on a loaded 2-core machine takes < 2)
LEASE_BOUND = 5.0  # seconds within which the run of a SIGKILLed holder must be taken
ROUND_BOUND = 240.0  # seconds a scenario process may take
BIG = 5 << 20  # a commit over 4 MiB (the size at which the store's thread pool is used)
DEFAULT = {"commits": 14, "forks": 8, "kills": 8}  # per round, default run
SLOW = {"commits": 40, "forks": 14, "kills": 25}  # per round, slow run
SLOW_MINIMUMS = {"commits": 300, "forks": 100, "kills": 200}


class ProcFailure(AssertionError):
    """Violations found; the message has one line per violation (seed, round, scenario, replay). ``stats`` attached."""

    def __init__(self, message: str, stats: dict):
        super().__init__(message)
        self.stats = stats


@dataclass
class Violation:
    seed: int
    round: int
    scenario: str
    kind: str
    detail: str

    def line(self) -> str:
        return (f"PROC-VIOLATION seed={self.seed} round={self.round} scenario={self.scenario} kind={self.kind}: {self.detail} "
                f"| replay: python -m tests.harness.procharness --seed {self.seed} --rounds 1 --first-round {self.round} "
                f"--scenario {self.scenario}")


# --- what is committed, and what may be read back ---------------------------------------------


def step_state(step: int, big: bool = False) -> dict:
    """The objects a fork or signal scenario commits at ``step``: a deterministic function of it."""
    g = torch.Generator().manual_seed(step)
    state = {"w": torch.randn(128, 64, generator=g), "s": torch.full((16,), float(step))}
    if big:
        state["big"] = torch.arange(BIG // 4, dtype=torch.float32) + step
    return state


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _record(t: torch.Tensor) -> tuple:
    return (str(t.dtype), tuple(t.shape), _bytes(t))


def _leaves(td) -> dict:
    """``{path: tensor}`` of a checkout (paths joined with ``/``); JSON leaves as their repr."""
    out = {}
    for key in td.keys(include_nested=True, leaves_only=True):
        name = "/".join(key) if isinstance(key, tuple) else key
        v = td.get(key)
        out[name] = v if isinstance(v, torch.Tensor) else repr(v)
    return out


def _judge_leaves(ack: dict, got: dict, reference: dict | None) -> str | None:
    """``None`` when the leaves of a checkout are what ``ack`` says may be read; else what is wrong."""
    check = ack["check"]
    if check == "ranges":  # every element a number the writer wrote, within [lo, hi] known at the call
        for path, (lo, hi) in ack["ranges"].items():
            t = got.get(path)
            if not isinstance(t, torch.Tensor):
                return f"leaf {path} missing"
            if t.numel() == 0:
                continue
            f = t.double()
            if not torch.equal(f, f.round()):
                return f"leaf {path} holds a value no writer wrote (not a step number)"
            mn, mx = f.min().item(), f.max().item()
            if mn < lo or mx > hi:
                return f"leaf {path} holds values {mn:g}..{mx:g}, the writer wrote {lo}..{hi} around this commit"
        return None
    if check == "step":
        want = step_state(ack["step"], ack.get("big", False))
        for path in ack.get("leaves", list(want)):
            t = got.get(path)
            if not isinstance(t, torch.Tensor) or _record(t) != _record(want[path]):
                return f"leaf {path} is not step {ack['step']}'s"
        return None
    if check == "ref":  # a migrated fixture's tag: bit-exact as an uninterrupted migration reads it
        want = reference[ack["fixture"]]["leaves"][ack["tag"]]
        have = {p: (_record(v) if isinstance(v, torch.Tensor) else v) for p, v in got.items()}
        if have != want:
            diff = sorted(p for p in set(want) | set(have) if want.get(p) != have.get(p))
            return f"tag {ack['tag']}: leaves {diff[:5]} differ from the uninterrupted migration's"
        return None
    raise ValueError(f"unknown check {check!r}")


def _err(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {' '.join(str(exc).split())[:300]}"


def _stuck_at(ev: dict) -> str:
    """Where a hung fork child's main thread was (its faulthandler dump), if it wrote one."""
    path = ev.get("stacks")
    if not path or not Path(path).exists():
        return ""
    text = Path(path).read_text()
    for block in text.split("\n\n"):
        if "most recent call first" in block and "_fork_child" in block:
            frames = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("File ")]
            ours = [f for f in frames if "/ckptstore/" in f] or frames
            return f" (stuck at {ours[0]}; stacks in {path})" if ours else f" (stacks in {path})"
    return f" (stacks in {path})"


def check_invariants(store_path: Path | None, acks: list[dict], events: list[dict], *, expect_tags: dict | None = None,
                     reference: dict | None = None) -> list[tuple[str, str]]:
    """The one invariant checker of every scenario: ``[(kind, detail)]``, empty when all hold.

    ``store_path`` is opened in a fresh ``Store`` of this process (``None``: no store to check);
    each of ``acks`` (an acknowledged commit: ``{"cid", "check", ...}``, see :func:`_judge_leaves`)
    must be there, check out without error and hold only values its writer wrote;
    ``fsck(deep=True)`` must be clean; ``expect_tags`` (``{tag: commit id}``) must resolve
    exactly. ``events`` are what the scenario's processes observed; the ones that break an
    invariant (a hang, a lost handler, a run not taken over, a raw error in a fork child) become
    violations here too. The kinds are listed in the module docstring."""
    out: list[tuple[str, str]] = []
    for ev in events:
        kind = ev.get("ev")
        if kind == "hang":
            out.append(("hang", f"{ev['what']} still running after {ev['bound']:g} s; SIGKILLed{_stuck_at(ev)}"))
        elif kind == "child-error":
            out.append(("child-error", f"fork child {ev['role']}: {ev['error']}"))
        elif kind == "crash":
            out.append(("crash", ev["error"]))
        elif kind == "lease" and ev.get("taken_in") is None:
            out.append(("lease", f"run {ev['run']!r} of a SIGKILLed holder not taken within {LEASE_BOUND:g} s while its forked child "
                                  f"(alive: {ev['child_alive']}) lived: {ev['error']}"))
        elif kind == "handler":
            if ev.get("user_ran") is False:
                out.append(("handler", f"the user's SIGTERM handler did not run when SIGTERM came ({ev['when']})"))
            if ev.get("restored") is False:
                out.append(("handler", f"after the Checkpointer {ev['when']}, SIGTERM's handler is {ev['sigterm']} and SIGUSR1's "
                                       f"{ev['sigusr1']}, not the ones installed before it"))
    if store_path is None:
        return out
    try:
        s = ckptstore.Store(store_path, create=False)
    except Exception as exc:
        return out + [("unreadable", f"opening {store_path}: {_err(exc)}")]
    with s:
        for tag, cid in (expect_tags or {}).items():
            try:
                got = s.resolve(tag)
            except Exception as exc:
                out.append(("tag", f"tag {tag} (was {cid}): {_err(exc)}"))
                continue
            if got != cid:
                out.append(("tag", f"tag {tag} points at {got}, was {cid}"))
        for ack in acks:
            cid, who = ack["cid"], ack.get("who", "")
            try:
                s.info(cid)
            except Exception as exc:
                out.append(("missing", f"commit {cid} acknowledged to {who} is not in the store: {_err(exc)}"))
                continue
            try:
                td = s.checkout(cid)
            except Exception as exc:
                out.append(("unreadable", f"commit {cid} acknowledged to {who}: checkout raises {_err(exc)}"))
                continue
            bad = _judge_leaves(ack, _leaves(td), reference)
            if bad:
                out.append(("wrong-value", f"commit {cid} acknowledged to {who}: {bad}"))
        try:
            report = s.fsck(deep=True)
            if not report.ok:
                out.append(("fsck", f"fsck(deep=True) of {store_path}: {' | '.join(map(str, report.problems[:3]))}"
                                    f"{f' (+{len(report.problems) - 3} more)' if len(report.problems) > 3 else ''}"))
        except Exception as exc:
            out.append(("fsck", f"fsck(deep=True) of {store_path} raises {_err(exc)}"))
    return out


# --- plumbing shared by the scenario processes --------------------------------------------------


def emit(path: Path, obj: dict) -> None:
    """Append one JSON line to ``path`` (one ``write`` of ``O_APPEND``: forked children share files safely)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(obj) + "\n").encode())
    finally:
        os.close(fd)


def read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line cut by a SIGKILL
            out.append(json.loads(line))
    return out


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _handler_name(h) -> str:
    if h in (signal.SIG_DFL, signal.SIG_IGN, None):
        return {signal.SIG_DFL: "SIG_DFL", signal.SIG_IGN: "SIG_IGN", None: "None"}[h]
    return getattr(h, "__qualname__", repr(h))


class Scenario:
    """What every scenario process shares: its folder, its store, its seeded rng, its two logs."""

    def __init__(self, name: str, seed: int, rnd: int, rdir: Path, size: dict):
        self.name, self.seed, self.round, self.dir, self.size = name, seed, rnd, rdir, size
        self.store = size.get("url") or rdir / "store"  # a threads round on object storage gets an s3:// URL
        self.rng = random.Random(f"{seed}:{rnd}:{name}")
        self.acks, self.events = rdir / "acks.jsonl", rdir / "events.jsonl"

    def ack(self, info, who: str, **check) -> None:
        emit(self.acks, {"cid": info.id, "who": who, **check})

    def event(self, ev: str, **kw) -> None:
        emit(self.events, {"ev": ev, **kw})


# --- (a) threads: writer threads and a collector thread while the main thread commits ---------------


def scenario_threads(sc: Scenario) -> None:
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rng = sc.rng
    store = ckptstore.Store(sc.store, create=True, shard_bytes=SHARD_BYTES, workers=2)
    acc = torch.zeros(256 << 10)  # only add_(1): all elements equal the count, or one less while an add_ runs
    rows = torch.zeros(256, 1024)  # row writes and fill_: each row filled with one number; zero rows at first
    zeros = torch.zeros(64 << 10)  # never written: the all-zero shard every fresh buffer has
    mine = torch.zeros(64 << 10)  # the main thread's: written only between commits, so exact in a snapshot
    rb = ReplayBuffer(storage=LazyTensorStorage(512))
    count = {"acc": 0, "rows": 0, "rb": 1}
    rb.extend(TensorDict({"obs": torch.full((16, 64), 1.0), "step": torch.full((16,), 1.0)}, [16]))
    stop = threading.Event()
    errors: list[str] = []

    def writer(trng: random.Random) -> None:
        while not stop.is_set():
            op = trng.choice(("add", "row", "rowfill", "rows", "fill"))
            if op == "add":
                count["acc"] += 1  # before the write: the count bounds every value from above
                acc.add_(1)
            elif op == "fill" and trng.random() < 0.2:
                count["rows"] += 1
                v = count["rows"]
                rows.fill_(v)
            else:
                count["rows"] += 1
                v = count["rows"]
                i = trng.randrange(rows.shape[0])
                if op == "row":
                    rows[i] = v
                elif op == "rowfill":
                    rows[i].fill_(v)
                else:
                    rows[i : i + 8].copy_(torch.full((min(8, rows.shape[0] - i), rows.shape[1]), float(v)))
            if trng.random() < 0.02:
                time.sleep(0.001)

    def collector(trng: random.Random) -> None:
        while not stop.is_set():
            count["rb"] += 1
            v = float(count["rb"])
            n = trng.choice((1, 4, 16, 32))
            rb.extend(TensorDict({"obs": torch.full((n, 64), v), "step": torch.full((n,), v)}, [n]))
            time.sleep(trng.choice((0, 0, 0.001)))

    def guard(fn, *args):
        def body():
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001  (a harness bug: reported, the round goes on)
                errors.append(_err(exc))
        return threading.Thread(target=body, daemon=True)

    threads = [guard(writer, random.Random(rng.random())), guard(collector, random.Random(rng.random()))]
    for t in threads:
        t.start()
    state = {"acc": acc, "rows": rows, "zeros": zeros, "mine": mine, "rb": rb}
    pending = None  # (future, check): a commit_async resolved only after the next step

    def ranges(lo: dict) -> dict:
        # (rows: no lower bound but 0; a commit that reuses an unchanged tensor's hashes by its version
        # counter may keep a torn row of the commit before, which is a value the writer wrote)
        return {"acc": [lo["acc"] - 1, count["acc"]], "rows": [0, count["rows"]], "zeros": [0, 0],
                "rb/storage/data/obs": [1, count["rb"]], "rb/storage/data/step": [1, count["rb"]]}

    def resolve(p) -> None:
        fut, check = p
        try:
            info = fut.result()
        except Exception as exc:  # not acknowledged: no promise to keep
            sc.event("commit-error", error=_err(exc))
            return
        sc.ack(info, "commit_async", **check)

    quiet = rng.random() < 0.3  # stop the writers for the last commits: a quiet commit must read back too
    n = sc.size["commits"]
    for i in range(1, n + 1):
        if quiet and i == n - 1:
            stop.set()
            for t in threads:
                t.join()
        mine.fill_(float(i))  # the training step writes its own tensor, between commits
        lo = dict(count)
        mode = rng.choice(("commit", "commit", "async", "async_overlap"))
        if mode == "commit":
            try:
                info = store.commit(state, tag="latest", metadata={"i": i})
            except Exception as exc:
                sc.event("commit-error", error=_err(exc))
                continue
            r = ranges(lo)
            r["mine"] = [i, i]
            sc.ack(info, "commit", check="ranges", ranges=r)
        else:
            try:
                fut = store.commit_async(state, tag="latest", metadata={"i": i})
            except Exception as exc:
                sc.event("commit-error", error=_err(exc))
                continue
            r = ranges(lo)  # read at the return: the snapshot is taken by then
            r["mine"] = [i, i]
            if mode == "async":
                resolve((fut, {"check": "ranges", "ranges": r}))
            else:
                if pending is not None:
                    resolve(pending)
                pending = (fut, {"check": "ranges", "ranges": r})
                mine.fill_(-1.0)  # the next step overwrites the objects before the future is resolved
    if pending is not None:
        resolve(pending)
    stop.set()
    for t in threads:
        t.join()
    for e in errors:
        sc.event("crash", error=f"writer thread: {e}")
    store.close()


# --- (b) fork: children forked from a process holding a Store (and a Checkpointer) ---------------


FORK_ROLES = ("commit", "commit_big", "commit_async", "read", "exit", "exit_atexit", "outlive", "outlive_async")


def _fork_child(sc: Scenario, role: str, store, ckpt, step: int, parent: int) -> None:
    """The body of a forked child (never returns)."""
    code = 0
    try:
        torch.set_num_threads(1)
        sc.event("child-start", pid=os.getpid(), role=role)
        stacks = open(sc.dir / f"stacks-{os.getpid()}.txt", "w")  # where a hung child is stuck (kept open until _exit)
        faulthandler.dump_traceback_later(HANG_BOUND * 0.75, file=stacks)
        try:
            if role in ("exit",):
                pass
            elif role == "exit_atexit":
                atexit._run_exitfuncs()  # what an interpreter exit of the child runs
                gc.collect()
            elif role in ("commit", "commit_big", "outlive_commit"):
                big = role == "commit_big"
                info = store.commit(step_state(step, big), tag=f"child-{step}", metadata={"step": step})
                sc.ack(info, f"fork child {role} pid {os.getpid()}", check="step", step=step, big=big)
            elif role == "commit_async":
                info = store.commit_async(step_state(step), tag=f"child-{step}", metadata={"step": step}).result()
                sc.ack(info, f"fork child {role} pid {os.getpid()}", check="step", step=step)
            elif role == "read":
                cid = store.resolve("p")
                meta = store.info(cid).metadata
                got = _leaves(store.checkout(cid))
                want = step_state(meta["step"])
                if any(_record(got[k]) != _record(want[k]) for k in want):
                    sc.event("child-error", role=role, error=f"checkout of {cid} in the child is not step {meta['step']}'s")
            elif role == "lease_commit":
                ckpt.objects["w"].copy_(step_state(step)["w"])
                info = ckpt.commit({"step_of_w": step})
                sc.ack(info, f"fork child {role} pid {os.getpid()}", check="step", step=step, leaves=["w"])
            elif role in ("outlive", "outlive_async"):  # after the parent is gone, commit through what it left
                deadline = time.monotonic() + ROUND_BOUND
                while os.getppid() == parent and time.monotonic() < deadline:
                    time.sleep(0.05)
                faulthandler.dump_traceback_later(HANG_BOUND * 0.75, file=stacks)  # from now on
                if role == "outlive":
                    info = store.commit(step_state(step), tag=f"child-{step}", metadata={"step": step})
                else:
                    info = store.commit_async(step_state(step), tag=f"child-{step}", metadata={"step": step}).result()
                sc.ack(info, f"fork child {role} pid {os.getpid()}", check="step", step=step)
            elif role == "hold_lease":  # only lives, holding what it inherited (the run lease's descriptor)
                time.sleep(LEASE_BOUND + 5)
            sc.event("child-end", pid=os.getpid(), role=role, result="ok")
        except CkptStoreError as exc:  # a clean refusal
            sc.event("child-end", pid=os.getpid(), role=role, result="refused", error=_err(exc))
        except BaseException as exc:  # noqa: BLE001
            sc.event("child-error", role=role, error=_err(exc))
            sc.event("child-end", pid=os.getpid(), role=role, result="error")
    except BaseException:  # noqa: BLE001
        code = 3
    finally:
        os._exit(code)


def scenario_fork(sc: Scenario) -> None:
    rng = sc.rng
    lease_round = rng.random() < 0.5
    store = ckptstore.Store(sc.store, create=True, shard_bytes=SHARD_BYTES, workers=2)
    ckpt = None
    step = sc.round * 10_000
    if lease_round:
        w = torch.zeros(128, 64)
        ckpt = ckptstore.Checkpointer(store, {"w": w}, every_n_steps=1, run="r", keep_last=None, on_signal=())
    waited: dict[int, tuple[str, float]] = {}  # children the parent reaps: pid -> (role, started)

    def parent_commit() -> None:
        nonlocal step
        step += 1
        info = store.commit(step_state(step), tag="p", metadata={"step": step})
        sc.ack(info, "fork parent", check="step", step=step)
        if ckpt is not None:
            ckpt.objects["w"].copy_(step_state(step)["w"])
            info = ckpt.commit({"step_of_w": step})
            sc.ack(info, "fork parent's Checkpointer", check="step", step=step, leaves=["w"])

    def reap(block: bool) -> None:
        for pid, (role, t0) in list(waited.items()):
            while True:
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    del waited[pid]
                    break
                if time.monotonic() - t0 > HANG_BOUND:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    del waited[pid]
                    sc.event("hang", what=f"fork child {role} (pid {pid})", bound=HANG_BOUND, stacks=str(sc.dir / f"stacks-{pid}.txt"))
                    break
                if not block:
                    break
                time.sleep(0.02)

    roles = FORK_ROLES + (("lease_commit",) if ckpt else ())
    parent_commit()
    for _ in range(sc.size["forks"]):
        for _ in range(rng.randrange(3)):
            parent_commit()
        role = rng.choice(roles)
        step += 1
        child_step = step
        pid = os.fork()
        if pid == 0:
            _fork_child(sc, role, store, ckpt, child_step, os.getppid())
        sc.event("child", pid=pid, role=role)
        if role.startswith("outlive"):
            continue  # the coordinator waits for it
        waited[pid] = (role, time.monotonic())
        if rng.random() < 0.5:
            reap(block=True)  # the parent goes on after the child ended (an exit-only child must change nothing)
        else:
            reap(block=False)
    if not lease_round:  # one child always commits after its parent closed its Store and exited
        step += 1
        child_step, role = step, rng.choice(("outlive", "outlive_async"))
        pid = os.fork()
        if pid == 0:
            _fork_child(sc, role, store, ckpt, child_step, os.getppid())
        sc.event("child", pid=pid, role=role)
    if not lease_round and rng.random() < 0.5:  # the parent closes its Store while its last children still work
        end = rng.choice(("close", "with", "exit"))
        sc.event("parent-end", how=end, children_running=len(waited))
        if end == "exit":
            return  # the interpreter's exit closes what it closes; the coordinator waits for the children
        store.close() if end == "close" else store.__exit__(None, None, None)
        reap(block=True)
        return
    parent_commit()
    reap(block=True)
    if lease_round:
        pid = os.fork()  # a child that only lives, holding what it inherited, while its parent is SIGKILLed
        if pid == 0:
            _fork_child(sc, "hold_lease", store, ckpt, 0, os.getppid())
        sc.event("child", pid=pid, role="hold_lease")
        sc.event("holder-ready", pid=os.getpid(), run="r")
        time.sleep(ROUND_BOUND)  # the coordinator SIGKILLs this process
        return
    end = rng.choice(("close", "with", "exit"))
    sc.event("parent-end", how=end)
    if end == "close":
        store.close()
    elif end == "with":
        with store:
            pass
    # "exit": the interpreter's exit closes what it closes


# --- (c) signals: a user's SIGTERM handler, then a Checkpointer -------------------------------------


def scenario_signal(sc: Scenario) -> None:
    rng = sc.rng
    marker = sc.dir / "user-handler-ran"

    def user_handler(signum, frame):  # what a SLURM script's own handler does: note it, carry on
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, b"ran\n")
        os.close(fd)

    signal.signal(signal.SIGTERM, user_handler)
    usr1_before = signal.getsignal(signal.SIGUSR1)
    store = ckptstore.Store(sc.store, create=True, shard_bytes=SHARD_BYTES, workers=2)
    w = torch.zeros(128, 64)
    when = rng.choice(("during", "close", "with", "collect"))
    steps = rng.randint(2, 6)
    ckpt = ckptstore.Checkpointer(store, {"w": w}, every_n_steps=1, keep_last=None)

    def train(n: int) -> None:
        for k in range(n):
            w.copy_(step_state(ckpt.steps + 1)["w"])
            info = ckpt.step()
            sc.ack(info, f"signal scenario step {ckpt.steps}", check="step", step=ckpt.steps, leaves=["w"])

    if when == "during":
        sc.event("ready", when=when)
        try:
            train(10_000)  # until SIGTERM makes the Checkpointer commit and exit
        except SystemExit:
            pass
        sc.event("stopped", when=when)
    else:
        train(steps)
        if when == "close":
            ckpt.close()
        elif when == "with":
            with ckpt:
                pass
        else:
            del ckpt
            gc.collect()
        term, usr1 = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
        restored = term is user_handler and usr1 == usr1_before
        sc.event("restored", when=when, restored=restored, sigterm=_handler_name(term), sigusr1=_handler_name(usr1))
        sc.event("ready", when=when)
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    store.close()


# --- (d) SIGKILL during the migration of fixture stores of older schemas ---------------------------


def copy_fixture(name: str, dest: Path) -> None:
    shutil.copytree(FIXTURES / name, dest)
    (dest / "tmp").mkdir(exist_ok=True)  # (git keeps no empty folder)


def _open_in_child(path: Path) -> tuple[int, int]:
    """Fork a child that says ``s``, opens ``path`` writable (migrating it), says ``d`` and exits; (pid, read end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            os.write(w, b"s")
            ckptstore.Store(path).close()
            os.write(w, b"d")
        except BaseException:  # noqa: BLE001
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def scenario_migrate(sc: Scenario) -> None:
    rng = sc.rng
    opened: dict[str, float] = {}  # fixture -> seconds an uninterrupted open took here
    for name in MIGRATION_FIXTURES:
        dest = sc.dir / f"calibrate-{name}"
        copy_fixture(name, dest)
        pid, r = _open_in_child(dest)
        os.read(r, 1)
        t0 = time.monotonic()
        said = os.read(r, 1)
        opened[name] = time.monotonic() - t0
        os.close(r)
        os.waitpid(pid, 0)
        shutil.rmtree(dest)
        if said != b"d":
            sc.event("crash", error=f"an uninterrupted open of a copy of {name} failed")
    for k in range(sc.size["kills"]):
        ones = sorted(n for n, v in MIGRATION_FIXTURES.items() if v == 1)
        name = rng.choice((*ones, *sorted(MIGRATION_FIXTURES)))  # schema 1 twice as often: its migration backfills records
        dest = sc.dir / f"m{k}-{name}"
        copy_fixture(name, dest)
        delay = rng.uniform(0, 1.3 * opened[name])
        pid, r = _open_in_child(dest)
        os.read(r, 1)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        finished = bool(select.select([r], [], [], 0)[0]) and os.read(r, 1) == b"d"
        os.close(r)
        sc.event("kill", fixture=name, copy=dest.name, delay=round(delay, 4), finished=finished)


def scenario_main(name: str, seed: int, rnd: int, rdir: str, size: dict) -> int:
    torch.set_num_threads(1)
    sc = Scenario(name, seed, rnd, Path(rdir), size)
    try:
        {"threads": scenario_threads, "fork": scenario_fork, "signal": scenario_signal, "migrate": scenario_migrate}[name](sc)
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, SystemExit) and not exc.code:
            return 0
        sc.event("crash", error=f"scenario {name}: {_err(exc)} | {traceback.format_exc()[-600:]}".replace("\n", " "))
        return 1
    return 0


# --- the coordinator ----------------------------------------------------------------------------------


_REFERENCE: dict = {}


def reference() -> dict:
    """Each migration fixture migrated uninterrupted, once per process: its tags and each tag's leaves."""
    if not _REFERENCE:
        with tempfile.TemporaryDirectory() as tmp:
            for name in MIGRATION_FIXTURES:
                dest = Path(tmp) / name
                copy_fixture(name, dest)
                with ckptstore.Store(dest) as s:
                    tags = {t: s.resolve(t) for t in s.tags()}
                    leaves = {t: {p: (_record(v) if isinstance(v, torch.Tensor) else v) for p, v in _leaves(s.checkout(c)).items()}
                              for t, c in tags.items()}
                _REFERENCE[name] = {"tags": tags, "leaves": leaves}
    return _REFERENCE


_SERVER: list = []  # the moto S3 server of this run, started by the first bucket round


def _bucket_env(rdir: Path) -> dict:
    """The AWS_* environment of this run's S3 server (tests/s3server.py; started once), and a cache of the round's own."""
    if not _SERVER:
        from tests.s3server import MotoServer

        _SERVER.append(MotoServer(buckets=["ckpt"], serialize=True).start())
    return {**_SERVER[0].env, "XDG_CACHE_HOME": str(rdir / "cache")}


def _stop_server() -> None:
    while _SERVER:
        _SERVER.pop().stop()


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _wait_for(cond, bound: float) -> bool:
    deadline = time.monotonic() + bound
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _take_run_over(store: Path, run: str) -> tuple[float | None, str]:
    """Seconds until a new Checkpointer got run ``run`` (``None``: not within LEASE_BOUND), and the last refusal."""
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < LEASE_BOUND:
        try:
            with ckptstore.Store(store) as s:
                ckpt = ckptstore.Checkpointer(s, {"w": torch.zeros(128, 64)}, every_n_steps=1, run=run, keep_last=None, on_signal=())
                ckpt.close()
            return time.monotonic() - t0, ""
        except RunBusyError as exc:
            last = _err(exc)
            time.sleep(0.1)
    return None, last


def run_round(seed: int, rnd: int, scenario: str, work: Path, size: dict, stats: dict) -> list[Violation]:
    """One round of ``scenario`` in its own folder; the violations found."""
    rdir = work / f"r{rnd:03d}-{scenario}"
    rdir.mkdir(parents=True)
    rng = random.Random(f"{seed}:{rnd}:{scenario}:coordinator")
    events_path = rdir / "events.jsonl"
    observed: list[dict] = []
    env, url = _env(), None
    if scenario == "threads" and rng.random() < 1 / 3:  # the bucket home's writer: payloads are views until uploaded
        url = f"s3://ckpt/proc-{seed}-{rnd}"
        env.update(_bucket_env(rdir))
        stats["bucket_rounds"] += 1
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.harness.procharness", "scenario", scenario, str(seed), str(rnd), str(rdir),
         json.dumps({**size, "url": url})],
        cwd=ROOT, env=env, stdout=open(rdir / "out.txt", "wb"), stderr=subprocess.STDOUT,
    )
    t0 = time.monotonic()

    def events() -> list[dict]:
        return read_lines(events_path)

    if scenario == "signal":
        if _wait_for(lambda: any(e["ev"] == "ready" for e in events()) or proc.poll() is not None, ROUND_BOUND):
            ready = [e for e in events() if e["ev"] == "ready"]
            if ready and proc.poll() is None:
                time.sleep(rng.uniform(0, 0.5))
                proc.send_signal(signal.SIGTERM)
                stats["signals"] += 1
                marker = rdir / "user-handler-ran"
                ran = _wait_for(marker.exists, 8)
                observed.append({"ev": "handler", "when": ready[0]["when"], "user_ran": ran})
    if scenario == "fork":
        _wait_for(lambda: any(e["ev"] == "holder-ready" for e in events()) or proc.poll() is not None, ROUND_BOUND)
        ready = [e for e in events() if e["ev"] == "holder-ready"]
        if ready and proc.poll() is None:
            time.sleep(rng.uniform(0, 0.3))
            proc.kill()
            proc.wait()
            holders = [e["pid"] for e in events() if e["ev"] == "child" and e["role"] == "hold_lease"]
            alive = bool(holders) and _alive(holders[0])
            taken, err = _take_run_over(rdir / "store", ready[0]["run"])
            observed.append({"ev": "lease", "run": ready[0]["run"], "taken_in": taken, "child_alive": alive, "error": err})
            for pid in holders:  # it only lived to hold what it inherited: done
                if _alive(pid):
                    _kill(pid)
                    emit(events_path, {"ev": "child-end", "pid": pid, "role": "hold_lease", "result": "ok"})
    try:
        proc.wait(timeout=max(1.0, ROUND_BOUND - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        observed.append({"ev": "hang", "what": f"the {scenario} scenario process", "bound": ROUND_BOUND})
    if scenario == "fork":  # children the parent did not reap (outliving ones, those of a SIGKILLed parent)
        children = {e["pid"]: e["role"] for e in events() if e["ev"] == "child"}
        ended = lambda: {e["pid"] for e in events() if e["ev"] == "child-end"}  # noqa: E731
        _wait_for(lambda: not [p for p in children if p not in ended() and _alive(p)], HANG_BOUND)
        for pid, role in children.items():
            if pid not in ended() and _alive(pid):
                _kill(pid)
                observed.append({"ev": "hang", "what": f"fork child {role} (pid {pid})", "bound": HANG_BOUND,
                                 "stacks": str(rdir / f"stacks-{pid}.txt")})
        stats["forks"] += len(children)
        roles = Counter(children.values())
        for r, n in roles.items():
            stats["fork_roles"][r] += n
        results = Counter(e["result"] + (f" {e['error'].split(':')[0]}" if e.get("error") else "")
                          for e in events() if e["ev"] == "child-end")
        for r, n in results.items():
            stats["fork_results"][r] += n
    evs = events() + observed
    for e in evs:
        if e["ev"] == "restored":  # the scenario's own observation of getsignal after close
            e.update(ev="handler")
    acks = read_lines(rdir / "acks.jsonl")
    stats["acks"][scenario] += len(acks)
    stats["commit_errors"] += sum(e["ev"] == "commit-error" for e in evs)
    if scenario == "threads":
        stats["racy_commits"] += len(acks)
    found: list[tuple[str, str]] = []
    if scenario == "migrate":
        ref = reference()
        kills = [e for e in evs if e["ev"] == "kill"]
        stats["kills"] += len(kills)
        stats["kills_mid_open"] += sum(not e["finished"] for e in kills)
        found += check_invariants(None, [], [e for e in evs if e["ev"] != "kill"])
        for e in kills:
            tags = ref[e["fixture"]]["tags"]
            acks_m = [{"cid": c, "who": f"fixture {e['fixture']} tag {t}", "check": "ref", "fixture": e["fixture"], "tag": t}
                      for t, c in tags.items()]
            for kind, detail in check_invariants(rdir / e["copy"], acks_m, [], expect_tags=tags, reference=ref):
                found.append((kind, f"{e['copy']} killed {e['delay']} s into its first open"
                                    f"{' (after it finished)' if e['finished'] else ''}: {detail}"))
    else:
        store = url or rdir / "store"
        saved = {k: os.environ.get(k) for k in env if k.startswith(("AWS_", "XDG_"))}
        os.environ.update({k: env[k] for k in saved})  # (a bucket round: this process reads the bucket too)
        try:
            found += check_invariants(store if url or store.exists() else None, acks, evs)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return [Violation(seed, rnd, scenario, k, d) for k, d in found]


def new_stats() -> dict:
    return {"rounds": Counter(), "acks": Counter(), "racy_commits": 0, "commit_errors": 0, "forks": 0, "fork_roles": Counter(),
            "fork_results": Counter(), "bucket_rounds": 0, "signals": 0, "kills": 0, "kills_mid_open": 0, "violations": Counter(),
            "violations_by_kind": Counter(), "seconds": 0.0}


def format_stats(stats: dict) -> str:
    return (f"procharness seed={stats['seed']}: rounds {dict(stats['rounds'])}, acknowledged commits {dict(stats['acks'])} "
            f"(racy {stats['racy_commits']}, {stats['bucket_rounds']} rounds on S3; "
            f"commit errors {stats['commit_errors']}), forks {stats['forks']} {dict(stats['fork_roles'])} -> "
            f"{dict(stats['fork_results'])}, signals {stats['signals']}, migration kills {stats['kills']} "
            f"({stats['kills_mid_open']} before the open finished); violations {sum(stats['violations'].values())}: "
            f"by scenario {dict(stats['violations'])}, by kind {dict(stats['violations_by_kind'])}; {stats['seconds']:.0f} s")


def schedule(seed: int, rounds: int | None, scenario: str, first: int = 0):
    """Round numbers and their scenarios: each kind in turn in a seeded order (``all``), or ``scenario`` only."""
    order = list(SCENARIOS)
    random.Random(f"{seed}:order").shuffle(order)
    rnd = first
    while rounds is None or rnd < first + rounds:
        yield rnd, (order[rnd % len(order)] if scenario == "all" else scenario)
        rnd += 1


def run_rounds(work: Path, seed: int, rounds: int | None = 8, scenario: str = "all", first_round: int = 0, slow: bool = False,
               minimums: dict | None = None, verbose: bool = True) -> dict:
    """Run the schedule; ``rounds=None`` runs until ``minimums`` (racy commits, forks, migration kills) are reached.

    Returns the stats (``format_stats``); raises :class:`ProcFailure` (every violation's line,
    the stats attached) when any invariant broke. The folder ``work`` is kept then."""
    size = SLOW if slow else DEFAULT
    stats = new_stats()
    stats["seed"] = seed
    violations: list[Violation] = []
    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    met = {"commits": "racy_commits", "forks": "forks", "kills": "kills"}
    kind_of = {"commits": "threads", "forks": "fork", "kills": "migrate"}
    minimums = {k: n for k, n in (minimums or SLOW_MINIMUMS).items() if scenario in ("all", kind_of[k])}
    if rounds is None and not minimums:
        rounds = 8  # (signal rounds have no minimum count)
    stop_server = atexit.register(_stop_server)  # (also when a KeyboardInterrupt ends the run)
    for rnd, sc in schedule(seed, rounds, scenario, first_round):
        if rounds is None and all(stats[met[k]] >= n for k, n in minimums.items()):
            break
        if rounds is None and sc in ("threads", "fork", "migrate"):
            key = {"threads": "commits", "fork": "forks", "migrate": "kills"}[sc]
            if stats[met[key]] >= minimums[key]:
                continue  # this kind has its count; the others go on
        found = run_round(seed, rnd, sc, work, size, stats)
        stats["rounds"][sc] += 1
        for v in found:
            stats["violations"][v.scenario] += 1
            stats["violations_by_kind"][f"{v.scenario}/{v.kind}"] += 1
            if verbose:
                print(v.line(), flush=True)
        violations += found
    _stop_server()
    atexit.unregister(stop_server)
    stats["seconds"] = time.monotonic() - t0
    if violations:
        lines = [v.line() for v in violations]
        raise ProcFailure(f"{len(violations)} violations (seed {seed}; folder {work} kept):\n" + "\n".join(lines[:40])
                          + (f"\n... {len(lines) - 40} more" if len(lines) > 40 else "") + "\n" + format_stats(stats), stats)
    return stats


def seed_from_env(default: int) -> int:
    return int(os.environ.get("CKPT_PROC_SEED", default))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["scenario"]:  # a scenario process started by run_round
        name, seed, rnd, rdir, size = argv[1:6]
        return scenario_main(name, int(seed), int(rnd), rdir, json.loads(size))
    p = argparse.ArgumentParser(prog="python -m tests.harness.procharness", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: a new one, printed)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--first-round", type=int, default=0, help="the number of the first round (replays one round)")
    p.add_argument("--scenario", choices=("all", *SCENARIOS), default="all")
    p.add_argument("--slow", action="store_true", help="the slow run: bigger rounds until 300 racy commits, 100 forks, 200 kills")
    p.add_argument("--dir", default=None, help="work folder (default: a new temporary one)")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="procharness-"))
    print(f"procharness seed={seed} folder={work}", flush=True)
    try:
        stats = run_rounds(work, seed, None if a.slow else a.rounds, a.scenario, a.first_round, slow=a.slow)
    except ProcFailure as exc:
        print(format_stats(exc.stats))
        return 1
    print(format_stats(stats))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
