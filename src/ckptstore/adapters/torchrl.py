"""Adapters for TorchRL: replay buffers (storage, writer, sampler), target-network
updaters, collectors and ``torchrl.checkpoint.GlobalRNGState``.

A replay buffer is a container of three components, ``storage``, ``writer``
and ``sampler``, restored in that order so that the writer and sampler see
the restored storage. Checking out into a freshly built, never-written buffer
initialises its lazy storage from the stored shapes first (TorchRL issue #3056).

Read from TorchRL 0.14's sources (``torchrl/data/replay_buffers``); the state
layouts below are ckptstore's own, versioned independently of TorchRL's
``state_dict``/``dumps`` formats.
"""

from __future__ import annotations

import json
import threading
import warnings
import weakref
from itertools import pairwise
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, is_non_tensor, is_tensor_collection
from torchrl.checkpoint import GlobalRNGState
from torchrl.collectors import BaseCollector
from torchrl.data.replay_buffers import (
    CompressedListStorage,
    ConsumingSampler,
    ImmutableDatasetWriter,
    LazyMemmapStorage,
    ListStorage,
    PrioritizedSampler,
    PrioritizedSliceSampler,
    PromptGroupSampler,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    Sampler,
    SamplerEnsemble,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    StalenessAwareSampler,
    Storage,
    StorageEnsemble,
    StoreStorage,
    StreamingSliceSampler,
    TensorDictMaxValueWriter,
    TensorStorage,
    Writer,
    WriterEnsemble,
)
from torchrl.objectives.utils import TargetNetUpdater
from torchrl.trainers import Trainer

from .. import jsonvalue
from ..errors import HyperparameterOverrideWarning, ShapeMismatchError, TargetMismatchError, UnsupportedTypeError
from .base import (
    REGISTRY,
    Adapter,
    ComponentState,
    Json,
    RowToken,
    StateDictAdapter,
    StorageIdentity,
    escape,
    join,
    plain,
    register_adapter,
    same_class,
    split,
    unflatten,
)
from .rng import RNGState, RNGStateAdapter
from .values import TensorDictAdapter


@register_adapter
class ReplayBufferAdapter(Adapter):
    """Any TorchRL ``ReplayBuffer`` (``TensorDict*`` and prioritized variants).

    Children: ``storage``, ``writer``, ``sampler``; ``generator`` when the buffer
    was built with its own ``torch.Generator``; ``transform`` when its transforms
    hold state (``ObservationNorm``, ``VecNorm`` statistics...).
    """

    name = "torchrl.replay_buffer"
    types = (ReplayBuffer,)

    def check_partial(self, obj: ReplayBuffer, restored: list[str], skipped: dict[str, ComponentState]) -> None:
        """The rules of a partial restore (docs/adapters.md):

        - a writer or sampler restored without the storage needs the target's
          storage to hold as many rows as the committed one did, with the same
          capacity (their cursors, priorities and permutations index those rows);
        - a storage restored without its writer or sampler resets them as if the
          restored rows had just been written, in order, into an emptied buffer:
          supported for round-robin writers without generation tracking and for
          every sampler over a one-dimensional storage.
        """
        parent = skipped[next(iter(skipped))].path.rpartition("/")[0]
        where, storage_path = parent or "<root>", join(parent, "storage")
        dependent = [n for n in ("writer", "sampler") if n in restored]
        if "storage" in skipped and dependent:
            state = skipped["storage"]
            rows = len(state.json("kinds")) if state.adapter == ListStorageAdapter.name else state.json("len")
            capacity = state.json("max_size")
            if rows != len(obj._storage) or capacity != obj._storage.max_size:
                raise TargetMismatchError(
                    f"{where}: restoring the {' and '.join(dependent)} without the storage needs the target's storage to hold "
                    f"the {rows} rows the commit's did, with its capacity {capacity}; it holds {len(obj._storage)} of "
                    f"{obj._storage.max_size}: check out {storage_path} as well"
                )
        if "storage" in skipped and "writer" in restored and not isinstance(obj._writer, RoundRobinWriter):
            raise TargetMismatchError(  # its state ranks the committed rows' values, not the target's
                f"{where}: a {type(obj._writer).__name__} restored without its storage would rank rows it does not hold: "
                f"check out {storage_path} with it"
            )
        if "storage" in restored:
            writer = obj._writer
            if "writer" in skipped and not (isinstance(writer, RoundRobinWriter) and not getattr(writer, "_track_generations", False)):
                raise TargetMismatchError(
                    f"{where}: a {type(writer).__name__} cannot be rebuilt from restored rows: check out {join(parent, 'writer')} with the storage"
                )
            if "sampler" in skipped and getattr(obj._storage, "ndim", 1) != 1:
                raise TargetMismatchError(f"{where}: check out {join(parent, 'sampler')} with a storage of ndim {obj._storage.ndim}")

    def after_partial(self, obj: ReplayBuffer, restored: list[str], skipped: list[str]) -> None:
        if "storage" not in restored:
            return
        rows = len(obj._storage)
        if "writer" in skipped:
            obj._writer._cursor = rows % obj._storage.max_size
            obj._writer._write_count = rows
        if "sampler" in skipped:
            sampler = obj._sampler
            sampler._empty()  # what ReplayBuffer.empty() does
            if isinstance(sampler, PrioritizedSampler) and rows:
                sampler.mark_update(torch.arange(rows), storage=obj._storage)  # what extend() does: the default priority

    def children(self, obj: ReplayBuffer) -> dict:
        kids = {"storage": obj._storage, "writer": obj._writer, "sampler": obj._sampler}
        rng = getattr(obj, "_rng", None)
        if rng is not None:
            kids["generator"] = rng
        transform = getattr(obj, "_transform", None)
        if transform is not None and len(transform.state_dict()):
            kids["transform"] = transform
        return kids


def _expect(obj: Any, cls: type, state: ComponentState) -> None:
    if not isinstance(obj, cls):
        raise TargetMismatchError(
            f"{state.where('')}: stored a {state.meta.get('class', state.adapter)}, target is a {type(obj).__module__}.{type(obj).__qualname__}"
        )


# --- storage ----------------------------------------------------------------------


def _warn_overrides(state: ComponentState, built: dict[str, Any]) -> None:
    """Warn (HyperparameterOverrideWarning) for each hyperparameter in ``built`` (leaf name:
    the target's value) that the restore replaces with a different committed value."""
    for key, value in built.items():
        stored = state.json(key)
        if stored != value:
            warnings.warn(
                f"{state.where(key)}: the restore sets {key} to the committed {stored!r}; the target was built with {value!r}",
                HyperparameterOverrideWarning, stacklevel=2,
            )


def _storage_leaves(data: Any, path: str) -> dict[str, torch.Tensor]:
    """``{escaped key path: full-capacity tensor}`` of a storage's backing data."""
    if isinstance(data, torch.Tensor) and not is_tensor_collection(data):
        return {"": data}
    if not is_tensor_collection(data):
        raise UnsupportedTypeError(f"{path}: storages backed by {type(data).__name__} (pytrees) are not supported")
    out: dict[str, torch.Tensor] = {}

    def walk(td: Any, prefix: str) -> None:
        for key in td.keys():
            value = td._get_str(key, None)
            p = join(prefix, escape(key))
            if is_non_tensor(value):
                raise UnsupportedTypeError(f"{path}/data/{p}: non-tensor data in a tensor storage is not supported")
            if is_tensor_collection(value):
                walk(value, p)
            else:
                out[p] = value

    walk(data, "")
    return out


class WriteLog:
    """Which rows of a TorchRL ``TensorStorage`` (``ndim == 1``) were written, and when.

    Installed as the storage's ``set`` (an instance attribute calling the class's
    method) by the first commit that fingerprints the storage: every TorchRL write
    path of rows goes through ``set`` (``extend``, ``add``, ``rb[idx] = ...``,
    the writers). It also installs the storage's ``__getstate__``, which leaves both
    out: a copied or pickled storage has no log (until a commit of it installs one).
    Each call gets a write number ``seq``, and the rows it writes are stamped with it
    (one int64 per row of capacity, 8 bytes per row), so a commit hashes only the
    shards holding rows written since the last commit.

    A write the log does not see makes it forget: before and after each ``set``,
    and when a token is taken, it compares the storage's mutation revision (TorchRL
    bumps it on every write through the storage or buffer, in any process) and
    each column's address and torch version counter with what it recorded after
    the last logged write; ``set`` itself must bump the revision exactly once. Any
    difference (``rb.update_``, ``set_at_``, ``empty``, a spawned process's write, an
    in-place op on a column or a view of it) sets ``valid_from`` past every
    earlier token, so the next commit hashes whole columns. Writes that change
    neither (``.data``, numpy views, another process writing a memory map) are
    what the store's random sample of reused shards is for (see ``Store``).
    Columns that share memory (views of one buffer) are never tracked: a write to
    rows of one changes other rows of another.

    The log never raises into the training loop: any problem only makes it forget.
    """

    def __init__(self, storage: TensorStorage):
        self._ref = weakref.ref(storage)
        self._lock = threading.RLock()
        self.seq = 0
        self.valid_from = 1
        self._stamps: torch.Tensor | None = None  # write number per row, allocated at the first logged write
        self._state: tuple | None = None  # (revision, ((key, address, version), ...)) after the last logged write
        self._data: Any = None  # weak reference to the storage's backing TensorDict or tensor
        self._cols: tuple = ()  # ((key, weak reference to the column), ...)
        self._since: tuple = (None, None)  # the last rows_since answer, by (its seq, the log's seq): one per commit
        self._aliased = False  # two columns share memory

    @classmethod
    def of(cls, storage: TensorStorage) -> WriteLog | None:
        """The storage's log, installed now if it has none; ``None`` for storages it
        cannot follow (``ndim > 1``, or another ``set`` already set on the instance)."""
        current = vars(storage).get("set")
        if isinstance(current, cls) and current._ref() is storage:
            return current
        if current is not None or storage.ndim != 1:
            return None
        log = cls(storage)
        storage.set = log
        storage.__getstate__ = log._getstate  # found before the class's by copy and pickle
        return log

    def _getstate(self) -> dict:
        storage = self._ref()
        state = type(storage).__getstate__(storage)
        if state is vars(storage):
            state = dict(state)
        state.pop("set", None)
        state.pop("__getstate__", None)
        return state

    def __call__(self, cursor: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        storage = self._ref()
        method = type(storage).set.__get__(storage, type(storage))
        with self._lock:
            before = self._observe(storage)
            ok = False
            try:
                result = method(cursor, data, *args, **kwargs)
                ok = True
            finally:
                after = self._observe(storage)
                self.seq += 1
                if not (ok and before is not None and after is not None and before == self._state and after[0] == before[0] + 1 and self._stamp(cursor)):
                    self.valid_from = self.seq
                self._state = after
        return result

    def _stamp(self, cursor: Any) -> bool:
        try:
            if self._stamps is None:
                with torch.inference_mode(False):  # a first write under inference mode must not make it an inference tensor
                    self._stamps = torch.zeros(int(self._ref().max_size), dtype=torch.int64)
            self._stamps[torch.as_tensor(cursor) if isinstance(cursor, range) else cursor] = self.seq
        except (TypeError, ValueError, IndexError, RuntimeError):
            return False
        return True

    def _observe(self, storage: TensorStorage, refresh: bool = False) -> tuple | None:
        try:
            if not storage.initialized:
                return None
            data = storage._storage
            tensors = [ref() for _, ref in self._cols]
            if refresh or self._data is None or self._data() is not data or any(t is None for t in tensors):
                leaves = _storage_leaves(data, "storage")
                self._data = weakref.ref(data)
                self._cols = tuple((k, weakref.ref(t)) for k, t in leaves.items())
                tensors = list(leaves.values())
                spans = sorted((m.data_ptr(), m.data_ptr() + m.nbytes()) for m in (t.untyped_storage() for t in tensors))
                self._aliased = any(b[0] < a[1] for a, b in pairwise(spans))  # overlapping memory
            return int(storage._mutation_revision), tuple((k, t.data_ptr(), t._version) for (k, _), t in zip(self._cols, tensors))
        except Exception:  # noqa: BLE001 - a write through the buffer must never fail because of the log
            return None

    def token_seq(self, storage: TensorStorage) -> int:
        """The write number for tokens taken now. If anything was written since the
        last logged write that the log did not see (the columns are listed afresh:
        one added or replaced is such a write), earlier tokens become incomparable."""
        with self._lock:
            now = self._observe(storage, refresh=True)
            if now is None or now != self._state or self._aliased:
                self.seq += 1
                self.valid_from = self.seq
                self._state = now
            return self.seq

    def rows_since(self, seq: int) -> torch.Tensor | None:
        """Indices of the rows written after write number ``seq``, or ``None`` if the
        log cannot tell (an unseen write since)."""
        with self._lock:
            if seq < self.valid_from or self._stamps is None:
                return None
            if self._since[0] != (seq, self.seq):
                # numpy's flatnonzero: a quarter of torch's compare-then-nonzero time on a large buffer
                self._since = (seq, self.seq), torch.from_numpy(np.flatnonzero(self._stamps.numpy() > seq))
            return self._since[1]


def _stored_keys(state: ComponentState) -> dict[str, str]:
    """``{storage key: leaf path}`` (the key is ``""`` for a plain tensor storage)."""
    return {k[len("data/"):] if k != "data" else "": k for k in state.keys("data")}


def _can_add_keys(storage: TensorStorage) -> bool:
    data = storage._storage
    return is_tensor_collection(data) and not data.is_locked and not data.is_memmap()


@register_adapter
class TensorStorageAdapter(Adapter):
    """``TensorStorage``, ``LazyTensorStorage`` and ``LazyMemmapStorage``.

    Leaves: ``max_size``, ``ndim``, ``len`` (elements), ``initialized`` and
    ``layout`` (``"tensordict"`` or ``"tensor"``) as JSON; ``data/<key>`` the
    written rows ``[0, n)`` along dim 0 of each tensor (``data`` for a plain
    tensor storage). Never-written capacity is not stored: a 1,000,000-row
    memory-mapped storage holding 24 rows commits 24 rows.

    Checkout needs the same capacity, ``ndim`` and layout, and, when the target
    is already initialised, the same keys, dtypes and per-row shapes (keys the
    commit has and an in-memory, unlocked target lacks are added). A lazy
    target that was never written is initialised from the stored shapes; the
    stored rows are then read straight into the target's (memory-mapped) tensors.
    """

    name = "torchrl.storage.tensor"
    types = (TensorStorage,)
    direct = True

    def to_state(self, obj: TensorStorage) -> dict:
        state: dict[str, Any] = {"max_size": int(obj.max_size), "ndim": int(obj.ndim), "len": len(obj), "initialized": bool(obj.initialized)}
        if obj.initialized:
            data = obj._storage
            rows = obj._len_along_dim0
            leaves = _storage_leaves(data, "storage")
            state["layout"] = "tensor" if "" in leaves else "tensordict"
            state["data"] = leaves[""][:rows] if "" in leaves else unflatten({k: v[:rows] for k, v in leaves.items()})
        return state

    def fingerprints(self, obj: TensorStorage) -> dict:
        """TorchRL bumps a storage's mutation revision (shared with spawned
        processes) on every write through the storage, and torch bumps a
        tensor's version counter on every in-place op; together they tell
        whether the written rows changed since the last commit. For a storage
        with ``ndim == 1`` the tokens are :class:`RowToken` s of its
        :class:`WriteLog` (installed here), which also name the rows written.

        Inference tensors (made under ``torch.inference_mode()``) have no
        version counter: they get no token and are always hashed."""
        revision = getattr(obj, "_mutation_revision", None)
        if revision is None or not obj.initialized:
            return {}
        rows = obj._len_along_dim0
        leaves = _storage_leaves(obj._storage, "storage")
        log = WriteLog.of(obj)
        seq = None if log is None else log.token_seq(obj)
        out = {}
        for key, t in leaves.items():
            if t.is_inference():
                continue
            parts = (StorageIdentity(t.untyped_storage()), t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
            token = (int(revision), rows, t._version, *parts)
            out["data" if key == "" else f"data/{key}"] = token if log is None else RowToken(token, parts, log, seq)
        return out

    def check(self, obj: Any, state: ComponentState) -> None:
        _expect(obj, TensorStorage, state)
        where = state.where("")
        for key in ("max_size", "ndim"):
            stored, target = state.json(key), int(getattr(obj, key))
            if stored != target:
                what = "capacity (max_size)" if key == "max_size" else key
                raise TargetMismatchError(f"{where}: {what} differs: stored {stored}, target {target}")
        length, initialized = state.json("len"), state.json("initialized")
        if type(length) is not int or not 0 <= length <= state.json("max_size") or type(initialized) is not bool:
            raise TargetMismatchError(f"{where}: invalid length {length!r} for capacity {state.json('max_size')}")
        if initialized:
            rows = {state.spec(k)[1][0] for k in state.keys("data")}
            expected = {length} if state.json("ndim") == 1 else rows
            if len(rows) != 1 or rows != expected or max(rows) > state.json("max_size"):
                raise TargetMismatchError(f"{where}: stored rows {sorted(rows)} do not match the length {length}")
        if not initialized or not obj.initialized:
            return
        target = _storage_leaves(obj._storage, where)
        layout = "tensor" if "" in target else "tensordict"
        if layout != state.json("layout"):
            raise TargetMismatchError(f"{where}: layout differs: stored {state.json('layout')}, target {layout}")
        stored = _stored_keys(state)
        missing = sorted(set(target) - set(stored))
        extra = sorted(set(stored) - set(target))
        if missing or (extra and not _can_add_keys(obj)):
            raise TargetMismatchError(f"{where}: storage keys differ; not in the commit: {missing}, not in the target: {extra}")
        for key, tensor in target.items():
            dtype, shape = state.spec(stored[key])
            if dtype != tensor.dtype or shape[1:] != tuple(tensor.shape[1:]) or shape[0] > tensor.shape[0]:
                raise ShapeMismatchError(
                    f"{state.where(stored[key])}: stored {dtype} rows of {list(shape[1:])}, target {tensor.dtype} rows of {list(tensor.shape[1:])}"
                )

    def _template(self, state: ComponentState) -> Any:
        """One row of zeros per key: what a lazy storage initialises from."""
        ndim = state.json("ndim")
        if state.json("layout") == "tensor":
            dtype, shape = state.spec("data")
            return torch.zeros(shape[1:], dtype=dtype)
        td = None
        for key in state.keys("data"):
            dtype, shape = state.spec(key)
            if td is None:
                td = TensorDict({}, batch_size=shape[1:ndim])
            td.set(split(key)[1:], torch.zeros(shape[1:], dtype=dtype))
        if td is None:
            raise TargetMismatchError(f"{state.where('data')}: an initialised storage with no data")
        return td

    @staticmethod
    def _init(obj: TensorStorage, template: Any) -> None:
        """Initialise a lazy storage from ``template``. A ``LazyMemmapStorage`` whose
        ``scratch_dir`` already holds the memmap files (those of the run being resumed)
        reuses them, as ``existsok=True`` would: the restore then writes every stored row."""
        existsok = getattr(obj, "existsok", None)
        if isinstance(obj, LazyMemmapStorage):
            obj.existsok = True
        try:
            obj._init(template)
        finally:
            if isinstance(obj, LazyMemmapStorage):
                obj.existsok = existsok

    def from_state(self, obj: TensorStorage, state: ComponentState) -> TensorStorage:
        if not state.json("initialized"):
            obj._len = 0
            return obj
        if not obj.initialized:
            self._init(obj, self._template(state))
        target = _storage_leaves(obj._storage, state.where(""))
        for key, leaf in _stored_keys(state).items():
            dtype, shape = state.spec(leaf)
            if key not in target:  # a key the buffer added on write (TorchRL's "index"): add it as TorchRL would
                target[key] = torch.zeros((obj._storage.shape[0], *shape[1:]), dtype=dtype)
                obj._storage.set(split(key), target[key])
            state.read_into(leaf, target[key][: shape[0]])
        obj._len = state.json("len")
        if hasattr(obj, "_bump_mutation_revision"):
            obj._bump_mutation_revision()
        return obj


# --- writers ------------------------------------------------------------------------


def _writer_v1_to_v2(flat: dict, meta: dict) -> dict:
    """Version 1 kept only the cursor (as TorchRL before PR #4030)."""
    return {**flat, "write_count": None}


@register_adapter
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
        _expect(obj, RoundRobinWriter, state)
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


# --- samplers -------------------------------------------------------------------------


@register_adapter
class RandomSamplerAdapter(Adapter):
    """``RandomSampler``: stateless (it draws from the storage's or torch's generator)."""

    name = "torchrl.sampler.random"
    types = (RandomSampler,)

    def to_state(self, obj: RandomSampler) -> dict:
        return {}

    def check(self, obj: Any, state: ComponentState) -> None:
        _expect(obj, RandomSampler, state)

    def from_state(self, obj: RandomSampler, state: ComponentState) -> RandomSampler:
        return obj


@register_adapter
class SamplerWithoutReplacementAdapter(Adapter):
    """``SamplerWithoutReplacement``: the remaining permutation (``sample_list``,
    int64, or null before the first sample), ``len_storage``, ``drop_last``,
    ``shuffle``, ``ran_out`` and ``remaining_batches``."""

    name = "torchrl.sampler.without_replacement"
    types = (SamplerWithoutReplacement,)

    def to_state(self, obj: SamplerWithoutReplacement) -> dict:
        return {
            "sample_list": obj._sample_list,
            "len_storage": int(obj.len_storage),
            "drop_last": bool(obj.drop_last),
            "shuffle": bool(obj.shuffle),
            "ran_out": bool(obj._ran_out),
            "remaining_batches": getattr(obj, "_remaining_batches", None),
        }

    def check(self, obj: Any, state: ComponentState) -> None:
        _expect(obj, SamplerWithoutReplacement, state)
        length = state.json("len_storage")
        if type(length) is not int or length < 0 or any(type(state.json(k)) is not bool for k in ("drop_last", "shuffle", "ran_out")):
            raise TargetMismatchError(f"{state.where('')}: invalid sampler state")
        if state.is_tensor("sample_list"):
            dtype, shape = state.spec("sample_list")
            values = state.tensor("sample_list")
            if dtype != torch.int64 or len(shape) != 1 or (values.numel() and (int(values.min()) < 0 or int(values.max()) >= length)):
                raise TargetMismatchError(f"{state.where('sample_list')}: indices must be int64 within [0, {length})")

    def from_state(self, obj: SamplerWithoutReplacement, state: ComponentState) -> SamplerWithoutReplacement:
        _warn_overrides(state, {"drop_last": bool(obj.drop_last), "shuffle": bool(obj.shuffle)})
        obj._sample_list = state.tensor("sample_list").clone() if state.is_tensor("sample_list") else None
        obj.len_storage = state.json("len_storage")
        obj.drop_last = state.json("drop_last")
        obj.shuffle = state.json("shuffle")
        obj._ran_out = state.json("ran_out")
        remaining = state.json("remaining_batches")
        if remaining is not None:
            obj._remaining_batches = remaining
        return obj


def _sampler_v1_to_v2(flat: dict, meta: dict) -> dict:
    """Version 1 stored the max priority transformed, ``(p + eps) ** alpha``;
    version 2 stores it raw (as TorchRL does since PR #4014)."""
    value = flat.get("max_priority/value")
    alpha, eps = flat["alpha"], flat["eps"]
    if value is not None and alpha != 0:
        if isinstance(value, torch.Tensor):
            flat["max_priority/value"] = (value.double() ** (1.0 / alpha) - eps).clamp_min(0).to(value.dtype)
        else:
            flat["max_priority/value"] = max(0.0, float(value) ** (1.0 / alpha) - eps)
    return flat


@register_adapter
class PrioritizedSamplerAdapter(Adapter):
    """``PrioritizedSampler`` (Schaul et al. 2015, https://arxiv.org/abs/1511.05952).

    Leaves: ``alpha``, ``beta``, ``eps``, ``max_capacity``, ``dtype`` (JSON);
    ``sum_tree`` and ``min_tree``: every leaf value of the two segment trees,
    read as whole tensors (float32 or float64, ``[max_capacity]``), including
    the empty slots (0 and the dtype's max); ``max_priority/value`` and
    ``max_priority/index``: the raw max priority and its index (tensors or
    JSON, null when unset).

    Restoring rewrites every tree leaf; the internal nodes are recomputed from
    them, so sums, minima and samples are bit-identical.
    """

    name = "torchrl.sampler.prioritized"
    version = 2
    types = (PrioritizedSampler,)
    migrations = {1: _sampler_v1_to_v2}

    def to_state(self, obj: PrioritizedSampler) -> dict:
        index = torch.arange(obj._max_capacity, dtype=torch.long)
        value, at = obj._max_priority
        return {
            "alpha": float(obj._alpha), "beta": float(obj._beta), "eps": float(obj._eps),
            "max_capacity": int(obj._max_capacity), "dtype": str(obj.dtype).removeprefix("torch."),
            "sum_tree": torch.as_tensor(obj._sum_tree[index]).cpu(),
            "min_tree": torch.as_tensor(obj._min_tree[index]).cpu(),
            "max_priority": {"value": _scalar(value), "index": _scalar(at)},
        }

    def check(self, obj: Any, state: ComponentState) -> None:
        _expect(obj, PrioritizedSampler, state)
        for key in ("alpha", "beta", "eps"):
            value = state.json(key)
            if type(value) not in (int, float) or not value >= 0:
                raise TargetMismatchError(f"{state.where(key)}: {value!r} is not a number >= 0")
        if state.json("max_capacity") != obj._max_capacity:
            raise TargetMismatchError(
                f"{state.where('')}: capacity differs: stored {state.json('max_capacity')}, target {obj._max_capacity}"
            )
        for key in ("sum_tree", "min_tree"):
            dtype, shape = state.spec(key)
            if shape != (obj._max_capacity,) or dtype != obj.dtype:
                raise ShapeMismatchError(f"{state.where(key)}: stored {dtype} {list(shape)}, target trees are {obj.dtype} [{obj._max_capacity}]")

    def from_state(self, obj: PrioritizedSampler, state: ComponentState) -> PrioritizedSampler:
        _warn_overrides(state, {"alpha": float(obj._alpha), "beta": float(obj._beta), "eps": float(obj._eps)})
        obj._init()
        obj._alpha, obj._beta, obj._eps = state.json("alpha"), state.json("beta"), state.json("eps")
        index = torch.arange(obj._max_capacity, dtype=torch.long)
        obj._sum_tree[index] = state.tensor("sum_tree")
        obj._min_tree[index] = state.tensor("min_tree")
        value, at = state.value("max_priority/value"), state.value("max_priority/index")
        obj._max_priority = None if value is None and at is None else (value, at)
        return obj


@register_adapter
class SliceSamplerAdapter(RandomSamplerAdapter):
    """``SliceSampler``: stateless apart from a trajectory cache, cleared on restore."""

    name = "torchrl.sampler.slice"
    types = (SliceSampler,)

    def check(self, obj: Any, state: ComponentState) -> None:
        _expect(obj, SliceSampler, state)

    def from_state(self, obj: SliceSampler, state: ComponentState) -> SliceSampler:
        obj.load_state_dict({})  # clears the trajectory cache
        return obj


@register_adapter
class SliceSamplerWithoutReplacementAdapter(SamplerWithoutReplacementAdapter):
    """``SliceSamplerWithoutReplacement``: the remaining permutation of trajectory starts."""

    name = "torchrl.sampler.slice_without_replacement"
    types = (SliceSamplerWithoutReplacement,)

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        super().from_state(obj, state)
        SliceSampler.load_state_dict(obj, {})
        return obj


@register_adapter
class PrioritizedSliceSamplerAdapter(PrioritizedSamplerAdapter):
    """``PrioritizedSliceSampler``: the prioritized sampler's trees and max priority."""

    name = "torchrl.sampler.prioritized_slice"
    types = (PrioritizedSliceSampler,)

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        super().from_state(obj, state)
        SliceSampler.load_state_dict(obj, {})
        return obj


def _scalar(x: Any) -> Any:
    """A max-priority field: tensors stay tensors (dtype kept), numbers stay numbers."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    return x


# --- list storage ---------------------------------------------------------------------


def _list_state(items: list, max_size: int) -> dict:
    """The state of a list storage's items (see :class:`ListStorageAdapter`)."""
    leaves, kinds, batch_sizes = {}, [], []
    td_adapter = TensorDictAdapter()
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor) and not is_tensor_collection(item):
            kinds.append("tensor")
            leaves[str(i)] = item
        elif is_tensor_collection(item):
            if not isinstance(item, TensorDict):
                item = item.to_tensordict()
            kinds.append("tensordict")
            batch_sizes.append(list(item.batch_size))
            leaves[str(i)] = td_adapter.to_state(item) or Json({})
        else:
            try:
                jsonvalue.encode(item, f"storage/items/{i}")
            except UnsupportedTypeError as exc:
                raise UnsupportedTypeError(f"{exc} (an item of a ListStorage is stored as a tensor, a TensorDict or a JSON value)") from None
            kinds.append("json")
            leaves[str(i)] = Json(item)
    return {"max_size": int(max_size), "kinds": kinds, "batch_sizes": batch_sizes, "items": leaves or Json({})}


def _list_items(state: ComponentState) -> list:
    """The items stored by :func:`_list_state`, rebuilt."""
    items, sizes = [], iter(state.json("batch_sizes"))
    for i, kind in enumerate(state.json("kinds")):
        key = f"items/{i}"
        if kind == "tensor":
            items.append(state.tensor(key).clone())
        elif kind == "tensordict":
            td = TensorDict({}, batch_size=next(sizes))
            for leaf in state.keys(key):
                rel = split(leaf[len(key) + 1:])
                td.set(rel, state.tensor(leaf)) if state.is_tensor(leaf) else td.set_non_tensor(rel, state.json(leaf))
            items.append(td)
        else:
            items.append(state.json(key))
    return items


@register_adapter
class ListStorageAdapter(Adapter):
    """``ListStorage`` and ``LazyStackStorage``: ``max_size`` and ``items/<i>``, each a
    tensor, a TensorDict (its keys below ``items/<i>``) or a JSON value; ``kinds`` says
    which, and ``batch_sizes`` the TensorDicts' batch sizes. Anything else is refused."""

    name = "torchrl.storage.list"
    types = (ListStorage,)

    def to_state(self, obj: ListStorage) -> dict:
        return _list_state(obj._storage, obj.max_size)

    def check(self, obj: Any, state: ComponentState) -> None:
        _expect(obj, ListStorage, state)
        if isinstance(obj, CompressedListStorage):
            raise TargetMismatchError(f"{state.where('')}: stored a {state.meta.get('class')}, target is a CompressedListStorage")
        if state.json("max_size") != obj.max_size:
            raise TargetMismatchError(f"{state.where('')}: capacity (max_size) differs: stored {state.json('max_size')}, target {obj.max_size}")

    def from_state(self, obj: ListStorage, state: ComponentState) -> ListStorage:
        obj._storage = _list_items(state)
        if hasattr(obj, "_bump_mutation_revision"):
            obj._bump_mutation_revision()
        return obj


@register_adapter
class CompressedListStorageAdapter(Adapter):
    """``CompressedListStorage``: its items decompressed, stored as :class:`ListStorageAdapter`
    stores a list's (the store compresses and deduplicates them itself); restored by
    writing each item again through the target storage, which compresses it with its own
    compression function (the default one gives the same bytes). Slots never written are
    JSON nulls (``kinds`` ``"json"``) and stay empty."""

    name = "torchrl.storage.compressed_list"
    types = (CompressedListStorage,)

    def to_state(self, obj: CompressedListStorage) -> dict:
        return _list_state([None if c is None else obj._get_item(i) for i, c in enumerate(obj._storage)], obj.max_size)

    def check(self, obj: Any, state: ComponentState) -> None:
        _expect(obj, CompressedListStorage, state)
        if state.json("max_size") != obj.max_size:
            raise TargetMismatchError(f"{state.where('')}: capacity (max_size) differs: stored {state.json('max_size')}, target {obj.max_size}")

    def from_state(self, obj: CompressedListStorage, state: ComponentState) -> CompressedListStorage:
        items = _list_items(state)
        obj._storage, obj._metadata = [None] * len(items), [None] * len(items)
        for i, item in enumerate(items):
            if item is not None:
                obj._set_item(i, obj._to_device(item))  # as ``set`` writes an item
        obj._bump_mutation_revision()
        return obj


# --- max-value writer -------------------------------------------------------------------


@register_adapter
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
        _expect(obj, TensorDictMaxValueWriter, state)
        for key in ("rank_key", "reduction"):
            stored, target = state.json(key), getattr(obj, f"_{key}")
            if (tuple(stored) if isinstance(stored, list) else stored) != (tuple(target) if isinstance(target, list) else target):
                raise TargetMismatchError(f"{state.where(key)}: stored {stored!r}, target {target!r}")

    def from_state(self, obj: TensorDictMaxValueWriter, state: ComponentState) -> TensorDictMaxValueWriter:
        from ..shards import DTYPES

        heap = []
        for (rank, index), dtype in zip(state.json("heap"), state.json("rank_dtypes")):
            heap.append((torch.tensor(rank, dtype=DTYPES[dtype]) if dtype else rank, index))
        obj._current_top_values = heap
        obj._cursor = state.json("cursor")
        obj._write_count = state.json("write_count")
        return obj


# --- samplers and writers whose state is their state_dict ------------------------------


class _StateDictPart(StateDictAdapter):
    """A sampler whose ``state_dict()`` (tensors and numbers) is its whole mutable state."""

    def check(self, obj: Any, state: ComponentState) -> None:
        _expect(obj, self.types[0], state)
        same_class(obj, state)


@register_adapter
class ConsumingSamplerAdapter(_StateDictPart):
    """``ConsumingSampler``: its ``state_dict()``: ``max_sample_count``, the per-slot
    ``_sample_count`` (int64) and ``_live_mask`` (bool), the free list, ``_ran_out``."""

    name = "torchrl.sampler.consuming"
    types = (ConsumingSampler,)


@register_adapter
class StreamingSliceSamplerAdapter(_StateDictPart):
    """``StreamingSliceSampler``: its ``state_dict()``: slot versions, queued and pending
    slices, the last trajectory; the target must have the same ``slice_len``."""

    name = "torchrl.sampler.streaming_slice"
    types = (StreamingSliceSampler,)

    def check(self, obj: Any, state: ComponentState) -> None:
        super().check(obj, state)
        stored = int(state.tensor("slice_len")) if state.is_tensor("slice_len") else None
        if stored != obj.slice_len:
            raise TargetMismatchError(f"{state.where('slice_len')}: stored slice_len {stored}, target {obj.slice_len}")


@register_adapter
class PromptGroupSamplerAdapter(_StateDictPart):
    """``PromptGroupSampler``: ``position_recency`` (int64) and ``recency_clock`` (none
    before the first write); its group index is a cache, rebuilt on the next sample."""

    name = "torchrl.sampler.prompt_group"
    types = (PromptGroupSampler,)


@register_adapter
class StalenessAwareSamplerAdapter(_StateDictPart):
    """``StalenessAwareSampler``: ``consumer_version`` and ``max_staleness``."""

    name = "torchrl.sampler.staleness_aware"
    types = (StalenessAwareSampler,)


@register_adapter
class ImmutableDatasetWriterAdapter(Adapter):
    """``ImmutableDatasetWriter``: stateless (it refuses writes)."""

    name = "torchrl.writer.immutable"
    types = (ImmutableDatasetWriter,)

    def to_state(self, obj: ImmutableDatasetWriter) -> dict:
        return {}

    def check(self, obj: Any, state: ComponentState) -> None:
        _expect(obj, ImmutableDatasetWriter, state)

    def from_state(self, obj: ImmutableDatasetWriter, state: ComponentState) -> ImmutableDatasetWriter:
        return obj


#: Why the TorchRL storages, samplers and writers ckptstore refuses cannot be stored.
REFUSED = {
    StorageEnsemble: "an ensemble of storages; commit each storage (or each buffer of a ReplayBufferEnsemble) on its own",
    StoreStorage: "its items live in an external key-value server (Redis), which a commit cannot copy or restore",
    SamplerEnsemble: "an ensemble of samplers; commit each buffer of the ensemble on its own",
    WriterEnsemble: "an ensemble of writers; commit each buffer of the ensemble on its own",
}


@register_adapter
class UnsupportedPartAdapter(Adapter):
    """Every TorchRL storage, sampler or writer without an adapter of its own: refused at
    commit and checkout, naming the class, why, and the classes that are supported."""

    name = "torchrl.unsupported"
    types = (Storage, Sampler, Writer)

    def refusal(self, obj: Any, where: str) -> UnsupportedTypeError:
        kind = next(k for k in (Storage, Sampler, Writer) if isinstance(obj, k))
        supported = sorted({t.__name__ for t, a in REGISTRY.by_type.items()
                            if issubclass(t, kind) and t is not kind and not isinstance(a, UnsupportedPartAdapter)})
        default = "the base class, with no state of its own" if type(obj) is kind else "ckptstore has no adapter for this class"
        reason = next((r for t, r in REFUSED.items() if isinstance(obj, t)), default)
        return UnsupportedTypeError(
            f"{where or '<root>'}: a {type(obj).__module__}.{type(obj).__qualname__} (a TorchRL {kind.__name__.lower()}) "
            f"cannot be stored: {reason}. Supported {kind.__name__.lower()}s (and their subclasses): {', '.join(supported)} "
            "(docs/adapters.md); register an adapter for others with ckptstore.register_adapter"
        )

    def to_state(self, obj: Any) -> Any:
        raise self.refusal(obj, "")


# --- training services ------------------------------------------------------------------


@register_adapter
class TargetUpdaterAdapter(Adapter):
    """``SoftUpdate`` / ``HardUpdate``: ``initialized``, and ``HardUpdate``'s step
    ``counter``. The target parameters themselves belong to the loss module:
    commit it too (its ``state_dict`` holds ``target_*_params``)."""

    name = "torchrl.target_updater"
    types = (TargetNetUpdater,)

    def to_state(self, obj: TargetNetUpdater) -> dict:
        return {"initialized": bool(obj.initialized), "counter": getattr(obj, "counter", None)}

    def check(self, obj: Any, state: ComponentState) -> None:
        _expect(obj, TargetNetUpdater, state)
        if (state.json("counter") is None) != (getattr(obj, "counter", None) is None):
            raise TargetMismatchError(f"{state.where('')}: stored a {state.meta.get('class')}, target is a {type(obj).__qualname__}")

    def from_state(self, obj: TargetNetUpdater, state: ComponentState) -> TargetNetUpdater:
        obj.initialized = state.json("initialized")
        if state.json("counter") is not None:
            obj.counter = state.json("counter")
        return obj


@register_adapter
class CollectorAdapter(StateDictAdapter):
    """A TorchRL collector's ``state_dict()``: frame and iteration counters, the
    policy weights it holds, its environment transforms' state, trajectory ids."""

    name = "torchrl.collector"
    types = (BaseCollector,)


@register_adapter
class GlobalRNGStateAdapter(RNGStateAdapter):
    """``torchrl.checkpoint.GlobalRNGState``: the same state as :class:`~ckptstore.RNGState`."""

    name = "torchrl.global_rng"
    types = (GlobalRNGState,)

    def check(self, obj: Any, state: ComponentState) -> None:
        super().check(RNGState(), state)
        _expect(obj, GlobalRNGState, state)


def _gym_layers(env: Any) -> list:
    """The gym(nasium) environment a TorchRL ``GymEnv`` wraps (under any ``TransformedEnv``):
    its wrapper chain, outermost first (``TimeLimit``, ..., ``CartPoleEnv``); empty for
    other environments (batched, DMControl, custom ``EnvBase``)."""
    layer = getattr(getattr(env, "base_env", env), "_env", None)
    layers = []
    while layer is not None and hasattr(layer, "unwrapped") and len(layers) < 64:
        layers.append(layer)
        layer = None if layer is layer.unwrapped else getattr(layer, "env", None)
    return layers


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


_BIT_GENERATORS = ("MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64")  # numpy's; a stored name is one of them


def _is_json_number(v: Any) -> bool:
    return type(v) is bool or (type(v) is int and -(1 << 63) <= v < 1 << 63) or (type(v) is float and np.isfinite(v))


def _gym_state(layers: list) -> dict[str, dict]:
    """Per wrapper layer (``"0"`` outermost): its class, its plain attributes (``values``: numbers, strings,
    None; ``arrays``: numeric numpy arrays as tensors) and its numpy generators' states
    (``generators``: JSON text). Anything else a layer holds (a physics engine's objects,
    a renderer) is not stored."""
    out = {}
    for i, layer in enumerate(layers):
        values, arrays, generators = {}, {}, {}
        for key, v in vars(layer).items():
            if isinstance(v, np.generic):
                v = v.item()
            if v is None or type(v) is str or _is_json_number(v):
                values[key] = v
            elif isinstance(v, np.ndarray) and v.dtype.kind in "biuf" and v.ndim <= 8:
                arrays[key] = torch.from_numpy(np.ascontiguousarray(v).copy())
            elif isinstance(v, np.random.Generator):
                generators[key] = json.dumps(v.bit_generator.state)
        out[str(i)] = {"class": _class_name(layer), "values": values, "arrays": arrays, "generators": generators}
    return out


def _check_gym_state(layers: list, state: ComponentState) -> None:
    """Raise TargetMismatchError unless the stored ``env`` fits the target's wrapper layers
    (the same classes, known numpy bit generators)."""
    stored = [state.json(f"env/{i}/class") for i in range(sum(k.endswith("/class") for k in state.keys("env")))]
    if stored != [_class_name(x) for x in layers]:
        raise TargetMismatchError(f"{state.where('env')}: stored an environment {stored}, target is {[_class_name(x) for x in layers]}")
    for key in state.keys("env"):
        if "/generators/" in key:
            text = state.json(key)
            name = json.loads(text).get("bit_generator") if type(text) is str and text.startswith("{") else None
            if name not in _BIT_GENERATORS:
                raise TargetMismatchError(f"{state.where(key)}: not a numpy generator state")


def _set_gym_state(layers: list, stored: dict[str, dict]) -> None:
    """Write :func:`_gym_state`'s output (checked by :func:`_check_gym_state`) back into the target's wrapper layers."""
    for i, layer in enumerate(layers):
        state = stored[str(i)]
        for key, value in state.get("values", {}).items():
            setattr(layer, key, value)
        for key, value in state.get("arrays", {}).items():
            setattr(layer, key, value.numpy().copy())
        for key, text in state.get("generators", {}).items():
            generator_state = json.loads(text)
            generator = getattr(layer, key, None)
            if not isinstance(generator, np.random.Generator) or type(generator.bit_generator).__name__ != generator_state["bit_generator"]:
                generator = np.random.Generator(getattr(np.random, generator_state["bit_generator"])())
            generator.bit_generator.state = generator_state
            setattr(layer, key, generator)


@register_adapter
class TrainerAdapter(Adapter):
    """A TorchRL ``Trainer``'s progress: ``state`` (collected frames, optimisation
    steps, last log and save) and its collector's ``state_dict()`` (frames and
    iterations so far, the collector's policy weights, its environment transforms'
    state such as ``ObservationNorm``'s or ``VecNorm``'s statistics), so that
    ``trainer.train()`` continues where it stopped. Also, for a single-process
    collector, the environment's step in progress: ``carrier`` (the collector's
    pending TensorDict, the next observation, as tensors; ``carrier_batch_size``)
    and, for a gym(nasium) environment, ``env``: per wrapper layer its plain
    attributes, numpy arrays (CartPole's ``state``, ``TimeLimit``'s elapsed steps)
    and numpy generator states (the reset RNG). The loss module and optimizer are
    components of their own (commit them beside the trainer); docs/training.md says
    where a resume is bit-identical and where not."""

    name = "torchrl.trainer"
    types = (Trainer,)

    def to_state(self, obj: Trainer) -> dict:
        sd = obj.state_dict()
        state = plain({"state": sd["state"], "collector": sd["collector"]})
        carrier = getattr(obj.collector, "_carrier", None)
        if isinstance(carrier, TensorDict):
            state["carrier"] = carrier.to_dict()
            state["carrier_batch_size"] = list(carrier.batch_size)
            state["env"] = _gym_state(_gym_layers(obj.collector.env))
        return state

    def check(self, obj: Any, state: ComponentState) -> None:
        same_class(obj, state)
        if state.has("carrier_batch_size") and hasattr(obj.collector, "_carrier"):
            _check_gym_state(_gym_layers(obj.collector.env), state)

    def from_state(self, obj: Trainer, state: ComponentState) -> Trainer:
        tree = state.tree()
        obj.collector.load_state_dict(tree["collector"])
        for key, value in tree["state"].items():
            setattr(obj, key, value)
        if "carrier" in tree and hasattr(obj.collector, "_carrier"):
            obj.collector._carrier = TensorDict(tree["carrier"], batch_size=tree["carrier_batch_size"])
            _set_gym_state(_gym_layers(obj.collector.env), tree.get("env") or {})
        return obj
