"""The core: pure functions and the error types, below everything else.

Layout and shards (how a tensor is cut and addressed), JSON values, units, the one thread pool,
progress reporting, pausing Python's cyclic collector, and :mod:`ckptstore.core.errors`.
Imports nothing of ckptstore outside ``core`` (and ``core`` modules import only each other).
"""
