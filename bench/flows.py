"""No-op workflows for the engine's half of the benchmark (loaded by the bench worker)."""

from __future__ import annotations

from typing import Any

from workflows.sdk import handler, workflow

NOOP = "bench.noop"
# 10, 200 and 2,000 steps: the per-step cost must not grow with the journal (issue 17);
# one step: what bench.starts starts.
SHAPES = (1, 5, 10, 200, 2000)


@handler(NOOP)
def noop(ctx: Any, input: Any, prior: Any) -> None:
    return None


def _sequence(steps: int) -> None:
    flow = workflow(
        f"bench_seq_{steps}",
        limits={"run_timeout_ms": 3_600_000, "max_steps": max(1000, steps * 2)},
    )
    for n in range(steps):
        flow.task(f"s{n}", handler=NOOP)


for _steps in SHAPES:
    _sequence(_steps)
