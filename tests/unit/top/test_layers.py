"""The layering of ARCHITECTURE.md: the import-linter contracts of pyproject.toml hold
(`make test` also runs `lint-imports` before the tests), and no module imports another's
private name (``_x``)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
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
    contracts = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in proc.stdout


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


def aliases() -> set[str]:
    """Top-level modules that only keep a public path: each is the module it names (``sys.modules``)."""
    return {p.stem for p in (SRC / "ckptstore").glob("*.py") if "sys.modules[__name__] = _module" in p.read_text()}


def test_every_module_has_a_layer():
    """A new module must be placed in the layers contracts (one a contract does not name is not
    checked): every module and package under ``ckptstore`` in the main contract, and every module
    of a package that has its own contract ("inside ckptstore.x") in that one."""
    conf = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    for contract in (c for c in conf if c["type"] == "layers"):
        package = contract.get("containers", ["ckptstore"])[0]
        named = {m.strip().removeprefix("ckptstore.") if package == "ckptstore" else m.strip()
                 for layer in contract["layers"] for m in re.split(r"[|:]", layer)}
        folder = SRC.joinpath(*package.split("."))
        modules = {p.stem if p.is_file() else p.name for p in folder.iterdir()
                   if (p.suffix == ".py" and p.stem not in ("__init__", "__main__")) or (p.is_dir() and (p / "__init__.py").exists())}
        if package == "ckptstore":
            modules -= aliases()
        assert (package, modules - named) == (package, set()) and (package, named - modules) == (package, set())


def test_the_public_paths_are_the_moved_modules():
    """``ckptstore.errors`` and ``ckptstore.layout`` (named by users and the docs) are the modules of
    ``ckptstore.core``, not copies: an exception class or a patched function is the same object."""
    import ckptstore.errors
    import ckptstore.layout
    from ckptstore.core import errors, layout

    assert aliases() == {"errors", "layout"}
    assert ckptstore.errors is errors and ckptstore.layout is layout
    assert ckptstore.errors.CkptStoreError is errors.CkptStoreError
