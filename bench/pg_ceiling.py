"""``python -m bench.pg_ceiling``: how many one-row commits a second this Postgres takes.

``pgbench`` (Postgres's own client, in C, so the client costs little) runs a script of one
``INSERT`` of one row, each its own transaction (a commit, a WAL flush), for ``--seconds``
from 1 client and from several. The table (``bench_commit``) is created in the bench
database (``DJFLOW_BENCH_DATABASE_URL``) and emptied afterwards. The several-client figure,
divided by the machine's cores, is the model's commit ceiling per core (``bench.scale_model``):
a low estimate, since pgbench's own CPU is on the same cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from urllib.parse import urlsplit

from bench import common

SCRIPT = "INSERT INTO bench_commit (payload) VALUES ('x');\n"


def _psql_args(url: str) -> list[str]:
    parts = urlsplit(url)
    return [
        "-h",
        parts.hostname or "127.0.0.1",
        "-p",
        str(parts.port or 5432),
        "-U",
        parts.username or "postgres",
        parts.path.lstrip("/"),
    ]


def commits_per_second(url: str, clients: int, seconds: int) -> float:
    """One-row commits/s from ``clients`` pgbench connections (``-j`` = clients)."""
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as script:
        script.write(SCRIPT)
        script.flush()
        done = subprocess.run(
            [
                "pgbench",
                "-n",
                "-f",
                script.name,
                "-c",
                str(clients),
                "-j",
                str(clients),
                "-T",
                str(seconds),
                *_psql_args(url),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    found = re.search(r"tps = ([0-9.]+)", done.stdout)
    if found is None:
        raise RuntimeError(f"no tps in pgbench's output:\n{done.stdout}\n{done.stderr}")
    return float(found.group(1))


def measure(
    url: str = common.DATABASE_URL, clients: tuple[int, ...] = (1, 8), seconds: int = 10
) -> dict[str, float] | None:
    """``{"clients_1": ..., "clients_8": ..., "commits_per_core": ...}``, or None without
    pgbench on ``PATH``."""
    if shutil.which("pgbench") is None:
        return None
    import psycopg

    common.create_database(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_commit "
            "(id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now(), payload text)"
        )
        settings = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]
            for name in ("fsync", "synchronous_commit", "wal_sync_method", "commit_delay")
        }
    try:
        figures: dict[str, float] = {
            f"clients_{n}": commits_per_second(url, n, seconds) for n in clients
        }
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS bench_commit")
    cores = os.cpu_count() or 1
    figures["commits_per_core"] = max(figures.values()) / cores
    figures["cores"] = cores
    print(
        "Postgres one-row commits/s (pgbench): "
        + ", ".join(
            f"{n} client{'s' if n > 1 else ''} {figures[f'clients_{n}']:,.0f}" for n in clients
        )
        + f"; {', '.join(f'{k} {v}' for k, v in settings.items())}",
        flush=True,
    )
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pg_ceiling", description=__doc__)
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--seconds", type=int, default=10)
    args = parser.parse_args(argv)
    measure(clients=tuple(int(n) for n in args.clients.split(",")), seconds=args.seconds)


if __name__ == "__main__":
    main()
