"""A run as a tree of spans (CONTRACT section 11, ``GET /api/v1/runs/{id}/trace``).

The tree: the run; under it one span per step (per path: a step inside a parallel, foreach or
loop has one per branch, item or iteration, under its composite step; a step of a
condition's branch is under the condition); under a step one span per attempt; under an
attempt the handler's own spans (``ctx.span()``, stored on the attempt), its model calls and
its MCP tool calls, and the child run it started (a subworkflow's, or a body of several steps
run as an anonymous child), whose spans nest the same way, recursively.

A handler's ``model_generation`` span and the model call it made are one span (the span's
times, the call's tokens, cost and GenAI attributes), as are an ``mcp_tool`` span and its
tool call: matched in order on their attempt. A call no span stands for is its own span,
timed from when it was recorded back by its latency.

Ids are stable and deterministic: ``run:<uuid>``, ``step:<run uuid>:<path><step id>``,
``attempt:<step run id>``, ``span:<step run id>:<index>``, ``model_call:<id>``,
``tool_call:<id>``.

Who sees what: the caller must be able to read the run (else 404, as for the run). A child
run the caller may not read (another workflow's) is left out with everything below it, as
the run API leaves it out of ``children``; its subworkflow step's attempts are still there.
Secrets show as ``••••``: everything stored holds tokens (``workflows.secrets``), shown
masked here as in the run API. Tracebacks are left out (the run resource has them for
operators).

Bounded: at most ``MAX_SPANS`` spans and ``MAX_DEPTH`` levels of child runs below the run.
Past either, what is left out is named in ``truncated`` (``{"reason", "limit"}``) and a span
of kind ``truncated`` under the run marks the cut. Reads are a fixed number of queries,
however many steps, attempts and child runs (the run, its descendants, their attempts, model
calls and tool calls).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

from django.db.models import Case, F, JSONField, Q, QuerySet, TextField, When
from django.db.models.functions import Cast, Length
from django.urls import reverse

from workflows import access, secrets
from workflows.errors import FieldError, NotFound, echo

from .engine.journal import document_of, steps_of
from .engine.plan import superseded
from .models import ModelCall, Run, StepRun, ToolCall

MAX_SPANS = 5000
# An input or output longer than this (characters of its JSON) is left out of the trace, its
# length said instead: a trace of 5,000 attempts of 1 MiB values would be gigabytes. The run
# resource has them whole.
MAX_VALUE_CHARS = 8192
# Levels of child runs below the traced run (a subworkflow chain is at most 8 deep, and a body
# of several steps inside each adds a level).
MAX_DEPTH = 16

_RUN_FIELDS = (
    "id",
    "workflow_id",
    "version_id",
    "version__number",
    "status",
    "error",
    "correlation",
    "generation",
    "reruns",
    "body",
    "cost_usd",
    "created_at",
    "started_at",
    "finished_at",
    "parent_run_id",
    "parent_step_run_id",
    "root_run_id",
    "created_by_id",
)
_STEP_FIELDS = (
    "id",
    "run_id",
    "step_id",
    "path",
    "kind",
    "attempt",
    "generation",
    "status",
    "branch",
    "error",
    "worker",
    "queue",
    "usage",
    "spans",
    "cost_usd",
    "scheduled_at",
    "started_at",
    "finished_at",
)


def run_trace(*, run_id: Any, user: Any = None) -> dict[str, Any]:
    """``{run, spans, truncated}`` for a run ``user`` may read; 404 naming ``id`` otherwise."""
    try:
        key = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError:
        raise NotFound(errors=[FieldError("id", f"'{echo(run_id)}' is not a run id")]) from None
    run = _bounded(Run.objects.filter(id=key)).values(*_RUN_FIELDS, *_VALUES).first()
    if run is None:
        raise NotFound(errors=[FieldError("id", f"unknown run '{run_id}'")])
    access.require_view_run(user, _Owned(run))
    builder = _Builder(run, _descendants(run, user))
    builder.build()
    trace = {"run": str(run["id"]), "spans": builder.spans, "truncated": builder.truncated}
    return secrets.shown(trace)  # type: ignore[no-any-return]


class _Owned:
    """What ``access.require_view_run`` reads of a run."""

    def __init__(self, run: Mapping[str, Any]) -> None:
        self.id, self.workflow_id = run["id"], run["workflow_id"]
        self.created_by_id = run["created_by_id"]


def _descendants(run: Mapping[str, Any], user: Any) -> list[dict[str, Any]]:
    """The runs below ``run`` that ``user`` may read, reached only through runs they may read,
    at most MAX_DEPTH levels down and MAX_SPANS runs; one query (a tree shares its root)."""
    root = run["root_run_id"] or run["id"]
    tree: QuerySet[Run] = Run.objects.filter(root_run_id=root)
    readable = access.run_filter(user)
    if readable is not None:
        tree = tree.filter(readable)
    rows = list(
        _bounded(tree.order_by("created_at", "id")).values(*_RUN_FIELDS, *_VALUES)[: MAX_SPANS + 1]
    )
    below: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        below[row["parent_run_id"]].append(row)
    found: list[dict[str, Any]] = []
    level, depth = [run["id"]], 0
    while level and depth < MAX_DEPTH:
        depth += 1
        children = [child for parent in level for child in below.get(parent, [])]
        found += children
        level = [child["id"] for child in children]
    if level and any(below.get(parent) for parent in level):
        found.append({"_cut": "depth"})
    return found


_VALUES = ("input_value", "input_chars", "output_value", "output_chars")


def _bounded(rows: QuerySet[Any]) -> QuerySet[Any]:
    """``rows`` with their input and output read only when short (and their lengths): the
    database measures them, so a long one is never sent here."""
    annotations: dict[str, Any] = {}
    for name in ("input", "output"):
        chars = Length(Cast(name, output_field=TextField()))
        annotations[f"{name}_chars"] = chars
        annotations[f"{name}_value"] = Case(
            When(Q(**{f"{name}_chars__lte": MAX_VALUE_CHARS}), then=F(name)),
            default=None,
            output_field=JSONField(),
        )
    annotated: QuerySet[Any] = rows.annotate(**annotations)
    return annotated


def _value(row: Mapping[str, Any], name: str) -> Any:
    """A row's input or output, or what stands for it when it is too long to show here."""
    chars = row[f"{name}_chars"]
    if chars is not None and chars > MAX_VALUE_CHARS:
        return {"omitted": f"{chars} characters of JSON, over {MAX_VALUE_CHARS}: read the run"}
    return row[f"{name}_value"]


def _time(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def _money(value: Any) -> float | None:
    return float(value) if value is not None else None


def _usage_sum(usages: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Token counts added up (the numbers at the top of each usage; ``models`` is per model)."""
    total: dict[str, int] = {}
    for usage in usages:
        for name, value in (usage or {}).items():
            if isinstance(value, int) and not isinstance(value, bool):
                total[name] = total.get(name, 0) + value
    return total


def _error(error: Any) -> dict[str, Any] | None:
    """An error without its traceback."""
    if not isinstance(error, Mapping):
        return None
    return {name: value for name, value in error.items() if name != "traceback"}


def _containers(version_id: int) -> dict[str, str]:
    """Each step inside a condition's branch mapped to that condition (a step inside a
    composite step is under it by its path instead)."""
    found: dict[str, str] = {}
    for step_id, step in steps_of(version_id).items():
        for name in ("then", "else"):
            for inner in step.get(name) or []:
                found[inner["id"]] = step_id
    return found


class _Builder:
    def __init__(self, run: dict[str, Any], descendants: list[dict[str, Any]]) -> None:
        self.run = run
        cut = [row for row in descendants if "_cut" in row]
        self.runs = [run, *(row for row in descendants if "_cut" not in row)]
        self.spans: list[dict[str, Any]] = []
        self.truncated: dict[str, Any] | None = None
        self.full = False  # MAX_SPANS reached: nothing more is added
        if len(self.runs) > MAX_SPANS:
            self._cut("spans", MAX_SPANS)
            self.runs = self.runs[:MAX_SPANS]
        elif cut:
            self._cut("depth", MAX_DEPTH)

    def build(self) -> None:
        run_ids = [row["id"] for row in self.runs]
        attempts = list(
            _bounded(StepRun.objects.filter(run_id__in=run_ids))
            .order_by("id")
            .values(*_STEP_FIELDS, *_VALUES)[: MAX_SPANS + 1]
        )
        if len(attempts) > MAX_SPANS:
            attempts = attempts[:MAX_SPANS]
            self._cut("spans", MAX_SPANS)
        attempt_ids = {row["id"] for row in attempts}
        model_calls: dict[int, list[ModelCall]] = defaultdict(list)
        for call in ModelCall.objects.filter(run_id__in=run_ids).order_by("id")[:MAX_SPANS]:
            if call.step_run_id in attempt_ids:
                model_calls[call.step_run_id].append(call)
        tool_calls: dict[int, list[ToolCall]] = defaultdict(list)
        for tool in ToolCall.objects.filter(run_id__in=run_ids).order_by("id")[:MAX_SPANS]:
            if tool.step_run_id in attempt_ids:
                tool_calls[tool.step_run_id].append(tool)
        by_run: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for row in attempts:
            by_run[row["run_id"]].append(row)
        for row in self.runs:
            self._run(row, self._run_parent(row))
            self._steps(row, by_run.get(row["id"], []), model_calls, tool_calls)
        if self.truncated is not None:
            # The marker, last: at most MAX_SPANS spans and it.
            self._add(
                f"truncated:{self.run['id']}",
                f"run:{self.run['id']}",
                "truncated",
                "truncated",
                attributes=dict(self.truncated),
            )

    def _run_parent(self, run: dict[str, Any]) -> str | None:
        """A child run nests under the attempt that started it (or, should that row be
        gone, its parent run); the traced run is the root."""
        if run is self.run:
            return None
        if run["parent_step_run_id"] is not None:
            return f"attempt:{run['parent_step_run_id']}"
        return f"run:{run['parent_run_id']}"

    def _cut(self, reason: str, limit: int) -> None:
        if self.truncated is None:
            self.truncated = {"reason": reason, "limit": limit}

    def _add(self, id: str, parent: str | None, name: str, kind: str, **fields: Any) -> None:
        """Add a span; past MAX_SPANS none but the marker, and the trace says it is cut."""
        if kind != "truncated" and (self.full or len(self.spans) >= MAX_SPANS):
            self.full = True
            self._cut("spans", MAX_SPANS)
            return
        self.spans.append(
            {
                "id": id,
                "parent": parent,
                "name": name,
                "kind": kind,
                "step_id": fields.get("step_id"),
                "attempt": fields.get("attempt"),
                "start": fields.get("start"),
                "end": fields.get("end"),
                "status": fields.get("status"),
                "attributes": fields.get("attributes") or {},
                "usage": fields.get("usage") or {},
                "cost_usd": fields.get("cost_usd"),
            }
        )

    def _run(self, run: dict[str, Any], parent: str | None) -> None:
        attributes = {
            "workflow": run["workflow_id"],
            "version": run["version__number"],
            "generation": run["generation"],
            "correlation": run["correlation"],
            "input": _value(run, "input"),
            "output": _value(run, "output"),
            "error": _error(run["error"]),
        }
        if run["body"]:
            attributes["body"] = run["body"]
        self._add(
            f"run:{run['id']}",
            parent,
            run["workflow_id"],
            "run",
            start=_time(run["started_at"] or run["created_at"]),
            end=_time(run["finished_at"]),
            status=run["status"],
            attributes=attributes,
            cost_usd=_money(run["cost_usd"]),
        )

    def _steps(
        self,
        run: dict[str, Any],
        attempts: list[dict[str, Any]],
        model_calls: Mapping[int, list[ModelCall]],
        tool_calls: Mapping[int, list[ToolCall]],
    ) -> None:
        run_id = run["id"]
        inside = _containers(run["version_id"])
        reruns = tuple((int(r["generation"]), str(r["from_step"])) for r in run["reruns"] or ())
        # Attempts a retry from a step superseded: kept, shown, marked.
        is_superseded = superseded(document_of(run["version_id"])["steps"], reruns)
        by_step: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for row in attempts:
            by_step.setdefault((row["path"], row["step_id"]), []).append(row)
        for (path, step_id), rows in by_step.items():
            step_span = f"step:{run_id}:{path}{step_id}"
            parent = self._step_parent(run_id, path, step_id, inside, by_step)
            latest = max(rows, key=lambda row: (row["generation"], row["attempt"]))
            ends = [row["finished_at"] for row in rows]
            self._add(
                step_span,
                parent,
                step_id,
                "step",
                step_id=step_id,
                start=_time(min(row["scheduled_at"] for row in rows)),
                end=_time(max(ends)) if all(ends) else None,
                status=latest["status"],
                attributes={"kind": latest["kind"], "path": path, "attempts": len(rows)},
                usage=_usage_sum(row["usage"] for row in rows),
                cost_usd=float(sum(row["cost_usd"] for row in rows)),
            )
            for row in sorted(rows, key=lambda row: row["id"]):
                calls = model_calls.get(row["id"], [])
                row["superseded"] = is_superseded(row["path"], row["step_id"], row["generation"])
                self._attempt(row, step_span, calls, tool_calls.get(row["id"], []))

    @staticmethod
    def _step_parent(
        run_id: Any,
        path: str,
        step_id: str,
        inside: Mapping[str, str],
        by_step: Mapping[tuple[str, str], Any],
    ) -> str:
        """The span a step's span is under: the composite step its path is inside (the last
        ``<id>[<x>]/`` of the path), else the condition it is in, else the run."""
        if path:
            outer, _, last = path[:-1].rpartition("/")
            outer = f"{outer}/" if outer else ""
            composite = last.split("[", 1)[0]
            if (outer, composite) in by_step:
                return f"step:{run_id}:{outer}{composite}"
        condition = inside.get(step_id)
        if condition is not None and (path, condition) in by_step:
            return f"step:{run_id}:{path}{condition}"
        return f"run:{run_id}"

    def _attempt(
        self, row: dict[str, Any], parent: str, calls: list[ModelCall], tools: list[ToolCall]
    ) -> None:
        attempt_span = f"attempt:{row['id']}"
        queued = row["started_at"] or row["finished_at"]
        self._add(
            attempt_span,
            parent,
            f"{row['step_id']} #{row['attempt']}",
            "attempt",
            step_id=row["step_id"],
            attempt=row["attempt"],
            start=_time(row["started_at"] or row["scheduled_at"]),
            end=_time(row["finished_at"]),
            status=row["status"],
            attributes={
                "kind": row["kind"],
                "path": row["path"],
                "generation": row["generation"],
                "superseded": row["superseded"],
                "queue": row["queue"],
                "worker": row["worker"],
                "branch": row["branch"] or None,
                "scheduled_at": _time(row["scheduled_at"]),
                "queued_ms": (
                    round((queued - row["scheduled_at"]) / timedelta(milliseconds=1), 3)
                    if queued is not None
                    else None
                ),
                "input": _value(row, "input"),
                "output": _value(row, "output"),
                "error": _error(row["error"]),
            },
            usage=row["usage"],
            cost_usd=_money(row["cost_usd"]),
        )
        unmatched, unmatched_tools = list(calls), list(tools)
        for index, stored in enumerate(row["spans"] or []):
            if not isinstance(stored, Mapping):
                continue
            if stored.get("kind") == "model_generation" and unmatched:
                call = _take(unmatched, lambda c: c.model, stored.get("model"))
                self._model_call(row, attempt_span, call, stored)
                continue
            tool = None
            if stored.get("name") == "mcp_tool" and unmatched_tools:
                attributes = stored.get("attributes") or {}
                wanted = (attributes.get("server"), attributes.get("tool"))
                tool = _take(unmatched_tools, lambda t: (t.server, t.tool), wanted)
            self._handler_span(row, attempt_span, index, stored, tool)
        for call in unmatched:
            self._model_call(row, attempt_span, call, None)
        for tool in unmatched_tools:
            self._tool_call(row, attempt_span, tool)

    def _handler_span(
        self,
        row: dict[str, Any],
        parent: str,
        index: int,
        stored: Mapping[str, Any],
        tool: ToolCall | None,
    ) -> None:
        """A handler's own span; an ``mcp_tool`` one carries the tool call it made."""
        attributes = dict(stored.get("attributes") or {})
        for name in ("model", "provider", "error", "duration_ms"):
            if stored.get(name) is not None:
                attributes[name] = stored[name]
        status = "error" if stored.get("error") else "ok"
        if tool is not None:
            attributes |= _tool_attributes(tool)
            status = tool.status
        self._add(
            f"tool_call:{tool.id}" if tool is not None else f"span:{row['id']}:{index}",
            parent,
            str(stored.get("name") or "span"),
            str(stored.get("kind") or "internal"),
            step_id=row["step_id"],
            attempt=row["attempt"],
            start=stored.get("started_at"),
            end=stored.get("finished_at"),
            status=status,
            attributes=attributes,
            usage=stored.get("usage"),
            cost_usd=stored.get("cost_usd"),
        )

    def _model_call(
        self, row: dict[str, Any], parent: str, call: ModelCall, stored: Mapping[str, Any] | None
    ) -> None:
        usage = {"input_tokens": call.input_tokens, "output_tokens": call.output_tokens}
        for name in ("cached_tokens", "reasoning_tokens"):
            if getattr(call, name) is not None:
                usage[name] = getattr(call, name)
        attributes: dict[str, Any] = {
            **((stored or {}).get("attributes") or {}),
            # The OpenTelemetry GenAI semantic conventions' names.
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": call.provider,
            "gen_ai.request.model": call.model,
            "gen_ai.response.model": call.answered_by or None,
            "gen_ai.usage.input_tokens": call.input_tokens,
            "gen_ai.usage.output_tokens": call.output_tokens,
            "model_call": call.id,
            "url": reverse("run-call", args=[str(call.run_id), call.id]),
            "latency_ms": call.latency_ms,
            "recipe": call.recipe or None,
            "recipe_version": call.recipe_version,
            "retrieved": call.retrieved,
            "error": call.error,
        }
        if stored is not None:
            start, end = stored.get("started_at"), stored.get("finished_at")
        else:
            start = _time(call.created_at - timedelta(milliseconds=call.latency_ms))
            end = _time(call.created_at)
        self._add(
            f"model_call:{call.id}",
            parent,
            str((stored or {}).get("name") or "model_call"),
            "model_generation",
            step_id=row["step_id"],
            attempt=row["attempt"],
            start=start,
            end=end,
            status=call.status,
            attributes=attributes,
            usage=usage,
            cost_usd=_money(call.cost_usd),
        )

    def _tool_call(self, row: dict[str, Any], parent: str, tool: ToolCall) -> None:
        self._add(
            f"tool_call:{tool.id}",
            parent,
            "mcp_tool",
            "client",
            step_id=row["step_id"],
            attempt=row["attempt"],
            start=_time(tool.created_at - timedelta(milliseconds=tool.latency_ms)),
            end=_time(tool.created_at),
            status=tool.status,
            attributes=_tool_attributes(tool),
        )


def _tool_attributes(tool: ToolCall) -> dict[str, Any]:
    return {
        "server": tool.server,
        "tool": tool.tool,
        "tool_call": tool.id,
        "latency_ms": tool.latency_ms,
        "arguments_digest": tool.arguments_id,
        "result_digest": tool.result_id,
        "error": tool.error,
    }


def _take(calls: list[Any], key: Callable[[Any], Any], wanted: Any) -> Any:
    """The first of ``calls`` whose ``key`` is ``wanted``, else the first: removed from
    ``calls`` (a span and its call are matched in order on their attempt)."""
    chosen = next((call for call in calls if key(call) == wanted), calls[0])
    calls.remove(chosen)
    return chosen
