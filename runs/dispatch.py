"""Messages the engine sends: always after commit, always ids only.

Every message may arrive twice, late or never; the receiving task is idempotent and the
reconciler finds what a lost message left behind.

Tasks are sent by name, through the current Celery app: the dispatcher imports neither the
tasks it sends (the worker's ``workers.tasks`` is above ``runs``; ``runs.tasks`` imports the
engine, which imports this module) nor ``config.celery``. A process that has not imported a
task's module sends it with Celery's ``send_task``, which knows none of the task's declared
options: each message names what the task declares for its sender (``ignore_result``), and
the queue comes from the message (an attempt's queue) or ``CELERY_TASK_ROUTES`` (the engine's
tasks), as it did when the task objects were imported.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import current_app
from celery.utils import uuid
from django.conf import settings
from django.db import transaction

logger = logging.getLogger(__name__)

# Names as the tasks declare them (runs.tasks, workers.tasks).
ADVANCE = "runs.advance"
EXECUTE_STEP = "workers.execute_step"
ADVANCE_RUNS = "workers.advance_runs"
DELIVER_NOTIFICATION = "workers.deliver_notification"
WAKE_TIMERS = "runs.wake_timers"
END_TREE = "runs.end_tree"


# A run's priority when nothing says otherwise (POST /runs's default).
DEFAULT_PRIORITY = 5


def broker_priority(priority: int | None) -> int:
    """The broker's priority for a run's ``priority`` (0 lowest to 9 highest).

    RabbitMQ (queues declared with ``x-max-priority``, ``CELERY_TASK_QUEUE_MAX_PRIORITY``)
    delivers higher first, as the run's scale reads. kombu's Redis transport keeps one list
    per priority step and pops the lowest number first (0 is its highest): the scale is
    turned over. The file-system transport of the embedded default ignores priority."""
    value = DEFAULT_PRIORITY if priority is None else min(max(int(priority), 0), 9)
    return 9 - value if _reversed() else value


def _reversed() -> bool:
    url = str(current_app.conf.broker_url or "")
    return url.startswith(("redis://", "rediss://", "redis+socket://", "sentinel://"))


def priority_of(step_run: Any) -> int | None:
    """The priority of the attempt's run when the row was loaded with its run (the applier's
    rows, ``select_related``): no query for it. None otherwise (the default is sent)."""
    cached = getattr(getattr(step_run, "_state", None), "fields_cache", {}).get("run")
    return getattr(cached, "priority", None)


def _advance_signature(run_id: Any, priority: int | None = None, **options: Any) -> Any:
    return current_app.signature(
        ADVANCE, (str(run_id),), priority=broker_priority(priority), **options
    )


def advance_on_commit(run_id: Any, *, priority: int | None = None) -> None:
    """An advance of the run after commit, sent with the run's ``priority`` when the caller
    has it (the default otherwise)."""
    # robust: a broker outage must not turn a committed change into an error; the
    # reconciler advances a run that stays quiet with nothing in flight.
    transaction.on_commit(
        lambda: _advance_signature(run_id, priority, ignore_result=True).apply_async(),
        robust=True,
    )


def revoke_on_commit(task_ids: Iterable[str]) -> None:
    ids = [t for t in task_ids if t]
    if not ids:
        return

    def revoke() -> None:
        try:
            current_app.control.revoke(ids)
        except Exception:  # best-effort: the attempt is already cancelled in the journal
            logger.warning("could not revoke tasks %s", ids, exc_info=True)

    transaction.on_commit(revoke)


def offer_on_commit(step_run: Any, *, workflow_id: str) -> None:
    """Offer an attempt to a worker on the step's queue once the transaction commits.

    The task id was chosen and stored with the attempt, so an operator can revoke it. The
    message shows in Flower as ``workers.execute_step`` (it may run the run's next steps
    too); each step it runs shows as ``<workflow>.<step>`` (``workers.task_events``).
    """
    # robust: if the broker is down the attempt stays scheduled and the reconciler offers it again.
    transaction.on_commit(lambda: offer(step_run, workflow_id=workflow_id), robust=True)


def offer_later_on_commit(step_run: Any, *, workflow_id: str, seconds: float) -> None:
    """Offer an attempt again ``seconds`` after the transaction commits (a countdown: fine for
    seconds; the reconciler offers it again should the message be lost)."""
    transaction.on_commit(
        lambda: _execute_signature(step_run).apply_async(countdown=seconds), robust=True
    )


def offer(step_run: Any, *, workflow_id: str) -> None:
    """Send the attempt's message now (the caller has committed the attempt)."""
    _execute_signature(step_run).apply_async()


def _execute_signature(step_run: Any, **options: Any) -> Any:
    # The step's own limit is a SIGALRM in the worker (workers.execution). Celery's limits
    # are the backstop, set past it by the time a worker may spend running the run's next
    # steps in the same task.
    soft = step_run.timeout_ms / 1000 + settings.DJFLOW["INLINE_SECONDS"]
    defaults = _execute_options(
        queue=step_run.queue, soft_limit=soft, priority=broker_priority(priority_of(step_run))
    )
    return current_app.signature(
        EXECUTE_STEP,
        (step_run.id,),
        task_id=step_run.celery_task_id,
        **{**defaults, **options},
    )


def _execute_options(
    *, queue: str | None, soft_limit: float | None, priority: int | None
) -> dict[str, Any]:
    """An ``execute_step`` message's options: no result, its queue, the broker's priority,
    Celery's soft limit and the hard one 10 s after it."""
    options: dict[str, Any] = {"ignore_result": True}
    if queue:
        options["queue"] = queue
    if priority is not None:
        options["priority"] = priority
    if soft_limit is not None:
        options.update(soft_time_limit=soft_limit, time_limit=soft_limit + 10)
    return options


# The most attempts one execute_step message carries: the worker takes no more from one
# (workers.batches.bounded), whatever DJFLOW_FAN_OUT_PER_MESSAGE says.
MAX_PER_MESSAGE = 100


def offer_fan_out_on_commit(step_runs: list[Any], *, run_id: Any, workflow_id: str) -> None:
    """Offer attempts fanned out together (parallel branches, foreach items) once the
    transaction commits, as one Celery chord: its header the attempts' ``execute_step``
    messages, ``FAN_OUT_PER_MESSAGE`` attempts to a message (attempts of one queue, time
    limit and priority), its body ``runs.advance`` of the run (:func:`fan_in_body`).

    The task that receives a message runs its attempts one after another, each claimed on
    its own, and offers the rest to other workers as soon as one runs long
    (``workers.batches``): Celery's cycle per message was most of a short item's cost, and a
    chord's part of it (the result backend counting each header task) is paid once a
    message, not once an attempt.

    The chord is a notification, never the fan-in (DESIGN rule 5): the fan-in is the
    journal's. A success inside a fan-out asks for an advance when, after its commit,
    nothing else of the run is in flight, and a failure asks at once
    (``workers.execution._record_inside``); should that ask be lost with its worker, the
    reconciler advances a run left with nothing in flight. So a body that never fires (a
    header task lost, a message handed on by ``workers.batches``, the result backend
    restarted), fires twice (a header task redelivered) or fires early (a header task that
    handed its rest on returns before those attempts end) changes no result; the body, sent
    ``fan_in=True``, plans only when nothing of the run is in flight any more
    (``runs.engine.advance.run_fan_in``), so the early ones cost one index probe.

    Without a result backend that can count a chord (``CELERY_RESULT_BACKEND`` unset, or
    ``rpc://``), or with ``DJFLOW["FAN_OUT_CHORDS"]`` off, the same messages go without
    the chord, through one producer in one publish batch.
    """
    per_message = min(max(1, int(settings.DJFLOW["FAN_OUT_PER_MESSAGE"])), MAX_PER_MESSAGE)
    alike: dict[tuple[Any, ...], list[Any]] = {}
    for step_run in step_runs:
        key = (step_run.queue, step_run.timeout_ms, priority_of(step_run))
        alike.setdefault(key, []).append(step_run)
    messages = [
        rows[start : start + per_message]
        for rows in alike.values()
        for start in range(0, len(rows), per_message)
    ]
    priority = priority_of(step_runs[0]) if step_runs else None

    def send() -> None:
        header = None
        if settings.DJFLOW["FAN_OUT_CHORDS"] and messages and _chords_kept():
            try:
                header = _chord_header(messages, fan_in_body(run_id, priority))
            except NotImplementedError:
                # The result backend keeps no chord (Celery's DisabledBackend, rpc://): it
                # refuses before any header message is sent.
                _warn_no_chords()
            except Exception:
                # The result backend is down (after a try or two: CELERY_RESULT_BACKEND's
                # retry policy in the settings): the chord is a nudge, the attempts must go.
                logger.warning("fan-out of run %s sent without its chord", run_id, exc_info=True)
        if header is None:
            _send_plain(messages)
        else:
            _publish(header)

    # robust: should the broker be down, the attempts stay scheduled and the reconciler
    # offers them again one by one.
    transaction.on_commit(send, robust=True)


def fan_in_body(run_id: Any, priority: int | None) -> Any:
    """A fan-out chord's body: ``runs.advance`` of the run, at its priority, ignoring the
    header's results (``immutable``) and keeping none of its own. ``fan_in=True``: it
    plans only once nothing of the run is in flight (see :func:`offer_fan_out_on_commit`)."""
    return current_app.signature(
        ADVANCE,
        (str(run_id),),
        {"fan_in": True},
        immutable=True,
        ignore_result=True,
        priority=broker_priority(priority),
    )


def _header_signature(together: list[Any], *, keep_result: bool) -> Any:
    more = [step_run.id for step_run in together[1:]]
    return _execute_signature(
        together[0], kwargs={"more": more} if more else {}, ignore_result=not keep_result
    )


def _chord_header(messages: list[list[Any]], body: Any) -> list[Any]:
    """The header of one chord of ``messages`` (each a list of attempts) and ``body``, on
    Celery's own chord machinery: each header message frozen as a part of the chord (its
    group id, index and the body it carries), and the result backend told of the chord (its
    size on Redis, ``apply_chord`` elsewhere); in the worker, the backend counts the parts as
    they return (``on_chord_part_return``) and calls the body. The caller publishes them.

    What ``chord.apply_async`` does, but for one thing. Upstream bug: on a Redis result
    backend Celery subscribes the sending process to every header task's result channel
    (a ``GroupResult`` waits on its members through a promise each, and
    ``group.apply_async`` adds them to a barrier: one SUBSCRIBE a header task, and an
    UNSUBSCRIBE when the result object is dropped), though no header task here stores a
    result and nothing reads one (https://github.com/celery/celery/issues/3808, open;
    https://github.com/celery/celery/issues/4824, open). So no result object of the header
    is made here, and its messages go through one producer in one publish batch (a pipeline
    on Redis), as they went before they were a chord.

    On Redis results the backend counts each header task as it returns (one script call)
    whether or not the task stores its result, so header tasks store none. Any other
    backend (the embedded default's SQLAlchemy one) has no counter: Celery's
    ``celery.chord_unlock`` task polls the header's stored results, so they keep them, and
    it polls for at most ``FAN_OUT_CHORD_UNLOCK_SECONDS``: a header task that never stores
    a success (one lost with its worker, or handed back for want of a handler: Celery
    stores its retry, and the attempt goes on in a message of its own) would keep it
    polling, every second, for good.
    """
    app = current_app
    backend = app.backend
    counts = _counts_chords(backend)
    group_id = uuid()
    header = [_header_signature(together, keep_result=not counts) for together in messages]
    body.freeze(group_id=group_id)
    for index, signature in enumerate(header):
        signature.freeze(group_id=group_id, chord=body, group_index=index)
    # Before any part is sent, so that a part that returns finds the size to count against.
    if counts:
        # Redis's apply_chord only saves a header of nested groups (ours is flat), and would
        # build the GroupResult that subscribes (above).
        backend.set_chord_size(group_id, len(header))
    else:
        # Refuses (NotImplementedError) when the backend cannot keep a chord; else starts
        # celery.chord_unlock, which polls the parts' results and calls the body.
        interval = float(app.conf.result_chord_retry_interval or 1.0)
        results = [app.AsyncResult(signature.id) for signature in header]
        backend.apply_chord(
            (group_id, results),
            body,
            interval=interval,
            max_retries=max(
                1, math.ceil(settings.DJFLOW["FAN_OUT_CHORD_UNLOCK_SECONDS"] / interval)
            ),
        )
    return header


def _publish(header: list[Any]) -> None:
    with current_app.producer_or_acquire() as producer, producer.batch():
        for signature in header:
            signature.apply_async(producer=producer, add_to_parent=False)


def _chords_kept() -> bool:
    """Whether the result backend can gather a chord whose parts run on any worker: not a
    SQLite file outside the embedded default (each host would count in a file of its own,
    and chord_unlock on one would wait for results stored on another)."""
    if settings.EMBEDDED:
        return True
    url = str(getattr(current_app.backend, "url", "") or "")
    if url.startswith("sqlite"):  # the SQLAlchemy backend's URL, without its db+
        _warn_no_chords()
        return False
    return True


def _counts_chords(backend: Any) -> bool:
    """Whether the result backend counts a chord's parts itself (Redis, Sentinel)."""
    from celery.backends.redis import RedisBackend

    return isinstance(backend, RedisBackend)


def _send_plain(messages: list[list[Any]]) -> None:
    # One producer, and on Redis one pipeline per thousand messages (kombu's publish
    # batch; other transports publish each at once): sending is one round trip per
    # message otherwise, and the fan-out is sent by a pool process that has items to run.
    with current_app.producer_or_acquire() as producer, producer.batch():
        for together in messages:
            _header_signature(together, keep_result=False).apply_async(producer=producer)


_warned_no_chords = False


def _warn_no_chords() -> None:
    global _warned_no_chords
    if not _warned_no_chords:
        _warned_no_chords = True
        logger.warning(
            "the result backend (%s) cannot gather a chord: fan-outs go as plain messages "
            "(their fan-in is the journal's either way). Set CELERY_RESULT_BACKEND to the "
            "Redis that all workers share (README: Configuration)",
            current_app.conf.result_backend,
        )


def offer_ids(
    step_run_ids: list[int],
    *,
    queue: str | None,
    soft_limit: float | None,
    priority: int | None,
    together: bool = False,
) -> None:
    """Offer attempts of a message that its task did not run (``workers.batches``): one
    message each, so that free workers take them at once, or ``together`` in one (a worker
    without their handler hands them on). ``priority`` is the broker's, as the message came;
    the time limits are the message's. The attempts stay scheduled whatever happens here:
    a message lost is made up by the reconciler."""
    if not step_run_ids:
        return
    options = _execute_options(queue=queue, soft_limit=soft_limit, priority=priority)
    with current_app.producer_or_acquire() as producer:
        if together:
            first, *more = step_run_ids
            current_app.signature(
                EXECUTE_STEP, (first,), kwargs={"more": more} if more else {}, **options
            ).apply_async(producer=producer)
            return
        for step_run_id in step_run_ids:
            current_app.signature(EXECUTE_STEP, (step_run_id,), **options).apply_async(
                producer=producer
            )


def offer_now(step_run: Any, *, workflow_id: str) -> None:
    """Send the attempt's message now (the caller has committed the attempt). A broker
    outage is logged, not raised: the attempt stays scheduled and the reconciler offers it
    again after ``LOST_MESSAGE_SECONDS``."""
    try:
        offer(step_run, workflow_id=workflow_id)
    except Exception:
        logger.warning("could not offer attempt %s", step_run.id, exc_info=True)


def advance_now(run_id: Any) -> None:
    """Send an ``advance`` message now (nothing to wait for: the caller has committed).
    A broker outage is logged, not raised: the reconciler advances the run later."""
    try:
        _advance_signature(run_id, ignore_result=True).apply_async()
    except Exception:
        logger.warning("could not send advance for run %s", run_id, exc_info=True)


def advance_many(run_ids: list[Any]) -> None:
    """Send ``advance`` messages for many runs through one producer (acquiring one per
    message cost about half a second per thousand). A broker outage is logged, not raised:
    the reconciler advances the runs left behind."""
    try:
        with current_app.producer_or_acquire() as producer:
            for run_id in run_ids:
                _advance_signature(run_id, ignore_result=True).apply_async(producer=producer)
    except Exception:
        logger.warning("could not send advance for %d runs", len(run_ids), exc_info=True)


def advance_in_batches(run_ids: list[Any], *, size: int) -> None:
    """Send ``advance_runs`` messages of at most ``size`` runs each (the timer tick's fired
    runs), through one producer: a worker advances each run and runs its next step itself
    when it serves it (workers.execution.advance_and_execute), so a resumed run costs a
    share of one message rather than an ``advance`` and an ``execute_step``. A broker outage
    is logged, not raised; a lost message, like a lost ``advance``, leaves runs that the
    reconciler advances (a fired timer's run with nothing in flight)."""
    try:
        with current_app.producer_or_acquire() as producer:
            for start in range(0, len(run_ids), size):
                chunk = [str(run_id) for run_id in run_ids[start : start + size]]
                current_app.signature(ADVANCE_RUNS, (chunk,), ignore_result=True).apply_async(
                    producer=producer
                )
    except Exception:
        logger.warning("could not send advance for %d runs", len(run_ids), exc_info=True)


def notify_on_commit(delivery_ids: list[int], *, countdown: float | None = None) -> None:
    """Offer run-end webhooks (``runs.models.NotifyDelivery`` rows) to a worker once the
    transaction commits, ``countdown`` seconds later when given (a retry's back-off; the
    row's ``due_at`` is the durable time, and the reconciler offers a row whose message was
    lost)."""

    def send() -> None:
        with current_app.producer_or_acquire() as producer:
            for delivery_id in delivery_ids:
                current_app.signature(
                    DELIVER_NOTIFICATION, (delivery_id,), ignore_result=True
                ).apply_async(producer=producer, countdown=countdown)

    # robust: a broker outage leaves the rows pending; the reconciler offers them again.
    transaction.on_commit(send, robust=True)


def end_tree_on_commit(root_id: Any) -> None:
    """Hand what ends left of the tree of ``root_id`` (runs.engine.ending.end_orphans) to a
    ``runs.end_tree`` task once the transaction commits."""
    # robust: a broker outage must not undo the end; the reconciler finds what it leaves.
    transaction.on_commit(lambda: end_tree_now(root_id), robust=True)


def end_tree_now(root_id: Any) -> None:
    current_app.signature(END_TREE, (str(root_id),), ignore_result=True).apply_async()


# beat's period for the clock's tick, runs.fire_timers (runs.beat installs the entry).
TICK_SECONDS = 1.0
# A wake-up delivered this long after its instant is dropped: the tick has fired its timers by
# then (a worker that restarted hands its held ETA messages back to the broker).
WAKE_EXPIRES_SECONDS = 5.0


def wake_timers_at(eta: datetime, *, until: datetime | None) -> None:
    """A wake-up of the clock at ``eta`` (``runs.wake_timers``, on the clock's queue at its
    priority): it fires the timers due then and, given ``until``, asks for the next wake-up
    before that instant (runs.engine.timers.wake_before). Sent now. A broker outage is logged,
    not raised: the one-second tick fires the timers anyway, only later."""
    try:
        current_app.signature(
            WAKE_TIMERS,
            kwargs={"until": until.timestamp() if until is not None else None},
            ignore_result=True,
            priority=broker_priority(9),
        ).apply_async(eta=eta, expires=eta + timedelta(seconds=WAKE_EXPIRES_SECONDS))
    except Exception:
        logger.warning("could not send a wake-up of the clock", exc_info=True)


# The instants (in TIMER_RESOLUTION_MS slots) this process asked a wake-up for when it armed
# a timer, and when each is past: the runs of a burst armed for one instant ask once.
_wakes_asked: dict[int, float] = {}


def wake_timers_on_commit(fire_at: datetime) -> None:
    """A timer armed for ``fire_at``: if that is before the next tick, a wake-up at its
    instant, rounded up to ``TIMER_RESOLUTION_MS``, once the transaction commits, unless this
    process asked for one at that instant already (the wake-up fires every timer then due)."""
    resolution = settings.DJFLOW["TIMER_RESOLUTION_MS"]
    if resolution <= 0 or fire_at.timestamp() >= time.time() + TICK_SECONDS:
        return
    slot = math.ceil(fire_at.timestamp() * 1000 / resolution)
    at = slot * resolution / 1000

    def send() -> None:
        if slot in _wakes_asked:
            return
        if len(_wakes_asked) > 64:
            now = time.time()
            # A copy (one C call under the GIL): a threaded web process's other requests
            # may ask meanwhile.
            for past in [slot for slot, when in _wakes_asked.copy().items() if when < now]:
                _wakes_asked.pop(past, None)
        _wakes_asked[slot] = at
        wake_timers_at(datetime.fromtimestamp(at, tz=UTC), until=None)

    transaction.on_commit(send, robust=True)
