"""The refs of a home: read, list and move tags by compare-and-swap, each move leaving a
reflog record (docs/design.md, "The refs of a home").

A tag is the only mutable thing in a store. :class:`Refs` is the one interface the store
facade moves tags through (``Store.tag``, ``delete_tag``, ``resolve``, ``tags``, ``reflog``
and a commit's tag move are written once against it); two homes implement it:

- :class:`CatalogRefs` (a local store): tags are rows of the catalog, moved inside one
  ``BEGIN IMMEDIATE`` transaction with a ``reflog`` row and a ref-move record in the
  transaction's pack. A commit passes its own transaction (``txn``), so its index rows
  and its tag moves commit as one transaction, as they always did.
- :class:`BucketRefs` (a store on object storage): tags are ref objects
  (``refs/<escaped name>``) moved by conditional PUT from the version read, each move
  followed by a reflog object; the cache's ``tags`` table mirrors the values read, and
  ``refs.json`` in the cache folder keeps each ref's ETag so that listing reads only the
  refs that changed.

Moves can be **fenced** (docs/design.md, "Fenced writers"): inside :func:`fenced`, every
move of a tag first passes the :class:`Fence` of the run's holder (its fencing token,
kept by :mod:`ckptstore.run`), in the same atomic step where the home allows one (locally
inside the catalog transaction that moves the tags; on object storage as a conditional
write of the run's token cell that records the moves before they are made).

This module knows the catalog, the backend and the remote ref formats
(:mod:`ckptstore.objects.bucketformat`'s payload and reflog helpers); never the store.
"""

from __future__ import annotations

import json
import re
import time
import uuid
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..backends.base import check_ref_name, ref_segment
from ..core.errors import (
    AmbiguousRefError,
    BackendError,
    IntegrityError,
    InvalidNameError,
    ObjectNotFoundError,
    RefBusyError,
    RefConflictError,
    ReflogWarning,
    RefNotFoundError,
)
from ..objects import records
from ..objects.bucketformat import commit_key, parse_reflog, read_tag, read_tag_hint, ref_payload, reflog_bytes

if TYPE_CHECKING:
    from ..backends import Backend
    from .catalog import Catalog

#: The expectation "whatever the tag names now" (no compare-and-swap against the caller's value).
ANY: Any = ...
#: Seconds a move on object storage keeps retrying its compare-and-swap against other writers.
CAS_SECONDS = 60.0
_CID = re.compile(r"[0-9a-f]{32}")
_HEX = re.compile(r"[0-9a-f]+")
_UPSERT = ("INSERT INTO tags(name, commit_id, updated_at) VALUES (?, ?, ?) "
           "ON CONFLICT(name) DO UPDATE SET commit_id = excluded.commit_id, updated_at = excluded.updated_at")

#: ``{tag: (expected commit or None or ANY, new commit or None)}``: a set of moves (``None``
#: expected: no such tag yet; ``None`` new: delete).
Moves = Mapping[str, tuple[Any, "str | None"]]


class Fence(ABC):
    """What a fenced tag move passes: the fencing token of one holder of a run
    (:mod:`ckptstore.run` makes them: one per home). ``token`` only grows over the run's
    whole life; a holder whose token is no longer the run's newest is taken over."""

    token: int

    @abstractmethod
    def guard(self, moves: list[dict]) -> AbstractContextManager[None]:
        """The scope of one atomic step of tag moves ``moves`` (``{"tag", "old", "version",
        "new", "action", "packs"}`` each; ``version`` only on object storage). Entering it
        raises :class:`~ckptstore.core.errors.RunTakenOverError` when a newer token was issued
        (locally: read inside the catalog transaction that moves the tags; on object
        storage: a conditional write of the run's token cell recording ``moves``, so a
        newer holder completes them before it reads anything, or this write fails)."""


_FENCE: ContextVar[Fence | None] = ContextVar("ckptstore_fence", default=None)


@contextmanager
def fenced(fence: Fence | None) -> Iterator[None]:
    """Every tag move this thread (context) makes inside the scope passes ``fence``
    (``None``: unfenced)."""
    token = _FENCE.set(fence)
    try:
        yield
    finally:
        _FENCE.reset(token)


def guarded(moves: list[dict]) -> AbstractContextManager[None]:
    """The current fence's :meth:`Fence.guard` of ``moves`` (none: a scope that checks nothing)."""
    fence = _FENCE.get()
    return nullcontext() if fence is None or not moves else fence.guard(moves)


class Refs(ABC):
    """The refs of one home: tags (name -> commit id), moved only by compare-and-swap,
    every move recorded (tag, old commit, new commit, time, action)."""

    #: Where the refs live, for messages: ``"in <folder>"`` or ``"at s3://…"``.
    where: str

    @abstractmethod
    def transaction(self) -> AbstractContextManager[Any]:
        """A scope whose reads and moves are one atomic step where the home allows it
        (locally: one catalog write transaction, yielding its ``txn``; on object storage
        there is none: each move is its own compare-and-swap, and this yields ``None``)."""

    @abstractmethod
    def read(self, name: str) -> str | None:
        """The commit tag ``name`` names now, ``None`` if there is no such tag (or the name
        cannot be a tag's).

        Raises:
            IntegrityError: the tag is damaged (a malformed payload; locally a row naming a
                commit the catalog lacks).
        """

    @abstractmethod
    def list(self) -> dict[str, str]:
        """``{tag name: commit id}`` of every tag, sorted by name."""

    @abstractmethod
    def move(self, moves: Moves, action: str, at: float | None = None, txn: Any = None) -> dict[str, str | None]:
        """Move each tag of ``moves`` from its expected commit to its new one (``None``:
        delete), with ``action`` (``commit``, ``tag``, ``delete``, ``import``…) and time
        ``at`` (``None``: now), leaving a reflog record for each; returns ``{tag: commit
        it named before}``. ``txn``: the caller's :meth:`transaction`, to move inside it.

        Raises:
            RefConflictError: a tag names something else than expected (nothing of that
                tag moved; on object storage, tags before it in ``moves`` did).
            RefNotFoundError: deleting a tag that does not exist.
            RefBusyError: (object storage) a tag without expectation kept moving.
        """

    @abstractmethod
    def delete(self, name: str) -> str:
        """Delete tag ``name``; returns the commit it named (``""``: a damaged tag, removed
        all the same).

        Raises:
            RefNotFoundError: no such tag.
        """

    @abstractmethod
    def reflog(self, tag: str | None = None) -> list[dict]:
        """Every move (of ``tag``), newest first: ``{tag, old_commit, new_commit, at, action}``.

        Raises:
            RefNotFoundError: ``tag`` never existed.
        """


class CatalogRefs(Refs):
    """A local store's refs: the catalog's ``tags`` and ``reflog`` tables.

    Args:
        catalog: returns the store's catalog (opened on first use).
        transaction: the store's catalog write transaction that may add records
            (``Home.write``): it yields a list of ``(kind, name, seq, text)`` that is
            written to a new durable pack and indexed just before ``COMMIT``.
        where: the store folder, for messages.
    """

    def __init__(self, catalog: Callable[[], Catalog], transaction: Callable[[], AbstractContextManager[list]], where: str):
        self._catalog = catalog
        self._transaction = transaction
        self.where = f"in {where}"

    def transaction(self) -> AbstractContextManager[list]:
        return self._transaction()

    def read(self, name: str) -> str | None:
        rows = self._catalog().rows("SELECT t.commit_id, c.id FROM tags t LEFT JOIN commits c ON c.id = t.commit_id WHERE t.name = ?", (name,))
        if not rows:
            return None
        if rows[0][1] is None:
            raise IntegrityError(f"tag {name!r} points to commit {rows[0][0]}, which is not in the catalog (damaged catalog; see ckptstore fsck)")
        return rows[0][0]

    def list(self) -> dict[str, str]:
        return {r["name"]: r["commit_id"] for r in self._catalog().rows("SELECT name, commit_id FROM tags ORDER BY name")}

    def move(self, moves: Moves, action: str, at: float | None = None, txn: list | None = None) -> dict[str, str | None]:
        if txn is None:
            with self.transaction() as txn:
                return self.move(moves, action, at, txn)
        at = time.time() if at is None else at
        conn = self._catalog().conn
        olds: dict[str, str | None] = {}
        with guarded([{"tag": n, "new": c, "action": action} for n, (_, c) in moves.items()]):  # (in this transaction)
            pass
        for name, (expect, cid) in moves.items():
            row = conn.execute("SELECT commit_id FROM tags WHERE name = ?", (name,)).fetchone()
            old = row[0] if row else None
            if expect is not ANY and old != expect:
                raise RefConflictError(f"tag {name!r} names {old or 'nothing'}, not {expect or 'nothing'}: another writer moved it")
            if cid is None:
                if old is None:
                    raise RefNotFoundError(f"no tag named {name!r} {self.where}")
                conn.execute("DELETE FROM tags WHERE name = ?", (name,))
            else:
                conn.execute(_UPSERT, (name, cid, at))
            seq = conn.execute(
                "INSERT INTO reflog (tag, old_commit, new_commit, at, action) VALUES (?, ?, ?, ?, ?)", (name, old, cid, at, action)
            ).lastrowid
            txn.append((records.KIND_REF, name, seq, records.ref_text(seq, name, old, cid, at, action)))
            olds[name] = old
        return olds

    def delete(self, name: str) -> str:
        check_ref_name(name)  # as a bucket's refs: InvalidNameError, not "no such tag", for a name no tag can have
        return self.move({name: (ANY, None)}, "delete")[name]

    def reflog(self, tag: str | None = None) -> list[dict]:
        if tag is not None:
            check_ref_name(tag)
        sql = "SELECT tag, old_commit, new_commit, at, action FROM reflog"
        rows = self._catalog().rows(sql + (" WHERE tag = ?" if tag else "") + " ORDER BY id DESC", (tag,) if tag else ())
        if tag is not None and not rows:
            raise RefNotFoundError(f"tag {tag!r} never existed {self.where}")
        return [dict(r) for r in rows]


class BucketRefs(Refs):
    """A bucket store's refs: ``refs/<tag>`` objects moved by conditional PUT, a reflog
    object per move, mirrored into the cache's ``tags`` table.

    Args:
        backend: the bucket.
        catalog: returns the cache (a catalog of the local schema: its ``tags`` rows mirror
            the refs last read, for a commit the cache holds).
        folder: the cache folder (``refs.json``: the ETag and commit of each ref seen).
        requests: runs small requests in parallel.
        has_store: does the bucket hold a store (its marker)? (listing an empty prefix: no tags)
        need_store: raises NotAStoreError when it does not (before any other read).
        packs_of: the ids of the packs holding a commit's blobs (the hint a moved tag carries).
    """

    def __init__(self, backend: Backend, catalog: Callable[[], Catalog], folder: Path, requests: Executor,
                 has_store: Callable[[], bool], need_store: Callable[[], None], packs_of: Callable[[str | None], list[str]]):
        self.backend = backend
        self._catalog = catalog
        self.folder = folder
        self.requests = requests
        self.has_store = has_store
        self.need_store = need_store
        self.packs_of = packs_of
        self.where = f"in {backend.url}"  # the words of a folder's refs: one message on both homes
        self._hints: dict[str, list[str]] = {}  # commit id -> packs, as its tag said when read (a hint only)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        yield None  # no multi-object transaction on object storage: each move is one CAS

    # --- reading ---------------------------------------------------------------------------

    def read(self, name: str) -> str | None:
        self.need_store()
        try:
            cid, _, packs = read_tag_hint(self.backend, name)
        except InvalidNameError:
            return None
        if cid is not None:
            if len(self._hints) > 1024:
                self._hints.clear()
            self._hints[cid] = packs
        return cid

    def hint(self, cid: str) -> list[str]:
        """The packs the last tag read that named ``cid`` said hold its blobs (``[]``: none known)."""
        return self._hints.get(cid, [])

    def versions(self, names: list[str]) -> dict[str, tuple[str | None, str | None]]:
        """``{tag: (commit or None, version or None)}``, read now, in parallel: what a
        compare-and-swap (:meth:`swap`) starts from."""
        return dict(zip(names, self.requests.map(lambda t: read_tag(self.backend, t), names)))

    def read_all(self, strict: bool = True) -> dict[str, str | None]:
        """Every tag on the bucket, ``{name: commit id}`` (``None``: deleted), as of now.

        One listing gives every ref's stamp (its ETag); only refs whose stamp this cache has
        not seen are read (a GET each), so a call costs O(tags moved since) requests, not
        O(tags). The stamps seen live in ``refs.json`` in the cache folder (an ETag names
        one version's bytes, so a stale file costs only reads, never a wrong commit).

        Raises:
            IntegrityError: a tag's payload is malformed (``strict``; else it is left out).
        """
        stamps = self.backend.ref_stamps()
        seen = self._stamps()
        todo = [n for n, st in stamps.items() if st is None or n not in seen or seen[n][0] != st]

        def read(name: str):
            try:
                return read_tag(self.backend, name)
            except IntegrityError:
                if strict:
                    raise
                return ...

        for name, got in zip(todo, self.requests.map(read, todo)):
            if got is ...:
                seen.pop(name, None)
            else:
                seen[name] = (got[1], got[0])
        out = {n: seen[n][1] for n in stamps if n in seen}
        self._save_stamps({n: seen[n] for n in stamps if n in seen})
        return out

    def _stamps(self) -> dict[str, tuple[str | None, str | None]]:
        try:
            data = json.loads((self.folder / "refs.json").read_text())
            return {n: (v[0], v[1]) for n, v in data.items() if type(v) is list and len(v) == 2
                    and all(x is None or type(x) is str for x in v) and (v[1] is None or _CID.fullmatch(v[1]))}
        except (OSError, ValueError, AttributeError):
            return {}  # none yet, or damaged: everything is read again

    def _save_stamps(self, stamps: dict) -> None:
        tmp = self.folder / f"refs.json.{uuid.uuid4().hex}.tmp"
        try:
            tmp.write_text(json.dumps({n: list(v) for n, v in stamps.items()}))
            tmp.replace(self.folder / "refs.json")
        except OSError:
            tmp.unlink(missing_ok=True)  # a cache that cannot be written only costs reads

    def list(self) -> dict[str, str]:
        """As on the bucket now: the refs only (:meth:`read_all`), never the commits they
        name; a malformed tag is left out (fsck reports it; ``delete`` removes it)."""
        if not self.has_store():
            return {}
        refs = self.read_all(strict=False)
        self.mirror(refs, complete=True)
        return {n: c for n, c in sorted(refs.items()) if c is not None}

    def mirror(self, refs: dict[str, str | None], complete: bool = False) -> None:
        """Copy tag values read from the bucket into the cache's ``tags`` table (``None``:
        deleted); ``complete``: ``refs`` is every tag, others are dropped. A tag whose
        commit the cache does not hold is left out (copy the commit first to list it there)."""
        cat = self._catalog()
        held = {c for c in dict.fromkeys(c for c in refs.values() if c) if cat.rows("SELECT 1 FROM commits WHERE id = ?", (c,), raw=True)}
        refs = {n: c for n, c in refs.items() if c is None or c in held}
        with cat.write():
            conn = cat.conn
            if complete:
                names = list(refs)
                conn.execute(f"DELETE FROM tags WHERE name NOT IN ({', '.join('?' * len(names))})", names)
            for name, cid in refs.items():
                if cid is None:
                    conn.execute("DELETE FROM tags WHERE name = ?", (name,))
                else:
                    conn.execute(_UPSERT, (name, cid, time.time()))

    # --- moving ----------------------------------------------------------------------------

    def swap(self, name: str, old: str | None, version: str | None, cid: str | None, action: str, packs: list[str] | None = None) -> float:
        """One compare-and-swap of tag ``name`` from ``version`` (where it named ``old``) to
        ``cid``, then its reflog object; returns the move's time. ``packs``: the hint it
        carries (default: :attr:`packs_of` ``cid``).

        Raises:
            RefConflictError: the tag moved since ``version`` was read (nothing changed).
        """
        at = time.time()  # the move's time: a retried CAS lands after moves made meanwhile
        self.backend.cas_ref(name, ref_payload(cid, old, action, at, self.packs_of(cid) if packs is None else packs), version)
        self.log_move(name, old, cid, action, at)
        return at

    def move(self, moves: Moves, action: str, at: float | None = None, txn: Any = None) -> dict[str, str | None]:
        """Each tag by its own CAS loop (there is no multi-object CAS): read, compare with
        the expectation, swap; a lost race re-reads (``ANY``) or raises (an expectation);
        ``at`` is ignored: each move is dated when its CAS is sent."""
        olds: dict[str, str | None] = {}
        for name, (expect, cid) in moves.items():
            deadline = time.monotonic() + CAS_SECONDS
            packs = self.packs_of(cid)
            while True:
                old, version = read_tag(self.backend, name)
                if expect is not ANY and old != expect:
                    raise RefConflictError(f"{self.backend.url}: tag {name!r} names {old or 'nothing'}, not {expect or 'nothing'}: "
                                           "another writer moved it")
                if cid is None and old is None:
                    raise RefNotFoundError(f"no tag named {name!r} {self.where}")
                try:
                    with guarded([{"tag": name, "old": old, "version": version, "new": cid, "action": action, "packs": packs}]):
                        self.swap(name, old, version, cid, action, packs)
                    break
                except RefConflictError:
                    if time.monotonic() > deadline:
                        raise RefBusyError(f"{self.backend.url}: tag {name!r} kept moving for {CAS_SECONDS:.0f} s") from None
            self.mirror({name: cid})
            olds[name] = old
        return olds

    def delete(self, name: str) -> str:
        """A tombstone by compare-and-swap against the commit read (a tag moved meanwhile is
        RefConflictError); a tag whose payload is malformed is replaced by a tombstone
        whatever it holds (returns ``""``)."""
        self.need_store()
        try:
            old = read_tag(self.backend, name)[0] if type(name) is str and name else None
        except IntegrityError:  # a malformed payload: replace it with a tombstone, whatever it holds
            ref = self.backend.read_ref(name)
            self.backend.cas_ref(name, ref_payload(None, None, "delete", time.time()), ref.version)
            self.log_move(name, None, None, "delete", time.time())
            return ""
        if old is None:
            raise RefNotFoundError(f"no tag named {name!r} {self.where}")
        return self.move({name: (old, None)}, "delete")[name] or old

    def log_move(self, tag: str, old: str | None, new: str | None, action: str, at: float) -> None:
        """Write the reflog object of a move that happened (a failure only warns: the tag moved)."""
        move = reflog_bytes(tag, old, new, action, at)
        try:
            self.backend.put_new(f"reflog/{ref_segment(tag)}/{time.time_ns():020d}-{uuid.uuid4().hex}", move)
        except BackendError as exc:  # the tag has moved: the call succeeded, only its history entry is lost
            warnings.warn(ReflogWarning(f"tag {tag!r} moved to {new}, but its reflog record was not written: {exc}"), stacklevel=4)

    def reflog(self, tag: str | None = None) -> list[dict]:
        """Every move recorded on the bucket (``reflog/``), newest first."""
        self.need_store()
        objects = self.backend.list(f"reflog/{ref_segment(tag)}" if tag is not None else "reflog")

        def load(key: str) -> dict | None:
            try:
                m = parse_reflog(self.backend.get(key), key, self.backend.url)
                return {"tag": m["tag"], "old_commit": m["old"], "new_commit": m["new"], "at": float(m["at"]), "action": m["action"]}
            except ObjectNotFoundError:
                return None

        out = [m for m in self.requests.map(load, [o.key for o in objects]) if m is not None]
        if tag is not None and not out:
            raise RefNotFoundError(f"tag {tag!r} never existed {self.where}")
        keys = {id(m): o.key.rsplit("/", 1)[1] for m, o in zip(out, objects)}
        return sorted(out, key=lambda m: (m["at"], keys[id(m)]), reverse=True)


def resolve_on_bucket(backend: Backend, ref: str) -> tuple[str, str | None]:
    """``(commit id, tag or None)`` that ``ref`` names on the remote: a tag, a full
    commit id, or a unique id prefix (4 hex digits or more).

    Raises:
        RefNotFoundError / AmbiguousRefError: nothing, or several commits, match.
    """
    if type(ref) is not str or not ref:
        raise RefNotFoundError(f"invalid ref {ref!r}")
    try:
        cid, _ = read_tag(backend, ref)
    except InvalidNameError:
        cid = None  # not a valid ref name: perhaps a commit id
    else:
        if cid is not None:
            return cid, ref
    low = ref.lower()
    if _CID.fullmatch(low) and backend.head(commit_key(low)) is not None:
        return low, None
    if len(low) >= records.MIN_PREFIX and _HEX.fullmatch(low):
        found = [o.key.rsplit("/", 1)[1] for o in backend.list(f"commits/{low[:2]}")]
        found = [c for c in found if c.startswith(low)]
        if len(found) == 1:
            return found[0], None
        if found:
            raise AmbiguousRefError(f"ref {ref!r} is an ambiguous commit id prefix in {backend.url}: matches {', '.join(c[:12] for c in found[:10])}")
    raise RefNotFoundError(records.unknown_ref(ref, backend.url, [t for t in backend.list_refs() if t.startswith(ref + "/")]))

__all__ = ["ANY", "BucketRefs", "CAS_SECONDS", "CatalogRefs", "Fence", "Refs", "fenced", "guarded", "resolve_on_bucket"]
