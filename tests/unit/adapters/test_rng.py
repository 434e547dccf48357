"""RNGState: Python, numpy and torch generators round-trip without pickle."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.errors import MissingLeafError

from tests.conftest import commit_edited, run_fresh


def draws() -> dict:
    return {
        "python": [random.random() for _ in range(10)],
        "numpy": [float(np.random.rand()) for _ in range(5)] + [float(np.random.randn()) for _ in range(5)],
        "torch": torch.rand(10).tolist(),
    }


def seed_and_advance() -> None:
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    for _ in range(5):
        random.random()
    for _ in range(3):
        np.random.rand()
    np.random.randn()  # leaves a cached gaussian behind
    torch.rand(5)


def test_rng_state_round_trip_in_a_fresh_process(tmp_path):
    seed_and_advance()
    with ckptstore.Store(tmp_path / "s") as s:
        s.commit({"rng": ckptstore.RNGState()}, tag="rng")
    reference = draws()
    proc = run_fresh(
        """
import json, random, sys
import numpy as np, torch, ckptstore
store = ckptstore.Store(sys.argv[1], create=False)
store.checkout("rng", into={"rng": ckptstore.RNGState()})
out = {"python": [random.random() for _ in range(10)],
       "numpy": [float(np.random.rand()) for _ in range(5)] + [float(np.random.randn()) for _ in range(5)],
       "torch": torch.rand(10).tolist()}
print(json.dumps(out))
""",
        str(tmp_path / "s"),
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == reference


def test_missing_numpy_record_is_an_error_not_a_silent_skip(store):
    commit_edited(store, {"rng": ckptstore.RNGState()}, "rng", drop=("rng/numpy/key",))
    state_before = torch.get_rng_state()
    with pytest.raises(MissingLeafError, match="rng/numpy/key"):
        store.checkout("rng", into={"rng": ckptstore.RNGState()})
    assert torch.equal(torch.get_rng_state(), state_before)  # nothing was applied


def test_commits_do_not_move_the_global_random_state(tmp_path):
    """Found by a newcomer: the 1 % sample of reused shards drew from Python's global
    ``random``, so every commit after the first moved the state an RNGState restores, and a
    resumed run was not bit-identical to the uninterrupted one."""
    store = ckptstore.Store(tmp_path / "s", shard_bytes=1024)
    random.seed(0)
    objects = {"w": torch.zeros(10_000), "rng": ckptstore.RNGState()}  # 40 shards
    store.commit(objects, tag="first")
    for commit in (store.commit, lambda o, tag: store.commit_async(o, tag=tag).result()):
        commit(objects, tag="latest")  # "w" unchanged: a sample of its shards is rehashed
        expected = random.random()
        store.checkout("latest", into={"rng": ckptstore.RNGState()}, partial=["rng"])
        assert random.random() == expected
    store.close()
