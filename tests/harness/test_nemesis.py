"""The nemesis harness (tests/harness/nemesis.py): pauses, partitions, clock jumps, stale disks and a
hostile folder against real processes contending for one run, on both homes.

The default test runs a fixed seed (``CKPT_NEMESIS_SEED`` picks another); the slow one
runs until it has done at least 200 pauses, 50 partitions and 50 stale rejoins."""

from __future__ import annotations

import os
import random

import pytest

from tests.harness.nemesis import rejoin_rounds, run_rounds

SEED = int(os.environ.get("CKPT_NEMESIS_SEED", "20261206"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("home", ["local", "s3"])
def test_nemesis_round_breaks_no_invariant(s3_server, tmp_path, home):
    totals = run_rounds(SEED, 1, home, tmp_path, s3_server, seconds=12.0)
    assert totals["hung"] == 0
    assert totals["acks"] > 0, totals  # the contenders committed under the nemeses


@pytest.mark.timeout(300)
def test_stale_disks_never_roll_the_run_back(s3_server, tmp_path):
    counts = rejoin_rounds(SEED, 6, tmp_path, s3_server)
    assert counts["rejoin"] == 6 and counts["fresh"] >= 2, counts


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
def test_nemesis_slow_200_pauses_50_partitions_50_rejoins(s3_server, tmp_path):
    seed = int(os.environ.get("CKPT_NEMESIS_SEED", random.randrange(1 << 30)))
    print(f"nemesis slow run, seed {seed}")
    totals: dict[str, int] = {}
    rounds = 0
    while totals.get("pause", 0) < 200 or totals.get("partition", 0) < 50:
        home = "s3" if totals.get("partition", 0) < 50 or rounds % 2 else "local"
        for k, v in run_rounds(seed + rounds, 1, home, tmp_path / f"r{rounds}", s3_server, seconds=40.0).items():
            totals[k] = totals.get(k, 0) + v
        rounds += 1
    counts = rejoin_rounds(seed, 50, tmp_path / "rejoin", s3_server)
    print(totals, counts)
    assert counts["rejoin"] == 50, counts
    assert totals["hung"] == 0
