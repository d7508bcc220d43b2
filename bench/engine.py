"""The engine's half of issue 3's benchmark: TODO, by the engine's author.

Each function runs against the worker ``bench.run_all`` started (the same worker, broker and
settings as the bare-Celery figures; add the workflow modules it needs to
``WORKFLOW_MODULES``) and times the work from the journal (the first step's start to the last
step's finish in Postgres), never from a client waiting on results.
"""

from __future__ import annotations

# Dotted modules defining the no-op workflows below; the bench worker saves their documents.
WORKFLOW_MODULES: list[str] = []


def engine_sequential(steps: int) -> float:
    """Milliseconds per step of one run of ``steps`` sequential no-op ``task`` steps."""
    raise NotImplementedError("TODO: the engine side of the sequential benchmark")


def engine_throughput(runs: int, steps: int) -> float:
    """Steps per second of ``runs`` concurrent runs of ``steps`` no-op steps, first step's
    start to last step's finish."""
    raise NotImplementedError("TODO: the engine side of the throughput benchmark")
