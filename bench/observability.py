"""``python -m bench.observability``: what metrics and tracing cost per step (issue 16).

The engine's sequential and concurrent figures of ``bench.run_all`` (the same no-op
workflows, worker ``-P prefork -c 2``, timed from the journal), each on a worker started with
observability off (``DJFLOW_METRICS=false``, no ``OTEL_EXPORTER_OTLP_ENDPOINT``) and on (metrics,
and traces exported over OTLP/HTTP to a sink in this process that answers as a collector
does), with and without a span per SQL query (``DJFLOW_TRACE_QUERIES``). The configurations
take turns round after round, so a machine that gets slower during the sitting slows them
alike; the median of ``--repeat`` rounds is printed with its ratio to "off".
"""

from __future__ import annotations

import argparse
import statistics
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench import common


class _Sink(BaseHTTPRequestHandler):
    """Takes OTLP/HTTP exports (``POST /v1/traces``, protobuf) and answers 200, as a
    collector does; counts the bytes, to show that spans did arrive."""

    received = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        with _Sink.lock:
            _Sink.received += length
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def otlp_sink() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.observability", description=__doc__)
    parser.add_argument(
        "--steps", type=int, default=200, help="steps of the sequential run (bench.flows: 5 or 200)"
    )
    parser.add_argument("--runs", type=int, default=16, help="concurrent runs (of --steps)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the median")
    args = parser.parse_args(argv)

    common.configure()
    from bench import engine  # after configure(): it reads Django's settings

    with otlp_sink() as endpoint:
        configurations = {
            "off": {"DJFLOW_METRICS": "false"},
            "metrics": {"DJFLOW_METRICS": "true"},
            "metrics + traces": {
                "DJFLOW_METRICS": "true",
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                "DJFLOW_TRACE_QUERIES": "false",
            },
            "metrics + traces + queries": {
                "DJFLOW_METRICS": "true",
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                "DJFLOW_TRACE_QUERIES": "true",
            },
        }
        sequential: dict[str, list[float]] = {name: [] for name in configurations}
        concurrent: dict[str, list[float]] = {name: [] for name in configurations}
        for round_ in range(args.repeat):
            for name, env in configurations.items():
                with common.running_worker(
                    workflow_modules=engine.WORKFLOW_MODULES, env=env
                ) as worker:
                    engine.engine_sequential(5)  # warm the pool
                    sequential[name].append(engine.engine_sequential(args.steps))
                    concurrent[name].append(engine.engine_throughput(args.runs, args.steps, worker))
                print(
                    f"round {round_ + 1} {name}: {sequential[name][-1]:.2f} ms/step, "
                    f"{concurrent[name][-1]:.0f} steps/s",
                    flush=True,
                )
        print(f"OTLP bytes received by the sink: {_Sink.received:,}")

    base_seq = statistics.median(sequential["off"])
    base_conc = statistics.median(concurrent["off"])
    print(
        f"median of {args.repeat}; worker -P prefork -c 2; "
        f"{args.steps} sequential steps, {args.runs}x{args.steps} concurrent"
    )
    print("| configuration | ms/step | vs off | steps/s | vs off |")
    print("|---|---|---|---|---|")
    for name in configurations:
        seq = statistics.median(sequential[name])
        conc = statistics.median(concurrent[name])
        print(
            f"| {name} | {seq:.2f} | {seq / base_seq:.2f}x | {conc:.0f} | {conc / base_conc:.2f}x |"
        )


if __name__ == "__main__":
    main()
