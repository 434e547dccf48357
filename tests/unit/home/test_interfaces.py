"""The protocols are typed against the small Protocols of ckptstore.home.interfaces, not against
Store: the store (on both homes) has every member each Protocol lists, each entry point names
its Protocol, and the commit engine, an object the store owns, keeps no reference cycle with
it. That no protocol imports the store or a home, not even for type checking, is the
import-linter contract's (pyproject.toml, with type-checking imports counted)."""

from __future__ import annotations

import gc
import inspect
import typing
import uuid
import weakref

import torch

import ckptstore
from ckptstore.protocols import checkout
from ckptstore.protocols import archive as container
from ckptstore.protocols import diff
from ckptstore.protocols import fsck
from ckptstore.home import interfaces
from ckptstore.protocols import recover
from ckptstore.protocols import remote
from ckptstore.protocols import torchrl_import
from ckptstore.protocols import transfer
from ckptstore.protocols import gc as store_gc

def protocols() -> dict[str, type]:
    return {n: getattr(interfaces, n) for n in interfaces.__all__ if getattr(getattr(interfaces, n), "_is_protocol", False)}


_PROTOCOL_MACHINERY = {"_is_protocol", "_is_runtime_protocol", "_abc_impl"}


def members(proto: type) -> set[str]:
    """The members a Protocol lists (its own and its bases'): methods, properties and annotated attributes."""
    out = set()
    for cls in proto.__mro__:
        if cls in (typing.Protocol, typing.Generic, object):
            continue
        out |= set(cls.__dict__.get("__annotations__", {}))
        out |= {n for n in cls.__dict__ if not (n.startswith("__") and n.endswith("__")) and n not in _PROTOCOL_MACHINERY}
    return out


def test_each_entry_point_names_its_protocol():
    expect = {
        checkout.checkout_ref: ("store", "CheckoutRepository"), store_gc.collect: ("store", "GCRepository"),
        fsck.run: ("store", "FsckRepository"), fsck.verify: ("store", "FsckRepository"),
        recover.recover_bucket: ("probe", "RecoverRepository"), diff.diff_commits: ("store", "DiffRepository"),
        transfer.transfer: ("src", "SourceRepository"), remote.push: ("local", "RemoteRepository"),
        remote.pull: ("local", "RemoteRepository"), container.export_commit: ("store", "ArchiveRepository"),
        container.import_commit: ("store", "ArchiveRepository"), torchrl_import.import_torchrl: ("store", "TorchRLImportRepository"),
    }
    for fn, (param, name) in expect.items():
        assert inspect.signature(fn).parameters[param].annotation == name, fn.__qualname__
        assert name in protocols()
    assert inspect.signature(transfer.transfer).parameters["dst"].annotation == "TargetRepository"


def members_missing(s: ckptstore.Store, bucket: bool) -> dict[str, list[str]]:
    missing = {}
    for name, proto in protocols().items():
        target = s.home if name.endswith("Home") else s
        lacks = [m for m in sorted(members(proto)) if not hasattr(target, m)]
        if name == "RecoverRepository" and not bucket:  # (recover_bucket: a store on object storage only)
            lacks = [m for m in lacks if m != "backend"]
        if lacks:
            missing[name] = lacks
    return missing


def test_a_local_store_has_every_member_the_protocols_list(tmp_path):
    with ckptstore.Store(tmp_path / "s", create=True) as s:
        s.commit({"w": torch.arange(8.0)}, tag="t")
        assert members_missing(s, bucket=False) == {}


def test_a_bucket_store_has_every_member_the_protocols_list(s3_server):
    with ckptstore.Store(f"s3://ckpt/interfaces-{uuid.uuid4().hex[:12]}", create=True) as s:
        s.commit({"w": torch.arange(8.0)}, tag="t")
        assert members_missing(s, bucket=True) == {}


def test_the_protocols_list_few_members():
    counts = {name: len(members(p)) for name, p in protocols().items()}
    print(counts)
    assert counts["CheckoutRepository"] == 10 and counts["CommitRepository"] == 7
    assert max(counts.values()) <= 14  # (RemoteRepository: a source and a target)


def test_the_committer_keeps_no_cycle_with_the_store(tmp_path):
    """The store owns its committer, which holds it weakly: a store dropped without close is
    freed at once (its catalog connection with it), with Python's cycle collector off; one
    with an asynchronous commit pending stays alive until that commit ran."""
    was = gc.isenabled()
    gc.disable()
    try:
        s = ckptstore.Store(tmp_path / "s", create=True)
        first = s.commit({"w": torch.arange(8.0)}, tag="a")
        future = s.commit_async({"w": torch.arange(8.0) + 1}, tag="b")
        del s
        info = future.result()  # the queued commit kept the store alive
        assert info.tags == ("b",) and info.id != first.id
        s = ckptstore.Store(tmp_path / "s")
        assert torch.equal(s.checkout("b")["w"], torch.arange(8.0) + 1)
        ref = weakref.ref(s)
        del s
        assert ref() is None
    finally:
        if was:
            gc.enable()
