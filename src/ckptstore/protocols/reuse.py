"""What a commit takes over from this store's earlier commits without hashing it again
(docs/design.md, "A component unchanged as a whole shares its rows"): a component whose
every fingerprint is equal to what the digest cache kept (:class:`ckptstore.protocols.digests.Kept`)
and whose sample rehashes equal is committed as a :class:`Reused` component, pointing at
the catalog rows of the commit that holds its leaves; :func:`as_reused` decides it,
:func:`keep_components` keeps what the next commit needs to decide. An asynchronous
commit's changed tensor leaves, split when it snapshots the state, are :class:`Prehashed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core import jsonvalue
from ..core.layout import ShardPlan, changed_parts, sample_unchanged, shard_count
from ..home.index_step import Reused, logical_bytes, per_component  # noqa: F401 (declared in the home layer, whose index step reads them)
from ..objects import records
from ..objects.records import LeafRecord
from .digests import DigestCache

if TYPE_CHECKING:
    from ..adapters.base import Captured

_SMALL = 4096  # a one-shard tensor up to this size is rehashed in one copy with the component's others (Reused)


def small_changed(paths: list[str], hashes: list[bytes], ends: list[int], values: dict) -> list[int] | None:
    """The sample of a component's small one-shard tensors ``values[path]`` (one dtype,
    contiguous): all of each, laid end to end in one copy and each part rehashed
    (:func:`ckptstore.core.layout.changed_parts`); the indices whose hash is not ``hashes``' at
    that index, or ``None`` if they cannot be laid end to end (not tensors)."""
    import torch

    tensors = [values[p] for p in paths]
    try:
        try:
            flat = torch._C._nn.flatten_dense_tensors(tensors)  # one C++ call (torch._utils._flatten_dense_tensors)
        except AttributeError:
            flat = torch.cat([t.reshape(-1) for t in tensors])
        mv = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
    except (TypeError, RuntimeError, ValueError):
        return None
    return changed_parts(hashes, mv, ends)


@dataclass
class Prehashed:
    """A changed tensor leaf of an asynchronous commit, split when it was snapshotted:
    its record, each shard's ``(digest, bytes)`` (copies of the shards that changed since
    the last commit, views of the live tensor for the others, only read if their blob
    must be written again, after a rehash; a copy's digest is ``b""`` until the commit
    hashes it), the blob ids of the unchanged ones, and the last commit's
    ``(digest, blob id)`` per shard."""

    record: LeafRecord
    shards: list[tuple[bytes, memoryview]]
    reused: dict[int, int]  # shard index -> blob id
    last: list[tuple[bytes, int]]


def as_reused(digests: DigestCache, comp: Captured, shard_bytes: int) -> Reused | None:
    """``comp`` as a :class:`Reused` component if the digest cache kept it
    (:class:`ckptstore.protocols.digests.Kept`) and it did not change since: the same leaf paths,
    every fingerprint equal (compared whole), the same JSON leaves, and a sample of
    every tensor's shards rehashed equal (a tensor whose sample differs is forgotten
    and warned about: the commit hashes it in full). Else ``None``."""
    import torch

    from ..core.shards import flat_bytes, physical

    kept = digests.components.get((comp.path, shard_bytes))
    if kept is None or records.ESCAPED in comp.meta:
        return None
    if kept.paths != tuple(comp.leaves) or kept.fingerprints != comp.fingerprints:
        return None
    if kept.owner_ref is not None and kept.owner_ref() is not comp.owner:
        return None
    values = comp.leaves
    for path, text in kept.jsons:
        v = values[path]
        if isinstance(v, (torch.Tensor, Prehashed)) or jsonvalue.dumps(v, path) != text:
            return None
    def stale(path: str) -> None:  # (sample_unchanged warned): the commit hashes it in full, the component has rows of its own
        digests.components.pop((comp.path, shard_bytes), None)
        digests.drop(comp.owner, path, comp.fingerprints[path], shard_bytes)

    if kept.small:  # the small one-shard tensors (contiguous, one dtype): laid end to end in one copy, each rehashed whole
        paths, hashes, ends = kept.small
        changed = small_changed(paths, hashes, ends, values)
        if changed is None:
            return None
        for i in changed:
            v = values[paths[i]]
            if not isinstance(v, torch.Tensor):
                return None
            if not sample_unchanged([hashes[i]], flat_bytes(v, paths[i]), ShardPlan(ends[i] - (ends[i - 1] if i else 0), 1 << 62), paths[i]):
                stale(paths[i])
                return None
    for path, hashes, p, strided in kept.checks:
        v = values[path]
        if not isinstance(v, torch.Tensor):
            return None
        if not sample_unchanged(hashes, flat_bytes(physical(v, path)[0] if strided else v, path), p, path):
            stale(path)
            return None
    return Reused(comp.path, comp.adapter, comp.version, {**comp.meta, records.ESCAPED: True}, kept.records, kept.keys, kept.blobs,
                  kept.owner, kept.last, kept.text, kept.nbytes, comp)


def keep_components(digests: DigestCache, components: list, leaves: list[LeafRecord], keys: list, ids: dict, cid: str, shard_bytes: int) -> None:
    """After commit ``cid``: the digest cache's :class:`~ckptstore.protocols.digests.Kept` of each
    component whose every tensor leaf has a fingerprint (a :class:`Reused` one's now
    names the rows' owner and ``cid``); the others' go."""
    import weakref

    from ..adapters.base import StorageIdentity
    from .digests import Kept

    cache = digests.components
    for c, recs, comp_keys in per_component(components, leaves, keys):
        key = (c.path, shard_bytes)
        if type(c) is Reused:
            kept = cache.get(key)
            if kept is not None:
                kept.owner, kept.last = (c.owner if c.confirmed else cid), cid
            continue
        cache.pop(key, None)
        fingerprints = c.fingerprints
        tensors = [r for r in recs if r.kind == "tensor"]
        if not tensors or any(r.path not in fingerprints for r in tensors):
            continue
        plain = all(type(t) is tuple and t and type(t[0]) is StorageIdentity for t in fingerprints.values())
        try:
            owner_ref = None if plain else weakref.ref(c.owner)
        except TypeError:
            continue
        checks, j = [], 0
        small: dict[str, tuple[list, list, list]] = {}  # dtype -> (paths, hashes, ends)
        for r in recs:
            if r.kind == "tensor":
                m = shard_count(r.nbytes, r.shard_bytes)
                if m == 1 and r.stride is None and 0 < r.nbytes <= _SMALL:
                    group = small.setdefault(r.dtype, ([], [], []))
                    group[0].append(r.path)
                    group[1].append(comp_keys[j][0])
                    group[2].append((group[2][-1] if group[2] else 0) + r.nbytes)
                else:
                    checks.append((r.path, [d for d, _ in comp_keys[j : j + m]], ShardPlan(r.nbytes, r.shard_bytes), r.stride is not None))
                j += m
        if len(small) > 1:  # one dtype only (the largest group): the others are checked one by one
            keep = max(small, key=lambda d: len(small[d][0]))
            for d, (paths, hashes, ends) in small.items():
                if d != keep:
                    checks += [(p, [h], ShardPlan(e - (ends[i - 1] if i else 0), 1 << 62), False) for i, (p, h, e) in enumerate(zip(paths, hashes, ends))]
            small = {keep: small[keep]}
        jsons = [(r.path, r.value) for r in recs if r.kind == "json"]
        cache[key] = Kept(tuple(c.leaves), dict(fingerprints), owner_ref, jsons, checks, next(iter(small.values()), None), recs, comp_keys,
                          {a: ids[a] for a in comp_keys}, cid, cid, records.manifest_json([r.encoded[0] for r in recs]),
                          sum(r.nbytes for r in tensors))
