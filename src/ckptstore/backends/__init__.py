"""Backends: where a store's objects and refs live (docs/design.md, "Object storage").

The only code in ckptstore that knows a filesystem path or an S3 client.
:class:`Backend` is the interface; :class:`LocalBackend` keeps objects and refs in a
folder, :class:`S3Backend` under ``s3://bucket/prefix`` (through obstore, imported only
when an S3 backend is opened). :func:`open_backend` chooses by location, :func:`is_url`
tells a store on object storage from a folder.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..core.errors import InvalidArgumentError
from .base import Backend, ObjectInfo, Ref, RefObject, check_key, check_ref_name, decode_ref, encode_ref, update_ref
from .local import LocalBackend
from .s3 import S3Backend, parse_s3_url

__all__ = [
    "Backend",
    "LocalBackend",
    "ObjectInfo",
    "Ref",
    "RefObject",
    "S3Backend",
    "as_backend",
    "check_key",
    "check_ref_name",
    "decode_ref",
    "encode_ref",
    "is_url",
    "open_backend",
    "parse_s3_url",
    "update_ref",
]


def open_backend(location: str | os.PathLike, create: bool = False) -> Backend:
    """The backend for ``location``: ``s3://bucket/prefix`` (never creates the bucket) or a folder.

    Args:
        location: an ``s3://`` URL or a folder path.
        create: for a folder, make it if missing (ignored for ``s3://``: a prefix needs no creating).

    Raises:
        NotAStoreError: a missing bucket, or a missing folder without ``create``.
        InvalidArgumentError: a malformed ``s3://`` URL.
        BackendError: ``s3://`` without obstore installed, or an unreachable server.
    """
    if isinstance(location, str) and location.startswith("s3://"):
        return S3Backend(location)
    return LocalBackend(location, create=create)


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:/")  # a URL scheme (s3:/ once a path mangled s3://), not a folder


def is_url(location: Any) -> bool:
    """Is ``location`` a store on object storage (``s3://…``) rather than a folder?

    Raises:
        InvalidArgumentError: a URL of another scheme.
    """
    if not (isinstance(location, str) and _URL.match(location)):
        return False
    if not location.startswith("s3://"):
        raise InvalidArgumentError(f"unsupported store location {location!r}: a folder, or s3://bucket/prefix for S3-compatible object storage")
    return True


def as_backend(remote: Any) -> Backend | None:
    """``remote`` as a backend when it is object storage (an ``s3://`` URL or a Backend), else ``None``."""
    if isinstance(remote, Backend):
        return remote
    if isinstance(remote, str) and remote.startswith("s3://"):
        return open_backend(remote)
    return None
