"""The whole training state: every TorchRL buffer part, PyTorch objects, RNGs, services."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ListStorage, ReplayBuffer, TensorDictReplayBuffer
from torchrl.data.replay_buffers import (
    PrioritizedSliceSampler,
    RandomSampler,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    TensorDictMaxValueWriter,
)

import ckptstore
from ckptstore.errors import AdapterVersionError, TargetMismatchError, UnsupportedTypeError

from tests.conftest import assert_bit_equal, commit_edited, run_fresh


def seeded(fn, seed=5):
    torch.manual_seed(seed)
    np.random.seed(seed)
    return fn()


# --- storages, writers, samplers ------------------------------------------------------------


def test_list_storage_with_tensors_tensordicts_and_json(store):
    def build():
        return ReplayBuffer(storage=ListStorage(10), batch_size=3)

    rb = build()
    rb.extend([torch.arange(3), TensorDict({"a": torch.ones(2)}, [2]), {"step": 4, "tags": ("x", 1)}, 7])
    store.commit(rb, tag="l")
    fresh = build()
    store.checkout("l", into=fresh)
    assert len(fresh) == 4 and fresh.writer._cursor == 4
    items = fresh.storage._storage
    assert_bit_equal(items[0], torch.arange(3))
    assert isinstance(items[1], TensorDict) and items[1].batch_size == torch.Size([2])
    assert_bit_equal(items[1]["a"], torch.ones(2))
    assert items[2] == {"step": 4, "tags": ("x", 1)} and type(items[2]["tags"]) is tuple and items[3] == 7
    homogeneous, fresh2 = build(), build()
    homogeneous.extend([torch.full((2,), float(i)) for i in range(6)])
    store.commit(homogeneous, tag="h")
    store.checkout("h", into=fresh2)
    assert_bit_equal(seeded(lambda: homogeneous.sample()), seeded(lambda: fresh2.sample()))
    bad = build()
    bad.extend([object()])
    with pytest.raises(UnsupportedTypeError, match=r"storage/items/0.*ListStorage"):
        store.commit(bad, tag="bad")


def test_c07a_max_value_writer_heap_keeps_its_types(store):
    def build():
        return TensorDictReplayBuffer(storage=LazyTensorStorage(4), writer=TensorDictMaxValueWriter(rank_key="reward"), batch_size=2)

    rb = build()
    rb.extend(TensorDict({"reward": torch.tensor([1.0, 5.0, 3.0]), "obs": torch.tensor([0, 1, 2])}, [3]))
    store.commit(rb, tag="topk")
    fresh = build()
    store.checkout("topk", into=fresh)
    assert fresh.writer._current_top_values == rb.writer._current_top_values
    assert all(type(e) is tuple and type(e[1]) is int for e in fresh.writer._current_top_values)
    for buf in (rb, fresh):
        buf.add(TensorDict({"reward": torch.tensor(2.0), "obs": torch.tensor(3)}, []))
        buf.extend(TensorDict({"reward": torch.tensor([0.5, 9.0]), "obs": torch.tensor([4, 5])}, [2]))
    assert sorted(rb.storage._storage["obs"][: len(rb)].tolist()) == sorted(fresh.storage._storage["obs"][: len(fresh)].tolist()) == [1, 2, 3, 5]
    assert fresh.writer._write_count == rb.writer._write_count


def trajectories(n_traj: int = 6, length: int = 10) -> TensorDict:
    episode = torch.arange(n_traj).repeat_interleave(length)
    done = torch.zeros(n_traj * length, 1, dtype=torch.bool)
    done[length - 1 :: length] = True
    return TensorDict({"episode": episode, "obs": torch.arange(n_traj * length).float(), "next": {"done": done}}, [n_traj * length])


@pytest.mark.parametrize("kind", ["slice", "slice_without_replacement", "prioritized_slice"])
def test_slice_samplers(store, kind):
    def build():
        if kind == "slice":
            sampler = SliceSampler(num_slices=2, traj_key="episode")
        elif kind == "slice_without_replacement":
            sampler = SliceSamplerWithoutReplacement(num_slices=2, traj_key="episode")
        else:
            sampler = PrioritizedSliceSampler(max_capacity=60, num_slices=2, traj_key="episode", alpha=0.7, beta=0.5)
        return TensorDictReplayBuffer(storage=LazyTensorStorage(60), sampler=sampler, batch_size=8)

    rb = build()
    rb.extend(trajectories())
    if kind == "prioritized_slice":
        rb.update_priority(torch.arange(60), torch.linspace(0.1, 3.0, 60))
    seeded(lambda: rb.sample())
    store.commit(rb, tag="s")
    fresh = build()
    store.checkout("s", into=fresh)
    assert store.components("s")["sampler"]["adapter"] == f"torchrl.sampler.{kind}"
    for _ in range(3):
        a, b = seeded(lambda: rb.sample(), 11), seeded(lambda: fresh.sample(), 11)
        assert_bit_equal(a["obs"], b["obs"])


def test_buffer_generator_and_transform_state(store):
    from torchrl.envs.transforms import ObservationNorm

    def build(seed):
        g = torch.Generator().manual_seed(seed)
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(50), batch_size=4, generator=g)
        norm = ObservationNorm(loc=torch.zeros(3), scale=torch.ones(3), in_keys=["obs"])
        rb.append_transform(norm)
        return rb, g, norm

    rb, _, norm = build(99)
    rb.extend(TensorDict({"obs": torch.randn(20, 3)}, [20]))
    with torch.no_grad():
        norm.loc.fill_(0.5)
        norm.scale.fill_(2.0)
    rb.sample()
    store.commit(rb, tag="g")
    assert set(store.components("g")) == {"storage", "writer", "sampler", "generator", "transform"}
    reference = [rb.sample() for _ in range(3)]  # no reseeding: the buffer's own generator drives it
    fresh, g2, norm2 = build(0)
    store.checkout("g", into=fresh)
    assert fresh._rng is g2  # restored in place, still shared
    assert float(norm2.loc[0]) == 0.5 and float(norm2.scale[0]) == 2.0
    for a, b in zip(reference, [fresh.sample() for _ in range(3)]):
        assert_bit_equal(a["obs"], b["obs"])
    plain = TensorDictReplayBuffer(storage=LazyTensorStorage(50), batch_size=4)
    plain.append_transform(ObservationNorm(loc=torch.zeros(3), scale=torch.ones(3), in_keys=["obs"]))
    with pytest.raises(TargetMismatchError, match="generator"):
        store.checkout("g", into=plain)


def test_wrong_sampler_class_is_refused(store):
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10), sampler=PrioritizedSliceSampler(max_capacity=10, num_slices=1, alpha=0.5, beta=0.5, traj_key="episode"), batch_size=2)
    rb.extend(trajectories(1, 10))
    store.commit(rb, tag="p")
    other = TensorDictReplayBuffer(storage=LazyTensorStorage(10), sampler=RandomSampler(), batch_size=2)
    with pytest.raises(TargetMismatchError, match="prioritized_slice"):
        store.checkout("p", into=other)


# --- PyTorch objects ------------------------------------------------------------------------


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 16)
        self.head = torch.nn.Linear(16, 100, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


class Untied(Tied):
    def __init__(self):
        super().__init__()
        self.head.weight = torch.nn.Parameter(self.emb.weight.detach().clone())


def adam_steps(model, opt, n=2):
    for _ in range(n):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.arange(8)), torch.arange(8).flip(0)).backward()
        opt.step()


def test_c12_tied_parameters(store):
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    adam_steps(model, opt)
    store.commit({"model": model, "optim": opt}, tag="t")
    committed = model.emb.weight.detach().clone()
    fresh = Tied()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    store.checkout("t", into={"model": fresh, "optim": fresh_opt})
    assert fresh.head.weight is fresh.emb.weight
    assert_bit_equal(fresh.emb.weight, model.emb.weight)
    assert len(fresh_opt.state) == 1
    (s1,), (s2,) = opt.state.values(), fresh_opt.state.values()
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert_bit_equal(s1[key], s2[key])
    adam_steps(model, opt, 1)
    adam_steps(fresh, fresh_opt, 1)
    assert_bit_equal(fresh.emb.weight, model.emb.weight)
    untied = Untied()
    store.checkout("t", into={"model": untied}, partial=["model"])  # both names receive the stored weights
    assert_bit_equal(untied.head.weight.detach(), committed)
    assert_bit_equal(untied.emb.weight.detach(), committed)


def test_named_optimizer_survives_a_reordered_parameter_list(store):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    x = torch.randn(16, 4)
    for _ in range(2):
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()
    store.commit({"net": net, "optim": ckptstore.NamedOptimizer(opt, net)}, tag="n")
    net2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt2 = torch.optim.Adam(list(net2.parameters())[::-1], lr=0.5)  # reversed order
    store.checkout("n", into={"net": net2, "optim": ckptstore.NamedOptimizer(opt2, net2)})
    for (name, p), p2 in zip(net.named_parameters(), net2.parameters()):
        assert_bit_equal(opt.state[p]["exp_avg"], opt2.state[p2]["exp_avg"]), name
    for o in (opt, opt2):
        o.zero_grad()
    net(x).pow(2).mean().backward()
    net2(x).pow(2).mean().backward()
    opt.step()
    opt2.step()
    for a, b in zip(net.parameters(), net2.parameters()):
        assert_bit_equal(a, b)


def test_schedulers_and_grad_scaler(store):
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [torch.optim.lr_scheduler.StepLR(opt, 2), torch.optim.lr_scheduler.CosineAnnealingLR(opt, 5)], milestones=[3])
    for _ in range(4):
        opt.step()
        seq.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # materialises the scale tensor
    scaler.update(512.0)
    store.commit({"opt": opt, "sched": seq, "scaler": scaler}, tag="s")
    opt2 = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    seq2 = torch.optim.lr_scheduler.SequentialLR(opt2, [torch.optim.lr_scheduler.StepLR(opt2, 2), torch.optim.lr_scheduler.CosineAnnealingLR(opt2, 5)], milestones=[3])
    scaler2 = torch.amp.GradScaler("cpu")
    store.checkout("s", into={"opt": opt2, "sched": seq2, "scaler": scaler2})
    assert seq2.last_epoch == seq.last_epoch == 4 and seq2.get_last_lr() == seq.get_last_lr()
    assert scaler2.get_scale() == scaler.get_scale() == 512.0
    opt.step(), seq.step(), opt2.step(), seq2.step()
    assert seq2.get_last_lr() == seq.get_last_lr()
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9**e)
    with pytest.raises(UnsupportedTypeError, match="LambdaLR holds code"):
        store.commit({"sched": lam}, tag="lam")
    with pytest.raises(TargetMismatchError, match="StepLR"):
        store.checkout("s", into={"sched": torch.optim.lr_scheduler.StepLR(opt2, 2)}, partial=["sched"])


# --- RNG --------------------------------------------------------------------------------------


C18 = """
import random, numpy as np, torch, ckptstore
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer, LazyTensorStorage
def streams(g, tg, rb):
    return {"python": [random.random() for _ in range(10)], "numpy": np.random.rand(10).tolist(),
            "generator": g.random(10).tolist(), "torch": torch.rand(10).tolist(),
            "tg": [rb.sample()["x"].tolist() for _ in range(10)]}
def buffer(tg):
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(20), batch_size=2, generator=tg)
    rb.extend(TensorDict({"x": torch.arange(20)}, [20]))
    return rb
"""


def test_c18_every_rng_stream_round_trips_in_a_fresh_process(tmp_path):
    ns: dict = {}
    exec(C18, ns)
    random.seed(123)
    np.random.seed(123)
    g = np.random.default_rng(7)
    torch.manual_seed(123)
    tg = torch.Generator().manual_seed(99)
    rb = ns["buffer"](tg)
    for _ in range(5):
        random.random()
    for _ in range(3):
        np.random.rand()
    np.random.randn()
    g.random(5)
    torch.rand(5)
    torch.randperm(10, generator=tg)
    with ckptstore.Store(tmp_path / "s") as s:
        s.commit({"rng": ckptstore.RNGState(), "np_gen": g, "rb": rb}, tag="rng")
        cid = s.resolve("rng")
    reference = ns["streams"](g, tg, rb)
    proc = run_fresh(
        C18 + """
import json, sys
store = ckptstore.Store(sys.argv[1], create=False)
g, tg = np.random.default_rng(0), torch.Generator()
rb = buffer(tg)
store.checkout("rng", into={"rng": ckptstore.RNGState(), "np_gen": g, "rb": rb})
print(json.dumps(streams(g, tg, rb)))
""",
        str(tmp_path / "s"),
    )
    assert __import__("json").loads(proc.stdout.strip().splitlines()[-1]) == reference
    with ckptstore.Store(tmp_path / "s") as s:  # a deleted record is an error naming it, never a silent skip
        # Editing the catalog's rows cannot remove it: checkout reads the manifest from the verified commit record.
        with s.catalog.write():
            s.catalog.conn.execute("DELETE FROM shards WHERE leaf_id = (SELECT id FROM leaves WHERE commit_id = ? AND path = 'rng/numpy/key')", (cid,))
            s.catalog.conn.execute("DELETE FROM leaves WHERE commit_id = ? AND path = 'rng/numpy/key'", (cid,))
        assert not s.fsck().ok
        s.checkout("rng", into={"rng": ckptstore.RNGState()}, partial=["rng"])
        # A commit made without it (an older writer, a hand-built state) is refused naming the leaf.
        (comp,) = ckptstore.adapters.capture({"rng": ckptstore.RNGState()}, s.registry)
        del comp.leaves["rng/numpy/key"]
        s.commit_components([comp], tag="no-numpy")
        with pytest.raises(ckptstore.errors.MissingLeafError, match="rng/numpy/key"):
            s.checkout("no-numpy", into={"rng": ckptstore.RNGState()}, partial=["rng"])


def test_global_rng_state_of_torchrl_checkpoint(store):
    from torchrl.checkpoint import GlobalRNGState

    torch.manual_seed(3)
    store.commit({"rng": GlobalRNGState()}, tag="g")
    ref = torch.rand(3)
    torch.manual_seed(4)
    store.checkout("g", into={"rng": GlobalRNGState()})
    assert_bit_equal(torch.rand(3), ref)


# --- services and versions ---------------------------------------------------------------------


def test_loss_module_target_updater_and_collector_counters(store):
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv
    from torchrl.modules import MLP, QValueActor
    from torchrl.objectives import DQNLoss, HardUpdate, SoftUpdate

    def build():
        env = GymEnv("CartPole-v1")
        actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"], spec=env.action_spec)
        loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
        return env, actor, loss, HardUpdate(loss, value_network_update_interval=5), SoftUpdate(DQNLoss(actor, action_space=env.action_spec, delay_value=True), eps=0.9)

    torch.manual_seed(0)
    env, actor, loss, hard, soft = build()
    collector = Collector(env, actor, frames_per_batch=20, total_frames=60, auto_register_policy_transforms=False)
    for _ in zip(range(2), collector):
        hard.step()
        soft.step()
    with torch.no_grad():
        for p in loss.target_value_network_params.values(True, True):
            p.add_(1.0)
    store.commit({"loss": loss, "hard": hard, "soft": soft, "collector": collector}, tag="svc")
    torch.manual_seed(1)
    env2, actor2, loss2, hard2, soft2 = build()
    collector2 = Collector(env2, actor2, frames_per_batch=20, total_frames=60, auto_register_policy_transforms=False)
    store.checkout("svc", into={"loss": loss2, "hard": hard2, "soft": soft2, "collector": collector2})
    assert hard2.counter == hard.counter == 2 and hard2.initialized and soft2.initialized
    assert collector2._frames == collector._frames == 40 and collector2._iter == collector._iter
    for a, b in zip(loss.state_dict().values(), loss2.state_dict().values()):
        assert_bit_equal(a, b)
    collector.shutdown()
    collector2.shutdown()


def test_newer_adapter_version_names_both_versions(store):
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(5), batch_size=1)
    rb.extend(TensorDict({"x": torch.arange(3)}, [3]))
    commit_edited(store, rb, "v", version={"writer": 7})
    with pytest.raises(AdapterVersionError, match=r"torchrl.writer.round_robin version 7.*version 2"):
        store.checkout("v", into=TensorDictReplayBuffer(storage=LazyTensorStorage(5), batch_size=1))
