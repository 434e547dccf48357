"""The backend interface: where objects and refs live (docs/design.md, "Object storage").

A backend stores two things and knows nothing else of ckptstore:

- **objects**: immutable bytes under a key, written whole and create-only
  (:meth:`Backend.put_new`), read whole or by byte ranges, listed with their sizes
  and ages, deleted by GC;
- **refs**: small mutable objects moved only by compare-and-swap
  (:meth:`Backend.cas_ref`) against the version :meth:`Backend.read_ref` returned.

Keys are ``/``-separated segments of ``[A-Za-z0-9._%~-]``, none empty or starting
with ``.``; first segments ``tmp``, ``refs``, ``gc.lock`` and ``catalog*`` are reserved (a
local store keeps its tmp files, refs, GC lock and SQLite catalog there). Ref names are any text of
1 to 255 characters without NUL; the backend escapes them into keys.

A ref object is one line of JSON (name, format version, a random write id, the
previous version's write id where the backend tracks it) and then the caller's
payload. The write id makes every version's bytes distinct, so a version can never
match again (no ABA) and a write whose response was lost is recognised by reading the
ref back.

This module holds what both backends share: the interface, key and ref-name rules,
the ref object format, and :func:`update_ref`, the read-modify-CAS loop.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.errors import BackendError, IntegrityError, InvalidArgumentError, InvalidNameError, RefBusyError, RefConflictError
from ..core.layout import RANDOM, digest

#: A bytes-like object, or a sequence of them written back to back (a pack's parts).
Data = bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]

REF_FORMAT = 1
MAX_KEY_BYTES = 900
MAX_REF_NAME = 255
MAX_ESCAPED_REF = 200
MAX_REF_HEADER = 4096
RESERVED = ("tmp", "refs", "gc.lock")  # and every first segment starting with "catalog"
_SEGMENT = r"[A-Za-z0-9_%~-][A-Za-z0-9._%~-]*"
_KEY = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")
_WRITE_ID = re.compile(r"[0-9a-f]{32}")
_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key, size in bytes, and modification time in seconds
    since the epoch (the server's clock on object storage)."""

    key: str
    size: int
    mtime: float


@dataclass(frozen=True)
class Ref:
    """A ref as read: the caller's payload and the opaque version to pass to :meth:`Backend.cas_ref`."""

    data: bytes
    version: str


class Backend(ABC):
    """Where a store's objects and refs live: a local folder or an object-storage prefix.

    Every method is safe to call from several threads. Errors are ``ckptstore.core.errors``:
    :class:`InvalidArgumentError` / :class:`InvalidNameError` for bad keys or names,
    :class:`ObjectNotFoundError` for absent objects, :class:`RefConflictError` for a lost
    CAS, :class:`BackendError` (remote) or :class:`StoreWriteError` (local writes) for
    failures of the storage itself.
    """

    #: ``s3://bucket/prefix`` or the folder's path, for messages.
    url: str

    @abstractmethod
    def put_new(self, key: str, data: Data) -> bool:
        """Create object ``key`` holding ``data`` (all of it, atomically, durably), only if absent.

        Returns ``True`` if this call created it, ``False`` if an object already
        existed under ``key`` (left unchanged): a duplicate of content-addressed data,
        or this call's own first attempt whose response was lost.
        """

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object. Raises :class:`ObjectNotFoundError` if absent."""

    @abstractmethod
    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list:
        """Bytes ``[start, end)`` of object ``key`` for each range (byte offsets), in order.

        Returns one bytes-like object (buffer protocol) per range, exactly
        ``end - start`` bytes long. Ranges may overlap and come in any order; close ones
        are fetched together, several requests in parallel.

        Raises:
            InvalidArgumentError: a range that is not ``0 <= start <= end``.
            ObjectNotFoundError: the object is absent.
            BlobCorruptError: a range ends past the object's end (a truncated object).
        """

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size and time of object ``key``, or ``None`` if absent."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object under folder ``prefix`` (whole segments: ``"blobs"`` lists
        ``blobs/…`` but not ``blobsx``; ``""`` lists all), recursively, sorted by key.
        Reserved names (refs, tmp files, the catalog) are never listed."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove object ``key``; removing an absent object is not an error."""

    @abstractmethod
    def read_ref(self, name: str) -> Ref | None:
        """Ref ``name``'s payload and version, read together, or ``None`` if it never existed.

        Raises:
            IntegrityError: the stored ref object is malformed or names another ref.
        """

    @abstractmethod
    def cas_ref(self, name: str, data: bytes, expected: str | None) -> str:
        """Set ref ``name`` to payload ``data`` if its version is still ``expected``
        (``None``: only if the ref does not exist). Returns the new version.

        Raises:
            RefConflictError: the ref moved or was created since ``expected`` was read.
            BackendError: the storage failed and the ref still shows ``expected`` (the
                write did not land; on object storage a request still in flight could
                land later, only on ``expected``, as a normal CAS would).
        """

    def read_cell(self, key: str) -> tuple[bytes, str, float] | None:
        """A **cell**: a small mutable object at plain key ``key`` (not a ref: never listed
        as one), moved only by :meth:`cas_cell`. Returns ``(payload, version, mtime)`` read
        together (``mtime``: seconds since the epoch, the storage's clock), or ``None`` if
        absent. Run leases keep their fencing token in one (:mod:`ckptstore.run`).

        Raises:
            BackendError: this storage has no cells (only object storage has them).
        """
        raise BackendError(f"{self.url}: this storage keeps no cells (conditional objects outside refs)")

    def cas_cell(self, key: str, data: bytes, expected: str | None) -> str:
        """Set cell ``key`` to payload ``data`` if its version is still ``expected``
        (``None``: only if absent), in one conditional write; returns the new version.
        Versions never repeat (each write carries a fresh write id).

        Raises:
            RefConflictError: the cell changed (or was created) since ``expected`` was read.
            BackendError: the storage failed and the cell still shows ``expected``, or
                this storage has no cells.
        """
        raise BackendError(f"{self.url}: this storage keeps no cells (conditional objects outside refs)")

    @abstractmethod
    def list_refs(self) -> list[str]:
        """Every ref name, sorted."""

    def ref_stamps(self) -> dict[str, str | None]:
        """``{ref name: stamp}`` for every ref, from as few requests as the storage allows;
        a stamp differs whenever the ref's object does (an ETag from a listing on object
        storage), so a cache that saw a ref with that stamp may use what it read then.
        ``None``: no stamp is known without reading the ref (this default: one listing)."""
        return dict.fromkeys(self.list_refs())

    def now(self) -> float:
        """The store's clock: seconds since the epoch, as the storage stamps objects.

        Every age on a home (grace periods, marks, orphans) is measured against this, never
        against ``time.time()`` (ARCHITECTURE.md invariant 5: a machine whose clock is wrong
        never shortens a grace period). It writes a tiny probe object ``clock/<random>``,
        reads its modification time and deletes it: three requests. Object stores give
        whole seconds (S3, moto), so the value may be up to one second behind.

        Raises:
            BackendError: the storage failed.
        """
        key = f"clock/{new_write_id()}"
        self.put_new(key, b"")
        try:
            info = self.head(key)
        finally:
            self.delete(key)
        if info is None:
            raise BackendError(f"{self.url}: the clock probe {key} vanished before it could be read")
        return info.mtime

    def close(self) -> None:
        """Release clients and descriptors; the backend is unusable afterwards."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


# --- keys and ranges ------------------------------------------------------------------


def check_key(key: object) -> str:
    """Return ``key`` if it is a valid object key, else raise :class:`InvalidArgumentError`."""
    if type(key) is not str or len(key.encode()) > MAX_KEY_BYTES or not _KEY.fullmatch(key):
        raise InvalidArgumentError(
            f"invalid object key {key!r}: '/'-separated segments of [A-Za-z0-9._%~-], none empty or starting with '.', "
            f"at most {MAX_KEY_BYTES} bytes"
        )
    first = key.split("/", 1)[0]
    if first in RESERVED or first.startswith("catalog"):
        raise InvalidArgumentError(f"invalid object key {key!r}: {first!r} is reserved for the backend")
    return key


def check_prefix(prefix: object) -> str:
    """Return ``prefix`` without a trailing ``/`` if it names a folder of keys (``""``: all)."""
    if prefix == "":
        return ""
    if type(prefix) is not str:
        raise InvalidArgumentError(f"invalid key prefix {prefix!r}: a str")
    return check_key(prefix.rstrip("/") if prefix.endswith("/") and len(prefix) > 1 else prefix)


def check_ranges(ranges: object) -> list[tuple[int, int]]:
    """Return ``ranges`` as a list of ``(start, end)`` ints with ``0 <= start <= end``."""
    try:
        out = [(start, end) for start, end in ranges]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"invalid byte ranges {ranges!r}: a sequence of (start, end) pairs") from None
    for start, end in out:
        if type(start) is not int or type(end) is not int or not 0 <= start <= end:
            raise InvalidArgumentError(f"invalid byte range ({start!r}, {end!r}): need integers 0 <= start <= end")
    return out


def as_parts(data: object) -> list[memoryview]:
    """``data`` (bytes-like or a sequence of them) as a list of byte views."""
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            return [memoryview(data).cast("B")]
        return [memoryview(p).cast("B") for p in data]  # type: ignore[union-attr]
    except TypeError:
        raise InvalidArgumentError(f"object data must be bytes-like or a sequence of bytes-like objects, not {type(data).__name__}") from None


# --- ref names ------------------------------------------------------------------------


def check_ref_name(name: object) -> str:
    """Return ``name`` if it can name a ref (1 to 255 characters of UTF-8, no NUL)."""
    if type(name) is not str or not 1 <= len(name) <= MAX_REF_NAME or "\x00" in name:
        raise InvalidNameError(f"invalid ref name {name!r}: 1 to {MAX_REF_NAME} characters without NUL")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidNameError(f"invalid ref name {name!r}: not encodable as UTF-8") from None
    return name


def ref_segment(name: str) -> str:
    """The key segment of ref ``name``: each UTF-8 byte outside ``[A-Za-z0-9_-]`` as
    ``%XX``; over 200 bytes, ``~`` and the XXH3-128 of the name (the name is in the object)."""
    raw = check_ref_name(name).encode("utf-8")
    seg = "".join(chr(b) if b in _PLAIN else f"%{b:02X}" for b in raw)
    return seg if len(seg) <= MAX_ESCAPED_REF else "~" + digest(raw).hex()


def ref_name(segment: str) -> str | None:
    """The ref name a key segment stands for; ``None`` for a hashed (``~``) segment,
    whose name only its object holds. Raises :class:`IntegrityError` for a segment no
    name escapes to."""
    if segment.startswith("~"):
        return None
    try:
        raw = bytearray()
        i = 0
        while i < len(segment):
            c = segment[i]
            if c == "%":
                raw.append(int(segment[i + 1 : i + 3], 16))
                if len(segment[i + 1 : i + 3]) != 2:
                    raise ValueError
                i += 3
            else:
                if ord(c) not in _PLAIN:
                    raise ValueError
                raw.append(ord(c))
                i += 1
        name = raw.decode("utf-8")
        if ref_segment(name) != segment:
            raise ValueError
    except (ValueError, UnicodeDecodeError, InvalidNameError):
        raise IntegrityError(f"ref key segment {segment!r} is not the escape of any ref name") from None
    return name


# --- ref objects ------------------------------------------------------------------------


def new_write_id() -> str:
    """A random write id (32 hex digits)."""
    return uuid.uuid4().hex


def encode_ref(name: str, write: str, data: bytes, prev: str | None = None) -> bytes:
    """A ref object: its JSON header line, then payload ``data`` (bytes)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"a ref payload must be bytes-like, not {type(data).__name__}")
    header = {"name": name, "prev": prev, "v": REF_FORMAT, "write": write}
    return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode() + b"\n" + bytes(data)


@dataclass(frozen=True)
class RefObject:
    """A parsed ref object: its name, write id, previous version's write id (or ``None``) and payload."""

    name: str
    write: str
    prev: str | None
    data: bytes


def decode_ref(raw: bytes, where: str, name: str | None = None) -> RefObject:
    """Parse and check a ref object read at ``where`` (for messages); ``name``, if
    given, must be the name it holds.

    Raises:
        IntegrityError: a malformed header, unknown format version, or another ref's name.
    """
    raw = bytes(raw)
    end = raw.find(b"\n", 0, MAX_REF_HEADER)
    if end < 0:
        raise IntegrityError(f"{where}: not a ckptstore ref object (no header line in its first {MAX_REF_HEADER} bytes)")
    try:
        header = json.loads(raw[:end].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise IntegrityError(f"{where}: not a ckptstore ref object (its header is not JSON)") from None
    if type(header) is not dict or set(header) != {"name", "prev", "v", "write"}:
        raise IntegrityError(f"{where}: not a ckptstore ref object (header fields {sorted(header) if type(header) is dict else header!r})")
    if header["v"] != REF_FORMAT or type(header["v"]) is not int:
        raise IntegrityError(f"{where}: unsupported ref object format version {header['v']!r} (this library reads {REF_FORMAT})")
    write, prev, held = header["write"], header["prev"], header["name"]
    if type(write) is not str or not _WRITE_ID.fullmatch(write) or not (prev is None or (type(prev) is str and _WRITE_ID.fullmatch(prev))):
        raise IntegrityError(f"{where}: malformed write ids in the ref object header")
    try:
        check_ref_name(held)
    except InvalidNameError:
        raise IntegrityError(f"{where}: the ref object holds an invalid name {held!r}") from None
    if name is not None and held != name:
        raise IntegrityError(f"{where}: the ref object is for ref {held!r}, not {name!r}")
    return RefObject(held, write, prev, raw[end + 1 :])


# --- the read-modify-CAS loop --------------------------------------------------------------


def update_ref(
    backend: Backend,
    name: str,
    update: Callable[[bytes | None], bytes],
    attempts: int = 50,
    backoff: float = 0.005,
    max_backoff: float = 0.5,
) -> tuple[bytes, str]:
    """Move ref ``name`` by read, ``update(current payload or None) -> new payload``, CAS;
    on a lost race, wait (jittered exponential backoff: ``backoff`` seconds doubling to
    ``max_backoff``) and start again with the ref's new payload.

    ``update`` may run several times and must be a pure function of its argument.
    Returns ``(new payload, new version)``.

    Raises:
        RefBusyError: every one of ``attempts`` CASes lost a race.
        InvalidArgumentError: ``attempts`` below 1.
    """
    if type(attempts) is not int or attempts < 1:
        raise InvalidArgumentError(f"invalid attempts {attempts!r}: a positive integer")
    for attempt in range(attempts):
        current = backend.read_ref(name)
        data = update(None if current is None else current.data)
        try:
            return data, backend.cas_ref(name, data, None if current is None else current.version)
        except RefConflictError:
            if attempt + 1 < attempts:
                time.sleep(RANDOM.uniform(0, min(max_backoff, backoff * 2**attempt)))
    raise RefBusyError(f"ref {name!r} at {backend.url} kept moving: {attempts} attempts to update it all lost a race to other writers")
