"""Two runs side by side, step by step (CONTRACT section 16, "Replay and fork"): what the
inspector's compare page (``/runs/<a>/compare/<b>/``) shows and ``manage.py run_replay``
prints. Reads only; no HTTP.

Pairing: a step instance is its ``(path, step id)``. Each run contributes the latest attempt
of each of its instances, leaving out the attempts a retry from a step superseded (as the
planner does, ``runs.engine.plan.superseded``); the instances of both runs are listed once,
in the order of the documents (a step inside a composite one after it, a foreach's items in
their order), a step only one run has marked ``added`` (only in ``b``) or ``removed`` (only
in ``a``). A foreach item or a branch of several steps runs as a body run of its own, whose
steps are not paired here: their outputs are in the composite step's.

What is compared is what people are shown: every value passes :func:`workflows.secrets.shown`
(a secret is ``••••``) before it is compared, so two runs given different secrets, or the same
secret under each run's own random token, compare as the same; plaintexts are never read.
Two values are the same when their pretty JSON (sorted keys) is the same text, so "changed"
and a non-empty diff always agree.

Bounded whatever the runs' size: the attempts are read as small tuples (no value), the first
:data:`MAX_STEPS` instances are compared and the rest counted; their outputs are read within
a byte budget (``runs.answers.bound``), a value past it being shown as its size and link and
compared as ``None`` (not compared); a diff is cut at :data:`DIFF_CHARS` characters, and
values that are too long to diff (:data:`DIFF_INPUT_CHARS`) are compared but not diffed;
the first :data:`CALLS_PER_STEP` model calls of each attempt are paired, and the texts
(prompts and replies, tool arguments and results) of the first :data:`CALLS_WITH_TEXT`
pairs read. The reads are a fixed number of statements, none made per step or per call.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.db.models import Count, F, QuerySet, Window
from django.db.models.functions import RowNumber
from django.urls import reverse

from workflows import access, secrets

from . import answers
from .engine import contents
from .engine.journal import reruns_of
from .engine.plan import superseded
from .inspection import TEXT_CHARS, VALUE_CHARS, Shown, conversation
from .models import ModelCall, Run, StepRun, ToolCall

# Step instances compared at most (the rest are counted in ``Comparison.steps_left_out``).
MAX_STEPS = 200
# The values read to compare: all of them together, and one at most. A larger value is
# shown as its size and link, and not compared.
VALUES_BYTES = 8 * 1_048_576
VALUE_BYTES = 262_144
LIMITS = (VALUES_BYTES, VALUE_BYTES)
# A diff longer than this is cut, and says so.
DIFF_CHARS = 20_000
# Texts longer than this are compared but not diffed: difflib's matching grows faster than
# the texts, and a diff of such texts would be cut at DIFF_CHARS anyway.
DIFF_INPUT_CHARS = 200_000
# difflib's matching is quadratic in the lines of the texts at worst: values chosen for it
# (33,000 short lines, each value just under its 1 % "popular" cut) took 29 s to diff here,
# 2,000 lines 0.1 s (security review C1). A text of more lines is compared, not diffed, and a
# comparison diffs at most DIFF_LINES lines in all (about 2 s at worst); then it compares only.
DIFF_INPUT_LINES = 2_000
DIFF_LINES = 40_000
_lines_left: ContextVar[int | None] = ContextVar("djflow_compare_lines_left", default=None)
# Pairs of model calls (and of tool calls) whose texts are read and compared; model calls
# listed per step at most.
CALLS_WITH_TEXT = 40
CALLS_PER_STEP = 20


# --- diffs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextDiff:
    """A unified diff as ``(kind, line)`` pairs, ``kind`` one of file, hunk, add, del, same,
    more (the CSS classes of ``templates/runs/_diff.html``). No lines: the texts are equal.
    ``cut``: characters of the diff left out; ``skipped``: the texts were too long to diff."""

    lines: tuple[tuple[str, str], ...] = ()
    cut: int = 0
    skipped: bool = False

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def text_diff(before: str, after: str, *, names: tuple[str, str] = ("a", "b")) -> TextDiff:
    """The unified diff of two texts (two lines of context), at most :data:`DIFF_CHARS`
    characters of it; past that a last ``more`` line says how much was left out."""
    if before == after:
        return TextDiff()
    if max(len(before), len(after)) > DIFF_INPUT_CHARS:
        return TextDiff(skipped=True)
    one, two = before.splitlines(), after.splitlines()
    if max(len(one), len(two)) > DIFF_INPUT_LINES:
        return TextDiff(skipped=True)
    left = _lines_left.get()
    if left is not None:
        if len(one) + len(two) > left:
            return TextDiff(skipped=True)
        _lines_left.set(left - len(one) - len(two))
    lines: list[tuple[str, str]] = []
    used = 0
    left_out = 0
    for line in difflib.unified_diff(one, two, names[0], names[1], n=2, lineterm=""):
        if left_out or used + len(line) > DIFF_CHARS:
            left_out += len(line) + 1
            continue
        used += len(line) + 1
        kind = {"+": "add", "-": "del", "@": "hunk"}.get(line[:1], "same")
        if line.startswith(("+++ ", "--- ")) and len(lines) < 2:
            kind = "file"
        lines.append((kind, line))
    if left_out:
        lines.append(("more", f"… {left_out} more characters of the diff left out"))
    return TextDiff(tuple(lines), left_out)


def pretty(value: Any) -> str:
    """A value as it is shown and compared: pretty JSON, sorted keys, secrets masked."""
    return json.dumps(
        secrets.shown(value), indent=2, sort_keys=True, ensure_ascii=False, default=str
    )


def _shown(text: str, limit: int) -> Shown:
    return Shown(text) if len(text) <= limit else Shown(text[:limit], len(text) - limit)


# --- the result ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Value:
    """One side's value, secrets masked. ``text``: its pretty JSON ("" when there is none);
    ``shown``: that text cut for a page, or the value's size and link when it was too large
    to read (``read`` false)."""

    text: str
    shown: Shown
    read: bool = True

    @property
    def json(self) -> Any:
        return json.loads(self.text) if self.read and self.text else None


NO_VALUE = Value("", Shown(""))


@dataclass(frozen=True)
class CallSide:
    """One model call as a comparison shows it; ``prompt``/``reply`` None when not read."""

    id: int
    provider: str
    model: str
    status: str
    recipe: str
    recipe_version: int | None
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal | None
    prompt: Shown | None
    reply: Shown | None


@dataclass(frozen=True)
class CallDiff:
    """The model calls in the same position of the two sides' attempts (1 is the first).
    ``prompt_changed``/``reply_changed``: None when the texts were not read."""

    position: int
    a: CallSide | None
    b: CallSide | None
    prompt_changed: bool | None
    reply_changed: bool | None
    prompt_diff: TextDiff = TextDiff()
    reply_diff: TextDiff = TextDiff()

    @property
    def changed(self) -> bool:
        return self.a is None or self.b is None or bool(self.prompt_changed or self.reply_changed)

    @property
    def sides(self) -> list[tuple[str, CallSide | None]]:
        return [("a", self.a), ("b", self.b)]


@dataclass(frozen=True)
class ToolSide:
    id: int
    server: str
    tool: str
    status: str
    arguments: Value
    result: Value


@dataclass(frozen=True)
class ToolDiff:
    """The MCP tool calls in the same position of the two sides' attempts."""

    position: int
    a: ToolSide | None
    b: ToolSide | None
    arguments_changed: bool | None
    result_changed: bool | None
    arguments_diff: TextDiff = TextDiff()
    result_diff: TextDiff = TextDiff()

    @property
    def changed(self) -> bool:
        return (
            self.a is None or self.b is None or bool(self.arguments_changed or self.result_changed)
        )

    @property
    def sides(self) -> list[tuple[str, ToolSide | None]]:
        return [("a", self.a), ("b", self.b)]


ADDED = "added"
REMOVED = "removed"
CHANGED = "changed"
SAME = "same"


@dataclass
class StepDiff:
    """One step instance in both runs. ``attempt_a``/``attempt_b``: the id of the attempt
    shown (None: the run has no such step); ``cost_a``/``cost_b``: what the instance's
    attempts of the current generations cost (retries included), None on the side without
    it; ``output_changed`` None when an output was too large to read here."""

    step_id: str
    path: str
    kind: str
    attempt_a: int | None
    attempt_b: int | None
    status_a: str | None
    status_b: str | None
    attempts_a: int
    attempts_b: int
    output_a: Value
    output_b: Value
    output_changed: bool | None
    output_diff: TextDiff
    error_a: str
    error_b: str
    cost_a: Decimal | None
    cost_b: Decimal | None
    calls: list[CallDiff] = field(default_factory=list)
    calls_left_out: int = 0
    tools: list[ToolDiff] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.path}{self.step_id}"

    @property
    def change(self) -> str:
        """``added`` (only in b), ``removed`` (only in a), ``changed`` or ``same``."""
        if self.attempt_a is None:
            return ADDED
        if self.attempt_b is None:
            return REMOVED
        differs = (
            self.status_a != self.status_b
            or bool(self.output_changed)
            or self.error_a != self.error_b
            or any(call.changed for call in self.calls)
            or any(tool.changed for tool in self.tools)
        )
        return CHANGED if differs else SAME

    @property
    def prompts_changed(self) -> bool:
        return any(c.a is None or c.b is None or c.prompt_changed for c in self.calls)

    @property
    def replies_changed(self) -> bool:
        return any(c.a is None or c.b is None or c.reply_changed for c in self.calls)


@dataclass
class Comparison:
    """Run ``a`` (before) against run ``b`` (after)."""

    a: Run
    b: Run
    status_a: str
    status_b: str
    output_a: Value
    output_b: Value
    output_changed: bool | None
    output_diff: TextDiff
    cost_a: Decimal
    cost_b: Decimal
    steps: list[StepDiff]
    # Step instances past MAX_STEPS, not compared.
    steps_left_out: int = 0

    @property
    def changed_steps(self) -> list[StepDiff]:
        return [step for step in self.steps if step.change != SAME]

    @property
    def cost_delta(self) -> Decimal:
        return self.cost_b - self.cost_a

    def as_json(self) -> dict[str, Any]:
        """The comparison as JSON-able data: money as decimal strings, values as the masked
        JSON (null when too large to read here, with ``"read": false``), diffs as text."""
        return {
            "a": _run_json(self.a, self.status_a, self.cost_a),
            "b": _run_json(self.b, self.status_b, self.cost_b),
            "output": {
                "a": _value_json(self.output_a),
                "b": _value_json(self.output_b),
                "changed": self.output_changed,
                "diff": _diff_json(self.output_diff),
            },
            "cost_usd": {
                "a": str(self.cost_a),
                "b": str(self.cost_b),
                "delta": str(self.cost_delta),
            },
            "steps": [_step_json(step) for step in self.steps],
            "steps_left_out": self.steps_left_out,
        }


def _run_json(run: Run, status: str, cost: Decimal) -> dict[str, Any]:
    return {
        "id": str(run.id),
        "workflow": run.workflow_id,
        "version": run.version.number,
        "status": status,
        "cost_usd": str(cost),
    }


def _money(value: Decimal | None) -> str | None:
    return None if value is None else str(value)


def _value_json(value: Value) -> dict[str, Any]:
    if not value.read:
        return {"value": None, "read": False, "bytes": value.shown.cut, "url": value.shown.url}
    return {"value": value.json, "read": True}


def _diff_json(diff: TextDiff) -> dict[str, Any]:
    return {"text": diff.text, "cut": diff.cut, "skipped": diff.skipped}


def _call_json(side: CallSide | None) -> dict[str, Any] | None:
    if side is None:
        return None
    return {
        "id": side.id,
        "model": f"{side.provider}:{side.model}",
        "status": side.status,
        "recipe": side.recipe or None,
        "recipe_version": side.recipe_version,
        "input_tokens": side.input_tokens,
        "output_tokens": side.output_tokens,
        "cost_usd": _money(side.cost_usd),
        "prompt": side.prompt.text if side.prompt else None,
        "reply": side.reply.text if side.reply else None,
    }


def _tool_json(side: ToolSide | None) -> dict[str, Any] | None:
    if side is None:
        return None
    return {
        "id": side.id,
        "tool": f"{side.server}.{side.tool}",
        "status": side.status,
        "arguments": _value_json(side.arguments),
        "result": _value_json(side.result),
    }


def _step_json(step: StepDiff) -> dict[str, Any]:
    return {
        "step_id": step.step_id,
        "path": step.path,
        "kind": step.kind,
        "change": step.change,
        "status": {"a": step.status_a, "b": step.status_b},
        "attempts": {"a": step.attempts_a, "b": step.attempts_b},
        "output": {
            "a": _value_json(step.output_a),
            "b": _value_json(step.output_b),
            "changed": step.output_changed,
            "diff": _diff_json(step.output_diff),
        },
        "error": {"a": step.error_a or None, "b": step.error_b or None},
        "cost_usd": {"a": _money(step.cost_a), "b": _money(step.cost_b)},
        "model_calls": [
            {
                "position": call.position,
                "a": _call_json(call.a),
                "b": _call_json(call.b),
                "prompt_changed": call.prompt_changed,
                "reply_changed": call.reply_changed,
                "prompt_diff": _diff_json(call.prompt_diff),
                "reply_diff": _diff_json(call.reply_diff),
            }
            for call in step.calls
        ],
        "model_calls_left_out": step.calls_left_out,
        "tool_calls": [
            {
                "position": tool.position,
                "a": _tool_json(tool.a),
                "b": _tool_json(tool.b),
                "arguments_changed": tool.arguments_changed,
                "result_changed": tool.result_changed,
            }
            for tool in step.tools
        ],
    }


# --- reading the journals --------------------------------------------------------------------


@dataclass
class _Instance:
    """A run's latest current attempt of one step instance, as a small tuple."""

    id: int
    kind: str
    status: str
    attempts: int
    cost: Decimal


Key = tuple[str, str]  # (path, step id)


def current_attempts(run: Run) -> dict[Key, _Instance]:
    """The latest attempt of each step instance of ``run`` (its own journal, not its body
    runs'), without the attempts a retry from a step superseded; in the order they were
    first written. No value is read."""
    is_superseded = superseded(run.version.document.get("steps") or [], reruns_of(run))
    rows = (
        StepRun.objects.filter(run_id=run.id)
        .order_by("id")
        .values_list("id", "path", "step_id", "kind", "status", "generation", "cost_usd")
    )
    found: dict[Key, _Instance] = {}
    for row_id, path, step_id, kind, status, generation, cost in rows.iterator(chunk_size=5_000):
        if is_superseded(path, step_id, generation):
            continue
        seen = found.get((path, step_id))
        if seen is None:
            found[(path, step_id)] = _Instance(row_id, kind, status, 1, cost)
        else:
            # Ids are in the order attempts were written: the last is the latest.
            seen.id, seen.kind, seen.status = row_id, kind, status
            seen.attempts += 1
            seen.cost += cost
    return found


def document_order(*documents: Mapping[str, Any]) -> dict[str, int]:
    """Every step id of the documents at its place in reading order (a step before the
    steps inside it); a step only one document has sits between its neighbours there."""
    merged: list[str] = []
    for document in documents:
        ids = _ids(document.get("steps") or [])
        if not merged:
            merged = ids
            continue
        known = set(merged)
        result: list[str] = []
        matcher = difflib.SequenceMatcher(a=merged, b=ids, autojunk=False)
        for op, a1, a2, b1, b2 in matcher.get_opcodes():
            result.extend(merged[a1:a2])
            if op != "equal":
                result.extend(step for step in ids[b1:b2] if step not in known)
        merged = result
    return {step_id: index for index, step_id in enumerate(merged)}


def _ids(body: Any) -> list[str]:
    found: list[str] = []
    for step in body if isinstance(body, list) else [body]:
        if not isinstance(step, Mapping) or not isinstance(step.get("id"), str):
            continue
        found.append(step["id"])
        for name in ("then", "else", "do"):
            if name in step:
                found.extend(_ids(step[name]))
        for branch in (step.get("branches") or {}).values():
            found.extend(_ids(branch))
    return found


def step_order(keys: Iterable[Key], *documents: Mapping[str, Any]) -> list[Key]:
    """The step instances ``keys`` (``(path, step id)``), each once, in the documents' order
    (:func:`document_order`): a composite step, then each of its items (in number order) or
    branches with the steps inside them, then the next step. Ties (a step no document
    names) keep the order they came in."""
    order = document_order(*documents)
    first_seen: dict[Key, int] = {}
    for key in keys:
        first_seen.setdefault(key, len(first_seen))
    return sorted(first_seen, key=lambda key: _sort_key(key, order, first_seen[key]))


_SEGMENT = re.compile(r"([^/\[]+)\[([^\]]*)\]/")


def _sort_key(key: Key, order: Mapping[str, int], first_seen: int) -> tuple[Any, int]:
    """Where a step instance is listed: by the place of each step its path goes through,
    then the item or branch (foreach items in number order), then its own place."""
    path, step_id = key
    unknown = len(order)
    parts: list[tuple[Any, ...]] = []
    for outer, which in _SEGMENT.findall(path):
        place = (0, int(which), "") if which.isdigit() else (1, 0, which)
        parts.append((order.get(outer, unknown), *place))
    # -1: a composite step before the items and branches inside it (0 and 1).
    parts.append((order.get(step_id, unknown), -1, 0, ""))
    return tuple(parts), first_seen


# --- the comparison --------------------------------------------------------------------------


def compare(a: Run, b: Run, *, user: Any, limits: tuple[int, int] | None = LIMITS) -> Comparison:
    """Run ``a`` against run ``b``, step by step, as ``user`` may see them (``None``: trusted
    code, which sees everything). 404 (``NotFound`` naming ``id``) when ``user`` may read
    either run not. ``limits``: (bytes of values read in all, bytes of one value) instead of
    :data:`LIMITS`; None reads every value whole (for trusted code only)."""
    access.require_view_run(user, a)
    access.require_view_run(user, b)
    budget = _lines_left.set(DIFF_LINES)
    try:
        return _compare(a, b, limits)
    finally:
        _lines_left.reset(budget)


def _compare(a: Run, b: Run, limits: tuple[int, int] | None) -> Comparison:
    runs = answers.sized(Run.objects.select_related("version"), answers.RUN_VALUES)
    run_a = runs.get(id=a.id)
    # One object for a run compared with itself: bound() reads a value once per row.
    run_b = run_a if b.id == a.id else runs.get(id=b.id)
    found_a, found_b = current_attempts(run_a), current_attempts(run_b)
    keys = step_order([*found_a, *found_b], run_a.version.document, run_b.version.document)
    shown = keys[:MAX_STEPS]

    ids = [found[key].id for key in shown for found in (found_a, found_b) if key in found]
    attempts = {
        step.id: step
        for step in answers.sized(StepRun.objects.filter(id__in=ids), ("output", "error"))
    }
    ordered = [attempts[i] for i in ids]
    # Runs first: their outputs are the comparison's headline (read, and diffed, first).
    answers.bound([run_a, run_b], ordered, limits=limits or (2**62, 2**62))
    out_a, out_b = _run_value(run_a), _run_value(run_b)
    changed, output_diff = _compared(out_a, out_b, True)
    calls = _Calls.read(ids, [(found_a.get(key), found_b.get(key)) for key in shown])
    steps = [_step(key, found_a.get(key), found_b.get(key), attempts, calls) for key in shown]
    return Comparison(
        a=run_a,
        b=run_b,
        status_a=run_a.status,
        status_b=run_b.status,
        output_a=out_a,
        output_b=out_b,
        output_changed=changed,
        output_diff=output_diff,
        cost_a=run_a.cost_usd,
        cost_b=run_b.cost_usd,
        steps=steps,
        steps_left_out=len(keys) - len(shown),
    )


def _step(
    key: Key,
    one: _Instance | None,
    two: _Instance | None,
    attempts: Mapping[int, StepRun],
    calls: _Calls,
) -> StepDiff:
    """One step instance of both runs (``one`` in a, ``two`` in b, at least one of them)."""
    step_a = attempts[one.id] if one else None
    step_b = attempts[two.id] if two else None
    out_a, out_b = _step_value(step_a, "output"), _step_value(step_b, "output")
    changed, output_diff = _compared(out_a, out_b, one is not None and two is not None)
    id_a, id_b = one.id if one else None, two.id if two else None
    latest = two or one
    return StepDiff(
        step_id=key[1],
        path=key[0],
        kind=latest.kind if latest else "",
        attempt_a=id_a,
        attempt_b=id_b,
        status_a=one.status if one else None,
        status_b=two.status if two else None,
        attempts_a=one.attempts if one else 0,
        attempts_b=two.attempts if two else 0,
        output_a=out_a,
        output_b=out_b,
        output_changed=changed,
        output_diff=output_diff,
        error_a=_error(step_a),
        error_b=_error(step_b),
        cost_a=one.cost if one else None,
        cost_b=two.cost if two else None,
        calls=calls.model_diffs(id_a, id_b),
        calls_left_out=max(
            0, *(calls.counts.get(i, 0) - CALLS_PER_STEP for i in (id_a, id_b) if i)
        ),
        tools=calls.tool_diffs(id_a, id_b),
    )


def _compared(one: Value, two: Value, both: bool) -> tuple[bool | None, TextDiff]:
    """Whether two values differ (None: one was not read) and their diff."""
    if not both:
        return True, text_diff(one.text, two.text)
    if not (one.read and two.read):
        return None, TextDiff()
    return one.text != two.text, text_diff(one.text, two.text)


def _value(obj: Any, name: str, url: str) -> Value:
    size = (getattr(obj, "truncated", None) or {}).get(name)
    if size is not None:
        return Value("", Shown("", size, url), read=False)
    value = getattr(obj, name)
    if value is None:
        return NO_VALUE
    text = pretty(value)
    return Value(text, _shown(text, VALUE_CHARS))


def _step_value(step: StepRun | None, name: str) -> Value:
    if step is None:
        return NO_VALUE
    return _value(step, name, reverse("run-step-value", args=[step.run_id, step.id, name]))


def _run_value(run: Run) -> Value:
    return _value(run, "output", reverse("run-output", args=[run.id]))


def _error(step: StepRun | None) -> str:
    """An attempt's error as its class and message, masked; never its traceback."""
    if step is None or not step.error:
        return ""
    error = secrets.shown(step.error)
    if not isinstance(error, Mapping):
        return str(error)[:VALUE_CHARS]
    return f"{error.get('class', 'error')}: {error.get('message', '')}"[:VALUE_CHARS]


def _first_calls(rows: QuerySet[Any], ids: Sequence[int]) -> dict[int, list[Any]]:
    """The first :data:`CALLS_PER_STEP` calls of each attempt, oldest first: an agent's
    attempt may make thousands, and only these are compared."""
    numbered = rows.filter(step_run_id__in=ids).annotate(
        number=Window(RowNumber(), partition_by=[F("step_run_id")], order_by=F("id").asc())
    )
    found: dict[int, list[Any]] = {}
    for call in numbered.filter(number__lte=CALLS_PER_STEP).order_by("step_run_id", "id"):
        found.setdefault(call.step_run_id, []).append(call)
    return found


def _bodies(digests: Iterable[str | None]) -> dict[str, Any]:
    return contents.bodies(digests)


Pair = tuple[Any, Any]


def _paired(before: Sequence[Any], after: Sequence[Any]) -> list[Pair]:
    """Calls of two attempts by position: the n-th of one with the n-th of the other."""
    return [
        (before[i] if i < len(before) else None, after[i] if i < len(after) else None)
        for i in range(max(len(before), len(after)))
    ]


@dataclass
class _Calls:
    """The model and tool calls of the attempts compared, read in a fixed number of
    statements: the first :data:`CALLS_PER_STEP` of each attempt, how many each made, and the
    texts of the first :data:`CALLS_WITH_TEXT` pairs of each sort, in the page's order."""

    model: dict[int, list[ModelCall]]
    tools: dict[int, list[ToolCall]]
    counts: dict[int, int]
    # Prompts and replies by digest, as text with secrets masked (those read).
    texts: dict[str, str]
    # Tool arguments and results by digest (those read).
    bodies: dict[str, Any]
    # The attempts (a's id, b's id) whose first n pairs of model (tool) calls were read.
    model_read: dict[tuple[int | None, int | None], int]
    tools_read: dict[tuple[int | None, int | None], int]

    @classmethod
    def read(cls, ids: Sequence[int], instances: Sequence[tuple[Any, Any]]) -> _Calls:
        model = _first_calls(ModelCall.objects.all(), ids)
        tools = _first_calls(
            ToolCall.objects.annotate(
                arguments_size=F("arguments__size"), result_size=F("result__size")
            ),
            ids,
        )
        counts = dict(
            ModelCall.objects.filter(step_run_id__in=ids)
            .values("step_run_id")
            .annotate(calls=Count("id"))
            .values_list("step_run_id", "calls")
        )
        model_read: dict[tuple[int | None, int | None], int] = {}
        tools_read: dict[tuple[int | None, int | None], int] = {}
        texts_left, tools_left = CALLS_WITH_TEXT, CALLS_WITH_TEXT
        prompts: list[str | None] = []
        contents: list[str | None] = []
        for one, two in instances:
            pair = (one.id if one else None, two.id if two else None)
            calls = _paired(model.get(pair[0] or 0, []), model.get(pair[1] or 0, []))
            model_read[pair] = min(len(calls), texts_left)
            texts_left -= model_read[pair]
            for call in (c for duo in calls[: model_read[pair]] for c in duo if c is not None):
                prompts.extend((call.prompt_id, call.reply_id))
            used = _paired(tools.get(pair[0] or 0, []), tools.get(pair[1] or 0, []))
            tools_read[pair] = min(len(used), tools_left)
            tools_left -= tools_read[pair]
            for tool in (t for duo in used[: tools_read[pair]] for t in duo if t is not None):
                # A value past VALUE_BYTES is shown as its size, not read.
                if tool.arguments_size <= VALUE_BYTES:
                    contents.append(tool.arguments_id)
                if tool.result_id is not None and tool.result_size <= VALUE_BYTES:
                    contents.append(tool.result_id)
        texts = {digest: conversation(body) for digest, body in _bodies(prompts).items()}
        return cls(model, tools, counts, texts, _bodies(contents), model_read, tools_read)

    def model_diffs(self, id_a: int | None, id_b: int | None) -> list[CallDiff]:
        pairs = _paired(self.model.get(id_a or 0, []), self.model.get(id_b or 0, []))
        read = self.model_read.get((id_a, id_b), 0)
        diffs = []
        for index, (one, two) in enumerate(pairs):
            has_text = index < read
            diffs.append(
                CallDiff(
                    position=index + 1,
                    a=_call_side(one, self.texts, has_text),
                    b=_call_side(two, self.texts, has_text),
                    **_texts_compared(one, two, self.texts, has_text),
                )
            )
        return diffs

    def tool_diffs(self, id_a: int | None, id_b: int | None) -> list[ToolDiff]:
        pairs = _paired(self.tools.get(id_a or 0, []), self.tools.get(id_b or 0, []))
        diffs = []
        for index, (one, two) in enumerate(pairs[: self.tools_read.get((id_a, id_b), 0)]):
            side_a, side_b = _tool_side(one, self.bodies), _tool_side(two, self.bodies)
            both = side_a is not None and side_b is not None
            arguments = _compared(
                side_a.arguments if side_a else NO_VALUE,
                side_b.arguments if side_b else NO_VALUE,
                both,
            )
            result = _compared(
                side_a.result if side_a else NO_VALUE, side_b.result if side_b else NO_VALUE, both
            )
            diffs.append(
                ToolDiff(
                    position=index + 1,
                    a=side_a,
                    b=side_b,
                    arguments_changed=arguments[0],
                    result_changed=result[0],
                    arguments_diff=arguments[1],
                    result_diff=result[1],
                )
            )
        return diffs


def _texts_compared(
    one: ModelCall | None, two: ModelCall | None, texts: Mapping[str, str], has_text: bool
) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name in ("prompt", "reply"):
        digest_a = getattr(one, f"{name}_id", None)
        digest_b = getattr(two, f"{name}_id", None)
        before, after = texts.get(digest_a or "", ""), texts.get(digest_b or "", "")
        if one is not None and two is not None and digest_a == digest_b:
            # Stored once by the digest of its JSON: the same digest is the same text.
            changed: bool | None = False
        elif not has_text:
            changed = None
        else:
            changed = one is None or two is None or before != after
        found[f"{name}_changed"] = changed
        found[f"{name}_diff"] = text_diff(before, after) if changed else TextDiff()
    return found


def _call_side(call: ModelCall | None, texts: Mapping[str, str], has_text: bool) -> CallSide | None:
    if call is None:
        return None
    prompt = reply = None
    if has_text:
        prompt = _shown(texts.get(call.prompt_id, ""), TEXT_CHARS)
        reply = _shown(texts.get(call.reply_id or "", ""), TEXT_CHARS)
    return CallSide(
        id=call.id,
        provider=call.provider,
        model=call.model,
        status=call.status,
        recipe=call.recipe,
        recipe_version=call.recipe_version,
        input_tokens=call.input_tokens,
        output_tokens=call.output_tokens,
        cost_usd=call.cost_usd,
        prompt=prompt,
        reply=reply,
    )


def _tool_side(tool: ToolCall | None, bodies: Mapping[str, Any]) -> ToolSide | None:
    if tool is None:
        return None
    return ToolSide(
        id=tool.id,
        server=tool.server,
        tool=tool.tool,
        status=tool.status,
        arguments=_content(tool.arguments_id, tool.arguments_size, bodies),  # type: ignore[attr-defined]
        result=_content(tool.result_id, tool.result_size, bodies),  # type: ignore[attr-defined]
    )


def _content(digest: str | None, size: int | None, bodies: Mapping[str, Any]) -> Value:
    if digest is None:
        return NO_VALUE
    if digest not in bodies:
        return Value("", Shown("", size or 0), read=False)
    text = pretty(bodies[digest])
    return Value(text, _shown(text, VALUE_CHARS))
