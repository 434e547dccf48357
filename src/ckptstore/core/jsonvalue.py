"""Type-preserving JSON for non-tensor leaves.

Plain JSON would turn tuples into lists, non-string dict keys into strings and
lose NaN, slices and Ellipsis (see TorchRL issue #4369 and tensordict PR #1736,
where such coercions broke a resumed buffer). This codec keeps Python types
exactly and rejects every other type instead of coercing it.

Encoding (a JSON document; objects with a single ``"$"`` key are tags):

=========================  =============================================
Python value               JSON
=========================  =============================================
None, bool, int, str       themselves (ints of any size)
float (finite)             a JSON number (``repr`` round-trips exactly)
float nan / inf / -inf     ``{"$": "float", "v": "nan" | "inf" | "-inf"}``
list                       a JSON array
tuple                      ``{"$": "tuple", "v": [...]}``
dict with str keys         a JSON object (a key ``"$"`` is escaped as a tag)
other dict                 ``{"$": "dict", "v": [[key, value], ...]}``
slice                      ``{"$": "slice", "v": [start, stop, step]}``
Ellipsis                   ``{"$": "ellipsis"}``
numpy scalar               ``{"$": "numpy", "dtype": "<f4", "v": value}``
=========================  =============================================

numpy scalars (``np.float64``, ``np.float32``, ``np.int64``, ``np.bool_``... what
``np.mean`` returns) of the bool, integer, float (up to 64 bits) and complex (up to
128 bits, ``v`` is ``[real, imag]``) kinds keep their numpy type: ``v`` is the value as
the matching Python number, which holds it exactly. Other subclasses of these types
(named tuples, ``np.str_``), ``np.longdouble`` and numpy's date, string and void
scalars are refused: they would come back as another type or value.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import CkptStoreError, UnsupportedTypeError

__all__ = ["JSON_SAFE_TYPES", "decode", "dumps", "encode", "loads"]

JSON_SAFE_TYPES = (type(None), bool, int, float, str, list, tuple, dict, slice, type(Ellipsis))
_MAX_DEPTH = 64


def is_text(s: str) -> bool:
    """Can ``s`` be stored as UTF-8 (no lone surrogates)?"""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def encode(value: Any, path: str = "") -> Any:
    """Turn ``value`` into plain JSON data, tagging types JSON cannot hold.

    Raises:
        UnsupportedTypeError: a value of another type (or a subclass) at
            ``path``; the message names the path and the type.
    """
    return _encode(value, path or "<value>", 0)


def _encode(value: Any, path: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise UnsupportedTypeError(f"{path}: nesting deeper than {_MAX_DEPTH} levels")
    t = type(value)
    if t is str and not is_text(value):
        raise UnsupportedTypeError(f"{path}: string {value!r} is not valid UTF-8 (lone surrogate)")
    if value is None or t is bool or t is int or t is str:
        return value
    if t is float:
        if math.isfinite(value):
            return value
        return {"$": "float", "v": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if t is list:
        return [_encode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if t is tuple:
        return {"$": "tuple", "v": [_encode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]}
    if t is dict:
        if all(type(k) is str and is_text(k) for k in value) and "$" not in value:
            return {k: _encode(v, f"{path}.{k}", depth + 1) for k, v in value.items()}
        return {
            "$": "dict",
            "v": [[_encode(k, f"{path}<key>", depth + 1), _encode(v, f"{path}[{k!r}]", depth + 1)] for k, v in value.items()],
        }
    if t is slice:
        return {"$": "slice", "v": [_encode(x, f"{path}.slice", depth + 1) for x in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"$": "ellipsis"}
    if _is_numpy_scalar(value) and _numpy_dtype(value.dtype):
        v = value.item()
        return {"$": "numpy", "dtype": value.dtype.str, "v": [_encode(v.real, path, depth + 1), _encode(v.imag, path, depth + 1)]
                if value.dtype.kind == "c" else _encode(v, path, depth + 1)}
    if t in (bytes, bytearray) or t.__module__ == "_io" and t.__qualname__ == "BytesIO":
        raise UnsupportedTypeError(
            f"{path}: raw bytes ({t.__qualname__}) are stored as blobs only as a component or as the value of a "
            "dict key, not inside a list, a tuple, a dict with non-str keys, metadata or a JSON leaf"
        )
    if any(k.__module__ == "torch" and k.__qualname__ == "Tensor" for k in t.__mro__):
        raise UnsupportedTypeError(
            f"{path}: a tensor inside a list, a tuple, a dict with non-str keys, metadata or a JSON leaf; "
            "tensors are stored only as a component or as the value of a str dict key"
        )
    raise UnsupportedTypeError(
        f"{path}: values of type {t.__module__}.{t.__qualname__} cannot be stored without pickle "
        "(supported: tensors, nested tensors, numpy arrays and scalars, bytes, bytearray, io.BytesIO, "
        "None, bool, int, float, str, list, tuple, dict, slice, Ellipsis)"
    )


def _is_numpy_scalar(value: Any) -> bool:
    """A numpy scalar (numpy is imported only by code that made one, so the command line's
    catalog-only commands do not import it)."""
    if type(value).__module__ != "numpy":
        return False
    import numpy as np

    return isinstance(value, np.generic)


def _numpy_dtype(dtype: Any) -> bool:
    """A numpy scalar dtype whose values a Python number holds exactly (bool, int, uint,
    float up to 64 bits, complex up to 128 bits)."""
    return dtype.kind in "biu" or (dtype.kind == "f" and dtype.itemsize <= 8) or (dtype.kind == "c" and dtype.itemsize <= 16)


def decode(data: Any) -> Any:
    """Inverse of :func:`encode`.

    Raises:
        CkptStoreError: unknown tags or malformed tagged objects.
    """
    return _decode(data, 0)


def _decode(data: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise CkptStoreError(f"JSON value nested deeper than {_MAX_DEPTH} levels")
    t = type(data)
    if data is None or t in (bool, int, float, str):
        return data
    if t is list:
        return [_decode(v, depth + 1) for v in data]
    if t is not dict:
        raise CkptStoreError(f"unexpected JSON type {t.__name__}")
    if "$" not in data:
        return {k: _decode(v, depth + 1) for k, v in data.items()}
    tag = data["$"]
    v = data.get("v")
    try:
        if tag == "tuple":
            return tuple(_decode(x, depth + 1) for x in _list(v))
        if tag == "float" and v in ("nan", "inf", "-inf"):
            return float(v)
        if tag == "dict":
            out = {}
            for pair in _list(v):
                key, val = _list(pair, 2)
                out[_decode(key, depth + 1)] = _decode(val, depth + 1)
            return out
        if tag == "slice":
            return slice(*(_decode(x, depth + 1) for x in _list(v, 3)))
        if tag == "ellipsis":
            return Ellipsis
        if tag == "numpy" and set(data) == {"$", "dtype", "v"} and type(data["dtype"]) is str:
            import numpy as np

            dtype = np.dtype(data["dtype"])
            if dtype.str == data["dtype"] and _numpy_dtype(dtype):
                x = _decode(v, depth + 1)
                if dtype.kind == "c":
                    re, im = _list(x, 2)
                    x = complex(re, im)
                elif type(x) is not {"b": bool, "i": int, "u": int, "f": float}[dtype.kind]:
                    raise TypeError(f"a {type(x).__name__} for a numpy {dtype}")
                return dtype.type(x)
    except (TypeError, ValueError, OverflowError) as exc:  # unhashable dict key, a bad numpy dtype or value as exc:  # unhashable dict key
        raise CkptStoreError(f"malformed tagged JSON value {tag!r}: {exc}") from None
    raise CkptStoreError(f"unknown or malformed tagged JSON value {tag!r}")


def _list(v: Any, n: int | None = None) -> list:
    if type(v) is not list or (n is not None and len(v) != n):
        raise CkptStoreError("malformed tagged JSON value")
    return v


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``object_pairs_hook`` for :func:`json.loads` refusing duplicate keys (ValueError)."""
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError(f"duplicate key(s) {sorted({k for k in keys if keys.count(k) > 1})}")
    return dict(pairs)


def dumps(value: Any, path: str = "") -> str:
    """Encode ``value`` to a compact, key-order-preserving JSON string."""
    return json.dumps(encode(value, path), separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def loads(text: str) -> Any:
    """Decode a string written by :func:`dumps`.

    Raises:
        CkptStoreError: the text is not valid JSON or holds unknown tags.
    """
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CkptStoreError(f"invalid JSON value: {exc}") from None
    return decode(data)
