"""No-op workflows for the engine's half of the benchmark (loaded by the bench worker)."""

from __future__ import annotations

from typing import Any

from workflows.sdk import handler, workflow

NOOP = "bench.noop"
SHAPES = (5, 200)


@handler(NOOP)
def noop(ctx: Any, input: Any, prior: Any) -> None:
    return None


def _sequence(steps: int) -> None:
    flow = workflow(f"bench_seq_{steps}", limits={"run_timeout_ms": 3_600_000})
    for n in range(steps):
        flow.task(f"s{n}", handler=NOOP)


for _steps in SHAPES:
    _sequence(_steps)
