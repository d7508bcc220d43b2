"""Which handlers workers serve: the heartbeats workers write, and what is asked of them
("does a live worker serve handler h on queue q?", "which steps of this document does none
serve?").

A worker is live while it has not stopped and its last heartbeat is at most
``WORKER_LIVE_BEATS`` beats old (``WORKER_HEARTBEAT_SECONDS`` each). A step's handler is
served when a worker has it in its registry and consumes the step's queue: a worker on other
queues never receives the step's message.

Two questions, two answers (CONTRACT sections 5 and 14):

- "served now" (a live worker serves it): what the engine asks before it waits for a worker
  (``runs.engine.unservable``), what the admin warns about when a document is saved, and
  what a start reports as the run's wait;
- "served within the window" (a worker, live or not, served it within ``UNSERVABLE_SECONDS``
  of now): what a start needs. A start is never refused because workers are restarting: the
  run waits for the worker, and fails as ``unservable`` if none comes within the window; 400
  is for a handler no worker has served in it. A worker that stopped cleanly served until its
  stop (``heartbeat_stop`` writes it as its ``last_seen``); one gone quiet (killed), until its
  last beat.

The table holds one row per worker node, a handful in practice: rows are read whole and
filtered here, since SQLite (the embedded default) has no JSON containment lookup.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from . import kinds
from .errors import FieldError
from .models import WorkerHeartbeat
from .registry import step_handler
from .validation import field_path

DEFAULT_QUEUE = "default"


@dataclass(frozen=True)
class StepHandler:
    """A step that needs a worker: where it is in the document, its handler and queue."""

    field: str
    step_id: str
    handler: str
    queue: str


def step_handlers(document: Mapping[str, Any]) -> list[StepHandler]:
    """Every ``task`` and ``agent`` step of a valid document, nested ones included, with
    the handler it is looked up by (its ``handler``, else ``<workflow id>.<step id>``)."""
    workflow_id = str(document.get("id", ""))
    found = []
    # The kinds whose body is a handler a worker must have.
    handler_kinds = kinds.handler_kinds()
    walked = [
        *walk_steps(document.get("steps", []), ["steps"]),
        *walk_steps(document.get("on_failure", []), ["on_failure"]),
    ]
    for path, step in walked:
        if step.get("kind") in handler_kinds:
            found.append(
                StepHandler(
                    field=field_path([*path, "handler"]),
                    step_id=step["id"],
                    handler=step_handler(workflow_id, step["id"], step.get("handler")),
                    queue=step.get("queue") or DEFAULT_QUEUE,
                )
            )
    return found


def walk_steps(steps: Any, path: list[str | int]) -> Iterator[tuple[list[str | int], Any]]:
    """Every step of ``steps`` (a list, or one step), nested ones included, with its path
    (``["steps", 2, "do"]``)."""
    if isinstance(steps, Mapping):  # a body of one step: ``"do": {...}``
        yield from _step_and_inside(steps, path)
        return
    if not isinstance(steps, Sequence):
        return
    for index, step in enumerate(steps):
        if isinstance(step, Mapping):
            yield from _step_and_inside(step, [*path, index])


def _step_and_inside(
    step: Mapping[str, Any], path: list[str | int]
) -> Iterator[tuple[list[str | int], Any]]:
    yield path, step
    for name in ("then", "else", "do"):
        if name in step:
            yield from walk_steps(step[name], [*path, name])
    branches = step.get("branches")
    if isinstance(branches, Mapping):
        for name, body in branches.items():
            yield from walk_steps(body, [*path, "branches", name])


def live_since(now: datetime) -> datetime:
    """The oldest ``last_seen`` a live worker may have."""
    tunables = settings.DJFLOW
    return now - timedelta(
        seconds=tunables["WORKER_HEARTBEAT_SECONDS"] * tunables["WORKER_LIVE_BEATS"]
    )


def workers_seen(*, since: datetime) -> list[WorkerHeartbeat]:
    """Workers whose last heartbeat is at or after ``since`` (stopped ones included: they
    were serving until then)."""
    return list(WorkerHeartbeat.objects.filter(last_seen__gte=since))


def is_live(worker: WorkerHeartbeat, now: datetime) -> bool:
    """Not stopped, and seen within ``WORKER_LIVE_BEATS`` beats of ``now``."""
    return worker.stopped_at is None and worker.last_seen >= live_since(now)


def workers_live(*, now: datetime | None = None) -> list[WorkerHeartbeat]:
    now = now or timezone.now()
    return [w for w in workers_seen(since=live_since(now)) if is_live(w, now)]


def window_since(now: datetime) -> datetime:
    """The oldest ``last_seen`` of a worker that served within ``UNSERVABLE_SECONDS`` of
    ``now``."""
    return now - timedelta(seconds=settings.DJFLOW["UNSERVABLE_SECONDS"])


def served_in_window(worker: WorkerHeartbeat, now: datetime) -> bool:
    """Live, or seen (a stopped worker: until its stop) within ``UNSERVABLE_SECONDS`` of
    ``now``. Live counts even when the window is shorter than the liveness span."""
    return is_live(worker, now) or worker.last_seen >= window_since(now)


def _read_since(now: datetime) -> datetime:
    """The oldest ``last_seen`` either question needs: one read answers both."""
    return min(live_since(now), window_since(now))


def workers_in_window(*, now: datetime | None = None) -> list[WorkerHeartbeat]:
    """Workers that served within ``UNSERVABLE_SECONDS`` of ``now`` (live ones included)."""
    now = now or timezone.now()
    return [w for w in workers_seen(since=_read_since(now)) if served_in_window(w, now)]


def served_under(prefix: str, *, now: datetime | None = None) -> list[str]:
    """The handlers workers served within ``UNSERVABLE_SECONDS`` whose names start with
    ``prefix``, sorted. The window, not liveness: a workflow's handlers stay the
    deployment's while its workers restart."""
    found = {
        name
        for worker in workers_in_window(now=now)
        for name in worker.handlers
        if name.startswith(prefix)
    }
    return sorted(found)


def serves(worker: WorkerHeartbeat, handler: str, queue: str) -> bool:
    return handler in worker.handlers and queue in worker.queues


def handler_served(
    *, handler: str, queue: str, since: datetime | None = None, now: datetime | None = None
) -> bool:
    """True when a live worker serves ``handler`` on ``queue``; with ``since``, when any
    worker that serves it was seen at or after ``since``, live now or not."""
    workers = workers_live(now=now) if since is None else workers_seen(since=since)
    return any(serves(worker, handler, queue) for worker in workers)


def unserved_message(step: StepHandler, workers: list[WorkerHeartbeat]) -> str:
    """Why no live worker takes the step: nobody has the handler, or nobody who has it
    consumes the step's queue."""
    what = f"no live worker serves handler '{step.handler}' (step '{step.step_id}')"
    if any(step.handler in worker.handlers for worker in workers):
        return (
            f"{what} on queue '{step.queue}'; start a worker that imports it and consumes "
            f"that queue (-Q {step.queue})"
        )
    return f"{what}; start a worker that imports it (WORKFLOW_MODULES)"


Judge = Callable[[WorkerHeartbeat, datetime], bool]


def unserved_steps(
    *,
    document: Mapping[str, Any],
    now: datetime | None = None,
    workers: list[WorkerHeartbeat] | None = None,
    judge: Judge = is_live,
) -> list[tuple[StepHandler, str]]:
    """The steps of ``document`` no worker serves, each with why: by default no live one
    (``judge``: :func:`served_in_window` asks for none within the window). One query, none
    when ``workers``, the heartbeats to judge by, are given."""
    wanted = step_handlers(document)
    if not wanted:
        return []
    now = now or timezone.now()
    if workers is None:
        workers = workers_seen(since=_read_since(now))
    judged = [worker for worker in workers if judge(worker, now)]
    return [
        (step, unserved_message(step, judged))
        for step in wanted
        if not any(serves(worker, step.handler, step.queue) for worker in judged)
    ]


# The pre-flight of every start asked the table which workers serve: one query per start,
# for rows that change once a beat. A process keeps what it read for LIVE_READ_SECONDS and
# takes only a "served" from it: a worker that stopped (or went quiet) that recently still
# counts, as it would have for a start made that much earlier; a step the rows kept do not
# serve is asked of the table again, so a worker that has just started serves at once. One
# read (back to the older of the liveness span and the window) answers both questions.
LIVE_READ_SECONDS = 1.0
_clock = time.monotonic
_live_read: tuple[float, list[WorkerHeartbeat]] | None = None


def forget_live_read() -> None:
    """Drop the kept read (a heartbeat written or stopped in this process; tests)."""
    global _live_read
    _live_read = None


def _unserved_kept(document: Mapping[str, Any], judge: Judge) -> list[tuple[StepHandler, str]]:
    """:func:`unserved_steps` over the kept read while it is fresh and says served; read
    again otherwise."""
    global _live_read
    if not step_handlers(document):
        return []
    now = timezone.now()
    kept = _live_read
    fresh = kept is not None and _clock() - kept[0] < LIVE_READ_SECONDS
    if (
        fresh
        and kept is not None
        and not unserved_steps(document=document, now=now, workers=kept[1], judge=judge)
    ):
        return []
    read_at = _clock()
    workers = workers_seen(since=_read_since(now))
    _live_read = (read_at, workers)
    return unserved_steps(document=document, now=now, workers=workers, judge=judge)


def unserved_errors(*, document: Mapping[str, Any]) -> list[FieldError]:
    """The steps of ``document`` no worker has served within ``UNSERVABLE_SECONDS``, in the
    contract's error shape: each names the step's ``handler`` field. What a start refuses
    (the pre-flight's); a step some worker served in the window is accepted, and waits."""
    found = _unserved_kept(document, served_in_window)
    return [FieldError(step.field, why) for step, why in found]


def unlive_steps(*, document: Mapping[str, Any]) -> list[StepHandler]:
    """The steps of ``document`` no live worker serves now. After :func:`unserved_errors`
    in the same start it costs no query when every step is served (the kept read)."""
    return [step for step, _ in _unserved_kept(document, is_live)]


def waiting_message(step: StepHandler) -> str:
    """What a start of a step no live worker serves, but one served within the window,
    is told: it is accepted, and waits."""
    window = settings.DJFLOW["UNSERVABLE_SECONDS"]
    return (
        f"no live worker serves handler '{step.handler}' (step '{step.step_id}') on queue "
        f"'{step.queue}' now, but one did within the last {window:g} s: a run is accepted "
        f"and waits for a worker, and the step fails as unservable if none serves it within "
        f"{window:g} s"
    )


# --- writes (the worker's main process, workers.heartbeat) -------------------------------


def heartbeat_record(
    *,
    hostname: str,
    handlers: Sequence[str],
    queues: Sequence[str],
    pid: int | None,
    started_at: datetime,
    now: datetime | None = None,
) -> None:
    """Say that ``hostname`` serves ``handlers`` on ``queues`` as of now. One statement,
    idempotent: a node started again under the same name takes its row over."""
    forget_live_read()
    WorkerHeartbeat.objects.update_or_create(
        hostname=hostname,
        defaults={
            "handlers": sorted(handlers),
            "queues": sorted(queues),
            "pid": pid,
            "started_at": started_at,
            "last_seen": now or timezone.now(),
            "stopped_at": None,
        },
    )


def heartbeat_stop(*, hostname: str, now: datetime | None = None) -> None:
    """A clean shutdown: the worker serves nothing from now on. The row is kept (with its
    last ``last_seen``) so that the unservable window knows it served until then."""
    now = now or timezone.now()
    forget_live_read()
    WorkerHeartbeat.objects.filter(hostname=hostname).update(last_seen=now, stopped_at=now)


def heartbeat_prune(*, older_than: datetime) -> int:
    """Forget workers not seen since ``older_than`` (node names with pids pile up)."""
    return WorkerHeartbeat.objects.filter(last_seen__lt=older_than).delete()[0]
