"""State trees: the nested dicts adapters' ``to_state`` returns, flattened into leaves and back.

A state tree is a nested ``dict`` with ``str`` keys (each escaped into one path segment,
:func:`ckptstore.core.layout.escape`) whose leaves are tensors, raw bytes or JSON values
(:mod:`ckptstore.core.jsonvalue`); :class:`Json` marks a value as one JSON leaf. Raw bytes and
nested tensors are written as plain tensors (:func:`raw_leaves`), their forms recorded in
the component meta :data:`RAW`; :func:`ckptstore.adapters.base.migrate` turns them back.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..core import jsonvalue
from ..core.errors import InvalidNameError, UnsupportedTypeError
from ..core.layout import escape, join, split


def check_key(key: Any, path: str) -> str:
    """The path segment of one state-tree key (:func:`ckptstore.core.layout.escape`).

    Raises:
        InvalidNameError: ``key`` is not a ``str``.
    """
    if type(key) is not str:
        raise InvalidNameError(f"{path or '<root>'}: key {key!r} is a {type(key).__name__}; keys of containers holding tensors or objects must be str")
    return escape(key)


def is_subtree(value: Any) -> bool:
    """A ``dict`` that flattens into child leaves (non-empty, all keys ``str``)."""
    return type(value) is dict and bool(value) and all(type(k) is str for k in value)


class Json:
    """Marks a value as one JSON leaf, even a ``dict`` that would be a subtree."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


#: Raw byte values, stored as uint8 tensor leaves (blobs) and restored as the same type.
RAW_BYTES = {bytes: "bytes", bytearray: "bytearray", io.BytesIO: "io.BytesIO"}
#: Component meta key ``{relative path: form}`` of the leaves stored as plain tensors for
#: a value of another kind: ``"bytes"``, ``"bytearray"``, ``"io.BytesIO"`` (one uint8
#: leaf at the path), ``{"nested": "jagged", "ragged_dim": d, "parts": [...]}`` (leaves
#: ``<path>/values``, ``<path>/offsets`` and, when set, ``<path>/lengths``) or
#: ``{"nested": "strided", "parts": ["values", "sizes"]}`` (``<path>/values``: every
#: component's elements concatenated, ``<path>/sizes``: int64 ``[n, ndim]``). Reserved:
#: adapters' ``meta()`` must not use it.
RAW = "ckptstore.raw"


def flatten(tree: Any, path: str = "") -> dict[str, Any]:
    """Flatten a state tree into ``{path: tensor, raw bytes or JSON value}``.

    A non-empty ``dict`` with ``str`` keys is a subtree, each key escaped into one
    path segment (:func:`ckptstore.core.layout.escape`: any ``str`` is a key, ``"x/y"``
    is stored as ``x%2Fy``); a tensor (nested ones included) is a tensor leaf;
    ``bytes``, ``bytearray`` and ``io.BytesIO`` are raw byte leaves (see
    :func:`raw_leaves`); a :class:`Json` or anything else is a JSON value (checked here).

    Raises:
        UnsupportedTypeError: a value that is neither, naming its path and type.
        InvalidNameError: a dict holding tensors under a key that is not a ``str``.
    """
    out: dict[str, Any] = {}

    def walk(node: Any, p: str) -> None:
        if isinstance(node, Json):
            node = node.value
        elif isinstance(node, torch.Tensor):
            out[p] = node
            return
        elif is_subtree(node):
            for k, v in node.items():
                walk(v, join(p, escape(k)))
            return
        if type(node) in RAW_BYTES:
            out[p] = node
            return
        if _holds_tensor(node):
            if type(node) is dict:
                for k in node:
                    check_key(k, p)
            raise UnsupportedTypeError(f"{p or '<root>'}: tensors inside lists, tuples or non-dict containers are not supported")
        jsonvalue.encode(node, p)  # validates, raises with the path
        out[p] = node

    walk(tree, path)
    return out


def _holds_tensor(node: Any) -> bool:
    if isinstance(node, torch.Tensor):
        return True
    if isinstance(node, (list, tuple)):
        return any(_holds_tensor(v) for v in node)
    if isinstance(node, dict):
        return any(_holds_tensor(v) for v in node.values())
    return False


def unflatten(flat: Mapping[str, Any]) -> Any:
    """Inverse of :func:`flatten` (relative escaped paths; ``""`` is the root leaf)."""
    if "" in flat:
        return flat[""]
    root: dict[str, Any] = {}
    for path, value in flat.items():
        node = root
        *parents, last = split(path)
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return root


def _byte_tensor(data: bytes | bytearray) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # bytes are read-only: the tensor is only read (hashed, written to a pack)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


def raw_leaves(leaves: dict[str, Any], component: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Put the raw byte values and nested tensors of ``leaves`` (absolute paths, as
    :func:`flatten` gives them) in plain tensor form; returns the new leaves, in the same
    order, and ``{path relative to component: form}`` for the component meta :data:`RAW`.

    Raw bytes become one 1-d uint8 tensor (a ``bytes`` shares its memory, an
    ``io.BytesIO`` gives its whole value). A jagged nested tensor gives its ``values``,
    ``offsets`` and ``lengths`` (when set) tensors; a strided one its components'
    elements concatenated (``values``) and their ``sizes`` (int64 ``[n, ndim]``).
    """
    out: dict[str, Any] = {}
    forms: dict[str, Any] = {}
    cut = len(component) + 1 if component else 0
    for path, value in leaves.items():
        rel = "" if path == component else path[cut:]
        t = type(value)
        if t in RAW_BYTES:
            out[path] = _byte_tensor(value.getvalue() if t is io.BytesIO else value)
            forms[rel] = RAW_BYTES[t]
        elif isinstance(value, torch.Tensor) and value.is_nested:
            if value.layout == torch.jagged:
                parts = {"values": value.values(), "offsets": value.offsets()}
                if value.lengths() is not None:
                    parts["lengths"] = value.lengths()
                forms[rel] = {"nested": "jagged", "ragged_dim": int(value._ragged_idx), "parts": list(parts)}
            else:
                pieces = value.unbind()
                flat = [x.reshape(-1) for x in pieces]
                parts = {
                    "values": torch.cat(flat) if flat else torch.empty(0, dtype=value.dtype, device=value.device),
                    "sizes": torch.tensor([list(x.shape) for x in pieces], dtype=torch.int64).reshape(len(pieces), value.dim() - 1),
                }
                forms[rel] = {"nested": "strided", "parts": list(parts)}
            for name, part in parts.items():
                out[join(path, name)] = part.detach()
        else:
            out[path] = value
    return out, forms
