"""The package layout stays as docs/ARCHITECTURE.md draws it: imports point down the floors, no import cycle, few
modules at the top.

The import graph is read from the source with `ast`, imports inside function bodies included (a lazy import hides
a cycle or a climb from Python's loader, not from the reader). `from pkg import name` depends on `pkg` (its
`__init__` runs and `name` is read from it) and on `pkg.name` when that is a module; `import a.b` depends on `a.b`.
A package's `__init__` importing its own submodules is not a cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvbench"
MAX_TOP_LEVEL_MODULES = 6  # run, merge, harness (`python -m` shims), registry, pathnames (the bottom floor), __init__

# The floors, top to bottom: the one list of them (docs/ARCHITECTURE.md, "Floors", says why). A module imports from
# its own floor (no cycle, test_kvbench_has_no_import_cycle) or from a floor below, never from one above, function
# bodies included. Names are kvbench's packages and top-level modules ("" is kvbench/__init__.py); "__main__" is
# every `python -m kvbench.<package>` command, which sits on the top floor with runs/ and the shims in kvbench/.
FLOORS = [
    {"runs", "serving", "run", "merge", "harness", "__main__"},  # commands: a run, the load benchmark, a merge,
    #                                                      lm-eval's model, the report's CLI
    {"engine", "report", "remote"},                   # running the model (here, or a server's); reading run dirs
    {"methods", "data"},                              # what to keep; benchmark builders
    {"models", "metrics"},                            # loading and capture; scorers and their standard errors
    {"attention"},                                    # decode attention and column sums over what a cache holds
    {"cache"},                                        # K/V storage and its accounting
    {"registry", "pathnames", "disk", ""},            # leaves: name -> component, names that become folders,
                                                      # files and folders written whole (temporaries, checksums)
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module inside `root`'s package: line of the first such import}."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x / from ..y import z
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            for target in targets:
                if target in files and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, colouring modules on the current path)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def floor_of(module: str, floors: list[set[str]] = FLOORS) -> int:
    """Index of the module's floor in `floors` (0 is the top): by its package under the root, or `__main__`."""
    parts = module.split(".")
    name = "__main__" if parts[-1] == "__main__" else parts[1] if len(parts) > 1 else ""
    for level, names in enumerate(floors):
        if name in names:
            return level
    raise KeyError(f"{module}: {name!r} is on no floor; add it to FLOORS in tests/unit/test_layout.py and to "
                   "docs/ARCHITECTURE.md's Floors")


def upward_imports(graph: dict[str, dict[str, int]], floors: list[set[str]] = FLOORS) -> list[str]:
    """`module:line -> imported module` for every import of a module on a higher floor."""
    return [f"{module}:{line} -> {target}" for module, edges in sorted(graph.items())
            for target, line in sorted(edges.items()) if floor_of(target, floors) < floor_of(module, floors)]


def test_kvbench_imports_point_down_the_floors():
    graph = import_graph(PACKAGE)
    climbs = upward_imports(graph)
    assert not climbs, ("imports that climb a floor (move the shared piece below its users, docs/ARCHITECTURE.md):\n"
                        + "\n".join(climbs))
    # the check sees function bodies (the report command's lazy imports) and puts every `__main__` on the top floor
    assert floor_of("kvbench.report.__main__") == 0 and floor_of("kvbench.report") == 1
    assert "kvbench.runs.merge" in graph["kvbench.report.__main__"]


def test_an_upward_import_hidden_in_a_function_body_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    for sub in ("top", "low"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "top" / "a.py").write_text("from pkg.low import b\n")
    (pkg / "top" / "c.py").write_text("def g():\n    return 1\n")
    (pkg / "low" / "b.py").write_text("X = 1\n")
    (pkg / "low" / "__main__.py").write_text("from pkg.top import c\n")  # a command may import any floor
    floors = [{"__main__"}, {"top"}, {"low"}, {""}]
    assert upward_imports(import_graph(pkg), floors) == []
    (pkg / "low" / "b.py").write_text("def f():\n    from ..top.c import g\n    return g()\n")
    graph = import_graph(pkg)
    assert find_cycle(graph) is None  # no cycle: only the floors catch it
    assert upward_imports(graph, floors) == ["pkg.low.b:2 -> pkg.top.c"]


def test_kvbench_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    # the graph sees imports inside function bodies (run's lazy import of validate, for one)
    assert "kvbench.runs.validate" in graph["kvbench.runs.run"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + describe(cycle, graph)


def test_kvbench_keeps_few_modules_at_its_top_level():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules directly in kvbench/: {top}"


def test_a_cycle_hidden_in_a_function_body_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")  # a package importing its own modules: no cycle
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n    return g\n")
    (pkg / "c.py").write_text("X = 1\n")
    assert find_cycle(import_graph(pkg)) is None
    (pkg / "c.py").write_text("def g():\n    from pkg import a\n")  # c -> pkg -> a -> b -> c
    graph = import_graph(pkg)
    assert graph["pkg.sub.b"] == {"pkg.c": 2}
    cycle = find_cycle(graph)
    assert cycle is not None and {"pkg.a", "pkg.sub.b", "pkg.c"} <= set(cycle)


def model_forward_calls(root: Path) -> list[str]:
    """Calls that run a model forward, as `module:line`: any call given `past_key_values=` (how a decoder runs
    over a cache), and any call of something named `model` (`model(...)`, `self.model(...)`)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            callee = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if callee == "model" or "past_key_values" in {k.arg for k in node.keywords}:
                found.append(f"{module_name(path, root)}:{node.lineno}")
    return found


def test_the_model_runs_in_three_places_prefill_and_the_two_forms_of_the_step():
    """One engine: the prefill (engine/generation.py), the decode step (engine/batching.py) and its fixed-shape form
    (engine/static.py, the same loop over static rows) are the only model forwards; beams, streams and lm-eval are
    sequences of the step."""
    modules = sorted(site.split(":")[0] for site in model_forward_calls(PACKAGE))
    assert modules == ["kvbench.engine.batching", "kvbench.engine.generation", "kvbench.engine.static"], \
        model_forward_calls(PACKAGE)
