"""Adapters for TorchRL storages: tensor storages (``TensorStorage``, ``LazyTensorStorage``,
``LazyMemmapStorage``) and list storages (``ListStorage``, ``LazyStackStorage``,
``CompressedListStorage``).

Registered by :mod:`ckptstore.adapters.torchrl`, in its order."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict, is_tensor_collection, is_tensorclass
from torchrl.data.replay_buffers import CompressedListStorage, LazyMemmapStorage, ListStorage, TensorStorage

from ...core import jsonvalue
from ...core.errors import ShapeMismatchError, TargetMismatchError, UnsupportedTypeError
from ..base import Adapter, ComponentState, Json, RowToken, StorageIdentity, join, split, unflatten
from ..values import TensorDictAdapter
from .checks import expect_instance
from .layouts import data_layout, pytree_of, storage_columns, storage_leaves, untree
from .writelog import WriteLog


def _stored_keys(state: ComponentState) -> dict[str, str]:
    """``{storage key: leaf path}`` (the key is ``""`` for a plain tensor storage)."""
    return {k[len("data/"):] if k != "data" else "": k for k in state.keys("data")}


def _can_add_keys(storage: TensorStorage) -> bool:
    data = storage._storage
    return is_tensor_collection(data) and not data.is_locked and not data.is_memmap()


class TensorStorageAdapter(Adapter):
    """``TensorStorage``, ``LazyTensorStorage`` and ``LazyMemmapStorage``.

    Leaves: ``max_size``, ``ndim``, ``len`` (elements), ``initialized`` and
    ``layout`` (``"tensordict"`` for a TensorDict or tensorclass, ``"tensor"``, or
    ``"pytree"`` for dicts, lists and tuples of tensors) as JSON; ``data/<key>`` the
    written rows ``[0, n)`` along dim 0 of each tensor (``data`` for a plain
    tensor storage, ``data/<i>`` for a pytree's tensors in order, its structure in
    ``tree``); a non-tensor column (a tensorclass ``str`` field) as a JSON list of
    its written rows. Never-written capacity is not stored: a 1,000,000-row
    memory-mapped storage holding 24 rows commits 24 rows.

    Checkout needs the same capacity, ``ndim`` and layout, and, when the target
    is already initialised, the same keys (and pytree structure), dtypes and
    per-row shapes (tensor keys the commit has and an in-memory, unlocked target
    lacks are added). A lazy target that was never written is initialised from
    the stored shapes (a tensorclass storage as a TensorDict: no class is imported
    from stored data); the stored rows are then read straight into the target's
    (memory-mapped) tensors.
    """

    name = "torchrl.storage.tensor"
    types = (TensorStorage,)
    direct = True

    def to_state(self, obj: TensorStorage) -> dict:
        state: dict[str, Any] = {"max_size": int(obj.max_size), "ndim": int(obj.ndim), "len": len(obj), "initialized": bool(obj.initialized)}
        if obj.initialized:
            data = obj._storage
            rows = obj._len_along_dim0
            leaves, texts = storage_columns(data, "storage")
            state["layout"] = data_layout(data)
            if state["layout"] == "tensor":
                state["data"] = leaves[""][:rows]
            else:
                columns = {k: v[:rows] for k, v in leaves.items()}
                columns.update({k: Json(v[:rows].tolist()) for k, v in texts.items()})
                state["data"] = unflatten(columns)
            if state["layout"] == "pytree":
                state["tree"] = Json(pytree_of(data, "storage")[0])
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
        leaves = storage_leaves(obj._storage, "storage")
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
        expect_instance(obj, TensorStorage, state)
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
            rows = {state.spec(k)[1][0] if state.is_tensor(k) else len(state.json(k)) if type(state.json(k)) is list else -1
                    for k in state.keys("data")}  # a non-tensor column: a list of rows
            expected = {length} if state.json("ndim") == 1 else rows
            if len(rows) != 1 or rows != expected or max(rows) > state.json("max_size"):
                raise TargetMismatchError(f"{where}: stored rows {sorted(rows)} do not match the length {length}")
        if not initialized or not obj.initialized:
            return
        target, texts = storage_columns(obj._storage, where)
        layout = data_layout(obj._storage)
        if layout != state.json("layout"):
            raise TargetMismatchError(f"{where}: layout differs: stored {state.json('layout')}, target {layout}")
        tree = pytree_of(obj._storage, where)[0] if layout == "pytree" else None
        if tree != (state.json("tree") if layout == "pytree" else None):
            raise TargetMismatchError(f"{where}: pytree structure differs: stored {state.json('tree')}, target {tree}")
        stored = _stored_keys(state)
        stored_texts = {k for k, leaf in stored.items() if not state.is_tensor(leaf)}
        missing = sorted((set(target) | set(texts)) - set(stored))
        extra = sorted(set(stored) - set(target) - set(texts))
        if missing or (extra and not _can_add_keys(obj)) or stored_texts != set(texts):
            raise TargetMismatchError(
                f"{where}: storage keys differ; not in the commit: {missing}, not in the target: {extra}, "
                f"non-tensor in the commit: {sorted(stored_texts)}, in the target: {sorted(texts)}"
            )
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
        specs = {k: state.spec(leaf) for k, leaf in _stored_keys(state).items() if state.is_tensor(leaf)}
        tensors = {k: torch.zeros(shape[1:], dtype=dtype) for k, (dtype, shape) in specs.items()}
        if state.json("layout") == "pytree":
            return untree(state.json("tree"), iter(tensors[k] for k in sorted(tensors, key=int)), state.where("tree"))
        td = None
        for key, zeros in tensors.items():
            if td is None:
                td = TensorDict({}, batch_size=state.spec(join("data", key))[1][1:ndim])
            td.set(split(key), zeros)
        for key, leaf in _stored_keys(state).items():
            if td is not None and not state.is_tensor(leaf) and state.json(leaf):
                first = state.json(leaf)  # a non-tensor column: its first value, which the storage expands
                for _ in range(ndim):
                    first = first[0] if type(first) is list and first else first
                td.set_non_tensor(split(key), first)
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
        target = storage_leaves(obj._storage, state.where(""))
        for key, leaf in _stored_keys(state).items():
            if not state.is_tensor(leaf):
                values = state.json(leaf)
                fields = obj._storage._tensordict if is_tensorclass(obj._storage) else obj._storage
                if values:
                    fields.set_at_(split(key), NonTensorStack.from_list(values), slice(0, len(values)))
                continue
            dtype, shape = state.spec(leaf)
            if key not in target:  # a key the buffer added on write (TorchRL's "index"): add it as TorchRL would
                target[key] = torch.zeros((obj._storage.shape[0], *shape[1:]), dtype=dtype)
                obj._storage.set(split(key), target[key])
            state.read_into(leaf, target[key][: shape[0]])
        obj._len = state.json("len")
        if hasattr(obj, "_bump_mutation_revision"):
            obj._bump_mutation_revision()
        return obj


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


class ListStorageAdapter(Adapter):
    """``ListStorage`` and ``LazyStackStorage``: ``max_size`` and ``items/<i>``, each a
    tensor, a TensorDict (its keys below ``items/<i>``) or a JSON value; ``kinds`` says
    which, and ``batch_sizes`` the TensorDicts' batch sizes. Anything else is refused."""

    name = "torchrl.storage.list"
    types = (ListStorage,)

    def to_state(self, obj: ListStorage) -> dict:
        return _list_state(obj._storage, obj.max_size)

    def check(self, obj: Any, state: ComponentState) -> None:
        expect_instance(obj, ListStorage, state)
        if isinstance(obj, CompressedListStorage):
            raise TargetMismatchError(f"{state.where('')}: stored a {state.meta.get('class')}, target is a CompressedListStorage")
        if state.json("max_size") != obj.max_size:
            raise TargetMismatchError(f"{state.where('')}: capacity (max_size) differs: stored {state.json('max_size')}, target {obj.max_size}")

    def from_state(self, obj: ListStorage, state: ComponentState) -> ListStorage:
        obj._storage = _list_items(state)
        if hasattr(obj, "_bump_mutation_revision"):
            obj._bump_mutation_revision()
        return obj


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
        expect_instance(obj, CompressedListStorage, state)
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
