"""Adversarial cases of ``Store("s3://…")``: a damaged local cache, hostile tag payloads."""

from __future__ import annotations

import uuid

import pytest
import torch

import ckptstore
from ckptstore.home.bucket_cache import cache_folder

from tests.conftest import assert_bit_equal


@pytest.fixture
def url(s3_server) -> str:
    return f"s3://ckpt/brk-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize("damage", ["garbage", "truncated", "sqlite-deleted"])
def test_a_damaged_cache_is_rebuilt_from_the_bucket(url, damage):
    with ckptstore.Store(url) as s:
        first = s.commit({"w": torch.arange(10.0)}, tag="latest")
    folder = cache_folder(url)
    catalog = folder / "catalog.sqlite"
    if damage == "garbage":
        catalog.write_bytes(b"garbage" * 100)
    elif damage == "truncated":
        catalog.write_bytes(catalog.read_bytes()[:3000])
    else:  # the catalog gone, its record packs still in the folder
        for f in folder.glob("catalog.sqlite*"):
            f.unlink()
        assert list(folder.glob("blobs/*/*.pack"))
    with ckptstore.Store(url) as s:
        assert_bit_equal(s.checkout("latest")["w"], torch.arange(10.0))
        second = s.commit({"w": torch.arange(11.0)}, tag="latest")
        assert second.parents == (first.id,)
        assert [c.id for c in s.log("latest")] == [second.id, first.id]
        assert s.fsck().ok
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(folder.name)] == [folder.name]  # the damaged copy is gone


def test_fsck_reports_a_tag_with_a_malformed_payload(url):
    from ckptstore.backends import open_backend

    with ckptstore.Store(url) as s:
        s.commit({"w": torch.arange(10.0)}, tag="good")
        s.commit({"w": torch.arange(3.0)}, tag="bad")
    with open_backend(url) as b:
        b.cas_ref("bad", b'["not", "a", "tag"]', b.read_ref("bad").version)
    with ckptstore.Store(url) as s:
        report = s.fsck()
        assert not report.ok
        assert report.damaged_tags == ["bad"]
        assert report.problems == [f"tag 'bad': {url}: tag 'bad' holds a malformed payload"]
        assert report.commits == 2 and report.damaged_commits == []
        assert_bit_equal(s.checkout("good")["w"], torch.arange(10.0))
        assert s.tags() == {"good": s.resolve("good")}  # listed without the malformed one
        with pytest.raises(ckptstore.errors.IntegrityError):
            s.gc(grace=0)  # which commit it holds is unknown: GC keeps everything rather than guess
        assert s.delete_tag("bad") == ""  # removed all the same
        assert s.fsck().ok and s.gc(grace=0).commits_dropped == 1


def test_a_tag_that_moved_is_a_successful_commit_even_if_its_reflog_record_fails(url, s3_server):
    from datetime import timedelta

    from ckptstore.backends import S3Backend

    fast = {"max_retries": 1, "backoff": {"init_backoff": timedelta(milliseconds=5), "max_backoff": timedelta(milliseconds=10), "base": 2}}
    s = ckptstore.Store(url, backend=S3Backend(url, retry_config=fast))
    first = s.commit({"w": torch.arange(4.0)}, tag="latest")
    s3_server.set_faults([{"method": "PUT", "key": f"/{url[5:]}/reflog/", "action": "500-before", "count": 1000}])
    try:
        with pytest.warns(ckptstore.errors.ReflogWarning, match="moved to"):
            second = s.commit({"w": torch.arange(5.0)}, tag="latest")
    finally:
        s3_server.set_faults([])
    assert s.tags() == {"latest": second.id} and second.parents == (first.id,)
    assert [m["new_commit"] for m in s.reflog("latest")] == [first.id]  # the lost entry
    s.close()


def test_deleting_the_cache_folder_under_an_open_store_loses_nothing(url):
    import shutil

    s = ckptstore.Store(url)
    first = s.commit({"w": torch.arange(10.0)}, tag="latest")
    shutil.rmtree(cache_folder(url))
    second = s.commit({"w": torch.arange(11.0)}, tag="latest")
    assert second.parents == (first.id,)
    s.close()
    with ckptstore.Store(url) as again:  # a new cache, built from the bucket
        assert [c.id for c in again.log("latest")] == [second.id, first.id]
        assert_bit_equal(again.checkout("latest")["w"], torch.arange(11.0))
