"""The type check (issue 64 item 6): ``make typecheck`` runs mypy over the modules that
``[tool.mypy]`` in ``pyproject.toml`` names, and ``make lint`` and ``make test`` (CI's
``.ci/run``) run it first, so a type error there fails CI.

What these tests prove: the Makefile wires ``typecheck`` into ``lint`` and ``test`` and runs
mypy with no arguments (the configuration's own file list); that list holds the step, the
run and the rollout sources, every entry a file that exists; mypy is installed and pinned in
``requirements.txt`` as in the ``dev`` extra; and mypy under the project's configuration
rejects a type error and a stale ``# type: ignore`` (a small file of its own, standard
library only: a few seconds). What they do not: run the whole check (``make typecheck`` does,
before the suite, ~15 s of CPU cold).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The modules the issue asks the check to cover, at least.
REQUIRED = set(
    """paravt/train.py paravt/run.py paravt/trainer.py paravt/rollout_source.py
paravt/step_stats.py paravt/workers/pipeline.py""".split()
)


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _prerequisites(makefile: str, target: str) -> list[str]:
    m = re.search(rf"^{target}:([^\n]*)$", makefile, re.M)
    assert m, f"no '{target}:' rule in the Makefile"
    return m.group(1).split()


def test_make_lint_and_test_run_the_type_check() -> None:
    mk = (ROOT / "Makefile").read_text()
    assert "typecheck" in _prerequisites(mk, "lint")
    assert "typecheck" in _prerequisites(mk, "test")
    recipe = re.search(r"^typecheck:[^\n]*\n((?:\t[^\n]*\n)+)", mk, re.M)
    assert recipe, "no 'typecheck:' rule with a recipe in the Makefile"
    assert recipe.group(1).strip() == "$(VENV)/bin/mypy"  # the configuration's own files
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_configuration_covers_the_step_and_names_real_files() -> None:
    project = _pyproject()
    cfg = project["tool"]["mypy"]
    files = cfg["files"]
    assert REQUIRED <= set(files), sorted(REQUIRED - set(files))
    assert [f for f in files if not (ROOT / f).exists()] == []  # a module or a package
    assert cfg["follow_imports"] == "silent" and cfg["ignore_missing_imports"] is True
    pin = re.search(r"^mypy==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M)
    assert pin, "mypy is not pinned in requirements.txt (make install installs from it)"
    assert f"mypy=={pin.group(1)}" in project["project"]["optional-dependencies"]["dev"]


def test_mypy_with_the_projects_configuration_rejects_a_type_error(tmp_path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from __future__ import annotations\n\n\n"
        "def half(n: int) -> int:\n"
        "    return n // 2\n\n\n"
        'x: int = half("4")\n'
        "y = half(4)  # type: ignore[arg-type]\n"
    )
    ok = tmp_path / "ok.py"
    ok.write_text("def half(n: int) -> int:\n    return n // 2\n")
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    cmd += ["--cache-dir", str(tmp_path / "cache")]
    p = subprocess.run([*cmd, str(bad)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert 'Argument 1 to "half" has incompatible type "str"' in p.stdout, p.stdout
    assert 'Unused "type: ignore" comment' in p.stdout, p.stdout  # warn_unused_ignores
    p = subprocess.run([*cmd, str(ok)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
