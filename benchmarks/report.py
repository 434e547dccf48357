"""Print a results file's tables as Markdown, for docs/performance.md.

    .venv/bin/python -m benchmarks.report benchmarks/results/latest.json > /tmp/tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .run import markdown_tables


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m benchmarks.report RESULTS.json", file=sys.stderr)
        return 2
    print(markdown_tables(json.loads(Path(argv[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
