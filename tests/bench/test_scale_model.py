"""The scale model (bench/scale_model.py): mean value analysis and the sizing arithmetic."""

from __future__ import annotations

import pytest

from bench.scale_model import Parameters, from_measurements, size, throughput


def params(**overrides: float) -> Parameters:
    values = {
        "serial_ms": 5.0,
        "worker_cpu_ms": 3.0,
        "postgres_cpu_ms": 1.0,
        "broker_cpu_ms": 0.5,
        "statements_per_step": 6.0,
        "commits_per_step": 2.0,
        "commits_per_core": 2500.0,
        "cores": 2.0,
    }
    values.update(overrides)
    return Parameters(**values)  # type: ignore[arg-type]


def test_one_process_runs_one_step_per_serial_time() -> None:
    assert throughput(params(), 1) == pytest.approx(1000 / 5.0)


def test_throughput_grows_with_processes_and_never_passes_the_cores() -> None:
    p = params()
    rates = [throughput(p, n) for n in (1, 2, 4, 8, 64)]
    assert rates == sorted(rates)
    ceiling = p.cores * 1000 / p.cpu_ms  # 2 cores / 4.5 ms of CPU per step
    assert rates[-1] == pytest.approx(ceiling, rel=0.01)
    assert all(rate <= ceiling + 1e-9 for rate in rates)


def test_waiting_without_cpu_is_what_more_processes_hide() -> None:
    # All CPU: a second process on one core adds nothing.
    assert throughput(params(serial_ms=4.5, cores=1.0), 2) == pytest.approx(1000 / 4.5)
    # Mostly waiting: two processes nearly double it.
    waiting = params(serial_ms=40.0)
    assert throughput(waiting, 2) > 1.9 * throughput(waiting, 1)


def test_sizing_follows_littles_law_and_the_cpu_per_step() -> None:
    sized = size(params(), 1000, utilisation=0.5)
    assert sized.worker_processes == 10  # 1,000/s x 5 ms = 5 busy, at half utilisation
    assert sized.worker_cores == pytest.approx(6.0)
    assert sized.commits_per_second == pytest.approx(2000)
    assert sized.statements_per_second == pytest.approx(6000)
    # Postgres: 1 ms CPU x 1,000/s = 1 core, / 0.5 = 2; commits 2,000 / 2,500 / 0.5 = 1.6.
    assert sized.postgres_cores == pytest.approx(2.0)
    assert sized.postgres_bound == "CPU"
    assert sized.broker_core_share == pytest.approx(0.5)
    assert sized.notes == []


def test_a_commit_bound_postgres_and_a_busy_broker_are_named() -> None:
    sized = size(params(commits_per_core=500.0), 10_000, utilisation=0.7)
    assert sized.postgres_bound == "commits"
    assert sized.postgres_cores == pytest.approx(10_000 * 2 / 500 / 0.7)
    assert "shard the queues" in sized.notes[0]


def test_a_network_round_trip_per_statement_lengthens_each_step() -> None:
    near = size(params(), 1000, utilisation=1.0)
    far = size(params(), 1000, utilisation=1.0, rtt_ms=0.5)
    # 8 round trips (6 statements, 2 commits) of 0.5 ms: 4 ms more per step, 4 more processes.
    assert far.worker_processes - near.worker_processes == 4


def test_the_one_process_point_calibrates_and_the_others_are_checked() -> None:
    point = {"worker_cpu_ms": 3.0, "postgres_cpu_ms": 1.0, "redis_cpu_ms": 0.5}
    data = {
        "cores": 2,
        "scale_out": [
            {"nodes": 1, "concurrency": 1, "engine": 200.0, **point},
            {"nodes": 1, "concurrency": 2, "engine": 380.0, **point},
            {"nodes": 2, "concurrency": 2, "engine": 420.0, **point},
        ],
        "counts": {"statements_per_step": 6.0, "commits_per_step": 2.0},
        "ceiling": {"commits_per_core": 2500.0},
    }
    p, measured = from_measurements(data)
    assert p.serial_ms == pytest.approx(5.0)
    assert p.broker_cpu_ms == 0.5
    assert measured == [("1 node x 2", 2, 380.0), ("2 nodes x 2", 4, 420.0)]
