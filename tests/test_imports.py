"""The import graph of ``paravt``: no circles, no ``__main__`` module imported.

Every module under ``paravt/`` is parsed with ``ast`` (nothing is imported), and each of its
``import`` statements — at module level and inside functions alike, since a function-level
import only hides a circle until the function runs — becomes an edge to the ``paravt`` module
it names: ``from paravt.x import y`` is an edge to ``paravt.x.y`` when ``y`` is a submodule,
else to ``paravt.x``. Importing ``paravt.x.y`` also runs the package ``paravt.x``'s
``__init__``, but that is no edge of its own (every submodule would otherwise be in a circle
with a package that re-exports it).

A circle means two stages that each need the other, so neither can be read, tested or
replaced alone (STYLE.md: shared helpers move down a floor). A ``__main__`` module is a CLI:
importing it runs nothing useful and ties a library to a command line.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "paravt"


def _modules(package: Path) -> dict[str, Path]:
    mods = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """``{paravt module that name (at path) imports anywhere in its body: first line}``."""
    is_pkg = path.name == "__init__.py"
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # each name is a submodule, or a name the module itself defines
            subs = (f"{target}.{a.name}" for a in node.names)
            targets = [sub if sub in modules else target for sub in subs]
        else:
            continue
        for t in targets:
            if t in modules and t != name:
                out[t] = min(out.get(t, node.lineno), node.lineno)
    return out


def import_edges(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """``{module: {paravt module it imports: line of the first such import}}``.

    The line lets a failing check (``tests/test_architecture_map.py``) name the statement.
    """
    modules = _modules(package)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: the paravt modules it imports}`` for every module of ``package``."""
    return {name: set(deps) for name, deps in import_edges(package).items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle ``[a, b, ..., a]`` of ``graph``, or None (depth-first, deterministic)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "paravt"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from paravt.sub import VALUE, b\n")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n\nVALUE = 1\n")
    (pkg / "sub" / "b.py").write_text("import os\nfrom ..a import f\n")
    graph = import_graph(pkg)
    assert graph == {
        "paravt": set(),
        "paravt.a": {"paravt.sub", "paravt.sub.b"},
        "paravt.sub": {"paravt.sub.b"},
        "paravt.sub.b": {"paravt.a"},
    }
    assert find_cycle(graph) == ["paravt.a", "paravt.sub", "paravt.sub.b", "paravt.a"]


def test_no_import_circle_in_paravt() -> None:
    graph = import_graph()
    assert "paravt.train" in graph and "paravt.sft" in graph["paravt.train"]  # the walk works
    assert "paravt.train" in graph["paravt.experiments.collapse"]  # sees function-level imports
    cycle = find_cycle(graph)
    assert cycle is None, (
        "import circle: " + " -> ".join(cycle or []) + "; move the code both sides need "
        "into a lower module that imports neither"
    )


def test_no_module_imports_a_main_module() -> None:
    graph = import_graph()
    assert "paravt.eval.__main__" in graph  # the walk sees the CLI modules
    bad = {n: sorted(m for m in deps if m.endswith(".__main__")) for n, deps in graph.items()}
    bad = {n: ms for n, ms in bad.items() if ms}
    assert not bad, f"imports of a __main__ module (move what they need out of the CLI): {bad}"


def lazy_imports_without_reason(package: Path = PACKAGE) -> list[str]:
    """Every import of a ``paravt`` or ``paravt_kernels`` module inside a function that no
    ``# lazy:`` comment explains (on the line above it, or above the run of imports it is in),
    as ``path:line module``."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        src = path.read_text()
        lines = src.splitlines()
        tree = ast.parse(src, filename=str(path))
        found = []
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import):
                        mod = node.names[0].name
                    elif isinstance(node, ast.ImportFrom) and not node.level:
                        mod = node.module or ""
                    else:
                        continue
                    if mod.split(".")[0] in ("paravt", "paravt_kernels"):
                        found.append((node.lineno, node.end_lineno or node.lineno, mod))
        in_imports = {i for a, b, _ in found for i in range(a, b + 1)}
        for start, _, mod in found:
            above = start - 1
            while above in in_imports:
                above -= 1
            if "# lazy:" not in lines[above - 1]:
                bad.append(f"{path.relative_to(package.parent)}:{start} {mod}")
    return bad


def test_function_level_imports_say_why() -> None:
    """An import inside a function hides an arrow of the graph from a reader of the module's
    head; it stays only where a ``# lazy:`` comment says why (an optional heavy dependency, a
    command's refusals before the model loads, an op looked up per call)."""
    bad = lazy_imports_without_reason()
    assert not bad, (
        "function-level imports without a '# lazy:' reason (move them to the module's head, "
        "or say why they must wait):\n  " + "\n  ".join(bad)
    )


def test_the_lazy_check_sees_a_bare_import(tmp_path: Path) -> None:
    pkg = tmp_path / "paravt"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "def f():\n    from paravt.b import x\n    return x\n\n\n"
        "def g():\n    # lazy: heavy\n    from paravt.b import y\n    import paravt.c\n"
    )
    assert lazy_imports_without_reason(pkg) == ["paravt/a.py:2 paravt.b"]


def test_no_module_imports_another_modules_private_name() -> None:
    """A name with a leading underscore is its module's own business: another module that
    imports it ties itself to an implementation detail (make it public, or move it down)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if node.module.split(".")[0] not in ("paravt", "paravt_kernels"):
                    continue
                bad += [
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not bad, "imports of another module's private name:\n  " + "\n  ".join(bad)
