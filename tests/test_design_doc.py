"""docs/DESIGN.md and docs/ARCHITECTURE.md name only modules and files that exist (issue 64
item 6: DESIGN.md had gone on naming ``paravt/rollout`` for the engines long after it moved).

Checked: every path under a top-level folder of the checkout (``paravt/…``, ``kernels/…``,
``tests/…``, ``bench/…``, ``scripts/…``, ``configs/…``, ``csrc/…``, ``docs/…``); every
``python -m paravt.x`` command and backticked ``paravt.x.y`` name (its module part: a name
past the first module is an attribute and is not checked); every backticked ``pkg/x.py``
relative to ``paravt/``; and every entry of DESIGN.md's "Layout" tree. A placeholder such as
``<op>_reference.py`` is skipped, and so are the names of work in flight (``IN_FLIGHT``:
delete an entry once its branch has merged, or the name if the plan changed).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "docs" / "DESIGN.md", ROOT / "docs" / "ARCHITECTURE.md"]
TOP = ("paravt", "kernels", "tests", "bench", "scripts", "configs", "csrc", "docs")

# Work in flight that the docs name before its branch merges (none now).
IN_FLIGHT: set[str] = set()
# Names that stand for any module (ARCHITECTURE.md's "`pkg/__init__.py` is that one module").
PLACEHOLDERS = {"pkg/__init__.py"}


def _exists(rel: str) -> bool:
    rel = rel.rstrip(".,;:")
    if "<" in rel or "*" in rel or rel in IN_FLIGHT or rel in PLACEHOLDERS:
        return True
    return (ROOT / rel).exists()


def _module_exists(dotted: str) -> bool:
    """``paravt.a.b.c``: ``paravt/a`` a package or ``paravt/a.py`` a module, and so on until a
    module is found (what follows it is an attribute)."""
    if dotted in IN_FLIGHT:
        return True
    parts = dotted.split(".")
    here = ROOT / parts[0]
    for name in parts[1:]:
        if name == "_C":  # the extension, built by `make ext`
            return True
        if (here / name).is_dir():
            here = here / name
        elif (here / f"{name}.py").is_file():
            return True
        else:
            return False
    return True


def _layout_entries(text: str) -> list[str]:
    """``top/name`` for each entry of the "## Layout" section's tree (the names that begin a
    line indented by two spaces under a ``top/`` line)."""
    m = re.search(r"^## Layout\n.*?^```\n(.*?)^```", text, re.M | re.S)
    if not m:
        return []
    out, top = [], ""
    for line in m.group(1).splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            first = line.split()[0]
            top = first if first.endswith("/") else ""
            continue
        if not top or line.startswith("   "):  # an entry is indented 2; more: its text goes on
            continue
        for tok in line.split()[:3]:  # "assets.py validate.py  the run's inputs ..."
            if tok.endswith((".py", "/")):
                out.append(top + tok)
            else:
                break
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_design_docs_name_only_what_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = []
    pat = rf"(?<![\w./-])((?:{'|'.join(TOP)})/[\w./<>*-]*)"
    missing += [p for p in re.findall(pat, text) if not _exists(p)]
    for dotted in re.findall(r"(?<![\w.])(paravt(?:\.\w+)+)", text):
        if not _module_exists(dotted):
            missing.append(dotted)
    for code in re.findall(r"`([^`\s]+)`", text):
        if re.fullmatch(r"[a-z_]+/[\w/]*\w\.py", code) and code.split("/")[0] not in TOP:
            if not (_exists(f"paravt/{code}") or _exists(code)):
                missing.append(code)
    if doc.name == "DESIGN.md":
        entries = _layout_entries(text)
        assert len(entries) > 30, "the Layout tree was not read"
        missing += [e for e in entries if not _exists(e)]
    assert not missing, f"{doc.name} names what does not exist: {sorted(set(missing))}"


def test_the_layout_tree_names_every_top_level_module() -> None:
    """A module or package added to paravt/ gets a line in DESIGN.md's Layout tree."""
    entries = set(_layout_entries((ROOT / "docs" / "DESIGN.md").read_text()))
    have = {
        f"paravt/{p.name}" + ("/" if p.is_dir() else "")
        for p in (ROOT / "paravt").iterdir()
        if (p.suffix == ".py" and p.name not in ("__init__.py", "_compat.py"))
        or (p.is_dir() and (p / "__init__.py").exists())
    }
    assert not have - entries, f"not in DESIGN.md's Layout: {sorted(have - entries)}"
