"""Child-process side of the suite: data, states, and each (workload, system, operation).

Every function here runs in a fresh child process started by ``benchmarks.run``
(forked from a server that has only imported these modules, or spawned). A *save*
child builds the state, then performs the workload's save operations in order; a
*load* child performs one load operation on what a save child left on disk.
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import math
import os
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import sqlite_utils  # noqa: F401 - imported lazily by ckptstore's catalog (with click, dateutil, pluggy): up front here too
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tensordict import TensorDict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torchrl.checkpoint import Checkpoint
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictPrioritizedReplayBuffer, TensorDictReplayBuffer
from torchrl.data.replay_buffers import PrioritizedSampler, RandomSampler

import ckptstore
import ckptstore.adapters.torchrl  # imported up front like every peer module (ckptstore imports it lazily)
import ckptstore.protocols.checkout  # ckptstore imports its store modules on first use (PEP 562): up front here too
import ckptstore.store

from .measure import apparent_size, evict_tree, fsync_tree, measure, read_raw_into, resident_fraction, set_rss_baseline, touch, write_raw
from .spec import FLOOR, MIB, WARM_OPS, Sizes

# --- shared data (generated once per run, mapped by every child) ------------------------


class Data:
    """Raw tensors in a folder (``<name>.bin`` + ``meta.json``), e.g. on /dev/shm."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.meta = json.loads((self.root / "meta.json").read_text())

    def __getitem__(self, key: str) -> Any:
        return self.meta[key]

    def t(self, name: str) -> torch.Tensor:
        m = self.meta["tensors"][name]
        dtype = getattr(torch, m["dtype"])
        numel = math.prod(m["shape"])
        flat = torch.from_file(str(self.root / f"{name}.bin"), shared=False, size=numel, dtype=dtype)
        return flat.view(m["shape"])


class _Writer:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.meta: dict[str, Any] = {"tensors": {}}

    def write(self, name: str, chunks, shape: tuple, dtype: torch.dtype) -> None:
        with open(self.root / f"{name}.bin", "wb") as f:
            f.writelines(memoryview(c.contiguous().view(torch.uint8).reshape(-1).numpy()) for c in chunks)
        self.meta["tensors"][name] = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}

    def close(self, **meta) -> dict:
        self.meta.update(meta)
        (self.root / "meta.json").write_text(json.dumps(self.meta))
        return self.meta


def _chunked(total: int, step: int, make: Callable[[int, int], torch.Tensor]):
    for a in range(0, total, step):
        yield make(a, min(total, a + step))


W1_KEYS = ("obs", "action", "reward", "done")


def _transition_columns(w: _Writer, prefix: str, n: int, d: int, g: torch.Generator) -> None:
    rows_per_chunk = max(1, (64 * MIB) // (4 * d))
    w.write(prefix + "obs", _chunked(n, rows_per_chunk, lambda a, b: torch.randn(b - a, d, generator=g)), (n, d), torch.float32)
    w.write(prefix + "action", [torch.randint(0, 18, (n, 1), generator=g)], (n, 1), torch.int64)
    w.write(prefix + "reward", [torch.randn(n, 1, generator=g)], (n, 1), torch.float32)
    w.write(prefix + "done", [torch.rand(n, 1, generator=g) < 0.01], (n, 1), torch.bool)
    w.write(prefix + "priority", [torch.rand(n, generator=g) + 0.01], (n,), torch.float32)


def _row_bytes(obs_dim: int) -> int:
    return 4 * obs_dim + 8 + 4 + 1 + 8  # obs, action, reward, done, and the "index" column TorchRL adds


def gen_w1(s: Sizes, root: Path) -> dict:
    d = s.w1_obs_dim
    n = max(16, int(s.w1_mib * MIB // _row_bytes(d)))
    c = max(1, round(n * s.w1_change))
    g = torch.Generator().manual_seed(1)
    w = _Writer(root)
    _transition_columns(w, "", n, d, g)
    _transition_columns(w, "new_", c, d, g)
    return w.close(rows=n, change_rows=c, obs_dim=d)


FRAME = 84


def _frames(a: int, b: int, g: torch.Generator, noise: float = 0.0) -> torch.Tensor:
    """Atari-like frames: banded background, scrolling pillars, a moving sprite, a black
    score bar. ``noise``: fraction of the pixels nudged by -3..3 (0 by default: ALE
    renders are deterministic, with no pixel noise; > 0 is a stress case)."""
    t = torch.arange(a, b, dtype=torch.float32)
    y = torch.arange(FRAME)
    bands = (40 + 20 * ((y // 12) % 3)).to(torch.uint8)[:, None].expand(FRAME, FRAME)
    pillars = ((y[None, None, :] + (t // 4).long()[:, None, None]) % 21) < 3  # [T, 1, 84], x along the last dim
    frame = torch.where(pillars, torch.tensor(120, dtype=torch.uint8), bands[None])
    cx, cy = 42 + 30 * torch.cos(t / 40), 42 + 30 * torch.sin(t / 53)
    yf = y.float()
    sprite = ((yf[None, None, :] - cx[:, None, None]) ** 2 + (yf[None, :, None] - cy[:, None, None]) ** 2) < 25
    frame.masked_fill_(sprite, 200)
    frame[:, :8, :] = 0  # score bar
    flat = frame.view(-1)
    k = int(noise * flat.numel())
    if k <= 0:
        return frame
    pos = torch.randint(0, flat.numel(), (k,), generator=g)
    flat[pos] = (flat[pos].to(torch.int16) + torch.randint(-3, 4, (k,), generator=g, dtype=torch.int16)).clamp_(0, 255).to(torch.uint8)
    return frame


def gen_w2(s: Sizes, root: Path) -> dict:
    n = max(16, int(s.w2_mib * MIB // (FRAME * FRAME + 8 + 4 + 8)))
    g = torch.Generator().manual_seed(2)
    w = _Writer(root)
    w.write("pixels", _chunked(n, 2048, lambda a, b: _frames(a, b, g, s.w2_noise)), (n, FRAME, FRAME), torch.uint8)
    w.write("action", [torch.randint(0, 18, (n,), generator=g)], (n,), torch.int64)
    w.write("reward", [(torch.rand(n, generator=g) < 0.05).float()], (n,), torch.float32)
    return w.close(rows=n, noise=s.w2_noise)


W6_KEYS = ("frames", "action", "reward", "done", "tree")


def _w6_row_bytes() -> int:
    return 4 * FRAME * FRAME + 8 + 4 + 1 + 2 * 8  # frames, action, reward, done, and two float64 tree leaves per row


def gen_w6(s: Sizes, root: Path) -> dict:
    """W6's plain state: random float32 frames [n, 84, 84], int64 actions, float32 rewards,
    bool done flags and a float64 vector of 2n leaves (a sum tree's size), incompressible."""
    n = max(16, int(s.w6_mib * MIB // _w6_row_bytes()))
    g = torch.Generator().manual_seed(6)
    w = _Writer(root)
    w.write("frames", _chunked(n, 2048, lambda a, b: torch.rand(b - a, FRAME, FRAME, generator=g)), (n, FRAME, FRAME), torch.float32)
    w.write("action", [torch.randint(0, 18, (n,), generator=g)], (n,), torch.int64)
    w.write("reward", [torch.randn(n, generator=g)], (n,), torch.float32)
    w.write("done", [torch.rand(n, generator=g) < 0.01], (n,), torch.bool)
    w.write("tree", [torch.rand(2 * n, generator=g, dtype=torch.float64)], (2 * n,), torch.float64)
    return w.close(rows=n)


def task_gen(task: dict) -> dict:
    s = Sizes(**task["sizes"])
    root = Path(task["root"])
    return {"w1": gen_w1, "w2": gen_w2, "w6": gen_w6}[task["data"]](s, root)


# --- replay-buffer state helpers ---------------------------------------------------------


def rows(rb) -> TensorDict:
    """The written rows of a buffer's storage."""
    return rb.storage._storage[: len(rb.storage)]


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, TensorDict):
        return sum(v.numel() * v.element_size() for v in obj.values(include_nested=True, leaves_only=True))
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def sampler_state(sampler) -> dict[str, torch.Tensor]:
    if not isinstance(sampler, PrioritizedSampler):
        return {}
    idx = torch.arange(sampler._max_capacity)
    value, at = sampler._max_priority
    return {
        "sum_tree": torch.as_tensor(sampler._sum_tree[idx]),
        "min_tree": torch.as_tensor(sampler._min_tree[idx]),
        "max_priority": torch.tensor(float(value) if value is not None else float("nan")),
        "max_priority_index": torch.tensor(int(at) if at is not None else -1),
        "alpha": torch.tensor(float(sampler._alpha)),
        "beta": torch.tensor(float(sampler._beta)),
        "eps": torch.tensor(float(sampler._eps)),
    }


def sampler_logical(sampler) -> int:
    if not isinstance(sampler, PrioritizedSampler):
        return 0
    return 2 * sampler._max_capacity * torch.empty((), dtype=sampler.dtype).element_size()


def rb_state(rb) -> dict:
    """A buffer's state as nested dicts of tensors, for the flat-tensor formats
    (safetensors, tensordict memmap, dcp): storage rows, writer cursor/count, sampler trees."""
    n = len(rb.storage)
    storage = {}
    for k, v in rb.storage._storage.items(include_nested=True, leaves_only=True):
        storage[".".join(k) if isinstance(k, tuple) else k] = v[:n]
    storage["_len"] = torch.tensor(n)
    out = {
        "storage": storage,
        "writer": {"cursor": torch.tensor(int(rb.writer._cursor)), "write_count": torch.tensor(int(rb.writer._write_count))},
    }
    sampler = sampler_state(rb.sampler)
    if sampler:
        out["sampler"] = sampler
    return out


def flatten(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def peer_path(system: str, out: Path, name: str) -> Path:
    base = out / "saves" / name
    return {"torch.save": base.with_suffix(".pt"), "torch.load(mmap)": base.with_suffix(".pt"), "safetensors": base.with_suffix(".safetensors"),
            FLOOR: base.with_suffix(".bin")}.get(system, base)


# --- physical floors: raw tensor bytes in one file ----------------------------------------------


def raw_bytes(t: torch.Tensor):
    """A contiguous tensor's bytes as a flat uint8 numpy array sharing its memory."""
    t = t.detach()
    if not t.is_contiguous():
        raise ValueError("floor buffers must be contiguous")
    return t.reshape(-1).view(torch.uint8).numpy()


def layout(named: list[tuple[str, torch.Tensor]]) -> list[list]:
    """``[name, shape, dtype]`` of each tensor a floor wrote, in file order (kept in info.json)."""
    return [[k, list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in named]


def from_layout(lay: list[list], zeros: bool) -> list[torch.Tensor]:
    """Tensors for a floor file: ``torch.empty`` (fresh, untouched) or ``torch.zeros`` (resident)."""
    make = torch.zeros if zeros else torch.empty
    return [make(tuple(shape), dtype=getattr(torch, dt)) for _, shape, dt in lay]


def floor_save(p: Path, named: list[tuple[str, torch.Tensor]]) -> int:
    """The floor of a durable save: the tensors' raw bytes into one file, fsync it and its folder."""
    p.parent.mkdir(parents=True, exist_ok=True)
    return write_raw(p, [raw_bytes(t) for _, t in named])


def floor_load(p: Path, tensors: list[torch.Tensor]) -> None:
    """The floor of a load: ``os.preadv`` of the raw file into ``tensors``, then every page touched."""
    read_raw_into(p, [raw_bytes(t) for t in tensors])
    touch(tensors)


def rb_floor_tensors(rb) -> list[tuple[str, torch.Tensor]]:
    """What a replay buffer's floor writes: every column of the written rows, then the two
    priority trees (every leaf, read out of TorchRL's segment trees before the timed window)."""
    named = [("storage." + (".".join(k) if isinstance(k, tuple) else k), v)
             for k, v in rows(rb).items(include_nested=True, leaves_only=True)]
    sampler = sampler_state(rb.sampler)
    named += [(f"sampler.{k}", sampler[k]) for k in ("sum_tree", "min_tree") if k in sampler]
    return named


def disk_root(system: str, out: Path) -> Path:
    return out / ("store" if system == "ckptstore" else "saves")


def save_rb(system: str, rb, out: Path, name: str, store: ckptstore.Store | None) -> dict:
    """One durable save of a replay buffer. Returns extra metrics."""
    if system == "ckptstore":
        info = store.commit(rb, tag="latest")
        return {"ckpt_new_bytes": info.new_bytes, "ckpt_stored_bytes": info.stored_bytes}
    p = peer_path(system, out, name)
    p.parent.mkdir(parents=True, exist_ok=True)
    if system == "torch.save":
        torch.save(rb.state_dict(), p)
    elif system == "safetensors":
        save_file(flatten(rb_state(rb)), str(p))
    elif system == "tensordict.memmap":
        TensorDict(rb_state(rb), batch_size=[]).memmap(p)
    elif system == "rb.dumps":
        rb.dumps(p)
    elif system == "torchrl.Checkpoint":
        Checkpoint(rb=rb).save(p)
    elif system == "dcp":
        dcp.save(rb_state(rb), checkpoint_id=str(p))
    else:
        raise ValueError(f"unknown system {system!r}")
    fsync_tree(p)
    return {}


def open_store(out: Path) -> ckptstore.Store:
    return ckptstore.Store(out / "store", create=False)


def dcp_targets(path: Path, prefix: str | None = None) -> dict:
    """Empty tensors for every (or every ``prefix``) tensor entry of a DCP checkpoint, nested as saved."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    out: dict = {}
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata) or (prefix and not fqn.startswith(prefix)):
            continue
        keys = (md.planner_data or {}).get(fqn) or tuple(fqn.split("."))
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    return out


def dcp_load(path: Path, prefix: str | None = None) -> dict:
    targets = dcp_targets(path, prefix)
    dcp.load(targets, checkpoint_id=str(path))
    return targets


def torch_load(path: Path, mmap: bool, weights_only: bool = False):
    return torch.load(path, weights_only=weights_only, mmap=mmap)


def sampler_stored_bytes(store: ckptstore.Store) -> int:
    leaves = store.show("latest")["leaves"]
    return sum(int(l.get("stored_bytes") or 0) for l in leaves if l["path"] == "sampler" or l["path"].startswith("sampler/"))


# --- W1: 1 GiB prioritized replay buffer --------------------------------------------------


def w1_rb(n: int):
    return TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(n), priority_key="td_error", batch_size=256)


def w1_build(data: Data):
    n = data["rows"]
    rb = w1_rb(n)
    rb.extend(TensorDict({k: data.t(k) for k in W1_KEYS}, [n]))
    rb.update_priority(torch.arange(n), data.t("priority"))
    return rb


def w1_change(rb, data: Data) -> torch.Tensor:
    """Rewrite ``change_rows`` rows the way the round-robin writer does (a contiguous block
    at the cursor), with new priorities for them."""
    c = data["change_rows"]
    idx = rb.extend(TensorDict({k: data.t("new_" + k) for k in W1_KEYS}, [c]))
    rb.update_priority(idx, data.t("new_priority"))
    return idx


def w1_existing(data: Data):
    """An initialised, resident buffer of the same layout (the target of ``load_into_existing``)."""
    n, d = data["rows"], data["obs_dim"]
    rb = w1_rb(n)
    one = TensorDict({"obs": torch.zeros(1, d), "action": torch.zeros(1, 1, dtype=torch.int64), "reward": torch.zeros(1, 1),
                      "done": torch.zeros(1, 1, dtype=torch.bool)}, [1])
    rb.extend(one)
    rb.storage._storage.zero_()
    return rb


def w1_save(task: dict) -> list[dict]:
    data, out, system = Data(task["data"]), Path(task["out"]), task["system"]
    rb = w1_build(data)
    logical = tensor_bytes(rows(rb)) + sampler_logical(rb.sampler)
    out.mkdir(parents=True, exist_ok=True)
    if system == FLOOR:
        named = rb_floor_tensors(rb)
        assert tensor_bytes([t for _, t in named]) == logical
        p = peer_path(FLOOR, out, "s1")
        _, m = measure(lambda: floor_save(p, named), logical_bytes=logical, disk_path=disk_root(system, out))
        info = {"latest": "s1", "logical": logical, "sampler_logical": sampler_logical(rb.sampler), "layout": layout(named)}
        (out / "info.json").write_text(json.dumps(info))
        return [{"op": "save", "metrics": m}]
    store = ckptstore.Store(out / "store") if system == "ckptstore" else None
    results = []
    for op, name in (("save", "s1"), ("save_after_change", "s2"), ("save_unchanged", "s3")):
        if op == "save_after_change":
            w1_change(rb, data)
        extra, m = measure(lambda name=name: save_rb(system, rb, out, name, store), logical_bytes=logical, disk_path=disk_root(system, out), keep=True)
        results.append({"op": op, "metrics": {**m, **extra}})
    info = {"latest": "s3", "logical": logical, "sampler_logical": sampler_logical(rb.sampler)}
    if store is not None:
        info["sampler_stored"] = sampler_stored_bytes(store)
        store.close()
    (out / "info.json").write_text(json.dumps(info))
    return results


def w1_load(task: dict):
    """Returns (fn, logical bytes): fn performs the measured load and returns extra metrics."""
    data, out, system, op = Data(task["data"]), Path(task["out"]), task["system"], task["op"]
    info = json.loads((out / "info.json").read_text())
    p = peer_path(system, out, info["latest"])
    mmap = system == "torch.load(mmap)"
    n = data["rows"]

    if op == "load":
        target = w1_rb(n) if system in ("rb.dumps", "torchrl.Checkpoint") else None

        def fn():
            if system == FLOOR:  # into freshly allocated tensors
                floor_load(p, from_layout(info["layout"], zeros=False))
                return {}
            if system == "ckptstore":
                store = open_store(out)
                td = store.checkout("latest")
                touch(td)
                read = store.io.bytes_read
                store.close()
                return {"store_io_bytes_read": read}
            if system in ("torch.save", "torch.load(mmap)"):
                touch(torch_load(p, mmap))
            elif system == "safetensors":
                touch(load_file(str(p)))
            elif system == "tensordict.memmap":
                touch(TensorDict.load_memmap(p))
            elif system == "rb.dumps":
                target.loads(p)
                touch(rows(target))
            elif system == "torchrl.Checkpoint":
                Checkpoint(rb=target).load(p)
                touch(rows(target))
            elif system == "dcp":
                touch(dcp_load(p))
            return {}

        return fn, info["logical"]

    if op == "load_into_existing":
        if system == FLOOR:  # into tensors allocated and zeroed (resident) beforehand
            existing = from_layout(info["layout"], zeros=True)

            def fn():
                floor_load(p, existing)
                return {}

            return fn, info["logical"]
        target = w1_existing(data)

        def fn():
            if system == "ckptstore":
                store = open_store(out)
                store.checkout("latest", into=target)
                read = store.io.bytes_read
                store.close()
                touch(rows(target))
                return {"store_io_bytes_read": read}
            if system in ("torch.save", "torch.load(mmap)"):
                target.load_state_dict(torch_load(p, mmap))
            elif system == "rb.dumps":
                target.loads(p)
            elif system == "torchrl.Checkpoint":
                Checkpoint(rb=target).load(p)
            touch(rows(target))
            return {}

        return fn, info["logical"]

    if op == "load_sampler_only":

        def fn():
            extra = {"sampler_stored_bytes": info["sampler_logical"]}
            if system == "ckptstore":
                store = open_store(out)
                touch(store.checkout("latest", partial=["sampler"]))
                extra = {"store_io_bytes_read": store.io.bytes_read, "sampler_stored_bytes": info["sampler_stored"]}
                store.close()
            elif system in ("torch.save", "torch.load(mmap)"):
                touch(torch_load(p, mmap)["_sampler"])
            elif system == "safetensors":
                with safe_open(str(p), framework="pt") as f:
                    touch({k: f.get_tensor(k) for k in f.keys() if k.startswith("sampler.")})
            elif system == "tensordict.memmap":
                touch(TensorDict.load_memmap(p / "sampler"))
            elif system == "rb.dumps":
                PrioritizedSampler(n, 0.7, 0.5).loads(p / "sampler")
            elif system == "dcp":
                touch(dcp_load(p, prefix="sampler."))
            return extra

        return fn, info["sampler_logical"]

    raise ValueError(op)


# --- W2: Atari-like frames ------------------------------------------------------------------


def w2_save(task: dict) -> list[dict]:
    data, out, system = Data(task["data"]), Path(task["out"]), task["system"]
    n = data["rows"]
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(n), sampler=RandomSampler(), batch_size=32)
    rb.extend(TensorDict({k: data.t(k) for k in ("pixels", "action", "reward")}, [n]))
    logical = tensor_bytes(rows(rb))
    out.mkdir(parents=True, exist_ok=True)
    store = ckptstore.Store(out / "store") if system == "ckptstore" else None
    if system == FLOOR:  # the frames' (and the other columns') raw bytes, durable
        named = rb_floor_tensors(rb)
        assert tensor_bytes([t for _, t in named]) == logical
        _, m = measure(lambda: floor_save(peer_path(FLOOR, out, "s1"), named), logical_bytes=logical, disk_path=disk_root(system, out))
        extra = {}
    else:
        extra, m = measure(lambda: save_rb(system, rb, out, "s1", store), logical_bytes=logical, disk_path=disk_root(system, out), keep=True)
    m.update(extra)
    m["stored_over_logical"] = m["bytes_written"] / logical
    if store is not None:
        store.close()
    return [{"op": "save", "metrics": m}]


# --- W3: the seed example ---------------------------------------------------------------------


def w3_chunk(n: int) -> TensorDict:
    return TensorDict({"obs": torch.randn(n, 3, 4), "next": {"obs": torch.randn(n, 3, 4)}, "td_error": torch.rand(n)}, [n])


def w3_rb(s: Sizes, scratch: Path):
    cap = s.w3_capacity
    return TensorDictReplayBuffer(storage=LazyMemmapStorage(cap, scratch_dir=str(scratch)), sampler=PrioritizedSampler(cap, 1.1, 1.0), batch_size=32)


def w3_step(rb, s: Sizes) -> None:
    rb.extend(w3_chunk(s.w3_rows))
    rb.update_tensordict_priority(rb.sample(32))


def w3_save(task: dict) -> list[dict]:
    s, out, system = Sizes(**task["sizes"]), Path(task["out"]), task["system"]
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rb = w3_rb(s, out / "scratch")
    for _ in range(s.w3_extends):
        w3_step(rb, s)
    store = ckptstore.Store(out / "store") if system == "ckptstore" else None
    results = []
    for op, name in (("save", "s1"), ("save_after_extend", "s2")):
        if op == "save_after_extend":
            w3_step(rb, s)
        logical = tensor_bytes(rows(rb)) + sampler_logical(rb.sampler)
        extra, m = measure(lambda name=name: save_rb(system, rb, out, name, store), logical_bytes=logical, disk_path=disk_root(system, out), keep=True)
        results.append({"op": op, "metrics": {**m, **extra}})
    if store is not None:
        store.close()
    (out / "info.json").write_text(json.dumps({"latest": "s2", "logical": logical}))
    return results


def w3_load(task: dict):
    s, out, system = Sizes(**task["sizes"]), Path(task["out"]), task["system"]
    info = json.loads((out / "info.json").read_text())
    target = w3_rb(s, out / "scratch-load")
    p = peer_path(system, out, info["latest"])

    def fn():
        if system == "ckptstore":
            store = open_store(out)
            store.checkout("latest", into=target)
            read = store.io.bytes_read
            store.close()
            touch(rows(target))
            return {"store_io_bytes_read": read}
        target.loads(p)
        touch(rows(target))
        return {}

    return fn, info["logical"]


# --- W4: rolling run ----------------------------------------------------------------------------


def w4_save(task: dict) -> list[dict]:
    s, out, system = Sizes(**task["sizes"]), Path(task["out"]), task["system"]
    d = s.w4_obs_dim
    n = max(16, int(s.w4_mib * MIB // _row_bytes(d)))
    c = max(1, round(n * s.w4_change))
    g = torch.Generator().manual_seed(4)

    def chunk(k: int) -> TensorDict:
        return TensorDict({"obs": torch.randn(k, d, generator=g), "action": torch.randint(0, 18, (k, 1), generator=g),
                           "reward": torch.randn(k, 1, generator=g), "done": torch.rand(k, 1, generator=g) < 0.01}, [k])

    rb = w1_rb(n)
    rb.extend(chunk(n))
    rb.update_priority(torch.arange(n), torch.rand(n, generator=g) + 0.01)
    logical = tensor_bytes(rows(rb)) + sampler_logical(rb.sampler)
    out.mkdir(parents=True, exist_ok=True)
    store = ckptstore.Store(out / "store") if system == "ckptstore" else None
    times: list[float] = []

    def run():
        for i in range(s.w4_commits):
            if i:
                idx = rb.extend(chunk(c))
                rb.update_priority(idx, torch.rand(c, generator=g) + 0.01)
            t0 = time.perf_counter()
            save_rb(system, rb, out, f"s{i}", store)
            times.append(time.perf_counter() - t0)

    _, m = measure(run, logical_bytes=logical, disk_path=disk_root(system, out))
    m["wall_s"] = statistics.median(times[1:]) if len(times) > 1 else times[0]
    m["throughput_gbps"] = logical / m["wall_s"] / 1e9
    m["first_commit_s"] = times[0]
    m["commits_total_s"] = sum(times)
    m["commits"] = s.w4_commits
    m["changed_rows"] = c
    if store is not None:
        du = store.du()
        m["store_bytes"] = du["pack_bytes"]
        m["catalog_bytes"] = du["catalog_bytes"]
        store.close()
    else:
        m["store_bytes"] = apparent_size(out / "saves")
    return [{"op": "rolling_commit", "metrics": m}]


# --- W5: policy + Adam ---------------------------------------------------------------------------

W5_IN, W5_OUT = 512, 64


def w5_hidden(params: int) -> int:
    # params(H) = 2H^2 + (W5_IN + 3 + W5_OUT) H + W5_OUT  for  in -> H -> H -> H -> out
    b = W5_IN + 3 + W5_OUT
    h = (-b + math.sqrt(b * b + 8 * max(0, params - W5_OUT))) / 4
    return max(8, round(h / 8) * 8)


def w5_policy(params: int, seed: int):
    torch.manual_seed(seed)
    h = w5_hidden(params)
    nn = torch.nn
    policy = nn.Sequential(nn.Linear(W5_IN, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, W5_OUT))
    return policy, torch.optim.Adam(policy.parameters(), lr=1e-4)


def w5_build(params: int):
    policy, optim = w5_policy(params, 0)
    policy(torch.randn(64, W5_IN)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return policy, optim


def w5_flat(policy, optim) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Params and flattened optimizer tensors for safetensors; param groups as JSON metadata."""
    tensors = {f"policy.{k}": v.detach() for k, v in policy.state_dict().items()}
    osd = optim.state_dict()
    scalars: dict = {}
    for pid, st in osd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim.state.{pid}.{k}"] = v
            else:
                scalars.setdefault(str(pid), {})[k] = v
    return tensors, {"param_groups": json.dumps(osd["param_groups"]), "state_scalars": json.dumps(scalars)}


def w5_unflat(policy, optim, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    policy.load_state_dict({k[len("policy."):]: v for k, v in tensors.items() if k.startswith("policy.")})
    state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("optim.state."):
            pid, name = k[len("optim.state."):].split(".", 1)
            state.setdefault(int(pid), {})[name] = v
    for pid, st in json.loads(meta["state_scalars"]).items():
        state.setdefault(int(pid), {}).update(st)
    optim.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})


def w5_floor_tensors(policy, optim) -> list[tuple[str, torch.Tensor]]:
    """What W5's floor writes: the parameters, then every optimizer state tensor (w5_flat's order)."""
    tensors, _ = w5_flat(policy, optim)
    return list(tensors.items())


def w5_floor_restore(policy, optim, lay: list[list], p: Path) -> None:
    """W5's load floor: preadv straight into the policy's parameters (they exist) and into
    freshly allocated optimizer state tensors, which then become the optimizer's state."""
    params = policy.state_dict()  # detached views of the parameters: reading into them restores them
    groups = [q for g in optim.param_groups for q in g["params"]]
    targets, state = [], {}
    for name, shape, dt in lay:
        if name.startswith("policy."):
            targets.append(params[name[len("policy."):]])
        else:
            pid, key = name[len("optim.state."):].split(".", 1)
            t = torch.empty(tuple(shape), dtype=getattr(torch, dt))
            state.setdefault(int(pid), {})[key] = t
            targets.append(t)
    read_raw_into(p, [raw_bytes(t) for t in targets])
    for pid, st in state.items():
        optim.state[groups[pid]] = st


def w5_logical(policy, optim) -> int:
    return tensor_bytes(dict(policy.state_dict())) + tensor_bytes([dict(s) for s in optim.state_dict()["state"].values()])


def w5_save(task: dict) -> list[dict]:
    s, out, system = Sizes(**task["sizes"]), Path(task["out"]), task["system"]
    policy, optim = w5_build(s.w5_params)
    logical = w5_logical(policy, optim)
    out.mkdir(parents=True, exist_ok=True)
    store = ckptstore.Store(out / "store") if system == "ckptstore" else None
    p = peer_path(system, out, "s1")
    p.parent.mkdir(parents=True, exist_ok=True)
    info = {"latest": "s1", "logical": logical}
    if system == FLOOR:
        named = w5_floor_tensors(policy, optim)
        assert tensor_bytes([t for _, t in named]) == logical
        info["layout"] = layout(named)

    def fn():
        if system == FLOOR:
            floor_save(p, named)
            return
        if system == "ckptstore":
            store.commit({"policy": policy, "optim": optim}, tag="latest")
            return
        if system == "torch.save":
            torch.save({"policy": policy.state_dict(), "optim": optim.state_dict()}, p)
        elif system == "safetensors":
            tensors, meta = w5_flat(policy, optim)
            save_file(tensors, str(p), metadata=meta)
        elif system == "dcp":
            msd, osd = get_state_dict(policy, optim)
            dcp.save({"policy": msd, "optim": osd}, checkpoint_id=str(p))
        elif system == "torchrl.Checkpoint":
            Checkpoint(policy=policy, optim=optim).save(p)
        fsync_tree(p)

    _, m = measure(fn, logical_bytes=logical, disk_path=disk_root(system, out))
    if store is not None:
        store.close()
    (out / "info.json").write_text(json.dumps(info))
    return [{"op": "save", "metrics": m}]


def w5_load(task: dict):
    s, out, system = Sizes(**task["sizes"]), Path(task["out"]), task["system"]
    info = json.loads((out / "info.json").read_text())
    p = peer_path(system, out, info["latest"])
    policy, optim = w5_policy(s.w5_params, 1)  # a fresh policy and optimizer (no state yet)

    def fn():
        extra = {}
        if system == FLOOR:
            w5_floor_restore(policy, optim, info["layout"], p)
        elif system == "ckptstore":
            store = open_store(out)
            store.checkout("latest", into={"policy": policy, "optim": optim})
            extra = {"store_io_bytes_read": store.io.bytes_read}
            store.close()
        elif system in ("torch.save", "torch.load(mmap)"):
            sd = torch_load(p, system == "torch.load(mmap)", weights_only=True)
            policy.load_state_dict(sd["policy"])
            optim.load_state_dict(sd["optim"])
        elif system == "safetensors":
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata()
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            w5_unflat(policy, optim, tensors, meta)
        elif system == "dcp":
            msd, osd = get_state_dict(policy, optim)
            sd = {"policy": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=str(p))
            set_state_dict(policy, optim, model_state_dict=sd["policy"], optim_state_dict=sd["optim"])
        elif system == "torchrl.Checkpoint":
            Checkpoint(policy=policy, optim=optim).load(p)
        touch(policy.state_dict())
        touch([dict(st) for st in optim.state_dict()["state"].values()])
        return extra

    return fn, info["logical"]


# --- W6: a plain TensorDict -----------------------------------------------------------------------


def w6_build(data: Data) -> TensorDict:
    """The state in ordinary (anonymous) memory, as a training process holds it: copies of the data."""
    return TensorDict({k: data.t(k).clone() for k in W6_KEYS}, batch_size=[])


def w6_save_one(system: str, td: TensorDict, out: Path, name: str, store: ckptstore.Store | None) -> dict:
    if system == "ckptstore":
        info = store.commit(td, tag="latest")
        return {"ckpt_new_bytes": info.new_bytes, "ckpt_stored_bytes": info.stored_bytes}
    p = peer_path(system, out, name)
    p.parent.mkdir(parents=True, exist_ok=True)
    if system == "torch.save":
        torch.save(td.to_dict(), p)
    elif system == "safetensors":
        save_file(flatten(td.to_dict()), str(p))
    elif system == "tensordict.memmap":
        td.memmap(p)
    else:
        raise ValueError(f"unknown system {system!r}")
    fsync_tree(p)
    return {}


def w6_save(task: dict) -> list[dict]:
    """First save, then (same process, same object) the unchanged re-save. For ckptstore the
    re-commit can reuse shard hashes by fingerprint; a further re-commit through a store opened
    with ``reuse_hashes=False`` (the escape hatch: everything rehashed) is ``rehash_commit_s``."""
    data, out, system = Data(task["data"]), Path(task["out"]), task["system"]
    td = w6_build(data)
    logical = tensor_bytes(td)
    out.mkdir(parents=True, exist_ok=True)
    if system == FLOOR:
        named = [(k, td[k]) for k in W6_KEYS]
        p = peer_path(FLOOR, out, "s1")
        _, m = measure(lambda: floor_save(p, named), logical_bytes=logical, disk_path=disk_root(system, out))
        (out / "info.json").write_text(json.dumps({"latest": "s1", "logical": logical, "layout": layout(named)}))
        return [{"op": "save", "metrics": m}]
    store = ckptstore.Store(out / "store") if system == "ckptstore" else None
    results = []
    for op, name in (("save", "s1"), ("save_unchanged", "s2")):
        extra, m = measure(lambda name=name: w6_save_one(system, td, out, name, store), logical_bytes=logical,
                           disk_path=disk_root(system, out), keep=True)
        results.append({"op": op, "metrics": {**m, **extra}})
    if store is not None:
        store.close()
        rehash = ckptstore.Store(out / "store", create=False, reuse_hashes=False)
        t0 = time.perf_counter()
        rehash.commit(td, tag="latest")
        results[-1]["metrics"]["rehash_commit_s"] = time.perf_counter() - t0
        rehash.close()
    (out / "info.json").write_text(json.dumps({"latest": "s2", "logical": logical}))
    return results


def w6_load(task: dict):
    out, system = Path(task["out"]), task["system"]
    info = json.loads((out / "info.json").read_text())
    p = peer_path(system, out, info["latest"])

    def fn():
        if system == FLOOR:  # into freshly allocated tensors
            floor_load(p, from_layout(info["layout"], zeros=False))
            return {}
        if system == "ckptstore":
            store = open_store(out)
            td = store.checkout("latest")
            touch(td)
            read = store.io.bytes_read
            store.close()
            return {"store_io_bytes_read": read}
        if system in ("torch.save", "torch.load(mmap)"):
            touch(TensorDict(torch_load(p, system == "torch.load(mmap)", weights_only=True), batch_size=[]))
        elif system == "safetensors":
            touch(TensorDict(load_file(str(p)), batch_size=[]))
        elif system == "tensordict.memmap":
            touch(TensorDict.load_memmap(p))
        return {}

    return fn, info["logical"]


# --- stall: a training loop with commit_async in the background ------------------------------------


def stall_save(task: dict) -> list[dict]:
    """A small CPU policy (MLP) trained on batches sampled from a TorchRL replay buffer, the
    buffer extended by a small batch every step. Three arms in this one child, in blocks of
    ``stall_steps`` steps, ABCCBA order (CBAABC on odd repetitions): no commits; the physical
    floor of an asynchronous checkpoint every ``stall_every`` steps (the call copies the bytes
    that changed since the last one, the rows written and the policy's and optimizer's
    tensors, into buffers reused across calls; a thread writes them to one file and fsyncs
    it: no hashing, no catalog); and ``store.commit_async({"rb", "policy", "optim"})`` every
    ``stall_every`` steps. A step's
    time includes the call made in it. Calls are made in the middle of each
    interval of ``stall_every`` steps, so the background work of every commit runs during
    measured steps (at the end of an interval, a block's last commit would run after it). Each
    commit block starts with one awaited, unmeasured commit_async: the rows the other arm wrote
    (1000 steps' worth by default) are not the next commit's, as they would not be in a run that
    commits every ``stall_every`` steps; the floor arm's blocks start the same way. After each
    commit or floor block the outstanding work is awaited (``drain_s``, outside the steps), so
    none spills into another block. Before the blocks: warm-up steps, a synchronous first commit and one
    awaited commit_async (its snapshot buffers allocated), as in a run that has been saving."""
    s, out = Sizes(**task["sizes"]), Path(task["out"])
    torch.set_num_threads(max(1, s.stall_threads))
    d = s.stall_obs_dim
    row = 4 * d + 8 + 4 + 1 + 8  # obs, action, reward, done, TorchRL's index
    n = max(64, int(s.stall_mib * MIB // row))
    batch, extend_rows = 256, 64
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(7)

    def chunk(k: int) -> TensorDict:
        return TensorDict({"obs": torch.randn(k, d, generator=g), "action": torch.randint(0, 18, (k, 1), generator=g),
                           "reward": torch.randn(k, 1, generator=g), "done": torch.rand(k, 1, generator=g) < 0.01}, [k])

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(n), sampler=RandomSampler(), batch_size=min(batch, n))
    for a in range(0, n, 65536):
        rb.extend(chunk(min(65536, n - a)))
    pool = [chunk(extend_rows) for _ in range(16)]  # new transitions, generated up front like an environment's output
    nn = torch.nn
    policy = nn.Sequential(nn.Linear(d, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 18))
    optim = torch.optim.Adam(policy.parameters(), lr=1e-4)
    state = {"rb": rb, "policy": policy, "optim": optim}
    logical = tensor_bytes(rows(rb)) + tensor_bytes(dict(policy.state_dict()))
    out.mkdir(parents=True, exist_ok=True)
    store = ckptstore.Store(out / "store")
    i_step = 0

    def step() -> None:
        nonlocal i_step
        b = rb.sample()
        logits = policy(b["obs"])
        loss = nn.functional.cross_entropy(logits, b["action"].squeeze(-1)) + b["reward"].mean() * 0
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        rb.extend(pool[i_step % len(pool)])
        i_step += 1

    # the floor: what any asynchronous checkpoint of this state must do at least
    columns = dict(rb.storage._storage.items(include_nested=True, leaves_only=True))  # the storage's column tensors, as TorchRL keeps them
    dense = [t for t in policy.state_dict().values()] + [t for st in optim.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    floor_bufs = {k: torch.empty_like(v) for k, v in columns.items()}  # worst case: every row changed
    dense_bufs = [torch.empty_like(t) for t in dense]
    floor_file = out / "floor.bin"
    floor_pool = ThreadPoolExecutor(1)
    floor_mark = [i_step]  # steps written when the floor last copied
    floor_last = [0]  # bytes the floor's last call copied

    def floor_write(views: list) -> None:
        with open(floor_file, "wb") as f:
            f.writelines(memoryview(v.numpy()).cast("B") for v in views)
            f.flush()
            os.fsync(f.fileno())

    def floor_async() -> Future:
        first, last = floor_mark[0] * extend_rows, i_step * extend_rows  # rows extended after the initial fill, in ring order
        floor_mark[0] = i_step
        start, count = first % n, min(n, last - first)
        spans = [(start, min(n, start + count))] + ([(0, start + count - n)] if start + count > n else [])
        views = []
        for key, col in columns.items():
            done = 0
            for a, b in spans:
                floor_bufs[key][done : done + b - a].copy_(col[a:b])
                done += b - a
            views.append(floor_bufs[key][:done])
        for buf, t in zip(dense_bufs, dense):
            buf.copy_(t)
        floor_last[0] = sum(v.nbytes for v in views + dense_bufs)
        return floor_pool.submit(floor_write, views + dense_bufs)

    for _ in range(min(50, s.stall_steps)):
        step()
    store.commit(state, tag="latest")
    step()
    _resolve(store.commit_async(state, tag="latest"))

    times = {"base": [], "floor": [], "commit": []}
    saved_bytes = {"floor": [], "commit": []}  # per measured save: bytes copied (floor), new blob bytes (commit)
    calls = {"floor": [], "commit": []}
    resolves, drains = [], []
    started = {"floor": 0, "commit": 0}
    completed = 0

    def block(arm: str) -> None:
        nonlocal completed
        save = {"floor": floor_async, "commit": lambda: store.commit_async(state, tag="latest")}.get(arm)
        futs = []
        if save is not None:  # as in a run that saves every stall_every steps: not the other arms' steps in one save
            _resolve(save())
        for i in range(s.stall_steps):
            t0 = time.perf_counter()
            step()
            if save is not None and i % s.stall_every == s.stall_every // 2 - 1:  # mid-interval: its background work falls inside the block
                tc = time.perf_counter()
                fut = save()
                calls[arm].append(time.perf_counter() - tc)
                if arm == "commit":
                    fut.add_done_callback(lambda f, tc=tc: resolves.append(time.perf_counter() - tc))
                else:
                    saved_bytes["floor"].append(floor_last[0])
                futs.append(fut)
            times[arm].append(time.perf_counter() - t0)
        if futs:
            started[arm] += len(futs)
            t0 = time.perf_counter()
            if arm == "commit":
                completed += sum(f.done() for f in futs)
            results = [f.result() for f in futs]
            drains.append(time.perf_counter() - t0)
            if arm == "commit":
                saved_bytes["commit"].extend(r.new_bytes for r in results)

    order = ["base", "floor", "commit", "commit", "floor", "base"]
    order = order if task.get("rep", 0) % 2 == 0 else order[::-1]
    _, m = measure(lambda: [block(arm) for arm in order], logical_bytes=logical, disk_path=out / "store")
    store.close()
    floor_pool.shutdown()
    window = sum(times["commit"])
    c, f, b = times["commit"], times["floor"], times["base"]
    # the arms' difference per save: what one save costs the loop, whatever the cadence
    # (at one save every T seconds of training, the slowdown is about the per-save loss / T)
    loss = lambda arm: (sum(times[arm]) - sum(b)) / started[arm] if started[arm] else 0.0
    m.update({
        "wall_s": statistics.fmean(c),
        "step_mean_s": statistics.fmean(c),
        "step_median_s": statistics.median(c),
        "step_max_s": max(c),
        "base_step_mean_s": statistics.fmean(b),
        "base_step_median_s": statistics.median(b),
        "base_step_max_s": max(b),
        "floor_step_mean_s": statistics.fmean(f),
        "stall_ratio_mean": statistics.fmean(c) / statistics.fmean(b),
        "stall_ratio_median": statistics.median(c) / statistics.median(b),
        "floor_ratio_mean": statistics.fmean(f) / statistics.fmean(b),
        "stall_per_commit_s": loss("commit"),
        "floor_per_save_s": loss("floor"),
        "call_mean_s": statistics.fmean(calls["commit"]) if calls["commit"] else 0.0,
        "floor_call_mean_s": statistics.fmean(calls["floor"]) if calls["floor"] else 0.0,
        "floor_bytes_per_save": statistics.fmean(saved_bytes["floor"]) if saved_bytes["floor"] else 0.0,
        "new_bytes_per_commit": statistics.fmean(saved_bytes["commit"]) if saved_bytes["commit"] else 0.0,
        "resolve_mean_s": statistics.fmean(resolves) if resolves else 0.0,
        "drain_s": sum(drains),
        "steps": len(c),
        "commits_started": started["commit"],
        "commits_completed_in_window": completed,
        "stall_threads": s.stall_threads,
        # state checkpointed per second of the commit arm's steps (an effective rate)
        "throughput_gbps": logical * started["commit"] / window / 1e9 if window > 0 else 0.0,
    })
    return [{"op": "train_steps", "metrics": m}]


# --- async commit ---------------------------------------------------------------------------------


def _resolve(fut: Any) -> Any:
    if hasattr(fut, "result"):
        return fut.result()
    if hasattr(fut, "wait"):
        return fut.wait()
    if inspect.isawaitable(fut):
        import asyncio

        async def _await():
            return await fut

        return asyncio.run(_await())
    return fut


def copy_floors(rb, idx: torch.Tensor) -> tuple[float, float]:
    """The async workload's floors: copies into memory allocated and zeroed (so resident)
    beforehand, as a snapshot's reused buffers are. Returns (rows, tensors) in seconds.

    rows: the changed rows of every column (``index_select``) and both priority trees, the
    least a row-level snapshot does. tensors: every tensor that changed (each whole storage
    column, all of which had rows rewritten) and both trees, with ``Tensor.copy_``, the
    least a tensor-level snapshot does. The buffers are freed before returning."""
    cols = dict(rb.storage._storage.items(include_nested=True, leaves_only=True))
    cap = rb.sampler._max_capacity
    trees = [torch.zeros(cap, dtype=rb.sampler.dtype) for _ in range(2)]

    def copy_trees():
        all_idx = torch.arange(cap)
        trees[0].copy_(torch.as_tensor(rb.sampler._sum_tree[all_idx]))
        trees[1].copy_(torch.as_tensor(rb.sampler._min_tree[all_idx]))

    def copy_rows(bufs):
        for k, b in bufs.items():
            torch.index_select(cols[k], 0, idx, out=b)
        copy_trees()

    def copy_tensors(bufs):
        for k, b in bufs.items():
            b.copy_(cols[k])
        copy_trees()

    row_bufs = {k: torch.zeros((len(idx),) + tuple(v.shape[1:]), dtype=v.dtype) for k, v in cols.items()}
    _, mr = measure(lambda: copy_rows(row_bufs), logical_bytes=tensor_bytes(row_bufs) + tensor_bytes(trees))
    row_bufs.clear()
    col_bufs = {k: torch.zeros_like(v) for k, v in cols.items()}
    _, mt = measure(lambda: copy_tensors(col_bufs), logical_bytes=tensor_bytes(col_bufs) + tensor_bytes(trees))
    col_bufs.clear()
    trees.clear()
    gc.collect()
    return mr["wall_s"], mt["wall_s"]


def async_save(task: dict) -> list[dict]:
    if not hasattr(ckptstore.Store, "commit_async"):
        return [{"op": "commit_async", "status": "not available", "reason": "ckptstore.Store has no commit_async"}]
    data, out = Data(task["data"]), Path(task["out"])
    rb = w1_build(data)
    out.mkdir(parents=True, exist_ok=True)
    store = ckptstore.Store(out / "store")
    store.commit(rb, tag="latest")
    # A first asynchronous commit after a change: ckptstore allocates its snapshot buffers
    # during this call. Reported as first_call_s / first_resolve_s.
    w1_change(rb, data)
    t0 = time.perf_counter()
    fut = store.commit_async(rb, tag="latest")
    first_call = time.perf_counter() - t0
    _resolve(fut)
    first_resolve = time.perf_counter() - t0
    # Measured: the next change (the following rows at the cursor) and its commit_async,
    # with the snapshot buffers of the first one reused: the steady state of a training loop.
    idx = w1_change(rb, data)
    logical = tensor_bytes(rows(rb)) + sampler_logical(rb.sampler)
    row_copy_s, tensor_copy_s = copy_floors(rb, idx)  # their buffers are freed again before the measured call
    box: dict = {}

    def call():
        t0 = time.perf_counter()
        box["fut"] = store.commit_async(rb, tag="latest")
        box["returned"] = time.perf_counter() - t0
        _resolve(box["fut"])
        box["resolved"] = time.perf_counter() - t0

    _, m = measure(call, logical_bytes=logical, disk_path=out / "store")
    store.close()
    m["wall_s"] = box["returned"]
    m["throughput_gbps"] = logical / box["resolved"] / 1e9  # of the whole commit (call to resolved future)
    m["resolve_s"] = box["resolved"]
    m["prealloc_copy_s"] = row_copy_s
    m["prealloc_copy_tensors_s"] = tensor_copy_s
    m["call_over_row_copy"] = box["returned"] / row_copy_s
    m["call_over_tensor_copy"] = box["returned"] / tensor_copy_s
    m["first_call_s"] = first_call
    m["first_resolve_s"] = first_resolve
    m["changed_rows"] = len(idx)
    return [{"op": "commit_async", "metrics": m}]


# --- child entry points ------------------------------------------------------------------------------

SAVES = {"w1": w1_save, "w2": w2_save, "w3": w3_save, "w4": w4_save, "w5": w5_save, "w6": w6_save, "async": async_save, "stall": stall_save}
LOADS = {"w1": w1_load, "w3": w3_load, "w5": w5_load, "w6": w6_load}


def task_save(task: dict) -> list[dict]:
    return SAVES[task["workload"]](task)


def task_load(task: dict) -> dict:
    warm_of = WARM_OPS.get(task.get("op"))
    if warm_of is not None:  # load_warm performs the same load as its cold counterpart
        task = {**task, "op": warm_of}
    fn, logical = LOADS[task["workload"]](task)
    out = Path(task["out"])
    cold = task.get("cold", True)
    if cold:
        evict_tree(out)
    resident = resident_fraction(out)
    extra, m = measure(fn, logical_bytes=logical, keep=True)
    m.update(extra or {})
    m["bytes_read"] = m["io_read_bytes"] if cold else m["rchar"]
    if resident is not None:
        m["resident_before" if cold else "resident_warm"] = resident
    return m


TASKS = {"gen": task_gen, "save": task_save, "load": task_load}


def child_main(task: dict, conn) -> None:
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    gc.freeze()  # the imported libraries' objects: keeps gc.collect() before each measurement cheap
    set_rss_baseline()  # right after the imports (done by the fork server, or by child.entry), before any state
    try:
        result = TASKS[task["kind"]](task)
        conn.send({"ok": True, "result": result})
    except BaseException:  # noqa: BLE001 - reported to the parent, which records the error
        conn.send({"ok": False, "error": traceback.format_exc()})
    finally:
        conn.close()
