"""The process harness (tests/harness/procharness.py): writer threads, forks, signals and migration kills
inside the process that uses the store, judged by one invariant checker.

Each run prints its seed and stats; every violation is printed with the seed, round, scenario
and the command that replays it. Replay with::

    CKPT_PROC_SEED=<seed> pytest tests/harness/test_procharness.py           # CKPT_PROC_ROUNDS=<n> for more or fewer rounds
    CKPT_PROC_SEED=<seed> pytest -m slow tests/harness/test_procharness.py   # the slow run (300 racy commits, 100 forks, 200 kills)
    python -m tests.harness.procharness --seed <seed> --rounds 1 --first-round <i> --scenario <kind>    # one round
"""

from __future__ import annotations

import os
import random

import pytest

from tests.harness.procharness import SCENARIOS, SLOW_MINIMUMS, ProcFailure, format_stats, run_rounds, seed_from_env


def harness(tmp_path, **kwargs) -> dict:
    """run_rounds, failing the test with the harness's violation lines (seed first) rather than a traceback."""
    try:
        stats = run_rounds(tmp_path / "work", **kwargs)
    except ProcFailure as exc:
        pytest.fail(str(exc), pytrace=False)
    print(format_stats(stats))
    return stats


@pytest.mark.timeout(600)
def test_process_harness_default_run(tmp_path):
    """One round of each scenario kind (writer threads, forks, signals, migration kills; about a
    minute on 2 cores once nothing hangs): 0 violations. A fixed schedule by default so CI
    replays the same one; ``CKPT_PROC_SEED`` / ``CKPT_PROC_ROUNDS`` pick another."""
    seed = seed_from_env(20261206)
    rounds = int(os.environ.get("CKPT_PROC_ROUNDS", str(len(SCENARIOS))))
    stats = harness(tmp_path, seed=seed, rounds=rounds)
    assert sum(stats["violations"].values()) == 0
    assert sum(stats["rounds"].values()) == rounds
    if rounds >= len(SCENARIOS):  # each kind ran and did something
        assert stats["racy_commits"] > 0 and stats["forks"] > 0 and stats["signals"] > 0 and stats["kills"] > 0


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
def test_process_harness_slow_run(tmp_path):
    """Rounds until at least 300 racy commits, 100 forks and 200 migration kills: 0 violations.
    A new seed each run (printed), ``CKPT_PROC_SEED`` replays one."""
    seed = seed_from_env(random.SystemRandom().randrange(1 << 31))
    print(f"procharness slow run, seed {seed}")
    stats = harness(tmp_path, seed=seed, rounds=None, slow=True)
    assert stats["racy_commits"] >= SLOW_MINIMUMS["commits"]
    assert stats["forks"] >= SLOW_MINIMUMS["forks"]
    assert stats["kills"] >= SLOW_MINIMUMS["kills"]
    assert sum(stats["violations"].values()) == 0


def test_the_invariant_checker_passes_a_clean_store_and_names_each_violation(tmp_path):
    """The checker itself, on this branch: a clean store gives no violation; a commit never made,
    one holding another step, a damaged pack, a hang, a lost handler and a run not taken over
    are each reported under their kind."""
    import torch

    import ckptstore

    from tests.harness.procharness import check_invariants, step_state

    path = tmp_path / "s"
    with ckptstore.Store(path, create=True) as s:
        good = s.commit(step_state(7), tag="a")
        big = s.commit({"w": torch.arange(1 << 16, dtype=torch.float32)}, tag="b")
    ack = {"cid": good.id, "who": "test", "check": "step", "step": 7}
    ranged = {"cid": big.id, "who": "test", "check": "ranges", "ranges": {"w": [0, (1 << 16) - 1]}}
    assert check_invariants(path, [ack, ranged], []) == []
    assert check_invariants(path, [ack], [], expect_tags={"a": good.id}) == []
    found = check_invariants(path, [{**ack, "cid": "0" * 32}, {**ack, "step": 8}, {**ranged, "ranges": {"w": [1, 10]}}], [
        {"ev": "hang", "what": "fork child commit (pid 1)", "bound": 20.0},
        {"ev": "handler", "when": "close", "user_ran": False},
        {"ev": "lease", "run": "r", "taken_in": None, "child_alive": True, "error": "RunBusyError"},
        {"ev": "child-error", "role": "commit", "error": "sqlite3.ProgrammingError"},
    ], expect_tags={"a": big.id})
    want = ["child-error", "hang", "handler", "lease", "missing", "tag", "wrong-value", "wrong-value"]
    assert sorted(k for k, _ in found) == sorted(want)
    pack = max((p for p in (path / "blobs").rglob("*.pack")), key=lambda p: p.stat().st_size)
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))
    kinds = {k for k, _ in check_invariants(path, [ranged], [])}
    assert kinds == {"unreadable", "fsck"}
