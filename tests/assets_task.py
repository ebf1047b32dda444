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
