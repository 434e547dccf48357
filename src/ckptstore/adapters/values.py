"""Adapters for plain values: tensors, numpy arrays, JSON values, raw bytes, dicts and TensorDicts."""

from __future__ import annotations

import io
import itertools
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_non_tensor,
    is_tensor_collection,
    is_tensorclass,
)

from ..core.errors import ShapeMismatchError, TargetMismatchError, UnsupportedTypeError
from .base import RAW_BYTES, REGISTRY, Adapter, ComponentState, Json, escape, join, plain, register_adapter, same_class, split, under


@register_adapter
class TensorAdapter(Adapter):
    """A bare tensor: one leaf at the component's own path.

    Restored in place (``copy_``) into a tensor of the same dtype and shape;
    into anything else a new tensor is returned.
    """

    name = "tensor"
    types = (torch.Tensor,)

    def to_state(self, obj: torch.Tensor) -> torch.Tensor:
        return obj

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        if isinstance(obj, torch.Tensor):
            dtype, shape = state.spec("")
            if (obj.dtype, tuple(obj.shape)) != (dtype, shape):
                raise ShapeMismatchError(f"{state.where('')}: stored {dtype} {list(shape)}, target {obj.dtype} {list(obj.shape)}")
            with torch.no_grad():
                state.read_into("", obj)
            return obj
        return state.tensor("")


@register_adapter
class NumpyAdapter(Adapter):
    """A numpy ``ndarray`` of a numeric or bool dtype: stored as a tensor leaf (no
    pickle), its numpy dtype (byte order included, ``meta["dtype"]``, e.g. ``"<f4"``)
    kept so it comes back as the same ndarray type, dtype and shape.

    Restored in place into an ndarray of the same dtype and shape; into
    anything else a new ndarray is returned.

    Raises (at commit): UnsupportedTypeError for object, string, datetime and
    other dtypes torch has no raw form of.
    """

    name = "numpy"
    types = (np.ndarray,)

    def to_state(self, obj: np.ndarray) -> torch.Tensor:
        native = obj.astype(obj.dtype.newbyteorder("="), copy=False)
        try:
            return torch.from_numpy(np.ascontiguousarray(native))
        except TypeError:
            raise UnsupportedTypeError(f"numpy dtype {obj.dtype} has no raw tensor form; store a numeric or bool array") from None

    def meta(self, obj: np.ndarray) -> dict:
        return {"dtype": obj.dtype.str}

    def check(self, obj: Any, state: ComponentState) -> None:
        if isinstance(obj, np.ndarray):
            dtype, shape = np.dtype(state.meta["dtype"]), tuple(state.spec("")[1])
            if (obj.dtype, obj.shape) != (dtype, shape):
                raise ShapeMismatchError(f"{state.where('')}: stored ndarray {dtype} {list(shape)}, target {obj.dtype} {list(obj.shape)}")

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        value = state.tensor("").numpy().astype(np.dtype(state.meta["dtype"]), copy=False)
        if isinstance(obj, np.ndarray) and obj.flags.writeable:
            obj[...] = value
            return obj
        return value


@register_adapter
class JsonAdapter(Adapter):
    """A JSON value (None, bool, int, float, str, list, tuple, slice, Ellipsis, and numpy
    scalars, restored as the same numpy type: :mod:`ckptstore.core.jsonvalue`)."""

    name = "json"
    types = (type(None), bool, int, float, str, list, tuple, slice, type(Ellipsis), np.bool_, np.number)

    def to_state(self, obj: Any) -> Any:
        return obj

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        return state.json("")


@register_adapter
class BytesAdapter(Adapter):
    """Raw bytes (``bytes``, ``bytearray``, ``io.BytesIO``): one uint8 tensor leaf, so
    stored as blobs (deduplicated, verified, read only when selected), restored as the
    same type (an ``io.BytesIO`` positioned at 0). Restored in place into a ``bytearray``
    or an ``io.BytesIO``; otherwise a new object is returned."""

    name = "bytes"
    types = tuple(RAW_BYTES)

    def to_state(self, obj: Any) -> Any:
        return obj

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        value = state.value("")
        if type(obj) is type(value) and type(value) in (bytearray, io.BytesIO):
            _refill(obj, value.getvalue() if type(value) is io.BytesIO else bytes(value))
            return obj
        return value


def _refill(obj: bytearray | io.BytesIO, data: bytes) -> None:
    """Make a ``bytearray`` or ``io.BytesIO`` hold ``data`` in place (a stream positioned at 0)."""
    if type(obj) is bytearray:
        obj[:] = data
        return
    obj.seek(0)
    obj.truncate()
    obj.write(data)
    obj.seek(0)


def _needs_container(value: Any) -> bool:
    """Does a dict hold (at any depth) an object that needs its own adapter?"""
    for v in value.values():
        if isinstance(v, (dict, OrderedDict)):
            if _needs_container(v):
                return True
        elif not isinstance(v, (torch.Tensor, *JsonAdapter.types, *RAW_BYTES)):
            return True
    return False


@register_adapter
class DictAdapter(Adapter):
    """A ``dict``: a container when it holds objects with their own adapters
    (each item becomes a component at ``<path>/<key>``), otherwise one
    component whose leaves are its nested tensors and JSON values."""

    name = "dict"
    types = (dict, OrderedDict)
    partial_targets = True

    def children(self, obj: dict) -> dict | None:
        return obj if _needs_container(obj) else None

    def targets(self, obj: dict) -> dict:
        return obj

    def set_child(self, obj: dict, name: str, value: Any) -> None:
        obj[name] = value

    def to_state(self, obj: dict) -> Any:
        return plain(obj)

    def check(self, obj: Any, state: ComponentState) -> None:
        """A tensor the target dict holds where the commit has a tensor is overwritten in
        place, so it must have the stored dtype and shape (ShapeMismatchError otherwise),
        be writable (not an inference tensor) and share no memory with another tensor of the
        target; a nested dict must appear once (TargetMismatchError otherwise)."""
        if not isinstance(obj, dict):
            return
        _check_unaliased(obj, state.where(""))
        for key in state.keys():
            if not state.is_tensor(key):
                continue
            node: Any = obj
            for k in split(key):
                node = node.get(k) if isinstance(node, dict) else None
            if isinstance(node, torch.Tensor) and node.device.type != "meta":  # a meta placeholder is replaced
                dtype, shape = state.spec(key)
                if (node.dtype, tuple(node.shape)) != (dtype, shape):
                    raise ShapeMismatchError(f"{state.where(key)}: stored {dtype} {list(shape)}, target {node.dtype} {list(node.shape)}")
                if node.is_inference():
                    raise TargetMismatchError(f"{state.where(key)}: the target is an inference tensor, which cannot be written in place")

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        value = state.tree()
        if isinstance(obj, dict) and isinstance(value, dict):
            _update(obj, value)
            return obj
        return value


def _check_unaliased(obj: dict, where: str) -> None:
    """Refuse a target dict whose tensors share memory or whose dicts appear twice (or
    contain themselves): restoring them one after another would give wrong values."""
    seen_dicts: set[int] = set()
    spans: list[tuple[int, int, str]] = []

    def walk(node: dict, path: str) -> None:
        if id(node) in seen_dicts:
            raise TargetMismatchError(f"{where}: the target holds the dict at {path or '<root>'} twice (or inside itself)")
        seen_dicts.add(id(node))
        for k, v in node.items():
            sub = f"{path}/{k}" if path else str(k)
            if type(v) is dict:
                walk(v, sub)
            elif isinstance(v, torch.Tensor) and v.device.type != "meta" and v.numel():
                storage = v.untyped_storage()
                start = storage.data_ptr() + v.storage_offset() * v.element_size()
                spans.append((start, start + v.numel() * v.element_size() if v.is_contiguous() else storage.data_ptr() + storage.nbytes(), sub))

    walk(obj, "")
    spans.sort()
    for (_, a1, pa), (b0, _, pb) in itertools.pairwise(spans):
        if b0 < a1:
            raise TargetMismatchError(f"{where}: the target's tensors at {pa} and {pb} share memory; give each its own tensor")


def _update(obj: dict, value: dict) -> None:
    """Make ``obj`` equal ``value`` in place, keeping the target's nested dicts (the
    objects a caller may hold), overwriting its tensors of the same dtype and shape and
    refilling its ``bytearray`` and ``io.BytesIO`` values."""
    for k in [k for k in obj if k not in value]:
        del obj[k]
    for k, v in value.items():
        old = obj.get(k)
        if type(old) is dict and type(v) is dict:
            _update(old, v)
        elif isinstance(old, torch.Tensor) and isinstance(v, torch.Tensor) and (old.dtype, old.shape) == (v.dtype, v.shape) and old.device.type != "meta":
            old.copy_(v)  # in place, on the target's device
        elif type(old) is type(v) and type(v) in (bytearray, io.BytesIO):
            _refill(old, v.getvalue() if type(v) is io.BytesIO else bytes(v))
        else:
            obj[k] = v


def _device_exists(device: str) -> bool:
    """Can tensors be put on ``device`` in this process (without initialising anything that fails)?"""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        return False
    if dev.type == "cpu" or dev.type == "meta":
        return True
    module = getattr(torch, dev.type, None)
    try:
        available = module is not None and module.is_available()
        return available and (dev.index is None or dev.index < module.device_count())
    except (AttributeError, RuntimeError):
        return False


def _legacy_index(value: Any) -> Any:
    """Decode a version-1 index: a list of ints, ``"..."`` and ``[start, stop, step]`` lists."""
    if not isinstance(value, list):
        raise TargetMismatchError(f"legacy index {value!r} is not a list")
    out = []
    for item in value:
        if item == "...":
            out.append(Ellipsis)
        elif isinstance(item, list) and len(item) == 3:
            out.append(slice(*item))
        elif type(item) is int or item is None:
            out.append(item)
        else:
            raise TargetMismatchError(f"legacy index item {item!r} is not an int, '...' or [start, stop, step]")
    return tuple(out)


def _tensordict_v1_to_v2(flat: dict, meta: dict) -> dict:
    """Version 1 stored index-valued non-tensor leaves (listed in meta ``indices``)
    untagged, as JSON lists; version 2 keeps tuples, slices and Ellipsis (TensorDict PR #1736)."""
    for key in meta.pop("indices", []):
        flat[key] = _legacy_index(flat[key])
    return flat


def _tensordict_v2_to_v3(flat: dict, meta: dict) -> dict:
    """Version 3 added meta ``lazy`` (heterogeneous lazy stacks stored member by member):
    version 2 state has none, or, written by the code that added it before the version was
    bumped, has it as version 3 does; either reads unchanged."""
    return flat


@register_adapter
class TensorDictAdapter(Adapter):
    """A TensorDict: its tensor leaves by nested key, non-tensor leaves as JSON.

    The batch size and device go in the component's metadata; NonTensorStack
    leaves are listed there so they come back as stacks. A ``LazyStackedTensorDict``
    whose members differ in keys or shapes is stored member by member (``<i>/<key>``;
    meta ``lazy``: ``{path: {"dim": stack dim, "batch_sizes": [...]}}``) and comes back
    as a lazy stack of the same members; a homogeneous one as a TensorDict of its
    stacked leaves. Restored in place into
    a TensorDict of the same batch size (tensors of the same shape and dtype are
    overwritten, others replaced); otherwise a new TensorDict is built.

    Version 1 wrote index-valued non-tensor leaves untagged (a tuple of slices
    as a list of ``[start, stop, step]`` lists); they are migrated on restore.
    Version 3 added meta ``lazy``: a version-2 reader ignores it (the members' leaves,
    keyed ``0``, ``1``..., would not come back as the lazy stack), so it refuses version 3.
    """

    name = "tensordict"
    version = 3
    types = (TensorDictBase,)
    migrations = {1: _tensordict_v1_to_v2, 2: _tensordict_v2_to_v3}

    def _walk(self, td: TensorDictBase, prefix: str, info: dict) -> dict:
        """``td`` as a nested dict of tensors and :class:`Json` leaves; ``info`` collects
        the escaped paths of non-tensor stacks and the batch sizes of nested TensorDicts
        that are empty or batched beyond their parent (what setting leaves cannot rebuild)."""
        tree: dict = {}
        if _heterogeneous(td):  # members with other keys or shapes: stored member by member
            info["lazy"][prefix] = {"dim": td.stack_dim, "batch_sizes": [list(m.batch_size) for m in td.tensordicts]}
            for i, member in enumerate(td.tensordicts):
                tree[str(i)] = self._walk(member, join(prefix, str(i)), info) or Json({})
            return tree
        for key in td.keys():
            value = td._get_str(key, None)
            path = join(prefix, escape(key))
            if is_non_tensor(value):
                if isinstance(value, NonTensorStack):
                    info["stacks"].append(path)
                    tree[key] = Json(value.tolist())
                else:
                    tree[key] = Json(value.data)
            elif is_tensor_collection(value):
                sub = self._walk(value, path, info)
                if path not in info["lazy"] and (not sub or list(value.batch_size) != list(td.batch_size)):
                    info["nested"][path] = list(value.batch_size)
                tree[key] = sub or Json({})  # an empty TensorDict is a leaf, so partial= can select it
            else:
                tree[key] = value
        return tree

    def _flat(self, td: TensorDictBase) -> tuple[dict, dict]:
        info: dict = {"stacks": [], "nested": {}, "lazy": {}}
        return self._walk(td, "", info), info

    def to_state(self, obj: TensorDictBase) -> Any:
        return self._flat(obj)[0]

    def meta(self, obj: TensorDictBase) -> dict:
        _, info = self._flat(obj)
        out = {
            **super().meta(obj),
            "batch_size": list(obj.batch_size),
            "device": None if obj.device is None else str(obj.device),
            "stacks": info["stacks"],
        }
        if info["nested"]:
            out["nested"] = info["nested"]
        if info["lazy"]:
            out["lazy"] = info["lazy"]
        return out

    def check(self, obj: Any, state: ComponentState) -> None:
        if isinstance(obj, TensorDictBase) and list(obj.batch_size) != state.meta.get("batch_size"):
            raise TargetMismatchError(
                f"{state.where('')}: stored batch size {state.meta.get('batch_size')}, target {list(obj.batch_size)}"
            )

    def build(self, state: ComponentState) -> TensorDict:
        """A new TensorDict from the stored state, on its stored device (see ``map_location``).

        Raises:
            TargetMismatchError: the stored device does not exist here (a CUDA
                TensorDict checked out without CUDA): pass ``map_location``.
        """
        device = state.meta.get("device")
        if device is not None and not _device_exists(device):
            raise TargetMismatchError(
                f"{state.where('')}: stored on {device}, which this machine does not have; "
                "pass map_location='cpu' (or another device) to checkout"
            )
        if "" in _lazy(state):
            return self._stack(state, "")
        td = TensorDict({}, batch_size=state.meta.get("batch_size", []), device=device)
        self._fill(td, state)
        return td

    def _member(self, state: ComponentState, prefix: str, batch_size: list) -> ComponentState:
        """The state under ``prefix`` (one member of a stored lazy stack) as a component of its own."""
        cut = len(prefix) + 1 if prefix else 0

        def rel(paths):
            return {p[cut:]: v for p, v in paths.items() if p != prefix and under(p, prefix)}
        meta = {"batch_size": batch_size, "device": state.meta.get("device"),
                "stacks": list(rel(dict.fromkeys(state.meta.get("stacks", ())))), "nested": rel(state.meta.get("nested", {})),
                "lazy": rel(_lazy(state))}
        return ComponentState(join(state.path, prefix), state.adapter, state.version, meta, rel(state.leaves))

    def _stack(self, state: ComponentState, prefix: str) -> LazyStackedTensorDict:
        """The heterogeneous lazy stack stored at ``prefix``: each member built from its own leaves."""
        spec = _lazy(state)[prefix]
        members = [self.build(self._member(state, join(prefix, str(i)), b)) for i, b in enumerate(spec["batch_sizes"])]
        try:
            return LazyStackedTensorDict(*members, stack_dim=spec["dim"])
        except (RuntimeError, ValueError, IndexError) as exc:
            raise TargetMismatchError(f"{state.where(prefix)}: the stored members do not stack along dim {spec['dim']} ({exc})") from None

    def _fill(self, td: TensorDictBase, state: ComponentState) -> None:
        stacks = set(state.meta.get("stacks", ()))
        nested_sizes = state.meta.get("nested", {})
        if not (type(nested_sizes) is dict and all(type(b) is list and all(type(n) is int and n >= 0 for n in b) for b in nested_sizes.values())):
            raise TargetMismatchError(f"{state.where('')}: malformed nested batch sizes {nested_sizes!r}")
        keys = state.keys()
        lazy = [p for p in _lazy(state) if not any(q != p and under(p, q) for q in _lazy(state))]  # the outermost stacks
        for path in lazy:
            if any(under(k, path) for k in keys):
                td.set(split(path), self._stack(state, path))
        keys = [k for k in keys if not any(under(k, p) for p in lazy)]
        nested_sizes = {p: b for p, b in nested_sizes.items() if not any(under(p, q) for q in lazy)}
        for path in sorted(nested_sizes, key=lambda p: p.count("/")):  # parents first, only those read
            if path in keys or state.keys(path):
                nested = split(path)
                current = td.get(nested, None)
                if path in keys or not (is_tensor_collection(current) and list(current.batch_size) == nested_sizes[path]):
                    td.set(nested, TensorDict({}, batch_size=nested_sizes[path], device=td.device))
        for key in keys:
            if key in nested_sizes:
                continue  # an empty TensorDict, set above
            nested = split(key)
            if state.is_tensor(key):
                current = td.get(nested, None)
                dtype, shape = state.spec(key)
                if isinstance(current, torch.Tensor) and not is_tensor_collection(current) and (current.dtype, tuple(current.shape)) == (dtype, shape):
                    state.read_into(key, current)
                else:
                    td.set(nested, state.tensor(key))
            elif key in stacks:
                td.set(nested, NonTensorStack(*state.json(key)))
            else:
                td.set_non_tensor(nested, state.json(key))

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        if not isinstance(obj, TensorDictBase) or "" in _lazy(state):
            return self.build(state)
        self._fill(obj, state)
        return obj


def _is_tensorclass(obj: Any) -> bool:
    """Is ``obj`` an instance (not the class) of a ``@tensorclass`` class?"""
    return not isinstance(obj, type) and is_tensorclass(obj)


@register_adapter
class TensorClassAdapter(TensorDictAdapter):
    """An instance of a ``@tensorclass`` class: stored as the TensorDict holding its
    fields (tensor fields as tensor leaves, nested TensorDicts by key, non-tensor
    fields such as ``str``, ``int`` or ``dict`` values as JSON: what
    :class:`TensorDictAdapter` stores), meta ``class`` naming its class.

    The class is never imported from stored data: checkout restores in place into a
    target of the same class (``checkout(into=instance)``; the fields are
    overwritten as a TensorDict target's are), into a TensorDict target, or, with
    no target, as a new TensorDict of the fields.

    Raises (at checkout): TargetMismatchError for a target tensorclass of another
    class or batch size.
    """

    name = "tensorclass"
    version = 1
    types = ()
    migrations = {}

    def claims(self, obj: Any) -> bool:
        return _is_tensorclass(obj)

    def to_state(self, obj: Any) -> Any:
        return super().to_state(obj._tensordict)

    def meta(self, obj: Any) -> dict:
        return {**super().meta(obj._tensordict), "class": f"{type(obj).__module__}.{type(obj).__qualname__}"}

    def check(self, obj: Any, state: ComponentState) -> None:
        if _is_tensorclass(obj):
            same_class(obj, state)
            obj = obj._tensordict
        super().check(obj, state)

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        if _is_tensorclass(obj):
            self._fill(obj._tensordict, state)
            return obj
        return super().from_state(obj, state)


def _heterogeneous(td: TensorDictBase) -> bool:
    """A lazy stack whose members differ in keys or in the shape or dtype of a tensor
    (one TensorDict of stacked leaves cannot hold it)."""
    if not isinstance(td, LazyStackedTensorDict) or len(td.tensordicts) < 2:
        return False

    def spec(member: TensorDictBase) -> dict:
        return {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) and not is_tensor_collection(v) else None
                for k, v in member.items(include_nested=True, leaves_only=True)}

    first = spec(td.tensordicts[0])
    return any(spec(m) != first for m in td.tensordicts[1:])


def _lazy(state: ComponentState) -> dict:
    """The stored heterogeneous lazy stacks ``{escaped path: {"dim", "batch_sizes"}}`` (``""``: the component itself).

    Raises:
        TargetMismatchError: a malformed entry.
    """
    lazy = state.meta.get("lazy", {})
    ok = type(lazy) is dict and all(
        type(v) is dict and set(v) == {"dim", "batch_sizes"} and type(v["dim"]) is int and type(v["batch_sizes"]) is list
        and v["batch_sizes"] and all(type(b) is list and all(type(n) is int and n >= 0 for n in b) for b in v["batch_sizes"])
        for v in lazy.values()
    )
    if not ok:
        raise TargetMismatchError(f"{state.where('')}: malformed lazy stack entries {lazy!r}")
    return lazy


__all__ = ["REGISTRY", "DictAdapter", "JsonAdapter", "NonTensorData", "TensorAdapter", "TensorClassAdapter", "TensorDictAdapter"]
