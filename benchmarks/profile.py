"""Profile ckptstore's W1 operations with pyinstrument (statistical, wall-clock).

    .venv/bin/python -m benchmarks.profile [--w1-mib 1024] [--out DIR]

Builds the W1 buffer (the benchmark's data and change), then profiles, each in
this one process: the first commit, the re-commit after 1 % of rows changed, the
unchanged re-commit, a full checkout into memory and a checkout into the existing
buffer. Prints one call tree per operation (frames under 2 % of the time hidden)
and, with ``--out``, writes them as HTML too. Notes from these runs are kept in
``docs/performance.md``. Timings here include the profiler's overhead (~1 ms
sampling); the benchmark suite is the reference for times.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from pyinstrument import Profiler

import ckptstore

from .spec import Sizes
from .workloads import Data, gen_w1, w1_build, w1_change


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--w1-mib", type=float, default=1024.0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckptstore-profile"))
    ap.add_argument("--out", type=Path, help="also write one HTML profile per operation here")
    args = ap.parse_args(argv)
    data_dir = Path(tempfile.mkdtemp(prefix="ckptstore-profile-", dir="/dev/shm"))
    shutil.rmtree(args.workdir, ignore_errors=True)
    try:
        gen_w1(Sizes(w1_mib=args.w1_mib), data_dir)
        data = Data(data_dir)
        rb = w1_build(data)
        store = ckptstore.Store(args.workdir / "store")
        existing = w1_build(data)
        ops = [
            ("commit", lambda: store.commit(rb, tag="latest")),
            ("commit_after_change", lambda: store.commit(rb, tag="latest")),
            ("commit_unchanged", lambda: store.commit(rb, tag="latest")),
            ("checkout", lambda: store.checkout("latest")),
            ("checkout_into_existing", lambda: store.checkout("latest", into=existing)),
        ]
        for name, op in ops:
            if name == "commit_after_change":
                w1_change(rb, data)
            profiler = Profiler(interval=0.001)
            with profiler:
                op()
            print(f"\n===== {name} =====")
            print(profiler.output_text(color=False, show_all=False, time="seconds", flat=False, processor_options={"filter_threshold": 0.02}))
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{name}.html").write_text(profiler.output_html())
        store.close()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
