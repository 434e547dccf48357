"""tools/archgraph.py, the architecture measures of issue 36: its parts on synthetic input with
exact answers, and the properties of the current tree that hold before and after the package move
(no call path is traced here: that is the tool's own run, minutes of commits on a loaded machine)."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

from tests import paths

REPO = paths.REPO


def _load():
    spec = importlib.util.spec_from_file_location("archgraph", REPO / "tools" / "archgraph.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["archgraph"] = mod
    spec.loader.exec_module(mod)
    return mod


ag = _load()
LAYERS = ag.Layers.parse(["p.cli | p.demo", "p.store", "p.proto : p.proto2", "p.home", "p.home.deep"])


def test_layer_of_takes_the_longest_prefix_at_a_dot():
    assert LAYERS.layer_of("p.cli") == 0 and LAYERS.layer_of("p.demo.x") == 0
    assert LAYERS.layer_of("p.proto2") == 2 and LAYERS.mutual == [False, False, True, False, False]
    assert LAYERS.layer_of("p.home.local") == 3
    assert LAYERS.layer_of("p.home.deep.x") == 4  # "p.home.deep" is longer than "p.home"
    assert LAYERS.layer_of("p.homestead") is None  # a prefix ends at a dot
    assert LAYERS.layer_of("p") is None
    assert LAYERS.sibling_of("p.home.deep.x") == "p.home.deep"
    assert LAYERS.label(2) == "p.proto : p.proto2" and LAYERS.label(None) == "unlayered"


def test_scc_finds_a_planted_two_cycle_and_nothing_else():
    nodes = ["a", "b", "c", "d", "e"]
    edges = [("a", "b"), ("b", "a"), ("b", "c"), ("c", "d"), ("e", "e")]
    comps = ag.strongly_connected(nodes, edges)
    assert comps[0] == ["a", "b"]
    assert sorted(map(tuple, comps[1:])) == [("c",), ("d",), ("e",)]
    arrows = [ag.Arrow(a, b, ["module"]) for a, b in edges]
    assert ag.circles(nodes, arrows) == [["a", "b"]]
    arrows[1] = ag.Arrow("b", "a", ["type-checking"])  # the circle closed by a type-only import
    assert ag.circles(nodes, arrows) == [["a", "b"]]
    assert ag.circles(nodes, arrows, ("module", "function-local")) == []


def test_scc_of_a_long_chain_does_not_recurse():
    n = 5000
    nodes = [f"m{i}" for i in range(n)]
    edges = [(nodes[i], nodes[i + 1]) for i in range(n - 1)] + [(nodes[-1], nodes[0])]
    assert ag.strongly_connected(nodes, edges) == [sorted(nodes)]


def test_visits_and_climbs_on_a_synthetic_sequence():
    seq = ["p.store", "p.store", "p.proto", "p.home", "p.home.local", "p.proto2", "p.store", "p.home", "p.x"]
    assert ag.runs(seq) == [("p.store", 2), ("p.proto", 1), ("p.home", 1), ("p.home.local", 1), ("p.proto2", 1),
                            ("p.store", 1), ("p.home", 1), ("p.x", 1)]
    r = ag.visits_and_climbs(seq, LAYERS.layer_of)
    # store>proto down, proto>home down, home>home.local level, home.local>proto2 up, proto2>store up, store>home down, home>x unlayered
    assert (r["visits"], r["climbs"], r["descents"], r["level"], r["unlayered_changes"], r["calls"]) == (8, 2, 3, 1, 1, 9)
    assert ag.compact(seq, root="p") == "store×2 > proto > home > home.local > proto2 > store > home > x"


def test_trace_records_calls_and_their_callers_in_the_package():
    low_ns = {"__name__": "fakepkg.lo"}
    exec("def low():\n    return 1\n", low_ns)
    high_ns = {"__name__": "fakepkg.hi", "low": low_ns["low"], "sorted": sorted}
    exec("def high():\n    low()\n    sorted([2, 1], key=lambda x: low())\n    return helper()\n\ndef helper():\n    return 2\n", high_ns)
    t = ag.trace(high_ns["high"], root="fakepkg")
    # high, low, the lambda (called by the builtin sorted: its caller is the frame below, high) twice with low each time, helper
    assert t.calls == ["fakepkg.hi", "fakepkg.lo", "fakepkg.hi", "fakepkg.lo", "fakepkg.hi", "fakepkg.lo", "fakepkg.hi"]
    assert t.callers == [None, "fakepkg.hi", "fakepkg.hi", "fakepkg.hi", "fakepkg.hi", "fakepkg.hi", "fakepkg.hi"]
    layers = ag.Layers.parse(["fakepkg.hi", "fakepkg.lo"])
    assert ag.cross_calls(t, layers.layer_of) == {"cross_module_calls": 3, "upward_calls": 0}
    assert ag.visits_and_climbs(t.calls, layers.layer_of)["climbs"] == 3
    assert sys.getprofile() is None


def test_import_kinds_of_a_synthetic_module():
    src = (
        "import os\n"                                  # 1
        "from typing import TYPE_CHECKING\n"           # 2
        "if TYPE_CHECKING:\n"                          # 3
        "    from .store import Store\n"               # 4
        "else:\n"                                      # 5
        "    import json\n"                            # 6
        "class C:\n"                                   # 7
        "    import re\n"                              # 8
        "    def f(self):\n"                           # 9
        "        from . import (\n"                    # 10
        "            checkout)\n"                      # 11
        "        if typing.TYPE_CHECKING:\n"           # 12
        "            import x\n"                       # 13
    )
    kinds = ag.import_line_kinds(src)
    assert kinds == {1: "module", 2: "module", 4: "type-checking", 6: "module", 8: "module",
                     10: "function-local", 11: "function-local", 13: "type-checking"}
    assert ag.Arrow("a", "b", ["type-checking", "function-local"]).kind == "function-local"
    assert ag.Arrow("a", "b", ["type-checking", "module"]).kind == "module"


def test_classify_arrows():
    arrows = [ag.Arrow("p.home", "p.store", ["type-checking"]), ag.Arrow("p.cli", "p.demo", ["function-local"]),
              ag.Arrow("p.proto", "p.proto2", ["module"]), ag.Arrow("p.store", "p.home", ["module"]), ag.Arrow("p", "p.store", ["module"])]
    c = ag.classify(LAYERS, arrows)
    assert [(a.importer, a.imported) for a in c["up"]] == [("p.home", "p.store")]
    assert [(a.importer, a.imported) for a in c["sibling"]] == [("p.cli", "p.demo")]
    assert [(a.importer, a.imported) for a in c["unlayered"]] == [("p", "p.store")]
    m = ag.mutual_layers(LAYERS, arrows)
    assert m == [{"members": 2, "arrows": 1, "circles": [], "sublayers": 2}]


def test_counted_copy_of_the_configuration_changes_one_setting():
    text = (REPO / "pyproject.toml").read_text()
    config = ag.read_config(REPO / "pyproject.toml")
    counted = tomllib.loads(ag.counted_config(text))
    assert counted["tool"]["importlinter"] == dict(config, exclude_type_checking_imports=False)
    assert {k: v for k, v in counted["tool"].items() if k != "importlinter"} == {k: v for k, v in tomllib.loads(text)["tool"].items() if k != "importlinter"}
    bare = '[tool.importlinter]\nroot_package = "x"\n\n[[tool.importlinter.contracts]]\nname = "n"\ntype = "layers"\nlayers = ["x.a"]\n'
    assert tomllib.loads(ag.counted_config(bare))["tool"]["importlinter"]["exclude_type_checking_imports"] is False
    with pytest.raises(ValueError):
        ag.counted_config("[tool.other]\nx = 1\n")


def test_layers_relative_to_containers():
    layers = ag.Layers.parse(["store", "(optional) | home"], containers=["p"])
    assert layers.entries == [["p.store"], ["p.optional", "p.home"]]
    assert layers.layer_of("p.home.local") == 1


@pytest.fixture(scope="module")
def graph():
    pytest.importorskip("grimp", reason="import-linter (the test extra) brings grimp")
    return ag.import_graph()


def test_every_module_of_the_tree_has_a_layer(graph):
    modules, arrows = graph
    layers = ag.read_layers(REPO / "pyproject.toml")
    import ckptstore

    pkg_dir = Path(ckptstore.__file__).resolve().parent
    # every module file has a layer, but the root package and the public paths that are other modules
    # (ckptstore.errors is ckptstore.core.errors: sys.modules)
    unlayered = [m for m in modules if layers.layer_of(m) is None]
    assert "ckptstore" in unlayered
    aliases = [m for m in unlayered if "sys.modules[__name__] = _module" in ag.module_file(pkg_dir, m).read_text()]
    assert sorted(aliases) == ["ckptstore.errors", "ckptstore.layout"]
    assert [m for m in unlayered if ag.module_file(pkg_dir, m).name != "__init__.py" and m not in aliases] == []
    assert "ckptstore.store" in modules
    names = set(modules)
    assert all(a.importer in names and a.imported in names and a.importer != a.imported for a in arrows)
    assert len({(a.importer, a.imported) for a in arrows}) == len(arrows)
    assert all(a.kinds and set(a.kinds) <= {"module", "function-local", "type-checking"} for a in arrows)
    # the import-time graph has no circle (Python would fail to import one made of `from x import y`)
    assert ag.circles(modules, arrows, ("module",)) == []


def test_sizes_add_up():
    import ckptstore

    s = ag.module_sizes(Path(ckptstore.__file__).resolve().parent)
    assert s["files"] == len(s["per_file"]) == sum(p["files"] for p in s["packages"].values()) == sum(s["histogram"].values())
    assert s["lines"] == sum(s["per_file"].values()) == sum(p["lines"] for p in s["packages"].values())
    assert [b["file"] for b in s["big"]] == sorted((f for f, n in s["per_file"].items() if n >= 500), key=lambda f: -s["per_file"][f])
    assert s["histogram"]["500-699"] + s["histogram"]["700+"] == len(s["big"])


def test_lint_counted_reports_every_contract():
    if ag.shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("import-linter is not installed (the test extra)")
    r = ag.lint_counted(REPO / "pyproject.toml", REPO / "src")
    n = len(ag.read_config(REPO / "pyproject.toml")["contracts"])
    assert r["kept"] + r["broken"] == n == len(r["contracts"])
    assert (r["returncode"] == 0) == (r["broken"] == 0)
