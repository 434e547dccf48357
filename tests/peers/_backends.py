"""The two storages every ported peer test runs with: the peer's own and ckptstore.

A ported test takes the ``storage`` fixture (parametrized ``peer`` / ``ckptstore``)
and asks it for the writer and reader of one checkpoint location, so that the test
body, and its assertions, are the same for both storages.
"""

from __future__ import annotations

import os

import pytest
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ckptstore.dcp import StoreReader, StoreWriter

TAG = "peer-test"


class PeerDCP:
    """torch.distributed.checkpoint's own file-system storage."""

    name = "peer"

    def writer(self, path: str | os.PathLike, thread_count: int = 1, **kwargs):
        return FileSystemWriter(path, thread_count=thread_count, **kwargs)

    def reader(self, path: str | os.PathLike, **kwargs):
        return FileSystemReader(path, **kwargs)


class StoreDCP:
    """ckptstore: the location is a store, each save moves tag ``TAG``. DCP's stream
    extensions (``_extensions``, ``_extension_registry``) transform the peer's own
    files; ckptstore has its own compression, so they are not passed on."""

    name = "ckptstore"

    def writer(self, path: str | os.PathLike, thread_count: int = 1, **kwargs):
        return StoreWriter(str(path), tag=TAG, workers=thread_count)

    def reader(self, path: str | os.PathLike, **kwargs):
        return StoreReader(str(path), TAG)


STORAGES = {"peer": PeerDCP(), "ckptstore": StoreDCP()}


@pytest.fixture(params=list(STORAGES))
def storage(request):
    return STORAGES[request.param]
