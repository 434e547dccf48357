"""The local-folder backend: objects are files under the store folder, refs are
lock-free version folders (docs/design.md, "Object storage").

**Objects.** ``put_new`` writes ``tmp/<uuid>.obj.tmp`` (holding an exclusive
``flock`` while it exists, as packs in flight do, so GC leaves it alone), fsyncs it,
and ``link(2)``s it to the object's path: ``link`` fails if the name exists, which
makes the write create-only and atomic, and the object appears only complete and
durable. The tmp name is then unlinked and the folders fsynced.

**Refs, without a lock.** Ref ``name`` is the folder ``refs/<escaped name>/`` of
version files named by a 20-digit number; the current version is the highest. A
version's string is ``<number>-<write id>``. A CAS from version *n* (0: create)

1. checks that file *n* still holds that write id (else the read was stale:
   ``RefConflictError``);
2. writes the new ref object (which records *n*'s write id as ``prev``) to a tmp file,
   fsyncs it, and links it to *n+1* (``EEXIST``: another writer won);
3. lists the folder: if a version above *n+1* exists, either a writer already built on
   ours (file *n+1*'s successor names our write id as ``prev``: success), or *n* was
   stale and pruned before our link: our file is unlinked — readers take the highest
   number, so none saw it — and ``RefConflictError`` is raised;
4. prunes versions below *n* older than ``prune_age`` seconds (default 10 minutes).
   Pruning only that old keeps the successor of a just-linked version in place for
   step 3 of its writer; a writer stalled between its link and step 3 for longer may
   report a conflict for a write that landed (its retry then moves the ref again: a
   repeated move, never a lost or torn one).

A SIGKILL at any point leaves at most a tmp file (GC removes it) or a version below
the highest (pruned later); readers never see a partial or retracted version.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
import uuid
from pathlib import Path

from ..errors import (
    BackendError,
    BlobCorruptError,
    IntegrityError,
    InvalidArgumentError,
    NotAStoreError,
    ObjectNotFoundError,
    RefConflictError,
    StoreWriteError,
)
from .base import (
    RESERVED,
    Backend,
    Data,
    ObjectInfo,
    Ref,
    as_parts,
    check_key,
    check_prefix,
    check_ranges,
    decode_ref,
    encode_ref,
    new_write_id,
    ref_name,
    ref_segment,
)

PRUNE_AGE = 600.0  # seconds a superseded ref version is kept
_VERSION_DIGITS = 20
_READ_ATTEMPTS = 100


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, parts: list[memoryview]) -> None:
    offset = 0
    for part in parts:
        while len(part):
            n = os.pwrite(fd, part, offset)
            if n == 0:
                raise OSError(errno.ENOSPC, "no progress writing")
            offset += n
            part = part[n:]


class LocalBackend(Backend):
    """Objects and refs in folder ``root`` (a store folder).

    Args:
        root: the folder.
        create: make ``root`` (and its parents) if missing.
        prune_age: seconds a superseded ref version is kept (see the module docstring).

    Raises:
        NotAStoreError: ``root`` is missing (without ``create``) or not a folder.
    """

    def __init__(self, root: str | os.PathLike, create: bool = False, prune_age: float = PRUNE_AGE):
        self.root = Path(root)
        self.prune_age = prune_age
        self.url = str(self.root)
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreWriteError(f"cannot create folder {self.root}: {exc}") from exc
        if not self.root.is_dir():
            raise NotAStoreError(f"{self.root}: no such folder")

    # --- objects -------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _makedirs(self, path: Path) -> None:
        """Create ``path`` and missing parents below the root, fsyncing each parent that gained one."""
        missing = []
        while not path.is_dir():
            missing.append(path)
            path = path.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                continue
            _fsync_dir(d.parent)

    def _link_new(self, parts: list[memoryview], final: Path) -> bool:
        """Write ``parts`` to a locked, fsynced tmp file and link it to ``final``; ``False`` if it exists."""
        tmpdir = self.root / "tmp"
        tmpdir.mkdir(exist_ok=True)
        while True:
            tmp = tmpdir / f"{uuid.uuid4().hex}.obj.tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink:  # a GC may unlink it between create and lock: then take a new name
                break
            os.close(fd)
        try:
            _write_all(fd, parts)
            os.fsync(fd)
            self._makedirs(final.parent)
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False
            _fsync_dir(final.parent)
            return True
        finally:
            try:
                os.unlink(tmp)
            finally:
                os.close(fd)

    def put_new(self, key: str, data: Data) -> bool:
        final = self._path(key)
        parts = as_parts(data)
        try:
            return self._link_new(parts, final)
        except OSError as exc:
            raise StoreWriteError(f"writing object {key} in {self.root} failed: {exc}") from exc

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.root}: object {key} is missing") from None
        except OSError as exc:
            raise BackendError(f"{self.root}: reading object {key} failed: {exc}") from exc

    def get_ranges(self, key: str, ranges) -> list[bytes]:
        path = self._path(key)
        ranges = check_ranges(ranges)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.root}: object {key} is missing") from None
        except OSError as exc:
            raise BackendError(f"{self.root}: opening object {key} failed: {exc}") from exc
        try:
            out = []
            for start, end in ranges:
                got = os.pread(fd, end - start, start) if end > start else b""
                if len(got) != end - start:
                    size = os.fstat(fd).st_size
                    raise BlobCorruptError(f"{self.root}: object {key} is {size} bytes; byte range [{start}, {end}) lies past its end")
                out.append(got)
            return out
        except OSError as exc:
            raise BackendError(f"{self.root}: reading object {key} failed: {exc}") from exc
        finally:
            os.close(fd)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise BackendError(f"{self.root}: stat of object {key} failed: {exc}") from exc
        return ObjectInfo(key, st.st_size, st.st_mtime) if stat.S_ISREG(st.st_mode) else None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        prefix = check_prefix(prefix)
        out: list[ObjectInfo] = []

        def walk(folder: Path, rel: str, top: bool) -> None:
            try:
                entries = list(os.scandir(folder))
            except (FileNotFoundError, NotADirectoryError):
                return
            except OSError as exc:
                raise BackendError(f"{self.root}: listing {folder} failed: {exc}") from exc
            for entry in entries:
                name = entry.name
                if name.startswith(".") or (top and (name in RESERVED or name.startswith("catalog"))):
                    continue
                key = f"{rel}{name}"
                if entry.is_dir(follow_symlinks=False):
                    walk(Path(entry.path), key + "/", False)
                elif entry.is_file(follow_symlinks=False):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # deleted meanwhile
                        continue
                    out.append(ObjectInfo(key, st.st_size, st.st_mtime))

        if prefix:
            walk(self.root / prefix, prefix + "/", False)
        else:
            walk(self.root, "", True)
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreWriteError(f"{self.root}: deleting object {key} failed: {exc}") from exc

    # --- refs ------------------------------------------------------------------------

    def _ref_dir(self, name: str) -> Path:
        return self.root / "refs" / ref_segment(name)

    @staticmethod
    def _versions(folder: Path) -> list[int]:
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(n) for n in names if len(n) == _VERSION_DIGITS and n.isdigit())

    def _read_version(self, folder: Path, number: int, name: str):
        """The parsed ref object of version ``number``, or ``None`` if that file is gone."""
        try:
            with open(folder / f"{number:0{_VERSION_DIGITS}d}", "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        return decode_ref(raw, f"{self.root}: ref {name!r} version {number}", name)

    def read_ref(self, name: str) -> Ref | None:
        folder = self._ref_dir(name)
        try:
            for _ in range(_READ_ATTEMPTS):
                versions = self._versions(folder)
                if not versions:
                    return None
                obj = self._read_version(folder, versions[-1], name)
                if obj is not None:  # else pruned or retracted between listing and opening: list again
                    return Ref(obj.data, f"{versions[-1]:0{_VERSION_DIGITS}d}-{obj.write}")
        except OSError as exc:
            raise BackendError(f"{self.root}: reading ref {name!r} failed: {exc}") from exc
        raise BackendError(f"{self.root}: ref {name!r} changed under {_READ_ATTEMPTS} reads in a row")

    def _parse_version(self, name: str, expected: str | None) -> tuple[int, str | None]:
        if expected is None:
            return 0, None
        number, _, write = expected.partition("-") if type(expected) is str else ("", "", "")
        if len(number) != _VERSION_DIGITS or not number.isdigit() or len(write) != 32 or int(number) == 0:
            raise InvalidArgumentError(f"invalid version {expected!r} for ref {name!r} in {self.root}: not one that read_ref returns here")
        return int(number), write

    def cas_ref(self, name: str, data: bytes, expected: str | None) -> str:
        number, prev = self._parse_version(name, expected)
        folder = self._ref_dir(name)
        conflict = f"{self.root}: ref {name!r} moved since version {expected} was read" if expected else f"{self.root}: ref {name!r} already exists"
        write = new_write_id()
        raw = encode_ref(name, write, data, prev)
        new = number + 1
        try:
            if number:
                old = self._read_version(folder, number, name)
                if old is None or old.write != prev:
                    raise RefConflictError(conflict)
            target = folder / f"{new:0{_VERSION_DIGITS}d}"
            if not self._link_new([memoryview(raw)], target):
                raise RefConflictError(conflict)
            versions = self._versions(folder)
            if versions and versions[-1] > new:
                successor = self._read_version(folder, new + 1, name)
                if successor is None or successor.prev != write:  # we were stale: retract our invisible version
                    try:
                        os.unlink(target)
                    except FileNotFoundError:  # pruned already
                        pass
                    raise RefConflictError(conflict)
            self._prune(folder, versions, number)
        except OSError as exc:
            raise StoreWriteError(f"{self.root}: moving ref {name!r} failed: {exc}") from exc
        return f"{new:0{_VERSION_DIGITS}d}-{write}"

    def _prune(self, folder: Path, versions: list[int], below: int) -> None:
        now = time.time()
        for v in versions:
            if v >= below:
                break
            path = folder / f"{v:0{_VERSION_DIGITS}d}"
            try:
                if now - path.stat().st_mtime >= self.prune_age:
                    path.unlink()
            except FileNotFoundError:
                pass

    def list_refs(self) -> list[str]:
        try:
            segments = os.listdir(self.root / "refs")
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise BackendError(f"{self.root}: listing refs failed: {exc}") from exc
        names = []
        for seg in segments:
            name = ref_name(seg)
            if name is None:  # a hashed long name: the name is in the object
                versions = self._versions(self.root / "refs" / seg)
                if not versions:
                    continue
                obj = self._read_version(self.root / "refs" / seg, versions[-1], None)
                if obj is None:
                    continue
                if ref_segment(obj.name) != seg:
                    raise IntegrityError(f"{self.root}: ref folder {seg} holds ref {obj.name!r}, whose folder is {ref_segment(obj.name)}")
                name = obj.name
            if self._versions(self.root / "refs" / seg):
                names.append(name)
        return sorted(names)
