"""The Python builder for workflow documents (contract section 6).

```python
from workflows.sdk import workflow, when, RetryPolicy, StepFailure

support = workflow("support_ticket")

@support.step("classify")
def classify(ctx, input, prior):
    ...
```

A builder writes exactly the document a person would write by hand: a keyword left out (or
``None``) is left out of the document, so defaults stay implicit and the same workflow authored
through the builder, the admin or the API is stored as the same version.

Nested steps (``parallel`` branches, ``foreach``/``loop`` ``do``, ``condition`` ``then`` and
``else``) are written with the module-level spec constructors, which return plain step dicts::

    wf.parallel("fan", branches={"a": sdk.task("fetch_a"), "b": sdk.sleep("nap", ms=10)})

    @wf.handler("fetch_a")          # the Python body of the nested task step
    def fetch_a(ctx, input, prior): ...

Raw dicts are accepted wherever a step spec is. This module imports no Django model at import
time: a settings or Celery module may import it before the app registry is ready.
"""

from __future__ import annotations

import copy
import importlib
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar, Unpack

from . import registry

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

    from .services import SaveResult

__all__ = [
    "RetryPolicy",
    "StepFailure",
    "SyncError",
    "Workflow",
    "agent",
    "all_",
    "any_",
    "approval",
    "condition",
    "foreach",
    "handler",
    "handoff",
    "http",
    "loop",
    "mcp_tool",
    "not_",
    "parallel",
    "recipe",
    "send_event",
    "sleep",
    "sleep_until",
    "subworkflow",
    "sync_modules",
    "task",
    "wait_event",
    "wait_for",
    "when",
    "workflow",
    "write_kb",
]

ID_RE = re.compile(r"^[a-z][a-z0-9_]*$")
MAX_DURATION_MS = 315_360_000_000  # 3650 days: the contract's bound on every *_ms field
ERROR_CLASSES = ("retryable", "fatal", "invalid_input", "unservable")
GUARD_OPS = ("eq", "ne", "lt", "lte", "gt", "gte", "in", "exists", "matches")

StepSpec = dict[str, Any]
Guard = dict[str, Any]
Steps = Mapping[str, Any] | Sequence[Mapping[str, Any]]
F = TypeVar("F", bound=Callable[..., Any])


class _Missing:
    def __repr__(self) -> str:
        return "<omitted>"


_MISSING: Any = _Missing()


# --- Retry policies and failures -------------------------------------------------------------


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


class StepFailure(Exception):
    """Raised by a handler to fail its attempt with a chosen error class (contract section 5).

    ``retryable`` is tried again while the retry budget lasts, no sooner than
    ``retry_after_ms``; ``fatal`` and ``invalid_input`` are never retried; ``unservable`` means
    this worker lacks what the step needs, and the attempt is offered to another worker without
    spending the budget.
    """

    def __init__(
        self,
        message: str,
        class_: str = "fatal",
        retry_after_ms: int | None = None,
    ) -> None:
        if class_ not in ERROR_CLASSES:
            raise ValueError(
                f"StepFailure class_ must be one of {', '.join(ERROR_CLASSES)}, got {class_!r}"
            )
        if retry_after_ms is not None and (
            isinstance(retry_after_ms, bool)
            or not isinstance(retry_after_ms, int)
            or not 0 <= retry_after_ms <= MAX_DURATION_MS
        ):
            raise ValueError(
                f"StepFailure retry_after_ms must be an integer from 0 to {MAX_DURATION_MS} "
                f"(3650 days), got {retry_after_ms!r}"
            )
        super().__init__(message)
        self.message = str(message)
        self.error_class = class_
        self.retry_after_ms = retry_after_ms

    def __reduce__(self) -> tuple[Any, ...]:
        # The default reduces to ``StepFailure(message)`` and would lose the class.
        return (type(self), (self.message, self.error_class, self.retry_after_ms))

    def __repr__(self) -> str:
        return f"StepFailure({self.message!r}, class_={self.error_class!r})"

    def as_error(self) -> dict[str, str]:
        return {"class": self.error_class, "message": self.message}


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


def _check_id(step_id: Any, what: str = "step id") -> None:
    if not isinstance(step_id, str) or not ID_RE.match(step_id):
        raise ValueError(f"{what} must match {ID_RE.pattern}, got {step_id!r}")


def _spec(step_id: str, kind: str, own: Mapping[str, Any], common: Mapping[str, Any]) -> StepSpec:
    """A step dict: ``id``, ``kind``, ``input``, the kind's fields, then the common ones."""
    _check_id(step_id)
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


def _one_step(value: Any, where: str) -> StepSpec:
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a step spec (a dict), got {value!r}")
    return copy.deepcopy(dict(value))


def _step_or_steps(value: Any, where: str) -> StepSpec | list[StepSpec]:
    """One step keeps its shape as one dict; a list stays a list."""
    if isinstance(value, Mapping):
        return _one_step(value, where)
    if isinstance(value, list | tuple):
        return [_one_step(item, f"{where}[{i}]") for i, item in enumerate(value)]
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
    prompt: str | None = None,
    model: str | None = None,
    output: Literal["json", "text"] | None = None,
    context: Mapping[str, Any] | None = None,
    **common: Unpack[_Common],
) -> StepSpec:
    """A ``recipe`` step: a stored (``recipe``) or inline (``prompt``) model prompt."""
    own = {
        "recipe": recipe,
        "prompt": prompt,
        "model": model,
        "output": output,
        "context": _copy(context),
    }
    return _spec(step_id, "recipe", own, common)


# The builder's ``recipe`` method has a parameter of the same name that hides this function.
_recipe_spec = recipe


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


def parallel(step_id: str, *, branches: Mapping[str, Steps], **common: Unpack[_Common]) -> StepSpec:
    """A ``parallel`` step: ``branches`` maps a branch name to a step spec (or a list)."""
    if not isinstance(branches, Mapping):
        raise TypeError(f"step '{step_id}' branches must be a dict, got {branches!r}")
    own = {
        "branches": {
            name: _step_or_steps(spec, f"step '{step_id}' branches['{name}']")
            for name, spec in branches.items()
        }
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


def handler(name: str) -> Callable[[F], F]:
    """Register the decorated function under a handler name, for ``task(..., handler=name)``."""

    def register(fn: F) -> F:
        registry.register_named(name, fn)
        return fn

    return register


def _nested(spec: Mapping[str, Any]) -> Iterator[Any]:
    """The step specs nested directly inside ``spec``."""
    branches = spec.get("branches")
    if isinstance(branches, Mapping):
        yield from branches.values()
    for key in ("do", "then", "else"):
        if key in spec:
            yield spec[key]


def _step_ids(value: Any) -> Iterator[str]:
    """Every step id in a spec or list of specs, nested ones included, in document order."""
    if isinstance(value, list | tuple):
        for item in value:
            yield from _step_ids(item)
    elif isinstance(value, Mapping):
        if isinstance(value.get("id"), str):
            yield value["id"]
        for inner in _nested(value):
            yield from _step_ids(inner)


# --- The builder -----------------------------------------------------------------------------


class Workflow:
    """Builds one workflow document; create it with :func:`workflow`.

    Creating a builder records it in :mod:`workflows.registry`, which is how
    ``manage.py sync_workflows`` and worker start-up find the documents to save.
    """

    def __init__(
        self,
        id: str,
        *,
        description: str | None = None,
        input_schema: Mapping[str, Any] | None = None,
        limits: Mapping[str, Any] | None = None,
        version: int | None = None,
        module: str | None = None,
    ) -> None:
        _check_id(id, "a workflow id")
        self.id = id
        self.version = version
        self.description = description
        self.input_schema = _copy(input_schema)
        self.limits = _copy(limits)
        # The module that defined the builder: a reload of it replaces the builder, another
        # module defining the same id is an error (see workflows.registry).
        self.module = module or sys._getframe(1).f_globals.get("__name__", "?")
        self._steps: list[StepSpec] = []
        self._ids: set[str] = set()
        self._output: Any = None
        # The version start() runs, saved on its first call in this process.
        self._saved_version: int | None = None
        registry.add_builder(self)

    def __repr__(self) -> str:
        return f"<Workflow {self.id!r} from {self.module}: {len(self._steps)} steps>"

    # -- adding steps --

    def add(self, spec: Mapping[str, Any]) -> Workflow:
        """Append a step spec (from a constructor of this module, or a raw dict)."""
        self._append(_one_step(spec, f"workflow '{self.id}' step"))
        return self

    def _append(self, spec: StepSpec, fn: Callable[..., Any] | None = None) -> None:
        ids = list(_step_ids(spec))
        seen = set(self._ids)
        for step_id in ids:
            if step_id in seen:
                raise ValueError(f"step id '{step_id}' is used twice in workflow '{self.id}'")
            seen.add(step_id)
        # Register before appending so that a handler conflict leaves the document unchanged.
        if fn is not None:
            registry.register(self.id, spec["id"], fn)
            if spec.get("handler"):
                registry.register_named(spec["handler"], fn)
        self._steps.append(spec)
        self._ids = seen

    def step(
        self, step_id: str, *, handler: str | None = None, **common: Unpack[_Common]
    ) -> Callable[[F], F]:
        """Decorator: add a ``task`` step whose handler is the decorated function.

        The function is registered for (workflow id, step id), and under ``handler`` too when
        that is given, and is returned unchanged.
        """
        spec = task(step_id, handler=handler, **common)
        return self._decorator(spec)

    def agent(
        self, step_id: str, *, handler: str | None = None, **common: Unpack[_Common]
    ) -> Callable[[F], F]:
        """Decorator: like :meth:`step`, for an ``agent`` step."""
        spec = agent(step_id, handler=handler, **common)
        return self._decorator(spec)

    def _decorator(self, spec: StepSpec) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            if not callable(fn):
                raise TypeError(f"step '{spec['id']}' decorates a callable, got {fn!r}")
            self._append(spec, fn)
            return fn

        return decorate

    def handler(self, step_id: str) -> Callable[[F], F]:
        """Decorator: register the handler of a nested task or agent step, adding no step."""
        _check_id(step_id)

        def register(fn: F) -> F:
            registry.register(self.id, step_id, fn)
            return fn

        return register

    def task(
        self, step_id: str, *, handler: str | None = None, **common: Unpack[_Common]
    ) -> Workflow:
        """Add a ``task`` step whose handler is registered elsewhere (e.g. another worker)."""
        return self.add(task(step_id, handler=handler, **common))

    def wait_for(
        self,
        step_id: str,
        *,
        event: str,
        key: Any = None,
        timeout_ms: int | None = None,
        **common: Unpack[_CommonBase],
    ) -> Workflow:
        return self.add(wait_event(step_id, event=event, key=key, timeout_ms=timeout_ms, **common))

    def sleep(self, step_id: str, *, ms: int, **common: Unpack[_Common]) -> Workflow:
        return self.add(sleep(step_id, ms=ms, **common))

    def sleep_until(self, step_id: str, *, until: Any, **common: Unpack[_Common]) -> Workflow:
        return self.add(sleep_until(step_id, until=until, **common))

    def approval(
        self,
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
    ) -> Workflow:
        return self.add(
            approval(
                step_id,
                approvers=approvers,
                quorum=quorum,
                timeout_ms=timeout_ms,
                message=message,
                remind_after_ms=remind_after_ms,
                escalate_to=escalate_to,
                email_details=email_details,
                **common,
            )
        )

    def parallel(
        self, step_id: str, *, branches: Mapping[str, Steps], **common: Unpack[_Common]
    ) -> Workflow:
        return self.add(parallel(step_id, branches=branches, **common))

    def foreach(
        self,
        step_id: str,
        *,
        items: str | Sequence[Any],
        do: Steps,
        max_items: int | None = None,
        concurrency: int | None = None,
        **common: Unpack[_Common],
    ) -> Workflow:
        return self.add(
            foreach(
                step_id,
                items=items,
                do=do,
                max_items=max_items,
                concurrency=concurrency,
                **common,
            )
        )

    def loop(
        self,
        step_id: str,
        *,
        do: Steps,
        max_iterations: int,
        until: Guard | None = None,
        **common: Unpack[_Common],
    ) -> Workflow:
        return self.add(loop(step_id, do=do, max_iterations=max_iterations, until=until, **common))

    def subworkflow(
        self,
        step_id: str,
        *,
        workflow: str,
        version: int | None = None,
        **common: Unpack[_Common],
    ) -> Workflow:
        return self.add(subworkflow(step_id, workflow=workflow, version=version, **common))

    def condition(
        self,
        step_id: str,
        *,
        if_: Guard,
        then: Steps,
        else_: Steps | None = None,
        **common: Unpack[_Common],
    ) -> Workflow:
        return self.add(condition(step_id, if_=if_, then=then, else_=else_, **common))

    def recipe(
        self,
        step_id: str,
        *,
        recipe: str | None = None,
        prompt: str | None = None,
        model: str | None = None,
        output: Literal["json", "text"] | None = None,
        context: Mapping[str, Any] | None = None,
        **common: Unpack[_Common],
    ) -> Workflow:
        spec = _recipe_spec(
            step_id,
            recipe=recipe,
            prompt=prompt,
            model=model,
            output=output,
            context=context,
            **common,
        )
        return self.add(spec)

    def http(
        self,
        step_id: str,
        *,
        method: str,
        url: Any,
        headers: Any = None,
        body: Any = None,
        **common: Unpack[_Common],
    ) -> Workflow:
        return self.add(http(step_id, method=method, url=url, headers=headers, body=body, **common))

    def mcp_tool(
        self,
        step_id: str,
        *,
        server: str,
        tool: str,
        arguments: Any = None,
        **common: Unpack[_Common],
    ) -> Workflow:
        return self.add(mcp_tool(step_id, server=server, tool=tool, arguments=arguments, **common))

    def write_kb(
        self,
        step_id: str,
        *,
        kb: Any,
        key: Any,
        content: Any,
        title: Any = None,
        **common: Unpack[_Common],
    ) -> Workflow:
        return self.add(write_kb(step_id, kb=kb, key=key, title=title, content=content, **common))

    def handoff(
        self, step_id: str, *, group: str, message: Any = None, **common: Unpack[_Common]
    ) -> Workflow:
        return self.add(handoff(step_id, group=group, message=message, **common))

    def output(self, template: Any) -> Workflow:
        """Set the run's ``output`` template."""
        self._output = _copy(template)
        return self

    # -- the document and what is done with it --

    def document(self) -> dict[str, Any]:
        """The workflow document, as it is stored (a deep copy: editing it changes nothing)."""
        doc: dict[str, Any] = {"id": self.id}
        if self.version is not None:
            doc["version"] = self.version
        if self.description is not None:
            doc["description"] = self.description
        if self.input_schema is not None:
            doc["input_schema"] = self.input_schema
        if self.limits is not None:
            doc["limits"] = self.limits
        doc["steps"] = self._steps
        if self._output is not None:
            doc["output"] = self._output
        return copy.deepcopy(doc)

    def save(self, user: AbstractBaseUser | None = None) -> SaveResult:
        """Save the document as a version: the same body again returns the same version."""
        from .services import definition_save

        return definition_save(document=self.document(), user=user)

    def start(self, input: Any, idempotency_key: str | None = None) -> Any:
        """Start a run of the version this builder defines; returns the run.

        The document is saved on the first call in this process (the same body keeps its
        version), so the run executes the code that started it, not whatever was saved last.
        """
        from runs.services import run_start

        if self._saved_version is None:
            self._saved_version = self.save().version.number
        return run_start(
            workflow=self.id,
            input=input,
            version=self._saved_version,
            idempotency_key=idempotency_key,
        ).run


def workflow(
    id: str,
    *,
    description: str | None = None,
    input_schema: Mapping[str, Any] | None = None,
    limits: Mapping[str, Any] | None = None,
    version: int | None = None,
) -> Workflow:
    """A builder for the workflow ``id``; the arguments are the document's top-level fields."""
    return Workflow(
        id,
        description=description,
        input_schema=input_schema,
        limits=limits,
        version=version,
        module=sys._getframe(1).f_globals.get("__name__", "?"),
    )


def send_event(name: str, key: str, payload: Any = None) -> int:
    """Deliver an event to the runs waiting for (``name``, ``key``), as ``POST
    /api/v1/events`` does: it is stored (a wait reached later still takes it) and the number
    of waits it resumed is returned."""
    from runs.services import event_send

    return event_send(name=name, key=key, payload=payload)[1]


# --- Saving every builder --------------------------------------------------------------------


class SyncError(Exception):
    """Some modules or workflows could not be synced.

    ``saved`` holds what was saved before or beside the failure; ``problems`` one line per
    failing module or workflow.
    """

    def __init__(self, problems: list[str], saved: list[tuple[str, SaveResult]]) -> None:
        self.problems = problems
        self.saved = saved
        super().__init__("\n".join(problems))


def sync_modules(
    modules: Sequence[str], user: AbstractBaseUser | None = None
) -> list[tuple[str, SaveResult]]:
    """Import ``modules`` and save the document of every builder in this process.

    Returns ``(workflow id, SaveResult)`` in builder creation order; saving is idempotent, so
    a second call creates nothing. A module that fails to import raises :class:`SyncError`
    before anything is saved. A document that is rejected is not saved, the others are, and
    :class:`SyncError` then names each rejected workflow with its errors.

    A workflow may call another as a ``subworkflow``, which must exist when it is saved:
    documents rejected in one pass are tried again while the previous pass saved something,
    so the order the builders were created in does not matter.
    """
    problems: list[str] = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            problems.append(f"module '{name}' failed to import: {type(exc).__name__}: {exc}")
    if problems:
        raise SyncError(problems, saved=[])

    from .errors import EngineError
    from .services import definition_save

    builders = registry.builders()
    results: dict[str, SaveResult] = {}
    failures: dict[str, EngineError] = {}
    pending = builders
    while pending:
        failures = {}
        for builder in pending:
            try:
                results[builder.id] = definition_save(document=builder.document(), user=user)
            except EngineError as exc:
                failures[builder.id] = exc
        if len(failures) == len(pending):
            break
        pending = [b for b in pending if b.id in failures]

    saved = [(b.id, results[b.id]) for b in builders if b.id in results]
    if failures:
        for builder in builders:
            if builder.id in failures:
                errors = "; ".join(
                    f"{e.field}: {e.message}" if e.field else e.message
                    for e in failures[builder.id].errors
                )
                problems.append(
                    f"workflow '{builder.id}' (module {builder.module}) was not saved: {errors}"
                )
        raise SyncError(problems, saved=saved)
    return saved
