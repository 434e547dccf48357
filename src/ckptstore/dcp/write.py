"""The writing side of ckptstore as DCP's storage layer: :class:`StoreWriter`, the
``StorageWriter`` that commits one ``dcp.save`` as one ckptstore commit (steps 1 to 3 of
:mod:`ckptstore.dcp`: plan, write, commit).
"""

from __future__ import annotations

import os
import weakref
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..adapters.base import RAW, RAW_BYTES, Captured, plain_token, raw_leaves
from ..core import jsonvalue
from ..core.errors import (
    IntegrityError,
    InvalidArgumentError,
    RefNotFoundError,
    StoreWriteError,
    UnsupportedTypeError,
)
from ..core.layout import address, digest, sample_unchanged
from ..core.shards import dtype_name, physical, tensor_bytes
from ..core.shards import plan as shard_plan
from ..objects.packs import BlobLoc, PackWriter
from ..objects.records import ESCAPED, LeafRecord, check_message, check_tag
from ..store import CommitInfo, Store, pack_writer_at
from .format import ADAPTER, FORMAT_VERSION, INLINE_HASH_BYTES, DCPAdapter, item_path, metadata_json, open_store, store_location

__all__ = ["StoreWriter"]

#: (store location, leaf path) -> (plain token, shard hashes) of the tensors this process saved
_REUSED: dict[tuple[str, str], tuple[tuple, list[bytes]]] = {}


def _whole(item: WriteItem) -> bool:
    td = item.tensor_data
    if item.type == WriteItemType.TENSOR or td is None:
        return True
    return all(o == 0 for o in td.chunk.offsets) and tuple(td.chunk.sizes) == tuple(td.size)



@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank in ``SavePlan.storage_data``."""

    rank: int
    paths: dict  # {MetadataIndex: leaf path} of this rank's items
    known: frozenset  # {(digest, length)} the store holds for this rank's items
    shard_bytes: int
    compression_level: int
    pack_bytes: int


class StoreWriter(StorageWriter):
    """DCP ``StorageWriter`` that commits one ``dcp.save`` as one ckptstore commit.

    Args:
        store: the store, or its location (the coordinator opens and, if missing,
            creates it; the other ranks only write packs to it): a folder every rank
            sees, or ``"s3://bucket/prefix"`` (every rank uploads its own packs; no
            shared filesystem; the coordinator's cache is under its ``XDG_CACHE_HOME``).
        tag: the tag the commit moves (its current commit becomes the parent);
            ``dcp.save(checkpoint_id=...)`` overrides it.
        message: the commit message.
        metadata: the commit's metadata (a dict of JSON values).
        tags: more tags to move to the same commit.
        workers: threads per rank for hashing, compression and writes (default: the CPUs
            divided among the ranks on this machine, ``LOCAL_WORLD_SIZE`` or the world size).
        reuse_hashes: a rank skips rehashing a tensor it saved to this store before in
            this process when its fingerprint (storage, address, layout, version
            counter) is unchanged, checking a random sample of its shards as
            ``Store(reuse_hashes=)`` does (docs/performance.md); ``False`` hashes every byte.

    After ``dcp.save`` returns, the coordinator's writer holds the
    :class:`~ckptstore.CommitInfo` in :attr:`commit_info` (``None`` on other ranks).

    Raises (at construction): InvalidNameError for a bad tag; InvalidArgumentError for
    a bad message or metadata; UnsupportedTypeError for metadata that is not JSON.
    During ``dcp.save`` (wrapped by DCP in a ``CheckpointException`` naming the rank):
    UnsupportedTypeError for a non-tensor value that is not JSON (naming its fqn);
    StoreWriteError for a store that cannot be written, or for a blob of the save
    that a GC removed during it; BackendError when object storage failed (after its
    retries); RefBusyError when the tags kept moving (object storage); InvalidArgumentError
    for DCP's ``enable_plan_caching`` (unsupported).
    """

    def __init__(
        self,
        store: Store | str | os.PathLike,
        tag: str | None = None,
        *,
        message: str = "",
        metadata: dict | None = None,
        tags: Sequence[str] = (),
        workers: int | None = None,
        reuse_hashes: bool = True,
    ):
        if not isinstance(store, (Store, str, os.PathLike)):
            raise InvalidArgumentError(f"store must be a ckptstore.Store or a path, got {type(store).__name__}")
        if isinstance(tags, str):
            tags = [tags]
        self.tags = list(dict.fromkeys(check_tag(t) for t in ([tag] if tag is not None else []) + list(tags)))
        metadata = check_message(message, metadata)
        self.store = store
        self.message = message
        self.metadata = metadata
        self.workers = workers
        self.reuse_hashes = reuse_hashes
        self.commit_info: CommitInfo | None = None
        self._clear()

    def _clear(self) -> None:
        self._coordinator = False
        self._rank: int | None = None
        self._opened: Store | None = None
        self._prior: dict[tuple[bytes, int], int] = {}
        self._writer: PackWriter | None = None
        self._release = None

    def __getstate__(self) -> dict:  # DCP's process-based async_save sends the writer to another process
        state = dict(self.__dict__)
        state.update(store=store_location(self.store), _opened=None, _writer=None, _release=None)
        return state

    # StorageWriter interface

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.release()
        if checkpoint_id is not None:
            self.tags = [check_tag(str(checkpoint_id))]
        self.commit_info = None
        self._clear()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked automatically: a store is named by constructing a StoreWriter

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.tags[0] if self.tags else None)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = is_coordinator
        self._rank = kwargs.get("rank")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: open the store and tell each rank the settings and the addresses it holds."""
        if any(not p.usable for p in plans):
            raise InvalidArgumentError("StoreWriter does not support DCP's enable_plan_caching: every save must send its plan")
        store = self._opened = open_store(self.store, create=True)
        store.prepare_shared_commit()  # the store exists before any rank writes a pack to it; its index is current
        chunks = Counter(i.index.fqn for p in plans for i in p.items if i.type != WriteItemType.BYTE_IO)
        paths = [{i.index: item_path(i.index.fqn, i.index.offset, chunks[i.index.fqn] <= 1 and _whole(i)) for i in p.items} for p in plans]
        refs = []
        for t in self.tags:
            try:
                refs.append(store.resolve(t))  # on object storage: read now, its record copied into the cache
            except (RefNotFoundError, IntegrityError):
                pass  # a new tag, or one whose commit cannot be read: nothing to dedup against
        newest = store.newest_commit(ADAPTER)
        if newest is not None:
            refs.append(newest)
        hints = store.leaf_blobs(refs, [q for ps in paths for q in ps.values()]) if refs else {}
        out = []
        for rank, (p, ps) in enumerate(zip(plans, paths)):
            known: dict[tuple[bytes, int], int] = {}
            for q in ps.values():
                known.update(hints.get(q, {}))
            self._prior.update(known)
            info = _RankPlan(rank, ps, frozenset(known), store.shard_bytes, store.compression_level, store.pack_bytes)
            out.append(replace(p, storage_data=info))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Every rank: hash the items, write the shards the store lacks to this rank's packs
        (durable before returning); no catalog access."""
        info = plan.storage_data
        if not isinstance(info, _RankPlan):
            raise InvalidArgumentError("the save plan was not prepared by StoreWriter.prepare_global_plan (was another storage writer's plan used?)")
        results: list[WriteResult] = []
        values = {}
        raw = {}  # raw bytes items (DCP's io.BytesIO, bytes, bytearray): stored as uint8 blobs
        for item in plan.items:  # every non-tensor value is checked before any blob is written
            if item.type == WriteItemType.BYTE_IO:
                value = _lookup_object(planner, item)
                if type(value) in RAW_BYTES:
                    leaves, forms = raw_leaves({"": value}, "")
                    raw[item.index] = (leaves[""], forms[""])
                else:
                    values[item.index] = jsonvalue.dumps(value, item.index.fqn)
        root = store_location(self.store)
        for k in [k for k, (token, _) in _REUSED.items() if token[0].ref() is None]:
            del _REUSED[k]  # tensors freed since
        writer = self._writer = pack_writer_at(root, info.compression_level, info.pack_bytes)
        self._release = weakref.finalize(self, writer.close)
        seen: dict[tuple[bytes, int], BlobLoc | None] = dict.fromkeys(info.known)
        tensors = []
        for item in plan.items:
            path = info.paths[item.index]
            if item.index in values:
                text = values[item.index]
                data = {"path": path, "kind": "json", "value": text}
                results.append(WriteResult(index=item.index, size_in_bytes=len(text.encode()), storage_data=data))
                continue
            t = raw[item.index][0] if item.index in raw else planner.resolve_data(item)
            if not isinstance(t, torch.Tensor):
                raise UnsupportedTypeError(f"{item.index.fqn}: the planner resolved a tensor item to a {type(t).__name__}")
            t = t.detach()
            phys, stride = physical(t, item.index.fqn)
            p = shard_plan(tuple(phys.shape), t.dtype, info.shard_bytes)
            mv = tensor_bytes(phys, item.index.fqn)
            data = {
                "path": path, "kind": "tensor", "dtype": dtype_name(t.dtype, item.index.fqn), "shape": list(t.shape),
                "stride": stride, "nbytes": p.nbytes, "shard_bytes": p.shard_bytes, "keys": [], "locs": {}, "packs": {},
            }
            if item.index in raw:
                data["raw"] = raw[item.index][1]
            views = [mv[slice(*p.bounds(s))] for s in range(p.count)]
            token = plain_token(t) if self.reuse_hashes and item.index not in raw else None
            cached = _REUSED.get((root, path)) if token is not None else None
            known = None
            if cached is not None and cached[0] == token and len(cached[1]) == p.count and sample_unchanged(cached[1], mv, p, path):
                known = cached[1]
            tensors.append((data, views, known, token))
            results.append(WriteResult(index=item.index, size_in_bytes=p.nbytes, storage_data=data))
        flat = [v for _, views, known, _ in tensors if known is None for v in views]
        workers = self.workers or _rank_workers()
        big = sum(len(v) for v in flat) > INLINE_HASH_BYTES and workers > 1
        with ThreadPoolExecutor(workers) if big else _Inline() as pool:
            fresh = iter(_chunked(pool, digest, flat, workers) if big else [digest(v) for v in flat])
            todo = []
            for data, views, known, token in tensors:
                digests = known or [next(fresh) for _ in views]
                if known is not None and any((d, len(v)) not in seen and digest(v) != d for d, v in zip(known, views)):
                    digests = [digest(v) for v in views]  # a shard to write that the sample did not check changed
                for d, v in zip(digests, views):
                    key = (d, len(v))
                    data["keys"].append(key)
                    if key not in seen:
                        seen[key] = None
                        todo.append((data, key, v))
                if token is not None:
                    _REUSED[(root, data["path"])] = (token, digests)
            locs = list(pool.map(lambda job: writer.append(job[2], job[1][0]), todo))
        writer.finish()  # durable under its final names before this rank reports back
        for (data, key, _), loc in zip(todo, locs):
            if loc.digest != key[0]:  # the writer hashes what it writes (invariant 14): the tensor changed since it was hashed
                raise StoreWriteError(
                    f"{data['path']}: shard {address(*key)} changed while this rank saved it (another thread wrote the tensor "
                    "during dcp.save); a DCP save needs its state unchanged until save returns. Nothing was committed "
                    "(its packs are orphans GC removes)"
                )
        sizes = dict(writer.pack_ids)
        for (data, key, _), loc in zip(todo, locs):
            data["locs"][key] = (loc.pack, loc.offset, loc.stored_len, loc.codec)
            data["packs"][loc.pack] = sizes[loc.pack]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: check every rank's reported packs are in the store at their sizes, then
        commit every rank's items through the store's own commit protocol (``Store.commit_manifest``:
        locally one catalog transaction; on object storage record put, GC-mark re-check of every
        pack relied on, tag compare-and-swap, reflog) and move the tags.

        Raises:
            StoreWriteError: a reported pack is missing or of another size, or a blob of the
                save was removed by a GC during it.
            RefBusyError: (object storage) the tags kept moving.
            BackendError: (object storage) the storage failed after retries.
        """
        import time

        t0 = time.perf_counter()
        store = self._opened = self._opened if self._opened is not None else open_store(self.store, create=True)
        order = {fqn: i for i, fqn in enumerate(metadata.state_dict_metadata)}
        ranks: dict[str, int] = {}
        items = []
        for rank, rank_results in enumerate(results):
            for r in rank_results:
                data = r.storage_data
                if not isinstance(data, dict) or data.get("kind") not in ("tensor", "json"):
                    raise InvalidArgumentError(f"rank {rank}: write result {r.index.fqn} was not made by StoreWriter.write_data")
                items.append((order.get(r.index.fqn, len(order)), tuple(r.index.offset or ()), r.index.fqn, data))
                ranks[data["path"]] = rank
        items.sort(key=lambda x: x[:3])
        leaves: list[LeafRecord] = []
        keys: list[tuple[bytes, int]] = []
        given: dict[tuple[bytes, int], BlobLoc] = {}
        packs: dict[str, int] = {}
        for _, _, _, data in items:
            if data["kind"] == "json":
                leaves.append(LeafRecord(data["path"], "", "json", None, None, 0, None, data["value"]))
                continue
            stride = None if data["stride"] is None else tuple(data["stride"])
            leaves.append(LeafRecord(data["path"], "", "tensor", data["dtype"], tuple(data["shape"]), data["nbytes"], data["shard_bytes"], None, stride))
            keys += data["keys"]
            for key, (pack, offset, stored_len, codec) in data["locs"].items():
                given.setdefault(key, BlobLoc(key[0], key[1], pack, offset, stored_len, codec))
            packs.update(data["packs"])
        for pack, size in packs.items():  # written by ranks that reported back: durable (and, in a folder, still locked by them)
            held = store.pack_size(pack)
            if held is None:
                raise StoreWriteError(f"pack {pack}.pack written by a rank of this save is not in {store.location}")
            if held != size:
                raise StoreWriteError(f"pack {pack}.pack written by a rank of this save holds {held} bytes, the rank wrote {size}")
        raw = {data["path"]: data["raw"] for _, _, _, data in items if "raw" in data}
        meta = {"dcp": FORMAT_VERSION, **metadata_json(metadata, ranks, raw)}
        component = Captured("", ADAPTER, DCPAdapter.version, {**meta, ESCAPED: True, **({RAW: raw} if raw else {})}, {})

        def write(writer: PackWriter, key: tuple[bytes, int]) -> BlobLoc:
            raise StoreWriteError(
                f"blob {address(*key)} of this DCP save was neither written by a rank nor found in {store.location}: a GC removed it "
                "during the save (a grace period shorter than the save?); save again"
            )

        message = self.message or f"dcp.save from {len(results)} rank(s)"
        self.commit_info, _ = store.commit_manifest(
            [component], leaves, keys, write, self.tags, message, self.metadata, None, t0, prior=self._prior,
            written=(given, list(packs.items())),
        )
        self.release()

    def release(self) -> None:
        """Unlock this rank's packs (called by ``reset``, after ``finish``, and when the
        writer is garbage collected); until then a local GC does not take them for orphans.
        Closes the store the coordinator opened from a path, and a rank's S3 client."""
        if self._release is not None:
            self._release()
        if self._opened is not None and not isinstance(self.store, Store):
            self._opened.close()
        self._writer = self._release = None
        self._opened = None


def _rank_workers() -> int:
    """Threads per rank by default: this machine's CPUs shared by the ranks on it
    (``LOCAL_WORLD_SIZE`` from torchrun, else every rank of the group)."""
    ranks = os.environ.get("LOCAL_WORLD_SIZE")
    if ranks is None:
        import torch.distributed as dist

        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return max(1, (os.cpu_count() or 1) // max(1, int(ranks)))


def _chunked(pool: ThreadPoolExecutor, fn, items: list, workers: int) -> list:
    """``[fn(x) for x in items]`` in a few tasks per thread (a task per shard costs more in locking than hashing it)."""
    size = -(-len(items) // (4 * workers))
    parts = pool.map(lambda i: [fn(x) for x in items[i : i + size]], range(0, len(items), size))
    return [y for part in parts for y in part]


class _Inline:
    """A stand-in for a thread pool that runs everything in the calling thread."""

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc) -> None:
        pass

    @staticmethod
    def map(fn, items):
        return [fn(x) for x in items]


def _lookup_object(planner: SavePlanner, item: WriteItem) -> Any:
    """The Python value of a non-tensor item, without ``resolve_data`` (which ``torch.save`` s it)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is not None:
        return lookup(item.index)
    state = getattr(planner, "state_dict", None)
    if isinstance(state, dict) and item.index.fqn in state:
        return state[item.index.fqn]
    raise UnsupportedTypeError(
        f"{item.index.fqn}: the save planner {type(planner).__name__} gives no access to non-tensor values "
        "(lookup_object or state_dict); StoreWriter stores them as JSON, never pickled"
    )

