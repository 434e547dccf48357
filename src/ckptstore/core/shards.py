"""Cutting tensors into row-aligned shards and addressing them.

A tensor is stored as its little-endian bytes in memory order: C-contiguous,
or, for a dense permuted layout (a transpose, ``channels_last``), in that
layout, with its strides recorded so checkout rebuilds it. Views with gaps
are stored C-contiguous (see docs/design.md). The bytes are cut at fixed
offsets, a multiple of one row (``shape[1:]`` elements), so that rows which did
not change keep the same shard boundaries and the same hash from one commit to
the next. A zero-element tensor has exactly one, empty, shard.

A shard's address is its XXH3-128 digest (16 bytes, from the xxHash
specification, https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md)
plus its length in bytes.
"""

from __future__ import annotations

import sys

import torch

from . import layout
from .errors import UnsupportedDtypeError, UnsupportedTypeError
from .layout import DEFAULT_SHARD_BYTES, EMPTY_DIGEST, MAX_DIMS, ShardPlan, address, dense_order, digest  # noqa: F401 (re-exported)

MAX_ROWS = 4096  # rows per shard at most, for leaves of up to MAX_SHARDS shards
MAX_SHARDS = 4096  # past this many shards a leaf's row cap doubles until it needs no more (or shards reach the target)

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("ckptstore stores tensors little-endian and needs a little-endian host")


def _build_dtypes() -> dict[str, torch.dtype]:
    table = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype) and not str(value).startswith(("torch.q", "torch.quint")):
            table[str(value).removeprefix("torch.")] = value
    return dict(sorted(table.items()))


#: Every dtype of the installed torch that has a raw byte form, by name
#: (``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"``, ...). Quantized dtypes
#: are absent: their values need scale and zero point, which are not bytes.
DTYPES: dict[str, torch.dtype] = _build_dtypes()


def dtype_name(dtype: torch.dtype, path: str = "") -> str:
    """Name of ``dtype`` in :data:`DTYPES`.

    Raises:
        UnsupportedDtypeError: quantized dtypes, which are never converted.
    """
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise UnsupportedDtypeError(f"{path or '<tensor>'}: dtype {dtype} cannot be stored raw")
    return name


def check_shape(shape, dtype: torch.dtype) -> None:
    """Check that a tensor of ``shape`` and ``dtype`` can be built, without allocating it:
    :func:`ckptstore.core.layout.check_shape`'s arithmetic, then torch itself
    (``torch.empty(shape, dtype=dtype, device="meta")`` allocates nothing).

    Raises:
        ValueError: what is wrong, with the shape and dtype.
    """
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype")  # noqa: TRY004 - one error class for every unbuildable shape
    layout.check_shape(shape, dtype.itemsize)
    try:
        torch.empty(tuple(shape), dtype=dtype, device="meta")
    except (RuntimeError, OverflowError, TypeError, ValueError):
        raise ValueError(f"shape {list(shape)} of {dtype} is too large for torch to build (its size overflows int64)") from None


def check_tensor(t: torch.Tensor, path: str = "") -> None:
    """Refuse tensors without a raw strided byte form.

    Raises:
        UnsupportedTypeError: sparse, nested or meta tensors.
        UnsupportedDtypeError: quantized dtypes.
    """
    kind = "nested" if t.is_nested else "meta" if t.device.type == "meta" else None if t.layout == torch.strided else str(t.layout)
    if kind:
        raise UnsupportedTypeError(f"{path or '<tensor>'}: {kind} tensors have no raw byte form; store a dense tensor")
    dtype_name(t.dtype, path)


def physical(t: torch.Tensor, path: str = "") -> tuple[torch.Tensor, list[int] | None]:
    """``t`` in memory order and its strides to record (after :func:`check_tensor`).

    A C-contiguous tensor comes back as is, with ``None``. A dense permuted
    layout (transpose, ``channels_last``) comes back permuted to memory order,
    which is contiguous without a copy, with ``t.stride()`` to restore it.
    Anything else (views with gaps) is copied C-contiguous, strides not kept.
    """
    check_tensor(t, path)
    if t.is_contiguous() or t.numel() == 0:
        return t, None
    order = dense_order(tuple(t.shape), t.stride())
    if order is None:
        return t.contiguous(), None
    return t.permute(order), list(t.stride())


def tensor_bytes(t: torch.Tensor, path: str = "") -> memoryview:
    """The bytes of a tensor that :func:`physical` returned, as a flat uint8 ``memoryview``.

    No copy for a contiguous CPU tensor; a conjugated or CUDA tensor is first
    copied to a contiguous CPU tensor.

    Raises:
        UnsupportedTypeError / UnsupportedDtypeError: see :func:`check_tensor`.
    """
    check_tensor(t, path)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return byte_view(t)


def flat_bytes(t: torch.Tensor, path: str = "") -> memoryview:
    """:func:`tensor_bytes` of a CPU tensor in memory order: the short way (through numpy)
    where it applies, else that function. Raises as :func:`tensor_bytes`."""
    if t.is_contiguous() and t.numel():
        try:
            return memoryview(t.detach().numpy()).cast("B")
        except (TypeError, RuntimeError, ValueError):  # no numpy dtype (bfloat16...), conjugate or negative bit, a subclass
            pass
    return tensor_bytes(t, path)


def byte_view(t: torch.Tensor) -> memoryview:
    """Writable flat uint8 ``memoryview`` of a contiguous CPU tensor's memory (no copy)."""
    if t.numel() == 0:
        return memoryview(bytearray(0))
    if type(t) is not torch.Tensor:  # MemoryMappedTensor and other subclasses: plain view, same memory
        t = t.as_subclass(torch.Tensor)
    # as_strided, not reshape: a contiguous tensor may carry odd strides on size-1 dims
    return memoryview(t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy())


def plan(shape: tuple[int, ...], dtype: torch.dtype, target: int = DEFAULT_SHARD_BYTES, max_rows: int = MAX_ROWS) -> ShardPlan:
    """Shard boundaries for a tensor of ``shape`` and ``dtype``.

    ``shard_bytes`` is the largest whole number of rows (a row is one index
    along dim 0) that fits in ``target`` bytes, at least one row and at most
    ``max_rows`` rows: narrow columns of a replay buffer (actions, rewards,
    priorities) then change in blocks of rows as small as the wide ones, not
    whole. For a leaf that would need more than ``MAX_SHARDS`` shards (a 1-d
    float32 tensor over 64 MiB) the row cap doubles until it does not, or until
    shards reach ``target``: per-shard catalog costs stay bounded, and
    boundaries move only when a growing buffer crosses a power of two. A row
    larger than ``target`` is cut every ``target`` bytes rounded down to whole
    elements. 0-d and 1-d tensors count one element as a row.
    """
    itemsize = dtype.itemsize
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * itemsize
    row = itemsize
    for s in shape[1:]:
        row *= s
    if row == 0:
        return ShardPlan(nbytes, max(itemsize, 1))
    if row <= target:
        rows = nbytes // row
        while -(-rows // max_rows) > MAX_SHARDS and max_rows * row < target:
            max_rows *= 2
        shard_bytes = row * min(target // row, max_rows)
    else:
        shard_bytes = max(itemsize, target - target % itemsize)
    return ShardPlan(nbytes, shard_bytes)
