"""Where the repository's parts are, for any test file at any depth under tests/ (one place to change).

Every path a test needs outside its own file (the repository root, src/, docs/, benchmarks/,
tests/fixtures/) comes from here rather than from ``Path(__file__).parents[n]``, so that a test
file moved one folder deeper (tests/unit/<package>/, tests/harness/, tests/conformance/) finds them
unchanged. This module stays at tests/paths.py.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SRC = REPO / "src"
DOCS = REPO / "docs"
BENCHMARKS = REPO / "benchmarks"
FIXTURES = TESTS / "fixtures"
