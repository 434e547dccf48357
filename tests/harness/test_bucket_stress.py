"""The object-storage stress harness (tests/harness/bucket_stress.py): real processes on a moto S3 server,
SIGKILL at random, GCs with short graces and skewed clocks, slow commits through a delaying
proxy, damaged and deleted objects, checks after every round.

Each run prints its seed and its counters; a failure's message starts with the seed. Replay::

    CKPT_BSTRESS_SEED=<seed> pytest tests/harness/test_bucket_stress.py             # CKPT_BSTRESS_ROUNDS=<n>
    CKPT_BSTRESS_SEED=<seed> pytest -m slow tests/harness/test_bucket_stress.py     # CKPT_BSTRESS_KILLS / _DAMAGES
    python -m tests.harness.bucket_stress --seed <seed> --rounds 6                  # outside pytest, with knobs
"""

from __future__ import annotations

import os
import uuid

import pytest

from tests.harness.bucket_stress import SLOW, BucketStressFailure, format_stats, run_rounds, seed_from_env

pytest.importorskip("moto", reason="the object-storage harness needs moto[server] (the test extra)")


def bstress(tmp_path, s3_server, **kwargs) -> dict:
    try:
        stats = run_rounds(tmp_path, url=f"s3://ckpt/bstress-{uuid.uuid4().hex[:10]}", env=s3_server.env, **kwargs)
    except BucketStressFailure as exc:
        pytest.fail(str(exc), pytrace=False)
    print(format_stats(stats))
    return stats


@pytest.mark.timeout(600)
def test_bucket_stress_rounds(tmp_path, s3_server):
    """A few rounds (about a minute on 2 cores): kills, skewed GCs, a slow commit, damage and repair.
    One fixed schedule by default, so that CI replays the same one (interleavings still vary);
    ``CKPT_BSTRESS_SEED`` picks another, and the slow test draws a new one each run."""
    seed = int(os.environ.get("CKPT_BSTRESS_SEED", "20261201"))
    rounds = int(os.environ.get("CKPT_BSTRESS_ROUNDS", "4"))
    stats = bstress(tmp_path, s3_server, seed=seed, rounds=rounds, max_seconds=140,
                    replay=f"CKPT_BSTRESS_SEED={seed} CKPT_BSTRESS_ROUNDS={rounds} pytest tests/harness/test_bucket_stress.py")
    assert stats["losses"] == 0 and stats["rounds"] >= 1 and stats["processes"] >= stats["rounds"]


@pytest.mark.slow
@pytest.mark.timeout(6 * 3600)
def test_bucket_stress_many_kills_and_damages(tmp_path, s3_server):
    """Rounds until at least 300 SIGKILLs and 100 injected damages (both homes): no loss of undamaged tagged data."""
    seed = seed_from_env()
    kills = int(os.environ.get("CKPT_BSTRESS_KILLS", "300"))
    damages = int(os.environ.get("CKPT_BSTRESS_DAMAGES", "100"))
    stats = bstress(tmp_path, s3_server, seed=seed, rounds=None, min_kills=kills, min_damages=damages, **SLOW,
                    replay=f"CKPT_BSTRESS_SEED={seed} CKPT_BSTRESS_KILLS={kills} CKPT_BSTRESS_DAMAGES={damages} "
                           f"pytest -m slow tests/harness/test_bucket_stress.py")
    assert stats["kills"] >= kills and stats["damages"] >= damages and stats["losses"] == 0
