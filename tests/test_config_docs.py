"""docs/config.md and ``--help``: every configuration key is documented by the comment lines
above its field in ``paravt/config.py`` (``paravt.config.field_docs``), docs/config.md is
what ``python -m paravt.config --markdown`` prints from them, and ``python -m paravt.train
--help`` lists the keys a researcher with their own data, tools and cluster sets."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from paravt.config import Config, config_markdown, field_docs, load_config, to_dict

ROOT = Path(__file__).resolve().parents[1]
CONFIG_PY = ROOT / "paravt" / "config.py"


def _keys(d: dict, prefix: str = "") -> list[str]:
    """Every leaf key of a nested dict, dotted (the oracle: the resolved config itself)."""
    out = []
    for k, v in d.items():
        out += _keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


def test_every_key_has_a_comment() -> None:
    """Each key of the config has comment lines of its own directly above its field; no key
    is missing, none is made up (the oracle: the resolved config's own keys)."""
    docs = field_docs()
    assert [k for k in docs if "[]." not in k] == _keys(to_dict(Config()))
    undocumented = [k for k, doc in docs.items() if not doc]
    assert not undocumented, (
        f"{undocumented}: write comment lines directly above each of these fields in "
        "paravt/config.py (what it does, its unit, what 0 or '' means), then regenerate "
        "docs/config.md: python -m paravt.config --markdown > docs/config.md"
    )
    assert docs["train.wandb"] == (
        "Log to Weights & Biases as well (needs wandb installed and configured)."
    )
    assert docs["reward.extra_terms[].weight"] == "Its weight in R (R += weight * value)."
    assert docs["agent.max_tool_response_tokens"] == (  # two lines, joined
        "Each tool response's content (a summary or an error) is cut to this many tokens, "
        "ending with a visible ' [truncated]' marker."
    )


def test_a_key_without_a_comment_is_found() -> None:
    """The check above can fail: a field whose comment is deleted reads as undocumented, even
    right under another field (whose comment is not taken for its own)."""
    text = CONFIG_PY.read_text()
    for key, line in (
        ("train.wandb", "Log to Weights & Biases as well (needs wandb installed and configured)."),
        ("train.eval_samples", "Samples per held-out prompt and condition."),
    ):
        gone = text.replace(f"    # {line}\n", "", 1)
        assert gone != text, line
        docs = field_docs(gone)
        assert docs[key] == "" and sum(not d for d in docs.values()) == 1, key


def test_docs_config_md_is_current() -> None:
    """docs/config.md is exactly what the generator prints today (a stale page fails)."""
    page = (ROOT / "docs" / "config.md").read_text()
    assert page == config_markdown(), (
        "docs/config.md is stale: run python -m paravt.config --markdown > docs/config.md"
    )
    # One row per key, with its defaults under both presets as load_config resolves them.
    tiny = load_config("tiny_cpu")
    assert f"| `train.steps` | `{tiny.train.steps}` | `300` |" in page
    assert "| `model.path` | `''` | `(required)` |" in page
    assert "| `agent.think_prefix` | `<think>\\n` |" in page  # code: the tag stays text
    assert "counts as an opened &lt;think&gt;" in page  # prose: escaped, not an HTML tag
    rows = re.findall(r"^\| `([\w.\[\]]+)` \|", page, re.M)
    assert rows == list(field_docs())
    assert "(no comment" not in page


def test_the_generator_command_prints_the_page() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "paravt.config", "--markdown"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == config_markdown() and "RuntimeWarning" not in out.stderr


def test_train_help_lists_the_plug_in_data_eval_and_logging_keys(capsys) -> None:
    from paravt.train import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for key in (
        "agent.tools",
        "reward.extra_terms",
        "sft.data",
        "train.eval_prompts",
        "train.eval_samples",
        "train.eval_conditions",
        "train.eval_every",
        "train.wandb",
    ):
        assert re.search(rf"^  {re.escape(key)} +\S+ +\S+ +\S", text, re.M), key
    assert "docs/config.md" in text
