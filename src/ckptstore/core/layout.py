"""Shard layout arithmetic and addresses, without torch: what the catalog, packs,
records, GC, fsck and recovery need, so that catalog-only commands never import torch.

A shard's address is its XXH3-128 digest (16 bytes, from the xxHash
specification, https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md)
plus its length in bytes. :mod:`ckptstore.core.shards` cuts tensors with these.
"""

from __future__ import annotations

import random
import re
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

from .errors import StaleFingerprintWarning

DEFAULT_SHARD_BYTES = 256 << 10  # 256 KiB; docs/performance.md has the measurement behind it
MAX_DIMS = 64  # the most dimensions ckptstore stores or imports (a bound on manifests; torch allows more)
_INT64 = 1 << 63

#: Bytes per element of every dtype name of torch 2.14 (``ckptstore.core.shards.DTYPES``;
#: a test keeps the two equal). Names a newer torch adds are looked up there.
ITEMSIZE: dict[str, int] = {
    "bcomplex32": 4, "bfloat16": 2, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1, "bool": 1,
    "complex128": 16, "complex32": 4, "complex64": 8, "float16": 2, "float32": 4, "float4_e2m1fn_x2": 1, "float64": 8,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "int1": 1, "int16": 2, "int2": 1, "int3": 1, "int32": 4, "int4": 1, "int5": 1, "int6": 1, "int64": 8, "int7": 1, "int8": 1,
    "uint1": 1, "uint16": 2, "uint2": 1, "uint3": 1, "uint32": 4, "uint4": 1, "uint5": 1, "uint6": 1, "uint64": 8, "uint7": 1, "uint8": 1,
}


def itemsize(dtype_name: object) -> int | None:
    """Bytes per element of a stored dtype name, or ``None`` for an unknown name."""
    if type(dtype_name) is not str:
        return None
    size = ITEMSIZE.get(dtype_name)
    if size is None and "torch" in sys.modules:  # a dtype of a newer torch than this table
        torch = sys.modules["torch"]
        dtype = getattr(torch, dtype_name, None) if dtype_name.isidentifier() else None
        size = dtype.itemsize if isinstance(dtype, torch.dtype) and not dtype_name.startswith("q") else None
    return size


def check_shape(shape: object, itemsize: int) -> None:
    """Check that a tensor of ``shape`` with ``itemsize``-byte elements can exist:
    at most :data:`MAX_DIMS` non-negative ints, and its strides and byte size fit
    in int64, as torch requires (so ``[0, 2**70]`` fails, zero elements or not).

    Raises:
        ValueError: what is wrong.
    """
    if not isinstance(shape, (list, tuple)):  # torch.Size is a tuple
        raise ValueError(f"shape {shape!r} is not a list of ints")  # noqa: TRY004 - one error class for every unbuildable shape
    if len(shape) > MAX_DIMS:
        raise ValueError(f"shape has {len(shape)} dimensions, more than {MAX_DIMS}")
    for s in shape:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"shape {list(shape)!r}: dimension {s!r} is not a non-negative int")
        if s >= _INT64:
            raise ValueError(f"shape {list(shape)} is too large: dimension {s} overflows int64")
    stride, numel = 1, 1
    for s in reversed(shape):
        numel *= s
        if stride >= _INT64:
            raise ValueError(f"shape {list(shape)} is too large: its strides overflow int64")
        stride *= max(s, 1)
    if numel * itemsize >= _INT64:
        raise ValueError(f"shape {list(shape)} of {itemsize}-byte elements is too large: its size overflows int64")


def address(digest: bytes, length: int) -> str:
    """Printable blob address: 32 hex digits of XXH3-128, a dash, the length in bytes."""
    return f"{digest.hex()}-{length}"


def digest(data) -> bytes:
    """XXH3-128 of a bytes-like object, as 16 big-endian bytes (canonical form)."""
    return xxhash.xxh3_128_digest(data)


EMPTY_DIGEST = digest(b"")


def dense_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> list[int] | None:
    """Dims from outermost to innermost in memory, if ``(shape, stride)`` is dense.

    Dense means non-overlapping with no gaps: a permutation of a C-contiguous
    layout, such as a transpose or ``channels_last``. ``None`` otherwise.
    """
    if len(stride) != len(shape):
        return None
    order = sorted(range(len(shape)), key=lambda d: -stride[d])
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return order


def shard_count(nbytes: int, shard_bytes: int) -> int:
    """Number of shards of a tensor of ``nbytes`` bytes cut every ``shard_bytes`` (one,
    empty, for a zero-byte tensor)."""
    return max(1, -(-nbytes // shard_bytes))


@dataclass(frozen=True)
class ShardPlan:
    """Where one tensor is cut: ``nbytes`` total, ``shard_bytes`` per shard."""

    nbytes: int
    shard_bytes: int

    @property
    def count(self) -> int:
        """Number of shards (:func:`shard_count`)."""
        return shard_count(self.nbytes, self.shard_bytes)

    def bounds(self, i: int) -> tuple[int, int]:
        """Byte range ``[start, stop)`` of shard ``i``."""
        start = i * self.shard_bytes
        return start, min(self.nbytes, start + self.shard_bytes)


#: ckptstore's own random generator (shard samples, retry jitter): drawing from the global one would move
#: the state an ``RNGState`` commits and restores, and a resumed run would not repeat the original.
RANDOM = random.Random()


def sample_unchanged(known: Sequence[bytes] | Mapping[int, bytes], mv: memoryview, plan: ShardPlan, path: str) -> bool:
    """Rehash a random sample of the shards of ``mv`` (cut by ``plan``) whose hashes a
    fingerprint says are still ``known`` (all shards in order, or ``{shard index:
    hash}``): one shard, and 1 % of them for large tensors.

    A write torch did not count (through ``.data``, a numpy view, another process)
    that touches a sampled shard, as any write to every element does, is caught:
    returns ``False`` and warns :class:`~ckptstore.core.errors.StaleFingerprintWarning`
    naming ``path``; the caller then hashes it all.
    """
    if type(known) is list and len(known) == 1:  # a one-shard tensor (most small leaves): the sample is all of it
        if digest(mv[: plan.nbytes]) == known[0]:
            return True
    else:
        known = known if isinstance(known, Mapping) else dict(enumerate(known))
        if not known:
            return True
        sample = RANDOM.sample(sorted(known), max(1, len(known) // 100))
        if all(digest(mv[slice(*plan.bounds(i))]) == known[i] for i in sample):
            return True
    warnings.warn(
        f"{path}: its bytes changed without torch counting a write (through .data, a numpy view or another "
        "process); it was rehashed in full. Pass reuse_hashes=False to the Store to always hash.",
        StaleFingerprintWarning,
        stacklevel=3,
    )
    return False


def changed_parts(known: Sequence[bytes], mv: memoryview, ends: Sequence[int]) -> list[int]:
    """Rehash each of the consecutive parts of ``mv`` that end at ``ends`` (the bytes of many
    one-shard tensors laid end to end, each one's whole sample): the indices of those whose
    hash is not ``known`` at the same index (every one when ``mv`` is not ``ends[-1]`` long)."""
    if len(mv) != (ends[-1] if ends else 0):
        return list(range(len(known)))
    out, start = [], 0
    for i, (h, end) in enumerate(zip(known, ends)):
        if digest(mv[start:end]) != h:
            out.append(i)
        start = end
    return out


# --- paths: keys escaped into segments joined by "/" ----------------------------------------
#
# A state tree's keys are any Python strings; a stored path joins them with "/".
# Each key is stored as one *segment*: "%" is written "%25", "/" "%2F", NUL "%00",
# a lone surrogate (not storable as UTF-8) "%uD8xx"; the empty key is the segment
# "%". Every other character stands for itself (".", "..", spaces, unicode).
# Exactly one segment spells each key, so paths compare as strings.

_ESCAPES = {"%": "%25", "/": "%2F", "\x00": "%00"}
_UNESCAPES = {"25": "%", "2F": "/", "00": "\x00"}


def escape(key: str) -> str:
    """The path segment that stores ``key`` (any ``str``; see the rules above).

    >>> escape("x/y"), escape(""), escape("a.b")
    ('x%2Fy', '%', 'a.b')
    """
    if not key:
        return "%"
    if key.isalnum() or not any(c in _ESCAPES or "\ud800" <= c <= "\udfff" for c in key):
        return key
    return "".join(_ESCAPES.get(c) or (f"%u{ord(c):04X}" if "\ud800" <= c <= "\udfff" else c) for c in key)


def unescape(segment: str) -> str:
    """The key a path segment stores: the inverse of :func:`escape`.

    A ``%`` that does not begin one of the escapes above stands for itself: so
    read paths of commits made before keys were escaped (when ``/`` was refused
    in keys and ``%`` stored as is).
    """
    if "%" not in segment:
        return segment
    if segment == "%":
        return ""
    return _ESCAPED.sub(_unescape_one, segment)


_ESCAPED = re.compile(r"%(25|2F|00|u(D[89A-F][0-9A-F]{2}))")


def _unescape_one(m: re.Match) -> str:
    return chr(int(m.group(2), 16)) if m.group(2) else _UNESCAPES[m.group(1)]


def keypath(*keys: str) -> str:
    """The stored path of the leaf reached through ``keys``, for ``partial=`` and
    ``show``: ``keypath("rb", "x/y") == "rb/x%2Fy"``.

    Raises:
        TypeError: a key that is not a ``str``.
    """
    for k in keys:
        if type(k) is not str:
            raise TypeError(f"state-tree keys are str, got {type(k).__name__} {k!r}")
    return "/".join(escape(k) for k in keys)


def split(path: str) -> tuple[str, ...]:
    """The keys along a stored path (``()`` for the root ``""``): inverse of :func:`keypath`.

    """
    return tuple(unescape(s) for s in path.split("/")) if path else ()


def is_escaped(segment: str) -> bool:
    """Is ``segment`` the one :func:`escape` writes for its key (no stray or lowercase escape)?"""
    return escape(unescape(segment)) == segment


def from_raw_keys(path: str) -> str:
    """A path of a component stored before keys were escaped (its meta lacks
    ``"escaped"``): then ``/`` could not be in a key and ``%`` stood for itself, so each
    segment is its key; the same path in today's escaped form."""
    return "/".join(escape(s) for s in path.split("/")) if path else path


def check_path(path: str) -> None:
    """Raise ValueError unless ``path`` is ``""`` or non-empty segments joined by ``/``
    that UTF-8 can hold (lone surrogates escaped)."""
    if path and "" in path.split("/"):
        raise ValueError(f"path {path!r} has an empty segment (the empty key is written '%')")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"path {path!a} holds a lone surrogate (written %uD800-%uDFFF)") from None


def join(path: str, name: str) -> str:
    """Join a path and an already escaped segment or path with ``/`` (the root path is ``""``)."""
    if not path:
        return name
    if not name:
        return path
    return f"{path}/{name}"


def under(path: str, prefix: str) -> bool:
    """Is ``path`` at or below ``prefix`` (``""`` is above everything)?"""
    return not prefix or path == prefix or path.startswith(prefix + "/")
