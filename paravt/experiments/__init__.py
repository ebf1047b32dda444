"""The PARA-GRPO experiments: ``python -m paravt.experiments ablation|collapse ...``.

- ``arms``: the arms (``key=value`` overrides of the config), the one arms × seeds driver
  (``run_arms``: every arm × seed one ``python -m paravt.train`` run, kept, resumed or redone
  on a rerun), run stamps, the folder lock, the signal-forwarding launcher;
- ``ablation``: every arm from one SFT checkpoint, the paper-style table;
- ``collapse``: does vanilla GRPO lose tool use, and does PARA-GRPO keep it (its own cold
  start, held-out evaluation every ``train.eval_every`` steps, the tool-vs-no-tool advantage);
- ``report``: the collapse's typed result (``CollapseResult``, ``collapse.json`` through
  ``to_dict``/``from_dict``), its statistics, pre-registered bars, ``collapse.md`` and
  ``collapse.png``;
- ``phase``: the collapse's phase diagram over (u, q) from finished collapse folders;
- ``tool_path``: where a spot answer comes from in ``paravt.eval`` results (crops, summaries,
  the copy into the answer);
- ``cli``: the command line (``__main__`` runs it).

There is no training loop here: each arm run is ``paravt.train``'s.
"""

from paravt.experiments.ablation import aggregate
from paravt.experiments.cli import main

__all__ = ["aggregate", "main"]
