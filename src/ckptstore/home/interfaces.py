"""What each protocol needs of the repository it works on: one small :class:`typing.Protocol`
per protocol module, listing exactly the members that module uses (and, where it calls the
home, the home's members it uses), so that a protocol is typed against this narrow interface
below it and never against :class:`ckptstore.store.Store`, the facade above it.

At run time a protocol still receives the :class:`~ckptstore.store.Store` (or, for the commit
engine, is constructed with it): it satisfies these Protocols structurally (nothing inherits
from them, nothing checks them with ``isinstance``). A new member a protocol starts to use is
added here first, to the Protocol of that protocol only.

Place in the layers: the home layer (``home/interfaces``), below the protocols. It may import
the core (``errors``, ``layout``, ...), the object formats (``packs``, ``records``, ...) and
the catalog; never a protocol module, a home implementation (``home``, ``localhome``,
``bucket*``), the adapters (the homes know none), ``store`` or anything above. Members typed
``Any`` are objects of a module this one may not name (a home's GC or fsck side, a bucket
home's internals, the adapter registry, the refs: ``refs`` sits in the protocols' layer of
today's flat contract): their docstrings say what they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..objects.packs import BlobLoc, IOStats, PackReader, PackWriter
from ..objects.records import CommitInfo, CommitRecord, LeafRecord
from .catalog import Catalog

Key = tuple[bytes, int]
"""A blob's address: (XXH3-128 digest of its raw bytes, raw length in bytes)."""


# --- commit (ckptstore.protocols.commit; ckptstore.protocols.reuse and ckptstore.protocols.digests receive no repository) ---------


class CommitHome(Protocol):
    """The home's steps of the commit protocol (:class:`ckptstore.protocols.commit.Committer`):
    ``before_commit`` (ready the home: a bucket home checks its marker), ``index_commit``
    (step 4: index the commit and move its tags atomically; raises
    :class:`ckptstore.protocols.commit.ReusedBlobsGone`), ``relocate_reused`` (copies a GC's repack made
    of blobs the commit meant to reuse), ``dated`` (the CommitInfo as the home dates it) and
    ``prepare_shared_commit`` (the home's part of a commit whose blobs other processes write)."""

    def before_commit(self) -> None: ...

    def index_commit(
        self, components: list, leaves: list[LeafRecord], keys: list[Key], known: dict[Key, int], written: dict[Key, BlobLoc],
        writer: PackWriter, tags: list[str], message: str, meta_json: str, explicit_parents: list[str] | None, created_at: float,
        t0: float, expect: str | None = None, given_packs: Sequence[tuple[str, int]] = (),
    ) -> tuple[str, list[str], float, dict[Key, int]]: ...

    def relocate_reused(self, keys: list[Key]) -> dict[Key, int]: ...

    def dated(self, info: CommitInfo) -> CommitInfo: ...

    def prepare_shared_commit(self) -> None: ...


class CommitRepository(Protocol):
    """What the commit engine (:class:`ckptstore.protocols.commit.Committer`, steps 1 to 3 of the commit
    protocol) needs of the repository it commits to:

    - ``root``: where the repository lives (named in its errors);
    - ``shard_bytes``: the target shard size in bytes (read at each commit: opening the
      catalog may change it to the stored setting);
    - ``home``: the home's steps (:class:`CommitHome`);
    - ``_open(create=True)``: open (creating if missing) the catalog, to tell whether it is
      writable here before anything is written;
    - ``resolve``: the commit ids of explicit ``parents`` refs;
    - ``pack_writer``: a writer of the commit's new packs;
    - ``_lookup``: the blob ids the index holds for addresses, less those marked bad (dedup);
      a member of the repository, not of the engine, so that one lookup serves the engine
      and the home's index step.
    """

    root: Path
    shard_bytes: int

    @property
    def home(self) -> CommitHome: ...

    def _open(self, create: bool) -> Catalog | None: ...

    def resolve(self, ref: str) -> str: ...

    def pack_writer(self) -> PackWriter: ...

    def _lookup(self, keys: list[Key]) -> dict[Key, int]: ...


class CommitsComponents(Protocol):
    """The commit entry point of an importer that builds captured components
    (:mod:`ckptstore.protocols.torchrl_import`): ``commit_components`` (``components``: a list of
    :class:`ckptstore.adapters.base.Captured`), as
    :meth:`ckptstore.protocols.commit.Committer.commit_components` defines it."""

    def commit_components(self, components: list, tag: str | Sequence[str] | None = None, message: str = "",
                          metadata: dict | None = None, parents: Sequence[str] | None = None) -> CommitInfo: ...


class CommitsManifests(Protocol):
    """The commit entry point of an importer or a copier that builds the manifest itself
    (:mod:`ckptstore.protocols.archive`, :mod:`ckptstore.protocols.transfer`, :mod:`ckptstore.protocols.remote`):
    ``commit_manifest``, as :meth:`ckptstore.protocols.commit.Committer.commit_manifest` defines it."""

    def commit_manifest(self, components: list, leaves: list[LeafRecord], keys: list[Key], write: Callable | None, tags: list[str],
                        message: str, metadata: dict | None, explicit_parents: list[str] | None, t0: float,
                        prior: dict[Key, int] | None = None, origin: tuple[str, Sequence[str], float] | None = None,
                        ) -> tuple[CommitInfo, dict[Key, int]]: ...


# --- checkout (ckptstore.protocols.checkout) -------------------------------------------------------------------


class CheckoutHome(Protocol):
    """The home's member a checkout uses: ``mark_bad`` marks blobs whose read failed
    verification, so that dedup never reuses them (invariant 14)."""

    def mark_bad(self, bad: list[tuple[BlobLoc, str]]) -> int: ...


class CheckoutRepository(Protocol):
    """What a checkout (:func:`ckptstore.protocols.checkout.checkout_ref`) needs of the repository:

    - ``catalog``: one read snapshot (``catalog.read()``) from the ref to the blobs' rows;
    - ``resolve``: the ref's commit id;
    - ``components``, ``record``, ``manifest``: the commit's components, its record (a
      partial path's leaves) and the located leaves of the selected components;
    - ``registry``: the adapters that build or restore the objects (a
      :class:`ckptstore.adapters.Registry`);
    - ``pack_reader``: the blobs' bytes (``sparse`` for a partial checkout);
    - ``_map``: reading many shards across the repository's threads;
    - ``io``: the repository's read counters (blobs and bytes), updated by each checkout;
    - ``home``: marking blobs whose read failed (:class:`CheckoutHome`).
    """

    @property
    def catalog(self) -> Catalog: ...

    @property
    def registry(self) -> Any: ...

    @property
    def home(self) -> CheckoutHome: ...

    io: IOStats

    def resolve(self, ref: str) -> str: ...

    def components(self, ref: str) -> dict[str, dict]: ...

    def record(self, ref: str) -> CommitRecord: ...

    def manifest(self, ref: str, prefixes: list[str] | None = None) -> list[LeafRecord]: ...

    def pack_reader(self, sparse: bool = False) -> PackReader: ...

    def _map(self, fn: Callable[[Any], Any], items: list) -> list: ...


# --- gc and fsck (ckptstore.protocols.gc, ckptstore.protocols.fsck) --------------------------------------------------------


class GCHome(Protocol):
    """The home's member a GC uses: ``gc_side()``, its GC side (``GCSide``: a
    :class:`ckptstore.home.local.LocalGC` or a :class:`ckptstore.home.bucket_upkeep.BucketGC`), which
    does every step that touches objects."""

    def gc_side(self) -> Any: ...


class GCRepository(Protocol):
    """What a GC (:func:`ckptstore.protocols.gc.collect`) needs of the repository: its ``catalog`` (the
    commits, edges and tags the retention reads), ``pack_bytes`` (the size a repack fills a
    pack to; small packs are those below half of it) and ``home`` (its GC side,
    :class:`GCHome`). The GC side receives the collector and reads its ``store`` (this
    repository) back."""

    @property
    def catalog(self) -> Catalog: ...

    @property
    def home(self) -> GCHome: ...

    pack_bytes: int


class FsckHome(Protocol):
    """The home's members fsck uses: ``fsck_side()`` (its fsck side, ``FsckSide``, which
    lists, reads and checks the objects), ``marked()`` (blobs marked bad), ``mark_bad`` and
    ``replace_copy`` (``repair``: point a bad blob's row at a good copy)."""

    def fsck_side(self) -> Any: ...

    def marked(self) -> list[BlobLoc]: ...

    def mark_bad(self, bad: list[tuple[BlobLoc, str]]) -> int: ...

    def replace_copy(self, loc: BlobLoc, good: BlobLoc) -> bool: ...


class FsckRepository(Protocol):
    """What fsck and verify (:mod:`ckptstore.protocols.fsck`) need of the repository: only its ``home``
    (:class:`FsckHome`); the fsck side reads everything else."""

    @property
    def home(self) -> FsckHome: ...


# --- recover (ckptstore.protocols.recover) -------------------------------------------------------------------


class RecoverRepository(Protocol):
    """What rebuilding a bucket store's local cache (:func:`ckptstore.protocols.recover.recover_bucket`)
    needs of the repository opened on an empty scratch cache:

    - ``root``: the scratch cache folder (removed at the end); ``close``: release it;
    - ``catalog``: the rebuilt index (counted, then installed in place of the cache);
    - ``backend``: the bucket (the records, refs and reflog read directly);
    - ``home``: the bucket home's ``pack_problems``, ``requests`` (its pool of reads) and
      ``index_records`` (a :class:`ckptstore.home.bucket.BucketHome`: typed ``Any``, a home
      implementation);
    - ``refresh_index``: read every pack index into the cache;
    - ``has_cached``, ``locate``: which commits and blobs the cache holds;
    - ``refs``: the bucket's refs (``read_all``: a :class:`ckptstore.home.refs.Refs`); ``tags``.
    """

    root: Path

    @property
    def catalog(self) -> Catalog: ...

    @property
    def backend(self) -> Any: ...

    @property
    def home(self) -> Any: ...

    refs: Any

    def close(self) -> None: ...

    def refresh_index(self, only: list[str] | None = None) -> int: ...

    def has_cached(self, cid: str) -> bool: ...

    def locate(self, keys: list[Key]) -> dict[Key, BlobLoc]: ...

    def tags(self) -> dict[str, str]: ...


# --- copies between repositories (ckptstore.protocols.transfer, ckptstore.protocols.remote, ckptstore.protocols.archive) ----------


class SourceRepository(Protocol):
    """What a copy reads from the repository it copies out of (:func:`ckptstore.protocols.transfer.transfer`'s
    source, :func:`ckptstore.protocols.remote.push`'s local store):

    - ``location``: where it lives (named in errors);
    - ``resolve``, ``tags``: the ref's commit id, and whether the ref is a tag;
    - ``log``, ``has_commit``, ``record``: the lineage to copy and each commit's record;
    - ``locate``, ``pack_reader``: where each blob is, and its stored bytes (copied as stored).
    """

    @property
    def location(self) -> str: ...

    def resolve(self, ref: str) -> str: ...

    def tags(self) -> dict[str, str]: ...

    def log(self, ref: str | None = None, limit: int | None = None) -> list[CommitInfo]: ...

    def has_commit(self, cid: str) -> bool: ...

    def record(self, ref: str) -> CommitRecord: ...

    def locate(self, keys: list[Key]) -> dict[Key, BlobLoc]: ...

    def pack_reader(self, sparse: bool = False) -> PackReader: ...


class TargetRepository(CommitsManifests, Protocol):
    """What a copy needs of the repository it copies into (:func:`ckptstore.protocols.transfer.transfer`'s
    destination): ``location`` (errors), ``tags`` (the tag's commit before), ``has_commit``
    (what is missing), ``commit_manifest`` (each copied commit, recreated with its own id:
    ``origin=``) and ``tag`` (the tag's compare-and-swap, ``expect=``)."""

    @property
    def location(self) -> str: ...

    def tags(self) -> dict[str, str]: ...

    def has_commit(self, cid: str) -> bool: ...

    def tag(self, name: str, ref: str, *, expect: Any = ...) -> str: ...


class RemoteRepository(SourceRepository, TargetRepository, Protocol):
    """The local repository of a push to or pull from object storage (:mod:`ckptstore.protocols.remote`):
    a source for a push, a target for a pull (:class:`SourceRepository`,
    :class:`TargetRepository`), and: ``shard_bytes`` and ``compression_level`` (the settings of
    a store the push creates on an empty prefix), ``refresh_index`` (a pull into a store on
    object storage: its cache learns every blob the bucket holds before the dedup lookup)."""

    shard_bytes: int
    compression_level: int

    def refresh_index(self, only: list[str] | None = None) -> int: ...


class ArchiveRepository(CommitsManifests, Protocol):
    """What exporting a commit to, and importing one from, a ZIP archive or folder
    (:mod:`ckptstore.protocols.archive`) needs of the repository:

    - ``root``: the repository's folder (an import refuses a source inside it);
    - ``catalog``: one read snapshot for the export (a GC cannot drop the commit meanwhile);
    - ``resolve``, ``infos``, ``record``, ``manifest``, ``pack_reader``: the exported commit,
      its info, record and located leaves, and the blobs' stored bytes;
    - ``registry``: the adapters the imported components name (checked before anything is
      written; a :class:`ckptstore.adapters.Registry`); ``commit_manifest``: the import's
      commit (:class:`CommitsManifests`).
    """

    root: Path

    @property
    def catalog(self) -> Catalog: ...

    @property
    def registry(self) -> Any: ...

    def resolve(self, ref: str) -> str: ...

    def infos(self, ids: list[str]) -> dict[str, CommitInfo]: ...

    def record(self, ref: str) -> CommitRecord: ...

    def manifest(self, ref: str, prefixes: list[str] | None = None) -> list[LeafRecord]: ...

    def pack_reader(self, sparse: bool = False) -> PackReader: ...


class TorchRLImportRepository(CommitsComponents, Protocol):
    """What importing a TorchRL dump or checkpoint (:mod:`ckptstore.protocols.torchrl_import`) needs of
    the repository: ``root`` (a source inside the repository is refused) and
    ``commit_components`` (the import's one commit, :class:`CommitsComponents`)."""

    root: Path


# --- diff (ckptstore.protocols.diff) ----------------------------------------------------


class DiffRepository(Protocol):
    """What comparing two commits (:func:`ckptstore.protocols.diff.diff_commits`) needs of the
    repository: its ``catalog`` (both commits' leaves and shards, read in one snapshot)."""

    @property
    def catalog(self) -> Catalog: ...


__all__ = [
    "ArchiveRepository", "CheckoutHome", "CheckoutRepository", "CommitHome", "CommitRepository", "CommitsComponents",
    "CommitsManifests", "DiffRepository", "FsckHome", "FsckRepository", "GCHome", "GCRepository", "Key",
    "RecoverRepository", "RemoteRepository", "SourceRepository", "TargetRepository", "TorchRLImportRepository",
]
