"""Build the frozen "schema v1, many commits" fixture store ``tests/fixtures/schema_v1_many``.

A store written by the code of catalog schema version 1 (commit 860e783: no commit
records in packs yet, so opening it migrates the catalog and backfills every record):
60 commits, each ``{"w": torch.full((32,), i, dtype=torch.float32), "shared": torch.arange(256)}``
for i in 0..59, tag ``t<i % 20>`` moved by each (20 tags, three commits each), and
``expected.json`` beside the store: ``{"tags": {tag: commit id}, "commits": {commit id: i}}``.

Usage (the old code from git, the current venv)::

    mkdir /tmp/old && git archive 860e783 src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src .venv/bin/python tools/make_schema_v1_fixture.py tests/fixtures/schema_v1_many

The fixture is committed; rerun only to rebuild it deliberately.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

import ckptstore


def state(i: int) -> dict:
    return {"w": torch.full((32,), float(i)), "shared": torch.arange(256)}


def main(dest: Path) -> None:
    from ckptstore.home.catalog import SCHEMA_VERSION

    assert SCHEMA_VERSION == 1, "run with the code of schema version 1 (see the module docstring)"
    shutil.rmtree(dest, ignore_errors=True)
    commits = {}
    with ckptstore.Store(dest) as store:
        for i in range(60):
            commits[store.commit(state(i), tag=f"t{i % 20}", message=f"commit {i}").id] = i
        tags = store.tags()
    for leftover in ("catalog.sqlite-wal", "catalog.sqlite-shm"):
        (dest / leftover).unlink(missing_ok=True)
    shutil.rmtree(dest / "tmp", ignore_errors=True)  # (git keeps no empty folder)
    (dest.parent / f"{dest.name}.expected.json").write_text(json.dumps({"tags": tags, "commits": commits}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
