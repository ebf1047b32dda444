"""paravt.log: the one rank-aware logger (levels, rank 0 by default, the streams a message
goes to, vLLM's chatter), checked on the real logging module and a real torchrun job."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from paravt.log import ALL_RANKS, get_logger, level, quiet_libraries


def test_info_to_stdout_warnings_to_stderr_rank_zero_only(capsys, monkeypatch) -> None:
    monkeypatch.delenv("PARAVT_LOG_LEVEL", raising=False)
    log = get_logger("paravt.test_log")
    monkeypatch.setenv("RANK", "0")
    log.info("said on rank 0")
    log.warning("warned on rank 0")
    cap = capsys.readouterr()
    assert cap.out == "said on rank 0\n" and cap.err == "warned on rank 0\n"
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    log.info("not said")
    log.info("said by every rank", extra=ALL_RANKS)
    log.warning("rank 3's own trouble")  # warnings and errors: every rank's
    cap = capsys.readouterr()
    assert cap.out == "said by every rank\n" and cap.err == "rank 3's own trouble\n"
    # A RANK left in the environment with no job (no WORLD_SIZE above 1): the one process is
    # rank 0 and says its lines (issue 66 item 5d; on main it said nothing at INFO).
    monkeypatch.delenv("WORLD_SIZE")
    log.info("said by a lone process with a stray RANK")
    assert capsys.readouterr().out == "said by a lone process with a stray RANK\n"


def test_level_from_the_environment(capsys, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("PARAVT_LOG_LEVEL", "warning")
    log = get_logger("test_log_levels")  # a bare name lands under paravt. too
    assert log.name == "paravt.test_log_levels"
    log.info("quiet")
    log.warning("loud")
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err == "loud\n"
    monkeypatch.setenv("PARAVT_LOG_LEVEL", "DEBUG")
    get_logger("test_log_levels").debug("detail")
    assert capsys.readouterr().out == "detail\n"
    monkeypatch.setenv("PARAVT_LOG_LEVEL", "chatty")
    assert level() == logging.INFO
    assert "PARAVT_LOG_LEVEL='CHATTY' is not a level" in capsys.readouterr().err


def test_vllm_quiet_unless_asked(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("PARAVT_LOG_LEVEL", raising=False)
    quiet_libraries()
    import os

    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # the user's own choice stays
    quiet_libraries()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    monkeypatch.setenv("PARAVT_LOG_LEVEL", "DEBUG")  # asked for everything
    quiet_libraries()
    assert "VLLM_LOGGING_LEVEL" not in os.environ


def test_two_ranks_one_voice(tmp_path) -> None:
    """Under torchrun, rank 0's lines are said once; ALL_RANKS lines once per rank."""
    script = tmp_path / "two.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            from paravt.log import ALL_RANKS, get_logger
            log = get_logger(__name__)
            log.info("once")
            log.info(f"rank {os.environ['RANK']} here", extra=ALL_RANKS)
            """
        )
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(script)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines.count("once") == 1
    assert sorted(x for x in lines if x.endswith(" here")) == ["rank 0 here", "rank 1 here"]


@pytest.mark.parametrize("name", ["paravt.train", "paravt.checkpoint", "paravt.engines.vllm"])
def test_modules_log_through_it(name: str) -> None:
    """The modules that said things with ``print`` now say them through ``paravt``'s logger."""
    import importlib

    mod = importlib.import_module(name)
    assert mod.log.name == name
    root = logging.getLogger("paravt")
    assert any(type(h).__name__ == "_CurrentStream" for h in root.handlers)
