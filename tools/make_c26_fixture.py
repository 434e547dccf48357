"""Build the frozen "schema v1" fixture store of acceptance case C26.

It holds, as written by version-1 adapters:

- a prioritized sampler (capacity 8, alpha 0.5, eps 1e-8) whose max priority is
  stored transformed, ``(p + eps) ** alpha`` with p = 4.0;
- a round-robin writer record without a write count;
- a TensorDict record whose index leaf ``idx`` uses the legacy untagged encoding
  (a list of ``[start, stop, step]`` lists and ``"..."``).

Usage: ``python tools/make_c26_fixture.py tests/fixtures/c26_schema_v1``, run with
the code of catalog schema version 1 (commit 860e783), since the fixture also
freezes that catalog schema (opening it migrates it). The fixture is committed;
rerun only to rebuild it deliberately.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

import ckptstore


def main(dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    store = ckptstore.Store(dest)
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.5, beta=0.4, eps=1e-8, storage=LazyTensorStorage(8), batch_size=2)
    rb.extend(TensorDict({"obs": torch.arange(5.0)}, [5]))
    rb.update_priority(torch.arange(5), torch.tensor([1.0, 4.0, 2.0, 3.0, 0.5]))
    value, index = rb.sampler._max_priority
    rb.sampler._max_priority = ((value + 1e-8) ** 0.5, index)  # version 1 stored it transformed
    td = TensorDict({"x": torch.arange(3)}, [])
    td.set_non_tensor("idx", [[0, 2, None], "..."])  # version 1: untagged index
    comps = ckptstore.adapters.capture({"rb": rb, "td": td}, store.registry)
    for c in comps:  # as the version-1 adapters wrote them
        c.version = 1
        c.leaves.pop("rb/writer/write_count", None)
        if c.path == "td":
            c.meta = {**c.meta, "indices": ["idx"]}
    store.commit_components(comps, tag="v1")
    store.close()
    for leftover in ("catalog.sqlite-wal", "catalog.sqlite-shm"):
        (dest / leftover).unlink(missing_ok=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
