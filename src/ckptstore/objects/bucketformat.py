"""The format of a store on object storage (docs/design.md, "Object storage"): the objects
a store keeps under a :class:`~ckptstore.backends.Backend` and their bytes, shared by the
bucket home (:mod:`ckptstore.home.bucket`), push and pull (:mod:`ckptstore.protocols.remote`), the refs
(:class:`~ckptstore.home.refs.BucketRefs`), recover and fsck.

A store on object storage is a :class:`~ckptstore.backends.Backend` (``s3://bucket/prefix``,
or a folder through :class:`~ckptstore.backends.LocalBackend`) holding the key layout of the
design: ``ckptstore.json``, ``blobs/<xx>/<id>.pack`` + ``.idx``, ``commits/<xx>/<cid>``,
``refs/<tag>``, ``reflog/<tag>/<at>-<write id>`` and ``gc/<run id>.json``. This module
knows only that interface: no path, no S3 client, no protocol. It holds:

- the store marker ``ckptstore.json`` and its copy (:func:`read_marker`, :func:`ensure_marker`,
  :func:`marker_problem`, :func:`repair_marker`);
- the payload of a tag (:func:`ref_payload`, :func:`read_tag_hint`) and of a ref move
  (:func:`reflog_bytes`, :func:`parse_reflog`);
- a commit record fetched and checked against its id (:func:`fetch_record`, :func:`commit_key`);
- the entries of a pack, from its ``.idx`` or the pack walked (:func:`pack_entries`,
  :func:`repair_index`), and every pack's entries with the GC marks (:class:`RemoteIndex`);
- the GC marks, read once for the GC, commits and push, with the rule for a mark that cannot
  be read (:func:`read_gc_marks`, :class:`GCMarks`);
- packs assembled in memory and uploaded whole, then their ``.idx`` (:class:`BucketPackWriter`,
  the upload sink of :class:`~ckptstore.objects.packs.EntryWriter`).
"""

from __future__ import annotations

import json
import re
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from ..backends import Backend
from ..backends.base import ref_segment
from ..core.errors import (
    BlobCorruptError,
    BlobMissingError,
    IntegrityError,
    InvalidNameError,
    NotAStoreError,
    ObjectNotFoundError,
)
from ..core.layout import address, digest
from .packindex import decode_index, encode_index, index_key, pack_key, scan_pack
from .packs import (
    BLOB_MAGIC,
    BlobLoc,
    Entry,
    EntryWriter,
    OpenPack,
    check_entry,
    pack_header,
)
from .records import CommitRecord, commit_id, parse_commit


class Settings(Protocol):
    """What the marker's writers read of a store (a home, or the store facade): its settings."""

    shard_bytes: int
    compression_level: int


MARKER = "ckptstore.json"
FORMAT_VERSION = 1
#: Bytes: a pack pushed to object storage rolls over past this size (several upload in parallel on S3).
PACK_BYTES = 64 << 20
#: Packs uploaded at a time by a push or a commit to object storage.
UPLOADS = 4
#: Parallel small requests (heads, refs, indexes); packs upload ``UPLOADS`` at a time.
REQUESTS = 16
_CID = re.compile(r"[0-9a-f]{32}")


def commit_key(cid: str) -> str:
    """The object key of commit ``cid``'s record."""
    return f"commits/{cid[:2]}/{cid}"


# --- the store marker and refs ------------------------------------------------------------


_MARKER_KEYS = {"compression_level", "digest", "format", "shard_bytes", "version"}
#: A copy of the marker, written before it: a damaged ``ckptstore.json`` is restored from it.
MARKER_COPY = "marker/ckptstore.json"


def _sealed(body: dict) -> bytes:
    """``body`` as canonical JSON with ``digest``: the XXH3-128 (hex) of the same JSON without it."""
    return json.dumps({**body, "digest": digest(json.dumps(body, sort_keys=True).encode()).hex()}, sort_keys=True).encode()


def _seal_broken(m: dict) -> bool:
    """Does ``m`` (parsed from :func:`_sealed` bytes) fail its digest?"""
    return digest(json.dumps({k: v for k, v in m.items() if k != "digest"}, sort_keys=True).encode()).hex() != m.get("digest")


def marker_bytes(shard_bytes: int, compression_level: int) -> bytes:
    """The marker's bytes: canonical JSON with ``digest``, the XXH3-128 (hex) of the same
    JSON without it, so one flipped byte is detected instead of read as another setting."""
    return _sealed({"compression_level": compression_level, "format": "ckptstore", "shard_bytes": shard_bytes, "version": FORMAT_VERSION})


def parse_marker(raw: bytes, where: str) -> dict:
    """The settings in marker bytes ``raw``.

    Raises:
        IntegrityError: the bytes are damaged (not JSON, or not matching their digest).
        NotAStoreError: an intact marker of another format or version (markers written
            before digests existed have none and are taken as they read).
    """
    try:
        marker = json.loads(raw)
    except ValueError:
        raise IntegrityError(f"{where} is damaged (not JSON)") from None
    if type(marker) is dict and (set(marker) - _MARKER_KEYS or "digest" in marker):  # a flipped key name is damage too
        if set(marker) - _MARKER_KEYS or _seal_broken(marker):
            raise IntegrityError(f"{where} is damaged (its bytes do not match its digest)")
    if type(marker) is not dict or marker.get("format") != "ckptstore":
        raise NotAStoreError(f"{where} is not a ckptstore store marker")
    if marker.get("version") != FORMAT_VERSION:
        raise NotAStoreError(f"{where}: store format version {marker.get('version')!r}; this library reads {FORMAT_VERSION}")
    return marker


def _read_one(backend: Backend, key: str) -> dict | None | IntegrityError:
    try:
        return parse_marker(backend.get(key), f"{backend.url}: {key}")
    except ObjectNotFoundError:
        return None
    except IntegrityError as exc:
        return exc


def _holds_a_store(backend: Backend) -> bool:
    return bool(backend.list_refs() or backend.list("commits"))


def read_marker(backend: Backend) -> dict | None:
    """The remote's store settings from ``ckptstore.json`` (or, where that is missing or
    damaged, from its copy :data:`MARKER_COPY`; where both are, and the prefix holds refs or
    commit records, the defaults, so that no data becomes unreachable for a damaged
    marker: fsck reports it and ``fsck --repair`` rewrites it). ``None``: an empty prefix.

    Raises:
        NotAStoreError: an intact marker of another format, or a damaged one in a prefix
            that holds no store.
    """
    first = _read_one(backend, MARKER)
    if isinstance(first, dict):
        return first
    copy = _read_one(backend, MARKER_COPY)
    if isinstance(copy, dict):
        return copy
    if first is None and copy is None and not _holds_a_store(backend):
        return None
    if not _holds_a_store(backend):
        raise NotAStoreError(f"{backend.url}: {MARKER} is not a ckptstore store marker ({first or copy})")
    return {"format": "ckptstore", "version": FORMAT_VERSION, "shard_bytes": None, "compression_level": None}


def marker_problem(backend: Backend) -> str | None:
    """What is wrong with the marker and its copy, or ``None`` (a store from before the copy
    existed, without one, is fine)."""
    first, copy = _read_one(backend, MARKER), _read_one(backend, MARKER_COPY)
    problems = []
    if isinstance(first, IntegrityError):
        problems.append(str(first))
    elif first is None and _holds_a_store(backend):
        problems.append(f"{backend.url}: {MARKER} is missing, though the prefix holds a store")
    if isinstance(copy, IntegrityError):
        problems.append(str(copy))
    elif copy is None and first is not None and not isinstance(first, dict):
        problems.append(f"{backend.url}: {MARKER_COPY} is missing")
    return "; ".join(problems) or None


def repair_marker(backend: Backend, store: Settings) -> None:
    """Rewrite a missing or damaged marker (or its copy) from the intact one.

    Raises:
        IntegrityError: neither is intact: the store's settings cannot be read back from
            the bucket, so nothing is rewritten (guessing would silently change the shard
            size, and with it every later commit's dedup); the store still reads and commits.
    """
    good = next((m for m in (_read_one(backend, MARKER), _read_one(backend, MARKER_COPY)) if isinstance(m, dict)), None)
    if good is None:
        raise IntegrityError(f"{backend.url}: {MARKER} and its copy {MARKER_COPY} are both missing or damaged: the store's settings "
                             "(shard size, compression level) cannot be read back, so neither is rewritten; reads and commits still work")
    data = marker_bytes(good.get("shard_bytes") or store.shard_bytes, good.get("compression_level", store.compression_level))
    for key in (MARKER_COPY, MARKER):
        if not isinstance(_read_one(backend, key), dict):
            backend.delete(key)
            backend.put_new(key, data)


def ensure_marker(backend: Backend, local: Settings) -> int:
    """Write ``ckptstore.json`` (and first its copy; create-only) if the remote has none;
    returns the bytes written (0 if it had one)."""
    data = marker_bytes(local.shard_bytes, local.compression_level)
    written = len(data) * backend.put_new(MARKER_COPY, data)
    if backend.put_new(MARKER, data):
        return written + len(data)
    read_marker(backend)  # another writer made it first: it must be ours
    return written


def complete_marker(backend: Backend) -> bool:
    """Write ``ckptstore.json`` from its intact copy if it is missing: a first writer killed
    between its two create-only PUTs (the copy goes first) left the store without it. A
    damaged marker is left alone (create-only; ``fsck --repair`` rewrites it), and nothing is
    guessed when the copy is not intact. One HEAD when the marker is there; returns whether
    it was written.

    Raises:
        BackendError: the storage failed.
    """
    if backend.head(MARKER) is not None or not isinstance(_read_one(backend, MARKER_COPY), dict):
        return False
    return backend.put_new(MARKER, backend.get(MARKER_COPY))


_MOVE_KEYS = {"action", "at", "digest", "new", "old", "tag"}


def reflog_bytes(tag: str, old: str | None, new: str | None, action: str, at: float) -> bytes:
    """A ref-move record's bytes, ``reflog/<escaped tag>/<20-digit ns time>-<random 32 hex>``:
    canonical JSON ``{"action", "at", "new", "old", "tag"}`` and ``digest``, the XXH3-128 (hex)
    of the same JSON without it, so a flipped byte is detected (records written before
    digests existed have none and are checked by their structure alone)."""
    return _sealed({"action": action, "at": at, "new": new, "old": old, "tag": tag})


def parse_reflog(raw: bytes, key: str, where: str) -> dict:
    """The ref move in reflog object ``key``'s bytes: ``{"action", "at", "new", "old", "tag"}``.

    Raises:
        IntegrityError: not a ref-move record of the tag its key names (damaged).
    """
    bad = IntegrityError(f"{where}: {key} is not a ref-move record (damaged)")
    try:
        m = json.loads(raw)
    except ValueError:
        raise bad from None
    if type(m) is not dict or set(m) - _MOVE_KEYS or not {"action", "at", "new", "old", "tag"} <= set(m):
        raise bad
    if "digest" in m and _seal_broken(m):
        raise bad
    ok = (type(m["tag"]) is str and type(m["action"]) is str and type(m["at"]) in (int, float)
          and all(m[f] is None or (type(m[f]) is str and _CID.fullmatch(m[f])) for f in ("new", "old")))
    try:
        ok = ok and key.split("/")[1] == ref_segment(m["tag"])
    except (IndexError, InvalidNameError):
        ok = False
    if not ok:
        raise bad
    return {k: v for k, v in m.items() if k != "digest"}


def ref_payload(cid: str | None, previous: str | None, action: str, at: float, packs: list[str] | None = None) -> bytes:
    """A remote tag's payload: ``{"action", "at", "commit", "previous"}`` as JSON (``commit``
    null: deleted), and optionally ``packs``: the ids of the packs that held the commit's
    blobs when the tag moved (a hint that spares a fresh reader the other packs' indexes)."""
    body = {"action": action, "at": at, "commit": cid, "previous": previous}
    if packs:
        body["packs"] = packs
    return json.dumps(body, sort_keys=True).encode()


def read_tag_hint(backend: Backend, name: str) -> tuple[str | None, str | None, list[str]]:
    """``(commit id or None, version or None, pack ids hint)`` of remote tag ``name`` (a
    deleted tag: no commit, its version; no hint: ``[]``).

    Raises:
        IntegrityError: the ref's payload is not a tag payload.
    """
    ref = backend.read_ref(name)
    if ref is None:
        return None, None, []
    try:
        payload = json.loads(ref.data)
        cid = payload["commit"]
        if not (cid is None or (type(cid) is str and _CID.fullmatch(cid))):
            raise ValueError
        packs = payload.get("packs", [])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise IntegrityError(f"{backend.url}: tag {name!r} holds a malformed payload") from None
    ok = type(packs) is list and all(type(p) is str and _CID.fullmatch(p) for p in packs)
    return cid, ref.version, packs if ok else []  # a bad hint is only a slower read


def read_tag(backend: Backend, name: str) -> tuple[str | None, str | None]:
    """``(commit id or None, version or None)`` of remote tag ``name`` (see :func:`read_tag_hint`)."""
    return read_tag_hint(backend, name)[:2]


def fetch_record(backend: Backend, cid: str, why: str = "") -> CommitRecord:
    """Commit ``cid``'s record from the remote, checked against its id.

    Raises:
        IntegrityError: the record is missing, does not hash to ``cid``, or is malformed.
    """
    key = commit_key(cid)
    try:
        raw = backend.get(key)
    except ObjectNotFoundError:
        raise IntegrityError(f"{backend.url}: commit {cid}{why} is missing (no object {key})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise IntegrityError(f"{backend.url}: {key}: the record of commit {cid} is not UTF-8 text") from None
    if commit_id(text) != cid:
        raise IntegrityError(f"{backend.url}: {key}: the record does not hash to commit id {cid} (damaged or forged)")
    try:
        return parse_commit(text, cid)
    except IntegrityError as exc:
        raise IntegrityError(f"{backend.url}: {key}: {exc}") from None


# --- the remote's pack indexes --------------------------------------------------------------


@dataclass
class PackEntries:
    """What is known of one pack on the remote: its ``entries`` (``None``: the pack itself
    cannot be read or walked), and ``index_problem``: why its ``.idx`` could not be used
    (missing or damaged; ``None`` when it was), in which case ``entries`` come from
    walking the pack itself."""

    entries: list[Entry] | None
    index_problem: str | None = None
    pack_problem: str | None = None


def pack_entries(backend: Backend, pid: str, size: int, has_index: bool = True) -> PackEntries:
    """The entries of pack ``pid`` (``size`` bytes, as listed): from its ``.idx`` when that
    is present and passes :func:`~ckptstore.objects.packindex.decode_index`, else by reading the
    whole pack and walking it (:func:`~ckptstore.objects.packindex.scan_pack`; packs are
    self-describing, so a lost or damaged index never makes data unreachable: invariant 4).

    Never raises for damage (it is reported in the result); raises only:
        BackendError: the storage failed.
    """
    problem = None
    if has_index:
        try:
            return PackEntries(decode_index(backend.get(index_key(pid)), pid, size, f"{backend.url}: {index_key(pid)}"))
        except ObjectNotFoundError:
            problem = f"{index_key(pid)} is missing"
        except BlobCorruptError as exc:
            problem = str(exc)
    else:
        problem = f"{index_key(pid)} is missing"
    try:
        return PackEntries(scan_pack(backend.get(pack_key(pid)), pid, f"{backend.url}: {pack_key(pid)}"), problem)
    except ObjectNotFoundError:
        return PackEntries(None, problem, f"{pack_key(pid)} is gone")
    except BlobCorruptError as exc:
        return PackEntries(None, problem, str(exc))


def repair_index(backend, pid: str, entries) -> None:
    """Replace pack ``pid``'s missing or damaged ``.idx`` by one encoded from ``entries``
    (walked from the pack itself). Indexes are derived data: the damaged copy is deleted
    and the rebuilt one written create-only."""
    backend.delete(index_key(pid))
    backend.put_new(index_key(pid), encode_index(entries))


# --- the GC marks ---------------------------------------------------------------------------


#: The key prefix of the GC marks: ``gc/<20-digit ns time>-<uuid>.json``.
GC_PREFIX = "gc"


@dataclass(frozen=True)
class GCMarks:
    """The GC marks of a store, read at one moment, and the one rule for a mark that cannot be read.

    A mark names what a GC deletes a grace period later if it is still unneeded then: on a
    bucket ``gc/<time>-<uuid>.json`` = ``{"at", "packs", "commits", "objects", "reflog"}``
    (:func:`read_gc_marks`); in a folder a pack's ``retired_at`` in the catalog
    (:func:`ckptstore.home.local.retired_marks`). A mark is *readable* when it is a JSON
    object whose ``packs`` and ``commits`` are lists of strings (``objects`` and
    ``reflog``, when present, lists; their malformed items are dropped), or, in a folder,
    a finite number. **A mark that cannot be read** (damaged bytes, another shape, a key
    listed but gone when fetched: a GC swept it, and what it named may be gone too)
    **withholds every pack it may name, and deletes none**:

    * writers (a commit's dedup, push) reuse no blob from a pack it may name, and write
      those blobs again (:meth:`withholds`): on a bucket, where its names are in its
      unreadable bytes, every pack created no later than the mark (a GC names only packs
      it listed, older than its grace period: a pack written after the mark, such as the
      writer's new copy, it cannot name); in a folder, the pack whose row holds it;
    * a GC deletes nothing on its account: a sweep goes only by readable marks a grace
      period old (:meth:`oldest`), and removes a damaged mark itself (a bucket's sweep
      deletes the object; a folder's GC marks the pack again), so the next GC marks again
      whatever is still dead.

    Attributes:
        marks: ``(time, key, mark)`` of every readable mark: the time it was made (the
            server's, seconds), its key (the pack id in a folder), the mark's fields
            ``{"packs", "commits", "objects", "reflog"}`` (lists).
        unreadable: ``(key, time, packs)`` of every damaged mark: the time it was made
            (``None``: unknown) and the packs it may name (``None``: any pack made no later).
        vanished: ``(key, time)`` of the marks listed but gone when fetched (they may have
            named any pack made no later).
    """

    marks: tuple = ()
    unreadable: tuple = ()
    vanished: tuple = ()

    @cached_property
    def packs(self) -> frozenset:
        """The pack ids the readable marks name."""
        return frozenset(p for _, _, mark in self.marks for p in mark["packs"])

    @property
    def withholds_all(self) -> bool:
        """Does a mark that cannot be read withhold every pack (made no later than it)?"""
        return bool(self.vanished) or any(names is None for _, _, names in self.unreadable)

    def withholds(self, pack: str, created: float | None = None) -> bool:
        """May a writer not reuse blobs from pack ``pack`` (a mark names it, or may)?
        ``created``: when the pack was made (the server's time, seconds; ``None``: unknown,
        as old as any mark)."""
        if pack in self.packs:
            return True
        may = [(at, names) for _, at, names in self.unreadable] + [(at, None) for _, at in self.vanished]
        return any((names is None or pack in names) and (created is None or at is None or created <= at) for at, names in may)

    def __contains__(self, pack: str) -> bool:
        return self.withholds(pack)

    def oldest(self, field_: str = "packs") -> dict:
        """``{name: time of the oldest readable mark naming it}`` for one field of the marks
        (``"packs"``, ``"commits"``): what a sweep goes by."""
        out: dict = {}
        for at, _, mark in self.marks:
            for x in mark[field_]:
                out[x] = min(out.get(x, at), at)
        return out


def parse_gc_mark(raw: bytes) -> dict | None:
    """The fields of a bucket's GC mark from its bytes, ``{"packs", "commits", "objects",
    "reflog"}`` (lists), or ``None`` when it cannot be read (see :class:`GCMarks`)."""
    try:
        mark = json.loads(raw)
    except ValueError:
        return None
    if type(mark) is not dict:
        return None
    packs, commits, objects, reflog = mark.get("packs"), mark.get("commits"), mark.get("objects", []), mark.get("reflog", [])
    if not (type(packs) is list and type(commits) is list and type(objects) is list and type(reflog) is list):
        return None
    if not all(type(p) is str for p in packs + commits):
        return None
    return {"packs": packs, "commits": commits, "objects": [x for x in objects if type(x) is str],
            "reflog": [x for x in reflog if type(x) is list and len(x) == 3 and type(x[0]) is str and x[0].startswith("reflog/")]}


def read_gc_marks(backend: Backend) -> GCMarks:
    """Every GC mark on the bucket (``gc/*``, listed then fetched), by the rule of :class:`GCMarks`:
    what the GC's sweep goes by, and what a commit (:meth:`ckptstore.home.bucket.BucketHome.marked_packs`)
    and a push (:meth:`RemoteIndex.read_marks`) must not reuse.

    Raises:
        BackendError: the storage failed.
    """
    marks, unreadable, vanished = [], [], []
    for o in backend.list(GC_PREFIX):
        try:
            mark = parse_gc_mark(backend.get(o.key))
        except ObjectNotFoundError:
            vanished.append((o.key, o.mtime))
            continue
        if mark is None:
            unreadable.append((o.key, o.mtime, None))
        else:
            marks.append((o.mtime, o.key, mark))
    return GCMarks(tuple(marks), tuple(unreadable), tuple(vanished))


class RemoteIndex:
    """Which blobs the remote holds, and where: read from every ``blobs/<xx>/<id>.idx``.

    A pack whose ``.idx`` is missing or damaged is walked instead (:func:`pack_entries`). Blobs in packs
    listed by a GC mark (``gc/<run id>.json``, ``{"packs": [pack ids], ...}``) are not
    offered for reuse (:meth:`reusable`); a mark that cannot be read withholds every pack
    (the rule of :class:`GCMarks`).
    """

    def __init__(self, backend: Backend, workers: int = 8):
        self.backend = backend
        self.workers = workers
        self.blobs: dict[tuple[bytes, int], BlobLoc] = {}
        self.marks = GCMarks()
        self.created: dict[str, float] = {}  # pack id -> when it was made (the server's time)

    def refresh(self) -> RemoteIndex:
        """List ``blobs/`` and ``gc/`` and learn every pack's entries (:func:`pack_entries`:
        its ``.idx``, checked, or the pack itself where the index is missing or damaged; a
        pack that cannot be read is not used).

        Raises:
            BackendError: the storage failed.
        """
        listed = {o.key: o for o in self.backend.list("blobs")}
        objects = {k: o.size for k, o in listed.items()}
        todo = [(k.rsplit("/", 1)[1][:-5], size) for k, size in objects.items() if k.endswith(".pack")]
        self.created.update((k.rsplit("/", 1)[1][:-5], o.mtime) for k, o in listed.items() if k.endswith(".pack"))

        def load(job):
            pid, size = job
            return pack_entries(self.backend, pid, size, index_key(pid) in objects).entries or []

        with ThreadPoolExecutor(self.workers) as pool:
            for entries in pool.map(load, todo):
                for e in entries:
                    if e.magic == BLOB_MAGIC:
                        self.blobs.setdefault((e.loc.digest, e.loc.raw_len), e.loc)
        self.read_marks()
        return self

    def read_marks(self) -> GCMarks:
        """Re-read the GC marks (:func:`read_gc_marks`); ``pack in`` the result: a mark names it, or may."""
        self.marks = read_gc_marks(self.backend)
        return self.marks

    @property
    def all_marked(self) -> bool:
        """Does a mark that cannot be read withhold every pack (as last read)?"""
        return self.marks.withholds_all

    def reusable(self, key: tuple[bytes, int]) -> BlobLoc | None:
        """Where the remote holds blob ``key`` in a pack no GC mark names (nor may name), or ``None``."""
        loc = self.blobs.get(key)
        if loc is None or self.marks.withholds(loc.pack, self.created.get(loc.pack)):
            return None
        return loc

    def fetch(self, keys: list[tuple[bytes, int]], where: str) -> dict[tuple[bytes, int], tuple[BlobLoc, memoryview]]:
        """Blobs ``keys`` as stored, ``{key: (remote location, payload)}``, each checked
        against its entry header and rehashed; one coalesced ranged read per pack.

        Raises:
            BlobMissingError: a blob no index lists (names it and ``where``).
            BlobCorruptError: a blob whose bytes or header do not match.
        """
        by_pack: dict[str, list[BlobLoc]] = {}
        for key in keys:
            loc = self.blobs.get(key)
            if loc is None:
                raise BlobMissingError(f"{self.backend.url}: {where}, blob {address(*key)} is in no pack index of the remote")
            by_pack.setdefault(loc.pack, []).append(loc)
        out = {}
        for pid, locs in by_pack.items():
            got = self.backend.get_ranges(pack_key(pid), [loc.span for loc in locs])
            for loc, buf in zip(locs, got):
                payload = check_entry(buf, loc, f"{self.backend.url}: {where}, pack {pid}")
                out[(loc.digest, loc.raw_len)] = (loc, payload)
        return out


# --- writing packs --------------------------------------------------------------------------


class _MemPack(OpenPack):
    def __init__(self):
        super().__init__(uuid.uuid4().hex)
        self.parts: list | None = [pack_header()]  # None once handed to its upload


class BucketPackWriter(EntryWriter):
    """The :class:`~ckptstore.objects.packs.EntryWriter` into object storage (a bucket store's
    commits, and push), with :class:`~ckptstore.objects.packs.PackWriter`'s interface; thread-safe.

    Entries are appended to a pack held in memory; a pack past ``pack_bytes`` is
    uploaded in the background (create-only PUT of the pack, then of its ``.idx``) while
    the next one fills, at most :data:`UPLOADS` of this writer's packs waiting or uploading
    at a time (an append that would ship one more waits): a commit holds a bounded number
    of packs in memory, not all of its new blobs. :meth:`append` copies the caller's bytes
    (a view of a live tensor, which training may write before the pack is uploaded) and
    hashes the copy: what is uploaded is what was hashed (invariant 14).
    :meth:`append_encoded` keeps the payload it is given, which must not change until
    :meth:`finish` (``bytes``, or a view of them). :meth:`finish` uploads the last pack and
    waits: every pack is then durable. Nothing is ever deleted: a commit that does not land
    leaves unreferenced packs, which GC removes after the grace period.

    Raises:
        BackendError: an upload failed after the client's retries (from :meth:`finish`).
    """

    def __init__(self, backend: Backend, level: int, pack_bytes: int, uploads: ThreadPoolExecutor):
        super().__init__(level, pack_bytes)
        self.backend, self._uploads = backend, uploads
        self._futures: list[Future] = []
        self.objects_uploaded = 0  # packs and .idx handed to the uploads (durable once finish() returns)
        self.bytes_uploaded = 0

    def _stage(self, raw) -> memoryview:
        """A copy of its own (the pack holds it until it is uploaded, unless it compresses)."""
        return memoryview(raw if isinstance(raw, bytes) else bytes(raw))

    def _new_pack(self) -> _MemPack:
        return _MemPack()

    def _place(self, pack: _MemPack, header: bytes, payload) -> None:
        pack.parts += (header, payload)

    def _seal(self, pack: _MemPack) -> None:
        idx = encode_index(pack.entries)
        parts, pack.parts = pack.parts, None
        self.objects_uploaded += 2
        self.bytes_uploaded += pack.size + len(idx)

        def upload() -> None:
            self.backend.put_new(pack_key(pack.id), parts)
            self.backend.put_new(index_key(pack.id), idx)

        self._futures.append(self._uploads.submit(upload))
        busy = [f for f in self._futures if not f.done()]
        if len(busy) > UPLOADS:  # memory: wait for one to land (its error, if any, is raised by finish)
            wait(busy, return_when=FIRST_COMPLETED)

    def finish(self) -> None:
        """Upload the open pack and wait until every pack and ``.idx`` is on the bucket."""
        with self._lock:
            if self._packs and not self._packs[-1].sealed:
                self._packs[-1].sealed = True
                self._seal(self._packs[-1])
            futures, self._futures = self._futures, []
        for f in futures:
            f.result()

    def discard(self) -> None:
        """Nothing to undo: unreferenced packs are GC's (after the grace period)."""
        self.close()

    def close(self) -> None:
        with self._lock:
            futures, self._futures = self._futures, []
            self._packs = [p for p in self._packs if p.sealed]  # the open pack is dropped, never uploaded
        for f in futures:
            f.exception()


__all__ = ["FORMAT_VERSION", "MARKER", "MARKER_COPY", "PACK_BYTES", "REQUESTS", "UPLOADS", "BucketPackWriter", "GCMarks", "PackEntries", "RemoteIndex", "commit_key",
           "complete_marker", "ensure_marker", "fetch_record", "marker_bytes", "marker_problem", "pack_entries", "parse_marker",
           "parse_gc_mark", "parse_reflog", "read_gc_marks", "read_marker", "read_tag", "read_tag_hint", "ref_payload", "reflog_bytes", "repair_index", "repair_marker"]
