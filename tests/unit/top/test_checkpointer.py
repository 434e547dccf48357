"""Checkpointer defaults a newcomer relies on: retention, clear errors, preemption."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptstore
from ckptstore import Checkpointer
from ckptstore.errors import NotAStoreError, TargetMismatchError, UnsupportedTypeError


def test_objects_are_checked_at_construction(store):
    with pytest.raises(UnsupportedTypeError, match="fn"):
        Checkpointer(store, {"w": torch.ones(2), "fn": lambda x: x}, every_n_steps=1000)
    assert store.log() == []


def test_retention_keeps_the_newest_step_tags_and_gc_frees_the_rest(store):
    w0 = torch.randn(1000, generator=torch.Generator().manual_seed(0))  # incompressible
    w = w0.clone()
    ckpt = Checkpointer(store, {"w": w}, every_n_steps=10)  # default keep_last=3
    at40 = None
    for i in range(60):
        w += 1
        ckpt.step()
        at40 = w.clone() if i + 1 == 40 else at40
    assert sorted(store.tags()) == ["latest", "step-40", "step-50", "step-60"]
    report = store.gc(keep_last=1, grace=0)  # the cron recipe's default run frees space
    assert report.commits_dropped == 3 and report.bytes_freed > 3 * 4000
    assert torch.equal(store.checkout("step-40")["w"], at40)
    Checkpointer(store, {"w": w}, every_n_steps=10, keep_last=None).commit()  # None keeps every tag
    assert sorted(store.tags()) == ["latest", "step-0", "step-40", "step-50", "step-60"]


def test_a_latest_tag_moved_by_another_commit_is_explained(store):
    ckpt = Checkpointer(store, {"w": torch.ones(2)}, every_n_steps=1)
    ckpt.step()
    store.commit({"eval": torch.zeros(3)}, tag="latest")  # the user's own "latest"
    with pytest.raises(TargetMismatchError, match=r"'latest' .* was not made by a Checkpointer: it holds eval.*latest_tag="):
        Checkpointer(store, {"w": torch.zeros(2)}).resume()
    assert Checkpointer(store, {"w": torch.zeros(2)}).resume("step-1") == 1


def test_resume_on_a_missing_store_says_how_to_start_a_new_run(tmp_path):
    ckpt = Checkpointer(ckptstore.Store(tmp_path / "runs" / "sotre"), {"w": torch.ones(2)})
    with pytest.raises(NotAStoreError, match="create=True"):
        ckpt.resume()
    assert not (tmp_path / "runs").exists()
    fresh = Checkpointer(ckptstore.Store(tmp_path / "runs" / "store", create=True), {"w": torch.ones(2)})
    assert fresh.resume() is None


PREEMPTED = """
import os, sys, time, torch, ckptstore
store = ckptstore.Store(sys.argv[1], create=True)
w = torch.zeros(4)
ckpt = ckptstore.Checkpointer(store, {"w": w}, every_n_steps=10**6)
start = ckpt.resume() or 0
print("ready", start, flush=True)
while True:  # a training loop that never reaches a scheduled commit
    w += 1
    ckpt.step()
    time.sleep(0.001)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_commits_at_the_next_step_and_exits_cleanly(tmp_path, signum):
    path = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PREEMPTED), str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().split() == ["ready", "0"]
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == 0
    with ckptstore.Store(path, create=False) as s:
        info = s.info("latest")
        step = info.metadata["step"]
        assert step > 0 and info.metadata["stopped_by"] == signal.Signals(signum).name
        assert s.checkout("latest")["w"].tolist() == [float(step)] * 4  # the state of exactly that step
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PREEMPTED), str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().split() == ["ready", str(step)]  # the next job resumes there
    proc.kill()
    proc.wait()


def test_a_checkpointer_takes_a_store_path_and_refuses_other_things(tmp_path):
    ckpt = Checkpointer(tmp_path / "run" / "store", {"w": torch.ones(2)}, every_n_steps=1)
    assert ckpt.resume() is None  # a path makes its store: a training run starts there
    ckpt.step()
    assert ckptstore.Store(tmp_path / "run" / "store", create=False).tags().keys() == {"step-1", "latest"}
    with pytest.raises(ckptstore.errors.InvalidArgumentError, match="store must be a ckptstore.Store or a path"):
        Checkpointer(42, {"w": torch.ones(2)})
