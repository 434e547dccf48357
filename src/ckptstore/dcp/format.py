"""What a ``torch.distributed.checkpoint`` save is in a store (docs/distributed.md, "What
is stored"): the adapter stamped on the one component of a DCP commit
(:class:`DCPAdapter`), the leaf path of each item (:func:`item_path`), the DCP metadata as
JSON and back (:func:`metadata_json`, :func:`metadata_from_json`), and the store a
writer or reader names (:func:`open_store`, :func:`store_location`): what the writer
(:mod:`ckptstore.dcp.write`) and the reader (:mod:`ckptstore.dcp.read`) share.
:mod:`ckptstore.dcp` is the public module and tells the whole story.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..adapters.base import RAW_BYTES, Adapter, ComponentState, register_adapter
from ..core import jsonvalue
from ..core.errors import (
    IntegrityError,
    InvalidArgumentError,
    NotAStoreError,
    TargetMismatchError,
    UnsupportedTypeError,
)
from ..core.layout import escape
from ..core.shards import DTYPES, dtype_name
from ..objects.records import LeafRecord
from ..store import Store

__all__ = ["ADAPTER", "FORMAT_VERSION", "DCPAdapter", "item_path", "metadata_from_json", "metadata_json", "open_store", "store_location"]

#: The adapter name stamped on the one component of a DCP commit.
ADAPTER = "dcp"
#: Version of the JSON form of DCP metadata this module writes (component meta ``"dcp"``).
FORMAT_VERSION = 1
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "channels_last_3d": torch.channels_last_3d, "preserve_format": torch.preserve_format}
#: Bytes: a rank hashes (writing) or reads (loading) up to this much in the calling thread, more with a thread pool.
INLINE_HASH_BYTES = 4 << 20


@register_adapter
class DCPAdapter(Adapter):
    """The component of a commit made by :class:`~ckptstore.dcp.StoreWriter`: its leaves are the
    state dict's items, its meta the DCP metadata. Read it with :class:`~ckptstore.dcp.StoreReader`
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


def open_store(store: Store | str | os.PathLike, create: bool) -> Store:
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


def store_location(store: Store | str | os.PathLike) -> str:
    """Where ``store`` lives: its folder or its ``s3://`` URL (a URL is not a path: ``Path`` would fold its ``//``)."""
    if isinstance(store, Store):
        return store.location
    return store if isinstance(store, str) and "://" in store else str(Path(store))


def metadata_json(metadata: Metadata, ranks: dict[str, int], raw: dict[str, str]) -> dict:
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
