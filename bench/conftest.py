"""Benchmarks import transformers' processors: import paravt first (see ``paravt._compat``)."""

import paravt  # noqa: F401
