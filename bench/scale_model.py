"""``python -m bench.scale_model``: how many worker processes, cores and how much Postgres a
given rate of steps needs, from figures ``bench.run_all`` measured (issue 17, docs/scale.md).

The model is a closed queueing network solved by mean value analysis, the textbook model of a
pool of workers each doing one step at a time:

- A step takes ``serial_ms`` of wall time in one pool process when nothing competes (the
  1-process figure of the scale-out benchmark: 1000 / its steps/s). Of it, ``cpu_ms`` is CPU
  on this machine's cores: the worker's own, the Postgres backends' and the broker's, each
  measured per step; the rest (``serial_ms - cpu_ms``) is waiting that needs no core here
  (fsync of the commits, the broker's poll interval, round trips).
- ``P`` pool processes share ``cores`` cores (a multi-server station, Seidmann's
  approximation). MVA gives the throughput of ``P`` processes; with ``P = 1`` it is
  ``1000 / serial_ms`` by construction, which is why only 2, 4 and two nodes are checks.

For a deployment (``--rate``) the parts are on machines of their own, each sized for its
share of the CPU at ``--utilisation``, with ``--rtt-ms`` more wall time per statement and
commit once Postgres is across a network:

- worker processes = rate x serial time (Little's law), worker cores = rate x worker CPU;
- Postgres cores = the larger of rate x Postgres CPU per step and rate x commits per step /
  one core's commit ceiling (``pgbench``, one-row transactions);
- broker: rate x broker CPU per step, against one Redis core (Redis runs commands on one).

What it leaves out is in docs/scale.md ("What the model leaves out").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Parameters:
    """Per-step costs and this machine's ceilings, as measured (see the module docstring)."""

    serial_ms: float  # wall ms per step, one pool process, nothing competing
    worker_cpu_ms: float  # CPU ms per step in the worker's processes
    postgres_cpu_ms: float  # CPU ms per step in the Postgres backends
    broker_cpu_ms: float  # CPU ms per step in the Redis server
    statements_per_step: float
    commits_per_step: float
    commits_per_core: float  # one-row commits/s one Postgres core sustains (pgbench)
    cores: float = 2.0  # cores of the machine the measurements were taken on

    @property
    def cpu_ms(self) -> float:
        return self.worker_cpu_ms + self.postgres_cpu_ms + self.broker_cpu_ms

    @property
    def wait_ms(self) -> float:
        """Wall time per step spent neither on this machine's cores nor queued for them."""
        return max(0.0, self.serial_ms - self.cpu_ms)


def throughput(params: Parameters, processes: int) -> float:
    """Steps/s of ``processes`` pool processes on ``params.cores`` shared cores (exact MVA
    with Seidmann's approximation for the multi-core CPU station)."""
    cores = params.cores
    queueing = params.cpu_ms / cores  # the station as one server ``cores`` times as fast
    delay = params.wait_ms + params.cpu_ms * (cores - 1) / cores
    queued = 0.0
    rate = 0.0
    for customers in range(1, processes + 1):
        residence = queueing * (1 + queued)
        rate = customers / (residence + delay)  # steps per ms
        queued = rate * residence
    return rate * 1000


@dataclass(frozen=True)
class Check:
    label: str
    processes: int
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted - self.measured) / self.measured


def checks(params: Parameters, measured: Sequence[tuple[str, int, float]]) -> list[Check]:
    """Predicted beside measured steps/s for each (label, processes, measured)."""
    return [
        Check(label, processes, throughput(params, processes), rate)
        for label, processes, rate in measured
    ]


@dataclass(frozen=True)
class Sizing:
    """What ``rate`` steps/s needs, the parts on machines of their own."""

    rate: float
    worker_processes: int
    worker_cores: float
    postgres_cores: float
    postgres_bound: str  # "CPU" or "commits": which estimate sized Postgres
    commits_per_second: float
    statements_per_second: float
    broker_core_share: float  # of one Redis core
    notes: list[str] = field(default_factory=list)


def size(
    params: Parameters, rate: float, *, utilisation: float = 0.7, rtt_ms: float = 0.0
) -> Sizing:
    """The worker processes and cores, Postgres cores and broker share for ``rate`` steps/s,
    each part kept at ``utilisation`` of what it has; ``rtt_ms`` is the network round trip
    each statement and commit adds when Postgres is on another machine."""
    serial_ms = params.serial_ms + rtt_ms * (params.statements_per_step + params.commits_per_step)
    processes = math.ceil(rate * serial_ms / 1000 / utilisation)
    worker_cores = rate * params.worker_cpu_ms / 1000 / utilisation
    by_cpu = rate * params.postgres_cpu_ms / 1000 / utilisation
    commits = rate * params.commits_per_step
    by_commits = commits / params.commits_per_core / utilisation
    broker = rate * params.broker_cpu_ms / 1000
    notes = []
    if broker > utilisation:
        notes.append(
            f"one Redis would be {broker:.0%} busy: shard the queues over "
            f"{math.ceil(broker / utilisation)} brokers, or RabbitMQ (several cores)"
        )
    return Sizing(
        rate=rate,
        worker_processes=processes,
        worker_cores=worker_cores,
        postgres_cores=max(by_cpu, by_commits),
        postgres_bound="CPU" if by_cpu >= by_commits else "commits",
        commits_per_second=commits,
        statements_per_second=rate * params.statements_per_step,
        broker_core_share=broker,
        notes=notes,
    )


def format_checks(rows: Sequence[Check]) -> str:
    lines = ["shape | processes | predicted steps/s | measured steps/s | error"]
    for row in rows:
        lines.append(
            f"{row.label} | {row.processes} | {row.predicted:,.0f} | {row.measured:,.0f} | "
            f"{row.error:+.0%}"
        )
    return "\n".join(lines)


def format_sizing(rows: Sequence[Sizing]) -> str:
    lines = [
        "steps/s | worker processes | worker cores | Postgres cores (bound) | commits/s | "
        "statements/s | Redis core"
    ]
    for row in rows:
        lines.append(
            f"{row.rate:,.0f} | {row.worker_processes:,} | {row.worker_cores:.1f} | "
            f"{row.postgres_cores:.1f} ({row.postgres_bound}) | {row.commits_per_second:,.0f} | "
            f"{row.statements_per_second:,.0f} | {row.broker_core_share:.0%}"
        )
        lines += [f"  {note}" for note in row.notes]
    return "\n".join(lines)


def from_measurements(data: dict) -> tuple[Parameters, list[tuple[str, int, float]]]:
    """The parameters and the scale-out figures from ``bench.run_all --json``'s file.

    The 1-process point gives the wall time of a step (``serial_ms``); the CPU per step is the
    median over every shape (a step's work does not depend on how many processes share the
    cores, and the Redis server is shared with whatever else runs on the machine, so one
    shape's figure can be another's load). Only throughputs are predicted, and the 1-process
    one is the calibration: the others are the check."""
    points = data["scale_out"]
    one = next(p for p in points if p["nodes"] == 1 and p["concurrency"] == 1)
    counts = data["counts"]

    def median(key: str) -> float:
        return statistics.median(p[key] for p in points)

    params = Parameters(
        serial_ms=1000 / one["engine"],
        worker_cpu_ms=median("worker_cpu_ms"),
        postgres_cpu_ms=median("postgres_cpu_ms"),
        broker_cpu_ms=median("redis_cpu_ms"),
        statements_per_step=counts["statements_per_step"],
        commits_per_step=counts["commits_per_step"],
        commits_per_core=data["ceiling"]["commits_per_core"],
        cores=data.get("cores", 2.0),
    )
    measured = [
        (_label(p), p["nodes"] * p["concurrency"], p["engine"])
        for p in points
        if (p["nodes"], p["concurrency"]) != (1, 1)
    ]
    return params, measured


def _label(point: dict) -> str:
    if point["nodes"] == 1:
        return f"1 node x {point['concurrency']}"
    return f"{point['nodes']} nodes x {point['concurrency']}"


def report(
    params: Parameters,
    measured: Sequence[tuple[str, int, float]],
    shape: str = "",
    **sizing: float,
) -> str:
    parts = [
        "parameters: " + ", ".join(f"{k} {v:,.2f}" for k, v in asdict(params).items()),
        f"  CPU per step on this machine {params.cpu_ms:.2f} ms, waiting {params.wait_ms:.2f} ms",
        "",
        f"this machine, predicted beside measured{f' ({shape})' if shape else ''}:",
        format_checks(checks(params, measured)),
        "",
        "a deployment, each part on machines of its own:",
        format_sizing([size(params, rate, **sizing) for rate in (1_000, 10_000)]),
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale_model", description=__doc__)
    parser.add_argument(
        "measurements", type=Path, help="the JSON file `python -m bench.run_all --json` wrote"
    )
    parser.add_argument("--utilisation", type=float, default=0.7)
    parser.add_argument(
        "--rtt-ms", type=float, default=0.0, help="round trip to Postgres per statement"
    )
    parser.add_argument(
        "--cores",
        type=float,
        help="cores the measured processes had (default: the machine's); on a machine shared "
        "with other work, fewer",
    )
    args = parser.parse_args(argv)
    data = json.loads(args.measurements.read_text())
    params, measured = from_measurements(data)
    if args.cores is not None:
        params = dataclasses.replace(params, cores=args.cores)
    print(
        report(params, measured, shape_of(data), utilisation=args.utilisation, rtt_ms=args.rtt_ms)
    )


def shape_of(data: dict) -> str:
    """``runs x steps`` of the scale-out figures."""
    point = data["scale_out"][0]
    return f"{point['runs']} runs x {point['steps']} steps" if "runs" in point else ""


if __name__ == "__main__":
    main()
