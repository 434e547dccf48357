"""Measure the architecture of the ckptstore tree that ``import ckptstore`` finds (issue 36).

Usage, from a checkout's root::

    PYTHONPATH=src .venv/bin/python tools/archgraph.py [--json out.json] [--no-trace]

It prints four measures of the tree (the one ``PYTHONPATH`` points at; its ``pyproject.toml``
gives the layers):

1. **The import graph** (grimp, ``if TYPE_CHECKING:`` and function-local imports counted):
   modules, import arrows (importer -> imported, both inside ``ckptstore``), the arrows that
   point UP the layers, and the circles (strongly connected components of more than one module).
   A module's layer is the entry of the import-linter ``layers`` contract whose name (one of its
   ``|``/``:`` siblings) is the longest prefix of the module's name; modules no entry names are
   reported as unlayered. An arrow points up when the importer's layer is below the imported's.
2. **lint-imports with type-checking imports counted**: a temporary copy of the configuration
   with ``exclude_type_checking_imports = false``, contracts kept/broken.
3. **Module sizes**: files and lines per package, a histogram, the files of 500 lines or more.
4. **Two call paths**, traced with :func:`sys.setprofile` on the calling thread only (the
   store's worker threads are not followed): one ``Store.commit`` of a small real object on a
   fresh folder store, and one partial checkout on an ``s3://`` store (moto's server, as the
   tests start it; a folder store if that fails, said so in the output). A *visit* is a run of
   consecutive ``call`` events whose frames belong to one ckptstore module; a *climb* is a
   change of module to one in a layer ABOVE the previous one (returns are not events, so the
   caller's next call after a return from below counts as a climb).

It runs on the flat tree (a contract over modules) and on a package tree (a contract over
packages) alike, since everything layer-related comes from the contract.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = "ckptstore"
BINS = ((0, 100), (100, 300), (300, 500), (500, 700), (700, None))
BIG = 500  # "files over 500 lines": 500 lines or more


# ---------------------------------------------------------------------------- the contract


@dataclass
class Layers:
    """The ``layers`` contract: ``entries[i]`` is the i-th layer from the TOP, a list of sibling
    module names; ``mutual[i]``: its siblings may import each other (``:``), else independent (``|``)."""

    entries: list[list[str]]
    mutual: list[bool]

    @classmethod
    def parse(cls, layers: Iterable[str], containers: Iterable[str] = ()) -> Layers:
        """``layers`` as in the contract; with ``containers``, its names are relative to each
        container (import-linter's ``containers`` option). ``(name)``: an optional layer."""
        entries, mutual = [], []
        containers = list(containers)
        for entry in layers:
            names = [n.strip().strip("()").strip() for n in re.split(r"[|:]", entry) if n.strip()]
            if containers:
                names = [f"{c}.{n}" for c in containers for n in names]
            entries.append(names)
            mutual.append(":" in entry)
        return cls(entries, mutual)

    def layer_of(self, module: str) -> int | None:
        """Index (0: top) of the layer whose sibling name is the longest prefix of ``module``."""
        best, best_len = None, -1
        for i, names in enumerate(self.entries):
            for name in names:
                if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                    best, best_len = i, len(name)
        return best

    def sibling_of(self, module: str) -> str | None:
        """The sibling name of the contract that holds ``module`` (longest prefix)."""
        best = None
        for names in self.entries:
            for name in names:
                if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best)):
                    best = name
        return best

    def label(self, i: int | None) -> str:
        return "unlayered" if i is None else (" : " if self.mutual[i] else " | ").join(self.entries[i])


def read_config(pyproject: Path) -> dict:
    return tomllib.loads(pyproject.read_text())["tool"]["importlinter"]


def read_layers(pyproject: Path) -> Layers:
    """The first ``layers`` contract of the import-linter configuration in ``pyproject``."""
    contract = next(c for c in read_config(pyproject)["contracts"] if c["type"] == "layers")
    return Layers.parse(contract["layers"], contract.get("containers", ()))


# ---------------------------------------------------------------------------- the import graph


def module_file(pkg_dir: Path, module: str) -> Path:
    """The source file of ``module`` (dotted, starting with the root package) under ``pkg_dir``."""
    parts = module.split(".")[1:]
    base = pkg_dir.joinpath(*parts)
    return base / "__init__.py" if (base / "__init__.py").exists() else base.with_suffix(".py")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_line_kinds(source: str) -> dict[int, str]:
    """Line number -> kind of the import statement that spans it: ``"type-checking"`` (under an
    ``if TYPE_CHECKING:``), ``"function-local"`` (inside a function body) or ``"module"``."""
    kinds: dict[int, str] = {}

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                kinds[line] = kind
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, "type-checking")
            for child in node.orelse:
                visit(child, kind)
            return
        inner = "function-local" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == "module" else kind
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(source), "module")
    return kinds


@dataclass
class Arrow:
    importer: str
    imported: str
    kinds: list[str]  # one per import statement (line) making the arrow

    @property
    def kind(self) -> str:
        """``module`` if any import of the arrow runs at import time, else ``function-local`` if
        any is one, else ``type-checking``."""
        for k in ("module", "function-local", "type-checking"):
            if k in self.kinds:
                return k
        return "module"


def import_graph(root: str = ROOT) -> tuple[list[str], list[Arrow]]:
    """The modules of ``root`` and its internal arrows, type-checking imports included."""
    import grimp

    graph = grimp.build_graph(root, exclude_type_checking_imports=False, cache_dir=None)
    pkg_dir = Path(importlib.import_module(root).__file__).parent
    modules = sorted(graph.modules)
    kinds_of: dict[str, dict[int, str]] = {}
    arrows = []
    for importer in modules:
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if importer not in kinds_of:
                kinds_of[importer] = import_line_kinds(module_file(pkg_dir, importer).read_text())
            details = graph.get_import_details(importer=importer, imported=imported)
            kinds = [kinds_of[importer].get(d["line_number"], "module") for d in details] or ["module"]
            arrows.append(Arrow(importer, imported, kinds))
    return modules, arrows


def strongly_connected(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted, largest first."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(succ[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                out.append(sorted(comp))
    return sorted(out, key=lambda c: (-len(c), c))


def circles(modules: list[str], arrows: list[Arrow], kinds: tuple[str, ...] = ("module", "function-local", "type-checking")) -> list[list[str]]:
    """The SCCs of more than one module over the arrows whose kind is in ``kinds``."""
    comps = strongly_connected(modules, [(a.importer, a.imported) for a in arrows if a.kind in kinds and a.importer != a.imported])
    return [c for c in comps if len(c) > 1]


def classify(layers: Layers, arrows: list[Arrow]) -> dict[str, list[Arrow]]:
    """The arrows that point up, those between independent (``|``) siblings, those with an unlayered end."""
    out: dict[str, list[Arrow]] = {"up": [], "sibling": [], "unlayered": []}
    for a in arrows:
        li, lj = layers.layer_of(a.importer), layers.layer_of(a.imported)
        if li is None or lj is None:
            out["unlayered"].append(a)
        elif li > lj:
            out["up"].append(a)
        elif li == lj and not layers.mutual[li] and layers.sibling_of(a.importer) != layers.sibling_of(a.imported):
            out["sibling"].append(a)
    return out


def mutual_layers(layers: Layers, arrows: list[Arrow]) -> list[dict]:
    """Each ``:`` layer: its size, the arrows among its members, and whether those arrows have a
    circle (without one it could be ordered into sub-layers with no code change)."""
    out = []
    for i, names in enumerate(layers.entries):
        if not layers.mutual[i]:
            continue
        inside = [a for a in arrows if layers.layer_of(a.importer) == i and layers.layer_of(a.imported) == i
                  and layers.sibling_of(a.importer) != layers.sibling_of(a.imported)]
        edges = {(layers.sibling_of(a.importer), layers.sibling_of(a.imported)) for a in inside}
        comps = [c for c in strongly_connected(names, edges) if len(c) > 1]
        depth = longest_path(names, edges) if not comps else None
        out.append({"members": len(names), "arrows": len(edges), "circles": comps, "sublayers": depth})
    return out


def longest_path(nodes: list[str], edges: set[tuple[str, str]]) -> int:
    """Number of sub-layers an acyclic graph needs (nodes on its longest path)."""
    succ = {n: [b for a, b in edges if a == n] for n in nodes}
    memo: dict[str, int] = {}

    def depth(n: str) -> int:
        if n not in memo:
            memo[n] = 1 + max((depth(m) for m in succ[n]), default=0)
        return memo[n]

    return max((depth(n) for n in nodes), default=0)


# ---------------------------------------------------------------------------- lint-imports, counted


def counted_config(text: str) -> str:
    """``text`` (a pyproject.toml) with ``exclude_type_checking_imports = false`` in its
    ``[tool.importlinter]`` table, the rest as it was. Raises ValueError if the table is missing."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "[tool.importlinter]"), None)
    if start is None:
        raise ValueError("no [tool.importlinter] table")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    body = [line for line in lines[start + 1:end] if not re.match(r"\s*exclude_type_checking_imports\s*=", line)]
    out = "\n".join([*lines[:start + 1], "exclude_type_checking_imports = false", *body, *lines[end:]]) + "\n"
    expected = dict(tomllib.loads(text)["tool"]["importlinter"], exclude_type_checking_imports=False)
    if tomllib.loads(out)["tool"]["importlinter"] != expected:
        raise ValueError("could not set exclude_type_checking_imports in [tool.importlinter]")
    return out


def lint_counted(pyproject: Path, src: Path) -> dict:
    """Run lint-imports on a copy of ``pyproject`` that counts type-checking imports
    (:func:`counted_config`), with ``src`` on ``PYTHONPATH``."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        return {"error": "lint-imports not found"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "importlinter-counted.toml"
        path.write_text(counted_config(pyproject.read_text()))
        env = dict(os.environ, PYTHONPATH=str(src))
        proc = subprocess.run([exe, str(path), "--no-cache"], capture_output=True, text=True, env=env, cwd=tmp)
    text = proc.stdout + proc.stderr
    m = re.search(r"Contracts: (\d+) kept, (\d+) broken", text)
    contracts = re.findall(r"^(.+?) (KEPT|BROKEN)$", text, re.M)
    return {"returncode": proc.returncode, "kept": int(m[1]) if m else None, "broken": int(m[2]) if m else None,
            "contracts": [{"name": n.strip(), "result": r} for n, r in contracts],
            "output": text if m is None else ""}


# ---------------------------------------------------------------------------- module sizes


def module_sizes(pkg_dir: Path) -> dict:
    """Lines per ``.py`` file under ``pkg_dir``, grouped by package (the file's folder)."""
    files = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        rel = path.relative_to(pkg_dir.parent)
        files[str(rel)] = len(path.read_text().splitlines())
    packages: dict[str, dict[str, int]] = {}
    for rel, n in files.items():
        pkg = ".".join(Path(rel).parent.parts)
        p = packages.setdefault(pkg, {"files": 0, "lines": 0})
        p["files"] += 1
        p["lines"] += n
    hist = {}
    for lo, hi in BINS:
        label = f"<{hi}" if lo == 0 else (f"{lo}+" if hi is None else f"{lo}-{hi - 1}")
        hist[label] = sum(1 for n in files.values() if n >= lo and (hi is None or n < hi))
    big = sorted(((rel, n) for rel, n in files.items() if n >= BIG), key=lambda x: -x[1])
    return {"files": len(files), "lines": sum(files.values()), "packages": packages, "histogram": hist,
            "big": [{"file": rel, "lines": n} for rel, n in big], "per_file": files}


# ---------------------------------------------------------------------------- call paths


@dataclass
class Trace:
    """The ``call`` events of ckptstore frames on the calling thread: ``calls[i]`` is the callee's
    module, ``callers[i]`` the module of the nearest ckptstore frame below it on the stack (``None``
    when the call came from outside the package: the public call itself)."""

    calls: list[str] = field(default_factory=list)
    callers: list[str | None] = field(default_factory=list)


def trace(fn: Callable[[], object], root: str = ROOT) -> Trace:
    """Run ``fn()`` under :func:`sys.setprofile` (this thread only) and record each Python
    ``call`` event whose frame belongs to ``root`` (module ``root`` or below)."""
    out = Trace()
    prefix = root + "."

    def ours(frame) -> str | None:
        name = frame.f_globals.get("__name__", "")
        return name if name == root or name.startswith(prefix) else None

    def prof(frame, event, arg):
        if event == "call":
            name = ours(frame)
            if name is not None:
                caller, back = None, frame.f_back
                while back is not None and caller is None:
                    caller, back = ours(back), back.f_back
                out.calls.append(name)
                out.callers.append(caller)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return out


def cross_calls(t: Trace, layer_of: Callable[[str], int | None]) -> dict:
    """Calls whose caller is another ckptstore module (the stack's view, not the sequence's):
    how many, and how many go UP (the callee's layer above the caller's)."""
    cross = up = 0
    for callee, caller in zip(t.calls, t.callers):
        if caller is None or caller == callee:
            continue
        cross += 1
        lc, le = layer_of(caller), layer_of(callee)
        up += lc is not None and le is not None and le < lc
    return {"cross_module_calls": cross, "upward_calls": up}


def runs(seq: list[str]) -> list[tuple[str, int]]:
    """Consecutive equal modules collapsed: ``[(module, calls), ...]``; one run is one visit."""
    out: list[list] = []
    for m in seq:
        if out and out[-1][0] == m:
            out[-1][1] += 1
        else:
            out.append([m, 1])
    return [(m, n) for m, n in out]


def visits_and_climbs(seq: list[str], layer_of: Callable[[str], int | None]) -> dict:
    """Visits (runs of one module) and climbs (a change to a module in a layer above the
    previous one's; layer index 0 is the top). Changes with an unlayered end are counted apart."""
    r = runs(seq)
    climbs = descents = level = unlayered = 0
    for (a, _), (b, _) in zip(r, r[1:]):
        la, lb = layer_of(a), layer_of(b)
        if la is None or lb is None:
            unlayered += 1
        elif lb < la:
            climbs += 1
        elif lb > la:
            descents += 1
        else:
            level += 1
    return {"calls": len(seq), "visits": len(r), "climbs": climbs, "descents": descents, "level": level,
            "unlayered_changes": unlayered, "modules": len({m for m, _ in r})}


def compact(seq: list[str], root: str = ROOT) -> str:
    """The runs as ``store×3 > commit > adapters.base×12 ...`` (root prefix dropped)."""
    return " > ".join(f"{m.removeprefix(root + '.')}" + (f"×{n}" if n > 1 else "") for m, n in runs(seq))


def _preimport(root: str) -> list[str]:
    """Import every module of ``root`` first, so that no module body runs inside a trace;
    returns the modules that failed to import (an optional dependency missing)."""
    failed = []
    pkg = importlib.import_module(root)
    for info in pkgutil.walk_packages(pkg.__path__, root + "."):
        if info.name.endswith(".__main__"):
            continue  # (running it is the command line, `python -m`)
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - listed in the output
            failed.append(info.name)
    for name in ("torch", "tensordict"):
        importlib.import_module(name)
    return failed


def _sample():
    """The committed object: a dict of a tensor and a small module (its state dict), seeded."""
    import torch

    torch.manual_seed(0)
    return {"weights": torch.arange(4096, dtype=torch.float32), "policy": torch.nn.Linear(16, 8)}


def trace_commit(tmp: Path) -> Trace:
    import ckptstore

    store = ckptstore.Store(str(tmp / "store"), create=True)
    obj = _sample()
    try:
        return trace(lambda: store.commit(obj, tag="t"))
    finally:
        store.close()


def _moto(tree: Path):
    """tests/s3server.py's MotoServer of ``tree`` (or of this tool's checkout), started."""
    for base in (tree, Path(__file__).resolve().parents[1]):
        for path in sorted(base.glob("tests/**/s3server.py")):
            spec = importlib.util.spec_from_file_location("_archgraph_s3server", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod  # dataclasses look the module up
            spec.loader.exec_module(mod)
            return mod.MotoServer(buckets=["ckpt"], serialize=True).start()
    raise FileNotFoundError("tests/s3server.py")


def trace_partial_checkout(tmp: Path, tree: Path) -> tuple[Trace, str]:
    """Commit the sample, then trace ``checkout("t", partial=["policy"])`` on a Store opened
    anew on the same location (as another process would). Returns (calls, where)."""
    import ckptstore

    server = None
    try:
        server = _moto(tree)
        os.environ.update(server.env)
        os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")
        url, where = "s3://ckpt/archgraph", "s3:// (moto server, tests/s3server.py)"
    except Exception as exc:  # noqa: BLE001 - said in the output
        url, where = str(tmp / "partial"), f"FOLDER store: the moto server did not start ({type(exc).__name__}: {exc})"
    try:
        writer = ckptstore.Store(url, create=True)
        writer.commit(_sample(), tag="t")
        writer.close()
        store = ckptstore.Store(url)
        try:
            return trace(lambda: store.checkout("t", partial=["policy"])), where
        finally:
            store.close()
    finally:
        if server is not None:
            server.stop()


# ---------------------------------------------------------------------------- report


def _commit(tree: Path) -> str:
    """``HEAD <hash>, src/ last changed by <hash>`` (``+dirty``: uncommitted changes under ``src/``),
    or ``?`` outside git."""
    try:
        git = ["git", "-C", str(tree)]

        def out(*args: str) -> str:
            return subprocess.run([*git, *args], capture_output=True, text=True, check=True).stdout.strip()

        dirty = "+dirty" if out("status", "--porcelain", "--", "src") else ""
        return f"HEAD {out('rev-parse', '--short', 'HEAD')}, src/ last changed by {out('log', '-1', '--format=%h', '--', 'src') or '?'}{dirty}"
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _same_circle(cyc: list[list[str]], a: Arrow) -> bool:
    return any(a.importer in c and a.imported in c for c in cyc)


def measure(pyproject: Path, do_trace: bool = True) -> dict:
    import ckptstore

    pkg_dir = Path(ckptstore.__file__).resolve().parent
    src = pkg_dir.parent
    tree = src.parent
    layers = read_layers(pyproject)
    modules, arrows = import_graph()
    cls = classify(layers, arrows)
    cyc = circles(modules, arrows)
    result: dict = {
        "tree": str(tree), "commit": _commit(tree), "pyproject": str(pyproject),
        "graph": {
            "modules": len(modules),
            "per_package": {p: sum(1 for m in modules if ".".join(module_file(pkg_dir, m).relative_to(src).parent.parts) == p)
                            for p in sorted({".".join(module_file(pkg_dir, m).relative_to(src).parent.parts) for m in modules})},
            "arrows": len(arrows),
            "arrows_by_kind": {k: sum(1 for a in arrows if a.kind == k) for k in ("module", "function-local", "type-checking")},
            "type_checking_imports": sum(a.kinds.count("type-checking") for a in arrows),
            "type_checking_in_circles": [{"importer": a.importer, "imported": a.imported, "statements": a.kinds.count("type-checking")}
                                         for a in arrows if "type-checking" in a.kinds and _same_circle(cyc, a)],
            "up": [{"importer": a.importer, "imported": a.imported, "kind": a.kind,
                    "from": layers.label(layers.layer_of(a.importer)), "to": layers.label(layers.layer_of(a.imported))} for a in cls["up"]],
            "sibling": [{"importer": a.importer, "imported": a.imported, "kind": a.kind} for a in cls["sibling"]],
            "unlayered_modules": sorted(m for m in modules if layers.layer_of(m) is None),
            "circles": cyc,
            "circles_without_type_checking": circles(modules, arrows, ("module", "function-local")),
            "circles_import_time_only": circles(modules, arrows, ("module",)),
            "layers": len(layers.entries),
            "largest_layer": max(len(e) for e in layers.entries),
            "mutual_layers": mutual_layers(layers, arrows),
        },
        "lint_counted": lint_counted(pyproject, src),
        "sizes": module_sizes(pkg_dir),
    }
    if do_trace:
        failed = _preimport(ROOT)
        with tempfile.TemporaryDirectory(prefix="archgraph-") as tmp:
            commit_t = trace_commit(Path(tmp))
            co_t, where = trace_partial_checkout(Path(tmp), tree)

        def path(t: Trace) -> dict:
            return {**visits_and_climbs(t.calls, layers.layer_of), **cross_calls(t, layers.layer_of), "sequence": compact(t.calls),
                    "raw": [[callee, caller] for callee, caller in zip(t.calls, t.callers)]}

        result["paths"] = {
            "note": "sys.setprofile 'call' events of the calling thread only (the store's worker threads are not followed); "
                    "every ckptstore module imported before tracing" + (f" (failed: {', '.join(failed)})" if failed else ""),
            "commit": {"call": "Store(folder, create=True).commit({'weights': 4096 float32, 'policy': nn.Linear(16, 8)}, tag='t')",
                       **path(commit_t)},
            "partial_checkout": {"call": "Store(url).checkout('t', partial=['policy']), the commit made by another Store on url",
                                 "where": where, **path(co_t)},
        }
    return result


def render(r: dict) -> str:
    g, lint, s = r["graph"], r["lint_counted"], r["sizes"]
    out = [f"tree: {r['tree']} ({r['commit']})", f"layers contract: {r['pyproject']} ({g['layers']} layers, largest {g['largest_layer']} names)", ""]
    out.append("1. Import graph (grimp; type-checking and function-local imports counted)")
    out.append(f"   modules: {g['modules']} (.py files per folder, __init__ included: "
               + ", ".join(f"{p}/ {n}" for p, n in g["per_package"].items()) + ")")
    k = g["arrows_by_kind"]
    out.append(f"   import arrows: {g['arrows']} (import-time {k['module']}, function-local only {k['function-local']}, "
               f"type-checking only {k['type-checking']}); `if TYPE_CHECKING:` import statements: {g['type_checking_imports']}")
    tc = g["type_checking_in_circles"]
    out.append(f"   type-checking imports between members of one circle: {sum(a['statements'] for a in tc)}"
               + "".join(f"\n     {a['importer']} -> {a['imported']}" + (f" ({a['statements']}x)" if a['statements'] > 1 else "") for a in tc))
    out.append(f"   arrows pointing up the layers: {len(g['up'])}")
    for a in g["up"]:
        out.append(f"     {a['importer']} -> {a['imported']}  [{a['kind']}]")
    if g["sibling"]:
        out.append(f"   arrows between independent (|) siblings: {len(g['sibling'])}")
        for a in g["sibling"]:
            out.append(f"     {a['importer']} -> {a['imported']}  [{a['kind']}]")
    out.append(f"   unlayered modules: {len(g['unlayered_modules'])} {g['unlayered_modules']}")
    for label, key in (("circles", "circles"), ("circles without type-checking imports", "circles_without_type_checking"),
                       ("circles of import-time imports only", "circles_import_time_only")):
        cs = g[key]
        out.append(f"   {label}: {len(cs)}" + (f", sizes {[len(c) for c in cs]}" if cs else ""))
        if key == "circles":
            for c in cs:
                out.append(f"     {', '.join(m.removeprefix(ROOT + '.') for m in c)}")
    for m in g["mutual_layers"]:
        out.append(f"   mutual (:) layer of {m['members']}: {m['arrows']} arrows among its members, "
                   + (f"circles {m['circles']}" if m["circles"] else f"no circle: orderable into {m['sublayers']} sub-layers"))
    out.append("")
    out.append("2. lint-imports with exclude_type_checking_imports = false")
    if lint.get("error") or lint.get("kept") is None:
        out.append(f"   could not run: {lint.get('error') or lint.get('output', '')[-2000:]}")
    else:
        out.append(f"   contracts: {lint['kept']} kept, {lint['broken']} broken")
        for c in lint["contracts"]:
            out.append(f"     {c['result']:6} {c['name']}")
    out.append("")
    out.append(f"3. Module sizes: {s['files']} .py files, {s['lines']} lines")
    for pkg, p in s["packages"].items():
        out.append(f"   {pkg:32} {p['files']:3} files {p['lines']:6} lines")
    out.append("   histogram (lines per file): " + ", ".join(f"{b}: {n}" for b, n in s["histogram"].items()))
    out.append(f"   files of {BIG} lines or more: {len(s['big'])}")
    for b in s["big"]:
        out.append(f"     {b['lines']:5}  {b['file']}")
    if "paths" in r:
        p = r["paths"]
        out.append("")
        out.append(f"4. Call paths ({p['note']})")
        out.append("   visit: a run of consecutive calls in one module; climb: a change of module to one in a layer above the last")
        for name in ("commit", "partial_checkout"):
            c = p[name]
            out.append(f"   {name}: {c['call']}" + (f"\n     on: {c['where']}" if "where" in c else ""))
            out.append(f"     visits {c['visits']}, climbs {c['climbs']} (descents {c['descents']}, level {c['level']}, "
                       f"unlayered {c['unlayered_changes']}); {c['calls']} calls in {c['modules']} modules")
            out.append(f"     by the stack: {c['cross_module_calls']} calls from another ckptstore module, {c['upward_calls']} of them up the layers")
            out.append(f"     {c['sequence']}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure ckptstore's import graph, layers, sizes and call paths (issue 36).")
    parser.add_argument("--json", type=Path, help="also write the measures as JSON here")
    parser.add_argument("--pyproject", type=Path, help="the import-linter configuration (default: the measured tree's pyproject.toml)")
    parser.add_argument("--no-trace", action="store_true", help="skip the two traced call paths")
    args = parser.parse_args(argv)
    import ckptstore

    pyproject = args.pyproject or Path(ckptstore.__file__).resolve().parents[2] / "pyproject.toml"
    r = measure(pyproject, do_trace=not args.no_trace)
    sys.stdout.write(render(r))
    if args.json:
        r["sizes"].pop("per_file")
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
