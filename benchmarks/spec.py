"""What the suite runs: systems, workloads, operations, sizes, and what is "n/a".

Torch-free, so the orchestrating parent (``benchmarks.run``) never imports torch;
the workloads themselves run in child processes (``benchmarks.workloads``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

# Display order. "torch.load(mmap)" is a load-only variant reading torch.save's file.
# "floor" is not a product: the physical limit of an operation (raw tensor bytes written
# to one file and fsynced, or read back with preadv), measured like a peer.
FLOOR = "floor"
SYSTEMS = [
    "ckptstore",
    "torch.save",
    "torch.load(mmap)",
    "safetensors",
    "tensordict.memmap",
    "rb.dumps",
    "torchrl.Checkpoint",
    "dcp",
    FLOOR,
]
PEERS = [s for s in SYSTEMS if s != "ckptstore"]  # ratios ckptstore / X are computed for each (the floor included)
FLOOR_LABEL = "floor (physical limit)"

MIB = 1 << 20


@dataclass
class Sizes:
    """Per-workload sizes (CLI: ``--w1-mib`` etc.)."""

    w1_mib: float = 512.0  # replay buffer bytes (storage rows; the priority trees come on top); nominal W1 is 1024
    w1_obs_dim: int = 1024  # float32 observation width (4 KiB rows)
    w1_change: float = 0.01  # fraction of rows (and their priorities) rewritten before the 2nd save
    w2_mib: float = 512.0  # raw bytes of 84x84 uint8 frames (plus action/reward columns); nominal W2 is 1024
    w2_noise: float = 0.0  # fraction of pixels nudged by -3..3 (0: deterministic renders, like ALE; > 0: a stress case)
    w3_capacity: int = 1_000_000  # LazyMemmapStorage capacity (the seed example)
    w3_extends: int = 100
    w3_rows: int = 100
    w4_mib: float = 64.0  # ring buffer bytes
    w4_obs_dim: int = 256
    w4_commits: int = 50
    w4_change: float = 0.02
    w5_params: int = 25_000_000  # MLP parameters (Adam doubles that in state)
    w6_mib: float = 512.0  # plain TensorDict bytes (float32 84x84 frames, actions, rewards, done flags, a float64 tree)
    stall_mib: float = 256.0  # replay buffer bytes of the training-loop stall measurement
    stall_obs_dim: int = 256  # float32 observation width of its rows (and the policy's input)
    stall_steps: int = 1000  # training steps per measured block (two blocks per arm, ABBA order)
    stall_every: int = 200  # commit_async every this many steps in the commit arm
    stall_threads: int = 1  # torch.set_num_threads of the training loop, the same in both arms

    @classmethod
    def smoke(cls) -> Sizes:
        return cls(
            w1_mib=4, w1_obs_dim=64, w2_mib=4, w3_capacity=20_000, w3_extends=5, w3_rows=20,
            w4_mib=2, w4_obs_dim=64, w4_commits=4, w5_params=100_000, w6_mib=4,
            stall_mib=4, stall_obs_dim=64, stall_steps=40, stall_every=10,
        )

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass
class Workload:
    name: str
    title: str
    save_systems: list[str]  # systems whose save child runs (in this order, rotated per repetition)
    save_ops: list[str]
    load_ops: list[str] = field(default_factory=list)
    variants: dict[str, list[str]] = field(default_factory=dict)  # save system -> systems that load its output
    na: dict[tuple[str, str], str] = field(default_factory=dict)  # (op, system) -> reason
    not_compared: str = "not part of this workload's comparison"
    shared_data: bool = False  # generated once per run in a child, mapped by every child

    @property
    def ops(self) -> list[str]:
        return self.save_ops + self.load_ops

    def loaders(self, save_system: str) -> list[str]:
        return self.variants.get(save_system, [save_system])

    def systems(self) -> list[str]:
        out = []
        for s in self.save_systems:
            out += [v for v in self.loaders(s) if v not in out]
        return out

    def reason(self, op: str, system: str) -> str | None:
        """Why (op, system) is not measured, or None when it is."""
        if (op, system) in self.na:
            return self.na[(op, system)]
        if system not in self.systems():
            return self.not_compared
        is_save_system = system in self.save_systems
        if op in self.save_ops and not is_save_system:
            return "load-only variant (reads torch.save's file)"
        return None


_FLAT = "stores flat tensors only: restoring a replay buffer from them needs custom code"
_MMAP_SAVE = "load-only variant (reads torch.save's file)"
# Load operations measured with the page cache warm (right after the save, nothing evicted),
# next to their cold counterpart ("load_warm" runs what "load" runs). They run first, right
# after the save child, before any cold load.
WARM_OPS = {"load_warm": "load"}
_FLOOR_FULL = "floor measured for full saves only (see save: every peer rewrites everything here)"

WORKLOADS: dict[str, Workload] = {
    "w1": Workload(
        name="w1",
        title="W1: {w1_mib:g} MiB prioritized replay buffer (LazyTensorStorage, randn float32 obs x {w1_obs_dim}), {w1_change:.0%} rows changed",
        save_systems=["ckptstore", "torch.save", "safetensors", "tensordict.memmap", "rb.dumps", "torchrl.Checkpoint", "dcp", FLOOR],
        save_ops=["save", "save_after_change", "save_unchanged"],
        load_ops=["load", "load_warm", "load_into_existing", "load_sampler_only"],
        variants={"torch.save": ["torch.save", "torch.load(mmap)"]},
        na={
            ("load_into_existing", "safetensors"): _FLAT,
            ("load_into_existing", "tensordict.memmap"): _FLAT,
            ("load_into_existing", "dcp"): _FLAT,
            ("load_sampler_only", "torchrl.Checkpoint"): "restores whole registered components only (here the whole replay buffer)",
            ("save_after_change", FLOOR): _FLOOR_FULL,
            ("save_unchanged", FLOOR): _FLOOR_FULL,
            ("load_sampler_only", FLOOR): "floor measured for whole-state loads only",
        },
        shared_data=True,
    ),
    "w2": Workload(
        name="w2",
        title="W2: {w2_mib:g} MiB of Atari-like 84x84 uint8 frames (pixel noise {w2_noise:.1%}), first save",
        save_systems=["ckptstore", "torch.save", "safetensors", "tensordict.memmap", "rb.dumps", "torchrl.Checkpoint", "dcp", FLOOR],
        save_ops=["save"],
        na={("save", "torch.load(mmap)"): "load-only variant; W2 measures saves only"},
        shared_data=True,
    ),
    "w3": Workload(
        name="w3",
        title="W3: seed example, LazyMemmapStorage({w3_capacity:,}) + PrioritizedSampler, {w3_extends} extends of {w3_rows} rows",
        save_systems=["ckptstore", "rb.dumps"],
        save_ops=["save", "save_after_extend"],
        load_ops=["load_into_fresh"],
        not_compared="not compared: W3 is the seed example, ckptstore vs ReplayBuffer.dumps/loads",
    ),
    "w4": Workload(
        name="w4",
        title="W4: rolling run, {w4_commits} commits of a {w4_mib:g} MiB prioritized ring buffer, {w4_change:.0%} of rows + priorities change between commits",
        save_systems=["ckptstore", "rb.dumps"],
        save_ops=["rolling_commit"],
        not_compared="not compared: W4 compares ckptstore with one rb.dumps copy per commit",
    ),
    "w5": Workload(
        name="w5",
        title="W5: MLP policy ({w5_params:,} params) + Adam after one update",
        save_systems=["ckptstore", "torch.save", "safetensors", "dcp", "torchrl.Checkpoint", FLOOR],
        save_ops=["save"],
        load_ops=["load", "load_warm"],
        variants={"torch.save": ["torch.save", "torch.load(mmap)"]},
        na={("save", "torch.load(mmap)"): _MMAP_SAVE},
        not_compared="not compared: no replay buffer in W5 (policy + optimizer: torch.save, safetensors, dcp, Checkpoint)",
    ),
    "w6": Workload(
        name="w6",
        title="W6: {w6_mib:g} MiB plain TensorDict (random float32 84x84 frames, actions, rewards, done flags, a float64 tree), no replay buffer",
        save_systems=["ckptstore", "torch.save", "safetensors", "tensordict.memmap", FLOOR],
        save_ops=["save", "save_unchanged"],
        load_ops=["load", "load_warm"],
        variants={"torch.save": ["torch.save", "torch.load(mmap)"]},
        na={
            ("save", "torch.load(mmap)"): _MMAP_SAVE,
            ("save_unchanged", "torch.load(mmap)"): _MMAP_SAVE,
            ("save_unchanged", FLOOR): _FLOOR_FULL,
        },
        not_compared="not compared: W6 is a plain TensorDict (torch.save, safetensors, tensordict memmap)",
        shared_data=True,
    ),
    "stall": Workload(
        name="stall",
        title="Stall: CPU training loop (MLP on batches from a {stall_mib:g} MiB LazyTensorStorage buffer, {stall_threads} torch thread(s)), "
              "commit_async every {stall_every} steps vs no commits and vs the floor (the changed bytes copied, written and fsynced in a thread)",
        save_systems=["ckptstore"],
        save_ops=["train_steps"],
        not_compared="ckptstore only (its references are the same loop without commits and with the floor's saves, in the same child)",
    ),
    "async": Workload(
        name="async",
        title="Async: Store.commit_async (if present) on the W1 state, a second {w1_change:.0%} change (snapshot buffers reused)",
        save_systems=["ckptstore"],
        save_ops=["commit_async"],
        not_compared="ckptstore only",
        shared_data=True,
    ),
}

# Data for "async" is W1's; W6 has its own.
DATA_OF = {"w1": "w1", "w2": "w2", "async": "w1", "w6": "w6"}

# Metric directions for compare.py: higher is better for these; lower for the rest;
# INFO metrics are context, never compared.
HIGHER_IS_BETTER = {"throughput_gbps"}
INFO_METRICS = {"logical_bytes", "rss_before", "rss_baseline", "rss_file_growth_before", "sampler_stored_bytes", "resident_before",
                "commits", "changed_rows", "prealloc_copy_s", "prealloc_copy_tensors_s", "call_over_row_copy", "call_over_tensor_copy",
                "peak_rss_lifetime", "resident_warm", "steps", "commits_started", "commits_completed_in_window", "stall_threads",
                # the stall loop's floor arm: the reference, not ckptstore
                "floor_step_mean_s", "floor_ratio_mean", "floor_per_save_s", "floor_call_mean_s", "floor_bytes_per_save"}
