"""Reads of runs and their journal that are more than a filter."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db.models import F, Prefetch, Q, QuerySet

from workflows import access
from workflows.errors import FieldError, NotFound, echo

from . import answers
from .answers import RUN_VALUES, STEP_VALUES
from .engine.ending import orphans_of
from .models import ModelCall, Run, RunAction, StepRun, ToolCall

# What the runs list's search box looks in (``run_list(search_in=...)``): exact matches only,
# each served by an index (run_newest's primary key, run_correlation, run_idempotency_key).
SEARCH_ANY = "any"
SEARCH_ID = "id"
SEARCH_CORRELATION = "correlation"
SEARCH_IDEMPOTENCY_KEY = "idempotency_key"
SEARCH_IN = (SEARCH_ANY, SEARCH_ID, SEARCH_CORRELATION, SEARCH_IDEMPOTENCY_KEY)


# How many of a run's actions its resource embeds: the newest (runs.serializers).
SHOWN_ACTIONS = 50


# The filters the runs list takes (GET /runs, the runs page) and so the bulk actions too:
# keywords of run_list.
RUN_LIST_FILTERS = ("workflow", "status", "account", "created_after", "created_before")


def run_list(
    *,
    workflow: str | None = None,
    status: str | None = None,
    account: str | None = None,
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    cost_min: Decimal | None = None,
    cost_max: Decimal | None = None,
    search: str | None = None,
    search_in: str = SEARCH_ANY,
    user: Any = None,
) -> QuerySet[Run]:
    """Runs, newest first, narrowed by each filter given and to those ``user`` may read
    (``None``: every run).

    ``created_after`` is inclusive and ``created_before`` exclusive, so consecutive ranges
    never list a run twice; the cost bounds are inclusive. ``search`` is an exact match of
    the run's id, correlation or idempotency key (``search_in`` says which; ``any``: all
    three, the id only when the text is a UUID). The permission filter comes last and always:
    a run the user may not read is not found by searching its id either.

    Rows carry what a list shows (the version number, the parent's step id), not the journal
    or the children: those are for :func:`run_get`.
    """
    runs = Run.objects.select_related("version", "parent_step_run").order_by("-created_at", "-id")
    lookups = {
        "workflow_id": workflow,
        "status": status,
        "account": account,
        "created_at__gte": created_after,
        "created_at__lt": created_before,
        "cost_usd__gte": cost_min,
        "cost_usd__lte": cost_max,
    }
    runs = runs.filter(**{lookup: value for lookup, value in lookups.items() if value is not None})
    if search is not None:
        runs = runs.filter(_search(search, search_in))
    readable = access.run_filter(user)
    if readable is not None:
        runs = runs.filter(readable)
    return runs


def _search(text: str, where: str) -> Q:
    """The exact-match condition of ``run_list(search=...)``; a text that is no UUID matches
    no id (rather than raising: the page checks ``search_in="id"`` before asking)."""
    try:
        run_id: uuid.UUID | None = uuid.UUID(text)
    except ValueError:
        run_id = None
    by_id = Q(id=run_id) if run_id is not None else Q(pk__in=[])
    if where == SEARCH_ID:
        return by_id
    if where == SEARCH_CORRELATION:
        return Q(correlation=text)
    if where == SEARCH_IDEMPOTENCY_KEY:
        return Q(idempotency_key=text)
    return by_id | Q(correlation=text) | Q(idempotency_key=text)


def run_detail_queryset(user: Any = None, *, bounded: bool = False) -> QuerySet[Run]:
    """Runs with the children ``user`` may read (``None``: all): a child of
    a workflow they may not see is not theirs to know of, by id or status (CONTRACT section
    8), though its output is their step's. The journal and the actions are
    :func:`with_journal`'s.
    ``bounded``: the run's values are left unread, their sizes read instead, for
    ``answers.bound`` to read those that fit an answer."""
    children = _readable_children(user)
    runs = Run.objects.select_related("version", "parent_step_run")
    if bounded:
        runs = answers.sized(runs, RUN_VALUES)
    return runs.prefetch_related(Prefetch("children", queryset=children))


def journal_queryset(*, bounded: bool = False) -> QuerySet[StepRun]:
    """Attempts with their model and tool calls (the sizes of a call's prompt, reply,
    arguments and result, not their texts: the call's own resource has them); ``bounded``:
    the attempts' values left unread, their sizes read instead (``answers.sized``)."""
    steps = StepRun.objects.all()
    if bounded:
        steps = answers.sized(steps, STEP_VALUES)
    return steps.prefetch_related(
        Prefetch(
            "model_calls",
            queryset=ModelCall.objects.annotate(
                prompt_size=F("prompt__size"), reply_size=F("reply__size")
            ).order_by("id"),
        ),
        Prefetch(
            "tool_calls",
            queryset=ToolCall.objects.annotate(
                arguments_size=F("arguments__size"), result_size=F("result__size")
            ).order_by("id"),
        ),
    )


def with_journal(run: Run, *, bounded: bool = False) -> Run:
    """``run`` with the newest DJFLOW_ANSWER_STEPS of its attempts, oldest first, as
    ``run.steps.all()``, its newest SHOWN_ACTIONS actions, and ``run.steps_total``, how
    many attempts its journal holds: a run's
    resource is bounded in rows as ``answers`` bounds it in bytes (20,000 attempts answered
    about 10 MB of rows; security review, issue 36). The whole journal is
    :func:`journal_page`'s, a page at a time. Reads the run_journal index from its end."""
    steps = _newest(run, journal_queryset(bounded=bounded))
    # The newest SHOWN_ACTIONS only: a run retried or marked thousands of times is not read
    # whole to show 50 (RunActionSerializer puts them in order).
    actions = RunAction.objects.filter(run_id=run.id).order_by("-created_at", "-id")
    run._prefetched_objects_cache = {
        **getattr(run, "_prefetched_objects_cache", {}),
        "steps": _fetched(StepRun.objects.none(), steps),
        "actions": _fetched(RunAction.objects.none(), list(actions[:SHOWN_ACTIONS])),
    }
    return run


def _readable_children(user: Any) -> QuerySet[Run]:
    children = Run.objects.order_by("created_at", "id").only(
        "id", "workflow", "status", "parent_run", "created_by"
    )
    readable = access.run_filter(user)
    return children if readable is None else children.filter(readable)


def run_get(*, run_id: Any, user: Any = None) -> Run:
    """The run with its journal and children; a malformed or unknown id, or a run ``user`` may
    not read, is a 404 naming ``id``."""
    try:
        key = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError:
        raise NotFound(errors=[FieldError("id", f"'{echo(run_id)}' is not a run id")]) from None
    run = run_detail_queryset(user, bounded=True).filter(id=key).first()
    if run is None:
        raise NotFound(errors=[FieldError("id", f"unknown run '{run_id}'")])
    access.require_view_run(user, run)
    with_journal(run, bounded=True)
    # The values that fit one answer (DJFLOW_MAX_ANSWER_BYTES), read now; the rest are links.
    answers.bound([run], run.steps.all())
    return run


def _newest(run: Run, steps: QuerySet[StepRun]) -> list[StepRun]:
    """The newest DJFLOW_ANSWER_STEPS of ``steps`` of ``run``, oldest first; sets
    ``run.steps_total`` (counted only when there may be more)."""
    shown = int(settings.DJFLOW["ANSWER_STEPS"])
    rows = list(steps.filter(run_id=run.id).order_by("-id")[:shown])[::-1]
    run.steps_total = len(rows)
    if len(rows) == shown:
        run.steps_total = StepRun.objects.filter(run_id=run.id).count()
    return rows


def journal_page(run: Run) -> QuerySet[StepRun]:
    """The whole journal of ``run`` (one its reader has: :func:`run_readable`), oldest first
    (by id, the order attempts were written), values unread for ``answers.bound``: what
    ``GET /runs/{id}/steps`` pages through."""
    return journal_queryset(bounded=True).filter(run_id=run.id)


def run_readable(*, run_id: Any, user: Any = None) -> Run:
    """The run (its id, workflow, starter and secrets only), if ``user`` may read it; a
    malformed or unknown id, or a run they may not read, is a 404 naming ``id``."""
    try:
        key = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError:
        raise NotFound(errors=[FieldError("id", f"'{echo(run_id)}' is not a run id")]) from None
    run = Run.objects.only("id", "workflow_id", "created_by_id", "secrets").filter(id=key).first()
    if run is None:
        raise NotFound(errors=[FieldError("id", f"unknown run '{run_id}'")])
    access.require_view_run(user, run)
    return run


def value_of(
    *, run_id: Any, field: str, step_run_id: Any = None, user: Any = None
) -> tuple[Run, Any]:
    """The whole of one value a run or one of its attempts stores (``field``: input, output,
    or an attempt's error), for whoever may read the run (else 404 naming ``id``); an
    attempt that is not the run's, or a field that is none of those, is a 404 naming it."""
    run = run_readable(run_id=run_id, user=user)
    fields = RUN_VALUES if step_run_id is None else STEP_VALUES
    if field not in fields:
        raise NotFound(
            errors=[FieldError("field", f"no value '{echo(field)}' ({', '.join(fields)})")]
        )
    if step_run_id is None:
        return run, Run.objects.filter(id=run.id).values_list(field, flat=True).get()
    text = str(step_run_id)
    # A step run's id is a bigint: anything else names none (never a 500 from int()).
    is_id = text.isascii() and text.isdigit() and len(text) <= 18
    rows = StepRun.objects.filter(run_id=run.id, id=int(text)) if is_id else StepRun.objects.none()
    found = list(rows.values_list(field, flat=True)[:1])
    if not found:
        raise NotFound(errors=[FieldError("step", f"run {run.id} has no step run '{echo(text)}'")])
    return run, found[0]


def run_as_started(run: Run) -> Run:
    """A run the caller has just created and committed (``run_start``), ready to render as
    :func:`run_get` renders a run, without reading it again: the start wrote no attempt, action
    or child for it, so its journal, actions and children are empty. What a worker has written
    since is the next read's (the run as of its start is a true answer; its starter may read
    it, CONTRACT section 8)."""
    run._prefetched_objects_cache = {
        "steps": _fetched(StepRun.objects.none()),
        "actions": _fetched(RunAction.objects.none()),
        "children": _fetched(Run.objects.none()),
    }
    run.steps_total = 0
    return run


def run_as_planned(*, run_id: Any, user: Any = None) -> Run:
    """A run the caller has just created, with its first steps planned in the same request
    (``run_start(plan_now=True)``), ready to render as :func:`run_get` renders a run, in two
    or three statements where run_get took six and guardian's look-up for the children:
    reading a run back was half of such a POST /runs (bench.starts --profile http-inline).

    What an inline plan can have written: the run, its first attempts, and child runs (a
    subworkflow planned at once); no operator action, and no model or tool call (a plan runs
    no worker's body; the rows of a worker that raced us to the attempt are the next read's,
    as in :func:`run_as_started`). The caller started the run, so it may read it (CONTRACT
    section 8); children stay filtered to those ``user`` may read, looked up only when the
    run has any."""
    runs = Run.objects.select_related("version", "parent_step_run")
    run = answers.sized(runs, RUN_VALUES).get(id=run_id)
    steps = _newest(run, answers.sized(StepRun.objects.all(), STEP_VALUES))
    answers.bound([run], steps)
    for step in steps:
        step._prefetched_objects_cache = {
            "model_calls": _fetched(ModelCall.objects.none()),
            "tool_calls": _fetched(ToolCall.objects.none()),
        }
    children: list[Run] = []
    if Run.objects.filter(parent_run_id=run.id).exists():
        children = list(_readable_children(user).filter(parent_run_id=run.id))
    run._prefetched_objects_cache = {
        "steps": _fetched(StepRun.objects.none(), steps),
        "actions": _fetched(RunAction.objects.none()),
        "children": _fetched(Run.objects.none(), children),
    }
    return run


def _fetched(queryset: QuerySet[Any], rows: list[Any] | None = None) -> QuerySet[Any]:
    """``queryset`` as a prefetch leaves it: its rows (``rows``, or none) in hand, so reading
    it compiles no SQL."""
    queryset._result_cache = rows if rows is not None else []
    queryset._prefetch_done = True
    return queryset


def model_call_get(*, run_id: Any, call_id: Any, user: Any = None) -> ModelCall:
    """One model call of a run with its prompt and reply; 404 naming ``id`` for a run the
    caller may not read, naming ``call`` for a call that is not the run's."""
    run = run_readable(run_id=run_id, user=user)
    call = (
        ModelCall.objects.select_related("prompt", "reply")
        .annotate(prompt_size=F("prompt__size"), reply_size=F("reply__size"))
        .filter(run_id=run.id, id=call_id)
        .first()
    )
    if call is None:
        raise NotFound(errors=[FieldError("call", f"run {run.id} has no model call {call_id}")])
    call.run = run
    return call


def run_tree_ending(*, run: Run) -> bool:
    """Whether runs that ends in ``run``'s tree left behind are still live: a
    ``runs.end_tree`` task is ending them (a cancel's answer is then 202, not 200)."""
    return orphans_of(run.root_run_id or run.id).exists()


def accounts_list() -> list[Any]:
    """The accounts given a budget, by name."""
    from .models import Account

    return list(Account.objects.order_by("name")[:1000])


def account_get(*, name: str) -> Any:
    """The account's row; for an account never given a budget, an unsaved one: no budget,
    what its runs cost in total, what their attempts hold."""
    from django.db.models import Sum

    from .models import Account, Run, StepRun

    found = Account.objects.filter(name=name).first()
    if found is not None:
        return found
    spent = Run.objects.filter(account=name).aggregate(total=Sum("cost_usd"))["total"]
    held = StepRun.objects.filter(run__account=name, reserved_usd__gt=0).aggregate(
        total=Sum("reserved_usd")
    )["total"]
    return Account(name=name, budget_usd=None, spent_usd=spent or 0, reserved_usd=held or 0)
