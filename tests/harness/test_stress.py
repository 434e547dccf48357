"""The model-based stress harness (tests/harness/stress.py): real processes and threads, SIGKILL at random.

Each run prints its seed and its stats; a failure's message starts with the seed. Replay with::

    CKPT_STRESS_SEED=<seed> pytest tests/harness/test_stress.py            # CKPT_STRESS_ROUNDS=<n> for more or fewer rounds
    CKPT_STRESS_SEED=<seed> pytest -m slow tests/harness/test_stress.py    # the long run (CKPT_STRESS_KILLS=<n>, default 1000)
"""

from __future__ import annotations

import os

import pytest

from tests.harness.stress import SLOW, StressFailure, format_stats, run_rounds, seed_from_env


def stress(tmp_path, **kwargs) -> dict:
    """run_rounds, failing the test with the harness's one-paragraph diagnosis (seed first) rather than its traceback."""
    try:
        stats = run_rounds(tmp_path, **kwargs)
    except StressFailure as exc:
        pytest.fail(str(exc), pytrace=False)
    print(format_stats(stats))
    return stats


@pytest.mark.timeout(900)
def test_stress_rounds(tmp_path):
    """A few rounds of 3 workers (about 30 seconds on 2 cores): every tag checks out exactly, fsck is clean.

    One fixed schedule by default, so that CI replays the same one (interleavings and kill
    instants still vary); ``CKPT_STRESS_SEED`` picks another, and the slow test draws a new one each run."""
    seed = int(os.environ.get("CKPT_STRESS_SEED", "20261204"))
    rounds = int(os.environ.get("CKPT_STRESS_ROUNDS", "5"))
    stats = stress(tmp_path, seed=seed, rounds=rounds, workers=3, kill_rate=0.5,
                   replay=f"CKPT_STRESS_SEED={seed} CKPT_STRESS_ROUNDS={rounds} pytest tests/harness/test_stress.py")
    assert stats["rounds"] == rounds and stats["losses"] == 0
    assert stats["ops"] > 0 and stats["processes"] >= 3 * rounds


@pytest.mark.slow
@pytest.mark.timeout(6 * 3600)
def test_stress_a_thousand_kills(tmp_path):
    """Rounds of 4 workers, most killed at random instants (and replaced by forks), until at least 1,000 SIGKILLs."""
    seed = seed_from_env()
    kills = int(os.environ.get("CKPT_STRESS_KILLS", "1000"))
    stats = stress(tmp_path, seed=seed, rounds=None, min_kills=kills, **SLOW,
                   replay=f"CKPT_STRESS_SEED={seed} CKPT_STRESS_KILLS={kills} pytest -m slow tests/harness/test_stress.py")
    assert stats["kills"] >= kills and stats["losses"] == 0
