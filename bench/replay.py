"""Seconds to replay a recorded 100-step run (issue 38's goal: under 2 s): ``manage.py
run_replay FILE`` as a user runs it, one process per replay, and the replay alone in process.

    .venv/bin/python -m bench.replay --repeat 5

The run (tests/runs/flows_replay.py's ``rp_chain``: 100 recipe steps, each a model call) is
made and exported in a private database of this process (``config.replay.private_database``:
SQLite, nothing of the deployment's is touched), by the engine in process with the model
answered by the fixture's stub. Printed: the median of ``--repeat`` command runs (wall time,
the interpreter's and Django's start included), the first run's (which migrates the template
database when none is kept yet), the replay alone (load, fork, run, compare), and the floor of
any command (``manage.py check``'s wall time) for scale.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import django

PROJECT = Path(__file__).resolve().parent.parent


def _command(*args: str, env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=PROJECT, env=env, capture_output=True, text=True
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"manage.py {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="(the chain has 100)")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(PROJECT))
    django.setup()

    from config import replay
    from config.inprocess import installed
    from runs import export
    from tests.runs.flows_replay import chain

    with tempfile.TemporaryDirectory(prefix="djflow-bench-replay-") as folder:
        path = Path(folder) / "chain.json"
        with replay.private_database(), installed() as engine:
            engine.model(reply="fine")
            run = engine.start(chain, input={"q": "how"})
            assert run.status == "completed", run.error
            steps = len(run.steps)
            path.write_text("".join(export.run_export(run_id=run.id).chunks()))
            # The replay alone, in this process (a second private database inside this one
            # would be the same file again: the recording is loaded afresh each time).
        alone = []
        for _ in range(args.repeat):
            with replay.private_database():
                started = time.perf_counter()
                result = replay.replay(replay.read_export(path), replay.Options())
                from runs.compare import compare

                compare(result.source, result.replayed, user=None, limits=None)
                alone.append(time.perf_counter() - started)
                assert result.code == replay.EXIT_SAME, result.misses
        env = dict(os.environ)
        fresh = {**env, "DJFLOW_VAR_DIR": str(Path(folder) / "var")}
        first = _command("run_replay", str(path), env=fresh)
        runs = [_command("run_replay", str(path), env=env) for _ in range(args.repeat)]
        floor = statistics.median(_command("check", env=env) for _ in range(3))
        size = path.stat().st_size
    median = statistics.median(runs)
    print(f"recorded run: {steps} attempts, export {size:,} bytes")
    print(f"run_replay (command, wall): median {median:.2f} s over {args.repeat} (goal < 2 s)")
    print(f"run_replay first run (template database migrated): {first:.2f} s")
    print(f"replay alone in process: median {statistics.median(alone):.2f} s")
    print(f"floor: manage.py check {floor:.2f} s; run_replay is {median / floor:.1f}x of it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
