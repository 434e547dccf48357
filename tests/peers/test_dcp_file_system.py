"""Port of torch.distributed.checkpoint's own file-system checkpoint tests.

Upstream: pytorch/pytorch test/distributed/checkpoint/test_file_system_checkpoint_cpu.py
(commit 02dee1ad31d013c458c5071f1710da10a2d50392) and
test/distributed/checkpoint/test_format_utils.py (commit 01767dfbcd73a48fa66f4d69d6849f162725e09d)
test/distributed/checkpoint/test_dtensor_checkpoint.py (commit 1f30f7461128ad4339c0627cde1440c185e32231)
and test/distributed/checkpoint/e2e/test_e2e_save_and_load.py (commit 01357535d7c74848ba16d36179c2df92559e75ba).

Every test runs twice (fixture ``storage``): with DCP's FileSystemWriter/FileSystemReader
(the peer's storage) and with ckptstore's StoreWriter/StoreReader. The test bodies and
assertions are upstream's; the harness is this project's (real gloo groups of 2 forked
ranks, ``tests.unit.dcp.test_dcp.run_ranks``) instead of torch's MultiProcessTestCase, whose
module needs ``expecttest``, which is not installed. Differences from upstream:

- ``test_dtype_mismatch_casting`` is not ported: it needs
  ``DefaultLoadPlanner(allow_unsafe_types=)``, which torch 2.14.1 does not have.
- ``test_load_rowwise_to_colwise`` is not ported: it moves the model to CUDA.
- the Rot13 and ZStandard tests (two upstream classes, one test here parametrized by
  the extension) pass their stream extension only to the peer's
  storage (the extension transforms the peer's own files; ckptstore compresses its
  shards itself); their assertions are unchanged.
- ``TestFormatUtils.test_online_torch_save_to_dcp`` is not ported: it needs 2 GPUs.
- test_distributed_tensor_planner runs on CPU DTensors over gloo (upstream moves the
  module to CUDA and skips below 2 GPUs; nothing in it needs a GPU).
- e2e: ``test_e2e`` and ``test_e2e_async_cached`` run with a DDP model on 2 CPU ranks
  over gloo (upstream: FSDP/HSDP/DDP on 4 GPUs); the async one with the thread
  checkpointer and ``cache_staged_state_dict=False`` only (the cached variant stages into
  pinned memory, which needs CUDA; the process checkpointer cases too).
  ``test_different_ordered_state_dict_keys`` runs on 2 CPU ranks (upstream: 4 GPUs).
  Not ported: ``test_partial_load`` (FSDP on GPUs), ``test_overwrite`` (its subject is
  FileSystemWriter's ``overwrite=`` option), ``TestNoCPU`` (NCCL).
- format_utils' ``dcp_to_torch_save`` / ``torch_save_to_dcp`` construct a
  FileSystemReader/Writer inside; the ckptstore run calls the same DCP functions they
  call (``_load_state_dict`` with ``_EmptyStateDictLoadPlanner``, ``_save_state_dict``)
  with the ckptstore reader/writer instead.
"""

from __future__ import annotations

import os
import tempfile
import time
import unittest
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from io import BytesIO
from typing import IO, Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_saver as saver
import torch.nn.functional as F
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor, state_dict_hook
from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec, ShardMetadata
from torch.distributed.checkpoint import load, load_state_dict, save, save_state_dict
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    _patch_model_state_dict,
    _patch_optimizer_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse, _save_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.testing._internal.distributed.checkpoint_utils import Rot13Example, get_test_extension_registry
from torch.testing._internal.distributed.common_state_dict import VerifyStateDictMixin

from tests.unit.dcp.test_dcp import run_ranks
from ._backends import STORAGES, storage  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(120)

_THREAD_COUNTS = [1, 2]


@pytest.fixture(autouse=True)
def _tmp_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DCP_TEST_TMP", str(tmp_path))


def _extensions(storage, ext):
    return {"_extensions": [ext]} if storage.name == "peer" else {}


def assert_state_dict_equal(self, state_dict_1: dict, state_dict_2: dict) -> bool:
    self.assertEqual(len(state_dict_1), len(state_dict_2), "state_dict must be the same size")
    self.assertEqual(set(state_dict_1.keys()), set(state_dict_2.keys()), "state_dict keys do not match")
    for key, value_1 in state_dict_1.items():
        value_2 = state_dict_2[key]
        if isinstance(value_1, ShardedTensor):
            for local_shard_1, local_shard_2 in zip(value_1.local_shards(), value_2.local_shards()):
                self.assertTrue(torch.equal(local_shard_1.tensor, local_shard_2.tensor), f"Key {key}'s shard does not match")
        elif isinstance(value_1, torch.Tensor):
            self.assertTrue(torch.equal(value_1, value_2), f"Key {key}'s tensor does not match")
        elif isinstance(value_1, Stateful):
            self.assertEqual(value_1, value_2)
    return True


class MyTestModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


class _ShardedModel2(torch.nn.Module):  # as torch.testing's _test_st_common.MyShardedModel2
    def __init__(self, spec: ShardingSpec) -> None:
        super().__init__()
        self.sharded_tensor2 = sharded_tensor.rand(spec, 10, 20, init_rrefs=False)
        self.random_tensor2 = torch.nn.Parameter(torch.rand(2, 2))


class MyShardedModel1(torch.nn.Module):  # as torch.testing's _test_st_common.MyShardedModel1
    def __init__(self, spec: ShardingSpec) -> None:
        super().__init__()
        self.sharded_tensor1 = sharded_tensor.rand(spec, 10, 20, init_rrefs=False)
        self.random_tensor1 = torch.nn.Parameter(torch.rand(2, 2))
        self.submodule = _ShardedModel2(spec)


class MyShardedModel3(torch.nn.Module):
    def __init__(self, spec: ShardingSpec) -> None:
        super().__init__()
        self.sharded_tensor: ShardedTensor = sharded_tensor.rand(spec, 10, 20, init_rrefs=False)


class BlobState:
    def __init__(self, value: IO[bytes]) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlobState) and self.state == other.state

    def __repr__(self) -> str:
        return f"BlobState({self.state['blob']})"


# --- TestDistributedStateDictSaveLoad ----------------------------------------------------------


@pytest.mark.parametrize("thread_count", _THREAD_COUNTS)
def test_read_write_only_tensor(storage, thread_count):
    self = unittest.TestCase()
    with tempfile.TemporaryDirectory() as path:
        state_dict_to_save = MyTestModule().state_dict()
        save_state_dict(state_dict=state_dict_to_save, storage_writer=storage.writer(path, thread_count), no_dist=True)
        state_dict_to_load_to = MyTestModule().state_dict()
        with self.assertRaises(AssertionError):
            assert_state_dict_equal(self, state_dict_to_load_to, state_dict_to_save)
        load_state_dict(state_dict=state_dict_to_load_to, storage_reader=storage.reader(path), no_dist=True)
        assert_state_dict_equal(self, state_dict_to_load_to, state_dict_to_save)


# --- TestDistributedStateDictSaveLoadRot13 / ZStandard -----------------------------------------


@pytest.mark.parametrize("ext", ["rot13", "zstd"])
@pytest.mark.parametrize("thread_count", _THREAD_COUNTS)
def test_read_write_tensor_and_blob(storage, thread_count, ext):
    self = unittest.TestCase()
    with tempfile.TemporaryDirectory() as path:
        state_dict_to_save = MyTestModule().state_dict()
        state_dict_to_save["test_blob"] = BlobState(b"SomeBlobForTesting")
        extension = Rot13Example() if ext == "rot13" else ZStandard()
        save(state_dict=state_dict_to_save, storage_writer=storage.writer(path, thread_count, **_extensions(storage, extension)))
        state_dict_to_load_to = MyTestModule().state_dict()
        state_dict_to_load_to["test_blob"] = BlobState(b"")
        with self.assertRaises(AssertionError):
            assert_state_dict_equal(self, state_dict_to_load_to, state_dict_to_save)
        registry = {"_extension_registry": get_test_extension_registry()} if ext == "rot13" and storage.name == "peer" else {}
        load(state_dict=state_dict_to_load_to, storage_reader=storage.reader(path, **registry))
        assert_state_dict_equal(self, state_dict_to_load_to, state_dict_to_save)


# --- TestDistributedStateDictSaveLoadWithSharedTensor (2 gloo ranks) ---------------------------


def _shared_path(rank: int, base: str) -> str:
    paths = [tempfile.mkdtemp(dir=base)] if rank == 0 else [None]
    dist.broadcast_object_list(paths)
    return paths[0]


def _read_write_shard_tensor(rank: int, world: int, base: str, name: str, thread_count: int) -> bool:
    self, storage = unittest.TestCase(), STORAGES[name]
    path = _shared_path(rank, base)
    spec = ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"])
    model_to_save = MyShardedModel1(spec)
    model_to_save._register_state_dict_hook(state_dict_hook)
    state_dict_to_save = model_to_save.state_dict()
    save_state_dict(state_dict=state_dict_to_save, storage_writer=storage.writer(path, thread_count))
    dist.barrier()
    model_to_load = MyShardedModel1(spec)
    model_to_load._register_state_dict_hook(state_dict_hook)
    state_dict_to_load_to = model_to_load.state_dict()
    dist.barrier()
    with self.assertRaises(AssertionError):
        assert_state_dict_equal(self, state_dict_to_load_to, state_dict_to_save)
    load_state_dict(state_dict=state_dict_to_load_to, storage_reader=storage.reader(path))
    assert_state_dict_equal(self, state_dict_to_load_to, state_dict_to_save)
    dist.barrier()
    return True


@pytest.mark.parametrize("thread_count", _THREAD_COUNTS)
def test_read_write_shard_tensor(storage, thread_count):
    assert run_ranks(2, _read_write_shard_tensor, os.environ["DCP_TEST_TMP"], storage.name, thread_count) == [True, True]


# --- TestDistributedReshardOnLoad (2 gloo ranks) -----------------------------------------------


def _gather(tensor: ShardedTensor, rank: int):
    res = torch.zeros(tensor.shape, device="cpu") if rank == 0 else None
    tensor.gather(out=res)
    return res


def _reshard_specs() -> list:
    return [
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
        EnumerableShardingSpec(shards=[
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[2, 20], placement="rank:0"),
            ShardMetadata(shard_offsets=[2, 0], shard_sizes=[1, 20], placement="rank:1"),
            ShardMetadata(shard_offsets=[3, 0], shard_sizes=[3, 20], placement="rank:0"),
            ShardMetadata(shard_offsets=[6, 0], shard_sizes=[3, 20], placement="rank:1"),
            ShardMetadata(shard_offsets=[9, 0], shard_sizes=[1, 20], placement="rank:0"),
        ]),
        EnumerableShardingSpec(shards=[
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[8, 20], placement="rank:1"),
            ShardMetadata(shard_offsets=[8, 0], shard_sizes=[2, 20], placement="rank:0"),
        ]),
    ]


def _load_with_different_shard_plan(rank: int, world: int, base: str, name: str, thread_count: int) -> int:
    self, storage = unittest.TestCase(), STORAGES[name]
    path = _shared_path(rank, base)
    self.assertEqual(2, dist.get_world_size())
    specs, pairs = _reshard_specs(), 0
    for s0 in specs:
        for s1 in specs:
            if s0 == s1:
                continue
            dist.barrier()
            model_to_save = MyShardedModel3(s0)
            model_to_save._register_state_dict_hook(state_dict_hook)
            state_dict_to_save = model_to_save.state_dict()
            save_state_dict(state_dict=state_dict_to_save, storage_writer=storage.writer(path, thread_count))
            dist.barrier()
            model_to_load = MyShardedModel3(s1)
            model_to_load._register_state_dict_hook(state_dict_hook)
            state_dict_to_load_to = model_to_load.state_dict()
            dist.barrier()
            load_state_dict(state_dict=state_dict_to_load_to, storage_reader=storage.reader(path))
            dist.barrier()
            store_tensor = _gather(model_to_save.sharded_tensor, rank)
            dist.barrier()
            load_tensor = _gather(model_to_load.sharded_tensor, rank)
            if rank == 0:
                self.assertTrue(torch.allclose(store_tensor, load_tensor), f"{s0} vs {s1}")
            pairs += 1
    return pairs


@pytest.mark.parametrize("thread_count", _THREAD_COUNTS)
def test_load_with_different_shard_plan(storage, thread_count):
    assert run_ranks(2, _load_with_different_shard_plan, os.environ["DCP_TEST_TMP"], storage.name, thread_count, timeout=100) == [12, 12]


def _save_load_bytes(rank: int, world: int, base: str, name: str, thread_count: int) -> bool:
    self, storage = unittest.TestCase(), STORAGES[name]
    path = _shared_path(rank, base)
    state_dict_to_save = {"bytes0": [1], "bytes1": "string"}
    save_state_dict(state_dict=state_dict_to_save, storage_writer=storage.writer(path, thread_count))
    state_dict_to_load = {"bytes0": [2], "bytes1": "other"}
    load_state_dict(state_dict=state_dict_to_load, storage_reader=storage.reader(path))
    self.assertEqual([1], state_dict_to_load["bytes0"])
    self.assertEqual("string", state_dict_to_load["bytes1"])
    return True


@pytest.mark.parametrize("thread_count", _THREAD_COUNTS)
def test_save_load_bytes(storage, thread_count):
    assert run_ranks(2, _save_load_bytes, os.environ["DCP_TEST_TMP"], storage.name, thread_count) == [True, True]


def _switch_between_sharded_tensor_to_tensor(rank: int, world: int, base: str, name: str, thread_count: int) -> int:
    self, storage = unittest.TestCase(), STORAGES[name]
    path = _shared_path(rank, base)
    tensor_size = 32
    specs = [
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
        EnumerableShardingSpec(shards=[
            ShardMetadata(shard_offsets=[0], shard_sizes=[8], placement="rank:1"),
            ShardMetadata(shard_offsets=[8], shard_sizes=[tensor_size - 8], placement="rank:0"),
        ]),
        EnumerableShardingSpec(shards=[
            ShardMetadata(shard_offsets=[0], shard_sizes=[10], placement="rank:0"),
            ShardMetadata(shard_offsets=[10], shard_sizes=[tensor_size - 10], placement="rank:1"),
        ]),
    ]
    pairs = 0
    for save_spec in specs:
        for load_spec in specs:
            save_dict = {"sharded": sharded_tensor.rand(save_spec, tensor_size), "replicated": torch.rand(tensor_size, device="cpu")}
            dist.broadcast(save_dict["replicated"], src=0)
            save_state_dict(state_dict=save_dict, storage_writer=storage.writer(path, thread_count))
            # Freaky Friday the tensors
            load_dict = {"sharded": torch.zeros(tensor_size, device="cpu"), "replicated": sharded_tensor.zeros(load_spec, tensor_size)}
            load_state_dict(state_dict=load_dict, storage_reader=storage.reader(path))
            save_dict_sharded = _gather(save_dict["sharded"], rank)
            load_dict_replicated = _gather(load_dict["replicated"], rank)
            if rank == 0:
                self.assertTrue(torch.allclose(save_dict_sharded, load_dict["sharded"]), f"save-spec {save_spec} load-spec {load_spec}")
                self.assertTrue(torch.allclose(save_dict["replicated"], load_dict_replicated), f"save-spec {save_spec} load-spec {load_spec}")
            pairs += 1
    return pairs


@pytest.mark.parametrize("thread_count", _THREAD_COUNTS)
def test_switch_between_sharded_tensor_to_tensor(storage, thread_count):
    assert run_ranks(2, _switch_between_sharded_tensor_to_tensor, os.environ["DCP_TEST_TMP"], storage.name, thread_count, timeout=100) == [16, 16]


# --- test_format_utils.py: TestFormatUtilsNoDist -----------------------------------------------


class SimpleModelUneven(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = torch.nn.Linear(5, 10)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(10, 15)
        self.net3 = torch.nn.Linear(15, 30)
        self.net4 = torch.nn.Linear(30, 5)


def _dcp_to_torch_save(storage, dcp_dir: str, torch_path: str) -> None:
    """format_utils.dcp_to_torch_save with the storage's reader."""
    sd: dict = {}
    _load_state_dict(sd, storage_reader=storage.reader(dcp_dir), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    torch.save(sd, torch_path)


def _torch_save_to_dcp(storage, torch_path: str, dcp_dir: str) -> None:
    """format_utils.torch_save_to_dcp with the storage's writer."""
    _save_state_dict(torch.load(torch_path, weights_only=False), storage_writer=storage.writer(dcp_dir), no_dist=True)


def test_dcp_to_torch_save(storage, tmp_path):
    self = unittest.TestCase()
    dcp_dir = str(tmp_path / "dcp")
    model = SimpleModelUneven()
    dcp.save({"model": model}, storage_writer=storage.writer(dcp_dir))
    torch_path = str(tmp_path / "model.pt")
    _dcp_to_torch_save(storage, dcp_dir, torch_path)
    loaded_sd = torch.load(torch_path)
    torch.testing.assert_close(loaded_sd, {"model": model.state_dict()}, rtol=0, atol=0)
    self.assertEqual(set(loaded_sd), {"model"})


def test_torch_save_to_dcp(storage, tmp_path):
    dcp_dir = str(tmp_path / "dcp")
    model = SimpleModelUneven()
    sd = {"model": model.state_dict()}
    torch_path = str(tmp_path / "model.pt")
    torch.save(sd, torch_path)
    _torch_save_to_dcp(storage, torch_path, dcp_dir)
    model = SimpleModelUneven()
    dcp.load({"model": model}, storage_reader=storage.reader(dcp_dir))
    torch.testing.assert_close({"model": model.state_dict()}, sd, rtol=0, atol=0)


# --- test_dtensor_checkpoint.py: DTensorPlanner (2 gloo ranks, CPU) ---------------------------


class DTensorModule(torch.nn.Module):
    def __init__(self, sdt, rdt, extra_state: int = 1, extra_state_tensor: torch.Tensor = torch.zeros(1)) -> None:
        super().__init__()
        self.rdt = torch.nn.Parameter(rdt)
        self.sdt = torch.nn.Parameter(sdt)
        self._extra_state = extra_state
        self._extra_state_tensor = extra_state_tensor

    def get_extra_state(self) -> dict:
        return {"extra_state": self._extra_state, "extra_state_tensor": self._extra_state_tensor}

    def set_extra_state(self, state: dict) -> None:
        self._extra_state = state["extra_state"]
        self._extra_state_tensor = state["extra_state_tensor"]


def _create_dtensor_model(tensor_to_shard, tensor_to_replicate):
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

    mesh = DeviceMesh(device_type="cpu", mesh=range(dist.get_world_size()))
    sharded_dt = distribute_tensor(tensor_to_shard, mesh, placements=[Shard(0)])
    replicated_dt = distribute_tensor(tensor_to_replicate, mesh, placements=[Replicate()])
    return DTensorModule(sharded_dt, replicated_dt), sharded_dt, replicated_dt


def _distributed_tensor_planner(rank: int, world: int, base: str, name: str) -> bool:
    self, storage = unittest.TestCase(), STORAGES[name]
    path = _shared_path(rank, base)
    local_tensor = torch.arange(0, 4, dtype=torch.float32)
    local_tensor_2 = torch.arange(4, 8, dtype=torch.float32)
    model, sharded_dt, replicated_dt = _create_dtensor_model(local_tensor, local_tensor_2)
    save_state_dict(state_dict=model.state_dict(), storage_writer=storage.writer(path), planner=dcp.DefaultSavePlanner())
    model, _, _ = _create_dtensor_model(local_tensor * 10, local_tensor_2 * 10)
    state_dict = model.state_dict()
    load_state_dict(state_dict=state_dict, storage_reader=storage.reader(path), planner=dcp.DefaultLoadPlanner())
    for k, v in state_dict.items():
        if k == "rdt":
            self.assertTrue(torch.equal(replicated_dt.to_local(), v.to_local()))
        if k == "sdt":
            self.assertTrue(torch.equal(sharded_dt.to_local(), v.to_local()))
        if k == "_extra_state":
            self.assertEqual(1, v["extra_state"])
            self.assertTrue(torch.equal(torch.tensor([0.0]), v["extra_state_tensor"]))
    return sorted(state_dict) == ["_extra_state", "rdt", "sdt"]


def test_distributed_tensor_planner(storage):
    assert run_ranks(2, _distributed_tensor_planner, os.environ["DCP_TEST_TMP"], storage.name) == [True, True]


# --- e2e/test_e2e_save_and_load.py -------------------------------------------------------------

device_type = "cpu"


def _assert_equal(a, b) -> None:
    """torch's TestCase.assertEqual, as far as these tests use it: tensors with
    ``assert_close``'s default tolerances, containers element by element, the rest with ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        torch.testing.assert_close(a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert set(a) == set(b), (sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    else:
        assert a == b, (a, b)


class _Verify(VerifyStateDictMixin, unittest.TestCase):
    def assertEqual(self, first, second, msg=None):  # noqa: N802 (unittest's name)
        _assert_equal(first, second)


class TestDummyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = torch.nn.Linear(8, 16)
        self.net2 = torch.nn.Linear(16, 32)
        self.net3 = torch.nn.Linear(32, 64)
        self.net4 = torch.nn.Linear(64, 8)

    def forward(self, x):
        x = F.relu(self.net1(x))
        x = F.relu(self.net2(x))
        x = F.relu(self.net3(x))
        return F.relu(self.net4(x))

    def get_input(self):
        return torch.rand(8, 8, device=device_type)


class TestStatefulObj:
    def __init__(self) -> None:
        self.data = torch.rand(10, 10, device=device_type)

    def state_dict(self):
        return {"data": self.data}

    def load_state_dict(self, state_dict):
        self.data = state_dict["data"]

    def __eq__(self, other):
        return torch.equal(self.data, other.data)


@dataclass
class TestTrainState:
    step: int = 0
    current_loss: float = -1
    losses: list = field(default_factory=list)

    def state_dict(self) -> dict:
        loss_bytes = BytesIO()
        torch.save(self.losses, loss_bytes)
        return {"step": torch.tensor(self.step, dtype=torch.int32), "current_loss": torch.tensor(self.current_loss, dtype=torch.float32), "losses": loss_bytes}

    def load_state_dict(self, state_dict) -> None:
        self.step = state_dict["step"].item()
        self.current_loss = state_dict["current_loss"].item()
        state_dict["losses"].seek(0)
        self.losses = torch.load(state_dict["losses"])

    def __eq__(self, other):
        return self.step == other.step and self.current_loss == other.current_loss and self.losses == other.losses


def _train(model, optim, train_steps=1):
    torch.manual_seed(0)
    loss = None
    train_state = TestTrainState()
    for _ in range(train_steps):
        loss = model(model.get_input()).sum()
        loss.backward()
        train_state.step += 1
        train_state.current_loss = torch.rand(1).item()
        train_state.losses.append(train_state.current_loss)
        optim.step()
        optim.zero_grad()
    return loss, train_state


def _optim(model):
    return torch.optim.Adam(model.parameters(), lr=0.1)


def _create_model(ddp: bool):
    dummy_model = TestDummyModel().to(device_type)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(dummy_model)
        model.get_input = partial(TestDummyModel.get_input, model)
    else:
        model = dummy_model
    optim = _optim(model)
    if ddp:
        _patch_model_state_dict(model)
        _patch_optimizer_state_dict(model, optimizers=optim)
    return model, optim


def _run_e2e_test(rank: int, world: int, base: str, name: str, async_op: bool, cache_staged_state_dict: bool) -> bool:
    self, storage = _Verify(), STORAGES[name]
    temp_dir = _shared_path(rank, base)
    model, optim = _create_model(ddp=False)
    _train(model, optim, train_steps=2)
    dist_model, dist_optim = _create_model(ddp=True)
    _, original_train_state = _train(dist_model, dist_optim, train_steps=2)
    original_stateful_obj = TestStatefulObj()
    sd = {"model": dist_model, "optimizer": dist_optim, "s": original_stateful_obj, "train_state": original_train_state}
    if async_op:
        kwargs = {"cache_staged_state_dict": cache_staged_state_dict} if storage.name == "peer" else {}
        writer = storage.writer(temp_dir, **kwargs)
        stager = None
        if not cache_staged_state_dict:
            stager = DefaultStager(StagingOptions(use_async_staging=False, use_shared_memory=False, use_pinned_memory=False, use_non_blocking_copy=False))
        response = saver.async_save(sd, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=stager)
        if isinstance(response, Future):
            save_future = response
        else:
            if not isinstance(response, AsyncSaveResponse):
                raise AssertionError(f"Expected AsyncSaveResponse, got {type(response)}")
            save_future = response.upload_completion
        while not save_future.done():
            time.sleep(0.05)
        save_future.result()
    else:
        dcp.save(sd, storage_writer=storage.writer(temp_dir))
    loaded_stateful_obj = TestStatefulObj()
    loaded_train_state = TestTrainState()
    dist_model, dist_optim = _create_model(ddp=True)
    dcp.load(
        state_dict={"model": dist_model, "optimizer": dist_optim, "s": loaded_stateful_obj, "train_state": loaded_train_state},
        storage_reader=storage.reader(temp_dir),
    )
    self.assertEqual(original_stateful_obj, loaded_stateful_obj)
    self.assertEqual(original_train_state, loaded_train_state)
    loss, _ = _train(model, optim, train_steps=1)
    dist_loss, _ = _train(dist_model, dist_optim, train_steps=1)
    self.assertEqual(loss, dist_loss)
    dist_msd, dist_osd = get_state_dict(dist_model, optimizers=dist_optim)
    model_sd, _ = get_state_dict(model, optimizers=optim)
    self._verify_msd(model_sd, dist_msd)
    self._verify_osd_by_load(model, optim, _optim(model), dist_osd)
    return True


def test_e2e(storage):
    assert run_ranks(2, _run_e2e_test, os.environ["DCP_TEST_TMP"], storage.name, False, False, timeout=100) == [True, True]


@pytest.mark.parametrize("cache_staged_state_dict", [False])  # True stages into pinned memory: CUDA
def test_e2e_async_cached(storage, cache_staged_state_dict):
    assert run_ranks(2, _run_e2e_test, os.environ["DCP_TEST_TMP"], storage.name, True, cache_staged_state_dict, timeout=100) == [True, True]


def test_stateful_and_non_stateful_loads(storage, tmp_path):
    self = unittest.TestCase()

    class StateDict(dict):
        def __init__(self):
            self.set_sd_item_called = False

        def __setitem__(self, item, value):
            self.set_sd_item_called = True
            super().__setitem__(item, value)

    class Foo(Stateful):
        def __init__(self):
            self.load_state_dict_called = False

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            self.load_state_dict_called = True

    temp_dir = str(tmp_path / "ckpt")
    stateful_foo = Foo()
    sd = StateDict()
    sd["foo"] = stateful_foo
    sd.set_sd_item_called = False
    dcp.save(sd, storage_writer=storage.writer(temp_dir))
    dcp.load(sd, storage_reader=storage.reader(temp_dir))
    self.assertTrue(stateful_foo.load_state_dict_called)
    self.assertFalse(sd.set_sd_item_called)
    sd = StateDict()
    sd["foo"] = {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]}
    sd.set_sd_item_called = False
    dcp.save(sd, storage_writer=storage.writer(temp_dir))
    dcp.load(sd, storage_reader=storage.reader(temp_dir))
    self.assertTrue(sd.set_sd_item_called)


def test_no_dist(storage, tmp_path):
    temp_dir = str(tmp_path / "ckpt")
    dcp.save({}, storage_writer=storage.writer(temp_dir))
    dcp.load({}, storage_reader=storage.reader(temp_dir))


def test_init_state_dict(storage, tmp_path):
    self = _Verify()
    temp_dir = str(tmp_path / "ckpt")
    model = TestDummyModel()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    state_dict_to_save = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim)}
    dcp.save(state_dict_to_save, storage_writer=storage.writer(temp_dir))
    torch.manual_seed(0)
    model_2 = TestDummyModel()
    optim_2 = torch.optim.Adam(model_2.parameters(), lr=0.2)
    msd = get_model_state_dict(model_2)
    osd = get_optimizer_state_dict(model_2, optim_2)
    state_dict_to_load = {"model": msd, "optimizer": osd}
    dcp.load(state_dict_to_load, storage_reader=storage.reader(temp_dir))
    self.assertTrue(msd is state_dict_to_load["model"])
    self.assertTrue(osd is state_dict_to_load["optimizer"])
    set_state_dict(model_2, optim_2, model_state_dict=state_dict_to_load["model"], optim_state_dict=state_dict_to_load["optimizer"])
    self.assertEqual(msd, get_model_state_dict(model_2))
    self.assertEqual(osd, get_optimizer_state_dict(model_2, optim_2))
    self.assertEqual(optim_2.param_groups[0]["lr"], 0.1)


class _Foo:
    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        world_size = dist.get_world_size()
        tl = [torch.ones(2, dtype=torch.int64, device=device_type) for _ in range(world_size)]
        t = torch.arange(2, dtype=torch.int64, device=device_type) + 1 + 2 * dist.get_rank()
        dist.all_gather(tl, t, async_op=False)


class _Bar:
    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        tensor = torch.arange(2, dtype=torch.int64, device=device_type) + 1 + 2 * dist.get_rank()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def _different_ordered_state_dict_keys(rank: int, world: int, base: str, name: str) -> bool:
    storage = STORAGES[name]
    temp_dir = _shared_path(rank, base)
    sd = {"A": _Foo(), "B": _Bar()} if rank == 0 else {"B": _Bar(), "A": _Foo()}
    dcp.save(sd, storage_writer=storage.writer(temp_dir))
    dcp.load(sd, storage_reader=storage.reader(temp_dir))
    return True


def test_different_ordered_state_dict_keys(storage):
    assert run_ranks(2, _different_ordered_state_dict_keys, os.environ["DCP_TEST_TMP"], storage.name) == [True, True]
