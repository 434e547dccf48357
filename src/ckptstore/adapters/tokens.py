"""Change tokens: what a commit compares to tell that a tensor's bytes did not change
since the store last committed it (so its shard hashes are reused, not recomputed).

See :meth:`ckptstore.adapters.base.Adapter.fingerprints` and ``Store``'s ``reuse_hashes``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class StorageIdentity:
    """Equal to another only while both refer to one live tensor storage: a token
    part that no new storage allocated at a freed one's address can match."""

    __slots__ = ("ref",)

    def __init__(self, storage: Any):
        self.ref = weakref.ref(storage)

    def __eq__(self, other: object) -> bool:
        mine = self.ref()
        return mine is not None and isinstance(other, StorageIdentity) and mine is other.ref()

    def __hash__(self) -> int:
        return 0


class RowToken:
    """A change token that can also name the rows written since an earlier token.

    ``key`` is compared like any token (equal keys: the tensor did not change).
    ``log`` is an object with ``rows_since(seq) -> torch.Tensor | None`` (int64
    indices along dim 0, ascending, written after its write number ``seq``, or ``None``
    when it cannot tell), and ``seq`` the log's write number when the token
    was taken. ``parts`` is the part of ``key`` that must be equal for rows to
    be compared at all (the tensor's storage identity, address, shape, strides, dtype).
    """

    __slots__ = ("key", "log", "parts", "seq")

    def __init__(self, key: tuple, parts: tuple, log: Any, seq: int):
        self.key, self.parts, self.log, self.seq = key, parts, log, seq

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowToken) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def changed_rows(self, earlier: Any) -> torch.Tensor | None:
        """Indices (int64, along dim 0, ascending) of every row written after ``earlier`` was
        taken, or ``None`` if the rows cannot be told (another tensor, another log,
        a write the log did not see in between)."""
        if not isinstance(earlier, RowToken) or earlier.log is not self.log or earlier.parts != self.parts:
            return None
        return self.log.rows_since(earlier.seq)


def plain_token(t: torch.Tensor) -> tuple | None:
    """A change token for a tensor whose writes torch tracks, or ``None``.

    Torch bumps a tensor's version counter on every in-place op on it or its
    views (optimizer steps, ``copy_``, ``index_put_``); with the storage's identity,
    the address, layout and dtype, an equal token means the bytes did not change
    *through torch*. Writes torch does not see are not in it: through ``.data``
    (TorchRL's target-network updates), ``.numpy()`` views, or raw memory. So
    tensors another process may write (shared or file-backed memory) and CUDA and
    inference tensors get no token, and a store checks a sample of every reused
    tensor's shards at each commit (see ``Store``, ``reuse_hashes``).
    """
    if not t.is_cpu or t.layout is not torch.strided or t.is_nested or t.is_inference():
        return None
    storage = t.untyped_storage()
    # Tensor.is_shared asks the same storage; _get_filename is what its `filename` property returns
    if storage.is_shared() or storage._get_filename() is not None:
        return None
    return (StorageIdentity(storage), t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
