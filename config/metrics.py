"""``GET /metrics``: every process's counters and histograms, added up, and the gauges that are
facts of the database and the broker, read at scrape time.

The counters are written by the processes that see the facts (a worker's pool child records
an attempt, whichever process ends a run counts its end: ``runs.metrics``) into files under
``DJFLOW_METRICS_DIR`` (``config.metrics_files``); this view adds up every file there. The
gauges below are read from the database and the broker on each scrape instead of being kept
up to date by each process: one bounded query each, on an index (only unfinished runs are
counted by status: the finished ones are ``djflow_workflow_executions_total``). A source that
fails is logged and its gauges left out, and ``djflow_scrape_error{source}`` says so: a scrape
never fails because the broker is down.

Access: with ``DJFLOW_METRICS_TOKEN`` set, ``Authorization: Bearer <token>`` (compared in
constant time), else 401. Unset, the endpoint answers only on the embedded default, to a
client on this machine with no proxy in front, and 403 elsewhere: the labels name workflows
and accounts, and an operator who never set a token must not publish them by deploying.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import Count, Min
from django.http import Http404, HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_safe
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from approvals.models import ApprovalRequest
from approvals.status import ApprovalStatus
from config import metrics_files
from runs.engine.costs import period_start
from runs.models import Account, Run, StepRun, Timer
from runs.status import RUN_TERMINAL, RunStatus, StepStatus

logger = logging.getLogger(__name__)

# Queues a scrape reads the depth of beyond the configured ones (steps may name their own):
# the most distinct queues of scheduled attempts it looks at.
MAX_STEP_QUEUES = 50
UNFINISHED = [status for status in RunStatus.values if status not in RUN_TERMINAL]


@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    if not settings.DJFLOW_METRICS_ENABLED:
        raise Http404("metrics are turned off (DJFLOW_METRICS=false)")
    refused = _refused(request)
    if refused is not None:
        return refused
    # Text format 0.0.4, which every Prometheus reads (the client's newest, 1.0.0, is the
    # same text for these names but older servers do not know its version).
    return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_PLAIN_0_0_4)


def registry() -> CollectorRegistry:
    """A registry for one scrape: the processes' files, the database, the broker."""
    scrape = CollectorRegistry(auto_describe=False)
    errors: dict[str, int] = {}
    # Registered in this order, collected in it: the errors are known by the last.
    for collector in (
        FilesCollector(),
        DatabaseCollector(errors),
        BrokerCollector(errors),
        ScrapeErrors(errors),
    ):
        scrape.register(collector)
    return scrape


def _refused(request: HttpRequest) -> HttpResponse | None:
    token = settings.DJFLOW_METRICS_TOKEN
    if token:
        scheme, _, given = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            return None
        return HttpResponse(
            "a bearer token is required (DJFLOW_METRICS_TOKEN)\n",
            status=401,
            content_type="text/plain",
            headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
        )
    if (
        settings.EMBEDDED
        and not settings.DJFLOW_TRUSTED_PROXIES
        and not _forwarded(request)
        and _loopback(request)
    ):
        return None
    return HttpResponse(
        "set DJFLOW_METRICS_TOKEN to serve metrics here (without it they are served only on "
        "the embedded default, to this machine)\n",
        status=403,
        content_type="text/plain",
    )


def _forwarded(request: HttpRequest) -> bool:
    """A request a proxy passed on, though none is declared (DJFLOW_TRUSTED_PROXIES 0): from a
    reverse proxy on this machine every request comes from loopback, whoever sent it."""
    return any(
        name in request.META
        for name in ("HTTP_X_FORWARDED_FOR", "HTTP_FORWARDED", "HTTP_X_REAL_IP", "HTTP_VIA")
    )


def _loopback(request: HttpRequest) -> bool:
    try:
        return ipaddress.ip_address(request.META.get("REMOTE_ADDR") or "").is_loopback
    except ValueError:
        return False


# Listings of the metric files a scrape reads at most, each after a file vanished from the
# one before (see FilesCollector.collect).
SCRAPE_TRIES = 5


class FilesCollector(Collector):
    """What every process counted, from the files under DJFLOW_METRICS_DIR."""

    def collect(self) -> Iterator[Metric]:
        tunables = settings.DJFLOW
        # A host's workers are live while their last beat is this recent (workflows.heartbeats).
        window = tunables["WORKER_HEARTBEAT_SECONDS"] * tunables["WORKER_LIVE_BEATS"]
        root = Path(settings.DJFLOW_METRICS_DIR)
        for tries_left in range(SCRAPE_TRIES - 1, -1, -1):
            files = metrics_files.files_to_read(root, live_window=window)
            try:
                merged = MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]
            except FileNotFoundError:
                # A file listed was removed before it was read (a master's start removes the
                # files of its host's processes that are gone; a child's end its live
                # gauges): list again, rather than answer the scrape with a 500.
                if not tries_left:
                    raise
                continue
            yield from merged
            return


class _SourceCollector(Collector):
    """Gauges read from one source; a failure is logged and noted in ``errors``."""

    source = ""

    def __init__(self, errors: dict[str, int]) -> None:
        self.errors = errors

    def collect(self) -> Iterator[Metric]:
        try:
            families = list(self._families())
        except Exception:
            logger.warning("metrics: reading the %s failed", self.source, exc_info=True)
            self.errors[self.source] = 1
            return
        self.errors[self.source] = 0
        yield from families

    def _families(self) -> Iterator[Metric]:
        raise NotImplementedError


class ScrapeErrors(Collector):
    def __init__(self, errors: dict[str, int]) -> None:
        self.errors = errors

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "djflow_scrape_error",
            "1 when this scrape could not read a source (database, broker): its gauges are "
            "left out.",
            labels=["source"],
        )
        for source, value in sorted(self.errors.items()):
            family.add_metric([source], value)
        yield family


class DatabaseCollector(_SourceCollector):
    """Unfinished runs by status, timers due and how late the oldest is, approvals pending."""

    source = "database"

    def _families(self) -> Iterator[Metric]:
        now = timezone.now()
        runs = GaugeMetricFamily(
            "djflow_runs",
            "Runs not finished yet, by status (run_status_newest).",
            labels=["status"],
        )
        counted = dict(
            Run.objects.filter(status__in=UNFINISHED)
            .order_by()
            .values_list("status")
            .annotate(n=Count("id"))
            .values_list("status", "n")
        )
        for status in UNFINISHED:
            runs.add_metric([status], counted.get(status, 0))
        yield runs
        queued = GaugeMetricFamily(
            "djflow_runs_waiting_for_slot",
            "Runs waiting pending for a concurrency slot of their key, by workflow "
            "(run_slot_queue).",
            labels=["workflow"],
        )
        for workflow_id, n in (
            Run.objects.filter(
                status=RunStatus.PENDING, concurrency_key__isnull=False, admitted_at__isnull=True
            )
            .order_by()
            .values_list("workflow_id")
            .annotate(n=Count("id"))
            .values_list("workflow_id", "n")
        ):
            queued.add_metric([workflow_id], n)
        yield queued
        due = Timer.objects.filter(fired_at__isnull=True, fire_at__lte=now).aggregate(
            n=Count("id"), oldest=Min("fire_at")
        )
        yield GaugeMetricFamily(
            "djflow_timers_due", "Timers past their time and not fired yet.", value=due["n"]
        )
        lag = (now - due["oldest"]).total_seconds() if due["oldest"] else 0.0
        yield GaugeMetricFamily(
            "djflow_timer_lag_seconds",
            "How late the oldest due timer is: a clock (beat, the timers queue) falling behind.",
            value=lag,
        )
        pending = ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING).count()
        yield GaugeMetricFamily(
            "djflow_approvals_pending", "Approval requests waiting for a decision.", value=pending
        )
        yield from _accounts(now)


def _accounts(now: Any) -> Iterator[Metric]:
    """Each account with a row (an operator set its budget: few, so a bounded label): its
    budget, and what it spent and holds in its current period (CONTRACT section 17)."""
    budget = GaugeMetricFamily(
        "djflow_account_budget_usd",
        "An account's budget per period (USD); accounts with no cap are left out.",
        labels=["account"],
    )
    spent = GaugeMetricFamily(
        "djflow_account_spent_usd",
        "What an account's settled model calls cost in its current period (USD).",
        labels=["account"],
    )
    reserved = GaugeMetricFamily(
        "djflow_account_reserved_usd",
        "The worst cases of an account's model calls in flight (USD).",
        labels=["account"],
    )
    rows = Account.objects.order_by("name").values_list(
        "name", "budget_usd", "period", "period_start", "spent_usd", "reserved_usd"
    )
    for name, cap, period, started, used, held in rows:
        if cap is not None:
            budget.add_metric([name], float(cap))
        # A period that ended since the row was last written spent nothing yet: the engine
        # resets the count at the account's next reservation.
        current = period_start(period, now)
        spent.add_metric([name], 0.0 if current is not None and started < current else float(used))
        reserved.add_metric([name], float(held))
    yield budget
    yield spent
    yield reserved


class BrokerCollector(_SourceCollector):
    """Messages waiting in each queue: the configured ones and those scheduled steps name."""

    source = "broker"

    def _families(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "djflow_queue_depth", "Messages waiting in a broker queue.", labels=["queue"]
        )
        for name, depth in sorted(self._depths().items()):
            family.add_metric([name], depth)
        yield family

    def _depths(self) -> dict[str, int]:
        from config.celery import app

        names = {queue.name for queue in settings.CELERY_TASK_QUEUES}
        names |= set(
            StepRun.objects.filter(status=StepStatus.SCHEDULED)
            .order_by()
            .values_list("queue", flat=True)
            .distinct()[:MAX_STEP_QUEUES]
        )
        depths: dict[str, int] = {}
        with app.connection_for_read() as connection:
            connection.ensure_connection(max_retries=1)
            channel: Any = connection.channel()  # kombu's channels are untyped
            try:
                for name in sorted(names):
                    try:
                        depths[name] = channel.queue_declare(queue=name, passive=True)[1]
                    except connection.channel_errors:
                        # No such queue (Redis has none while it is empty; RabbitMQ's answer
                        # closes the channel): nothing waits in it.
                        depths[name] = 0
                        channel = connection.channel()
            finally:
                channel.close()
        return depths
