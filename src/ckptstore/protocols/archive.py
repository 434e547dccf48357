"""Export a commit to a ZIP archive or a folder, and import one into a store.

Layout (both forms)::

    blobs/<address>         one file per blob: the 40-byte blob header and
                            payload, exactly as in a pack (see ckptstore.objects.packs)
    ckptstore-export.json   the manifest, written last: its presence marks a
                            complete export

Manifest: ``{"format": "ckptstore-export", "version": 1, "commit": {...},
"components": [...], "leaves": [...]}``; a leaf lists its shards' addresses.

Import trusts nothing: the manifest must match the schema exactly (no
duplicate keys, known dtypes, shapes whose byte size matches the shards,
valid paths, registered adapters), entry names are built from validated
addresses (never taken from the archive), sizes are checked before reading,
and every blob's header and hash are verified before anything is written to
the store. Nothing is unpickled or imported.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import stat
import tempfile
import time
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash
import zstandard

from ..core import jsonvalue, progress
from ..core.errors import CkptStoreError, ContainerError, IntegrityError
from ..core.layout import check_path
from ..core.shards import DTYPES, ShardPlan, address, check_shape, dense_order
from ..objects.packs import BLOB_HEADER, BLOB_MAGIC, CODEC_RAW, CODEC_ZSTD, FORMAT_VERSION, BlobLoc
from ..objects.records import Component, LeafRecord, check_paths, check_tag, recreate

if TYPE_CHECKING:
    from ..home.interfaces import ArchiveRepository

FORMAT = "ckptstore-export"
VERSION = 1
MANIFEST = "ckptstore-export.json"
MAX_MANIFEST_BYTES = 64 << 20
_ADDRESS = re.compile(r"^([0-9a-f]{32})-(0|[1-9][0-9]{0,15})$")
#: A zstd block regenerates at most 128 KiB from at least 4 bytes (an RLE block), so
#: no zstd payload decompresses to more than 32768 times its size; twice that is
#: the bound a declared raw length is checked against before anything is read.
MAX_ZSTD_RATIO = 1 << 16
_CHUNK = 1 << 20  # bytes read at a time from an entry

#: An export is written in a staging folder ``.<dest name>.ckptstore-export-<random>``
#: beside its destination; the exporting process holds an exclusive ``flock`` on
#: ``<staging>/export.lock`` until the folder is removed. Every export removes the
#: staging folders in its parent folder whose lock it can take (their exporter died).
STAGING_MARK = ".ckptstore-export-"
STAGING_LOCK = "export.lock"
_STAGING_NAME = re.compile(r"\..*" + re.escape(STAGING_MARK) + r"[A-Za-z0-9_]+", re.DOTALL)
_LOCKLESS_GRACE_S = 60.0  # a staging folder without its lock file is younger than this only while being made


@dataclass(frozen=True)
class _Leaf:
    path: str
    component: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    stride: tuple[int, ...] | None
    nbytes: int
    shard_bytes: int | None
    value: str | None
    shards: tuple[str, ...]


# --- export ----------------------------------------------------------------------------


def export_commit(store: ArchiveRepository, ref: str, dest: str | os.PathLike) -> Path:
    """Write commit ``ref`` to ``dest``: a ZIP archive if it ends in ``.zip``, else a folder.

    Blobs are copied as stored (compressed ones stay compressed) after their
    hashes are verified. The archive or folder appears complete or not at all.

    The export is staged in a hidden folder beside ``dest`` (see
    :data:`STAGING_MARK`); staging folders left by exports that were killed are
    removed by the next export into the same folder.

    Raises:
        ContainerError: ``dest`` exists (a non-empty folder, any file, or anything
            for a ``.zip``), its folder does not exist, or it cannot be written.
        IntegrityError: a blob of the commit is missing or corrupt.
    """
    dest = Path(dest)
    _check_destination(dest)
    cid = store.resolve(ref)  # on object storage: reads the tag, copies the record into the cache
    with store.catalog.read():  # one snapshot: a GC cannot drop the commit between its ref and its blobs' rows
        cid = store.resolve(cid)
        info = store.infos([cid])[cid]
        leaves = store.manifest(cid)  # the shards' locations
        raw_comps, raw_leaves = recreate(store.record(cid))  # paths and values as stored: the import rebuilds the same record
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "commit": {
            "id": cid, "parents": list(info.parents), "created_at": info.created_at,
            "message": info.message, "metadata": jsonvalue.dumps(info.metadata),
        },
        "components": [{"path": c.path, "adapter": c.adapter, "version": c.version, "meta": jsonvalue.dumps(c.meta)} for c in raw_comps],
        "leaves": [
            {
                "path": raw.path, "component": raw.component, "kind": r.kind, "dtype": r.dtype,
                "shape": None if r.shape is None else list(r.shape), "stride": None if r.stride is None else list(r.stride),
                "nbytes": r.nbytes, "shard_bytes": r.shard_bytes, "value": raw.value, "shards": [loc.address for loc in r.shards],
            }
            for r, raw in zip(leaves, raw_leaves)
        ],
    }
    blobs: dict[str, BlobLoc] = {loc.address: loc for r in leaves for loc in r.shards}
    reader = store.pack_reader()

    def blob_bytes(loc: BlobLoc) -> bytes:  # header and payload as stored, verified first
        data = reader.stored(loc, f"commit {cid}, export")
        advance(loc.raw_len)
        return data

    try:
        _remove_stale_staging(dest.parent)
        staging, lock_fd = _make_staging(dest)
    except OSError as exc:
        reader.close()
        raise ContainerError(f"cannot write the export {dest}: {exc.strerror or exc}") from None
    try:
        with progress.task(f"export {cid[:12]}", sum(loc.raw_len for loc in blobs.values())) as advance:
            out = staging / dest.name  # the staging folder keeps its lock file; only this moves to dest
            if dest.suffix == ".zip":
                with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
                    for addr, loc in blobs.items():
                        zf.writestr(_entry(f"blobs/{addr}"), blob_bytes(loc))
                    zf.writestr(_entry(MANIFEST), json.dumps(manifest))
                _fsync(out)
            else:
                out.mkdir()
                (out / "blobs").mkdir()
                for addr, loc in blobs.items():
                    (out / "blobs" / addr).write_bytes(blob_bytes(loc))
                (out / MANIFEST).write_text(json.dumps(manifest))
                for f in (out / "blobs").iterdir():
                    _fsync(f)
                _fsync(out / MANIFEST)
            try:
                os.replace(out, dest)  # a folder replaces only an empty folder
            except OSError as exc:
                if dest.exists():
                    raise ContainerError(f"{dest} already exists") from None
                raise ContainerError(f"cannot write the export {dest}: {exc.strerror or exc}") from None
    except OSError as exc:
        raise ContainerError(f"cannot write the export {dest}: {exc.strerror or exc}") from None
    finally:
        reader.close()
        shutil.rmtree(staging, ignore_errors=True)  # still locked: no other export removes it meanwhile
        os.close(lock_fd)
    return dest


def _entry(name: str) -> zipfile.ZipInfo:
    """An archive entry dated 1980-01-01 (ZIP's epoch), mode 0644: the archive's bytes
    depend only on the commit, so one commit exported from any store, on either home, at
    any time, gives the same file."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    return info


def _check_destination(dest: Path) -> None:
    """Refuse a destination that exists or whose folder does not; touches nothing."""
    parent = dest.parent
    try:
        if not parent.is_dir():
            if parent.exists() or parent.is_symlink():
                raise ContainerError(f"cannot export to {dest}: {parent} is not a folder")
            raise ContainerError(f"cannot export to {dest}: folder {parent} does not exist")
        if dest.is_symlink() or (dest.exists() and (dest.suffix == ".zip" or not dest.is_dir() or any(dest.iterdir()))):
            raise ContainerError(f"{dest} already exists")
    except OSError as exc:
        raise ContainerError(f"cannot export to {dest}: {exc.strerror or exc}") from None


def _make_staging(dest: Path) -> tuple[Path, int]:
    """Make ``dest``'s staging folder and lock it; returns ``(folder, lock fd)``.

    The lock file is created under another name, locked, then renamed: another
    export never finds the lock file unlocked while its owner is alive.
    """
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}{STAGING_MARK}", dir=dest.parent))
    try:
        fd = os.open(staging / f"{STAGING_LOCK}.new", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(staging / f"{STAGING_LOCK}.new", staging / STAGING_LOCK)
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging, fd


def _remove_stale_staging(folder: Path) -> None:
    """Remove staging folders in ``folder`` (of any destination name) whose export died.

    A folder is stale when its lock file can be locked, or, lacking a lock file,
    when it is older than a minute (its exporter died between making it and
    locking it). Best effort: what cannot be examined or removed is left alone.
    """
    try:
        entries = [e for e in os.scandir(folder) if _STAGING_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for entry in entries:
        try:
            fd = os.open(os.path.join(entry.path, STAGING_LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            try:
                if time.time() - os.lstat(entry.path).st_mtime > _LOCKLESS_GRACE_S:
                    shutil.rmtree(entry.path, ignore_errors=True)
            except OSError:
                pass
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live export
            os.close(fd)
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)  # under the dead exporter's lock
        finally:
            os.close(fd)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- import -----------------------------------------------------------------------------


class _Source:
    """Reads named entries of a ZIP archive or a folder, with size limits.

    Sizes are checked before anything is read: an entry is read in chunks, never
    more than its actual size (the folder's file, via ``fstat``) or its size in the
    ZIP directory (checked against the archive's own size) plus one byte.
    """

    def __init__(self, path: Path):
        self.path = path
        self.zip: zipfile.ZipFile | None = None
        if path.is_dir():
            return
        if not path.is_file():
            raise ContainerError(f"{path}: no such export archive or folder")
        try:
            self.zip = zipfile.ZipFile(path)
            archive_size = path.stat().st_size
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            self.close()
            raise ContainerError(f"{path}: not a readable ZIP archive, it is probably truncated or corrupt ({exc})") from None
        infos = self.zip.infolist()
        names = [i.filename for i in infos]
        if len(names) != len(set(names)):
            self.close()
            raise ContainerError(f"{path}: the archive holds duplicate entry names")
        declared = sum(i.compress_size for i in infos)
        if declared > archive_size:  # entries never overlap in an archive export writes
            self.close()
            raise ContainerError(
                f"{path}: the archive's directory declares {declared} bytes of entries, more than the archive's {archive_size} bytes (corrupt or crafted)"
            )

    def size(self, name: str) -> int | None:
        """The entry's size, ``None`` if there is no such entry; opens nothing."""
        if self.zip is not None:
            try:
                return self.zip.getinfo(name).file_size
            except KeyError:
                return None
        try:
            st = os.lstat(self.path / name)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise ContainerError(f"{self.path / name}: cannot be examined ({exc.strerror or exc})") from None
        if not stat.S_ISREG(st.st_mode):
            raise ContainerError(f"{self.path / name}: not a regular file")
        return st.st_size

    def read(self, name: str, limit: int) -> bytes:
        """The bytes of entry ``name``; refused if it holds more than ``limit`` bytes."""
        try:
            if self.zip is not None:
                try:
                    size = self.zip.getinfo(name).file_size
                except KeyError:
                    raise ContainerError(f"{self.path}: entry {name} is missing") from None
                self._check_size(name, size, limit)
                with self.zip.open(name) as f:
                    return self._read_all(f, name, size)
            fd = os.open(self.path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb", buffering=0) as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ContainerError(f"{self.path / name}: not a regular file")
                self._check_size(name, st.st_size, limit)
                return self._read_all(f, name, st.st_size)
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
            raise ContainerError(f"{self.path}: entry {name} cannot be read ({exc})") from None

    def _check_size(self, name: str, size: int, limit: int) -> None:
        if size > limit:
            raise ContainerError(f"{self.path}: entry {name} is {size} bytes, larger than its declared {limit} bytes")

    def _read_all(self, f, name: str, size: int) -> bytes:
        parts, got = [], 0
        while got <= size:  # one byte past the size tells an entry that grew or lied
            chunk = f.read(min(_CHUNK, size + 1 - got))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        if got > size:
            raise ContainerError(f"{self.path}: entry {name} holds more than its {size} bytes")
        return b"".join(parts)

    def close(self) -> None:
        if self.zip is not None:
            self.zip.close()


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ContainerError(f"manifest: {what}")


def _is_int(x: Any) -> bool:
    return type(x) is int and x >= 0


def _path(p: Any, what: str, allow_root: bool = True) -> str:
    _need(type(p) is str, f"{what} must be a string")
    if p == "" and allow_root:
        return p
    try:
        check_path(p)
    except ValueError as exc:
        raise ContainerError(f"manifest: unsafe or invalid {what} {p!r} ({exc})") from None
    return p


def _parse(text: bytes, registry) -> tuple[dict, list[dict], list[_Leaf]]:
    try:
        doc = json.loads(text, object_pairs_hook=jsonvalue.no_duplicate_keys)
    except (ValueError, RecursionError) as exc:
        raise ContainerError(f"manifest: not valid JSON ({exc})") from None
    _need(isinstance(doc, dict) and set(doc) == {"format", "version", "commit", "components", "leaves"}, "unexpected top-level keys")
    _need(doc["format"] == FORMAT, f"unknown format {doc['format']!r}")
    _need(doc["version"] == VERSION, f"unsupported export format version {doc['version']!r}")
    commit = doc["commit"]
    _need(isinstance(commit, dict) and set(commit) == {"id", "parents", "created_at", "message", "metadata"}, "bad commit record")
    _need(type(commit["message"]) is str and type(commit["created_at"]) in (int, float), "bad commit message or time")
    hex32 = re.compile(r"^[0-9a-f]{32}$")
    _need(type(commit["id"]) is str and hex32.match(commit["id"]) is not None, "bad commit id")
    _need(type(commit["parents"]) is list and all(type(p) is str and hex32.match(p) for p in commit["parents"]), "bad commit parents")
    try:
        metadata = jsonvalue.loads(commit["metadata"]) if type(commit["metadata"]) is str else None
    except CkptStoreError as exc:
        raise ContainerError(f"manifest: bad commit metadata ({exc})") from None
    _need(type(metadata) is dict, "commit metadata must be a JSON object")
    comps = []
    _need(type(doc["components"]) is list, "components must be a list")
    seen = set()
    for c in doc["components"]:
        _need(isinstance(c, dict) and set(c) == {"path", "adapter", "version", "meta"}, "bad component record")
        path = _path(c["path"], "component path")
        _need(path not in seen, f"duplicate component {path!r}")
        seen.add(path)
        _need(type(c["adapter"]) is str and re.fullmatch(r"[A-Za-z0-9_.]{1,100}", c["adapter"]) is not None, f"bad adapter name {c['adapter']!r}")
        if c["adapter"] not in registry.by_name:
            registry._load(c["adapter"].split(".")[0])
        _need(c["adapter"] in registry.by_name, f"component {path!r}: unknown adapter {c['adapter']!r}")
        _need(_is_int(c["version"]) and c["version"] >= 1, f"component {path!r}: bad version")
        try:
            meta = jsonvalue.loads(c["meta"]) if type(c["meta"]) is str else None
        except CkptStoreError as exc:
            raise ContainerError(f"manifest: component {path!r}: bad meta ({exc})") from None
        _need(type(meta) is dict, f"component {path!r}: meta must be a JSON object")
        comps.append({"path": path, "adapter": c["adapter"], "version": c["version"], "meta": meta})
    leaves = []
    _need(type(doc["leaves"]) is list, "leaves must be a list")
    paths = set()
    for r in doc["leaves"]:
        _need(isinstance(r, dict) and set(r) == {"path", "component", "kind", "dtype", "shape", "stride", "nbytes", "shard_bytes", "value", "shards"}, "bad leaf record")
        path = _path(r["path"], "leaf path")
        _need(path not in paths, f"duplicate leaf {path!r}")
        paths.add(path)
        comp = r["component"]
        _need(comp in seen and (comp == "" or path == comp or path.startswith(comp + "/")), f"leaf {path!r}: bad component {comp!r}")
        if r["kind"] == "json":
            _need(
                type(r["value"]) is str and r["shards"] == [] and r["dtype"] is None and r["shape"] is None and r["stride"] is None,
                f"leaf {path!r}: bad JSON leaf",
            )
            try:
                jsonvalue.loads(r["value"])
            except CkptStoreError as exc:
                raise ContainerError(f"manifest: leaf {path!r}: {exc}") from None
            leaves.append(_Leaf(path, comp, "json", None, None, None, 0, None, r["value"], ()))
            continue
        _need(r["kind"] == "tensor", f"leaf {path!r}: unknown kind {r['kind']!r}")
        dtype = DTYPES.get(r["dtype"]) if type(r["dtype"]) is str else None
        _need(dtype is not None, f"leaf {path!r}: unknown dtype {r['dtype']!r}")
        shape = r["shape"]
        _need(type(shape) is list and all(_is_int(s) for s in shape), f"leaf {path!r}: bad shape")
        try:
            check_shape(shape, dtype)
        except ValueError as exc:
            raise ContainerError(f"manifest: leaf {path!r}: {exc}") from None
        stride = r["stride"]
        _need(
            stride is None or (type(stride) is list and all(_is_int(x) for x in stride) and dense_order(tuple(shape), tuple(stride)) is not None),
            f"leaf {path!r}: strides {stride!r} are not a dense layout of shape {shape}",
        )
        nbytes = math.prod(shape) * dtype.itemsize
        _need(r["nbytes"] == nbytes, f"leaf {path!r}: shape {shape} x {r['dtype']} is {nbytes} bytes, the manifest says {r['nbytes']}")
        _need(_is_int(r["shard_bytes"]) and r["shard_bytes"] >= 1, f"leaf {path!r}: bad shard size")
        plan = ShardPlan(nbytes, r["shard_bytes"])
        shards = r["shards"]
        _need(type(shards) is list and len(shards) == plan.count, f"leaf {path!r}: {len(shards) if type(shards) is list else '?'} shards, {plan.count} expected")
        for i, addr in enumerate(shards):
            m = _ADDRESS.match(addr) if type(addr) is str else None
            _need(m is not None, f"leaf {path!r}: bad shard address {addr!r}")
            a, b = plan.bounds(i)
            _need(int(m.group(2)) == b - a, f"leaf {path!r}: shard {i} ({addr}) should hold {b - a} bytes")
        leaves.append(_Leaf(path, comp, "tensor", r["dtype"], tuple(shape), None if stride is None else tuple(stride), nbytes, r["shard_bytes"], None, tuple(shards)))
    bad = check_paths(list(paths))
    _need(bad is None, str(bad))
    commit["metadata"] = metadata
    return commit, comps, leaves


def _checked_blob(data: bytes, addr: str, where: str) -> tuple[int, bytes]:
    """Check one exported blob (header, sizes, codec, hash) without ever holding
    more than 1 MiB of decompressed bytes (a declared size is not trusted for
    memory); return ``(codec, payload)``."""
    m = _ADDRESS.match(addr)
    want_digest, raw_len = bytes.fromhex(m.group(1)), int(m.group(2))
    if len(data) < BLOB_HEADER.size:
        raise ContainerError(f"{where}: blob {addr} is truncated ({len(data)} bytes)")
    magic, version, codec, _, hdr_raw, stored, dig = BLOB_HEADER.unpack(data[: BLOB_HEADER.size])
    payload = data[BLOB_HEADER.size :]
    if magic != BLOB_MAGIC or version != FORMAT_VERSION:
        raise ContainerError(f"{where}: blob {addr} is not a ckptstore blob (bad header)")
    if hdr_raw != raw_len or dig != want_digest or stored != len(payload):
        raise ContainerError(f"{where}: blob {addr} header does not match its address or size (truncated?)")
    h, n = xxhash.xxh3_128(), 0
    if codec == CODEC_RAW:
        h.update(payload)
        n = len(payload)
    elif codec == CODEC_ZSTD:
        try:
            with zstandard.ZstdDecompressor().stream_reader(payload) as reader:
                while n <= raw_len and (chunk := reader.read(1 << 20)):
                    h.update(chunk)
                    n += len(chunk)
        except zstandard.ZstdError as exc:
            raise ContainerError(f"{where}: blob {addr} does not decompress ({exc})") from None
    else:
        raise ContainerError(f"{where}: blob {addr} has unknown codec {codec}")
    if n != raw_len or h.digest() != want_digest:
        raise ContainerError(f"{where}: blob {addr} content hash mismatch (corrupt)")
    return codec, payload


def check_export(src: str | os.PathLike, registry) -> None:
    """Verify an export completely (manifest and every blob) without a store.

    Raises ContainerError exactly as :func:`import_commit` would.
    """
    source = _Source(Path(src))
    try:
        _verified(source, Path(src), registry)
    finally:
        source.close()


def _verified(source: _Source, src: Path, registry):
    """Parse the manifest and check every blob; returns ``(commit, comps, leaves, fetch)``."""
    size = source.size(MANIFEST)
    if size is None:
        raise ContainerError(f"{src}: no {MANIFEST}; not a complete ckptstore export")
    if size > MAX_MANIFEST_BYTES:
        raise ContainerError(f"{src}: {MANIFEST} is {size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
    commit, comps, leaves = _parse(source.read(MANIFEST, MAX_MANIFEST_BYTES), registry)
    users: dict[str, str] = {}
    for leaf in leaves:
        for i, addr in enumerate(leaf.shards):
            users.setdefault(addr, f"{src}: leaf {leaf.path!r} shard {i}")

    def entry_size(addr: str) -> int:
        """The size of ``addr``'s entry, checked against its declared raw length."""
        raw_len = int(addr.rsplit("-", 1)[1])
        size = source.size(f"blobs/{addr}")
        if size is None:
            raise ContainerError(f"{users[addr]}: blob {addr} is missing from the export")
        if size > BLOB_HEADER.size + raw_len:
            raise ContainerError(f"{users[addr]}: blob {addr} entry is {size} bytes, more than its {raw_len} raw bytes allow")
        if size < BLOB_HEADER.size:
            raise ContainerError(f"{users[addr]}: blob {addr} is truncated ({size} bytes)")
        if raw_len > (size - BLOB_HEADER.size) * MAX_ZSTD_RATIO:
            raise ContainerError(
                f"{users[addr]}: blob {addr} declares {raw_len} raw bytes, which its {size}-byte entry cannot hold even compressed"
            )
        return size

    def fetch(addr: str) -> tuple[int, bytes]:
        entry_size(addr)
        raw_len = int(addr.rsplit("-", 1)[1])
        return _checked_blob(source.read(f"blobs/{addr}", BLOB_HEADER.size + raw_len), addr, users[addr])

    for addr in users:  # every declared size against its entry before any blob is read
        entry_size(addr)
    with progress.task(f"verify {src.name}", sum(int(a.rsplit("-", 1)[1]) for a in users)) as advance:
        for addr in users:  # verify everything before writing anything
            fetch(addr)
            advance(int(addr.rsplit("-", 1)[1]))
    return commit, comps, leaves, fetch


def import_commit(store: ArchiveRepository, src: str | os.PathLike, tag: str | None = None, message: str | None = None):
    """Import an export (ZIP archive or folder) as a new commit of ``store``.

    The commit keeps its provenance: the exported id, time, parents (which this
    store may lack: lineage then ends there), message and metadata. Importing
    a commit the store already holds writes nothing (only ``tag`` moves).
    Without ``tag`` a warning says that the next GC drops the commit once the
    grace period has passed. Verified blobs are copied as they are (no recompression).

    Returns:
        CommitInfo of the new commit.

    Raises:
        ContainerError: malformed, truncated, unsafe or unknown content, naming
            the entry (and the leaf that uses it); the store is unchanged.
    """
    t0 = time.perf_counter()
    tags = [] if tag is None else [check_tag(tag)]
    src = Path(src)
    refuse_store_files(src, Path(store.root))
    source = _Source(src)
    try:
        commit, comps, leaves, fetch = _verified(source, src, store.registry)
        components = [Component(c["path"], c["adapter"], c["version"], c["meta"]) for c in comps]
        records = [LeafRecord(r.path, r.component, r.kind, r.dtype, r.shape, r.nbytes, r.shard_bytes, r.value, r.stride) for r in leaves]
        keys = [(bytes.fromhex(a[:32]), int(a[33:])) for r in leaves for a in r.shards]

        def write(writer, key: tuple[bytes, int]):  # verified again: the files may have changed since
            codec, payload = fetch(address(*key))
            return writer.append_encoded(key[0], key[1], codec, payload)

        origin = None if message is not None else (commit["id"], commit["parents"], float(commit["created_at"]))
        try:
            info, _ = store.commit_manifest(
                components, records, keys, write, tags, commit["message"] if message is None else message, commit["metadata"], None, t0,
                origin=origin,
            )
        except IntegrityError as exc:
            raise ContainerError(f"{src}: the exported commit does not match its id ({exc})") from None
        if not tags:
            warnings.warn(
                f"imported commit {info.id} has no tag: the next `ckptstore gc` drops it once the grace period has passed "
                "(pass tag=... / --tag to keep it)", stacklevel=2,
            )
        return info
    finally:
        source.close()


def refuse_store_files(src: Path, root: Path) -> None:
    """Refuse to import from the store's own folder (its catalog and WAL files
    included), comparing resolved paths only: opening and closing the catalog
    file would drop the SQLite locks this process holds on it."""
    try:
        inside, top = src.resolve(), root.resolve()
    except (OSError, RuntimeError) as exc:
        raise ContainerError(f"{src}: the path cannot be resolved ({exc})") from None
    if inside == top or top in inside.parents:
        raise ContainerError(f"{src} is the store {root} or inside it; import from an export outside the store")

