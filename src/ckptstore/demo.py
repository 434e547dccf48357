"""The main job, end to end (``ckptstore demo``).

A TorchRL collector steps Gymnasium ``CartPole-v1`` with an epsilon-greedy
Q-network into a ``TensorDictPrioritizedReplayBuffer`` over
``LazyMemmapStorage``; DQN updates change the policy, the optimizer and the
priorities. Every ``every`` frames the whole training state
``{"rb", "policy", "optim", "rng", "progress"}`` is committed as ``step-N``
and ``latest``. Then: a partial checkout of ``rb/sampler``, a policy-only
restore, a full restore into freshly built objects with identical sampling
checked, and the lineage.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import RNGState, Store
from .core.errors import MissingExtraError, NotAStoreError
from .core.units import counted, dedup, fmt_bytes, ratio

CAPACITY = 10_000
BATCH = 64
PER_BATCH = 250  # frames per collector batch
#: CartPole rows are 4 to 16 bytes per key: with the default shards (256 KiB,
#: at most 4096 rows) a few thousand rows fit in one shard per key, which every
#: commit changes. The demo store uses 4 KiB shards so that row-level dedup
#: shows on this small buffer.
DEMO_SHARD_BYTES = 4096


def build(scratch: Path, frames: int, seed: int):
    """Fresh environment, Q-network policy, DQN loss, optimizer and replay buffer."""
    from tensordict.nn import TensorDictSequential
    from torchrl.data import LazyMemmapStorage, TensorDictPrioritizedReplayBuffer
    from torchrl.envs import GymEnv
    from torchrl.modules import MLP, EGreedyModule, QValueActor
    from torchrl.objectives import DQNLoss, SoftUpdate

    torch.manual_seed(seed)
    env = GymEnv("CartPole-v1")
    env.set_seed(seed)
    actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[64, 64]), in_keys=["observation"], spec=env.action_spec)
    explore = EGreedyModule(env.action_spec, eps_init=1.0, eps_end=0.05, annealing_num_steps=frames)
    loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
    loss.make_value_estimator(gamma=0.99)
    target = SoftUpdate(loss, eps=0.95)
    optim = torch.optim.Adam(loss.parameters(), lr=1e-3)
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=0.6, beta=0.4, priority_key="td_error", batch_size=BATCH,
        storage=LazyMemmapStorage(CAPACITY, scratch_dir=scratch),
    )
    return env, actor, TensorDictSequential(actor, explore), loss, target, optim, rb


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True)


def require_extra() -> None:
    """Check that the ``[demo]`` extra (Gymnasium, for CartPole) is installed.

    Raises:
        MissingExtraError: it is not, naming ``pip install 'ckptstore[demo]'``.
    """
    try:
        import gymnasium  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(f"the demo needs Gymnasium ({exc}): pip install 'ckptstore[demo]'") from None


def run(store_path: Path, frames: int = 3000, every: int = 500, seed: int = 0, console: Console | None = None) -> dict:
    """Run the demo; returns the figures it printed (used by the tests).

    Raises AssertionError if a restore does not reproduce the original state;
    MissingExtraError (before anything is written) without the ``[demo]`` extra.
    """
    require_extra()
    from torchrl.collectors import Collector

    console = console or Console()
    per_batch = PER_BATCH
    if every % per_batch or frames % per_batch or every <= 0 or frames <= 0:
        raise ValueError(f"frames and every must be positive multiples of {per_batch}")
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    store = Store(store_path, shard_bytes=DEMO_SHARD_BYTES)
    scratch = Path(tempfile.mkdtemp(prefix="ckptstore-demo-"))
    np.random.seed(seed)  # TorchRL's prioritized sampler draws from numpy's global generator (the rng component restores it)
    env, actor, policy, loss, target, optim, rb = build(scratch / "rb", frames, seed)
    collector = Collector(env, policy, frames_per_batch=per_batch, total_frames=frames, auto_register_policy_transforms=False)
    explore = policy[1]
    commits, seen, updates = [], 0, 0
    console.print(f"[bold]ckptstore demo[/bold]: CartPole-v1, DQN, prioritized replay over LazyMemmapStorage({CAPACITY}), store {store.root}")
    try:
        earlier = len(store.log())
    except NotAStoreError:  # a new store: the first commit creates it
        earlier = 0
    if earlier:  # a previous demo run: this one starts a lineage of its own and moves the tags to it
        console.print(f"the store holds {earlier} commits of earlier runs: this run starts a new lineage (its first commit has no parent)")
    with _progress(console) as bar:
        task = bar.add_task("collect + train", total=frames)
        for data in collector:
            rb.extend(data.reshape(-1))
            explore.step(data.numel())
            seen += data.numel()
            if len(rb) >= 2 * BATCH:
                for _ in range(8):
                    sample = rb.sample()
                    value = loss(sample)["loss"]
                    optim.zero_grad()
                    value.backward()
                    optim.step()
                    rb.update_tensordict_priority(sample)
                    target.step()
                    updates += 1
            if seen % every == 0:
                state = {"rb": rb, "policy": actor, "optim": optim, "rng": RNGState(), "progress": {"frames": seen, "updates": updates}}
                parents = [commits[-1].id] if commits else []  # this run's previous commit, never an earlier run's
                info = store.commit(state, tag=[f"step-{seen}", "latest"], message=f"after {seen} frames", metadata={"frames": seen, "updates": updates},
                                    parents=parents)
                commits.append(info)
                bar.console.print(f"committed step-{seen} as {info.id[:12]}: {info.shards_new} of {info.shards_total} shards new")
            bar.update(task, completed=seen)
    collector.shutdown()
    table = Table(title="commits (new: raw bytes the store did not hold; stored: bytes written; dedup: logical / new)")
    for col in ("tag", "commit", "logical", "new", "stored", "dedup", "seconds"):
        table.add_column(col, justify="left" if col in ("tag", "commit") else "right")
    for c in commits:
        table.add_row(c.tags[0], c.id[:12], fmt_bytes(c.logical_bytes), fmt_bytes(c.new_bytes), fmt_bytes(c.stored_bytes),
                      dedup(c.logical_bytes, c.new_bytes, c.dedup_ratio), f"{c.seconds:.3f}")
    console.print(table)

    # Partial checkout: the sampler's state only.
    before = store.io.blobs_read
    sampler = store.checkout("latest", partial=["rb/sampler"])["rb", "sampler"]
    sampler_blobs = store.io.blobs_read - before
    total_blobs = store.info("latest").shards_total
    console.print(
        f"partial checkout rb/sampler: {sampler_blobs} of {total_blobs} shards read; sum-tree total "
        f"{float(sampler['sum_tree'].double().sum()):.4f}, max priority {float(sampler['max_priority', 'value']):.4f}"
    )

    # Policy-only restore into a fresh network: reads no replay-buffer bytes.
    _, actor2, *_ = build(scratch / "unused", frames, seed + 1)
    before = store.io.bytes_read
    store.checkout("latest", into={"policy": actor2}, partial=["policy"])
    policy_bytes = store.io.bytes_read - before
    assert all(torch.equal(a, b) for a, b in zip(actor.state_dict().values(), actor2.state_dict().values()))
    console.print(f"policy-only restore: parameters bit-identical, {fmt_bytes(policy_bytes)} read (no replay-buffer blobs)")

    # Full restore into freshly built objects, then sample from both: identical.
    reference = [rb.sample() for _ in range(3)]  # continues from the RNG state captured at the last commit
    _, actor3, _, _, _, optim3, rb3 = build(scratch / "rb3", frames, seed + 2)
    store.checkout("latest", into={"rb": rb3, "policy": actor3, "optim": optim3, "rng": RNGState()})
    restored = [rb3.sample() for _ in range(3)]
    same = all(
        torch.equal(a["index"], b["index"]) and torch.equal(a["priority_weight"], b["priority_weight"]) and torch.equal(a["observation"], b["observation"])
        for a, b in zip(reference, restored)
    )
    assert same, "restored buffer sampled differently"
    assert len(rb3) == len(rb) and rb3.writer._cursor == rb.writer._cursor and rb3.writer._write_count == rb.writer._write_count
    console.print(
        f"full restore into fresh objects: len {len(rb3)}, cursor {rb3.writer._cursor}, write count {rb3.writer._write_count}; "
        f"3 batches of {BATCH} after restoring the rng component: identical indices, weights and data"
    )

    lineage = Table(title="lineage of latest (newest first)")
    for col in ("commit", "tags", "parent", "message"):
        lineage.add_column(col)
    for c in store.log("latest"):
        lineage.add_row(c.id[:12], ", ".join(c.tags), ", ".join(p[:12] for p in c.parents) or "-", c.message)
    console.print(lineage)
    usage = store.du()
    console.print(
        f"store: {counted(usage['commits'], 'commit')}, logical {fmt_bytes(usage['logical_bytes'])}, unique {fmt_bytes(usage['unique_bytes'])}, "
        f"stored {fmt_bytes(usage['stored_bytes'])}, dedup {ratio(usage['dedup_ratio'])}"
    )
    store.close()
    shutil.rmtree(scratch, ignore_errors=True)
    return {"commits": commits, "sampler_blobs": sampler_blobs, "policy_bytes": policy_bytes, "identical": same, "np": np.__version__}
