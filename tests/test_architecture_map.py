"""docs/ARCHITECTURE.md's floor table is the real import graph of ``paravt``, so it cannot drift.

The two tables of "The floors" (which module sits on which floor; which modules never import
which) are parsed from the Markdown and checked against ``import_edges`` of
``tests/test_imports.py`` (``ast``, nothing imported). Function-level (lazy) imports count, as
the page says: a lower module that imports a higher one inside a function still cannot run
without it. The checks:

* every module under ``paravt/`` is placed (its most specific entry: a file beats a folder, a
  deeper folder beats a shallower one), and every entry places at least one module;
* no import goes to a higher floor;
* no module breaks a "never import" rule;
* ``kernels/`` (``paravt_kernels``) imports no ``paravt`` module.

The parametrised cases below break the parsed table on purpose and assert the message, so the
check is known to be able to fail.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from pathlib import Path

import pytest
from test_imports import PACKAGE, import_edges

ROOT = PACKAGE.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
CODE = re.compile(r"`([^`]+)`")


@dataclasses.dataclass
class FloorMap:
    """The parsed tables: ``floors[entry] = (floor, floor name)``, ``rules = [(who, never, why)]``."""

    floors: dict[str, tuple[int, str]]
    rules: list[tuple[list[str], list[str], str]]


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of the Markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header)]
    assert len(starts) == 1, f"{DOC}: expected one table whose header starts {header!r}"
    rows = []
    for line in lines[starts[0] + 2 :]:  # skip the header and its | --- | line
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def parse_map(text: str) -> FloorMap:
    """The floor table and the rules table of docs/ARCHITECTURE.md's "The floors"."""
    floors: dict[str, tuple[int, str]] = {}
    for floor, name, modules, _what in _table_rows(text, "| floor | name | modules |"):
        for entry in CODE.findall(modules):
            assert entry not in floors, f"{DOC}: {entry} is on two floors"
            floors[entry] = (int(floor), name)
    rules = [
        (CODE.findall(who), CODE.findall(never), why)
        for who, never, why in _table_rows(text, "| modules | never import |")
    ]
    return FloorMap(floors, rules)


def _entry_modules(entry: str) -> tuple[str, bool]:
    """``agent/`` -> (``paravt.agent``, folder); ``eval/__main__.py`` -> (``paravt.eval.__main__``, file)."""
    if entry.endswith("/"):
        return "paravt." + entry.rstrip("/").replace("/", "."), True
    parts = entry.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["paravt", *parts]), False


def _covers(entry: str, module: str) -> bool:
    name, folder = _entry_modules(entry)
    return module == name or (folder and module.startswith(name + "."))


def place(fmap: FloorMap, module: str) -> tuple[str, int, str] | None:
    """The most specific entry placing ``module`` and its floor, or None."""
    hits = [e for e in fmap.floors if _covers(e, module)]
    if not hits:
        return None
    # a file beats any folder; among folders the deepest wins
    best = max(hits, key=lambda e: (not e.endswith("/"), e.count("/")))
    return (best, *fmap.floors[best])


def check(fmap: FloorMap, edges: dict[str, dict[str, int]]) -> list[str]:
    """Every way the import graph ``edges`` disagrees with ``fmap``; empty when they agree."""
    problems = []
    placed = {m: place(fmap, m) for m in edges}
    for module, where in sorted(placed.items()):
        if where is None:
            problems.append(
                f"{module} is on no floor of docs/ARCHITECTURE.md: add it to the floor table "
                "(its floor is the highest floor it imports from, or higher)"
            )
    used = {where[0] for where in placed.values() if where}
    for entry in sorted(set(fmap.floors) - used):
        problems.append(
            f"docs/ARCHITECTURE.md's floor table places {entry!r} (floor "
            f"{fmap.floors[entry][0]}), but no module of paravt is placed by it: remove the "
            "entry or fix its path"
        )
    for module, deps in sorted(edges.items()):
        src = placed[module]
        for target, line in sorted(deps.items()):
            dst = placed[target]
            if src and dst and dst[1] > src[1]:
                problems.append(
                    f"{module} (floor {src[1]}, {src[2]}, placed by {src[0]}) imports {target} "
                    f"(floor {dst[1]}, {dst[2]}, placed by {dst[0]}) at line {line}: a module "
                    "imports only from its own floor or below; move what it needs down a "
                    "floor, or move the importer up and update docs/ARCHITECTURE.md"
                )
    for who, never, why in fmap.rules:
        for module, deps in sorted(edges.items()):
            if not any(_covers(w, module) for w in who):
                continue
            for target, line in sorted(deps.items()):
                for banned in never:
                    if _covers(banned, target):
                        problems.append(
                            f"{module} imports {target} at line {line}, but docs/"
                            f"ARCHITECTURE.md says {' '.join(who)} never import "
                            f"{' '.join(never)} ({why})"
                        )
    return problems


def test_the_floor_table_is_the_import_graph() -> None:
    fmap = parse_map(DOC.read_text())
    edges = _edges()
    assert fmap.floors["train.py"] == (5, "commands")  # the parse works
    assert fmap.floors["engines/__init__.py"][0] == 0 and len(fmap.rules) == 3
    assert place(fmap, "paravt.engines.hf")[:2] == ("engines/", 3)  # folder under a file entry
    problems = check(fmap, edges)
    assert not problems, "docs/ARCHITECTURE.md disagrees with the code:\n" + "\n".join(problems)


@functools.cache
def _edges() -> dict[str, dict[str, int]]:
    """paravt's import edges, parsed once per session (check() only reads them)."""
    return import_edges()


def _move(fmap: FloorMap, entry: str, floor: int) -> None:
    fmap.floors[entry] = (floor, "moved")


BROKEN = {
    # metrics -> rewards.format (floor 3) becomes an upward edge from floor 0
    "upward": (
        lambda m: _move(m, "metrics.py", 0),
        "paravt.metrics (floor 0, moved, placed by metrics.py) imports paravt.rewards.format "
        "(floor 3, the stages, placed by rewards/) at line ",
    ),
    # a lazy import counts: config imports the engine registry inside a function only
    "upward lazy": (
        lambda m: _move(m, "engines/__init__.py", 3),
        "paravt.config (floor 0, records + registries, placed by config.py) imports "
        "paravt.engines (floor 3, moved, placed by engines/__init__.py) at line ",
    ),
    "unplaced": (
        lambda m: m.floors.pop("view.py"),
        "paravt.view is on no floor of docs/ARCHITECTURE.md",
    ),
    "stale": (
        lambda m: m.floors.update({"gone.py": (3, "the stages")}),
        "places 'gone.py' (floor 3), but no module of paravt is placed by it",
    ),
    "rule": (
        lambda m: m.rules.append((["metrics.py"], ["rewards/"], "made up")),
        "paravt.metrics imports paravt.rewards.format at line ",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_wrong_table_fails_naming_module_import_and_floors(case: str) -> None:
    fmap = parse_map(DOC.read_text())
    assert not check(fmap, _edges())
    breaks, message = BROKEN[case]
    breaks(fmap)
    problems = check(fmap, _edges())
    assert any(message in p for p in problems), problems


def test_a_function_level_upward_import_fails_with_its_line(tmp_path: Path) -> None:
    pkg = tmp_path / "paravt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "types.py").write_text("def f():\n    import os\n\n\n    from paravt.train import g\n")
    (pkg / "train.py").write_text("from paravt.types import f\n\ndef g():\n    pass\n")
    fmap = FloorMap({"__init__.py": (0, "r"), "types.py": (0, "r"), "train.py": (5, "c")}, [])
    assert check(fmap, import_edges(pkg)) == [
        "paravt.types (floor 0, r, placed by types.py) imports paravt.train (floor 5, c, placed "
        "by train.py) at line 5: a module imports only from its own floor or below; move what "
        "it needs down a floor, or move the importer up and update docs/ARCHITECTURE.md"
    ]


def test_paravt_kernels_imports_no_paravt() -> None:
    bad = []
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [
                f"{path.relative_to(ROOT)}:{node.lineno} imports {n}"
                for n in names
                if n == "paravt" or n.startswith("paravt.")
            ]
    assert not bad, "paravt_kernels sits below paravt and imports none of it: " + "; ".join(bad)


def test_relative_links_in_the_docs_resolve() -> None:
    """README.md and docs/**/*.md link only to files a clone has (docs/DESIGN.md included)."""
    dead = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")):
                if not (doc.parent / target).exists():
                    dead.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not dead, "dead links (fix the path or add the file): " + "; ".join(dead)
