"""Training-loop checkpointer, diff, TorchRL checkpoint and Trainer integration."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

import ckptstore
from ckptstore import Checkpointer, Progress
from ckptstore.errors import InvalidArgumentError

from tests.conftest import assert_bit_equal
from tests.unit.protocols.test_faults import digest, fork, wait_ok
from tests import paths

N = 20


def build(seed: int) -> dict:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=LazyTensorStorage(200), batch_size=16, priority_key="td_error")
    net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    return {"rb": rb, "net": net, "optim": torch.optim.Adam(net.parameters(), lr=1e-2), "rng": ckptstore.RNGState(), "progress": Progress()}


def train_step(o: dict) -> None:
    o["rb"].extend(TensorDict({"obs": torch.randn(8, 4), "target": torch.randn(8, 2)}, [8]))
    batch = o["rb"].sample()
    loss = (o["net"](batch["obs"]) - batch["target"]).pow(2).mean(-1)
    o["optim"].zero_grad()
    loss.mean().backward()
    o["optim"].step()
    batch.set("td_error", loss.detach())
    o["rb"].update_tensordict_priority(batch)
    o["progress"].step += 1


def finish(o: dict, store: ckptstore.Store) -> None:
    nxt = torch.stack([o["rb"].sample()["obs"] for _ in range(3)])  # the next samples, drawn from the restored streams
    store.commit({**o, "next_samples": nxt}, tag="final")


def straight(path: Path) -> None:
    o = build(0)
    ckpt = Checkpointer(ckptstore.Store(path), o, every_n_steps=N // 2)
    for _ in range(N):
        train_step(o)
        ckpt.step()
    finish(o, ckpt.store)


def interrupted(path: Path, ready: int) -> None:
    o = build(0)
    ckpt = Checkpointer(ckptstore.Store(path, create=True), o, every_n_steps=N // 2)
    assert ckpt.resume() is None  # a fresh run
    while True:
        train_step(o)
        if ckpt.step() is not None:
            os.write(ready, b"x")  # the step-10 commit returned; keep training until killed
        if o["progress"].step > N // 2:
            time.sleep(0.02)


def resumed(path: Path) -> None:
    o = build(1)  # other seeds: everything must come from the store
    ckpt = Checkpointer(ckptstore.Store(path), o, every_n_steps=N // 2)
    assert ckpt.resume() == N // 2 and o["progress"].step == N // 2
    for _ in range(N - N // 2):
        train_step(o)
        ckpt.step()
    finish(o, ckpt.store)


def test_checkpointer_kill_and_resume_is_bit_identical(tmp_path):
    wait_ok(fork(straight, tmp_path / "a"))
    r, w = os.pipe()
    pid = fork(interrupted, tmp_path / "b", w)
    os.close(w)
    assert os.read(r, 1) == b"x"
    time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    wait_ok(fork(resumed, tmp_path / "b"))
    with ckptstore.Store(tmp_path / "a") as a, ckptstore.Store(tmp_path / "b") as b:
        assert set(b.tags()) >= {"step-10", "step-20", "latest", "final"}
        left, right = a.checkout("final"), b.checkout("final")
        assert digest(left) == digest(right)
        assert_bit_equal(left["next_samples"], right["next_samples"])
        assert right["progress", "step"] == N


def test_checkpointer_arguments(store):
    with pytest.raises(InvalidArgumentError):
        Checkpointer(store, {"a": 1}, every_n_steps=0)
    with pytest.raises(InvalidArgumentError):
        Checkpointer(store, {"a": 1}, components=["b"])
    for objects in (5, {}, TensorDict({"w": torch.ones(2)}, []), {1: torch.ones(2)}):
        with pytest.raises(InvalidArgumentError, match="objects must be a non-empty dict"):
            Checkpointer(store, objects)
    ckpt = Checkpointer(store, {"n": 5, "w": torch.ones(2)}, every_n_steps=3, tag_format=None)
    assert [ckpt.step() is not None for _ in range(7)] == [False, False, True, False, False, True, False]
    assert store.tags().keys() == {"latest"}
    objects = {"n": 0, "w": torch.zeros(2)}
    again = Checkpointer(store, objects, every_n_steps=3)
    assert again.resume() == 6 and objects["n"] == 5 and torch.equal(objects["w"], torch.ones(2))


def test_diff_shows_where_the_bytes_went(tmp_path):
    s = ckptstore.Store(tmp_path / "s", shard_bytes=4096)
    s.commit({"w": torch.zeros(4096), "n": 1, "gone": torch.ones(2)}, tag="a")
    s.commit({"w": torch.cat([torch.zeros(2048), torch.ones(2048)]), "n": 2, "new": torch.arange(3.0)}, tag="b")
    report = s.diff("a", "b")
    by_path = {leaf.path: leaf for leaf in report.leaves}
    assert {p: leaf.status for p, leaf in by_path.items()} == {"gone": "removed", "n": "changed", "new": "added", "w": "changed"}
    assert (by_path["w"].shards, by_path["w"].shards_changed, by_path["w"].new_bytes) == (4, 2, 4096)  # 2 changed shards, both ones
    assert by_path["new"].new_bytes == 12 and report.new_bytes == 4096 + 12
    same = s.diff("a", "a")
    assert same.count("unchanged") == 3 and same.new_bytes == 0
    s.close()


def test_torchrl_checkpoint_through_the_store(tmp_path):
    from torchrl.checkpoint import Checkpoint

    from ckptstore.torchrl_checkpoint import REF_FILE, StoreRotation, forget, use_store

    store = ckptstore.Store(tmp_path / "store", shard_bytes=256)  # small shards: the buffer is small
    o = build(0)
    for _ in range(5):
        train_step(o)
    ckpt = use_store(Checkpoint(policy=o["net"], optimizer=o["optim"], replay_buffer=o["rb"], meta={"step": 5}), store)
    ckpt.save(tmp_path / "ckpt" / "step-5")
    (ref,) = (tmp_path / "ckpt" / "step-5").glob(f"components/*-replay_buffer/{REF_FILE}")
    assert sorted(p.name for p in ref.parent.iterdir()) == [REF_FILE]  # the data lives in the store
    ref_doc = json.loads(ref.read_text())
    assert ref_doc["component"] == "replay_buffer"
    first = store.info(f"torchrl-checkpoint:{ref_doc['ref']}:replay_buffer")
    train_step(o)
    ckpt.save(tmp_path / "ckpt" / "step-6")
    (ref,) = (tmp_path / "ckpt" / "step-6").glob(f"components/*-replay_buffer/{REF_FILE}")
    second = store.info(f"torchrl-checkpoint:{json.loads(ref.read_text())['ref']}:replay_buffer")
    assert second.new_bytes < first.new_bytes / 2 and second.shards_new < second.shards_total / 3  # most shards reused
    fresh = build(3)
    loader = use_store(Checkpoint(policy=fresh["net"], optimizer=fresh["optim"], replay_buffer=fresh["rb"], meta={}), store)
    result = loader.load(tmp_path / "ckpt" / "step-6")
    assert result.loaded == {"policy", "optimizer", "replay_buffer", "meta"}
    assert len(fresh["rb"]) == len(o["rb"]) and fresh["rb"].writer._write_count == o["rb"].writer._write_count
    for a, b in zip(o["net"].parameters(), fresh["net"].parameters()):
        assert_bit_equal(a, b)
    # A renamed checkpoint keeps its data: GC frees nothing it references.
    (tmp_path / "ckpt" / "step-6").rename(tmp_path / "ckpt" / "renamed")
    store.gc(grace=0)
    again = build(4)
    use_store(Checkpoint(policy=again["net"], optimizer=again["optim"], replay_buffer=again["rb"], meta={}), store).load(tmp_path / "ckpt" / "renamed")
    n = len(o["rb"])
    assert len(again["rb"]) == n
    assert_bit_equal(again["rb"].storage[:n]["obs"], o["rb"].storage[:n]["obs"])
    for a, b in zip(o["net"].parameters(), again["net"].parameters()):
        assert_bit_equal(a, b)
    # Deleting one by hand: forget it first, and GC frees exactly its data.
    assert len(forget(store, tmp_path / "ckpt" / "step-5")) == 3  # policy, optimizer, replay_buffer
    shutil.rmtree(tmp_path / "ckpt" / "step-5")
    assert first.id not in store.tags().values() and store.gc(grace=0).commits_dropped == 3
    # A rotation deletes the tags of the checkpoints it removes, and only those.
    rotation = StoreRotation(tmp_path / "rot", store, keep_last=1)
    rotation.save(ckpt, step=1)
    kept_before = set(store.tags())
    train_step(o)
    newest = rotation.save(ckpt, step=2)
    assert len(set(store.tags()) - kept_before) == 3 and len(kept_before - set(store.tags())) == 3
    assert rotation.checkpoints() == (newest,)
    store.close()


def dqn_trainer(total_frames: int, vecnorm: bool = False):
    """A real TorchRL Trainer: DQN on CartPole (seeded; with ``vecnorm``, observations through
    a ``VecNorm`` transform), 50 frames per batch, one optimisation step per batch."""
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv, TransformedEnv, VecNorm
    from torchrl.modules import MLP, QValueActor
    from torchrl.objectives import DQNLoss
    from torchrl.trainers import Trainer

    torch.manual_seed(0)
    env = GymEnv("CartPole-v1")
    if vecnorm:
        env = TransformedEnv(env, VecNorm(in_keys=["observation"], decay=0.9))
    env.set_seed(0)
    actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"], spec=env.action_spec)
    loss = DQNLoss(actor, action_space=env.action_spec)
    optim = torch.optim.Adam(loss.parameters(), lr=1e-3)
    collector = Collector(env, actor, frames_per_batch=50, total_frames=total_frames, auto_register_policy_transforms=False)
    trainer = Trainer(collector=collector, total_frames=total_frames, frame_skip=1, optim_steps_per_batch=1, loss_module=loss,
                      optimizer=optim, progress_bar=False, save_trainer_file=None)
    return actor, optim, collector, trainer


def test_trainer_hook(tmp_path):
    from ckptstore.torchrl_checkpoint import CheckpointerHook

    actor, optim, collector, trainer = dqn_trainer(200)
    store = ckptstore.Store(tmp_path / "s")
    hook = CheckpointerHook(Checkpointer(store, {"policy": actor, "optim": optim}, every_n_steps=2))
    hook.register(trainer)
    trainer.train()
    assert set(store.tags()) == {"step-2", "step-4", "latest"}
    assert store.info("latest").metadata["step"] == 4
    collector.shutdown()
    store.close()


FIXTURE = paths.FIXTURES / "c26_schema_v1"


def test_c26_frozen_v1_fixture_migrates(tmp_path):
    store_dir = tmp_path / "store"
    shutil.copytree(FIXTURE, store_dir)
    with ckptstore.Store(store_dir) as s:
        comps = s.components("v1")
        assert {c: comps[c]["version"] for c in comps} == {"rb/storage": 1, "rb/writer": 1, "rb/sampler": 1, "td": 1}
        rb = TensorDictPrioritizedReplayBuffer(alpha=0.5, beta=0.4, eps=1e-8, storage=LazyTensorStorage(8), batch_size=2)
        td = TensorDict({}, [])
        s.checkout("v1", into={"rb": rb, "td": td})
        assert abs(float(rb.sampler._max_priority[0]) - 4.0) < 1e-6  # stored transformed, migrated to raw
        assert rb.writer._write_count == len(rb) == 5  # documented default: the storage's length
        assert td["idx"] == (slice(0, 2, None), Ellipsis) and type(td["idx"]) is tuple
        raw = s.checkout("v1", partial=["td"])
        assert raw["td", "idx"] == (slice(0, 2, None), Ellipsis)
        s.catalog.conn.execute("PRAGMA user_version=999")
    with pytest.raises(ckptstore.errors.SchemaVersionError, match="unsupported schema version 999"):
        ckptstore.Store(store_dir)


def test_a_resumed_trainer_continues_its_frame_budget(tmp_path):
    """Stopped after 2 of 6 batches and resumed in fresh objects, train() runs only the other 4."""
    from ckptstore.torchrl_checkpoint import CheckpointerHook

    def build():
        actor, optim, collector, trainer = dqn_trainer(300)
        hook = CheckpointerHook(Checkpointer(ckptstore.Store(tmp_path / "s", create=True), {"policy": actor, "optim": optim}, every_n_steps=2))
        hook.register(trainer)
        return trainer, hook, collector

    trainer, hook, collector = build()
    trainer.register_op("post_steps", lambda: hook.checkpointer.steps == 2 and trainer.request_stop("preempted"))
    trainer.train()
    collector.shutdown()
    assert (hook.checkpointer.steps, trainer.collected_frames) == (2, 100)
    trainer, hook, collector = build()
    assert hook.checkpointer.resume() == 2 and trainer.collected_frames == 100 and trainer._optim_count == 2
    batches = []
    trainer.register_op("post_steps", lambda: batches.append(1))
    trainer.train()
    collector.shutdown()
    assert (len(batches), trainer.collected_frames, hook.checkpointer.steps) == (4, 300, 6)


def test_torchrl_checkpoint_through_the_store_returns_immutable_values(tmp_path):
    """An int or str component routed through the store comes back in ``result.values``, as
    with TorchRL's own JSON adapter (found by tests/peers: it used to be dropped silently)."""
    from torchrl.checkpoint import Checkpoint

    from ckptstore.torchrl_checkpoint import use_store

    store = ckptstore.Store(tmp_path / "store")
    use_store(Checkpoint(step=3, name="run-a", meta={"k": 1}), store, (int, str, dict)).save(tmp_path / "ckpt")
    meta = {}
    result = use_store(Checkpoint(step=0, name="", meta=meta), store, (int, str, dict)).load(tmp_path / "ckpt")
    assert result.loaded == {"step", "name", "meta"}
    assert result.values == {"step": 3, "name": "run-a"}
    assert meta == {"k": 1}


def test_a_resumed_trainer_equals_an_uninterrupted_one_bit_exactly(tmp_path):
    """Interrupted after 2 of 6 batches and resumed in fresh objects, the Trainer ends with
    exactly the parameters, optimizer state and VecNorm statistics of a run never
    interrupted: the environment's step in progress, its RNG and its transforms' state
    are in the commit."""
    from ckptstore.torchrl_checkpoint import CheckpointerHook

    def build(store):
        actor, optim, collector, trainer = dqn_trainer(300, vecnorm=True)
        hook = CheckpointerHook(Checkpointer(ckptstore.Store(store, create=True), {"policy": actor, "optim": optim}, every_n_steps=2))
        hook.register(trainer)
        return actor, optim, collector.env.transform, trainer, hook  # train() shuts the collector down

    actor, optim, vecnorm, trainer, hook = build(tmp_path / "whole")
    trainer.train()
    whole = ({k: v.clone() for k, v in actor.state_dict().items()}, optim.state_dict()["state"], vecnorm.state_dict())
    actor, optim, vecnorm, trainer, hook = build(tmp_path / "parts")
    trainer.register_op("post_steps", lambda: hook.checkpointer.steps == 2 and trainer.request_stop("preempted"))
    trainer.train()
    actor, optim, vecnorm, trainer, hook = build(tmp_path / "parts")
    assert hook.checkpointer.resume() == 2
    trainer.train()
    stats = vecnorm.state_dict()
    assert trainer.collected_frames == 300 and hook.checkpointer.steps == 6
    for key, value in whole[0].items():
        assert_bit_equal(actor.state_dict()[key], value)
    for i, state in whole[1].items():
        for key, value in state.items():
            assert_bit_equal(optim.state_dict()["state"][i][key], value)
    assert sorted(whole[2]["_extra_state"]) == ["observation_count", "observation_ssq", "observation_sum"]
    for key, value in whole[2]["_extra_state"].items():  # VecNorm's running statistics
        assert_bit_equal(stats["_extra_state"][key], value)


def test_a_trainer_commit_refuses_another_environment(tmp_path):
    """The committed environment state names its wrapper classes: restoring into a trainer
    over another environment raises before anything is changed."""
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv
    from torchrl.trainers import Trainer

    _, _, collector, trainer = dqn_trainer(100)
    with ckptstore.Store(tmp_path / "s") as s:
        cid = s.commit({"trainer": trainer}).id
        assert "trainer/env/2/arrays/state" in {leaf["path"] for leaf in s.show(cid)["leaves"]}  # CartPole's physics state
        env = GymEnv("Pendulum-v1")
        other_collector = Collector(env, None, frames_per_batch=50, total_frames=100)
        other = Trainer(collector=other_collector, total_frames=100, frame_skip=1, optim_steps_per_batch=1, loss_module=trainer.loss_module,
                        optimizer=trainer.optimizer, progress_bar=False, save_trainer_file=None)
        frames = other_collector._frames
        with pytest.raises(ckptstore.errors.TargetMismatchError, match="stored an environment"):
            s.checkout(cid, into={"trainer": other})
        assert other_collector._frames == frames
    collector.shutdown()
    other_collector.shutdown()


def test_a_run_committed_without_rng_still_resumes(tmp_path):
    """A run whose latest commit has no ``rng`` component (an earlier hook's) resumes under
    the hook as before, without the RNG streams, instead of failing on the missing component."""
    from ckptstore.torchrl_checkpoint import CheckpointerHook

    actor, optim, collector, trainer = dqn_trainer(100)
    with ckptstore.Store(tmp_path / "s") as store:
        Checkpointer(store, {"policy": actor, "optim": optim, "trainer": trainer}, every_n_steps=1).commit()
        hook = CheckpointerHook(Checkpointer(store, {"policy": actor, "optim": optim}, every_n_steps=1))
        hook.register(trainer)
        assert hook.checkpointer.components == ["policy", "optim", "trainer"] and hook.checkpointer.resume() == 0
    collector.shutdown()
