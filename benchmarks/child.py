"""Entry point of every child process (torch-free to import, so the parent stays light)."""

from __future__ import annotations


def entry(task: dict, conn) -> None:
    from benchmarks import workloads  # preloaded in the fork server: no import cost there

    workloads.child_main(task, conn)
