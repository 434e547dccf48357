"""The digest cache (``Store(reuse_hashes=True)``): the shard hashes and blob ids of each
fingerprinted tensor leaf of a live object as this store last committed it, so that a
commit skips rehashing what did not change.

A leaf's fingerprint (token) is, for plain tensors (module parameters and buffers,
optimizer moments, TensorDict and dict leaves), the storage, address, layout and torch's
version counter (:func:`ckptstore.adapters.base.plain_token`); for a TorchRL storage its
mutation revision too (``Adapter.fingerprints``), and, when it changed, only the shards
holding rows written through the storage's ``set`` since are rehashed
(:class:`ckptstore.adapters.torchrl.WriteLog`, :func:`reusable`). Writes torch does not
count (through ``.data``, numpy views, another process's memory) keep the fingerprint, so
every commit also rehashes a random sample of each such tensor's shards (1 %, at least one:
:func:`ckptstore.core.layout.sample_unchanged`): a write to every element, like TorchRL's
target-network updates through ``.data``, is always caught, a sparse one with the sample's
odds; a catch rehashes the tensor in full and warns (``StaleFingerprintWarning``). Shared
and file-backed memory and CUDA tensors are always hashed.

An entry lives as long as what it is kept for (:func:`keeper`) and is looked up by
``(leaf path, target shard size)``. The commit engine (:mod:`ckptstore.protocols.commit`) reads and
fills it; a GC empties it (:meth:`ckptstore.Store.forget_hashes`).
"""

from __future__ import annotations

import weakref
from typing import Any

from ..core.layout import ShardPlan
from ..objects.records import LeafRecord

#: An entry: ``(fingerprint, [(shard hash, blob id)], shard plan, Same or None)``.
Entry = tuple


class Same:
    """What the digest cache keeps of a tensor leaf beside its shard hashes, so that a
    commit of it unchanged skips its per-shard work: its manifest record, its layout
    (dtype, shape, strides) and ``{address: blob id}`` of its shards."""

    __slots__ = ("record", "dtype", "shape", "stride", "blobs")

    def __init__(self, record: LeafRecord, value: Any, blobs: dict[tuple[bytes, int], int]):
        self.record, self.dtype, self.shape, self.stride, self.blobs = record, value.dtype, value.shape, value.stride(), blobs

    @staticmethod
    def of(entry: Entry | None, token: Any, value: Any, component: str) -> Same | None:
        """``entry[3]`` if ``entry`` (the digest cache's) says tensor ``value`` of ``component`` is unchanged."""
        if entry is None or entry[3] is None or entry[0] != token:
            return None
        same = entry[3]
        if same.record.component != component or value.dtype != same.dtype or value.shape != same.shape or value.stride() != same.stride:
            return None
        return same


def _storage_identity() -> type:
    global _STORAGE_IDENTITY
    if _STORAGE_IDENTITY is None:
        from ..adapters.base import StorageIdentity  # lazily: the adapters import torch

        _STORAGE_IDENTITY = StorageIdentity
    return _STORAGE_IDENTITY


_STORAGE_IDENTITY: type | None = None


def keeper(owner: Any, token: Any) -> Any:
    """What a digest-cache entry lives as long as: the tensor's storage for a plain
    token (a dict owner cannot be weakly referenced, and a new dict each commit
    must still find the hashes), else the object the adapter fingerprinted."""
    if type(token) is tuple and token and type(token[0]) is _storage_identity():
        return token[0].ref()
    return owner


def reusable(entry: Entry, token: Any, value: Any, p: ShardPlan) -> dict[int, tuple[bytes, int]] | None:
    """The shards of tensor ``value`` (cut by ``p``) that its last commit (``entry``
    of the digest cache) stored at the same bounds and that no row written since
    touches, as ``{index: (hash, blob id)}``; ``None`` unless ``token`` is a
    :class:`~ckptstore.adapters.base.RowToken` that can name the rows (indices
    along dim 0) written since that commit's token."""
    import torch

    from ..adapters.base import RowToken

    last_token, hashes, last = entry[:3]
    rows = token.changed_rows(last_token) if isinstance(token, RowToken) else None
    if rows is None or last.shard_bytes != p.shard_bytes or value.dim() == 0 or not value.is_contiguous():
        return None
    dirty: set[int] = set()
    if value.shape[0] and p.nbytes:
        row = p.nbytes // value.shape[0]
        rows = rows[: int(torch.searchsorted(rows, value.shape[0]))]  # sorted; rows past the written ones are not in the leaf
        if p.shard_bytes % row == 0:  # whole rows per shard (the plan's rule for rows up to the target)
            dirty = set(torch.unique_consecutive(rows // (p.shard_bytes // row)).tolist())
        else:  # rows cut into several shards
            first, stop = rows * row // p.shard_bytes, ((rows + 1) * row - 1) // p.shard_bytes + 1
            dirty = {i for a, b in zip(first.tolist(), stop.tolist()) for i in range(a, b)}
    same = min(last.count, p.count)  # shards below the last one of either plan are whole in both
    if last.bounds(same - 1) != p.bounds(same - 1):
        same -= 1
    return {i: hashes[i] for i in range(same) if i not in dirty}


class Kept:
    """What the digest cache keeps of a component whose every tensor leaf has a fingerprint,
    as this store last committed it, so that a commit of it unchanged skips all per-leaf
    and per-shard work but the fingerprints' comparison and the sample: its leaf paths and
    fingerprints (compared whole), the object an adapter's fingerprints belong to (weakly;
    ``None`` when all are plain tokens, which name their storages), its JSON leaves' text,
    each tensor leaf's sample plan ``(path, shard hashes, ShardPlan, strided)`` (the small
    one-shard ones of one dtype as ``small``: ``(paths, hashes, end offsets)``, rehashed whole
    in one copy), its
    manifest records, shard addresses and ``{address: blob id}``, and the commits whose
    rows hold them (``owner``) and that last committed it (``last``), and its manifest
    entries' JSON text (``text``) and its tensors' bytes (``nbytes``)."""

    __slots__ = ("paths", "fingerprints", "owner_ref", "jsons", "checks", "small", "records", "keys", "blobs", "owner", "last", "text", "nbytes")

    def __init__(self, paths, fingerprints, owner_ref, jsons, checks, small, records, keys, blobs, owner, last, text, nbytes):
        self.paths, self.fingerprints, self.owner_ref, self.jsons, self.checks = paths, fingerprints, owner_ref, jsons, checks
        self.small = small
        self.records, self.keys, self.blobs, self.owner, self.last, self.text, self.nbytes = records, keys, blobs, owner, last, text, nbytes


class DigestCache:
    """One store's digest cache: ``{id(keeper): (weak reference to it, {(path, shard bytes): Entry})}``,
    and per component ``{(component path, shard bytes): Kept}`` (:attr:`components`)."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, dict]] = {}
        self.components: dict[tuple[str, int], Kept] = {}

    def get(self, owner: Any, path: str, token: Any, shard_bytes: int) -> Entry | None:
        """The entry of leaf ``path`` of ``owner`` (fingerprint ``token``) as this store last
        committed it at target shard size ``shard_bytes`` (bytes), or ``None``."""
        owner = keeper(owner, token)
        cached = self._entries.get(id(owner))
        if cached is None or cached[0]() is not owner:
            return None
        return cached[1].get((path, shard_bytes))

    def drop(self, owner: Any, path: str, token: Any, shard_bytes: int) -> None:
        """Forget the entry :meth:`get` returned (its fingerprint lied: the next commit rehashes it all)."""
        cached = self._entries.get(id(keeper(owner, token)))
        if cached is not None:
            cached[1].pop((path, shard_bytes), None)

    def remember(self, leaves: list[LeafRecord], views: list, tokens: list, ids: dict[tuple[bytes, int], int], shard_bytes: int,
                 unchanged: set[int] = frozenset()) -> None:
        """Keep each fingerprinted leaf's shard hashes and blob ids for the next commit;
        a leaf of ``unchanged`` (taken whole from the cache, its blob ids confirmed) keeps its
        entry. Entries of objects freed since go."""
        import torch

        fresh: dict[int, tuple[Any, dict]] = {}
        for i, (rec, shards, entry) in enumerate(zip(leaves, views, tokens)):
            if entry is not None:
                owner, path, token, value = entry
                owner = keeper(owner, token)
                if owner is None:  # its storage is gone already
                    continue
                key = (path, shard_bytes)
                old = self._entries.get(id(owner)) if i in unchanged else None
                if old is not None and old[0]() is owner and key in old[1]:
                    kept = old[1][key]
                else:
                    hashes = [(d, ids[(d, len(mv))]) for d, mv in shards]
                    same = Same(rec, value, {(d, len(mv)): b for (d, mv), (_, b) in zip(shards, hashes)}) if isinstance(value, torch.Tensor) else None
                    kept = (token, hashes, ShardPlan(rec.nbytes, rec.shard_bytes), same)
                fresh.setdefault(id(owner), (weakref.ref(owner), {}))[1][key] = kept
        live = {k: v for k, v in self._entries.items() if v[0]() is not None}  # entries of freed objects go
        live.update(fresh)
        self._entries = live

    def clear(self) -> None:
        """Forget every entry (:meth:`ckptstore.Store.forget_hashes`)."""
        self._entries = {}
        self.components = {}


__all__ = ["DigestCache", "Entry", "Kept", "Same", "keeper", "reusable"]
