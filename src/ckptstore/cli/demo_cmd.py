"""The ``demo`` command: the TorchRL DQN walkthrough of :mod:`ckptstore.demo`, run from the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..core.errors import MissingExtraError
from .common import terminal


def demo(
    store: Annotated[Path, typer.Option("--store", "-s", help="Store folder (not $CKPTSTORE_PATH: the demo never writes into your store).")] = Path(
        "runs/demo-store"
    ),
    frames: Annotated[int, typer.Option(min=250, help="Environment frames to collect (a multiple of 250).")] = 3000,
    every: Annotated[int, typer.Option(min=250, help="Commit every this many frames (a multiple of 250).")] = 500,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """The main job: collect CartPole with TorchRL, train DQN, commit every N frames, restore and check."""
    try:  # the [demo] extra, checked before the demo's own imports (torch, TorchRL: seconds)
        import gymnasium  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(f"the demo needs Gymnasium ({exc}): pip install 'ckptstore[demo]'") from None
    from ..demo import PER_BATCH, run

    if frames % PER_BATCH or every % PER_BATCH:
        raise typer.BadParameter(f"--frames and --every must be multiples of {PER_BATCH}")
    run(store, frames=frames, every=every, seed=seed, console=terminal())
