"""Exceptions raised by ckptstore.

Every error the library raises on purpose derives from :class:`CkptStoreError`,
so callers can catch one class. Each subclass stands for one kind of failure;
messages name the store path, ref, leaf path, blob address or file concerned.
The command line prints ``error: <message>`` on one line and exits non-zero.
"""

from __future__ import annotations


class CkptStoreError(Exception):
    """Base class of every error raised by ckptstore."""


# --- the store and its catalog -------------------------------------------------


class NotAStoreError(CkptStoreError):
    """The folder exists but is not a ckptstore store (no valid catalog)."""


class CatalogCorruptError(CkptStoreError):
    """The catalog file exists but is not a readable SQLite database of ours."""


class SchemaVersionError(CkptStoreError):
    """The catalog's schema version is newer than this library, or unknown."""


class CatalogBusyError(CkptStoreError):
    """The catalog stayed locked by another process after the bounded retries."""


class GCLockedError(CkptStoreError):
    """Another GC holds the store's GC lock; this one did nothing (CLI exit code 3)."""


class ResourceLimitError(CkptStoreError):
    """The process ran out of a resource it does not control (open files: ``ulimit -n``);
    nothing stored is at fault, so it is never reported as damage."""


class MissingExtraError(CkptStoreError):
    """An optional feature needs a package that is not installed; the message names the
    extra to install (``pip install 'ckptstore[demo]'``)."""


class RunBusyError(CkptStoreError):
    """Another live Checkpointer (named by pid and host) holds the lease of the run, or
    this one lost it to a newer one; nothing was committed."""


class RunTakenOverError(RunBusyError):
    """This holder of a run was taken over (paused or cut off past its lease, or replaced by
    a newer Checkpointer in this process): a newer fencing token (:attr:`generation`) was
    issued for the run, so none of this holder's tag moves may happen (docs/design.md,
    "Fenced writers"). What it wrote stays in the store untagged, for GC to collect."""

    def __init__(self, message: str, generation: int | None = None):
        super().__init__(message)
        #: The run's fencing token now (the generation that took it over); ``None``: unknown.
        self.generation = generation


class ForkedStoreError(CkptStoreError):
    """A :class:`~ckptstore.Store` (or a Checkpointer's run lease) was used in a process
    forked from the one that opened it: it does not cross ``fork`` (its catalog connection,
    threads and leases are the parent's). Open a new ``Store`` in the child
    (docs/operations.md, "Processes: threads, fork, signals")."""


class InvalidArgumentError(CkptStoreError):
    """An argument that does not parse: a duration, a glob, a fraction."""


class StoreWriteError(CkptStoreError):
    """Writing blobs or the catalog failed (disk full, permissions, I/O error).

    Nothing already committed is changed: a failed commit leaves at most
    orphan files that ``ckptstore gc`` removes after the grace period.
    """


# --- refs ----------------------------------------------------------------------


class RefError(CkptStoreError):
    """Base class of errors about refs (tags, commit ids, prefixes)."""


class RefNotFoundError(RefError):
    """No tag, commit id or id prefix matches the ref."""


class AmbiguousRefError(RefError):
    """A commit id prefix matches more than one commit."""


class RefConflictError(RefError):
    """A tag did not name the commit a compare-and-swap expected (another writer moved
    it), or a push/pull would move it to a commit that does not descend from it."""


class InvalidNameError(RefError):
    """A tag name or a state-tree key is not allowed (empty, contains '/', ...)."""


# --- what is committed ----------------------------------------------------------


class UnsupportedTypeError(CkptStoreError):
    """An object or value cannot be stored without pickle; names the path and type."""


class UnsupportedDtypeError(UnsupportedTypeError):
    """A tensor dtype that has no raw byte representation (quantized dtypes)."""


# --- what is checked out ----------------------------------------------------------


class PartialPathError(CkptStoreError):
    """A ``partial`` prefix matches no leaf; the message lists the components."""


class TargetMismatchError(CkptStoreError):
    """The object given to ``checkout(into=...)`` does not fit the stored state.

    Raised before anything is written into the target: wrong capacity, layout,
    class, missing keys, or a shape or dtype that differs.
    """


class ShapeMismatchError(TargetMismatchError):
    """A stored tensor's shape or dtype differs from the target's; names the key."""


class AdapterError(CkptStoreError):
    """No adapter for a type, or an adapter was registered twice."""


class AdapterVersionError(AdapterError):
    """Stored state was written by a newer adapter version than this library has."""


class MissingLeafError(CkptStoreError):
    """A component lacks a leaf its adapter needs (e.g. a deleted RNG record)."""


# --- integrity ---------------------------------------------------------------------


class IntegrityError(CkptStoreError):
    """Stored bytes do not match the catalog: missing, truncated or corrupt data.

    The message names the leaf path, the blob address and the commit where known.
    """


class BlobMissingError(IntegrityError):
    """A blob the catalog references is absent (pack file or bytes missing)."""


class BlobCorruptError(IntegrityError):
    """A blob's header, length, codec or content hash is wrong."""


# --- containers (export / import) ---------------------------------------------------


class ContainerError(CkptStoreError):
    """An export archive or folder is malformed, unsafe, or of an unknown format."""


# --- object storage and other backends (ckptstore.backends) -----------------------


class BackendError(CkptStoreError):
    """The storage backend failed a request after its retries (network, HTTP 5xx,
    timeouts, permissions), or its client library is not installed."""


class ObjectNotFoundError(BlobMissingError):
    """An object (a pack, an index, a record) is absent from the backend."""


class RefBusyError(RefError):
    """A ref kept moving under a read-modify-write loop for all its attempts."""


# --- warnings -------------------------------------------------------------------------


class StaleFingerprintWarning(UserWarning):
    """A tensor's bytes changed although its fingerprint (version counter, address)
    did not: a write torch does not count (``.data``, a numpy view, another process).
    The commit rehashed it in full, so the checkpoint is right; see ``reuse_hashes``."""


class OlderStepError(RefConflictError):
    """A push would move a run's ``latest`` on the bucket to a step no higher than the one it
    holds (a node resumed from a stale disk, or without reaching the bucket): refused, the
    bucket unchanged. Resume again to continue from the bucket, or rewind explicitly with
    ``Checkpointer.resume(ref=...)``."""


class PushFailedWarning(UserWarning):
    """A background push (``Checkpointer(push_to=...)``) failed after its retries; the
    local commit is intact and the next commit's push tries again."""


class BucketNotConsultedWarning(UserWarning):
    """A tiered ``Checkpointer.resume()`` (``local=``, ``remote=``) could not reach the bucket
    and resumed from the node's local tier without knowing the bucket's newest step: a newer
    save may exist there. The node's pushes never move the bucket's ``latest`` to a lower
    step (they fail with :class:`OlderStepError` instead)."""


class LocalTierGCWarning(UserWarning):
    """The GC a tiered Checkpointer runs on a node's local store after a durable push failed
    (another GC held the store, say); the push stands, and the next durable push runs it again."""


class ReflogWarning(UserWarning):
    """A tag moved on object storage but its reflog record could not be written after the
    client's retries: the move stands (the commit is returned), only its history entry is missing."""


class HyperparameterOverrideWarning(UserWarning):
    """A restore set a hyperparameter (a prioritized sampler's ``alpha``, ``beta`` or
    ``eps``, a sampler's ``shuffle`` or ``drop_last``) to the committed value, replacing a
    different one the target was built with; the message names the leaf and both values."""


class DefaultRunResumedWarning(UserWarning):
    """``Checkpointer.resume()`` without ``run=`` continued the store's default run from its
    latest commit (the message names the step, the commit and the script that made it):
    an experiment meant to start afresh (another seed of the same script) needs its own
    ``run=``. Not raised for named runs."""
