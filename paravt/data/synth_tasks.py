"""The synthetic tasks' names and the shortest video each allows: what a config is checked
against before anything heavy loads (``paravt.data.synth``, which generates the tasks, imports
av and torch; it checks the same through :func:`synth_task_error`)."""

from __future__ import annotations

# The synthetic tasks (paravt.data.synth) and the shortest video each allows, in seconds: the
# cue window alone is 20-30 s; a spot square lasts 4-6 s; "spot_late" places a 4-6 s square in
# the first half and may follow it with a brief one; "spot_decoy" is "spot" with a decoy colour
# in the frames of the K = 32 overview.
SYNTH_TASK_MIN_SECONDS = {"cue": 30.0, "spot": 10.0, "spot_late": 20.0, "spot_decoy": 10.0}


def synth_task_error(task: str, min_duration: float, max_duration: float) -> str | None:
    """Why ``task`` with these video durations cannot be generated, or None."""
    if task not in SYNTH_TASK_MIN_SECONDS:
        return f"task '{task}' is not one of {'|'.join(SYNTH_TASK_MIN_SECONDS)}"
    floor = SYNTH_TASK_MIN_SECONDS[task]
    if not floor <= min_duration <= max_duration:
        return (
            f"need {floor:g} <= min_duration ({min_duration}) <= max_duration ({max_duration}) "
            f"seconds for task '{task}'"
        )
    return None


def synth_config_errors(task: str, min_duration: float, max_duration: float) -> list[str]:
    """``data.synth_task`` / ``data.synth_min_duration`` / ``data.synth_max_duration`` checked
    (``paravt.config.DataConfig.validate``): the messages name the config keys."""
    if task not in SYNTH_TASK_MIN_SECONDS:
        return [f"data.synth_task='{task}' is not one of {'|'.join(SYNTH_TASK_MIN_SECONDS)}"]
    if err := synth_task_error(task, min_duration, max_duration):
        return [
            f"data.synth_min_duration={min_duration} / synth_max_duration={max_duration}: {err}"
        ]
    return []
