"""Validation of workflow documents at save (contract section 4).

One pass that reports every problem at once, of two kinds. The JSON Schema
(``definition.schema.json``) checks shapes: unknown fields, ids, kinds, durations, guard
structure. A walk over the steps checks what a schema cannot: duplicate ids across nesting
levels, templates and guards that read a step not declared earlier or a path that step cannot
produce, ``foreach.items`` that is not a path, waits that outlast ``limits.run_timeout_ms``,
``input_schema`` that is not a JSON Schema, ``subworkflow`` targets that do not exist, and the
work a document may ask for (contract section 9): the product of nested loops' and foreach's
bounds.

Two bounds come first, before any other check: the number of steps (nested ones included) and
how deep steps nest. A document past either is refused with those errors alone, because they
bound the work of the other checks too (15,000 steps took 7 s to check).

The walk runs beside the schema, not after it, so a user fixing a document sees every problem
in one answer, not the shape errors first and the duplicate ids only once those are fixed. It
therefore cannot trust shapes: each check of a step runs on its own and is skipped where the
step's shape is wrong (the schema reports that), and a step with a usable id still counts for
the steps after it.

Every problem is a :class:`FieldError` whose ``field`` is a path into the document such as
``steps[2].when.path``.
"""

from __future__ import annotations

import contextlib
import difflib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from jsonschema.exceptions import ValidationError

from .errors import FieldError, InvalidDocument, echo
from .forecast import DEFAULT_MAX_STEPS, Sources, forecast
from .guards import pattern_error
from .input_schema import schema_errors
from .kb_names import is_template
from .kb_names import name_problem as kb_name_problem
from .mailbox import MailboxProblem, domain_of, mailbox
from .recipes import step_recipe_errors
from .schema import (
    DEFAULT_MAX_DOCUMENT_STEPS,
    DEFAULT_MAX_ITEMS,
    DEFAULT_RUN_TIMEOUT_MS,
    MAX_DURATION_MS,
    MAX_NESTING,
    MAX_REPEATS,
    schema_validator,
)
from .shapes import Shape, output_problem, output_shape
from .templates import (
    REFERENCE,
    is_valid_path,
    join_location,
    reference_errors,
    references,
    split_path,
    translate_legacy,
)

WorkflowExists = Callable[[str, "int | None"], bool]
ChildDocument = Callable[[str, "int | None"], "Mapping[str, Any] | None"]

# Contract section 9: an approval request asks at most this many people.
MAX_APPROVERS = 50


@dataclass(frozen=True)
class ApprovalRules:
    """What the deployment and the saving user allow an ``approval`` step (contract sections
    8 and 9), given by the caller so this module stays free of settings and users.

    ``mail_domains`` are the domains anyone may name in ``approvers.emails`` (exact, lower
    case); ``None`` lifts the rule (the saver holds ``approvals.mail_external``)."""

    min_remind_ms: int
    mail_domains: frozenset[str] | None = frozenset()
    max_approvers: int = MAX_APPROVERS


def outside_domains(address: str, domains: frozenset[str] | None) -> bool:
    """Whether naming ``address`` (as :func:`workflows.mailbox.mailbox` returned it: the
    address mail goes to) as an approver needs ``approvals.mail_external``."""
    return domains is not None and domain_of(address) not in domains


def _mail_key(entry: str) -> str:
    """An ``emails`` entry as people are counted once: the address it delivers to."""
    try:
        return mailbox(entry).lower()
    except MailboxProblem:
        return entry.lower()


_STEP_ATTRIBUTES = ("output", "status", "error")
_ERROR_KEYS = ("class", "message")
_RUN_KEYS = ("id", "correlation")
_ROOTS = ("input", "steps", "run", "item", "index", "iter", "error")
# What ``${error}`` holds in an on_failure step: the failure the run would have failed with.
_FAILURE_KEYS = ("class", "message", "step")
# Fields holding templates, per kind (``input`` is common to every kind). A recipe step's
# ``system`` and ``prompt`` are rendered with the step input by the step itself: their roots
# are the recipe's (``workflows.recipes``), checked by ``_kind_recipe``.
_TEMPLATE_FIELDS: dict[str, tuple[str, ...]] = {
    "wait_event": ("key",),
    "sleep_until": ("until",),
    "approval": ("message",),
    "write_kb": ("kb", "key", "title", "content"),
    "handoff": ("message",),
    "mcp_tool": ("arguments",),
    "http": ("url", "headers", "body"),
    "subworkflow": (),
}
# Waits that must end before the run's own time limit does.
_WAIT_FIELDS = {"sleep": "ms", "wait_event": "timeout_ms", "approval": "timeout_ms"}


def prepare_document(
    document: Any,
    *,
    workflow_exists: WorkflowExists | None = None,
    approval_rules: ApprovalRules | None = None,
    max_steps: int = DEFAULT_MAX_DOCUMENT_STEPS,
    child_document: ChildDocument | None = None,
) -> dict[str, Any]:
    """Translate legacy template syntax, validate, and return the document to store.

    Raises :class:`InvalidDocument` listing every problem found.
    """
    if not isinstance(document, dict):
        raise InvalidDocument(
            errors=[FieldError("body", "a workflow document must be a JSON object")]
        )
    translated = translate_legacy(document)
    errors = validate_document(
        translated,
        workflow_exists=workflow_exists,
        approval_rules=approval_rules,
        max_steps=max_steps,
        child_document=child_document,
    )
    if errors:
        raise InvalidDocument(errors=errors)
    return translated


def validate_document(
    document: Any,
    *,
    workflow_exists: WorkflowExists | None = None,
    approval_rules: ApprovalRules | None = None,
    max_steps: int = DEFAULT_MAX_DOCUMENT_STEPS,
    child_document: ChildDocument | None = None,
) -> list[FieldError]:
    """Every problem with ``document``, or an empty list when it may be saved. Without
    ``approval_rules`` the bounds on approval steps are not checked (saving always gives
    them: ``workflows.services.definition_save``). ``max_steps`` is the most steps a document
    may hold (``DJFLOW_MAX_DOCUMENT_STEPS``). ``child_document`` gives a subworkflow's
    document for the worst-case step count (:func:`step_count_errors`)."""
    if not isinstance(document, dict):
        return [FieldError("body", "a workflow document must be a JSON object")]
    too_big = _size_errors(document, max_steps)
    if too_big:
        return too_big
    checker = _Checker(document, workflow_exists, approval_rules)
    errors = _dedupe([*_schema_errors(document), *checker.run()])
    if errors:
        return errors  # the worst case is counted on a document of the right shape only
    return step_count_errors(document, child_document)


# --- the worst-case step count (contract section 17) -----------------------------------------


def step_count_errors(
    document: dict[str, Any], child_document: ChildDocument | None = None
) -> list[FieldError]:
    """A document whose worst case (every loop and foreach at its bound, the dearer branch,
    the on_failure steps, its subworkflows'; a step's first attempt only, as a retry happens
    on a failure) is more attempts than ``limits.max_steps`` (default 1,000) counts would
    fail at run time even when nothing fails: refused, naming the bound that multiplies the
    most. A worst case that cannot be known (a subworkflow not
    found, or starting itself, a foreach that gives no max_items) is not refused: its run is
    still held to max_steps."""
    limits = document.get("limits")
    limit = limits.get("max_steps") if isinstance(limits, dict) else None
    if not _is_int(limit):
        limit = DEFAULT_MAX_STEPS
    sources = Sources(child_of=child_document, stated_bounds_only=True, count_retries=False)
    result = forecast(document, sources)
    if result.steps_max is None or result.steps_max <= limit:
        return []
    counted = [step for step in result.per_step if step.attempts_max]
    worst = max(counted, key=lambda step: step.attempts_max or 0)
    given = "" if isinstance(limits, dict) and "max_steps" in limits else " (default)"
    message = (
        f"the worst case is {result.steps_max} step attempts, more than limits.max_steps "
        f"{limit}{given}: step '{worst.step_id}' ({worst.field}) alone may make "
        f"{worst.attempts_max} ({worst.how}); lower the bound, or raise limits.max_steps"
    )
    return [FieldError(worst.bound_field or "limits.max_steps", message)]


# --- size: steps and nesting -----------------------------------------------------------------


def _size_errors(document: dict[str, Any], max_steps: int) -> list[FieldError]:
    """Too many steps, or steps nested too deep. Iterative, and cheap on any JSON."""
    errors: list[FieldError] = []
    count = 0
    # (a list of steps or one step, where it is, the level of the steps in it)
    stack: list[tuple[Any, str, int]] = [
        (document.get("steps"), "steps", 1),
        # The handler's steps count against the same limits as the main ones.
        (document.get("on_failure"), "on_failure", 1),
    ]
    while stack:
        body, where, level = stack.pop()
        steps = list(enumerate(body)) if isinstance(body, list) else [(None, body)]
        for index, step in steps:
            if not isinstance(step, dict):
                continue
            here = where if index is None else f"{where}[{index}]"
            count += 1
            if level > MAX_NESTING:
                errors.append(
                    FieldError(
                        here,
                        f"is nested {level} levels deep; steps nest at most {MAX_NESTING} levels "
                        "(a top-level step is level 1)",
                    )
                )
                continue
            stack.extend((inner, at, level + 1) for inner, at in _bodies(step, here))
    if count > max_steps:
        errors.insert(
            0,
            FieldError(
                "steps",
                f"the document has {count} steps, nested ones included; at most {max_steps} "
                "are allowed (DJFLOW_MAX_DOCUMENT_STEPS)",
            ),
        )
    return errors


def _bodies(step: dict[str, Any], here: str) -> Iterator[tuple[Any, str]]:
    """The steps inside ``step``: a condition's branches, a parallel's branches, a ``do``."""
    for name in ("then", "else"):
        if isinstance(step.get(name), list):
            yield step[name], f"{here}.{name}"
    branches = step.get("branches")
    if isinstance(branches, dict):
        for name, body in branches.items():
            yield body, f"{here}.branches.{name}"
    if "do" in step:
        yield step["do"], f"{here}.do"


# --- shapes: the JSON Schema ---------------------------------------------------------------


def field_path(parts: Iterable[str | int]) -> str:
    """``["steps", 2, "when", "path"]`` → ``steps[2].when.path``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_duration(schema: dict[str, Any]) -> bool:
    return schema.get("maximum") == MAX_DURATION_MS


def _schema_errors(document: dict[str, Any]) -> Iterator[FieldError]:
    for error in schema_validator().iter_errors(document):
        yield from _describe(error)


def _describe(error: ValidationError) -> Iterator[FieldError]:
    path = list(error.absolute_path)
    where = field_path(path)
    keyword = error.validator
    schema = error.schema if isinstance(error.schema, dict) else {}
    instance = error.instance

    if keyword == "additionalProperties" and isinstance(instance, dict):
        known = list(schema.get("properties", {}))
        for key in instance:
            if key in known:
                continue
            hint = difflib.get_close_matches(str(key), known, n=1)
            message = f"unknown field '{key}'"
            if hint:
                message += f" (did you mean '{hint[0]}'?)"
            elif known:
                message += f"; allowed here: {', '.join(known)}"
            yield FieldError(field_path([*path, key]), message)
    elif keyword == "required" and isinstance(instance, dict):
        for name in error.validator_value:
            if name not in instance:
                yield FieldError(field_path([*path, name]), f"required field '{name}' is missing")
    elif "propertyNames" in error.absolute_schema_path:
        yield FieldError(
            field_path([*path, str(instance)]),
            f"'{instance}' is not a valid name: it must match ^[a-z][a-z0-9_]*$",
        )
    elif _is_duration(schema) and keyword in ("minimum", "maximum", "type"):
        yield FieldError(
            where,
            f"{where} must be an integer number of milliseconds from 0 to "
            f"{MAX_DURATION_MS} (3650 days); got {_short(instance)}",
        )
    elif keyword == "pattern":
        yield FieldError(where, f"must match {error.validator_value}; got {_short(instance)}")
    elif keyword == "type":
        expected = error.validator_value
        expected_text = " or ".join(expected) if isinstance(expected, list) else expected
        yield FieldError(where, f"must be {expected_text}; got {_json_type(instance)}")
    elif keyword == "enum":
        options = ", ".join(_short(v) for v in error.validator_value)
        yield FieldError(where, f"must be one of {options}; got {_short(instance)}")
    elif keyword == "const":
        yield FieldError(where, f"must be {_short(error.validator_value)}; got {_short(instance)}")
    elif keyword == "not" and error.validator_value == {"required": ["value"]}:
        yield FieldError(field_path([*path, "value"]), "op 'exists' takes no 'value'")
    elif keyword in ("minimum", "maximum"):
        bound = "at least" if keyword == "minimum" else "at most"
        yield FieldError(where, f"must be {bound} {error.validator_value}; got {_short(instance)}")
    else:
        yield FieldError(where, error.message)


def _dedupe(errors: Iterable[FieldError]) -> list[FieldError]:
    seen: set[FieldError] = set()
    out = []
    for error in errors:
        if error not in seen:
            seen.add(error)
            out.append(error)
    return out


# --- cross references ----------------------------------------------------------------------

# What a check raises when it meets a shape the schema refused (a string where an object
# belongs, a missing required field): the schema has reported it, the check skips it.
_SHAPE_ERRORS = (KeyError, IndexError, TypeError, AttributeError, ValueError)


@dataclass(frozen=True)
class _Scope:
    """What a template at some point of the document may read."""

    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    in_foreach: bool = False
    in_loop: bool = False
    # How many times a body here may run for one run of the outermost loop or foreach: the
    # product of the enclosing loops' and foreach's bounds.
    repeats: int = 1
    # Inside the document's on_failure steps, where ``${error}`` is defined.
    on_failure: bool = False

    def child(self, **changes: Any) -> _Scope:
        return replace(self, steps=dict(self.steps), **changes)


class _Checker:
    def __init__(
        self,
        document: dict[str, Any],
        workflow_exists: WorkflowExists | None,
        approval_rules: ApprovalRules | None = None,
    ):
        self.document = document
        self.workflow_exists = workflow_exists
        self.approval_rules = approval_rules
        self.errors: list[FieldError] = []
        self.seen_ids: dict[str, str] = {}
        self.steps = document.get("steps")
        if not isinstance(self.steps, list):
            self.steps = []
        self.all_ids = {step["id"]: step for step, _ in every_step(document)}
        limits = document.get("limits")
        timeout = limits.get("run_timeout_ms") if isinstance(limits, dict) else None
        self.run_timeout_ms = timeout if _is_duration_value(timeout) else DEFAULT_RUN_TIMEOUT_MS
        self.closed_input = _closed_properties(document.get("input_schema"))
        # Each step's output shape, worked out once (workflows.shapes).
        self.shapes: dict[int, Shape] = {}

    def run(self) -> list[FieldError]:
        self._safely(self._check_input_schema)
        scope = _Scope()
        self._walk(self.steps, "steps", scope)
        if "output" in self.document:
            self._safely(self._check_template, self.document["output"], "output", scope)
        self._safely(self._check_notify)
        handler = self.document.get("on_failure")
        if isinstance(handler, list):
            # The handler runs after any top-level step may have failed: it may read each of
            # them (a step that did not run reads null), and ${error}.
            self._walk(handler, "on_failure", scope.child(on_failure=True))
        concurrency = self.document.get("concurrency")
        if isinstance(concurrency, dict) and isinstance(concurrency.get("key"), str):
            self._safely(self._check_concurrency_key, concurrency["key"])
        return self.errors

    def _check_concurrency_key(self, key: str) -> None:
        """A concurrency key is resolved when the run starts, before any step: it may read
        the run's input only."""
        where = "concurrency.key"
        for location, message in reference_errors(key):
            self.fail(join_location(where, location), message)
        for _, path in references(key):
            if not is_valid_path(path):
                continue  # reported above as malformed
            if split_path(path)[0] != "input":
                self.fail(
                    where,
                    f"'{path}': a concurrency key is resolved when the run starts and reads "
                    "only the run's input (${input.<field>})",
                )
                continue
            problem = self._path_problem(path, _Scope())
            if problem:
                self.fail(where, problem)

    def _check_notify(self) -> None:
        """Each ``notify`` URL names a host over http or https (the schema checks the rest;
        which addresses it may reach is the delivering worker's check, as for http steps)."""
        for index, entry in enumerate(self.document.get("notify") or []):
            problem = notify_url_problem(entry["url"])
            if problem:
                self.fail(f"notify[{index}].url", problem)

    def _safely(self, check: Callable[..., None], *args: Any) -> None:
        """Run one check; a shape the schema refused ends this check only."""
        with contextlib.suppress(_SHAPE_ERRORS):
            check(*args)

    def fail(self, where: str, message: str) -> None:
        self.errors.append(FieldError(where, message))

    # walking

    def _walk(self, steps: list[dict[str, Any]], where: str, scope: _Scope) -> None:
        """Check ``steps`` in order; each step joins ``scope`` after its own checks."""
        for index, step in enumerate(steps):
            self._step(step, f"{where}[{index}]", scope)

    def _body(self, body: Any, where: str, scope: _Scope) -> _Scope:
        """A ``do`` or a branch: one step or a list. Returns the scope at its end."""
        inner = scope.child()
        if isinstance(body, list):
            self._walk(body, where, inner)
        else:
            self._step(body, where, inner)
        return inner

    def _step(self, step: Any, where: str, scope: _Scope) -> None:
        if not isinstance(step, dict) or not isinstance(step.get("id"), str):
            return  # nothing to check or to read later; the schema names what is wrong
        step_id, kind = step["id"], step.get("kind")
        first = self.seen_ids.setdefault(step_id, where)
        if first != where:
            self.fail(f"{where}.id", f"duplicate step id '{step_id}' (first used at {first})")

        if "when" in step:
            self._safely(self._check_guard, step["when"], f"{where}.when", scope)
        if "input" in step:
            self._safely(self._check_template, step["input"], f"{where}.input", scope)
        for name in _TEMPLATE_FIELDS.get(kind, ()) if isinstance(kind, str) else ():
            if name in step:
                self._safely(self._check_template, step[name], f"{where}.{name}", scope)
        self._safely(self._check_wait, step, where)

        check = getattr(self, f"_kind_{kind}", None) if isinstance(kind, str) else None
        if check is not None:
            self._safely(check, step, where, scope)
        scope.steps[step_id] = step

    def _kind_condition(self, step: dict[str, Any], where: str, scope: _Scope) -> None:
        self._safely(self._check_guard, step.get("if"), f"{where}.if", scope)
        taken = []
        for name in ("then", "else"):
            if name in step:
                branch = scope.child()
                self._walk(step[name], f"{where}.{name}", branch)
                taken.append(branch)
        # Steps of either branch stay readable after the condition (null when not taken).
        for branch in taken:
            for step_id, nested in branch.steps.items():
                scope.steps.setdefault(step_id, nested)

    def _kind_parallel(self, step: dict[str, Any], where: str, scope: _Scope) -> None:
        for name, body in step["branches"].items():
            self._body(body, f"{where}.branches.{name}", scope)

    def _kind_foreach(self, step: dict[str, Any], where: str, scope: _Scope) -> None:
        self._safely(self._check_items, step, where, scope)
        inner = scope.child(in_foreach=True, repeats=self._repeats(step, where, scope))
        self._body(step["do"], f"{where}.do", inner)

    def _repeats(self, step: dict[str, Any], where: str, scope: _Scope) -> int:
        """The body's ``repeats``: this step's bound times the enclosing ones'. A product over
        MAX_REPEATS is reported once, at the step that first goes over."""
        items = step.get("items")
        if step["kind"] == "loop":
            name, bound = "max_iterations", step.get("max_iterations")
        elif isinstance(items, list):
            name, bound = "items", len(items)
        else:
            # Without max_items a foreach may take up to its run-time default.
            name, bound = "max_items", step.get("max_items", DEFAULT_MAX_ITEMS)
        if not _is_int(bound) or bound < 1:
            return scope.repeats  # a shape error: the schema reports it
        repeats = scope.repeats * bound
        if repeats > MAX_REPEATS >= scope.repeats:
            given = "" if name in step else f" (not given: {DEFAULT_MAX_ITEMS} by default)"
            self.fail(
                f"{where}.{name}",
                f"{name} {bound}{given} inside loops and foreach that repeat it "
                f"{scope.repeats} times makes {repeats} runs of its body; the product of "
                f"nested loops' max_iterations and foreach's max_items (or items) may be at "
                f"most {MAX_REPEATS}",
            )
        return repeats

    def _check_items(self, step: dict[str, Any], where: str, scope: _Scope) -> None:
        items = step["items"]
        if isinstance(items, str):
            if REFERENCE.fullmatch(items.strip()) is None:
                self.fail(
                    f"{where}.items",
                    "must be a path template such as '${steps.search.output.hits}' or an "
                    f"array; got {_short(items)}",
                )
            else:
                self._check_template(items.strip(), f"{where}.items", scope)
        else:
            limit = step.get("max_items", DEFAULT_MAX_ITEMS)
            if len(items) > limit:
                self.fail(f"{where}.items", f"has {len(items)} items, more than max_items {limit}")
            self._check_template(items, f"{where}.items", scope)

    def _kind_loop(self, step: dict[str, Any], where: str, scope: _Scope) -> None:
        repeats = self._repeats(step, where, scope)
        inner = self._body(step["do"], f"{where}.do", scope.child(in_loop=True, repeats=repeats))
        if "until" in step:
            self._check_guard(step["until"], f"{where}.until", inner)

    def _kind_recipe(self, step: dict[str, Any], where: str, scope: _Scope) -> None:
        # The recipe's own rules (workflows.recipes): its templates read the step input and
        # the context, not the run's, so they are not checked as the document's templates.
        # The context's query likewise reads the step input only (checked there too).
        self.errors += step_recipe_errors(step, where)

    def _kind_write_kb(self, step: dict[str, Any], where: str, scope: _Scope) -> None:
        # A literal name is checked now; a template's value when a run resolves it.
        name = step.get("kb")
        if isinstance(name, str) and not is_template(name):
            problem = kb_name_problem(name)
            if problem:
                self.fail(f"{where}.kb", problem)
        for name_of in ("key", "content"):
            if step.get(name_of) == "":
                self.fail(f"{where}.{name_of}", "must not be empty")

    def _kind_approval(self, step: dict[str, Any], where: str, scope: _Scope) -> None:
        approvers = step["approvers"]
        quorum = step.get("quorum", 1)
        if not any(approvers.get(k) for k in ("users", "groups", "emails")):
            self.fail(f"{where}.approvers", "names no approver: list users, groups or emails")
        elif not approvers.get("groups"):
            known = len(set(approvers.get("users", []))) + len(set(approvers.get("emails", [])))
            if quorum > known:
                self.fail(
                    f"{where}.quorum",
                    f"quorum {quorum} is more than the {known} approver(s) listed",
                )
        for index, entry in enumerate(approvers.get("emails") or []):
            try:
                mailbox(entry)
            except MailboxProblem as problem:
                self.fail(f"{where}.approvers.emails[{index}]", f"'{echo(entry)}' {problem}")
        if self.approval_rules is not None:
            self._safely(self._approval_bounds, step, where)

    def _approval_bounds(self, step: dict[str, Any], where: str) -> None:
        """Contract sections 8 and 9: at most ``max_approvers`` people named (groups are
        counted when the request opens), e-mail approvers inside the allowed domains unless
        the saver may mail outside them, reminders no more often than ``min_remind_ms``."""
        rules = self.approval_rules
        assert rules is not None
        approvers = step["approvers"]
        users = [u for u in approvers.get("users") or [] if isinstance(u, str)]
        emails = [e for e in approvers.get("emails") or [] if isinstance(e, str)]
        listed = len(set(users)) + len({_mail_key(e) for e in emails})
        if listed > rules.max_approvers:
            self.fail(
                f"{where}.approvers",
                f"names {listed} approvers; a request asks at most {rules.max_approvers}",
            )
        for index, address in enumerate(approvers.get("emails") or []):
            try:
                delivered = mailbox(address)
            except MailboxProblem:
                continue  # reported by _kind_approval, for every saver
            if outside_domains(delivered, rules.mail_domains):
                allowed = ", ".join(sorted(rules.mail_domains or ())) or "none"
                self.fail(
                    f"{where}.approvers.emails[{index}]",
                    f"'{address}' is outside the approver e-mail domains "
                    f"(DJFLOW_APPROVER_EMAIL_DOMAINS: {allowed}); naming it needs the "
                    "permission approvals.mail_external",
                )
        remind = step.get("remind_after_ms")
        if _is_duration_value(remind) and remind < rules.min_remind_ms:
            self.fail(
                f"{where}.remind_after_ms",
                f"is {remind} ms; reminders come at most every {rules.min_remind_ms} ms "
                "(DJFLOW_MIN_REMIND_MS): raise it, or leave it out for no reminders",
            )

    def _kind_subworkflow(self, step: dict[str, Any], where: str, scope: _Scope) -> None:
        target, version = step["workflow"], step.get("version")
        if not isinstance(target, str) or not (version is None or _is_int(version)):
            return  # a shape error: never look such a value up in the database
        if target == self.document["id"] and version is None:
            return  # recursion into the workflow being saved; its limits bound it
        if self.workflow_exists is None or self.workflow_exists(target, version):
            return
        if version is not None and self.workflow_exists(target, None):
            self.fail(f"{where}.version", f"workflow '{target}' has no version {version}")
        else:
            self.fail(f"{where}.workflow", f"unknown workflow '{target}'")

    # durations

    def _check_wait(self, step: dict[str, Any], where: str) -> None:
        name = _WAIT_FIELDS.get(step["kind"])
        if name is None or not _is_duration_value(step.get(name)):
            return  # a duration out of range is the schema's to report
        if step[name] > self.run_timeout_ms:
            self.fail(
                f"{where}.{name}",
                f"waits {step[name]} ms, longer than limits.run_timeout_ms "
                f"({self.run_timeout_ms} ms): the run would time out first; raise "
                "limits.run_timeout_ms",
            )

    def _check_input_schema(self) -> None:
        if "input_schema" not in self.document:
            return
        for where, message in schema_errors(self.document["input_schema"], "input_schema"):
            self.fail(where, message)

    # templates and guards

    def _check_template(self, template: Any, where: str, scope: _Scope) -> None:
        for location, message in reference_errors(template):
            self.fail(join_location(where, location), message)
        for location, path in references(template):
            if not is_valid_path(path):
                continue  # reported above as malformed
            message = self._path_problem(path, scope)
            if message:
                self.fail(join_location(where, location), message)

    def _check_guard(self, guard: dict[str, Any], where: str, scope: _Scope) -> None:
        if "all" in guard or "any" in guard:
            key = "all" if "all" in guard else "any"
            for index, child in enumerate(guard[key]):
                self._check_guard(child, f"{where}.{key}[{index}]", scope)
            return
        if "not" in guard:
            self._check_guard(guard["not"], f"{where}.not", scope)
            return
        message = self._path_problem(guard["path"], scope)
        if message:
            self.fail(f"{where}.path", message)
        if guard["op"] == "matches":
            problem = pattern_error(guard["value"])
            if problem is not None:
                self.fail(f"{where}.value", f"is not a valid regular expression: {problem}")

    def _path_problem(self, path: str, scope: _Scope) -> str | None:
        """Why ``path`` cannot be read at this point, or None when it can."""
        parts = split_path(path)
        if not parts or any(part == "" for part in parts):
            return f"'{path}' is not a valid path"
        root, rest = parts[0], parts[1:]
        if root == "input":
            if rest and self.closed_input is not None and rest[0] not in self.closed_input:
                return f"'{path}' reads input field '{rest[0]}', which input_schema does not allow"
            return None
        if root == "steps":
            return self._step_path_problem(path, rest, scope)
        if root == "run":
            if not rest or rest[0] not in _RUN_KEYS or (rest[0] == "id" and len(rest) > 1):
                return f"'{path}': run has only run.id and run.correlation"
            return None
        if root in ("item", "index"):
            if not scope.in_foreach:
                return f"'{path}': '{root}' is only defined inside a foreach's 'do'"
            if root == "index" and rest:
                return f"'{path}': index is a number"
            return None
        if root == "error":
            if not scope.on_failure:
                return f"'{path}': 'error' is only defined inside the on_failure steps"
            if len(rest) > 1 or (rest and rest[0] not in _FAILURE_KEYS):
                return f"'{path}': error has only error.class, error.message and error.step"
            return None
        if root == "iter":
            if not scope.in_loop:
                return f"'{path}': 'iter' is only defined inside a loop's 'do' and 'until'"
            if not rest or rest[0] not in ("index", "previous"):
                return f"'{path}': iter has only iter.index and iter.previous"
            if rest[0] == "index" and len(rest) > 1:
                return f"'{path}': iter.index is a number"
            return None
        return f"'{path}' starts with unknown root '{root}'; roots are {', '.join(_ROOTS)}"

    def _step_path_problem(self, path: str, rest: list[str], scope: _Scope) -> str | None:
        if not rest:
            return f"'{path}' must name a step: steps.<id>.output"
        step_id = rest[0]
        step = scope.steps.get(step_id)
        if step is None:
            if step_id in self.all_ids:
                return (
                    f"'{path}' reads step '{step_id}', which is not declared before this "
                    "point (or is inside a parallel, foreach or loop body)"
                )
            return f"'{path}' reads unknown step '{step_id}'"
        if len(rest) < 2 or rest[1] not in _STEP_ATTRIBUTES:
            return f"'{path}' must continue with .output, .status or .error"
        attribute, tail = rest[1], rest[2:]
        if attribute == "status":
            return f"'{path}': a step's status is a string" if tail else None
        if attribute == "error":
            if tail and (tail[0] not in _ERROR_KEYS or len(tail) > 1):
                return f"'{path}': a step's error has only class and message"
            return None
        if not tail:
            return None
        problem = output_problem(
            output_shape(step, self.shapes),
            tail,
            _owner(step),
            lambda n: ".".join(["output", *tail[:n]]),
        )
        return f"'{path}': {problem}" if problem else None


def _owner(step: dict[str, Any]) -> str:
    """How a message names the output of ``step``."""
    kind, name = step.get("kind"), f"'{echo(str(step.get('id')))}'"
    if kind == "recipe" and "prompt" in step:
        if step.get("output", "text") == "text":
            return f"text recipe step {name}'s output"
        return f"recipe step {name}'s output_schema"
    return f"{kind} step {name}'s output"


def notify_url_problem(url: str) -> str | None:
    """What is wrong with a ``notify`` entry's URL, or None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a port out of range raises here)
    except ValueError as error:
        return f"is not a URL ({error})"
    if parts.scheme.lower() not in ("http", "https"):
        return f"only http and https URLs may be called, not {parts.scheme or 'none'}:"
    if not parts.hostname:
        return "names no host"
    if any(c.isspace() for c in url):
        return "may not hold white space"
    return None


def _closed_properties(input_schema: Any) -> frozenset[str] | None:
    """Input fields a closed ``input_schema`` allows, or None when any field may appear."""
    if not isinstance(input_schema, dict) or input_schema.get("additionalProperties") is not False:
        return None
    properties = input_schema.get("properties")
    if not isinstance(properties, dict):
        return None
    return frozenset(properties)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_duration_value(value: Any) -> bool:
    return _is_int(value) and 0 <= value <= MAX_DURATION_MS


def _every_step(steps: Any, where: str) -> Iterator[tuple[dict[str, Any], str]]:
    """Every step with a usable id, nested ones too, skipping what the schema refuses."""
    if not isinstance(steps, list):
        return
    for index, step in enumerate(steps):
        yield from _step_and_children(step, f"{where}[{index}]")


def _step_and_children(step: Any, here: str) -> Iterator[tuple[dict[str, Any], str]]:
    if not isinstance(step, dict) or not isinstance(step.get("id"), str):
        return
    yield step, here
    kind = step.get("kind")
    if kind == "condition":
        for name in ("then", "else"):
            yield from _every_step(step.get(name), f"{here}.{name}")
    elif kind == "parallel" and isinstance(step.get("branches"), dict):
        for name, body in step["branches"].items():
            yield from _every_body(body, f"{here}.branches.{name}")
    elif kind in ("foreach", "loop"):
        yield from _every_body(step.get("do"), f"{here}.do")


def _every_body(body: Any, where: str) -> Iterator[tuple[dict[str, Any], str]]:
    if isinstance(body, list):
        yield from _every_step(body, where)
    else:
        yield from _step_and_children(body, where)


def every_step(document: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """Every step of a prepared document, nested ones too, with its field path
    (``steps[2].do[0]``), the on_failure steps' last (``on_failure[0]``)."""
    yield from _every_step(document.get("steps"), "steps")
    yield from _every_step(document.get("on_failure"), "on_failure")
