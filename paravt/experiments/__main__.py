"""``python -m paravt.experiments ablation|collapse ...`` (``paravt.experiments.cli.main``)."""

from paravt.experiments.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
