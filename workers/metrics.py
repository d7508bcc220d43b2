"""The workers' Prometheus metrics, defined once per process (prometheus-client's default
registry refuses a second definition of a name).

Nothing serves them yet: the /metrics endpoint (and, for prefork worker children, the
client's multiprocess mode with ``PROMETHEUS_MULTIPROC_DIR``) comes in a later issue. The
gauge already says how its per-process values combine there (``livesum``: the sum over live
processes), so that issue only has to serve them.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

MODEL_SLOTS_FAIL_OPEN = Counter(
    "djflow_model_slots_fail_open",
    "Model calls let through without counting them against their account's concurrency "
    "limit because the slots' Redis was unreachable.",
)

MODEL_CALLS_IN_FLIGHT = Gauge(
    "djflow_model_calls_in_flight",
    "Model calls in flight in this process, per account (counted in Redis or not).",
    ["account"],
    multiprocess_mode="livesum",
)
