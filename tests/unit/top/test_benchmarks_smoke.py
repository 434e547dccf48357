"""The benchmark suite runs end to end (``--smoke``: tiny sizes, 1 repetition) and
benchmarks.compare flags regressions. No timing assertions: this is a functional check."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import compare
from benchmarks.measure import read_raw_into, write_raw
from benchmarks.spec import FLOOR, PEERS, SYSTEMS, WARM_OPS, WORKLOADS
from tests import paths

ROOT = paths.REPO


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "smoke.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke", "--workdir", str(tmp / "work"), "--datadir", str(tmp / "data"), "--output", str(out)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"benchmarks.run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert not any((tmp / "work").glob("run-*")), "the run left its work folder behind"
    return out


def test_smoke_results_cover_every_entry(smoke: Path):
    doc = json.loads(smoke.read_text())
    assert doc["meta"]["repetitions"] == 1 and doc["meta"]["smoke"] is True
    assert "fsync" in doc["meta"]["durability"] and doc["meta"]["reads"].startswith("cold")
    assert set(doc["results"]) == set(WORKLOADS)
    for wl, spec in WORKLOADS.items():
        assert set(doc["results"][wl]) == set(spec.ops), wl
        for op in spec.ops:
            for system in SYSTEMS:
                e = doc["results"][wl][op][system]
                where = f"{wl}/{op}/{system}"
                reason = spec.reason(op, system)
                if reason is not None:
                    assert e == {"status": "n/a", "reason": reason}, where
                    continue
                if wl == "async" and e["status"] == "not available":
                    assert "commit_async" in e["reason"]
                    continue
                assert e["status"] == "ok", (where, e)
                assert e["n"] == 1 and "errors" not in e, where
                m = {k: v["median"] for k, v in e["metrics"].items()}
                for k, v in e["metrics"].items():
                    assert v["min"] <= v["median"] <= v["max"], (where, k)
                for k in ("wall_s", "throughput_gbps", "logical_bytes", "peak_rss", "rss_before", "rss_baseline"):
                    assert m[k] > 0, (where, k, m.get(k))
                # memory beyond the state: peak - the child's RSS after its imports - the state's bytes
                assert m["peak_rss_over_state"] == m["peak_rss"] - m["rss_baseline"] - m["logical_bytes"], where
                assert m["rss_baseline"] < m["peak_rss"], where
                if op.startswith("load"):
                    assert m["bytes_read"] >= 0, where
                    if op in WARM_OPS:  # right after the save, nothing evicted: the files are in the page cache
                        assert "resident_before" not in m and m["resident_warm"] > 0.5, (where, m)
                    elif m.get("resident_before", 1.0) < 0.5:  # the eviction worked (not on tmpfs): cold reads are counted
                        assert m["bytes_read"] > 0, (where, m)
                else:
                    floor = 0 if (system, op) == ("ckptstore", "save_unchanged") else 1
                    assert m["bytes_written"] >= floor, (where, m["bytes_written"])
    r = doc["results"]
    assert r["w2"]["save"]["ckptstore"]["metrics"]["stored_over_logical"]["median"] > 0
    assert doc["meta"]["sizes"]["w2_noise"] == 0.0 and doc["meta"]["data"]["w2"]["noise"] == 0.0 and "w2_noise" in doc["meta"]
    assert r["w1"]["load_sampler_only"]["ckptstore"]["metrics"]["sampler_stored_bytes"]["median"] > 0
    for system in ("ckptstore", "rb.dumps"):
        m = r["w4"]["rolling_commit"][system]["metrics"]
        assert m["store_bytes"]["median"] > 0 and m["commits"]["median"] == doc["meta"]["sizes"]["w4_commits"]
    # the physical floor: measured where defined, n/a with a reason elsewhere, not hidden behind errors
    assert FLOOR in PEERS and "floor" in doc["meta"]
    measured = {(wl, op) for wl, ops in r.items() for op, sy in ops.items() if sy[FLOOR]["status"] == "ok"}
    assert measured == {("w1", "save"), ("w1", "load"), ("w1", "load_warm"), ("w1", "load_into_existing"), ("w2", "save"), ("w5", "save"),
                        ("w5", "load"), ("w5", "load_warm"), ("w6", "save"), ("w6", "load"), ("w6", "load_warm")}
    # warm-read rows next to the cold ones (W1, W5, W6), for every system that loads
    for wl in ("w1", "w5", "w6"):
        for system, e in r[wl]["load"].items():
            assert (e["status"] == "ok") == (r[wl]["load_warm"][system]["status"] == "ok"), (wl, system)
    # W6: the unchanged re-commit in the save child, and the reuse_hashes=False escape hatch
    w6 = r["w6"]["save_unchanged"]["ckptstore"]["metrics"]
    assert w6["rehash_commit_s"]["median"] > 0 and w6["ckpt_new_bytes"]["median"] == 0
    assert {s for s, e in r["w6"]["save_unchanged"].items() if e["status"] == "ok"} == {"ckptstore", "torch.save", "safetensors", "tensordict.memmap"}
    # stall: both arms timed, commits started in the commit arm, the ratios of the arms' means and medians
    st = {k: v["median"] for k, v in r["stall"]["train_steps"]["ckptstore"]["metrics"].items()}
    sizes = doc["meta"]["sizes"]
    assert st["steps"] == 2 * sizes["stall_steps"] and st["commits_started"] == 2 * (sizes["stall_steps"] // sizes["stall_every"])
    assert 0 <= st["commits_completed_in_window"] <= st["commits_started"]
    assert st["stall_ratio_mean"] == pytest.approx(st["step_mean_s"] / st["base_step_mean_s"])
    assert st["stall_ratio_median"] == pytest.approx(st["step_median_s"] / st["base_step_median_s"])
    assert st["wall_s"] == st["step_mean_s"] and st["call_mean_s"] > 0 and st["resolve_mean_s"] >= st["call_mean_s"]
    for wl, op in measured:
        fm = r[wl][op][FLOOR]["metrics"]
        if not op.startswith("load"):  # raw bytes, durable: it writes at least the logical bytes
            assert fm["bytes_written"]["median"] >= fm["logical_bytes"]["median"], (wl, op)
        for system, e in r[wl][op].items():  # every measured system / the floor
            if system != FLOOR and e["status"] == "ok":
                got = doc["floor_ratios"][wl][op][system]["wall_s"]
                assert got == pytest.approx(e["metrics"]["wall_s"]["median"] / fm["wall_s"]["median"]), (wl, op, system)
    # async: both copy floors and the call's ratio to each
    a = r["async"]["commit_async"]["ckptstore"]
    if a["status"] == "ok":
        am = {k: v["median"] for k, v in a["metrics"].items()}
        assert 0 < am["prealloc_copy_s"] and 0 < am["prealloc_copy_tensors_s"]
        assert am["call_over_row_copy"] == pytest.approx(am["wall_s"] / am["prealloc_copy_s"])
        assert am["call_over_tensor_copy"] == pytest.approx(am["wall_s"] / am["prealloc_copy_tensors_s"])
    # ratios: ckptstore median / peer median for every measured peer (the floor included)
    for wl, ops in r.items():
        for op, systems in ops.items():
            if systems["ckptstore"]["status"] != "ok":
                continue
            for peer, e in systems.items():
                if peer != "ckptstore" and e["status"] == "ok":
                    ratio = doc["ratios"][wl][op][peer]["wall_s"]
                    expect = systems["ckptstore"]["metrics"]["wall_s"]["median"] / e["metrics"]["wall_s"]["median"]
                    assert ratio == pytest.approx(expect), (wl, op, peer)


def test_compare_passes_identical_and_flags_worse(smoke: Path, tmp_path: Path, capsys):
    assert compare.main([str(smoke), str(smoke)]) == 0

    doc = json.loads(smoke.read_text())
    worse = copy.deepcopy(doc)
    m = worse["results"]["w1"]["save"]["ckptstore"]["metrics"]
    m["wall_s"]["median"] *= 1.10  # 10 % slower
    m["throughput_gbps"]["median"] *= 0.5
    m["peak_rss"]["median"] += 512 << 20
    path = tmp_path / "worse.json"
    path.write_text(json.dumps(worse))
    capsys.readouterr()
    assert compare.main([str(path), str(smoke)]) == 1
    out = capsys.readouterr().out
    for metric in ("wall_s", "throughput_gbps", "peak_rss"):
        assert metric in out
    rows = compare.compare(worse, doc)
    flagged = {(r["workload"], r["op"], r["system"], r["metric"]) for r in rows if r["verdict"] == "worse"}
    assert flagged == {("w1", "save", "ckptstore", k) for k in ("wall_s", "throughput_gbps", "peak_rss")}
    # within tolerance: not flagged
    assert compare.main([str(path), str(smoke), "--tolerance", "0.2", "--min-bytes", str(1 << 30)]) == 1  # throughput still -50 %
    better = copy.deepcopy(doc)
    better["results"]["w1"]["save"]["ckptstore"]["metrics"]["wall_s"]["median"] *= 0.5
    path.write_text(json.dumps(better))
    assert compare.main([str(path), str(smoke)]) == 0
    # the new rows are covered: a slower warm checkout, a slower W6 re-commit, more stall
    for wl, op, metric in (("w6", "load_warm", "wall_s"), ("w6", "save_unchanged", "wall_s"), ("w1", "load_warm", "wall_s"),
                           ("stall", "train_steps", "stall_ratio_mean")):
        worse = copy.deepcopy(doc)
        worse["results"][wl][op]["ckptstore"]["metrics"][metric]["median"] *= 1.10
        rows = compare.compare(worse, doc, min_seconds=0)
        assert {(r["workload"], r["op"], r["metric"]) for r in rows if r["verdict"] == "worse"} == {(wl, op, metric)}
    # an entry the baseline measured that is missing now is flagged
    del better["results"]["w5"]["load"]["dcp"]
    path.write_text(json.dumps(better))
    assert compare.main([str(path), str(smoke)]) == 1


def test_raw_floor_io_round_trips(tmp_path: Path):
    import numpy as np

    bufs = [np.arange(100_000, dtype=np.float32), np.array([True, False, True]), np.arange(7, dtype=np.int64)]
    path = tmp_path / "raw.bin"
    assert write_raw(path, bufs) == sum(b.nbytes for b in bufs) == path.stat().st_size
    back = [np.empty_like(b) for b in bufs]
    assert read_raw_into(path, back) == path.stat().st_size
    for a, b in zip(bufs, back):
        assert np.array_equal(a, b)
    with pytest.raises(EOFError):
        read_raw_into(path, [np.empty(path.stat().st_size + 1, dtype=np.uint8)])


def test_objstore_benchmark_quick(tmp_path: Path):
    """benchmarks/objstore.py --quick (64 MiB, 1 repetition, its own moto server) runs end to
    end and its byte counts agree with each other. No timing or size-target assertions."""
    pytest.importorskip("moto", reason="needs moto[server]")
    pytest.importorskip("obstore")
    import os

    import ckptstore

    out = tmp_path / "objstore.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(ckptstore.__file__).resolve().parents[1]), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.objstore", "--quick", "--workdir", str(tmp_path), "--output", str(out)],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"benchmarks.objstore failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert not list(tmp_path.glob("ckptstore-objbench-*")), "the run left its work folder behind"
    doc = json.loads(out.read_text())
    assert doc["meta"]["quick"] and doc["meta"]["repetitions"] == 1 and doc["meta"]["size_mib"] == 64
    assert not doc["meta"]["settings"]["experiment"]
    (r,) = doc["repetitions"]
    state = doc["meta"]["state_bytes"]
    for k in ("commit_s", "floor_put_s", "recommit_s", "partial_s", "whole_s", "floor_get_s", "push1_s", "push2_s"):
        assert r[k] > 0, k
    assert r["commit_bytes"] >= state and r["commit_stored_bytes"] >= state  # random floats: stored raw
    assert r["commit_phases"]["pack_puts"] >= 1 and r["commit_phases"]["upload_wait_s"] >= 0
    assert 0 < r["changed_bytes"] <= r["recommit_new_bytes"] <= r["recommit_bytes"] < state // 10
    # the partial checkout read exactly the component's entries, and little else
    p = r["partial"]
    assert p["io_bytes_read"] == r["partial_stored_bytes"] == p["fetched"]["packs"]["bytes"]
    assert r["partial_stored_bytes"] >= r["partial_logical_bytes"] == state // 16
    assert p["fetched_bytes"] == sum(c["bytes"] for c in p["fetched"].values()) and 1 <= r["partial_total_over_stored"] < 1.1
    w = r["whole"]
    assert w["io_bytes_read"] == w["fetched"]["packs"]["bytes"] >= state
    # push: the TransferReport agrees with the bucket's listing (the ref's bytes are not in bytes_written)
    for i in (1, 2):
        t = r[f"push{i}"]
        assert t["objects_written"] == t["listed_new_objects"] and 0 < t["listed_new_bytes"] - t["bytes_written"] < 1024, (i, t)
    assert r["push1"]["bytes_written"] >= state > 10 * r["push2"]["bytes_written"] > 0
    q = doc["summary"]["ratios"]
    assert q["commit_over_floor"] == pytest.approx(r["commit_s"] / r["floor_put_s"])
    assert q["whole_checkout_over_floor_get"] == pytest.approx(r["whole_s"] / r["floor_get_s"])
    assert set(doc["summary"]["met"]) == set(doc["summary"]["targets"])
