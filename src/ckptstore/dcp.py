"""ckptstore as the storage layer of ``torch.distributed.checkpoint`` (DCP).

>>> import torch.distributed.checkpoint as dcp
>>> from ckptstore.dcp import StoreWriter, StoreReader
>>> dcp.save(state_dict, storage_writer=StoreWriter("runs/store", tag="step-100"))      # every rank
>>> dcp.async_save(state_dict, storage_writer=StoreWriter("runs/store", tag="step-200"))  # a future
>>> dcp.load(state_dict, storage_reader=StoreReader("runs/store", "step-100"))          # every rank
>>> dcp.save(state_dict, storage_writer=StoreWriter("s3://bucket/prefix", tag="step-300"))  # a store on object storage

DCP plans which rank writes which bytes; ckptstore stores them. One ``dcp.save`` is
one ordinary commit (docs/distributed.md has the whole story):

1. **Plan** (coordinator, ``prepare_global_plan``): opens the store (creating it:
   on object storage ``ckptstore.json``, and its cache's index brought up to date), and
   sends each rank, inside DCP's own plan, the store's shard settings and the
   addresses the store already holds for that rank's items: the shards of the same
   leaves in the commits the tags point to and in the newest DCP commit.
2. **Write** (every rank, ``write_data``): cuts each write item into the store's
   row-aligned shards, hashes them (XXH3-128), and appends only the shards that are
   neither known nor already written by this rank to packs of its own, made durable
   before the rank reports back (:func:`ckptstore.store.pack_writer_at`): in a folder
   fsync, rename, fsync, the rank holding its packs' locks until its writer is released
   (after ``dcp.save`` returns), so GC never takes them for orphans meanwhile; on
   object storage each pack is uploaded whole by the rank itself (create-only PUTs, in
   parallel), then its ``.idx``. Raw bytes items (``io.BytesIO``, ``bytes``, ``bytearray``)
   are stored as uint8 tensors, so as blobs; other non-tensor values are encoded as the
   store's type-preserving JSON (refused, naming the key, otherwise). No catalog or cache access.
3. **Commit** (coordinator, ``finish``): checks every reported pack is in the store at
   its size, then commits through ``Store.commit_manifest``, the store's own commit
   protocol: locally one catalog transaction indexes every rank's new blobs, rechecks
   the reused ones, writes the commit (one component ``""`` stored by adapter ``dcp``
   whose meta is the DCP metadata as JSON, one leaf per item) and moves the tags; on
   object storage the record is put, every pack relied on is rechecked against the GC
   marks, then each tag moves by compare-and-swap and a reflog object is written.

A rank or coordinator killed before step 3 leaves no commit and no tag move, only
orphan packs that GC removes after its grace period.

Layout of a DCP commit: every item of the (flattened) state dict is a leaf at
``layout.escape(fqn)`` (one path segment, so ``Store.checkout(ref)`` returns a
TensorDict keyed by the fqns as given); a chunk of a sharded tensor (``DTensor``,
``ShardedTensor``) that does not cover the whole tensor is a leaf at
``escape(fqn)/<offsets joined by ",">``. Reading never unpickles: the metadata is
rebuilt from the verified commit record, and the only bytes handed to DCP's planner
(``load_bytes``) are ``torch.save`` d by this module from values decoded from JSON.
"""

from __future__ import annotations

import io
import os
import weakref
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import jsonvalue
from .adapters.base import RAW, RAW_BYTES, REGISTRY, Adapter, Captured, ComponentState, Registry, capture, plain_token, raw_leaves, register_adapter
from .errors import (
    IntegrityError,
    InvalidArgumentError,
    NotAStoreError,
    RefNotFoundError,
    StoreWriteError,
    TargetMismatchError,
    UnsupportedTypeError,
)
from .layout import ShardPlan, address, digest, escape, sample_unchanged
from .packs import BlobLoc, PackWriter
from .records import ESCAPED, LeafRecord, check_message, check_tag
from .shards import DTYPES, byte_view, dense_order, dtype_name, physical, tensor_bytes
from .shards import plan as shard_plan
from .store import CommitInfo, Store, pack_writer_at

__all__ = ["ADAPTER", "AdapterState", "DCPAdapter", "StoreReader", "StoreWriter", "item_path"]

#: The adapter name stamped on the one component of a DCP commit.
ADAPTER = "dcp"
#: Version of the JSON form of DCP metadata this module writes (component meta ``"dcp"``).
FORMAT_VERSION = 1
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "channels_last_3d": torch.channels_last_3d, "preserve_format": torch.preserve_format}
_INLINE_HASH_BYTES = 4 << 20
#: (store location, leaf path) -> (plain token, shard hashes) of the tensors this process saved
_REUSED: dict[tuple[str, str], tuple[tuple, list[bytes]]] = {}


@register_adapter
class DCPAdapter(Adapter):
    """The component of a commit made by :class:`StoreWriter`: its leaves are the
    state dict's items, its meta the DCP metadata. Read it with :class:`StoreReader`
    (``dcp.load``) or as a TensorDict (``Store.checkout(ref)``); ``checkout(into=...)``
    is refused (DCP's planner, not an adapter, knows where each chunk goes)."""

    name = ADAPTER
    version = 1

    def check(self, obj: Any, state: ComponentState) -> None:
        raise TargetMismatchError(
            f"{state.where('')}: a torch.distributed.checkpoint commit; load it with "
            "dcp.load(state_dict, storage_reader=ckptstore.dcp.StoreReader(store, ref)) or read it with store.checkout(ref)"
        )


def item_path(fqn: str, offsets: Sequence[int] | None = None, whole: bool = True) -> str:
    """The leaf path of one DCP item: ``escape(fqn)`` for a value or a whole tensor,
    ``escape(fqn)/<offsets>`` (``"0,128"``) for a chunk of a sharded tensor."""
    if whole or offsets is None:
        return escape(fqn)
    return f"{escape(fqn)}/{','.join(str(int(o)) for o in offsets) or '%'}"


def _whole(item: WriteItem) -> bool:
    td = item.tensor_data
    if item.type == WriteItemType.TENSOR or td is None:
        return True
    return all(o == 0 for o in td.chunk.offsets) and tuple(td.chunk.sizes) == tuple(td.size)


def _open(store: Store | str | os.PathLike, create: bool) -> Store:
    """``store``, or the store at that location (made if missing and ``create``).

    Raises:
        NotAStoreError: no store there; a folder holding other files (a folder of DCP
            checkpoints) is refused with what to pass instead.
    """
    if isinstance(store, Store):
        return store
    if isinstance(store, (str, os.PathLike)):
        try:
            return Store(store, create=create)
        except NotAStoreError as exc:
            folder = Path(store)
            if "://" in str(store) or not folder.is_dir() or (folder / "catalog.sqlite").exists() or not any(folder.iterdir()):
                raise
            raise NotAStoreError(
                f"{exc}. A store keeps its commits in a folder of its own (a DCP save is a commit in it, not a "
                f"folder of files), so it is not made among other files: pass a new or empty folder, e.g. "
                f"{folder / 'store'} inside your checkpoint folder, to StoreWriter and StoreReader (docs/distributed.md)"
            ) from None
    raise InvalidArgumentError(f"store must be a ckptstore.Store or a path, got {type(store).__name__}")


def _location(store: Store | str | os.PathLike) -> str:
    """Where ``store`` lives: its folder or its ``s3://`` URL (a URL is not a path: ``Path`` would fold its ``//``)."""
    if isinstance(store, Store):
        return store.location
    return store if isinstance(store, str) and "://" in store else str(Path(store))


# --- writing ------------------------------------------------------------------------------------


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
        state.update(store=_location(self.store), _opened=None, _writer=None, _release=None)
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
        store = self._opened = _open(self.store, create=True)
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
        root = _location(self.store)
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
        big = sum(len(v) for v in flat) > _INLINE_HASH_BYTES and workers > 1
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
        store = self._opened = self._opened if self._opened is not None else _open(self.store, create=True)
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
        meta = {"dcp": FORMAT_VERSION, **_metadata_json(metadata, ranks, raw)}
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


def _metadata_json(metadata: Metadata, ranks: dict[str, int], raw: dict[str, str]) -> dict:
    """DCP metadata as JSON values (see docs/distributed.md, "What is stored"); ``raw``:
    ``{leaf path: "io.BytesIO" | "bytes" | "bytearray"}`` of the raw bytes items."""
    items = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            path = item_path(fqn)
            items[fqn] = {"bytes": path, "rank": ranks.get(path), **({"raw": raw[path]} if path in raw else {})}
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise UnsupportedTypeError(f"{fqn}: unknown DCP storage metadata {type(md).__name__}")
        p = md.properties
        whole = len(md.chunks) == 1 and all(o == 0 for o in md.chunks[0].offsets) and tuple(md.chunks[0].sizes) == tuple(md.size)
        chunks = []
        for c in md.chunks:
            path = item_path(fqn, c.offsets, whole)
            chunks.append([list(c.offsets), list(c.sizes), path, ranks.get(path)])
        mem = next((k for k, v in _MEMORY_FORMATS.items() if v == p.memory_format), "contiguous_format")
        items[fqn] = {
            "dtype": dtype_name(p.dtype, fqn), "size": list(md.size), "requires_grad": bool(p.requires_grad),
            "memory_format": mem, "pin_memory": bool(p.pin_memory), "chunks": chunks,
        }
    try:
        jsonvalue.encode(metadata.planner_data, "planner_data")
    except UnsupportedTypeError as exc:
        raise UnsupportedTypeError(f"the save planner's planner_data is not JSON and would need pickle: {exc}") from None
    return {"items": items, "planner_data": metadata.planner_data, "version": metadata.version}


# --- reading ------------------------------------------------------------------------------------


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise IntegrityError(f"{where}: malformed DCP metadata ({what})")


def _ints(v: Any) -> bool:
    return type(v) is list and all(type(x) is int and x >= 0 for x in v)


def metadata_from_json(meta: dict, leaves: dict[str, LeafRecord], where: str) -> tuple[Metadata, dict[MetadataIndex, str]]:
    """Rebuild DCP ``Metadata`` from a DCP commit's component meta, checking it against the
    commit's leaves; returns it and ``{MetadataIndex: leaf path}``.

    Raises:
        IntegrityError: malformed metadata, or a chunk whose leaf is missing or differs.
    """
    _need(type(meta) is dict and meta.get("dcp") == FORMAT_VERSION, where, f"unknown format {meta.get('dcp') if type(meta) is dict else meta!r}")
    items = meta.get("items")
    _need(type(items) is dict, where, "no items")
    sd_md: dict[str, Any] = {}
    paths: dict[MetadataIndex, str] = {}
    for fqn, e in items.items():
        _need(type(fqn) is str and type(e) is dict, where, "bad item")
        if "bytes" in e:
            leaf = leaves.get(e["bytes"])
            if "raw" in e:  # raw bytes: a 1-d uint8 tensor leaf
                _need(e["raw"] in RAW_BYTES.values() and leaf is not None and leaf.kind == "tensor" and leaf.dtype == "uint8"
                      and leaf.shape is not None and len(leaf.shape) == 1 and leaf.stride is None, where, f"{fqn}: no raw bytes leaf")
            else:
                _need(leaf is not None and leaf.kind == "json", where, f"{fqn}: no JSON leaf")
            _need(e["bytes"] == item_path(fqn), where, f"{fqn}: leaf path")
            sd_md[fqn] = BytesStorageMetadata()
            paths[MetadataIndex(fqn)] = e["bytes"]
            continue
        _need(set(e) == {"dtype", "size", "requires_grad", "memory_format", "pin_memory", "chunks"}, where, f"{fqn}: fields")
        dtype = DTYPES.get(e["dtype"]) if type(e["dtype"]) is str else None
        _need(dtype is not None, where, f"{fqn}: dtype {e['dtype']!r}")
        _need(_ints(e["size"]) and type(e["chunks"]) is list and e["memory_format"] in _MEMORY_FORMATS, where, f"{fqn}: size or chunks")
        _need(type(e["requires_grad"]) is bool and type(e["pin_memory"]) is bool, where, f"{fqn}: flags")
        size = e["size"]
        chunks = []
        for c in e["chunks"]:
            _need(type(c) is list and len(c) == 4 and _ints(c[0]) and _ints(c[1]) and type(c[2]) is str, where, f"{fqn}: chunk")
            offsets, sizes, path = c[0], c[1], c[2]
            _need(len(offsets) == len(sizes) == len(size) and all(o + s <= n for o, s, n in zip(offsets, sizes, size)), where, f"{fqn}: chunk bounds")
            whole = offsets == [0] * len(size) and sizes == size and len(e["chunks"]) == 1
            leaf = leaves.get(path)
            _need(path == item_path(fqn, offsets, whole), where, f"{fqn}: chunk path {path!r}")
            if leaf is None or leaf.kind != "tensor" or list(leaf.shape) != sizes or leaf.dtype != e["dtype"]:
                raise IntegrityError(f"{where}: DCP item {fqn} chunk {offsets}: leaf {path!r} is missing or differs from the metadata")
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            paths[MetadataIndex(fqn, offsets)] = path
        props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=e["requires_grad"],
                                 memory_format=_MEMORY_FORMATS[e["memory_format"]], pin_memory=e["pin_memory"])
        sd_md[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)
    version = meta.get("version")
    _need(version is None or type(version) is str, where, "version")
    md = Metadata(state_dict_metadata=sd_md, planner_data=meta.get("planner_data"), storage_data=dict(paths))
    if version is not None:
        md.version = version
    return md, paths


@dataclass(frozen=True)
class _ReadPlan:
    """What the coordinator tells each rank in ``LoadPlan.storage_data``."""

    commit_id: str
    world: int  # the ranks the plan was made for
    owners: dict  # {(digest, length): group rank} of the blobs several ranks need: the one rank that reads each


def _rows(leaf: LeafRecord, items: list) -> tuple[int | None, int, int]:
    """The bytes ``[lo, hi)`` of ``leaf`` that ``items`` (DCP read items) overlap, and its
    row size in bytes (``None``: 0-d, empty or permuted, read whole)."""
    shape = tuple(leaf.shape)
    row = leaf.nbytes // shape[0] if shape and shape[0] and leaf.stride is None else None
    if row is None:
        return None, 0, leaf.nbytes
    lo = min(item.storage_offsets[0] for item in items) * row
    hi = max(item.storage_offsets[0] + item.lengths[0] for item in items) * row
    return row, lo, hi


def _shards(leaf: LeafRecord, lo: int, hi: int) -> range:
    """The indices of the shards of ``leaf`` that hold its bytes ``[lo, hi)``."""
    if not leaf.nbytes:
        return range(0)
    sb = ShardPlan(leaf.nbytes, leaf.shard_bytes).shard_bytes
    return range(lo // sb, max(lo, hi - 1) // sb + 1)


class StoreReader(StorageReader):
    """DCP ``StorageReader`` that loads a DCP commit of a ckptstore store.

    Args:
        store: the store or its location, a folder or ``"s3://bucket/prefix"`` (every
            rank opens it for reading; on object storage with its own cache, reading
            only the blobs its plan needs with ranged GETs).
        ref: a tag, a commit id or a unique prefix; resolved once, here, so a tag
            moved during the load does not change what is read.
        verify: rehash every blob read (default on).
        restore_once: a blob that several ranks' load plans need (a replicated tensor
            under data parallelism) is read from the store by one of them, verified there,
            and broadcast over ``process_group`` to the others, so one load reads each
            blob of the commit at most once whatever the world size (the coordinator
            gives each rank a contiguous run of about equal bytes, so each reads few long ranges). ``False``: every rank reads
            all it needs itself. Off without an initialized process group. The shared
            blobs are held in memory (CPU, or the current CUDA device for NCCL) until
            the load ends: at most the commit's replicated bytes per rank.
        process_group: the group given to ``dcp.load`` (default: the default group).

    :attr:`blobs_read` and :attr:`bytes_read` count what this rank read from packs,
    :attr:`blobs_received` and :attr:`bytes_received` what it received from other ranks.

    Raises (at construction): NotAStoreError, RefNotFoundError, AmbiguousRefError;
    InvalidArgumentError when the commit was not made by :class:`StoreWriter`;
    IntegrityError for a damaged record or metadata. During ``dcp.load``:
    IntegrityError (BlobMissingError, BlobCorruptError) naming the leaf and blob; on the
    other ranks, when a rank failed to read the blobs it reads for them, IntegrityError
    naming that rank (no rank waits forever on a broadcast that will not come).
    """

    def __init__(self, store: Store | str | os.PathLike, ref: str, *, verify: bool = True, restore_once: bool = True,
                 process_group: Any = None):
        self.store = _open(store, create=False)
        self.verify = verify
        self.restore_once = restore_once
        self.process_group = process_group
        self.blobs_read = self.bytes_read = self.blobs_received = self.bytes_received = 0
        self._reader = None
        self._load(ref)

    def _load(self, ref: str) -> None:
        self.commit_id = cid = self.store.resolve(ref)
        record = self.store.record(cid)
        comp = record.components.get("")
        if comp is None or comp["adapter"] != ADAPTER:
            raise InvalidArgumentError(
                f"commit {cid[:12]} ({ref!r}) was not made by torch.distributed.checkpoint through StoreWriter; read it with Store.checkout"
            )
        self._leaves = {r.path: r for r in record.leaves}
        self._metadata, self._paths = metadata_from_json(comp["meta"], self._leaves, f"commit {cid}")
        self._raw = {e["bytes"]: e["raw"] for e in comp["meta"]["items"].values() if "raw" in e}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self._load(str(checkpoint_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def read_metadata(self) -> Metadata:
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def _by_path(self, items: list) -> dict[str, list]:
        by_path: dict[str, list] = {}
        for item in items:
            path = self._paths.get(item.storage_index)
            if path is None:
                raise IntegrityError(f"commit {self.commit_id}: DCP asked for {item.storage_index}, which the commit does not hold")
            by_path.setdefault(path, []).append(item)
        return by_path

    def _needed(self, by_path: dict[str, list]) -> list[tuple[bytes, int]]:
        """The blobs a rank whose plan reads ``by_path`` needs, in order."""
        out = []
        for path, items in by_path.items():
            leaf = self._leaves[path]
            if leaf.kind == "tensor":
                out.extend(leaf.keys[i] for i in _shards(leaf, *_rows(leaf, items)[1:]))
        return list(dict.fromkeys(out))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: every rank must read the coordinator's commit; with ``restore_once``,
        pick for each blob several ranks need the one rank that reads it: the shared blobs, in
        the commit's order, cut into one run of about equal bytes per rank (a blob whose run's
        rank does not need it goes to the needing rank with the fewest bytes so far)."""
        owners: dict[tuple[bytes, int], int] = {}
        if self.restore_once and len(plans) > 1:
            needs = [self._needed(self._by_path(p.items)) for p in plans]
            needers: dict[tuple[bytes, int], list[int]] = {}
            for rank, keys in enumerate(needs):
                for k in keys:
                    needers.setdefault(k, []).append(rank)
            load = [sum(k[1] for k in keys if len(needers[k]) == 1) for keys in needs]
            shared = [k for k, rs in needers.items() if len(rs) > 1]  # in the commit's order, which is the packs' order
            per, acc = sum(k[1] for k in shared) / len(plans), 0
            for k in shared:  # contiguous runs, one per rank: each reads few long ranges
                run = min(int(acc // per), len(plans) - 1) if per else 0
                owners[k] = run if run in needers[k] else min(needers[k], key=lambda r: (load[r], r))
                load[owners[k]] += k[1]
                acc += k[1]
        info = _ReadPlan(self.commit_id, len(plans), owners)
        return [replace(p, storage_data=info) for p in plans]

    def _group(self, info: _ReadPlan):
        """The process group to share blobs over, or ``None`` (nothing shared, or no group)."""
        import torch.distributed as dist

        if not info.owners or not dist.is_available() or not dist.is_initialized():
            return None
        if dist.get_world_size(self.process_group) != info.world:
            raise InvalidArgumentError(
                f"the load plan is for {info.world} ranks, the process group has {dist.get_world_size(self.process_group)}: "
                "give StoreReader(process_group=) the group given to dcp.load"
            )
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _exchange(self, info: _ReadPlan, group, where: str) -> dict[tuple[bytes, int], memoryview]:
        """Read the shared blobs this rank owns (verified), then broadcast each owner's blobs
        to every rank; returns ``{blob key: its bytes}`` for every shared blob."""
        import torch.distributed as dist

        me = dist.get_rank(group)
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        by_owner: dict[int, list[tuple[bytes, int]]] = {}
        for k, o in info.owners.items():
            by_owner.setdefault(o, []).append(k)
        bufs = {o: torch.empty(sum(k[1] for k in keys), dtype=torch.uint8) for o, keys in by_owner.items()}
        views: dict[tuple[bytes, int], memoryview] = {}
        for o, keys in by_owner.items():
            mv, at = byte_view(bufs[o]), 0
            for k in keys:
                views[k], at = mv[at : at + k[1]], at + k[1]
        failure: BaseException | None = None
        if me in by_owner:
            try:
                mine = by_owner[me]
                locs = self.store.locate(mine)
                missing = [k for k in mine if k not in locs]
                if missing:
                    raise IntegrityError(f"{where}: blob {address(*missing[0])} (shared by several ranks) is not in the catalog")
                self._fetch([(locs[k], views[k], f"{where}, blob {address(*k)}") for k in mine])
            except Exception as exc:  # noqa: BLE001 - every rank learns of it below, then this rank raises it
                failure = exc
        failed = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=device)
        failed[me] = failure is not None
        dist.all_reduce(failed, group=group)
        if failure is not None:
            raise failure
        if failed.any():
            ranks = [int(r) for r in torch.nonzero(failed.cpu()).flatten()]
            raise IntegrityError(f"{where}: rank(s) {ranks} could not read the blobs they read for the other ranks (see their errors)")
        for o in sorted(by_owner):
            t = bufs[o].to(device) if nccl else bufs[o]
            dist.broadcast(t, group=group, group_src=o)
            if nccl and o != me:
                bufs[o].copy_(t)
            if o != me:
                self.blobs_received += len(by_owner[o])
                self.bytes_received += bufs[o].numel()
        return views

    def _fetch(self, tasks: list[tuple[BlobLoc, memoryview, str]]) -> None:
        """Read each ``(blob, destination, where)`` from the store, verified (inside :meth:`read_data`)."""
        reader = self._reader
        reader.prefetch([t[0] for t in tasks])  # object storage: one coalesced ranged read per pack
        run = lambda task: reader.read_into(task[0], task[1], task[2], self.verify)
        workers = min(4, os.cpu_count() or 1)
        if sum(t[1].nbytes for t in tasks) > _INLINE_HASH_BYTES and workers > 1 and len(tasks) > 1:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(run, tasks))
        else:
            for task in tasks:
                run(task)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read only the shards the items of this rank's plan overlap, verified (blobs other
        ranks need too: read by one rank, received from it)."""
        info = plan.storage_data
        if not isinstance(info, _ReadPlan):
            raise InvalidArgumentError("the load plan was not prepared by StoreReader.prepare_global_plan (was another storage reader's plan used?)")
        if info.commit_id != self.commit_id:
            raise InvalidArgumentError(
                f"this rank resolved its ref to commit {self.commit_id[:12]}, the coordinator to {info.commit_id[:12]} "
                "(a tag moved between them): load by commit id"
            )
        where = f"commit {self.commit_id}"
        by_path = self._by_path(plan.items)
        group = self._group(info)
        reader = self._reader = self.store.pack_reader(sparse=True)  # ranged, coalesced reads on object storage
        try:
            shared = self._exchange(info, group, where) if group is not None else {}
            locs = self.store.locate([k for k in self._needed(by_path) if k not in shared])
            for path, path_items in by_path.items():
                leaf = self._leaves[path]
                if leaf.kind == "json":
                    for item in path_items:
                        buf = io.BytesIO()
                        torch.save(leaf.value, buf)  # bytes made here from the verified JSON value: the planner unpickles only these
                        buf.seek(0)
                        planner.load_bytes(item, buf)
                    continue
                if path in self._raw:  # raw bytes: read whole, handed to the planner as DCP's own reader does
                    buf = torch.empty(leaf.shape[0], dtype=torch.uint8)
                    self._read_tensor(leaf, locs, shared, [_WholeLeaf(leaf.shape)], _IntoBuffer(buf), where)
                    data = buf.numpy().tobytes()
                    form = self._raw[path]
                    value = data if form == "bytes" else bytearray(data) if form == "bytearray" else io.BytesIO(data)
                    for item in path_items:
                        out = io.BytesIO()
                        torch.save(value, out)  # made here from the verified blob: the planner unpickles only these
                        out.seek(0)
                        planner.load_bytes(item, out)
                    continue
                self._read_tensor(leaf, locs, shared, path_items, planner, where)
        finally:
            self._reader = None
            self.blobs_read += reader.blobs_read
            self.bytes_read += reader.bytes_read
            self.store.io.blobs_read += reader.blobs_read
            self.store.io.bytes_read += reader.bytes_read
            reader.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_tensor(self, leaf: LeafRecord, locs: dict, shared: dict, items: list, planner: LoadPlanner, where: str) -> None:
        dtype = DTYPES[leaf.dtype]
        shape = tuple(leaf.shape)
        splan = ShardPlan(leaf.nbytes, leaf.shard_bytes)

        def read(shards: range, view: memoryview, start: int) -> None:
            tasks = []
            for i in shards:
                key = leaf.keys[i]
                a, b = splan.bounds(i)
                if key in shared:  # read once by its owner, received here
                    view[a - start : b - start] = shared[key]
                    continue
                loc = locs.get(key)
                if loc is None:
                    raise IntegrityError(f"{where}, leaf {leaf.path}: shard {i} (blob {address(*key)}) is not in the catalog")
                tasks.append((loc, view[a - start : b - start], f"{where}, leaf {leaf.path}, shard {i}"))
            if tasks:
                self._fetch(tasks)

        if leaf.stride is None and len(items) == 1 and all(o == 0 for o in items[0].storage_offsets) and tuple(items[0].lengths) == shape:
            target = planner.resolve_tensor(items[0]).detach()
            if target.device.type == "cpu" and target.dtype == dtype and tuple(target.shape) == shape and target.is_contiguous():
                read(_shards(leaf, 0, leaf.nbytes), byte_view(target), 0)  # the whole chunk, straight into the destination
                planner.commit_tensor(items[0], target)
                return
        row, lo, hi = _rows(leaf, items)
        shards = _shards(leaf, lo, hi)
        start, stop = (splan.bounds(shards[0])[0], splan.bounds(shards[-1])[1]) if shards else (0, 0)
        buf = torch.empty(stop - start, dtype=torch.uint8)
        read(shards, byte_view(buf), start)
        if row is None:
            if leaf.nbytes == 0:
                src = torch.empty(shape, dtype=dtype)
            elif leaf.stride is None:
                src = buf.view(dtype).reshape(shape)
            else:
                order = dense_order(shape, leaf.stride)
                phys = buf.view(dtype).reshape([shape[d] for d in order])
                src = phys.permute([order.index(d) for d in range(len(shape))])
            base = 0
        else:
            first_row = lo // row
            rows = (hi - lo) // row
            src = buf[lo - start : hi - start].view(dtype).reshape((rows, *shape[1:]))
            base = first_row
        for item in items:
            offsets, lengths = list(item.storage_offsets), list(item.lengths)
            if len(offsets) != len(shape):
                raise IntegrityError(f"{where}, leaf {leaf.path}: DCP read item of {len(offsets)} dims for a {len(shape)}-d chunk")
            piece = src
            for d, (o, n) in enumerate(zip(offsets, lengths)):
                piece = piece.narrow(d, o - base if d == 0 else o, n)
            target = planner.resolve_tensor(item).detach()
            if tuple(target.shape) != tuple(piece.shape):
                raise IntegrityError(f"{where}, leaf {leaf.path}: DCP expects {list(target.shape)}, the stored chunk gives {list(piece.shape)}")
            target.copy_(piece)
            planner.commit_tensor(item, target)


@dataclass(frozen=True)
class _WholeLeaf:
    """A read item covering a whole 1-d leaf of ``shape`` (what ``_read_tensor`` reads of an item)."""

    shape: tuple

    @property
    def storage_offsets(self) -> tuple:
        return (0,)

    @property
    def lengths(self) -> tuple:
        return tuple(self.shape)


class _IntoBuffer:
    """The part of a ``LoadPlanner`` that ``_read_tensor`` uses, reading into ``buf``."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf

    def resolve_tensor(self, item: Any) -> torch.Tensor:
        return self.buf

    def commit_tensor(self, item: Any, tensor: torch.Tensor) -> None:
        pass


# --- objects that ckptstore has adapters for, inside a DCP state dict -----------------------------


class AdapterState:
    """Wraps any object ckptstore has an adapter for (a TorchRL replay buffer with its
    storage, writer and sampler, an :class:`~ckptstore.RNGState`, a collector...) as a
    DCP ``Stateful``, so it can go into ``dcp.save`` / ``dcp.load`` state dicts::

        dcp.save({f"rb{rank}": AdapterState(rb), "policy": policy}, storage_writer=StoreWriter(path, tag="t"))
        dcp.load({f"rb{rank}": AdapterState(rb)}, storage_reader=StoreReader(path, "t"))

    ``state_dict()`` is the adapters' state: ``"components"`` (JSON text: each
    component's path, adapter, version and meta) and one item per leaf at its path,
    tensors as they are, JSON values as JSON text (so DCP stores each as one value).
    ``load_state_dict`` restores through the adapters, checking each component against
    the object first (TargetMismatchError). DCP loads tensors in place, so the object
    must already hold tensors of the stored shapes: a replay buffer of the same
    capacity whose storage is allocated (extended once). Give each rank's own objects
    their own key (``rb{rank}``): DCP saves one copy of a key that several ranks hold.
    """

    def __init__(self, obj: Any, registry: Registry | None = None):
        self.obj = obj
        self.registry = REGISTRY if registry is None else registry

    def state_dict(self) -> dict[str, Any]:
        with torch.no_grad():
            comps = capture(self.obj, self.registry)
        out: dict[str, Any] = {"components": jsonvalue.dumps([[c.path, c.adapter, c.version, c.meta] for c in comps], "components")}
        for c in comps:
            for path, value in c.leaves.items():
                out[path or "%"] = value if isinstance(value, torch.Tensor) else jsonvalue.dumps(value, path)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from .checkout import plan_restore, restore

        text = state_dict.get("components")
        if type(text) is not str:
            raise IntegrityError("AdapterState: the loaded state has no 'components' (was it saved from an AdapterState?)")
        comps = jsonvalue.loads(text)
        states: dict[str, ComponentState] = {}
        for path, adapter, version, meta in comps:
            leaves = {}
            for key, value in state_dict.items():
                leaf = "" if key == "%" else key
                if key == "components" or not (path == "" or leaf == path or leaf.startswith(path + "/")):
                    continue
                rel = leaf[len(path) + 1 :] if path and leaf != path else ("" if leaf == path else leaf)
                leaves[rel] = value if isinstance(value, torch.Tensor) else jsonvalue.loads(value)
            states[path] = ComponentState(path, adapter, version, meta, leaves)
        info = {p: {"adapter": st.adapter, "version": st.version, "meta": st.meta} for p, st in states.items()}
        steps = plan_restore(self.obj, info, None, self.registry, "dcp")
        self.obj = restore(self.obj, steps, states, self.registry, _NoReads())


class _NoReads:
    """The blob reader of :func:`ckptstore.checkout.restore` when every tensor is already loaded."""

    def read_many(self, pairs: list, states: list | None = None) -> None:
        if pairs:
            raise IntegrityError("AdapterState: a leaf was not loaded by DCP")
