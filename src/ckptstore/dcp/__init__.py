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
(``load_bytes``) are ``torch.save`` d by the reader from values decoded from JSON.

This module is the public import path (``from ckptstore.dcp import StoreWriter, StoreReader,
AdapterState``) and holds :class:`AdapterState`; the writer is :mod:`ckptstore.dcp.write`,
the reader :mod:`ckptstore.dcp.read`, and what both share (the adapter, the leaf paths,
the metadata as JSON) :mod:`ckptstore.dcp.format`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import jsonvalue
from ..adapters.base import REGISTRY, ComponentState, Registry, capture
from .format import ADAPTER, DCPAdapter, item_path
from .read import StoreReader
from .write import StoreWriter
from ..core.errors import IntegrityError

__all__ = ["ADAPTER", "AdapterState", "DCPAdapter", "StoreReader", "StoreWriter", "item_path"]


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
        from ..protocols.checkout import plan_restore, restore

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
    """The blob reader of :func:`ckptstore.protocols.checkout.restore` when every tensor is already loaded."""

    def read_many(self, pairs: list, states: list | None = None) -> None:
        if pairs:
            raise IntegrityError("AdapterState: a leaf was not loaded by DCP")
