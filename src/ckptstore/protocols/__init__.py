"""Protocols: what a store does, written once for both homes.

Commit (with reuse and digests), checkout, GC, fsck, recover, diff, transfer (push and pull,
with :mod:`~ckptstore.protocols.remote` for object storage), export/import archives and the
TorchRL importer. Each is typed against the small interfaces of
:mod:`ckptstore.home.interfaces` (what it needs of a repository), never against the
``Store`` facade above; the queries (resolve, log, show...) are the home's own.
May import ``home``, ``objects``, ``backends``, ``core`` and ``adapters``.
"""
