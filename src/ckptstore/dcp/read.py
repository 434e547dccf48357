"""The reading side of ckptstore as DCP's storage layer: :class:`StoreReader`, the
``StorageReader`` that loads a DCP commit of a store, reading only the shards each rank's
plan overlaps, verified, and each blob several ranks need once (read by one rank, then
broadcast).
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..core.errors import IntegrityError, InvalidArgumentError
from ..core.layout import ShardPlan, address
from ..core.shards import DTYPES, byte_view, dense_order
from ..objects.packs import BlobLoc
from ..objects.records import LeafRecord
from ..store import Store
from .format import ADAPTER, INLINE_HASH_BYTES, metadata_from_json, open_store

__all__ = ["StoreReader"]

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
    InvalidArgumentError when the commit was not made by :class:`~ckptstore.dcp.StoreWriter`;
    IntegrityError for a damaged record or metadata. During ``dcp.load``:
    IntegrityError (BlobMissingError, BlobCorruptError) naming the leaf and blob; on the
    other ranks, when a rank failed to read the blobs it reads for them, IntegrityError
    naming that rank (no rank waits forever on a broadcast that will not come).
    """

    def __init__(self, store: Store | str | os.PathLike, ref: str, *, verify: bool = True, restore_once: bool = True,
                 process_group: Any = None):
        self.store = open_store(store, create=False)
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
        if sum(t[1].nbytes for t in tasks) > INLINE_HASH_BYTES and workers > 1 and len(tasks) > 1:
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

