"""Import TorchRL 0.14 checkpoints as one commit, without unpickling anything.

Two inputs are read:

- a folder written by ``ReplayBuffer.dumps(path)``;
- a ``torchrl.checkpoint.Checkpoint`` save, a folder or a ZIP archive:
  ``manifest.json`` (format ``"torchrl.checkpoint"``, version 1) and one
  ``components/<NNNN-name>/`` payload per component.

Every file is parsed here: JSON with :func:`json.loads`, tensors as raw
native (little-endian) bytes once the file is exactly ``prod(shape) *
itemsize`` bytes. Nothing is unpickled, ``torch.load``-ed or opened through
TensorDict. Symbolic links, special files and names leaving the root are
refused, and every file under a payload must be read or reported as skipped:
a file this module does not know could hold state the commit would lose.

Components written (``P`` is ``""`` for a bare dumps folder, the component
name inside a checkpoint), in the layouts the adapters' ``to_state`` produce:

=========================  ====================================================
input                      components
=========================  ====================================================
replay-buffer dumps        ``P/storage`` (``torchrl.storage.tensor``), ``P/writer``
                           (``torchrl.writer.round_robin``), ``P/sampler``
                           (``torchrl.sampler.prioritized``, ``.without_replacement``,
                           or ``.random`` when the dump has no ``sampler/`` files)
``torchrl.dump_load``      the same, for a replay buffer
``torchrl.state_dict``     ``torch.nn.Module`` (an ordered dict of tensors),
                           ``torch.optim.Optimizer`` (``state`` and ``param_groups``),
                           ``rng`` (a ``GlobalRNGState``), else ``dict`` or ``json``
``torchrl.json``           ``dict`` (a JSON object) or ``json`` (any other value)
=========================  ====================================================

Skipped and reported: a dump's ``buffer_metadata.json`` (batch size settings)
and ``prefetch.pkl`` (prefetch settings and queue, a pickle). Refused, naming
the file: ``state.pt`` (a ``torch.save`` pickle), ``transform.t``, a buffer's
own generator (``rng_state/``), ``state.tdz``/``state.tdc`` payloads, pytree
storages other than one tensor, writers other than round-robin, samplers
other than the three above, and component adapters other than the three above.

What a dump does not record, and what is assumed instead:

- a storage's ``ndim``: 1 (TorchRL's default); the capacity is dim 0;
- ``SamplerWithoutReplacement.shuffle``: ``True`` (TorchRL's default), and its
  remaining-batch count is left to the target, as TorchRL's ``loads`` does;
- a prioritized sampler's tree dtype: float32. TorchRL 0.14 writes both trees
  as float64 files holding float32 values (it builds them with
  ``torch.as_tensor`` of Python floats), so a float64 sampler's dump is
  already rounded; checking one out into a float64 sampler raises
  ShapeMismatchError rather than restoring rounded trees;
- the max priority is written as JSON numbers: restored as a float value and
  an int index.
"""

from __future__ import annotations

import json
import math
import os
import stat
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torchrl.data.replay_buffers import PrioritizedSampler, RandomSampler, RoundRobinWriter, SamplerWithoutReplacement, TensorStorage

from ..adapters.base import Captured, check_key, flatten, join, plain, unflatten
from ..adapters.rng import RNGState
from ..core import jsonvalue
from ..core.errors import CkptStoreError, ContainerError
from ..core.shards import DTYPES, byte_view
from .archive import refuse_store_files

if TYPE_CHECKING:
    from ..home.interfaces import TorchRLImportRepository
    from ..objects.records import CommitInfo

__all__ = ["ImportReport", "import_torchrl"]

MAX_JSON_BYTES = 64 << 20
_MAX_DEPTH = 64
_MANIFEST = "manifest.json"
_TD_CLASS = "<class 'tensordict._td.TensorDict'>"
_NON_TENSOR_CLASS = "<class 'tensordict.tensorclass.NonTensorData'>"
_SINGLE_TENSOR = "_-single-tensor-_"  # TorchRL's name for a storage holding one tensor
_PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".pth", ".t")
_PREFETCH_REASON = "pickle of the buffer's prefetch settings and queue, never unpickled: a restored buffer starts with an empty queue"
# tensordict's file-name encoding of keys (robust_key, the 0.14 default)
_FS_UNSAFE = frozenset('/<>:"|?*\\ \0%') | {chr(i) for i in range(32)} | {chr(127)}


@dataclass
class ImportReport:
    """What :func:`import_torchrl` read.

    Attributes:
        format: ``"torchrl.replay_buffer.dumps"``, ``"torchrl.checkpoint.directory"``
            or ``"torchrl.checkpoint.archive"``.
        components: the committed component paths, in commit order.
        skipped: ``(file, reason)`` for each settings-only file not imported;
            ``file`` is relative to the imported path.
    """

    format: str
    components: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _refuse_other_formats(source: _Source, path: Path) -> None:
    """Name the two formats people hand to import-torchrl by mistake, before parsing them as TorchRL's."""
    if source.has("ckptstore-export.json"):
        raise ContainerError(f"{path} is a ckptstore export, not a TorchRL dump or checkpoint: use `ckptstore import` (Store.import_from)")
    names = source.zip.namelist() if source.zip is not None else []
    if not source.has(_MANIFEST) and any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
        raise ContainerError(
            f"{path} is a torch.save file (a pickle), which ckptstore never unpickles; "
            "load it yourself with torch.load(..., weights_only=True) and commit the objects"
        )


def import_torchrl(
    store: TorchRLImportRepository, path: str | os.PathLike, tag: str | None = None, message: str | None = None
) -> tuple[CommitInfo, ImportReport]:
    """Import a TorchRL replay-buffer dump or checkpoint as one commit of ``store``.

    Args:
        store: the store to commit to.
        path: a ``ReplayBuffer.dumps`` folder, or a ``torchrl.checkpoint``
            folder or ZIP archive.
        tag: tag to move to the new commit.
        message: commit message (default: names the format and ``path``).

    Returns:
        The commit (metadata: ``imported_from``, ``format``, ``skipped`` and,
        for a checkpoint, ``torchrl_checkpoint``: its id, creation time,
        versions and metadata) and the :class:`ImportReport`.

    Raises:
        ContainerError: naming the file: malformed or unknown content (bad
            JSON, unknown dtype, wrong file size, missing file, unknown
            manifest format or adapter), unsafe content (symbolic links, names
            leaving the root), or state that cannot be read without
            unpickling (``state.pt``, ``transform.t``, other pickles). The
            store is unchanged.
        InvalidNameError: a bad tag name.
    """
    path = Path(path)
    refuse_store_files(path, store.root)
    source = _Source(path)
    try:
        reader = _Reader(source)
        extra: dict[str, Any] = {}
        _refuse_other_formats(source, path)
        if source.zip is not None or source.has(_MANIFEST):
            fmt = "torchrl.checkpoint." + ("archive" if source.zip is not None else "directory")
            components, extra = reader.checkpoint()
        elif source.has("storage/storage_metadata.json"):
            fmt = "torchrl.replay_buffer.dumps"
            components = reader.replay_buffer("", "")
        else:
            raise ContainerError(
                f"{path}: neither a TorchRL checkpoint (no {_MANIFEST}) nor a replay-buffer dump (no storage/storage_metadata.json)"
            )
    finally:
        source.close()
    report = ImportReport(fmt, [c.path for c in components], reader.skipped)
    metadata = {"imported_from": str(path), "format": fmt, "skipped": [list(s) for s in reader.skipped], **extra}
    info = store.commit_components(
        components, tag=tag, message=f"import {fmt} from {path}" if message is None else message, metadata=metadata
    )
    return info, report


# --- reading files ----------------------------------------------------------------------


def _safe_name(name: str, where: str) -> str:
    """A relative POSIX path without empty, ``.`` or ``..`` parts."""
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") or "\\" in p or "\x00" in p for p in parts):
        raise ContainerError(f"{where}: unsafe path {name!r} (absolute, empty, '.' or '..' parts)")
    return name


class _Source:
    """The regular files of a folder or ZIP archive, by POSIX path relative to the root.

    Opening lists every file and refuses symbolic links, special files and
    names leaving the root; reads check sizes against that listing.
    """

    def __init__(self, path: Path):
        self.path = path
        self.zip: zipfile.ZipFile | None = None
        self.sizes: dict[str, int] = {}  # relative path -> bytes
        if path.is_dir():
            self._walk()
        elif path.is_file():
            self._open_zip()
        else:
            raise ContainerError(f"{path}: no such folder or file")

    def _walk(self) -> None:
        def fail(exc: OSError) -> None:
            raise ContainerError(f"{exc.filename}: cannot be listed ({exc.strerror})")

        def lstat(full: str) -> os.stat_result:
            try:
                st = os.lstat(full)
            except OSError as exc:
                raise ContainerError(f"{full}: cannot be listed ({exc.strerror})") from None
            if stat.S_ISLNK(st.st_mode):
                raise ContainerError(f"{full}: a symbolic link; links are refused, they can point outside the checkpoint")
            return st

        for top, dirs, files in os.walk(self.path, onerror=fail):
            for name in dirs:  # os.walk lists links to folders here without entering them
                lstat(os.path.join(top, name))
            for name in files:
                full = os.path.join(top, name)
                st = lstat(full)
                if not stat.S_ISREG(st.st_mode):
                    raise ContainerError(f"{full}: not a regular file")
                self.sizes[Path(full).relative_to(self.path).as_posix()] = st.st_size

    def _open_zip(self) -> None:
        try:
            self.zip = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise ContainerError(f"{self.path}: neither a folder nor a readable ZIP archive ({exc})") from None
        for info in self.zip.infolist():
            where = self.where(info.filename)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise ContainerError(f"{where}: a symbolic link; links are refused, they can point outside the checkpoint")
            name = _safe_name(info.filename.removesuffix("/") if info.is_dir() else info.filename, where)
            if info.is_dir():
                continue
            if name in self.sizes:
                raise ContainerError(f"{where}: the archive holds this entry twice")
            self.sizes[name] = info.file_size

    def where(self, rel: str) -> str:
        return f"{self.path}/{rel}" if rel else str(self.path)

    def has(self, rel: str) -> bool:
        return rel in self.sizes

    def is_folder(self, rel: str) -> bool:
        return any(n.startswith(rel + "/") for n in self.sizes)

    def files(self, folder: str) -> list[str]:
        """The files under ``folder`` (``""``: all), sorted."""
        head = folder + "/" if folder else ""
        return sorted(n for n in self.sizes if n.startswith(head))

    def size(self, rel: str) -> int:
        if rel not in self.sizes:
            raise ContainerError(f"{self.where(rel)}: missing")
        return self.sizes[rel]

    def read_into(self, rel: str, view: memoryview) -> None:
        """Fill ``view`` with the first ``len(view)`` bytes of ``rel``."""
        size = self.size(rel)
        done = 0
        try:
            if self.zip is not None:
                f = self.zip.open(rel)
            else:
                fd = os.open(self.path / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                f = os.fdopen(fd, "rb")
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                    f.close()
                    raise ContainerError(f"{self.where(rel)}: changed while being imported")
            with f:
                while done < len(view):
                    n = f.readinto(view[done:])
                    if not n:
                        break
                    done += n
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error, RuntimeError, NotImplementedError) as exc:
            # zipfile raises RuntimeError for encrypted entries, NotImplementedError for unknown compression
            raise ContainerError(f"{self.where(rel)}: cannot be read ({exc})") from None
        if done != len(view):
            raise ContainerError(f"{self.where(rel)}: truncated, {done} of {len(view)} bytes")

    def close(self) -> None:
        if self.zip is not None:
            self.zip.close()


@dataclass(frozen=True)
class _Memmap:
    """A raw tensor file: ``rel`` holds ``prod(shape) * itemsize`` bytes in C order."""

    rel: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _NonTensor:
    """A tensordict ``NonTensorData`` leaf whose value is JSON."""

    value: Any


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise ContainerError(f"{where}: {what}")


def _count(x: Any) -> bool:
    return type(x) is int and x >= 0


def _number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def _shape(x: Any, where: str) -> tuple[int, ...]:
    _need(type(x) is list and all(_count(d) for d in x), where, f"invalid shape {x!r}")
    return tuple(x)


def _dtype(x: Any, where: str) -> torch.dtype:
    dtype = DTYPES.get(x.removeprefix("torch.")) if type(x) is str and x.startswith("torch.") else None
    _need(dtype is not None, where, f"unknown dtype {x!r}")
    return dtype


def _fs_name(key: str) -> str:
    return "".join(f"%{ord(c):02X}" if c in _FS_UNSAFE else c for c in key)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _Reader:
    """Parses the payloads of one source into components, recording what it read."""

    def __init__(self, source: _Source):
        self.src = source
        self.used: set[str] = set()
        self.skipped: list[tuple[str, str]] = []

    # --- primitives

    def json(self, rel: str) -> Any:
        where = self.src.where(rel)
        size = self.src.size(rel)
        _need(size <= MAX_JSON_BYTES, where, f"{size} bytes, over the {MAX_JSON_BYTES}-byte limit for JSON")
        buf = bytearray(size)
        self.src.read_into(rel, memoryview(buf))
        self.used.add(rel)
        try:
            return json.loads(buf.decode("utf-8"), object_pairs_hook=jsonvalue.no_duplicate_keys)
        except (ValueError, RecursionError) as exc:
            raise ContainerError(f"{where}: not valid JSON ({exc})") from None

    def tensor(self, entry: _Memmap, rows: int | None = None) -> torch.Tensor:
        """The tensor in ``entry`` (its first ``rows`` rows when given).

        Raises ContainerError unless the file is exactly ``prod(shape) * itemsize`` bytes.
        """
        where = self.src.where(entry.rel)
        nbytes = math.prod(entry.shape) * entry.dtype.itemsize
        shape = entry.shape if rows is None else (rows, *entry.shape[1:])
        if not self.src.has(entry.rel) and nbytes == 0:  # tensordict writes no file for a tensor without elements
            return torch.empty(shape, dtype=entry.dtype)
        size = self.src.size(entry.rel)
        _need(size == nbytes, where, f"{size} bytes, but {entry.dtype} {list(entry.shape)} takes {nbytes}: truncated or tampered")
        out = torch.empty(shape, dtype=entry.dtype)
        try:
            view = byte_view(out)
        except (RuntimeError, TypeError) as exc:
            raise ContainerError(f"{where}: {entry.dtype} tensors cannot be read as raw bytes ({exc})") from None
        self.src.read_into(entry.rel, view)
        self.used.add(entry.rel)
        return out

    def skip(self, rel: str, reason: str) -> None:
        self.used.add(rel)
        self.skipped.append((rel, reason))

    def check_all_read(self, folder: str) -> None:
        """Refuse files under ``folder`` that were neither read nor skipped."""
        for rel in self.src.files(folder):
            if rel in self.used:
                continue
            if rel.endswith(_PICKLE_SUFFIXES):
                raise ContainerError(f"{self.src.where(rel)}: a pickle, which may hold state; ckptstore never unpickles")
            raise ContainerError(f"{self.src.where(rel)}: a file this importer does not know; importing without it could lose state")

    def td(self, folder: str) -> tuple[tuple[int, ...], dict[str, _Memmap | _NonTensor]]:
        """A TensorDict memmap folder: its batch size and ``{"a/b": entry}`` for every leaf (keys escaped)."""
        rel = join(folder, "meta.json")
        where = self.src.where(rel)
        meta = self.json(rel)
        cls = meta.get("_type") if type(meta) is dict else type(meta).__name__
        _need(cls == _TD_CLASS, where, f"not a plain TensorDict ({cls})")
        batch = _shape(meta.get("shape"), where)
        out: dict[str, _Memmap | _NonTensor] = {}
        for key, entry in meta.items():
            if type(entry) is not dict:
                continue  # the TensorDict's own batch size, device and class
            _need(key not in ("", ".", ".."), where, f"entry {key!r} cannot be a file name")
            try:
                segment = check_key(key, folder)
            except CkptStoreError as exc:
                raise ContainerError(f"{where}: {exc}") from None
            name = join(folder, _fs_name(key))
            kind = entry.get("type")
            if kind == "TensorDict":
                sub_batch, sub = self.td(name)
                _need(sub_batch[: len(batch)] == batch, where, f"{key!r}: batch size {list(sub_batch)} does not extend {list(batch)}")
                out.update({join(segment, k): v for k, v in sub.items()})
            elif kind == "NonTensorData":
                out[segment] = self._non_tensor(name)
            elif kind is None and set(entry) == {"device", "shape", "dtype", "is_nested"} and entry["is_nested"] is False:
                shape = _shape(entry["shape"], where)
                _need(shape[: len(batch)] == batch, where, f"{key!r}: shape {list(shape)} does not extend the batch size {list(batch)}")
                out[segment] = _Memmap(name + ".memmap", _dtype(entry["dtype"], where), shape)
            else:
                what = json.dumps(entry)[:200]
                raise ContainerError(f"{where}: entry {key!r} is not a dense tensor, TensorDict or NonTensorData: {what}")
        return batch, out

    def _non_tensor(self, folder: str) -> _NonTensor:
        rel = join(folder, "meta.json")
        meta = self.json(rel)
        _need(type(meta) is dict and meta.get("_type") == _NON_TENSOR_CLASS, self.src.where(rel), "not a NonTensorData record")
        if "data" not in meta:  # tensordict pickles values JSON cannot hold
            other = [f for f in self.src.files(folder) if f != rel]
            where = self.src.where(other[0] if other else rel)
            raise ContainerError(f"{where}: non-tensor data stored as a pickle; ckptstore never unpickles")
        return _NonTensor(meta["data"])

    def component(self, path: str, adapter: str, version: int, cls: str, rel: str, tree: Any) -> Captured:
        try:
            leaves = flatten(tree, path)
        except CkptStoreError as exc:
            raise ContainerError(f"{self.src.where(rel)}: {exc}") from None
        return Captured(path, adapter, version, {"class": cls, "imported_from": rel or "."}, leaves)

    # --- replay-buffer dumps

    def replay_buffer(self, folder: str, prefix: str) -> list[Captured]:
        """``<prefix>/storage``, ``/writer`` and ``/sampler`` from a ``dumps`` folder."""
        transform = join(folder, "transform.t")
        if self.src.has(transform):
            raise ContainerError(
                f"{self.src.where(transform)}: the buffer's transform state, pickled by torch.save; ckptstore never unpickles"
            )
        rng = join(folder, "rng_state")
        if self.src.is_folder(rng):
            raise ContainerError(
                f"{self.src.where(rng)}: the buffer's own generator state; ckptstore's replay-buffer components have no place for it"
            )
        settings = join(folder, "buffer_metadata.json")
        if self.src.has(settings):
            value = self.json(settings)
            _need(type(value) is dict, self.src.where(settings), "not a JSON object")
            self.skip(settings, f"buffer settings {json.dumps(value)}, not state: ckptstore restores into a buffer built with its own")
        prefetch = join(folder, "prefetch.pkl")
        if self.src.has(prefetch):
            self.skip(prefetch, _PREFETCH_REASON)
        storage, capacity = self.storage(folder, join(prefix, "storage"))
        out = [storage, self.writer(folder, join(prefix, "writer"), capacity), self.sampler(folder, join(prefix, "sampler"))]
        self.check_all_read(folder)
        return out

    def storage(self, folder: str, path: str) -> tuple[Captured, int]:
        """The storage component and its capacity (rows)."""
        root = join(folder, "storage")
        rel = join(root, "storage_metadata.json")
        where = self.src.where(rel)
        md = self.json(rel)
        _need(type(md) is dict and set(md) == {"metadata", "is_pytree", "len"}, where, "expected exactly the keys metadata, is_pytree, len")
        length = md["len"]
        _need(_count(length), where, f"invalid len {length!r}")
        if md["is_pytree"] is True:
            meta = md["metadata"]
            _need(
                type(meta) is dict and list(meta) == [_SINGLE_TENSOR], where, "pytree storages other than a single tensor are not supported"
            )
            entry = meta[_SINGLE_TENSOR]
            _need(type(entry) is dict and set(entry) == {"dtype", "shape"}, where, f"invalid {_SINGLE_TENSOR} record")
            shape = _shape(entry["shape"], where)
            tensors: dict[str, Any] = {"": _Memmap(join(root, _SINGLE_TENSOR + ".memmap"), _dtype(entry["dtype"], where), shape)}
            layout = "tensor"
        elif md["is_pytree"] is False:
            _need(md["metadata"] == {}, where, "metadata must be empty for a TensorDict storage")
            shape, tensors = self.td(root)
            layout = "tensordict"
            for key, entry in tensors.items():
                what = f"{key!r}: non-tensor data in a tensor storage is not supported"
                _need(isinstance(entry, _Memmap), self.src.where(join(root, "meta.json")), what)
        else:
            raise ContainerError(f"{where}: is_pytree must be true or false")
        _need(len(shape) >= 1 and shape[0] >= 1, where, f"a storage needs a capacity along dim 0, got shape {list(shape)}")
        capacity = shape[0]
        # dumps do not record ndim; with ndim 1, len counts rows along dim 0
        _need(length <= capacity, where, f"len {length} exceeds the capacity {capacity}; storages with ndim > 1 are not supported")
        data = {k: self.tensor(e, rows=length) for k, e in tensors.items()}
        state = {
            "max_size": capacity, "ndim": 1, "len": length, "initialized": True, "layout": layout,
            "data": data[""] if layout == "tensor" else unflatten(data),
        }
        return self.component(path, "torchrl.storage.tensor", 1, _qualname(TensorStorage), root, state), capacity

    def writer(self, folder: str, path: str, capacity: int) -> Captured:
        rel = join(folder, "writer/metadata.json")
        where = self.src.where(rel)
        _need(self.src.has(rel), where, "missing; only round-robin writers are supported")
        md = self.json(rel)
        _need(type(md) is dict, where, "not a JSON object")
        extra = sorted(set(md) - {"cursor", "write_count", "generation_shape", "generation_dtype"})
        _need(not extra, where, f"unknown fields {extra}; only RoundRobinWriter dumps are supported")
        cursor, count = md.get("cursor"), md.get("write_count")
        _need(_count(cursor) and cursor < capacity, where, f"invalid cursor {cursor!r} for capacity {capacity}")
        _need(count is None or _count(count), where, f"invalid write_count {count!r}")
        state: dict[str, Any] = {"cursor": cursor, "write_count": count}
        if "generation_shape" in md or "generation_dtype" in md:
            dtype, shape = _dtype(md.get("generation_dtype"), where), _shape(md.get("generation_shape"), where)
            state["generation"] = self.tensor(_Memmap(join(folder, "writer/generation.memmap"), dtype, shape))
        return self.component(path, "torchrl.writer.round_robin", 2, _qualname(RoundRobinWriter), rel, state)

    def sampler(self, folder: str, path: str) -> Captured:
        root = join(folder, "sampler")
        files = self.src.files(root)
        if not files:  # RandomSampler.dumps writes nothing
            return self.component(path, "torchrl.sampler.random", 1, _qualname(RandomSampler), folder, {})
        if join(root, "sampler_metadata.json") in files:
            return self._prioritized(root, path)
        if join(root, "meta.json") in files:
            return self._without_replacement(root, path)
        raise ContainerError(f"{self.src.where(root)}: not a PrioritizedSampler or SamplerWithoutReplacement dump (files: {files[:5]})")

    def _prioritized(self, root: str, path: str) -> Captured:
        rel = join(root, "sampler_metadata.json")
        where = self.src.where(rel)
        md = self.json(rel)
        keys = {"_alpha", "_beta", "_eps", "_max_priority", "_max_capacity", "_schema_version"}
        _need(type(md) is dict and set(md) == keys, where, f"expected exactly the keys {sorted(keys)}")
        # version-less payloads may hold a transformed max priority (before TorchRL PR #3925)
        version = md["_schema_version"]
        _need(type(version) is int and version == 1, where, f"schema version {version!r} is not supported (only 1)")
        for key in ("_alpha", "_beta", "_eps"):
            _need(_number(md[key]) and md[key] >= 0, where, f"invalid {key} {md[key]!r}")
        cap = md["_max_capacity"]
        _need(_number(cap) and cap == int(cap) and cap >= 1, where, f"invalid _max_capacity {cap!r}")
        cap = int(cap)
        trees = []
        for name in ("sumtree.memmap", "mintree.memmap"):
            tree = self.tensor(_Memmap(join(root, name), torch.float64, (cap,)))
            # TorchRL writes float32 values (torch.as_tensor of Python floats) into float64 files: narrowing is exact
            _need(torch.equal(tree.float().double(), tree), self.src.where(join(root, name)), "holds values that are not float32 values")
            trees.append(tree.float())
        mp = md["_max_priority"]
        _need(type(mp) is list and len(mp) == 2, where, f"invalid _max_priority {mp!r}")
        value, index = mp
        if value is not None or index is not None:
            _need(_number(value) and _number(index) and index == int(index) and 0 <= index < cap, where, f"invalid _max_priority {mp!r}")
            value, index = float(value), int(index)
        state = {
            "alpha": float(md["_alpha"]), "beta": float(md["_beta"]), "eps": float(md["_eps"]),
            "max_capacity": cap, "dtype": "float32", "sum_tree": trees[0], "min_tree": trees[1],
            "max_priority": {"value": value, "index": index},
        }
        return self.component(path, "torchrl.sampler.prioritized", 2, _qualname(PrioritizedSampler), root, state)

    def _without_replacement(self, root: str, path: str) -> Captured:
        where = self.src.where(join(root, "meta.json"))
        batch, entries = self.td(root)
        keys = {"len_storage", "_sample_list", "drop_last", "_ran_out"}
        _need(batch == () and set(entries) == keys, where, f"expected exactly the entries {sorted(keys)} with batch size []")

        def scalar(key: str, dtype: torch.dtype) -> Any:
            entry = entries[key]
            _need(isinstance(entry, _Memmap) and entry.shape == () and entry.dtype == dtype, where, f"{key!r} must be a 0-d {dtype} tensor")
            return self.tensor(entry).item()

        length = scalar("len_storage", torch.int64)
        sample_list = entries["_sample_list"]
        if isinstance(sample_list, _NonTensor):
            _need(sample_list.value is None, where, "'_sample_list' must be a tensor or null")
            sample_list = None
        else:
            _need(len(sample_list.shape) == 1 and sample_list.dtype == torch.int64, where, "'_sample_list' must be a 1-d int64 tensor")
            sample_list = self.tensor(sample_list)
            ok = not sample_list.numel() or 0 <= int(sample_list.min()) <= int(sample_list.max()) < length
            _need(ok, self.src.where(join(root, "_sample_list.memmap")), f"indices outside [0, {length})")
        state = {
            "sample_list": sample_list, "len_storage": length,
            "drop_last": scalar("drop_last", torch.bool), "shuffle": True,  # not in the dump: TorchRL's default
            "ran_out": scalar("_ran_out", torch.bool), "remaining_batches": None,
        }
        return self.component(path, "torchrl.sampler.without_replacement", 1, _qualname(SamplerWithoutReplacement), root, state)

    # --- torchrl.checkpoint

    def checkpoint(self) -> tuple[list[Captured], dict]:
        """Every component of a checkpoint, and the manifest's provenance fields."""
        where = self.src.where(_MANIFEST)
        m = self.json(_MANIFEST)
        _need(type(m) is dict, where, "not a JSON object")
        _need(m.get("format") == "torchrl.checkpoint", where, f"format {m.get('format')!r} is not 'torchrl.checkpoint'")
        version = m.get("format_version")
        _need(type(version) is int and version == 1, where, f"format_version {version!r} is not supported (only 1)")
        comps = m.get("components")
        _need(type(comps) is dict, where, "no components mapping")
        readers = {
            "torchrl.json": self._json_component,
            "torchrl.state_dict": self._state_dict_component,
            "torchrl.dump_load": self._dump_load_component,
        }
        folders: dict[str, str] = {}
        for name, rec in comps.items():
            try:
                check_key(name, "")
            except CkptStoreError as exc:
                raise ContainerError(f"{where}: component name {exc}") from None
            _need(
                type(rec) is dict and type(rec.get("adapter")) is str and type(rec.get("adapter_version")) is int
                and type(rec.get("path")) is str and type(rec.get("files")) is list and all(type(f) is str for f in rec["files"]),
                where, f"component {name!r}: invalid record",
            )
            adapter, version = rec["adapter"], rec["adapter_version"]
            _need(adapter in readers, where, f"component {name!r} was saved by adapter {adapter!r}, which this importer does not read")
            _need(version == 1, where, f"component {name!r}: {adapter} version {version} is not supported (only 1)")
            folder = _safe_name(rec["path"], where)
            for other, owner in folders.items():
                nested = (folder + "/").startswith(other + "/") or (other + "/").startswith(folder + "/")
                _need(not nested, where, f"components {owner!r} and {name!r} share files")
            folders[folder] = name
            listed = {join(folder, _safe_name(f, where)) for f in rec["files"]}
            present = set(self.src.files(folder))
            for rel in sorted(listed - present):
                raise ContainerError(f"{self.src.where(rel)}: listed in {_MANIFEST} but missing")
            for rel in sorted(present - listed):
                raise ContainerError(f"{self.src.where(rel)}: not listed in {_MANIFEST}")
        out: list[Captured] = []
        for name in sorted(comps):
            folder = comps[name]["path"]
            out += readers[comps[name]["adapter"]](folder, name)
            self.check_all_read(folder)
        keep = ("checkpoint_id", "created_at", "versions", "metadata")
        return out, {"torchrl_checkpoint": {k: m.get(k) for k in keep}}

    def _json_component(self, folder: str, name: str) -> list[Captured]:
        rel = join(folder, "value.json")
        value = self.json(rel)
        if type(value) is dict:
            return [self.component(name, "dict", 1, "builtins.dict", rel, value)]
        return [self.component(name, "json", 1, f"builtins.{type(value).__name__}", rel, value)]

    def _dump_load_component(self, folder: str, name: str) -> list[Captured]:
        _need(self.src.has(join(folder, "storage/storage_metadata.json")), self.src.where(folder),
              "a torchrl.dump_load component that is not a replay-buffer dump (no storage/storage_metadata.json)")
        return self.replay_buffer(folder, name)

    def _state_dict_component(self, folder: str, name: str) -> list[Captured]:
        pickle = join(folder, "state.pt")
        if self.src.has(pickle):
            raise ContainerError(
                f"{self.src.where(pickle)}: a torch.save pickle (StateDictCheckpointAdapter(payload_format='torch')); "
                "ckptstore never unpickles: save the component with payload_format='directory'"
            )
        for other, what in (("state.tdz", "a TensorDict archive"), ("state.tdc", "a consolidated TensorDict")):
            rel = join(folder, other)
            if self.src.has(rel) or self.src.is_folder(rel):
                raise ContainerError(
                    f"{self.src.where(rel)}: unsupported payload format ({what}); save the component with payload_format='directory'"
                )
        rel = join(folder, "state.json")
        where = self.src.where(rel)
        schema = self.json(rel)
        batch, entries = self.td(join(folder, "state"))
        ok = batch == () and all(isinstance(e, _Memmap) for e in entries.values())
        _need(ok, self.src.where(join(folder, "state/meta.json")), "expected tensors with batch size []")
        tensors = {k: self.tensor(e) for k, e in entries.items()}
        referenced: set[str] = set()
        value = _decode(schema, tensors, referenced, where, 0)
        unused = sorted(set(tensors) - referenced)
        _need(not unused, where, f"tensors {unused[:5]} of state/meta.json are not referenced")
        return [self._state_dict_tree(name, rel, value, where)]

    def _state_dict_tree(self, name: str, rel: str, value: Any, where: str) -> Captured:
        if type(value) is OrderedDict and all(type(k) is str and isinstance(v, torch.Tensor) for k, v in value.items()):
            return self.component(name, "torch.nn.Module", 1, _qualname(torch.nn.Module), rel, dict(value))
        if type(value) is dict and set(value) == {"state", "param_groups"}:
            return self.component(name, "torch.optim.Optimizer", 1, _qualname(torch.optim.Optimizer), rel, _optimizer_tree(value, where))
        if type(value) is dict and set(value) >= {"python", "numpy", "torch_cpu"}:
            return self.component(name, "rng", 1, _qualname(RNGState), rel, _rng_tree(value, where))
        if isinstance(value, dict):
            return self.component(name, "dict", 1, "builtins.dict", rel, plain(value))
        return self.component(name, "json", 1, f"builtins.{type(value).__name__}", rel, value)


# --- torchrl.state_dict schema ------------------------------------------------------------


def _decode(node: Any, tensors: dict[str, torch.Tensor], referenced: set[str], where: str, depth: int) -> Any:
    """A value of TorchRL's ``state.json`` schema (kinds dict, ordered_dict, list, tuple, value, tensor)."""
    _need(depth <= _MAX_DEPTH, where, f"nested deeper than {_MAX_DEPTH} levels")
    _need(type(node) is dict and type(node.get("kind")) is str, where, f"invalid schema node {json.dumps(node)[:100]}")
    kind = node["kind"]
    if kind == "value":
        value = node.get("value")
        _need(type(value) in (type(None), bool, int, float, str), where, f"invalid value {json.dumps(value)[:100]}")
        return value
    if kind == "tensor":
        key = node.get("key")
        _need(type(key) is str and key in tensors, where, f"tensor {key!r} is not in state/meta.json")
        referenced.add(key)
        return tensors[key]
    items = node.get("items")
    _need(type(items) is list, where, f"{kind} node without items")
    if kind in ("list", "tuple"):
        out = [_decode(item, tensors, referenced, where, depth + 1) for item in items]
        return out if kind == "list" else tuple(out)
    if kind in ("dict", "ordered_dict"):
        # an ordered dict's "metadata" (module versions) is dropped, as ModuleAdapter does
        mapping: dict = OrderedDict() if kind == "ordered_dict" else {}
        for pair in items:
            _need(type(pair) is list and len(pair) == 2, where, "a dict item must be a [key, value] pair")
            key = _decode(pair[0], tensors, referenced, where, depth + 1)
            _need(type(key) in (type(None), bool, int, float, str), where, f"dict key {key!r} is not a scalar")
            _need(key not in mapping, where, f"duplicate dict key {key!r}")
            mapping[key] = _decode(pair[1], tensors, referenced, where, depth + 1)
        return mapping
    raise ContainerError(
        f"{where}: state-dict entries of kind {kind!r} are not supported (dict, ordered_dict, list, tuple, value, tensor are)"
    )


def _optimizer_tree(sd: dict, where: str) -> dict:
    """``OptimizerAdapter.to_state``'s tree of an optimizer state dict."""
    state, groups = sd["state"], sd["param_groups"]
    _need(
        isinstance(state, dict)
        and all(type(i) is int and isinstance(s, dict) and all(type(k) is str for k in s) for i, s in state.items()),
        where, "optimizer 'state' must map parameter indices to dicts with str keys",
    )
    _need(
        type(groups) is list
        and all(isinstance(g, dict) and all(type(k) is str for k in g) and type(g.get("params")) is list for g in groups),
        where, "optimizer 'param_groups' must be a list of dicts with str keys and a 'params' list",
    )
    return {"state": {str(i): dict(s) for i, s in state.items()}, "param_groups": {str(i): dict(g) for i, g in enumerate(groups)}}


def _uint8_state(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.dim() == 1


def _rng_tree(sd: dict, where: str) -> dict:
    """``RNGStateAdapter.to_state``'s tree of a TorchRL ``GlobalRNGState`` state dict."""
    extra = sorted(set(sd) - {"python", "numpy", "torch_cpu", "torch_cuda"})
    _need(not extra, where, f"RNG state for {extra}: ckptstore's rng adapter holds the Python, numpy, torch CPU and CUDA generators only")
    py = sd["python"]
    _need(
        type(py) is tuple and len(py) == 3 and py[0] == 3 and type(py[1]) is tuple and len(py[1]) == 625
        and all(type(x) is int and 0 <= x < 2**32 for x in py[1]) and 1 <= py[1][624] <= 624 and (py[2] is None or type(py[2]) is float),
        where, "invalid Python random state (version 3, 624 words and a position in [1, 624], gauss)",
    )
    np_state = sd["numpy"]
    _need(
        type(np_state) is tuple and len(np_state) == 5 and np_state[0] == "MT19937"
        and isinstance(np_state[1], torch.Tensor) and np_state[1].dtype == torch.int64 and tuple(np_state[1].shape) == (624,)
        and bool(((np_state[1] >= 0) & (np_state[1] < 2**32)).all())
        and type(np_state[2]) is int and 0 <= np_state[2] <= 624 and type(np_state[3]) is int and np_state[3] in (0, 1)
        and type(np_state[4]) is float,
        where, "invalid numpy random state (MT19937, int64 [624] key of 32-bit words, pos in [0, 624], has_gauss, cached_gaussian)",
    )
    _need(_uint8_state(sd["torch_cpu"]), where, "torch_cpu must be a 1-d uint8 tensor")
    tree: dict[str, Any] = {
        "python": {"version": py[0], "state": torch.tensor(py[1], dtype=torch.int64), "gauss_next": py[2]},
        "numpy": {"algorithm": "MT19937", "key": np_state[1], "pos": np_state[2], "has_gauss": np_state[3], "cached_gaussian": np_state[4]},
        "torch": sd["torch_cpu"],
    }
    cuda = sd.get("torch_cuda", [])
    _need(type(cuda) is list and all(_uint8_state(s) for s in cuda), where, "torch_cuda must be a list of 1-d uint8 tensors")
    if cuda:
        tree["cuda"] = {str(i): s for i, s in enumerate(cuda)}
    return tree
