"""The part of the crash/stress harnesses that does not depend on the store's home, written once.

Two harnesses drive a store through rounds of real processes killed at random: tests/harness/stress.py
(a store folder) and tests/harness/bucket_stress.py (``s3://`` on the tests' moto server, and the local
home pushing to it). What they share lives here (after the tests' move: tests/harness/base.py):

* the model (:func:`make_state`, :func:`compare`, :func:`leaf_paths`, :func:`scramble`): every
  committed state is a deterministic function of its step number, compared bit for bit;
* :class:`HarnessFailure` (a failure whose message starts with the seed) and :class:`Mismatch`;
* :class:`BaseWorker`: the worker's plumbing (its ``p<wid>.ops`` log, unique steps, the one
  diagnostic line and exit 17 on a failure, opening the store until the round stops);
* :class:`Proc`: a round's process, whatever started it (a fresh interpreter, ``os.fork``, a
  forkserver), polled, SIGKILLed and reaped the same way;
* :class:`Coordinator`: the kill/restart loop of a round (wait until every worker is ready, go,
  give some a kill instant, SIGKILL them then, replace some by forks) and the reading of the
  workers' logs; a home's harness says, through small hooks, what differs (how it spawns, when a
  process is replaced, at what instant a replacement dies);
* :func:`unlogged_moves`: the invariant "every tag move a worker saw return is in the reflog";
* :func:`run_round_loop` (rounds until the stop conditions), :func:`counts` and :func:`seed_from_env`.

What stays with each home: how a store is opened, the workers' roles and operations, what a
tolerated outcome is, the checks after a round (the folder: fsck, every tag exact, every move in
the reflog, gc(grace=0), recover; the bucket: clean / may-hit / must-hit tags under injected
damage, skewed clocks, the reflog collection) and how damage is injected and repaired.

Every draw from a round's random generator happens in the same order as before this module
existed, so a seed replays the same schedule.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tensordict import TensorDict

FAIL_CODE = 17
STEP_BLOCK = 10**6  # step = worker id * STEP_BLOCK + counter: unique across workers


class HarnessFailure(AssertionError):
    """A failure found by a harness; the message starts with the seed. ``stats`` so far attached."""

    def __init__(self, message: str, stats: dict | None = None):
        super().__init__(message)
        self.stats = stats


class Mismatch(Exception):
    """A worker read something other than what was committed (or fsck / verify was not clean)."""


# --- the model: the state of step N ------------------------------------------------------


def _gen(*key: int) -> torch.Generator:
    seed = 0x9E3779B97F4A7C15
    for k in key:
        seed = (seed * 1_000_003 + k + 1) % (1 << 63)
    return torch.Generator().manual_seed(seed)


def make_state(step: int) -> dict:
    """The objects committed at ``step``: a deterministic function of it.

    Some leaves never change (dedup across every commit), some change every few steps,
    row blocks of ``blocks`` change at different rates (dedup at shard level), and the
    rest change every step. Dtypes: float32/64/16, bfloat16, complex64, int64, uint8,
    bool; a transposed (non-contiguous) tensor, a zero-element one, NaN payloads and
    -0.0; a nested dict, a TensorDict, an ``nn.Module`` and JSON values.
    """
    blocks = torch.cat([torch.randn(32, 64, generator=_gen(1, j, step // (j + 1))) for j in range(8)])
    weird = torch.randn(64, generator=_gen(9, step))
    bits = weird.view(torch.int32)
    bits[0] = 0x7FC00000 | (step % 0x3FFFFF)  # a NaN with a payload
    bits[1] = -(1 << 31)  # -0.0
    weird[2] = float("inf")
    net = torch.nn.Linear(8, 4)
    with torch.no_grad():
        g = _gen(8, step)
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return {
        "shared": torch.randn(16384, generator=_gen(0)),
        "blocks": blocks,
        "model": {
            "w": torch.randn(64, 32, generator=_gen(2, step // 3)),
            "b": torch.arange(3, dtype=torch.float64) * step,
            "nest": {"i": torch.randint(-(1 << 40), 1 << 40, (40,), generator=_gen(3, step))},
        },
        "half": torch.randn(300, generator=_gen(4, step % 7)).to(torch.bfloat16),
        "f16": torch.randn(33, generator=_gen(4, step)).half(),
        "cplx": torch.randn(17, dtype=torch.complex64, generator=_gen(5, step // 2)),
        "mask": torch.rand(123, generator=_gen(6, step)) > 0.5,
        "u8": torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=_gen(7, step // 2)),
        "perm": torch.randn(16, 24, generator=_gen(10, step)).t(),
        "weird": weird,
        "empty": torch.zeros(0, 3),
        "td": TensorDict({"a": torch.randn(4, 2, generator=_gen(11, step)), "n": {"x": torch.arange(4) + step}}, [4]),
        "net": net,
        "meta": {"step": step, "name": f"s{step}", "vals": [step, step / 7, True, None], "pair": (step % 5, "x"), "keys": {3: "three"}},
    }


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a contiguous copy: exact for NaN payloads, -0.0, bool, complex, bfloat16."""
    t = t.detach().cpu().contiguous()
    start = t.storage_offset() * t.element_size()
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return storage[start : start + t.numel() * t.element_size()].numpy().tobytes()


def tensor_record(t: torch.Tensor) -> tuple:
    stride = tuple(t.stride()) if t.numel() else None  # a zero-element tensor's strides are arbitrary
    return ("t", str(t.dtype), tuple(t.shape), stride, raw_bytes(t))


def _flatten(obj, prefix: str, out: dict) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = tensor_record(obj)
    elif isinstance(obj, torch.nn.Module):
        for name, t in obj.state_dict().items():
            out[f"{prefix}/{name.replace('.', '/')}"] = tensor_record(t)
    elif isinstance(obj, TensorDict):
        for key in obj.keys(include_nested=True, leaves_only=True):
            key = key if isinstance(key, tuple) else (key,)
            out["/".join((prefix, *key))] = tensor_record(obj.get(key))
    elif isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        for k, v in obj.items():
            _flatten(v, f"{prefix}/{k}" if prefix else k, out)
    else:
        out[prefix] = ("j", repr(obj))


@functools.lru_cache(maxsize=256)
def expected_leaves(step: int) -> dict:
    """``{leaf path: record}`` of step ``step``; records hold dtype, shape, strides and bytes."""
    out: dict = {}
    _flatten(make_state(step), "", out)
    return out


def leaf_paths(step: int) -> list[str]:
    """Every leaf path and every component prefix: targets for a partial checkout."""
    paths = set(expected_leaves(step))
    for p in list(paths):
        parts = p.split("/")
        paths.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return sorted(paths)


def compare(step: int, td, prefix: str | None = None) -> str | None:
    """``None`` when ``td`` (a checkout) holds exactly step ``step``'s leaves under ``prefix``; else what differs."""
    want = expected_leaves(step)
    if prefix is not None:
        want = {p: r for p, r in want.items() if p == prefix or p.startswith(prefix + "/")}
    if not isinstance(td, TensorDict):
        return f"checkout returned a {type(td).__name__}, not a TensorDict"
    got_tensors = set()
    for key in td.keys(include_nested=True, leaves_only=True):
        got_tensors.add("/".join(key) if isinstance(key, tuple) else key)
    want_tensors = {p for p, r in want.items() if r[0] == "t"}
    if got_tensors != want_tensors:
        return f"tensor leaves differ: missing {sorted(want_tensors - got_tensors)}, unexpected {sorted(got_tensors - want_tensors)}"
    for path, rec in want.items():
        key = tuple(path.split("/"))
        if rec[0] == "t":
            got = tensor_record(td.get(key))
            if got != rec:
                what = [n for n, a, b in zip(("kind", "dtype", "shape", "stride", "bytes"), got, rec) if a != b]
                return f"leaf {path}: {', '.join(what)} differ (got {got[1]} {got[2]} {got[3]}, want {rec[1]} {rec[2]} {rec[3]})"
        else:
            try:
                got = repr(td.get_non_tensor(key))
            except KeyError:
                return f"JSON leaf {path} is missing"
            if got != rec[1]:
                return f"JSON leaf {path}: got {got}, want {rec[1]}"
    return None


def scramble(state: dict) -> None:
    """Overwrite every live tensor and JSON list of ``state`` (after ``commit_async`` returned)."""
    with torch.no_grad():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v.zero_() if v.dtype != torch.bool else v.logical_not_()
            elif isinstance(v, torch.nn.Module):
                for p in v.parameters():
                    p.fill_(12345.0)
            elif isinstance(v, TensorDict):
                v.apply_(lambda t: t.zero_())
            elif isinstance(v, dict):
                scramble(v)
                if isinstance(v.get("vals"), list):
                    v["vals"].append("scrambled")


# --- the worker's plumbing ---------------------------------------------------------------


class BaseWorker:
    """One worker process of a round: its log, its steps, its failure line, its store opening.

    Writes to ``<round dir>/p<wid>.ops``: ``O op`` per operation that returned, ``R op kind``
    per tolerated outcome, and the home's own lines (``D cid tags step`` per commit that
    returned...). A failure prints ``<FAIL_TAG> seed=… worker=… role=… op=…: …`` (the line the
    coordinator quotes) and exits :data:`FAIL_CODE`. A home's worker sets ``FAIL_TAG``, defines
    ``run_op`` (what it tolerates) and its ``role_<name>`` methods.
    """

    FAIL_TAG = "STRESS-FAIL"

    def __init__(self, seed: int, wid: int, role: str, rdir: str | Path):
        self.seed, self.wid, self.role = seed, wid, role
        self.rdir = Path(rdir)
        self.stop_file = self.rdir / f"stop-{wid}"
        self.counter = itertools.count()
        self.log_fd = os.open(self.rdir / f"p{wid}.ops", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(self, line: str) -> None:
        os.write(self.log_fd, (line + "\n").encode())

    def stopped(self) -> bool:
        return self.stop_file.exists()

    def next_step(self) -> int:
        return self.wid * STEP_BLOCK + next(self.counter)

    def describe(self, exc: BaseException) -> str:
        """The failure's text after ``op=…:``."""
        return f"{type(exc).__qualname__}: {exc}"

    def fail(self, ctx: dict, exc: BaseException, where: str = "") -> None:
        """Print the one diagnostic line (and the traceback) and exit 17: nothing after it runs."""
        detail = " ".join(f"{k}={v}" for k, v in ctx.items())
        line = f"{self.FAIL_TAG} seed={self.seed} worker={self.wid} role={self.role} {where}{detail}: {self.describe(exc)}".replace("\n", " | ")
        with contextlib.suppress(Exception):
            self.log("F " + line)
            print(line, flush=True)
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(FAIL_CODE)

    def run_op(self, name: str, fn: Callable, *args) -> None:  # pragma: no cover - each home defines it
        raise NotImplementedError

    def open_until_stopped(self, opener: Callable):
        """``opener()``, retried (through ``run_op``, which logs a tolerated error) until it returns; exit 0 if the round stops first."""
        box: list = []
        while not box:
            if self.stopped():
                os._exit(0)  # the round ended before the store could be opened
            self.run_op("open", lambda ctx: box.append(opener()))
        return box[0]

    def run(self) -> int:
        torch.set_num_threads(1)
        self.play()
        return 0

    def play(self) -> None:
        getattr(self, f"role_{self.role}")()


def wait_for_go(rdir: str | Path, wid: int, give_up_when_stopped: bool = False) -> bool:
    """Say ``ready-<wid>`` and wait for the round's ``go``; false when told to stop first (``give_up_when_stopped``)."""
    rd = Path(rdir)
    (rd / f"ready-{wid}").touch()
    while not (rd / "go").exists():
        if give_up_when_stopped and (rd / f"stop-{wid}").exists():
            return False
        time.sleep(0.005)
    return True


def redirect_output(out: str | Path) -> None:
    """In a forked child: stdout and stderr appended to ``out``."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115


# --- the coordinator ---------------------------------------------------------------------


@dataclass
class Proc:
    """A process of a round. ``handle``: a ``subprocess.Popen`` (``exec``, ``cli``), a
    ``multiprocessing.Process`` (a forkserver's fork) or the pid of an ``os.fork`` child."""

    wid: int
    role: str
    method: str  # "exec", "fork" or "cli"
    out: Path
    handle: object
    fail_tag: str = "STRESS-FAIL"
    kill_at: float | None = None
    code: int | None = None
    killed: bool = False
    skew: float = 0.0
    extra: dict = field(default_factory=dict)  # what the home's spawn was given (to start a replacement alike)

    @property
    def pid(self) -> int:
        return self.handle if isinstance(self.handle, int) else self.handle.pid

    def poll(self) -> int | None:
        if self.code is None:
            if isinstance(self.handle, int):
                pid, status = os.waitpid(self.handle, os.WNOHANG)
                if pid:
                    self.code = os.waitstatus_to_exitcode(status)
            elif hasattr(self.handle, "poll"):
                self.code = self.handle.poll()
            elif not self.handle.is_alive():
                self.handle.join()
                self.code = self.handle.exitcode
        return self.code

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return self.code

    def kill(self, timeout: float | None = None) -> bool:
        """SIGKILL; true when the signal ended a running process (not one that had already exited)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.wait(timeout)
        self.killed = self.code == -signal.SIGKILL
        return self.killed

    def diagnostic(self) -> str:
        text = self.out.read_text(errors="replace") if self.out.exists() else ""
        fails = [line for line in text.splitlines() if line.startswith(self.fail_tag)]
        return fails[0] if fails else "output tail: " + " | ".join(text.strip().splitlines()[-12:])


@dataclass
class Round:
    """Bookkeeping of one round."""

    index: int
    rdir: Path
    rng: random.Random  # every choice made within the round: one round's timing cannot shift the next one's plan
    procs: list[Proc] = field(default_factory=list)
    collected: bool = False


class Coordinator:
    """The round loop both homes share; a home's ``Harness`` subclasses it.

    The subclass provides ``self.seed``, ``self.o`` (its options: ``kill_rate``, ``respawn``),
    ``self.stats`` (``kills``, ``ops``, ``ops_by_kind`` and ``TOLERATED_KEY`` with its
    ``_by_kind``), ``self.live``, ``failure(index, what)`` (the seed-first
    :class:`HarnessFailure`), ``spawn`` / ``reap``, and overrides the hooks below.
    """

    TOLERATED_KEY = "races"  # the stats' name for tolerated outcomes ("R" lines)
    RESPAWN_MARGIN = 0.3  # no replacement this close to the round's end (seconds)
    KILL_WAIT: float | None = None  # seconds to wait for a SIGKILLed process to be reaped (None: as long as it takes)

    # - hooks -

    def kill_instant(self, p: Proc, rng: random.Random, t0: float, run_for: float) -> float:
        return t0 + rng.uniform(0, run_for)

    def may_replace_killed(self, p: Proc) -> bool:
        """Whether a process just SIGKILLed (or found exited at its kill instant) may be replaced (before the draw)."""
        return True

    def replace(self, rnd: Round, p: Proc) -> Proc:
        """Start a fork in the place of ``p``."""
        raise NotImplementedError  # pragma: no cover

    def replacement_kill_instant(self, rng: random.Random, now: float, end: float) -> float:
        return now + rng.uniform(0, end - now)

    def on_kill(self, p: Proc) -> None:
        """A process was SIGKILLed mid-round (counted in ``kills`` already)."""

    def on_exit(self, rnd: Round, p: Proc, now: float, end: float) -> None:
        """A process ended by itself mid-round (reaped already)."""

    def on_tick(self, rnd: Round, now: float, end: float) -> None:
        """Once per pass of the loop."""

    def on_log_line(self, parts: list[str], events: list) -> None:
        """A line of a worker's ``.ops`` log other than ``O`` and ``R``."""

    # - the loop -

    def start_round(self, rnd: Round, procs: list[Proc], run_for: float, ready_timeout: float = 120) -> tuple[float, float]:
        """Wait until every process said ready (a fresh interpreter imports torch), say go, give kill instants.

        Returns ``(t0, end)``. Raises the home's failure if a process exits first or none is ready in time."""
        deadline = time.monotonic() + ready_timeout
        while not all((rnd.rdir / f"ready-{p.wid}").exists() for p in procs):
            for p in procs:
                if p.code is None and p.poll() is not None:
                    self.reap(rnd, p)
                    self.abort()
                    raise self.failure(rnd.index, f"process {p.wid} ({p.role}, {p.method}) exited {p.code} before it was ready: "
                                                  f"{p.diagnostic()}")
            if time.monotonic() > deadline:
                self.abort()
                raise self.failure(rnd.index, f"workers did not start within {ready_timeout:.0f} s")
            time.sleep(0.02)
        (rnd.rdir / "go").touch()
        t0 = time.monotonic()
        for p in procs:
            if rnd.rng.random() < self.o.kill_rate:
                p.kill_at = self.kill_instant(p, rnd.rng, t0, run_for)
        return t0, t0 + run_for

    def drive(self, rnd: Round, end: float) -> None:
        """Until ``end``: SIGKILL each process at its instant (and maybe start a fork in its place), reap the others that end."""
        rng = rnd.rng
        while time.monotonic() < end:
            now = time.monotonic()
            for p in list(self.live):
                if p.kill_at is not None and now >= p.kill_at and p.code is None:
                    if p.kill(self.KILL_WAIT):
                        self.stats["kills"] += 1
                        self.on_kill(p)
                    self.reap(rnd, p)
                    if self.may_replace_killed(p) and rng.random() < self.o.respawn and end - now > self.RESPAWN_MARGIN:
                        q = self.replace(rnd, p)
                        if rng.random() < self.o.kill_rate:
                            q.kill_at = self.replacement_kill_instant(rng, now, end)
                elif p.poll() is not None:
                    self.reap(rnd, p)
                    self.on_exit(rnd, p, now, end)
            self.on_tick(rnd, now, end)
            time.sleep(0.005)

    def abort(self) -> None:
        """SIGKILL every process still running."""
        for p in list(self.live):
            p.kill(self.KILL_WAIT)
            self.live.remove(p)

    def collect_logs(self, rnd: Round) -> list:
        """Add the round's operation counts to the stats; return its events (what ``on_log_line`` kept)."""
        rnd.collected = True
        events: list = []
        tolerated = self.TOLERATED_KEY
        for p in rnd.procs:
            f = rnd.rdir / f"p{p.wid}.ops"
            if not f.exists():
                continue
            for line in f.read_text(errors="replace").splitlines():
                parts = line.split()
                if not parts:
                    continue
                if parts[0] == "O" and len(parts) == 2:
                    self.stats["ops"] += 1
                    self.stats["ops_by_kind"][parts[1]] += 1
                elif parts[0] == "R" and len(parts) == 3:
                    self.stats[tolerated] += 1
                    self.stats[f"{tolerated}_by_kind"][f"{parts[1]}:{parts[2]}"] += 1
                else:
                    self.on_log_line(parts, events)
        return events


def unlogged_moves(events, reflog: list[dict], still_there: Callable[[str], bool] | None = None) -> list[str]:
    """The invariant "no acknowledged move is lost", on both homes: what workers saw return and the reflog lacks.

    ``events``: the workers' ``D cid tags step`` (a commit that returned, ``tags`` comma-separated or
    ``-``), ``T tag cid`` (a tag moved) and ``X tag cid`` (a tag deleted) lines; ``reflog``: the store's
    ``reflog()`` rows. ``still_there(cid)``: false for a commit whose moves retention may have dropped
    with it (its record collected). Returns one line per missing move (empty: none lost)."""
    moves = {(r["tag"], r["new_commit"]) for r in reflog}
    deletes = {(r["tag"], r["old_commit"]) for r in reflog if r.get("action") == "delete"}
    lost = []
    for ev in events:
        if ev[0] == "D" and ev[2] != "-":
            missing = [f"commit {ev[1]} tag {t}" for t in ev[2].split(",") if (t, ev[1]) not in moves]
            if missing and (still_there is None or still_there(ev[1])):
                lost += missing
        elif ev[0] == "T" and (ev[1], ev[2]) not in moves:
            lost.append(f"tag {ev[1]} -> {ev[2]}")
        elif ev[0] == "X" and (ev[1], ev[2]) not in deletes:
            lost.append(f"delete of tag {ev[1]} (at {ev[2]})")
    return lost


def run_round_loop(h, rounds: int | None, enough: Callable[[], bool], max_seconds: float | None) -> None:
    """``h.run_round(0)``, ``h.run_round(1)``…: ``rounds`` of them and until ``enough()`` (``rounds`` None: until
    ``enough()`` alone); none started after ``max_seconds`` since ``h.started``."""
    for index in itertools.count():
        done = enough()
        if (rounds is not None and index >= rounds and done) or (rounds is None and done):
            break
        if max_seconds is not None and time.monotonic() - h.started > max_seconds:
            break
        h.run_round(index)


def counts(c) -> str:
    """``"a 3, b 1"`` of a Counter (``-`` when empty), for the stats line."""
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"


def seed_from_env(var: str) -> int:
    """``$var`` if set, else a new random seed (the harness prints it)."""
    env = os.environ.get(var)
    return int(env) if env else random.SystemRandom().randrange(1 << 31)
