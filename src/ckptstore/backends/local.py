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

from ..core.errors import (
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

# --- a store's folder is the store's (ARCHITECTURE invariant 13) -------------------------
#
# Anything else may live in the folder: a symbolic link someone made (``tmp`` pointing at
# another folder, ``blobs/zz`` at a shared disk), a FIFO, a socket, a device node. ckptstore
# follows no symbolic link below a store's root (the root itself may be one), opens no
# non-regular file (``O_NOFOLLOW | O_NONBLOCK`` and an ``lstat`` first: a FIFO never blocks
# a command), and unlinks only through a folder descriptor reached without a link, so
# nothing outside the folder is read as the store's, written or deleted.

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ForeignEntryError(OSError):
    """An entry below a store's root that ckptstore did not make and does not use: a
    symbolic link (``errno`` ``ELOOP``), or a FIFO, socket, device or folder where a regular
    file (``EINVAL``), or a file where a folder (``ENOTDIR``), was expected. ``strerror``
    says which, in one line; callers turn it into their own error (a missing blob, a
    refused write) and never follow or delete the entry."""


def describe_mode(mode: int) -> str:
    """``"a symbolic link"``, ``"a FIFO"``, ``"a socket"``, ``"a character device"``,
    ``"a block device"``, ``"a folder"`` or ``"a file"``: what an ``st_mode`` is, for messages."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "a file"


def foreign(rel: str, mode: int, want: str = "a regular file") -> ForeignEntryError:
    """The :class:`ForeignEntryError` of entry ``rel`` (relative to the store root) of mode ``mode``."""
    what = describe_mode(mode)
    code = errno.ELOOP if stat.S_ISLNK(mode) else errno.ENOTDIR if want == "a folder" else errno.EINVAL
    return ForeignEntryError(code, f"{rel} is {what}, not made by ckptstore ({want} was expected)")


def _parts(root: Path, path: Path) -> list[str]:
    try:
        parts = Path(path).relative_to(root).parts
    except ValueError:
        raise InvalidArgumentError(f"{path} is not inside {root}") from None
    if any(p in ("..", ".") for p in parts):
        raise InvalidArgumentError(f"{path}: no '.' or '..' inside a store")
    return list(parts)


def open_dir(root: Path, path: Path) -> int:
    """A descriptor of folder ``path`` (``root`` or a folder below it), reached from ``root``
    without following a symbolic link (``root`` itself may be one).

    Raises:
        FileNotFoundError: a component is missing.
        ForeignEntryError: a component is a symbolic link or not a folder.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    done: list[str] = []
    try:
        for name in _parts(root, path):
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise foreign("/".join([*done, name]), os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode, "a folder") from None
            os.close(fd)
            fd = nfd
            done.append(name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def lstat_beneath(root: Path, path: Path) -> os.stat_result:
    """``lstat`` of ``path`` below ``root``, its folders reached without a symbolic link.

    Raises:
        FileNotFoundError: it (or a folder above it) is missing.
        ForeignEntryError: a folder above it is a symbolic link or not a folder.
    """
    dfd = open_dir(root, Path(path).parent)
    try:
        return os.stat(Path(path).name, dir_fd=dfd, follow_symlinks=False)
    finally:
        os.close(dfd)


def open_regular(root: Path, path: Path, flags: int = 0, mode: int = 0o644) -> int:
    """A read-only descriptor (plus ``flags``) of the regular file ``path`` below ``root``,
    reached without following a symbolic link and without opening anything else (a FIFO,
    socket or device is never opened: it would block or act). The descriptor is
    non-blocking (``O_NONBLOCK``; ``os.set_blocking`` undoes it). With ``os.O_CREAT`` in
    ``flags`` a missing file is created (permissions ``mode``).

    Raises:
        FileNotFoundError: it is missing (and not created), or a folder above it is.
        ForeignEntryError: it, or a folder above it, is not what ckptstore makes there.
    """
    path = Path(path)
    dfd = open_dir(root, path.parent)
    try:
        try:
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
        else:
            if not stat.S_ISREG(st.st_mode):
                raise foreign("/".join(_parts(root, path)), st.st_mode)
        try:
            fd = os.open(path.name, _READ_FLAGS | flags, mode, dir_fd=dfd)
        except OSError as exc:  # replaced by a link (ELOOP) or a FIFO without a reader (ENXIO) meanwhile
            if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise
            raise foreign("/".join(_parts(root, path)), os.stat(path.name, dir_fd=dfd, follow_symlinks=False).st_mode) from None
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced between the two looks
        os.close(fd)
        raise foreign("/".join(_parts(root, path)), st.st_mode)
    return fd


def unlink_beneath(root: Path, path: Path, sync: bool = True) -> int:
    """Unlink the regular file ``path`` below ``root`` through its folder's descriptor (reached
    without a symbolic link), and with ``sync`` fsync that folder; its size in bytes, 0 when
    it was gone. Nothing else is ever unlinked: not a link, FIFO, socket or device.

    Raises:
        ForeignEntryError: it, or a folder above it, is not what ckptstore makes there
            (it is left as it is).
    """
    path = Path(path)
    try:
        dfd = open_dir(root, path.parent)
    except FileNotFoundError:
        return 0
    try:
        try:
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise foreign("/".join(_parts(root, path)), st.st_mode)
            os.unlink(path.name, dir_fd=dfd)
        except FileNotFoundError:
            return 0
        if sync:
            os.fsync(dfd)
        return st.st_size
    finally:
        os.close(dfd)


def own_dir(root: Path, path: Path) -> Path:
    """Make folder ``path`` below ``root`` (and its missing parents) if missing; ``path``.

    Raises:
        ForeignEntryError: it, or a folder above it, exists as a symbolic link or not as a
            folder (ckptstore writes nothing through it).
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    done: list[str] = []
    try:
        for name in _parts(root, path):
            done.append(name)
            try:
                os.mkdir(name, dir_fd=fd)  # (mkdir never follows a link of its own name)
                os.fsync(fd)
            except FileExistsError:
                pass
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise foreign("/".join(done), os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode, "a folder") from None
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)
    return path


PRUNE_AGE = 600.0  # seconds a superseded ref version is kept
_VERSION_DIGITS = 20
_READ_ATTEMPTS = 100


def fsync_dir(path: Path) -> None:
    """``fsync`` folder ``path``: the names created, renamed or removed in it are durable.

    Raises:
        OSError: it cannot be opened or synced."""
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

    def _link_new(self, parts: list[memoryview], final: Path) -> bool:
        """Write ``parts`` to a locked, fsynced tmp file and link it to ``final``; ``False`` if it exists."""
        tmpdir = own_dir(self.root, self.root / "tmp")  # never written through a link (invariant 13)
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
            own_dir(self.root, final.parent)
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False
            fsync_dir(final.parent)
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
            with os.fdopen(open_regular(self.root, path), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ForeignEntryError):
            raise ObjectNotFoundError(f"{self.root}: object {key} is missing") from None
        except OSError as exc:
            raise BackendError(f"{self.root}: reading object {key} failed: {exc}") from exc

    def get_ranges(self, key: str, ranges) -> list[bytes]:
        path = self._path(key)
        ranges = check_ranges(ranges)
        try:
            fd = open_regular(self.root, path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ForeignEntryError):
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
            st = lstat_beneath(self.root, self._path(key))
        except (FileNotFoundError, NotADirectoryError, ForeignEntryError):
            return None
        except OSError as exc:
            raise BackendError(f"{self.root}: stat of object {key} failed: {exc}") from exc
        return ObjectInfo(key, st.st_size, st.st_mtime) if stat.S_ISREG(st.st_mode) else None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        prefix = check_prefix(prefix)
        out: list[ObjectInfo] = []

        def walk(folder: Path, rel: str, top: bool) -> None:
            try:
                os.close(open_dir(self.root, folder))  # a prefix through a link lists nothing (invariant 13)
                entries = list(os.scandir(folder))
            except (FileNotFoundError, NotADirectoryError, ForeignEntryError):
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
            unlink_beneath(self.root, self._path(key), sync=False)
        except (FileNotFoundError, ForeignEntryError):
            pass  # (a link or FIFO in an object's place is not the object: left alone)
        except OSError as exc:
            raise StoreWriteError(f"{self.root}: deleting object {key} failed: {exc}") from exc

    # --- refs ------------------------------------------------------------------------

    def _ref_dir(self, name: str) -> Path:
        return self.root / "refs" / ref_segment(name)

    def _versions(self, folder: Path) -> list[int]:
        try:
            fd = open_dir(self.root, folder)  # a link in refs/ names no ref (invariant 13)
        except (FileNotFoundError, NotADirectoryError, ForeignEntryError):
            return []
        try:
            names = os.listdir(fd)
        finally:
            os.close(fd)
        return sorted(int(n) for n in names if len(n) == _VERSION_DIGITS and n.isdigit())

    def _read_version(self, folder: Path, number: int, name: str):
        """The parsed ref object of version ``number``, or ``None`` if that file is gone."""
        try:
            with os.fdopen(open_regular(self.root, folder / f"{number:0{_VERSION_DIGITS}d}"), "rb") as f:
                raw = f.read()
        except (FileNotFoundError, ForeignEntryError):
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
                if now - lstat_beneath(self.root, path).st_mtime >= self.prune_age:
                    unlink_beneath(self.root, path, sync=False)
            except (FileNotFoundError, ForeignEntryError):
                pass

    def list_refs(self) -> list[str]:
        try:
            fd = open_dir(self.root, self.root / "refs")
        except (FileNotFoundError, NotADirectoryError, ForeignEntryError):
            return []
        except OSError as exc:
            raise BackendError(f"{self.root}: listing refs failed: {exc}") from exc
        try:
            segments = os.listdir(fd)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise BackendError(f"{self.root}: listing refs failed: {exc}") from exc
        finally:
            os.close(fd)
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
