"""Build the schema-1 and schema-2 fixture stores of the process harness (tests/harness/procharness.py).

Each holds 40 commits of a small training state (a dict of tensors and a JSON step), in one
lineage, with a tag ``step-<n>`` on every fourth commit and ``latest`` on the last: enough
commits that the record backfill of a schema-1 store's first open takes a moment, so that
SIGKILLs during migrations land inside it.

Usage, with the code of the catalog schema wanted (schema 1: commit 860e783; schema 2: the
parent of commit fac5683), e.g.::

    git archive 860e783 src | tar -x -C /tmp/v1
    PYTHONPATH=/tmp/v1/src python tools/make_procharness_fixtures.py tests/fixtures/procharness_schema_v1

The fixtures are committed; rerun only to rebuild them deliberately.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

import ckptstore


def main(dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    store = ckptstore.Store(dest)
    g = torch.Generator().manual_seed(41)
    w = torch.randn(16, 32, generator=g)
    for step in range(1, 41):
        w[step % 16].add_(1.0)
        state = {"w": w, "b": torch.full((8,), float(step)), "meta": {"step": step}}
        tags = ["latest"] + ([f"step-{step}"] if step % 4 == 0 else [])
        store.commit(state, tag=tags, message=f"step {step}", metadata={"step": step})
    store.close()
    for junk in ("catalog.sqlite-wal", "catalog.sqlite-shm", "tmp"):
        p = dest / junk
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
