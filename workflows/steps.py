"""The step constructors of the Python builder: each returns the step dict a person would
write by hand (contract sections 1 and 6), and ``when`` builds guards.

A keyword left out (or ``None``) is left out of the step, so defaults stay implicit and the
same workflow authored through the builder, the admin or the API is stored as the same version.
Nested steps (``parallel`` branches, ``foreach``/``loop`` ``do``, ``condition`` ``then`` and
``else``) are written with these constructors too; raw dicts are accepted wherever a step spec
is. Every ``Workflow`` method that adds a step is made from the constructor of the same kind
(``workflows.builder``), so a constructor's signature, docstring and checks are written once.

Pure functions of their arguments: no registry, no Django, no database.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypedDict, Unpack

__all__ = [
    "RetryPolicy",
    "agent",
    "all_",
    "any_",
    "approval",
    "condition",
    "foreach",
    "handoff",
    "http",
    "loop",
    "mcp_tool",
    "not_",
    "parallel",
    "recipe",
    "sleep",
    "sleep_until",
    "subworkflow",
    "task",
    "wait_event",
    "wait_for",
    "when",
    "write_kb",
]

ID_RE = re.compile(r"^[a-z][a-z0-9_]*$")
GUARD_OPS = ("eq", "ne", "lt", "lte", "gt", "gte", "in", "exists", "matches")

StepSpec = dict[str, Any]
Guard = dict[str, Any]
Steps = Mapping[str, Any] | Sequence[Mapping[str, Any]]


class _Missing:
    def __repr__(self) -> str:
        return "<omitted>"


_MISSING: Any = _Missing()

# --- Retry policies --------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """A step's ``retry`` field; ``max_attempts`` counts the first try."""

    max_attempts: int = 1
    backoff: Literal["exponential", "fixed", "none"] = "exponential"
    initial_ms: int | None = None
    max_ms: int | None = None
    jitter: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """The policy as the document writes it: fields left as ``None`` are left out."""
        return {key: value for key, value in asdict(self).items() if value is not None}


# --- Guards ----------------------------------------------------------------------------------


def _guard(value: Any, where: str) -> Guard:
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a guard (a dict from when(...)), got {value!r}")
    return copy.deepcopy(dict(value))


def _guards(guards: tuple[Any, ...], where: str) -> list[Guard]:
    # when.all([a, b]) reads as well as when.all(a, b); accept both.
    if len(guards) == 1 and isinstance(guards[0], list | tuple):
        guards = tuple(guards[0])
    return [_guard(g, where) for g in guards]


def all_(*guards: Guard) -> Guard:
    """True when every guard is: ``{"all": [...]}``."""
    return {"all": _guards(guards, "when.all()")}


def any_(*guards: Guard) -> Guard:
    """True when one guard is: ``{"any": [...]}``."""
    return {"any": _guards(guards, "when.any()")}


def not_(guard: Guard) -> Guard:
    """``{"not": guard}``."""
    return {"not": _guard(guard, "when.not_()")}


class _When:
    """``when(path, op, value)`` builds a guard (contract section 3).

    ``value`` is left out of the guard when it is not given, as for ``exists``. Combine guards
    with ``when.all(...)``, ``when.any(...)`` and ``when.not_(...)``.
    """

    all = staticmethod(all_)
    any = staticmethod(any_)
    not_ = staticmethod(not_)

    def __call__(self, path: str, op: str, value: Any = _MISSING) -> Guard:
        if not isinstance(path, str) or not path:
            raise ValueError(f"a guard's path must be a non-empty string, got {path!r}")
        # A misspelt guard is an error, never a skipped guard: say so where it is written.
        if op not in GUARD_OPS:
            raise ValueError(f"a guard's op must be one of {', '.join(GUARD_OPS)}, got {op!r}")
        guard: Guard = {"path": path, "op": op}
        if value is not _MISSING:
            guard["value"] = copy.deepcopy(value)
        return guard

    def __repr__(self) -> str:
        return "when"


when = _When()


# --- Step specs ------------------------------------------------------------------------------


class _CommonBase(TypedDict, total=False):
    input: Any
    when: Guard
    retry: RetryPolicy | Mapping[str, Any]
    on_error: Literal["fail_run", "continue"]
    effect: Literal["at_least_once", "at_most_once"]
    queue: str


class _Common(_CommonBase, total=False):
    timeout_ms: int


# The document's own order for the common fields that follow a kind's own fields.
_COMMON_AFTER = ("when", "retry", "on_error", "effect", "timeout_ms", "queue")
_COMMON_NAMES = frozenset(("input", *_COMMON_AFTER))


def check_id(step_id: Any, what: str = "step id") -> None:
    if not isinstance(step_id, str) or not ID_RE.match(step_id):
        raise ValueError(f"{what} must match {ID_RE.pattern}, got {step_id!r}")


def _spec(step_id: str, kind: str, own: Mapping[str, Any], common: Mapping[str, Any]) -> StepSpec:
    """A step dict: ``id``, ``kind``, ``input``, the kind's fields, then the common ones."""
    check_id(step_id)
    unknown = sorted(set(common) - _COMMON_NAMES)
    if unknown:
        raise TypeError(f"step '{step_id}' ({kind}): unexpected keyword {', '.join(unknown)}")
    spec: StepSpec = {"id": step_id, "kind": kind}
    if "handler" in own and own["handler"] is not None:
        spec["handler"] = own["handler"]
    if common.get("input") is not None:
        spec["input"] = copy.deepcopy(common["input"])
    for key, value in own.items():
        if key != "handler" and value is not None:
            spec[key] = value
    for key in _COMMON_AFTER:
        value = common.get(key)
        if value is None:
            continue
        if key == "when":
            value = _guard(value, f"step '{step_id}' when")
        elif key == "retry":
            value = _retry(value, step_id)
        spec[key] = value
    return spec


def _retry(value: Any, step_id: str) -> dict[str, Any]:
    if isinstance(value, RetryPolicy):
        return value.as_dict()
    if isinstance(value, Mapping):
        return copy.deepcopy(dict(value))
    raise TypeError(f"step '{step_id}' retry must be a RetryPolicy or a dict, got {value!r}")


def one_step(value: Any, where: str) -> StepSpec:
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a step spec (a dict), got {value!r}")
    return copy.deepcopy(dict(value))


def _step_or_steps(value: Any, where: str) -> StepSpec | list[StepSpec]:
    """One step keeps its shape as one dict; a list stays a list."""
    if isinstance(value, Mapping):
        return one_step(value, where)
    if isinstance(value, list | tuple):
        return [one_step(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(f"{where} must be a step spec or a list of them, got {value!r}")


def _step_list(value: Any, where: str) -> list[StepSpec]:
    steps = _step_or_steps(value, where)
    return steps if isinstance(steps, list) else [steps]


def _copy(value: Any) -> Any:
    return None if value is None else copy.deepcopy(value)


def task(step_id: str, *, handler: str | None = None, **common: Unpack[_Common]) -> StepSpec:
    """A ``task`` step: runs the handler named ``handler``, else ``<workflow>.<step id>``."""
    return _spec(step_id, "task", {"handler": handler}, common)


def agent(step_id: str, *, handler: str | None = None, **common: Unpack[_Common]) -> StepSpec:
    """An ``agent`` step: a ``task`` whose spans and model usage are priced as an agent turn."""
    return _spec(step_id, "agent", {"handler": handler}, common)


def recipe(
    step_id: str,
    *,
    recipe: str | None = None,
    recipe_version: int | None = None,
    prompt: str | None = None,
    system: str | None = None,
    model: str | None = None,
    output: Literal["json", "text"] | None = None,
    output_schema: Mapping[str, Any] | None = None,
    temperature: float | None = None,
    max_tokens: int | None = None,
    context: Mapping[str, Any] | None = None,
    **common: Unpack[_Common],
) -> StepSpec:
    """A ``recipe`` step: a stored (``recipe``, optionally ``recipe_version``) or inline
    (``prompt``, ``system``, ``output_schema``...) model prompt."""
    own = {
        "recipe": recipe,
        "recipe_version": recipe_version,
        "prompt": prompt,
        "system": system,
        "model": model,
        "output": output,
        "output_schema": _copy(output_schema),
        "temperature": temperature,
        "max_tokens": max_tokens,
        "context": _copy(context),
    }
    return _spec(step_id, "recipe", own, common)


def sleep(step_id: str, *, ms: int, **common: Unpack[_Common]) -> StepSpec:
    """A ``sleep`` step: waits ``ms`` milliseconds with no process alive."""
    return _spec(step_id, "sleep", {"ms": ms}, common)


def sleep_until(step_id: str, *, until: Any, **common: Unpack[_Common]) -> StepSpec:
    """A ``sleep_until`` step: ``until`` is a template giving ISO-8601 or epoch ms."""
    return _spec(step_id, "sleep_until", {"until": _copy(until)}, common)


def wait_event(
    step_id: str,
    *,
    event: str,
    key: Any = None,
    timeout_ms: int | None = None,
    **common: Unpack[_CommonBase],
) -> StepSpec:
    """A ``wait_event`` step: the payload of the event ``event`` with the resolved ``key``."""
    own = {"event": event, "key": _copy(key), "timeout_ms": timeout_ms}
    return _spec(step_id, "wait_event", own, common)


wait_for = wait_event


def approval(
    step_id: str,
    *,
    approvers: Mapping[str, Sequence[str]] | None = None,
    quorum: int | None = None,
    timeout_ms: int | None = None,
    message: Any = None,
    remind_after_ms: int | None = None,
    escalate_to: Mapping[str, Sequence[str]] | None = None,
    email_details: bool | None = None,
    **common: Unpack[_CommonBase],
) -> StepSpec:
    """An ``approval`` step: ``approvers`` is ``{"users": [...], "groups": [...],
    "emails": [...]}``; ``escalate_to`` is ``{"users": [...], "groups": [...]}``;
    ``email_details=True`` puts the details (the step input) in the e-mails too."""
    own = {
        "approvers": _copy(approvers),
        "quorum": quorum,
        "timeout_ms": timeout_ms,
        "message": _copy(message),
        "remind_after_ms": remind_after_ms,
        "escalate_to": _copy(escalate_to),
        "email_details": email_details,
    }
    return _spec(step_id, "approval", own, common)


def parallel(
    step_id: str,
    *,
    branches: Mapping[str, Steps],
    mode: str | None = None,
    **common: Unpack[_Common],
) -> StepSpec:
    """A ``parallel`` step: ``branches`` maps a branch name to a step spec (or a list);
    ``mode`` is ``"fail_fast"`` (the default) or ``"all_settled"``."""
    if not isinstance(branches, Mapping):
        raise TypeError(f"step '{step_id}' branches must be a dict, got {branches!r}")
    own = {
        "branches": {
            name: _step_or_steps(spec, f"step '{step_id}' branches['{name}']")
            for name, spec in branches.items()
        },
        "mode": mode,
    }
    return _spec(step_id, "parallel", own, common)


def foreach(
    step_id: str,
    *,
    items: str | Sequence[Any],
    do: Steps,
    max_items: int | None = None,
    concurrency: int | None = None,
    **common: Unpack[_Common],
) -> StepSpec:
    """A ``foreach`` step: runs ``do`` for each element of ``items``, a path template to an
    array (``"${steps.search.output.hits}"``) or a literal array."""
    own = {
        "items": _copy(items),
        "do": _step_or_steps(do, f"step '{step_id}' do"),
        "max_items": max_items,
        "concurrency": concurrency,
    }
    return _spec(step_id, "foreach", own, common)


def loop(
    step_id: str,
    *,
    do: Steps,
    max_iterations: int,
    until: Guard | None = None,
    **common: Unpack[_Common],
) -> StepSpec:
    """A ``loop`` step: ``do`` up to ``max_iterations`` times, until the guard ``until``."""
    own = {
        "do": _step_or_steps(do, f"step '{step_id}' do"),
        "max_iterations": max_iterations,
        "until": None if until is None else _guard(until, f"step '{step_id}' until"),
    }
    return _spec(step_id, "loop", own, common)


def subworkflow(
    step_id: str, *, workflow: str, version: int | None = None, **common: Unpack[_Common]
) -> StepSpec:
    """A ``subworkflow`` step: a child run of ``workflow`` (its latest version if none)."""
    return _spec(step_id, "subworkflow", {"workflow": workflow, "version": version}, common)


def condition(
    step_id: str,
    *,
    if_: Guard,
    then: Steps,
    else_: Steps | None = None,
    **common: Unpack[_Common],
) -> StepSpec:
    """A ``condition`` step (document keys ``if``, ``then``, ``else``)."""
    own = {
        "if": _guard(if_, f"step '{step_id}' if_"),
        "then": _step_list(then, f"step '{step_id}' then"),
        "else": None if else_ is None else _step_list(else_, f"step '{step_id}' else_"),
    }
    return _spec(step_id, "condition", own, common)


def write_kb(
    step_id: str,
    *,
    kb: Any,
    key: Any,
    content: Any,
    title: Any = None,
    **common: Unpack[_Common],
) -> StepSpec:
    """A ``write_kb`` step: upserts a knowledge-base document (every field a template)."""
    own = {"kb": _copy(kb), "key": _copy(key), "title": _copy(title), "content": _copy(content)}
    return _spec(step_id, "write_kb", own, common)


def handoff(
    step_id: str, *, group: str, message: Any = None, **common: Unpack[_Common]
) -> StepSpec:
    """A ``handoff`` step: notifies the users of ``group``; never blocks."""
    return _spec(step_id, "handoff", {"group": group, "message": _copy(message)}, common)


def mcp_tool(
    step_id: str,
    *,
    server: str,
    tool: str,
    arguments: Any = None,
    **common: Unpack[_Common],
) -> StepSpec:
    """An ``mcp_tool`` step: calls ``tool`` on the MCP ``server`` with ``arguments``."""
    own = {"server": server, "tool": tool, "arguments": _copy(arguments)}
    return _spec(step_id, "mcp_tool", own, common)


def http(
    step_id: str,
    *,
    method: str,
    url: Any,
    headers: Any = None,
    body: Any = None,
    **common: Unpack[_Common],
) -> StepSpec:
    """An ``http`` step: 429, 5xx, time-outs and connection errors are retryable."""
    own = {"method": method, "url": _copy(url), "headers": _copy(headers), "body": _copy(body)}
    return _spec(step_id, "http", own, common)


def _nested(spec: Mapping[str, Any]) -> Iterator[Any]:
    """The step specs nested directly inside ``spec``."""
    branches = spec.get("branches")
    if isinstance(branches, Mapping):
        yield from branches.values()
    for key in ("do", "then", "else"):
        if key in spec:
            yield spec[key]


def step_ids(value: Any) -> Iterator[str]:
    """Every step id in a spec or list of specs, nested ones included, in document order."""
    if isinstance(value, list | tuple):
        for item in value:
            yield from step_ids(item)
    elif isinstance(value, Mapping):
        if isinstance(value.get("id"), str):
            yield value["id"]
        for inner in _nested(value):
            yield from step_ids(inner)
