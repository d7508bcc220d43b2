"""A run's export (CONTRACT section 16): one self-contained JSON document of the run, its
children (recursively), every attempt of each with its model calls (prompt and reply whole)
and tool calls (arguments and result whole), the document versions and the recipes they
used, as its reader may see them (secrets as ``••••``, tracebacks for the workflow's
operators only). ``manage.py run_replay`` reads it; docs/reference/run-export.md is the
format.

Invariants:

- It is written a piece at a time (:meth:`Export.chunks`): the run's and each child's
  attempts are read in batches of at most :data:`BATCH_ATTEMPTS` attempts and about
  :data:`BATCH_BYTES` of their values, so what is held at once is one run's row, one batch
  and the ids of one run's children, however big the tree (a run stores at most
  DJFLOW_MAX_RUN_BYTES of values, a tree holds at most DJFLOW_MAX_TREE_RUNS runs).
- Every read is in one transaction (REPEATABLE READ when the export opens it): a run that
  moves on while it is exported is exported as it was when the export began.
- Who may read the run is checked before the first piece (:func:`run_export`: 404
  otherwise); a child the reader may not read is left out, as ``GET /runs/{id}`` leaves it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, transaction
from django.utils import timezone

from workflows import access, secrets
from workflows.models import Recipe, WorkflowVersion

from . import answers, selectors
from .engine import contents
from .models import Content, ModelCall, Run, StepRun, ToolCall
from .serializers import CALL_FIELDS, has_traceback

FORMAT = "djflow-run-export"
FORMAT_VERSION = 1
# A batch of attempts read in one go: at most this many, and no more attempts than fit in
# BATCH_BYTES of their values (input, output, error; at least one attempt, which may hold
# up to 3 MiB). Measured (tests/runs/test_export.py, 3,000 attempts of 1 KiB values and a
# model call each, 12 MB of JSON): peak traced memory 2.3 to 3.1 MB, as for 300 attempts;
# the pieces themselves take 0.7 s.
BATCH_ATTEMPTS = 100
BATCH_BYTES = 4 * 1_048_576

MODEL_CONTENTS = ("prompt", "reply")
TOOL_CONTENTS = ("arguments", "result")

_ENCODER = DjangoJSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _json(value: Any) -> str:
    return _ENCODER.encode(value)


def server_version() -> str | None:
    """The installed djflow's version; None when it is not installed as a package."""
    try:
        return metadata.version("djflow")
    except metadata.PackageNotFoundError:
        return None


def run_export(*, run_id: Any, user: Any = None) -> Export:
    """The export of the run, if ``user`` may read it (``None``: trusted code, everything);
    a malformed or unknown id, or a run they may not read, is a 404 naming ``id``."""
    run = selectors.run_readable(run_id=run_id, user=user)
    return Export(run_id=run.id, user=user)


@dataclass
class Export:
    run_id: Any
    user: Any
    _versions: list[int] = field(default_factory=list)
    _recipes: set[tuple[str, int]] = field(default_factory=set)
    _tracebacks: dict[str, bool] = field(default_factory=dict)

    def chunks(self) -> Iterator[str]:
        """The export as JSON text, in pieces (joined, one JSON document)."""
        with _snapshot():
            head = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "server_version": server_version(),
                "exported_at": timezone.now(),
            }
            yield _json(head)[:-1] + ',"run":'
            yield from self._run(self.run_id)
            yield ',"documents":' + _json(self._documents())
            yield ',"recipes":' + _json(self._recipes_used()) + "}\n"

    def _run(self, run_id: Any) -> Iterator[str]:
        run = Run.objects.select_related("version", "parent_step_run").get(id=run_id)
        if run.version_id not in self._versions:
            self._versions.append(run.version_id)
        masked: Callable[[Any], Any] = secrets.shown if run.secrets else _same
        yield _json(masked(_run_fields(run)))[:-1] + ',"steps":['
        separator = ""
        for batch in _batches(run.id):
            rows = []
            for step, model_calls, tool_calls in batch:
                for call in model_calls:
                    if call.recipe and call.recipe_version is not None:
                        self._recipes.add((call.recipe, call.recipe_version))
                row = _step_fields(
                    step, model_calls, tool_calls, tracebacks=self._sees_tracebacks(run.workflow_id)
                )
                rows.append(_json(masked(row)))
            # One piece a batch: a write to the client per batch, not per attempt.
            yield separator + ",".join(rows)
            separator = ","
        yield '],"children":['
        readable = access.run_filter(self.user)
        children = Run.objects.filter(parent_run_id=run.id)
        if readable is not None:
            children = children.filter(readable)
        ids = list(children.order_by("created_at", "id").values_list("id", flat=True))
        for index, child_id in enumerate(ids):
            yield "," if index else ""
            yield from self._run(child_id)
        yield "]}"

    def _sees_tracebacks(self, workflow_id: str) -> bool:
        if workflow_id not in self._tracebacks:
            self._tracebacks[workflow_id] = access.may_see_tracebacks(self.user, workflow_id)
        return self._tracebacks[workflow_id]

    def _documents(self) -> list[dict[str, Any]]:
        found = {v.id: v for v in WorkflowVersion.objects.filter(id__in=self._versions)}
        return [
            {
                "workflow": found[pk].workflow_id,
                "version": found[pk].number,
                "content_hash": found[pk].content_hash,
                "document": found[pk].document,
            }
            for pk in self._versions
        ]

    def _recipes_used(self) -> list[dict[str, Any]]:
        rows = []
        for name, version in sorted(self._recipes):
            recipe = Recipe.objects.resolve(name, version)
            if recipe is not None:
                rows.append(
                    {
                        "name": name,
                        "version": version,
                        "content_hash": recipe.content_hash,
                        "document": recipe.document,
                    }
                )
        return rows


def _same(value: Any) -> Any:
    return value


@contextmanager
def _snapshot() -> Iterator[None]:
    """One transaction for every read; REPEATABLE READ (one snapshot) when it is ours."""
    outermost = not connection.in_atomic_block
    with transaction.atomic():
        if outermost and connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        yield


Batch = list[tuple[StepRun, list[ModelCall], list[ToolCall]]]


def _batches(run_id: Any) -> Iterator[Batch]:
    """The run's attempts, oldest first (by id), each with its model and tool calls, in
    batches (see BATCH_ATTEMPTS): the sizes of the next attempts' values are read first,
    then the values of those that fit."""
    after = 0
    sized = answers.sized(StepRun.objects.filter(run_id=run_id), answers.STEP_VALUES)
    while True:
        ahead = list(
            sized.filter(id__gt=after)
            .order_by("id")
            .values_list("id", "input_bytes", "output_bytes", "error_bytes")[:BATCH_ATTEMPTS]
        )
        if not ahead:
            return
        taken, spent = [], 0
        for pk, *sizes in ahead:
            spent += sum(size or 0 for size in sizes)
            if taken and spent > BATCH_BYTES:
                break
            taken.append(pk)
        after = taken[-1]
        yield _with_calls(taken)


def _with_calls(ids: list[int]) -> Batch:
    """The attempts ``ids`` with their calls. Read apart, not prefetched: a prefetch links
    each call back to its attempt, and those cycles kept every batch alive until the
    garbage collector's next pass (peak memory grew with the journal: 25 MB at 3,000
    attempts, where the batch alone is about 1.5 MB)."""
    model_calls: dict[int, list[ModelCall]] = {pk: [] for pk in ids}
    tool_calls: dict[int, list[ToolCall]] = {pk: [] for pk in ids}
    stored: list[Content | None] = []
    made = ModelCall.objects.filter(step_run_id__in=ids).select_related(*MODEL_CONTENTS)
    for call in made.order_by("id"):
        model_calls[call.step_run_id].append(call)
        stored += (call.prompt, call.reply)
    used = ToolCall.objects.filter(step_run_id__in=ids).select_related(*TOOL_CONTENTS)
    for use in used.order_by("id"):
        tool_calls[use.step_run_id].append(use)
        stored += (use.arguments, use.result)
    # Prompts stored in parts, whole again: one query for the batch (runs.engine.contents).
    contents.assemble(stored)
    steps = StepRun.objects.filter(id__in=ids).order_by("id")
    return [(step, model_calls[step.id], tool_calls[step.id]) for step in steps]


# A run's own fields in the file, as its columns hold them (config.replay reads them back).
RUN_FIELDS = (
    "id",
    "status",
    "input",
    "output",
    "error",
    "correlation",
    "idempotency_key",
    "account",
    "priority",
    "concurrency_key",
    "body",
    "generation",
    "reruns",
    "attempts",
    "cost_usd",
    "created_at",
    "started_at",
    "finished_at",
    "deadline_at",
)


def _run_fields(run: Run) -> dict[str, Any]:
    parent = None
    if run.parent_run_id is not None:
        step = run.parent_step_run
        parent = {"run": run.parent_run_id, "step": step.step_id if step else None}
    values = {name: getattr(run, name) for name in RUN_FIELDS}
    return {
        **values,
        "workflow": run.workflow_id,
        "version": run.version.number,
        "parent": parent,
    }


STEP_FIELDS = (
    "id",
    "step_id",
    "path",
    "kind",
    "attempt",
    "generation",
    "status",
    "effect",
    "branch",
    "input",
    "output",
    "idempotency_key",
    "worker",
    "queue",
    "timeout_ms",
    "scheduled_at",
    "started_at",
    "finished_at",
    "usage",
    "spans",
    "cost_usd",
)


def _step_fields(
    step: StepRun, model_calls: list[ModelCall], tool_calls: list[ToolCall], *, tracebacks: bool
) -> dict[str, Any]:
    error = step.error
    if error and has_traceback(error) and not tracebacks:
        # Tracebacks are for the workflow's operators (CONTRACT section 8), as in the API.
        error = {key: value for key, value in error.items() if key != "traceback"}
    return {
        **{name: getattr(step, name) for name in STEP_FIELDS},
        "error": error,
        "model_calls": [_model_call(call) for call in model_calls],
        "tool_calls": [_tool_call(call) for call in tool_calls],
    }


# The fields of a model call as the API lists it, less its links and sizes (the export
# carries the prompt and the reply themselves).
MODEL_CALL_FIELDS = tuple(
    name for name in CALL_FIELDS if name != "url" and not name.endswith(("_digest", "_size"))
)


def _model_call(call: ModelCall) -> dict[str, Any]:
    return {
        **{name: getattr(call, name) for name in MODEL_CALL_FIELDS},
        "prompt_digest": call.prompt_id,
        "prompt": _body(call.prompt),
        "reply_digest": call.reply_id,
        "reply": _body(call.reply),
    }


TOOL_CALL_FIELDS = ("id", "server", "tool", "status", "error", "latency_ms", "created_at")


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {
        **{name: getattr(call, name) for name in TOOL_CALL_FIELDS},
        "arguments_digest": call.arguments_id,
        "arguments": _body(call.arguments),
        "result_digest": call.result_id,
        "result": _body(call.result),
    }


def _body(content: Content | None) -> Any:
    return None if content is None else content.body
