"""What the run inspector shows (``/runs/<id>/``), read in a bounded number of queries
whatever the size of the run: the graph's statuses are counted per step instance (a run of
10,000 attempts is at most a few thousand small tuples, never its inputs and outputs), the
timeline holds the :data:`TIMELINE_ROWS` most recent attempts, the attempt details the
:data:`DETAIL_ROWS` most recent, each value cut at :data:`VALUE_CHARS` characters and each
prompt or reply at :data:`TEXT_CHARS`; the page says what it left out and links to the API,
which has all of it.

Everything shown passes :func:`workflows.secrets.shown` (a secret's token is ``••••``), and
tracebacks only reach the workflow's operators, as in the API.
"""

from __future__ import annotations

import difflib
import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Q, QuerySet
from django.urls import reverse
from django.utils import timezone

from workflows import access, kinds, secrets
from workflows.errors import FieldError, NotFound, echo

from . import answers, graph, timeline
from .answers import STEP_VALUES
from .engine import contents, slots
from .models import ModelCall, Run, RunAction, StepRun, ToolCall
from .status import RUN_MOVES, RUN_TERMINAL, RunStatus, StepStatus

TIMELINE_ROWS = 200
# The attempts' values a page reads at most (answers.bound): each up to 64 KiB (it shows
# VALUE_CHARS of it), 4 MiB in all; a larger one is shown as its size and a link.
PAGE_VALUE_BYTES = 65_536
PAGE_VALUES_BYTES = 4 * 1_048_576
DETAIL_ROWS = 100
VALUE_CHARS = 4_000
TEXT_CHARS = 12_000
DIFF_LINES = 200
# Model calls whose prompt and reply are shown in full (up to TEXT_CHARS): the rest are listed
# with their figures and a link to the API.
CALLS_WITH_TEXT = 40
# Model calls listed on the page at all (an agent's attempt may make many).
CALLS_LISTED = 400
ACTION_ROWS = 200
# Body runs are at most this deep (CONTRACT section 9: nesting depth 8).
BODY_DEPTH = 8

# Hooks of apps above runs (approvals registers one from its AppConfig.ready()): each gives,
# for a run and the user reading its page, links to show on it as (step id, text, url), only
# of runs that user may read. runs never imports them.
_links: list[Callable[[Run, Any], list[tuple[str, str, str]]]] = []


def on_page_links(source: Callable[[Run, Any], list[tuple[str, str, str]]]) -> None:
    if source not in _links:
        _links.append(source)


@dataclass(frozen=True)
class AuditRow:
    """One line of the page's audit: an operator's action, or what an app above runs records
    of the run (an approval's decision)."""

    created_at: datetime
    who: str
    what: str
    # What it said, as JSON with secrets masked ("" when nothing).
    detail: str


# Hooks of apps above runs, like ``_links``: each gives, for a run, the newest ``limit`` lines
# of its audit that the app records (approvals: who decided which request). Without them a
# run approved by someone said "No one has acted on this run" (issue 37).
_audits: list[Callable[[Run, int], list[AuditRow]]] = []


def on_page_audit(source: Callable[[Run, int], list[AuditRow]]) -> None:
    if source not in _audits:
        _audits.append(source)


def audit(run: Run) -> list[AuditRow]:
    """The run's audit, newest first, at most :data:`ACTION_ROWS` lines."""
    actions = RunAction.objects.filter(run=run).order_by("-created_at", "-id")[:ACTION_ROWS]
    rows = [
        AuditRow(
            action.created_at,
            action.actor_name or "the system",
            action.action,
            show(action.detail, 500).text if action.detail else "",
        )
        for action in actions
    ]
    for source in _audits:
        rows.extend(source(run, ACTION_ROWS))
    rows.sort(key=lambda row: row.created_at, reverse=True)
    return rows[:ACTION_ROWS]


def run_for_page(*, run_id: Any, user: Any) -> Run:
    """The run without its journal (a run of 10,000 attempts is read in parts below); 404
    naming ``id`` for an unknown id or a run ``user`` may not read."""
    try:
        key = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError:
        raise NotFound(errors=[FieldError("id", f"'{echo(run_id)}' is not a run id")]) from None
    run = (
        Run.objects.select_related("version", "parent_step_run", "created_by")
        .filter(id=key)
        .first()
    )
    if run is None:
        raise NotFound(errors=[FieldError("id", f"unknown run '{run_id}'")])
    access.require_view_run(user, run)
    return run


# --- values as people read them --------------------------------------------------------------


@dataclass(frozen=True)
class Shown:
    text: str
    # Characters left out (0: all of it is shown); bytes when the value was not read at all.
    cut: int = 0
    # Where the whole value is, when the page read none of it (an attempt's large value).
    url: str = ""


def show(value: Any, limit: int = VALUE_CHARS) -> Shown:
    """JSON as people read it, secrets masked, cut at ``limit`` characters."""
    if value is None:
        return Shown("")
    text = json.dumps(
        secrets.shown(value), indent=2, sort_keys=True, ensure_ascii=False, default=str
    )
    return _cut(text, limit)


def _cut(text: str, limit: int) -> Shown:
    if len(text) <= limit:
        return Shown(text)
    return Shown(text[:limit], len(text) - limit)


def conversation(body: Any) -> str:
    """A prompt or a reply as text: the system prompt and each message under its role, or a
    reply's text (what the API's call resource has, in a form a diff reads line by line)."""
    if not isinstance(body, dict):
        return secrets.shown_text(json.dumps(body, ensure_ascii=False, default=str))
    parts = []
    if body.get("system"):
        parts.append(f"[system]\n{_text(body['system'])}")
    for message in body.get("messages") or []:
        role = message.get("role", "?") if isinstance(message, dict) else "?"
        content = message.get("content") if isinstance(message, dict) else message
        parts.append(f"[{role}]\n{_text(content)}")
    if "text" in body:
        parts.append(_text(body["text"]))
    rest = {k: v for k, v in body.items() if k not in ("system", "messages", "text")}
    if rest:
        parts.append(json.dumps(rest, indent=2, sort_keys=True, ensure_ascii=False, default=str))
    return secrets.shown_text("\n\n".join(parts))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def diff(before: str, after: str) -> list[tuple[str, str]]:
    """The lines that changed from ``before`` to ``after`` as (css class, line), a unified diff
    with two lines of context, at most :data:`DIFF_LINES` lines. Empty when equal."""
    if before == after:
        return []
    lines: list[tuple[str, str]] = []
    for line in difflib.unified_diff(
        before.splitlines(),
        after.splitlines(),
        "previous attempt",
        "this attempt",
        n=2,
        lineterm="",
    ):
        if len(lines) == DIFF_LINES:
            lines.append(("more", "… (the diff goes on; compare the calls in the API)"))
            break
        kind = {"+": "add", "-": "del", "@": "hunk"}.get(line[:1], "same")
        if line.startswith(("+++", "---")):
            kind = "file"
        lines.append((kind, line))
    return lines


# --- the graph ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Latest:
    """The latest attempt of one step instance: what the graph counts."""

    body: str
    path: str
    step_id: str
    status: str
    branch: str
    # The attempt's id when it is the run's own (not a body run's).
    id: int | None


def latest_attempts(run: Run) -> list[Latest]:
    """The latest attempt of every step instance of the run and of its body runs (a foreach
    item of several steps runs as an anonymous child run). Small tuples, not values: no input
    or output is read.

    Every attempt's tuple is read and the latest kept here, in id order: one index scan per
    level, whatever the table's statistics (a correlated "no later attempt" subquery took 4 s
    over 10,000 attempts on a table not yet analysed, 25 ms once analysed)."""
    found: list[Latest] = []
    runs: QuerySet[Run] = Run.objects.filter(id=run.id)
    for depth in range(BODY_DEPTH + 1):
        rows = (
            StepRun.objects.filter(run__in=runs.values("id"))
            .order_by("id")
            .values_list("run__body", "run_id", "path", "step_id", "status", "branch", "id")
        )
        latest: dict[tuple[Any, str, str], Latest] = {}
        for body, run_id, path, step_id, status, branch, row_id in rows.iterator(chunk_size=5_000):
            # The run itself is drawn at the document's root, whatever body it is of.
            latest[(run_id, path, step_id)] = Latest(
                body if depth else "", path, step_id, status, branch, None if depth else row_id
            )
        found.extend(latest.values())
        runs = Run.objects.filter(parent_run__in=runs.values("id")).exclude(body="")
        if not latest or not runs.exists():
            break
    return found


def _links_of(
    nodes: list[graph.Node], latest: list[Latest], shown: set[int], readable: Q | None
) -> None:
    """A node leads to its latest attempt's details when the page shows them, a subworkflow
    node to the child run its latest attempt started when the reader may read that run
    (``readable``: ``access.run_filter``; a child of another workflow's id must not leak)."""
    newest: dict[str, int] = {}
    for row in latest:
        if row.id is not None:
            node_key = graph.key(row.body, row.path, row.step_id)
            newest[node_key] = max(newest.get(node_key, 0), row.id)
    by_attempt = {newest[n.key]: n for n in graph.walk(nodes) if n.key in newest}
    for attempt_id, node in by_attempt.items():
        if attempt_id in shown:
            node.href = f"#attempt-{attempt_id}"
    started = Run.objects.filter(parent_step_run_id__in=list(by_attempt), body="")
    if readable is not None:
        started = started.filter(readable)
    for child_id, step_run_id in started.values_list("id", "parent_step_run_id")[:ACTION_ROWS]:
        node = by_attempt[step_run_id]
        if node.kind == "subworkflow":
            node.href = reverse("runs:inspect", kwargs={"run_id": child_id})


def drawing(run: Run, shown: set[int], readable: Q | None = None) -> graph.Drawing:
    """The graph of the run's document (of its body, for a body run) coloured by status;
    ``shown``: the attempts whose details the page shows, which nodes link to; ``readable``:
    the child runs a subworkflow node may link to (``access.run_filter``, None: any)."""
    document = run.version.document
    if run.body:
        # A body run's page draws the body it runs, not its whole workflow.
        document = {"steps": _body_of(document, run.body)}
    nodes = graph.outline(document)
    latest = latest_attempts(run)
    graph.colour(nodes, [(r.body, r.path, r.step_id, r.status, r.branch) for r in latest])
    _links_of(nodes, latest, shown, readable)
    return graph.layout(nodes)


def _body_of(document: dict[str, Any], ref: str) -> list[Any]:
    """The steps of the body ``<step id>.do`` or ``<step id>.branches.<name>``."""
    step_id, _, rest = ref.partition(".")
    found = _find(document.get("steps") or [], step_id)
    if found is None:
        return []
    body = (
        found.get("do")
        if rest == "do"
        else (found.get("branches") or {}).get(rest.split(".", 1)[-1])
    )
    return body if isinstance(body, list) else [body] if isinstance(body, dict) else []


def _find(steps: Iterable[Any], step_id: str) -> dict[str, Any] | None:
    for step in steps:
        if not isinstance(step, dict):
            continue
        if step.get("id") == step_id:
            return step
        inner: list[Any] = [*(step.get("then") or []), *(step.get("else") or [])]
        for body in [step.get("do"), *(step.get("branches") or {}).values()]:
            inner.extend(body if isinstance(body, list) else [body])
        found = _find(inner, step_id)
        if found is not None:
            return found
    return None


# --- the attempts -------------------------------------------------------------------------


@dataclass
class Call:
    call: ModelCall
    prompt: Shown | None
    reply: Shown | None
    # Against the same call (by position) of the step's previous attempt; None when there is
    # none to compare with or the texts were not read.
    prompt_diff: list[tuple[str, str]] | None = None
    reply_diff: list[tuple[str, str]] | None = None


@dataclass
class Tool:
    call: ToolCall
    arguments: Shown
    result: Shown


@dataclass
class AttemptView:
    step: StepRun
    input: Shown
    output: Shown
    error: dict[str, Any] | None
    traceback: str
    usage: Shown
    spans: Shown
    duration: str
    queued: str
    calls: list[Call] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    # A step that waits in the engine (an approval, an event, a sleep): its time was waited.
    waits: bool = False


def _attempt_rows(run: Run, limit: int) -> list[StepRun]:
    """The run's last ``limit`` attempts without their values (``answers.bound`` reads those
    the page shows): 200 attempts of 2 MiB each were read whole for a page showing 4,000
    characters of each of 100."""
    rows = list(answers.sized(StepRun.objects.filter(run=run), STEP_VALUES).order_by("-id")[:limit])
    rows.reverse()
    return rows


def _left_out(step: StepRun, name: str) -> Shown | None:
    """How the page shows a value ``answers.bound`` did not read: its size and its link."""
    size = (getattr(step, "truncated", None) or {}).get(name)
    if size is None:
        return None
    url = reverse("run-step-value", args=[step.run_id, step.id, name])
    return Shown("", size, url)


def attempts(run: Run, rows: list[StepRun], *, tracebacks: bool) -> list[AttemptView]:
    """The most recent attempts with their values, model calls (prompts and replies, and what
    changed since the previous attempt) and tool calls."""
    views = []
    for step in rows:
        error = dict(secrets.shown(step.error)) if step.error else None
        traceback = ""
        if error is not None:
            traceback = str(error.pop("traceback", "") or "") if tracebacks else ""
            error.pop("traceback", None)
        views.append(
            AttemptView(
                step=step,
                input=_left_out(step, "input") or show(step.input),
                output=_left_out(step, "output") or show(step.output),
                error=error,
                traceback=_cut(traceback, VALUE_CHARS * 2).text,
                usage=show(step.usage or None),
                spans=show(step.spans or None),
                duration=_between(step.started_at, step.finished_at),
                queued=_between(step.scheduled_at, step.started_at),
                waits=waits_in_engine(step.kind),
            )
        )
    _calls(run, views)
    _tools(views)
    return views


def _between(start: datetime | None, end: datetime | None) -> str:
    if start is None or end is None:
        return ""
    return timeline.duration((end - start).total_seconds() * 1000)


def _calls(run: Run, views: list[AttemptView]) -> None:
    """The model calls of the shown attempts; the texts of the :data:`CALLS_WITH_TEXT` most
    recent, each compared with the call in the same position of its step's previous attempt.
    Prompts and replies are read only for those (a prompt may be a 250,000-character
    conversation)."""
    by_step = {view.step.id: view for view in views}
    calls = list(
        ModelCall.objects.filter(step_run_id__in=by_step).order_by("step_run_id", "id")[
            :CALLS_LISTED
        ]
    )
    with_text = calls[-CALLS_WITH_TEXT:]
    # The previous attempt of every shown attempt whose calls show their texts.
    wanted = {
        (step.path, step.step_id, step.attempt - 1)
        for step in (by_step[call.step_run_id].step for call in with_text)
        if step.attempt > 1
    }
    previous: dict[tuple[str, str, int], list[ModelCall]] = {}
    if wanted:
        which = Q()
        for path, step_id, attempt in wanted:
            which |= Q(step_run__path=path, step_run__step_id=step_id, step_run__attempt=attempt)
        earlier = ModelCall.objects.filter(which, run_id=run.id).select_related("step_run")
        for call in earlier.order_by("id")[:CALLS_LISTED]:
            where = (call.step_run.path, call.step_run.step_id, call.step_run.attempt)
            previous.setdefault(where, []).append(call)
    needed = [*with_text, *(c for found in previous.values() for c in found)]
    digests = {d for c in needed for d in (c.prompt_id, c.reply_id) if d is not None}
    bodies = contents.bodies(digests)

    def text(digest: str | None) -> str:
        return conversation(bodies.get(digest)) if digest is not None else ""

    shows_text = {call.id for call in with_text}
    position: dict[int, int] = {}
    for call in calls:
        view = by_step[call.step_run_id]
        index = position[call.step_run_id] = position.get(call.step_run_id, -1) + 1
        if call.id not in shows_text:
            view.calls.append(Call(call, None, None))
            continue
        prompt, reply = text(call.prompt_id), text(call.reply_id)
        shown = Call(call, _cut(prompt, TEXT_CHARS), _cut(reply, TEXT_CHARS))
        before = previous.get((view.step.path, view.step.step_id, view.step.attempt - 1), [])
        if index < len(before):
            old = before[index]
            shown.prompt_diff = diff(text(old.prompt_id), prompt)
            shown.reply_diff = diff(text(old.reply_id), reply)
        view.calls.append(shown)


def _tools(views: list[AttemptView]) -> None:
    by_step = {view.step.id: view for view in views}
    tools = ToolCall.objects.filter(step_run_id__in=by_step).select_related("arguments", "result")
    shown_tools = list(tools.order_by("step_run_id", "id")[:CALLS_WITH_TEXT])
    contents.assemble(row for tool in shown_tools for row in (tool.arguments, tool.result))
    for tool in shown_tools:
        by_step[tool.step_run_id].tools.append(
            Tool(
                tool,
                show(tool.arguments.body),
                show(tool.result.body if tool.result is not None else None),
            )
        )


def waits_in_engine(kind: str) -> bool:
    """Whether a step of ``kind`` waits in the engine rather than runs (``kinds.WAITING_ROLES``):
    from its start to its end an approval waited for people, it never ran."""
    return kinds.role_of(kind) in kinds.WAITING_ROLES


def timeline_of(run: Run, rows: list[StepRun], total: int, now: datetime) -> timeline.Chart:
    bars = [
        timeline.Attempt(
            id=step.id,
            label=f"{step.path}{step.step_id}" + (f" #{step.attempt}" if step.attempt > 1 else ""),
            instance=f"{step.path}|{step.step_id}",
            attempt=step.attempt,
            status=step.status,
            scheduled_at=step.scheduled_at,
            started_at=step.started_at,
            finished_at=step.finished_at,
            waits=waits_in_engine(step.kind),
        )
        for step in rows
    ]
    return timeline.chart(bars, now=now, limit=TIMELINE_ROWS, omitted=total - len(rows))


# --- the page -----------------------------------------------------------------------------


@dataclass
class Page:
    run: Run
    live: bool
    may_operate: bool
    tracebacks: bool
    drawing: graph.Drawing
    chart: timeline.Chart
    attempts: list[AttemptView]
    total_attempts: int
    # The audit, newest first (:func:`audit`).
    actions: list[AuditRow]
    children: list[Run]
    links: list[tuple[str, str, str]]
    input: Shown
    output: Shown
    error: Any
    duration: str
    # What the operator may do now: the actions the run's status allows.
    can: dict[str, bool]
    # The retry from a step with an edited input (``runs.services.run_retry``): offered on an
    # ended top-level run to its operators; the steps it may start from, and the input to
    # edit (JSON, secrets masked: a masked secret sent back keeps its value), None when the
    # input is too large to edit here.
    rerun: bool = False
    rerun_steps: list[str] = field(default_factory=list)
    rerun_input: str | None = None
    # Why the run waits for a concurrency slot of its key (runs.engine.slots), or None.
    queued: str | None = None
    # "Run again" (CONTRACT section 15): the start form of the run's version, prefilled with
    # its input, for the workflow's starters.
    may_start: bool = False
    # Why a budget_exceeded run waits (CONTRACT section 17), and whether its operators may
    # raise its own limit here (a run with limits.max_cost_usd of its own).
    budget_reason: str | None = None
    budget_top_up: bool = False


# The largest input the retry form offers to edit (a run input may be 1 MiB; the API takes it).
EDIT_CHARS = 64_000


def editable_input(run: Run) -> str | None:
    """The run's input as the retry form shows it, or None when it is too large to edit."""
    text = json.dumps(secrets.shown(run.input), indent=2, ensure_ascii=False, default=str)
    return text if len(text) <= EDIT_CHARS else None


def page(run: Run, user: Any) -> Page:
    now = timezone.now()
    total = StepRun.objects.filter(run=run).count()
    rows = _attempt_rows(run, TIMELINE_ROWS)
    detailed = rows[-DETAIL_ROWS:]
    answers.bound([], detailed, limits=(PAGE_VALUES_BYTES, PAGE_VALUE_BYTES))
    tracebacks = access.may_see_tracebacks(user, run.workflow_id)
    may_operate = access.may_operate_run(user, run.workflow_id, run.created_by_id)
    children = Run.objects.filter(parent_run=run).order_by("created_at", "id")
    readable = access.run_filter(user)
    if readable is not None:
        children = children.filter(readable)
    status = run.status
    queued = slots.waiting_reason(run)
    # The form only its operators see on an ended run: its steps and input (up to 64,000
    # characters of JSON) are not worked out for anyone else, nor at each live refresh.
    rerun = may_operate and status in RUN_TERMINAL and run.parent_run_id is None
    return Page(
        run=run,
        live=status not in RUN_TERMINAL,
        may_operate=may_operate,
        tracebacks=tracebacks,
        drawing=drawing(run, {row.id for row in detailed}, readable),
        chart=timeline_of(run, rows, total, now),
        attempts=attempts(run, detailed, tracebacks=tracebacks),
        total_attempts=total,
        actions=audit(run),
        children=list(children.only("id", "workflow", "status", "body")[:ACTION_ROWS]),
        links=[link for source in _links for link in source(run, user)],
        input=show(run.input),
        output=show(run.output),
        error=secrets.shown(run.error),
        duration=_between(run.started_at, run.finished_at or (now if run.started_at else None)),
        can={
            "cancel": RunStatus.CANCELLED in RUN_MOVES.get(status, ()),
            # A run waiting for a slot runs nothing to pause (runs.services.run_pause).
            "pause": RunStatus.PAUSED in RUN_MOVES.get(status, ()) and queued is None,
            "resume": status == RunStatus.PAUSED,
            "retry": status == RunStatus.FAILED,
        },
        rerun=rerun,
        rerun_steps=(
            [node.step_id for node in graph.walk(graph.outline(run.version.document))]
            if rerun
            else []
        ),
        rerun_input=editable_input(run) if rerun else None,
        queued=queued,
        may_start=access.may_start(user, run.workflow_id),
        **_budget(run, may_operate),
    )


def _budget(run: Run, may_operate: bool) -> dict[str, Any]:
    """What a budget_exceeded run's page says and offers: the waiting attempts' reason, and
    the top-up form to its operators when the run has a limit of its own to raise."""
    if run.status != RunStatus.BUDGET_EXCEEDED:
        return {}
    from .engine import costs
    from .serializers import budget_reason

    waiting = StepRun.objects.filter(
        run=run, status=StepStatus.SCHEDULED, budget_wait__isnull=False
    ).order_by("id")[:20]
    reasons = [reason for step in waiting if (reason := budget_reason(step))]
    return {
        "budget_reason": reasons[0] if reasons else "it waits for budget",
        "budget_top_up": may_operate and costs.limit_of_version(run.version_id) is not None,
    }
