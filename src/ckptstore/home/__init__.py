"""Homes: where a store's objects, refs and index live, behind one interface.

:mod:`~ckptstore.home.base` holds the part both homes share (the index as a SQLite catalog,
the queries over it) and :mod:`~ckptstore.home.interfaces` what each protocol needs of a
home; :mod:`~ckptstore.home.local` is the store in a folder, :mod:`~ckptstore.home.bucket`
(with its cache, I/O and upkeep) the store on object storage; :mod:`~ckptstore.home.catalog`
and :mod:`~ckptstore.home.refs` are the index and the tags. A home owns its catalog, refs
and settings. May import ``objects``, ``backends`` and ``core``; imports no protocol and
never the ``Store``.
"""
