"""The layering of ARCHITECTURE.md: the import-linter contracts of pyproject.toml hold
(`make test` also runs `lint-imports` before the tests), and no module imports another's
private name (``_x``)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests import paths

SRC = paths.SRC


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("import-linter is not installed (the test extra)")
    proc = subprocess.run([exe, "--no-cache"], cwd=SRC.parent, capture_output=True, text=True, env={"PYTHONPATH": str(SRC), "PATH": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in proc.stdout


def private_imports() -> list[str]:
    found = []
    for path in sorted((SRC / "ckptstore").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ckptstore")):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(SRC)}:{node.lineno}: {alias.name} from {'.' * node.level}{node.module or ''}")
    return found


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == []


def test_every_module_has_a_layer():
    """A new module must be placed in the layers contract (one the contract does not name is not checked)."""
    import re
    import tomllib

    conf = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in conf if c["type"] == "layers")["layers"]
    named = {m.strip().removeprefix("ckptstore.") for layer in layers for m in re.split(r"[|:]", layer)}
    modules = {p.stem if p.is_file() else p.name for p in (SRC / "ckptstore").iterdir()
               if (p.suffix == ".py" and p.stem not in ("__init__", "__main__")) or (p.is_dir() and (p / "__init__.py").exists())}
    assert modules - named == set() and named - modules == set()
