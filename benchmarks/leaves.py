"""Per-leaf overhead, fixed cost per commit and model-state checkout (issue 22, items 7 and 8).

    python -m benchmarks.leaves            # every part, default repetitions
    python -m benchmarks.leaves --only leaves --leaves 10,1000,50000 -r 5
    python -m benchmarks.leaves --gpt2-scale 0.25   # a quarter of GPT-2's parameters

One process, in one run, each figure the median of ``-r`` repetitions (times in seconds):

- ``leaves``: a dict of L float32 [8] tensors. ``first``: a commit of L new tensors (new
  values each repetition) into an existing store; ``unchanged``: the same dict committed
  again; ``torch.save``: ``torch.save`` of the same dict to a file, fsynced with its folder.
- ``fixed``: the unchanged re-commit of a 512 MiB TensorDict (W6's columns) against the
  durable floor: two small files written and fsynced, and their folder fsynced.
- ``gpt2``: a GPT-2-sized model (GPT-2 small's 148 tensor shapes, 124 M float32 parameters)
  with AdamW state (exp_avg, exp_avg_sq, step): ``checkout(into=...)`` of model and optimizer
  against ``torch.load`` (weights_only) + ``load_state_dict`` of the same state saved with
  ``torch.save``; and ``checkout`` returning a TensorDict against ``torch.load`` alone.
  Warm (files in the page cache), alternating the two systems.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import ckptstore
import ckptstore.protocols.checkout  # noqa: F401 - imported lazily by the store: up front here
import ckptstore.store  # noqa: F401


def _fsync(path: str, folder: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if folder else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def leaves(root: Path, counts: list[int], reps: int) -> list[dict]:
    out = []
    for n in counts:
        d = root / f"leaves-{n}"
        store = ckptstore.Store(d / "store")
        store.commit({"x": torch.zeros(8)}, tag="seed")  # an existing store
        first, again, save = [], [], []
        r = reps if n < 50_000 else max(3, reps // 2)
        for i in range(r):
            state = {f"t{k}": torch.rand(8) for k in range(n)}
            first.append(_timed(lambda: store.commit(state, tag="latest")))
            again.append(_timed(lambda: store.commit(state, tag="latest")))
            p = d / f"s{i}.pt"

            def torch_save():
                torch.save(state, p)
                _fsync(str(p))
                _fsync(str(d), True)

            save.append(_timed(torch_save))
            p.unlink()
        store.close()
        row = {"L": n, "first": _med(first), "unchanged": _med(again), "torch.save": _med(save)}
        row["unchanged/first"] = row["unchanged"] / row["first"]
        row["first/torch.save"] = row["first"] / row["torch.save"]
        out.append(row)
        print(f"L={n:>6}: first {row['first']:.4f} s  unchanged {row['unchanged']:.4f} s  torch.save+fsync {row['torch.save']:.4f} s  "
              f"unchanged/first {row['unchanged/first']:.3f}  first/torch.save {row['first/torch.save']:.2f}", flush=True)
        shutil.rmtree(d)
    return out


def fixed(root: Path, mib: int, reps: int) -> dict:
    from tensordict import TensorDict

    n = mib * (1 << 20) // (4 * 84 * 84 + 8 + 4 + 1 + 16)
    g = torch.Generator().manual_seed(6)
    td = TensorDict(
        {
            "frames": torch.rand(n, 84, 84, generator=g),
            "action": torch.randint(0, 18, (n,), generator=g),
            "reward": torch.randn(n, generator=g),
            "done": torch.rand(n, generator=g) < 0.01,
            "tree": torch.rand(2 * n, generator=g, dtype=torch.float64),
        },
        batch_size=[],
    )
    store = ckptstore.Store(root / "fixed" / "store")
    store.commit(td, tag="latest")
    floor_dir = root / "fixed" / "floor"
    floor_dir.mkdir()
    small = os.urandom(512)

    def floor():
        for name in ("a", "b"):
            fd = os.open(floor_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, small)
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync(str(floor_dir), True)

    commits, floors = [], []
    for _ in range(reps * 3):  # alternating, so both see the same disk
        commits.append(_timed(lambda: store.commit(td, tag="latest")))
        floors.append(_timed(floor))
    store.close()
    row = {"MiB": mib, "unchanged": _med(commits), "floor": _med(floors)}
    row["unchanged/floor"] = row["unchanged"] / row["floor"]
    print(f"{mib} MiB TensorDict: unchanged re-commit {row['unchanged'] * 1e3:.2f} ms  durable floor {row['floor'] * 1e3:.2f} ms  "
          f"ratio {row['unchanged/floor']:.2f}", flush=True)
    shutil.rmtree(root / "fixed")
    return row


class GPT2(torch.nn.Module):
    """GPT-2 small's parameter shapes (tied output layer): 148 tensors, 124.4 M parameters at scale 1."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        e = max(8, int(round(768 * scale**0.5 / 8)) * 8)
        P = torch.nn.Parameter
        ps = {"wte": P(torch.randn(50257, e) * 0.02), "wpe": P(torch.randn(1024, e) * 0.02)}
        for i in range(12):
            ps.update({
                f"h{i}_ln1_w": P(torch.ones(e)), f"h{i}_ln1_b": P(torch.zeros(e)),
                f"h{i}_attn_w": P(torch.randn(e, 3 * e) * 0.02), f"h{i}_attn_b": P(torch.zeros(3 * e)),
                f"h{i}_proj_w": P(torch.randn(e, e) * 0.02), f"h{i}_proj_b": P(torch.zeros(e)),
                f"h{i}_ln2_w": P(torch.ones(e)), f"h{i}_ln2_b": P(torch.zeros(e)),
                f"h{i}_fc_w": P(torch.randn(e, 4 * e) * 0.02), f"h{i}_fc_b": P(torch.zeros(4 * e)),
                f"h{i}_mlp_w": P(torch.randn(4 * e, e) * 0.02), f"h{i}_mlp_b": P(torch.zeros(e)),
            })
        ps.update({"lnf_w": P(torch.ones(e)), "lnf_b": P(torch.zeros(e))})
        self.p = torch.nn.ParameterDict(ps)


def _gpt2(scale: float, seed: int):
    torch.manual_seed(seed)
    model = GPT2(scale)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optim


def gpt2(root: Path, scale: float, reps: int) -> dict:
    model, optim = _gpt2(scale, 0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    nparams = sum(p.numel() for p in model.parameters())
    state_bytes = 3 * 4 * nparams
    d = root / "gpt2"
    store = ckptstore.Store(d / "store")
    store.commit({"model": model, "optim": optim}, tag="latest")
    pt = d / "state.pt"
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, pt)
    del model, optim
    target_model, target_optim = _gpt2(scale, 1)

    def ck_into():
        store.checkout("latest", into={"model": target_model, "optim": target_optim})

    def tl_into():
        sd = torch.load(pt, weights_only=True)
        target_model.load_state_dict(sd["model"])
        target_optim.load_state_dict(sd["optim"])

    def ck_td():
        store.checkout("latest")

    def tl():
        torch.load(pt, weights_only=True)

    ck_into()
    tl_into()  # warm both files and the target's optimizer state
    t = {"checkout(into)": [], "torch.load+load_state_dict": [], "checkout": [], "torch.load": []}
    for _ in range(reps):
        t["checkout(into)"].append(_timed(ck_into))
        t["torch.load+load_state_dict"].append(_timed(tl_into))
        t["torch.load"].append(_timed(tl))
        t["checkout"].append(_timed(ck_td))
    store.close()
    row = {"params": nparams, "tensors": 3 * len(list(target_model.parameters())), "bytes": state_bytes, **{k: _med(v) for k, v in t.items()}}
    row["into ratio"] = row["checkout(into)"] / row["torch.load+load_state_dict"]
    row["plain ratio"] = row["checkout"] / row["torch.load"]
    print(f"GPT-2 x{scale} ({nparams / 1e6:.1f} M params, {state_bytes / 1e9:.2f} GB state): checkout(into) {row['checkout(into)']:.3f} s vs "
          f"torch.load+load_state_dict {row['torch.load+load_state_dict']:.3f} s: {row['into ratio']:.2f}x;  checkout {row['checkout']:.3f} s vs "
          f"torch.load {row['torch.load']:.3f} s: {row['plain ratio']:.2f}x", flush=True)
    shutil.rmtree(d)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="leaves,fixed,gpt2", help="comma-separated parts: leaves, fixed, gpt2")
    ap.add_argument("--leaves", default="10,1000,50000", help="leaf counts L")
    ap.add_argument("--fixed-mib", type=int, default=512)
    ap.add_argument("--gpt2-scale", type=float, default=1.0, help="fraction of GPT-2's 124 M parameters")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temporary folder under the current one)")
    a = ap.parse_args(argv)
    parts = set(a.only.split(","))
    root = Path(tempfile.mkdtemp(prefix="bench-leaves-", dir=a.dir or "."))
    out: dict = {}
    try:
        if "leaves" in parts:
            out["leaves"] = leaves(root, [int(x) for x in a.leaves.split(",")], a.reps)
        if "fixed" in parts:
            out["fixed"] = fixed(root, a.fixed_mib, a.reps)
        if "gpt2" in parts:
            out["gpt2"] = gpt2(root, a.gpt2_scale, a.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
