"""Adapters for TorchRL writers: round-robin, max-value (top-k) and immutable-dataset writers.

Registered by :mod:`ckptstore.adapters.torchrl`, in its order."""

from __future__ import annotations

from typing import Any

import torch
from torchrl.data.replay_buffers import ImmutableDatasetWriter, RoundRobinWriter, TensorDictMaxValueWriter

from ...core.errors import TargetMismatchError
from ..base import Adapter, ComponentState
from .checks import expect_instance


def _writer_v1_to_v2(flat: dict, meta: dict) -> dict:
    """Version 1 kept only the cursor (as TorchRL before PR #4030)."""
    return {**flat, "write_count": None}


class RoundRobinWriterAdapter(Adapter):
    """``RoundRobinWriter`` and ``TensorDictRoundRobinWriter``.

    Leaves: ``cursor`` (next row), ``write_count`` (total rows ever written,
    which drives TorchRL's scheduling), and ``generation`` (int64 per slot)
    when the writer tracks generations.

    Version 1 state has no write count; it restores as the storage's length
    (the smallest count consistent with the stored data).
    """

    name = "torchrl.writer.round_robin"
    version = 2
    types = (RoundRobinWriter,)
    migrations = {1: _writer_v1_to_v2}

    def to_state(self, obj: RoundRobinWriter) -> dict:
        state = {"cursor": int(obj._cursor), "write_count": int(obj._write_count)}
        generation = obj._generation if getattr(obj, "_track_generations", False) else None
        if generation is not None:
            state["generation"] = generation
        return state

    def check(self, obj: Any, state: ComponentState) -> None:
        expect_instance(obj, RoundRobinWriter, state)
        cursor, count = state.json("cursor"), state.json("write_count")
        capacity = obj._storage.max_size if obj._storage is not None else None
        if type(cursor) is not int or cursor < 0 or (capacity is not None and cursor >= max(capacity, 1)):
            raise TargetMismatchError(f"{state.where('cursor')}: invalid cursor {cursor!r} for capacity {capacity}")
        if count is not None and (type(count) is not int or count < 0):
            raise TargetMismatchError(f"{state.where('write_count')}: invalid write count {count!r}")

    def from_state(self, obj: RoundRobinWriter, state: ComponentState) -> RoundRobinWriter:
        obj._cursor = state.json("cursor")
        count = state.json("write_count")
        if count is None:
            count = len(obj._storage) if obj._storage is not None else obj._cursor
        obj._write_count = count
        if state.has("generation"):
            obj._generation = state.tensor("generation").clone()
        return obj


class MaxValueWriterAdapter(Adapter):
    """``TensorDictMaxValueWriter`` (TorchRL's own ``state_dict`` raises for it).

    Leaves: ``cursor``, ``write_count``, ``rank_key``, ``reduction`` and ``heap``:
    the top-k heap as a list of ``(rank, index)`` tuples, with Python types kept
    exactly (TorchRL #4369: a heap that came back as lists with float indices
    broke the first write after restore); ranks that were tensors are stored as
    numbers with ``rank_dtypes`` to rebuild them.
    """

    name = "torchrl.writer.max_value"
    types = (TensorDictMaxValueWriter,)

    def to_state(self, obj: TensorDictMaxValueWriter) -> dict:
        heap, dtypes = [], []
        for rank, index in obj._current_top_values:
            if isinstance(rank, torch.Tensor):
                dtypes.append(str(rank.dtype).removeprefix("torch."))
                rank = rank.item()
            else:
                dtypes.append(None)
            heap.append((rank, int(index)))
        return {
            "cursor": int(obj._cursor), "write_count": int(obj._write_count), "rank_key": obj._rank_key,
            "reduction": obj._reduction, "heap": heap, "rank_dtypes": dtypes,
        }

    def check(self, obj: Any, state: ComponentState) -> None:
        expect_instance(obj, TensorDictMaxValueWriter, state)
        for key in ("rank_key", "reduction"):
            stored, target = state.json(key), getattr(obj, f"_{key}")
            if (tuple(stored) if isinstance(stored, list) else stored) != (tuple(target) if isinstance(target, list) else target):
                raise TargetMismatchError(f"{state.where(key)}: stored {stored!r}, target {target!r}")

    def from_state(self, obj: TensorDictMaxValueWriter, state: ComponentState) -> TensorDictMaxValueWriter:
        from ...core.shards import DTYPES

        heap = []
        for (rank, index), dtype in zip(state.json("heap"), state.json("rank_dtypes")):
            heap.append((torch.tensor(rank, dtype=DTYPES[dtype]) if dtype else rank, index))
        obj._current_top_values = heap
        obj._cursor = state.json("cursor")
        obj._write_count = state.json("write_count")
        return obj


class ImmutableDatasetWriterAdapter(Adapter):
    """``ImmutableDatasetWriter``: stateless (it refuses writes)."""

    name = "torchrl.writer.immutable"
    types = (ImmutableDatasetWriter,)

    def to_state(self, obj: ImmutableDatasetWriter) -> dict:
        return {}

    def check(self, obj: Any, state: ComponentState) -> None:
        expect_instance(obj, ImmutableDatasetWriter, state)

    def from_state(self, obj: ImmutableDatasetWriter, state: ComponentState) -> ImmutableDatasetWriter:
        return obj
