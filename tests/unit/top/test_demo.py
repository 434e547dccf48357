"""The main job: the demo collects CartPole with TorchRL, trains, commits and restores."""

from __future__ import annotations

import ckptstore

from tests.unit.top.test_cli import cli


def test_demo_end_to_end(tmp_path, monkeypatch, capsys):
    code, out, err = cli(monkeypatch, capsys, "demo", "--store", str(tmp_path / "s"), "--frames", "1000", "--every", "500")
    assert code == 0, err
    assert "identical indices, weights and data" in out and "parameters bit-identical" in out
    with ckptstore.Store(tmp_path / "s") as s:
        assert set(s.tags()) == {"step-500", "step-1000", "latest"}
        log = s.log("latest")
        assert [c.metadata["frames"] for c in log] == [1000, 500]
        assert log[0].parents == (log[1].id,)
        assert log[0].new_bytes < log[0].logical_bytes / 1.5  # the second commit reuses most shards
        assert list(s.components("latest")) == ["rb/storage", "rb/writer", "rb/sampler", "policy", "optim", "rng", "progress"]


def test_demo_never_writes_into_the_users_store(tmp_path, monkeypatch, capsys):
    user = ckptstore.Store(tmp_path / "mine", create=True)
    cid = user.commit({"x": ckptstore.RNGState()}, tag="latest").id
    user.close()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPTSTORE_PATH", str(tmp_path / "mine"))
    code, _, err = cli(monkeypatch, capsys, "demo", "--frames", "500", "--every", "250")
    assert code == 0, err
    with ckptstore.Store(tmp_path / "mine", create=False) as s:
        assert s.tags() == {"latest": cid} and len(s.log()) == 1
    with ckptstore.Store(tmp_path / "runs" / "demo-store", create=False) as s:
        assert set(s.tags()) == {"step-250", "step-500", "latest"}


def test_a_second_demo_in_the_same_store_starts_its_own_lineage(tmp_path, monkeypatch, capsys):
    """Run twice into one store: the second run's first commit has no parent (not the first
    run's ``latest`` and ``step-250`` as two parents), and its dedup is never printed as ``inf``."""
    for _ in range(2):
        code, out, err = cli(monkeypatch, capsys, "demo", "--store", str(tmp_path / "s"), "--frames", "500", "--every", "250")
        assert code == 0, err
    assert "inf" not in out and "all held" in out and "starts a new lineage" in out
    with ckptstore.Store(tmp_path / "s") as s:
        second = s.log("latest")
        assert [len(c.parents) for c in second] == [1, 0] and second[0].parents == (second[1].id,)
        assert len(s.log()) == 4 and [c.new_bytes for c in second] == [0, 0]  # the same seed: the same states
