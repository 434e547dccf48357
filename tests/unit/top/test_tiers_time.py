"""The two tiers over time (issue 35, findings 2 and 3): a node that comes back with its old
disk, a bucket that cannot be reached at a resume, an outage that recovers, a save made while
the bucket was down, and the local tier's disk after many saves.

Real processes: each node is a Python process (``python -m tests.unit.top.test_tiers_time``, one rank,
its own local folder) with a tiered ``Checkpointer(local=, remote=)``; the bucket is the
moto S3 server (tests/s3server.py), reached through tests/delay_proxy.py where a node's
network must be cut (the proxy process is killed and restarted on the same port).
Every restored state is compared bit for bit with the state saved at that step."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import uuid
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.errors import BackendError, CkptStoreError, PushFailedWarning

from tests.delay_proxy import DelayProxy, free_port
from tests import paths

pytestmark = pytest.mark.timeout(300)

ROOT = paths.REPO
FAST = {"max_retries": 1, "backoff": {"init_backoff": timedelta(milliseconds=20), "max_backoff": timedelta(milliseconds=50), "base": 2},
        "retry_timeout": timedelta(seconds=2)}


def trained(step: int) -> dict:
    """The state of the job after ``step`` steps (replicated weights, a counter)."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(512, 64, generator=g), "b": torch.randn(64, generator=g), "mine": torch.full((8,), 1000 * step, dtype=torch.int64)}


def empty() -> dict:
    return {"w": torch.zeros(512, 64), "b": torch.zeros(64), "mine": torch.zeros(8, dtype=torch.int64)}


def exact(state: dict, step: int) -> bool:
    want = trained(step)
    return all(state[k].dtype == want[k].dtype and torch.equal(state[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def tiered(local: str, url: str, state: dict, endpoint: str | None = None, **kw) -> ckptstore.Checkpointer:
    """A one-rank node's Checkpointer; ``endpoint``: the S3 endpoint it uses (a proxy). The
    client gives up on an unreachable bucket within seconds where this code lets it say so."""
    params = inspect.signature(ckptstore.Checkpointer).parameters
    if "remote_config" in params:  # (on code that predates it, the client's defaults)
        kw["remote_config"] = {"retry_config": FAST, **({"config": {"endpoint": endpoint}} if endpoint else {})}
    return ckptstore.Checkpointer(None, {"state": state}, dcp=True, local=local, remote=url, every_n_steps=2, keep_last=2,
                                  on_signal=(), part_timeout=10, push_attempts=2, push_backoff=0.05, **kw)


# --- a node: one process ---------------------------------------------------------------------


def node_main(args: dict) -> dict:
    """One node's life: resume from ``local`` / ``url`` (through ``args["proxy"]`` when given,
    started only after the resume when ``proxy_after_resume``), then train to ``until``,
    waiting for each save's push. Returns what it saw, as JSON values."""
    proxy = None
    endpoint = None
    if args.get("proxy"):
        proxy = DelayProxy(args["upstream"], args["proxy"])
        endpoint = proxy.endpoint
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        if not args.get("proxy_after_resume"):
            proxy.start()
    state = empty()
    ckpt = tiered(args["local"], args["url"], state, endpoint)
    out: dict = {"pushes": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = ckpt.resume() or 0
        out["resumed"], out["from"], out["exact"] = start, ckpt.resumed_from, start == 0 or exact(ckpt.objects["state"], start)
        out["bucket_step"] = getattr(ckpt, "bucket_step", "n/a")
        ours = lambda ws: [w.category.__name__ for w in ws if w.category.__module__.startswith("ckptstore")]  # noqa: E731 (not torch's)
        out["warned"] = ours(caught)
        seen = len(caught)
        if proxy is not None and proxy.proc is None:
            proxy.start()
        try:
            ckpt.wait_pushed()  # a resumed save that never reached the bucket is pushed again
            out["after_resume"] = None
        except CkptStoreError as exc:
            out["after_resume"] = type(exc).__name__
        out["durable_after_resume"] = list(ckpt.durable_steps)
        state = ckpt.objects["state"]
        for step in range(start + 1, args["until"] + 1):
            state.update(trained(step))
            if ckpt.step() is not None:  # a save (this node's part, committed locally)
                try:
                    ckpt.wait_pushed()
                    out["pushes"].append([step, None])
                except CkptStoreError as exc:
                    out["pushes"].append([step, type(exc).__name__])
        out["warned_later"] = sorted(set(ours(caught[seen:])))
    out["durable"], out["not_durable"] = ckpt.durable_steps, ckpt.not_durable_steps
    if proxy is not None:
        proxy.stop()
    return out


def node(**args) -> dict:
    """Run :func:`node_main` in a new process (its own interpreter, its own client)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "XDG_CACHE_HOME": str(Path(args["local"]).parent / f"cache-{uuid.uuid4().hex[:8]}")}
    proc = subprocess.run([sys.executable, "-m", "tests.unit.top.test_tiers_time", json.dumps(args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=240)
    if proc.returncode != 0:
        raise AssertionError(f"node process failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- what the bucket holds --------------------------------------------------------------------


def bucket_view(url: str) -> dict:
    """The bucket's latest (commit, step), its step tags, and the steps ``latest`` ever named
    (its reflog, oldest first)."""
    with ckptstore.Store(url, cache=Path(os.environ["XDG_CACHE_HOME"]) / uuid.uuid4().hex) as b:
        tags = b.tags()
        step = lambda cid: b.info(cid).metadata["step"]  # noqa: E731
        history = [step(m["new_commit"]) for m in reversed(b.reflog("latest")) if m["new_commit"]]
        return {"latest": tags["latest"], "step": step(tags["latest"]), "history": history,
                "steps": {t: (c, step(c)) for t, c in tags.items() if t.startswith("step-")}}


def assert_monotone(history: list[int]) -> None:
    assert all(a < b for a, b in zip(history, history[1:])), f"latest moved backwards: {history}"


@pytest.fixture
def url(s3_server) -> str:
    return f"s3://ckpt/tiers-{uuid.uuid4().hex[:12]}"


def test_a_node_back_with_its_old_disk_resumes_from_the_bucket_and_never_moves_latest_back(s3_server, url, tmp_path):
    x, y = str(tmp_path / "x"), str(tmp_path / "y")
    first = node(local=x, url=url, until=4)  # nodes X: saves 2, 4, both pushed
    assert (first["resumed"], first["pushes"], first["durable"]) == (0, [[2, None], [4, None]], [2, 4]), first
    second = node(local=y, url=url, until=8)  # new nodes Y: from the bucket, to step 8
    assert (second["resumed"], second["from"], second["exact"], second["durable"]) == (4, "remote", True, [6, 8]), second
    before = bucket_view(url)
    assert before["step"] == 8 and before["history"] == [2, 4, 6, 8], before
    back = node(local=x, url=url, until=12)  # X again, with its disk of step 4: the bucket's step 8 wins
    assert (back["resumed"], back["from"], back["exact"], back["bucket_step"]) == (8, "remote", True, 8), back
    assert back["pushes"] == [[10, None], [12, None]] and back["durable"] == [10, 12] and back["warned"] == [], back
    after = bucket_view(url)
    assert after["step"] == 12 and after["history"] == [2, 4, 6, 8, 10, 12], after
    assert after["steps"]["step-8"] == before["steps"]["step-8"] and after["steps"]["step-6"] == before["steps"]["step-6"]
    assert_monotone(after["history"])


def test_a_node_that_cannot_reach_the_bucket_resumes_locally_says_so_and_cannot_lower_it(s3_server, url, tmp_path):
    x, y = str(tmp_path / "x"), str(tmp_path / "y")
    assert node(local=x, url=url, until=4)["durable"] == [2, 4]
    assert node(local=y, url=url, until=8)["durable"] == [6, 8]
    before = bucket_view(url)
    # X again, its network cut while it resumes (the proxy starts only afterwards): its own step 4, and a warning
    back = node(local=x, url=url, until=8, upstream=s3_server.endpoint, proxy=free_port(), proxy_after_resume=True)
    assert (back["resumed"], back["from"], back["exact"], back["bucket_step"]) == (4, "local", True, None), back
    assert back["warned"] == ["BucketNotConsultedWarning"], back
    # its saves 6 and 8 reach the bucket, which holds step 8: both refused, nothing of them written there
    assert back["pushes"] == [[6, "OlderStepError"], [8, "OlderStepError"]] and back["durable"] == [], back
    assert back["not_durable"] == [6, 8] and "PushFailedWarning" in back["warned_later"], back
    after = bucket_view(url)
    assert after == before, (before, after)  # latest, every step tag and latest's history: unchanged
    assert after["step"] == 8 and after["history"] == [2, 4, 6, 8]
    with ckptstore.Store(url, cache=tmp_path / "look") as b:
        assert not [t for t in b.tags() if t.startswith("parts/")]  # not even a part of the refused saves
    again = node(local=x, url=url, until=10)  # reachable again: the bucket's step 8, then 10
    assert (again["resumed"], again["from"], again["pushes"]) == (8, "remote", [[10, None]]), again
    assert bucket_view(url)["history"] == [2, 4, 6, 8, 10]


def test_wait_pushed_after_an_outage_that_recovered_reports_the_superseded_failure(s3_server, url, tmp_path):
    proxy = DelayProxy(s3_server.endpoint).start()
    state = empty()
    ckpt = tiered(str(tmp_path / "x"), url, state, proxy.endpoint)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ckpt.resume() is None
            state.update(trained(1))
            ckpt.step()
            state.update(trained(2))
            ckpt.step()  # save 2
            assert ckpt.wait_pushed() is True and ckpt.durable_steps == [2]
            proxy.stop()  # the bucket is down
            for step in (3, 4):
                state.update(trained(step))
                ckpt.step()  # save 4: its push fails
            with pytest.raises(BackendError):
                ckpt.wait_pushed()  # the newest save is not durable: raised
            assert [(f.step, type(f.error).__name__) for f in ckpt.push_failures] == [(4, "BackendError")]
            proxy.start()  # back, on the same endpoint
            for step in (5, 6):
                state.update(trained(step))
                ckpt.step()  # save 6: durable
            assert ckpt.wait_pushed() is True  # nothing raised: step 4's failure is superseded by step 6
            assert ckpt.push_error is None
            assert [(f.step, type(f.error).__name__) for f in ckpt.push_superseded] == [(4, "BackendError")]
            assert (ckpt.durable_steps, ckpt.not_durable_steps) == ([2, 6], [4])
            texts = [str(w.message) for w in caught if w.category is PushFailedWarning]
            assert len(texts) == 2 and "step 4" in texts[0] and "superseded: the save of step 6 is durable there" in texts[1], texts
        view = bucket_view(url)
        assert view["step"] == 6 and view["history"] == [2, 6] and sorted(view["steps"]) == ["step-2", "step-6"]
    finally:
        proxy.stop()


def test_a_save_made_while_the_bucket_was_down_is_pushed_after_a_local_resume(s3_server, url, tmp_path):
    proxy = DelayProxy(s3_server.endpoint).start()
    x = str(tmp_path / "x")
    state = empty()
    ckpt = tiered(x, url, state, proxy.endpoint)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in (1, 2):
                state.update(trained(step))
                ckpt.step()
            ckpt.wait_pushed()
            proxy.stop()
            for step in (3, 4):
                state.update(trained(step))
                ckpt.step()
            with pytest.raises(BackendError):
                ckpt.wait_pushed()
        with ckptstore.Store(x) as disk:
            local4 = disk.resolve("step-4")
            assert "parts/step-4/node-0" in disk.tags()  # kept for its push
        assert bucket_view(url)["step"] == 2
    finally:
        proxy.stop()
    # the job is requeued on the same node: it resumes its own step 4 (newer than the bucket's 2) and pushes it again
    back = node(local=x, url=url, until=6)
    assert (back["resumed"], back["from"], back["exact"], back["bucket_step"]) == (4, "local", True, 2), back
    assert (back["after_resume"], back["durable_after_resume"]) == (None, [4]), back
    assert back["pushes"] == [[6, None]] and back["durable"] == [4, 6], back
    view = bucket_view(url)
    assert view["history"] == [2, 4, 6] and view["steps"]["step-4"][1] == 4
    with ckptstore.Store(url, cache=tmp_path / "look") as b:  # the bucket's step 4 is the very save X made while it was down
        got = b.checkout("step-4")
        assert exact({k: got[f"state.{k}"] for k in ("w", "b", "mine")}, 4)
    with ckptstore.Store(x) as disk:
        assert disk.resolve("step-4") == local4 and not [t for t in disk.tags() if t.startswith("parts/")]


def test_the_local_tier_keeps_only_what_retention_needs(s3_server, url, tmp_path):
    """keep_last=2 on the node's disk, a GC of it after each durable push (grace 0 here): the
    disk holds exactly the two newest saves' commits, every one of them restorable."""
    x = str(tmp_path / "x")
    state = empty()
    ckpt = tiered(x, url, state, local_gc=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, 21):  # saves 2..20, no wait: pushes run beside the saves (newest wins), GC in the push thread
            state.update(trained(step))
            ckpt.step()
        ckpt.wait_pushed()
        durable = ckpt.durable_steps
        assert durable[-1] == 20 and sorted(durable + ckpt.not_durable_steps) == list(range(2, 21, 2)), (durable, ckpt.not_durable_steps)
        state.update(trained(21))
        ckpt.step()
        state.update(trained(22))
        ckpt.step()  # save 22, then its GC: the last word on the disk
        ckpt.wait_pushed()
    with ckptstore.Store(x) as disk:
        tags = disk.tags()
        assert sorted(tags) == ["latest", "step-20", "step-22"], tags
        assert {c.id for c in disk.log()} == {tags["step-20"], tags["step-22"]}  # no other commit is left
        assert not disk.fsck(deep=True).problems
        for step in (20, 22):
            got = disk.checkout(f"step-{step}")
            assert exact({k: got[f"state.{k}"] for k in ("w", "b", "mine")}, step)
    view = bucket_view(url)
    assert view["step"] == 22 and view["history"][-1] == 22
    assert_monotone(view["history"])


def test_an_explicit_rewind_moves_the_buckets_latest_lower_once(s3_server, url, tmp_path):
    """resume(ref="step-4") then saves: the one way the run's latest goes back, on purpose."""
    state = empty()
    ckpt = tiered(str(tmp_path / "x"), url, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, 9):
            state.update(trained(step))
            if ckpt.step() is not None:
                ckpt.wait_pushed()
        eighth = bucket_view(url)["steps"]["step-8"]
        again = empty()
        rewound = tiered(str(tmp_path / "x2"), url, again)
        assert rewound.resume(step=4) == 4 and rewound.resumed_from == "remote" and exact(rewound.objects["state"], 4)
        again = rewound.objects["state"]
        for step in range(5, 9):
            again.update(trained(step))
            if rewound.step() is not None:
                rewound.wait_pushed()  # step 6 lowers the bucket's latest (asked for), step 8 moves it up from there
    view = bucket_view(url)
    assert view["history"] == [2, 4, 6, 8, 6, 8] and view["step"] == 8 and rewound.durable_steps == [6, 8], view
    assert view["steps"]["step-8"] != eighth  # the rewound run's own step 8


def test_push_to_raises_only_for_the_newest_save_and_reports_the_superseded_failure(tmp_path):
    """The same worker and error model serve Checkpointer(push_to=...): a remote folder that
    cannot be written (a file is in its place), then can."""
    remote = tmp_path / "remote"
    remote.write_text("not a store")
    w = {"w": torch.arange(8.0)}
    ckpt = ckptstore.Checkpointer(tmp_path / "local", {"sd": w}, every_n_steps=1, on_signal=(), push_to=remote, push_attempts=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ckpt.step()
        with pytest.raises(CkptStoreError) as failed:
            ckpt.wait_pushed()  # step 1 is the newest save, and not durable
        assert ckpt.push_error is failed.value and [f.step for f in ckpt.push_failures] == [1]
        remote.unlink()
        w["w"] += 1
        second = ckpt.step()
        report = ckpt.wait_pushed()  # step 2 is durable: step 1's failure is superseded, not raised
    assert ckpt.push_error is None and [(f.step, f.error) for f in ckpt.push_superseded] == [(1, failed.value)]
    assert report.commit == second.id and first.id in report.commits_copied
    assert [w.category for w in caught] == [PushFailedWarning, PushFailedWarning]
    assert "is superseded: the save of step 2 is durable there" in str(caught[1].message)
    with ckptstore.Store(remote) as there:
        assert there.resolve("latest") == second.id and torch.equal(there.checkout("latest")["sd"]["w"], torch.arange(8.0) + 1)


if __name__ == "__main__":
    print(json.dumps(node_main(json.loads(sys.argv[1]))))
