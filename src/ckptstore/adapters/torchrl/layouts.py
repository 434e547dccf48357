"""How a TorchRL tensor storage's backing data is laid out, read as columns.

A storage holds a tensor, a TensorDict (or tensorclass), or a pytree (dicts, lists and
tuples of tensors); :func:`storage_columns` lists its full-capacity tensors and non-tensor
columns by escaped key path, the form both the storage adapter and the write log use."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import is_non_tensor, is_tensor_collection

from ...core.errors import TargetMismatchError, UnsupportedTypeError
from ..base import escape, join


def data_layout(data: Any) -> str:
    """How a storage's backing data is laid out: ``"tensor"``, ``"tensordict"`` (a
    TensorDict or tensorclass) or ``"pytree"`` (dicts, lists and tuples of tensors)."""
    if is_tensor_collection(data):
        return "tensordict"
    return "tensor" if isinstance(data, torch.Tensor) else "pytree"


def pytree_of(data: Any, path: str) -> tuple[Any, list[torch.Tensor]]:
    """A pytree-backed storage's structure as JSON (``null``: a tensor; ``["dict",
    [[key, sub], ...]]`` with ``str`` or ``int`` keys; ``["list", [...]]``; ``["tuple",
    [...]]``) and its tensors in that order.

    Raises:
        UnsupportedTypeError: anything else in the tree (naming it and its place).
    """
    tensors: list[torch.Tensor] = []

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, torch.Tensor) and not is_tensor_collection(node):
            tensors.append(node)
            return None
        if type(node) is dict and all(type(k) in (str, int) for k in node):
            return ["dict", [[k, walk(v, f"{where}/{k}")] for k, v in node.items()]]
        if type(node) in (list, tuple):
            return [type(node).__name__, [walk(v, f"{where}/{i}") for i, v in enumerate(node)]]
        raise UnsupportedTypeError(
            f"{path}/data{where}: a pytree-backed storage holding a {type(node).__module__}.{type(node).__qualname__}; "
            "supported: tensors in dicts (str or int keys), lists and tuples"
        )

    return walk(data, ""), tensors


def untree(spec: Any, tensors: Any, where: str) -> Any:
    """The pytree :func:`pytree_of` describes, its tensors taken in order from the iterator ``tensors``.

    Raises:
        TargetMismatchError: a malformed structure, or one with more places than tensors.
    """
    try:
        if spec is None:
            return next(tensors)
        kind, items = spec
        if kind == "dict":
            return {k: untree(v, tensors, where) for k, v in items}
        if kind in ("list", "tuple"):
            return (list if kind == "list" else tuple)(untree(v, tensors, where) for v in items)
    except (TypeError, ValueError, StopIteration, RuntimeError):
        pass
    raise TargetMismatchError(f"{where}: malformed pytree structure {spec!r}")


def storage_columns(data: Any, path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A storage's backing data as ``({escaped key path: full-capacity tensor},
    {escaped key path: non-tensor column})``; a pytree's tensors are keyed by their
    place in :func:`pytree_of`'s order (``"0"``, ``"1"``...), a plain tensor by ``""``."""
    layout = data_layout(data)
    if layout == "tensor":
        return {"": data}, {}
    if layout == "pytree":
        return {str(i): t for i, t in enumerate(pytree_of(data, path)[1])}, {}
    tensors: dict[str, torch.Tensor] = {}
    texts: dict[str, Any] = {}

    def walk(td: Any, prefix: str) -> None:
        for key in td.keys():
            value = td._get_str(key, None)
            p = join(prefix, escape(key))
            if is_non_tensor(value):
                texts[p] = value
            elif is_tensor_collection(value):
                walk(value, p)
            else:
                tensors[p] = value

    walk(data, "")
    return tensors, texts


def storage_leaves(data: Any, path: str) -> dict[str, torch.Tensor]:
    """``{escaped key path: full-capacity tensor}`` of a storage's backing data (see :func:`storage_columns`)."""
    return storage_columns(data, path)[0]
