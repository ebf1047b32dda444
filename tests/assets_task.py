"""The task of conftest's shared ``assets["data"]`` folder, as config overrides.

A run that names that folder as ``data.synth_dir`` passes these too: other task settings (the
default preset's) would regenerate the folder under the tests that read it. Not a test module:
tests import it by name, as pytest puts ``tests/`` on ``sys.path``.
"""

ASSETS_TASK = {
    "data.synth_task": "cue",
    "data.synth_min_duration": 40.0,
    "data.synth_max_duration": 50.0,
}

#: A rollout of the tiny model short enough for a train-loop test (~1 s a step on 2 cores):
#: two rollouts a prompt, a few tokens, one turn, K in {2, 4}.
SHORT_ROLLOUT = (
    "rollout.group_size=2",
    "rollout.max_new_tokens=6",
    "rollout.sub_max_new_tokens=4",
    "agent.max_turns=1",
    "agent.max_tool_response_tokens=8",
    "video.frame_budgets=[2,4]",
)


def on_assets(assets: dict[str, str], out: object) -> list[str]:
    """The overrides of a run on conftest's ``assets`` (their folder, its task, their tiny
    model) writing into ``out``."""
    return [
        f"data.synth_dir={assets['data']}",
        *(f"{k}={v}" for k, v in ASSETS_TASK.items()),  # that folder's own task
        "data.synth_num_videos=2",
        f"model.tiny_dir={assets['model']}",
        f"train.out_dir={out}",
    ]
