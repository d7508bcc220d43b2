"""The workflow builder: :class:`Workflow` collects steps into one document and registers
their Python handlers (contract section 6).

Every method that adds a step is made from the module-level constructor of its kind
(:mod:`workflows.steps`) by :func:`_adds_step` or :func:`_decorates_step`: the method takes
the constructor's arguments, so its signature, docstring and checks are the constructor's,
written once. ``wf.sleep("nap", ms=5)`` is ``wf.add(steps.sleep("nap", ms=5))``.

Saving the document and starting a run go through :mod:`workflows.client`, the one module of
``workflows`` that talks to ``runs``. This module imports no Django model: a settings or
Celery module may import it before the app registry is ready.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from . import client, registry, steps
from .steps import StepSpec

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

    from .services import SaveResult

__all__ = ["Workflow", "handler", "workflow"]

F = TypeVar("F", bound=Callable[..., Any])
P = ParamSpec("P")


def _method_signature(constructor: Callable[..., StepSpec], returns: str) -> inspect.Signature:
    """The constructor's signature with ``self`` in front: without it ``help()`` and
    ``inspect.signature`` would follow ``__wrapped__`` to the constructor and, for a bound
    method, drop its first parameter (the step id) as if it were ``self``."""
    signature = inspect.signature(constructor)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    return signature.replace(
        parameters=[this, *signature.parameters.values()], return_annotation=returns
    )


def _named(method: Callable[..., Any], name: str) -> None:
    """Name a method made from a constructor as the class attribute it is bound to."""
    method.__module__ = __name__
    method.__name__ = name
    method.__qualname__ = f"Workflow.{name}"


def _adds_step(
    constructor: Callable[P, StepSpec], name: str | None = None
) -> Callable[Concatenate[Workflow, P], Workflow]:
    """A :class:`Workflow` method that appends the step ``constructor`` builds and returns the
    builder, so calls chain; ``name`` is the method's name when it is not the constructor's."""

    @functools.wraps(constructor)
    def add_step(self: Workflow, /, *args: P.args, **kwargs: P.kwargs) -> Workflow:
        return self.add(constructor(*args, **kwargs))

    _named(add_step, name or constructor.__name__)
    add_step.__doc__ = (
        f"{constructor.__doc__}\n\nAdds the step and returns the builder, so calls chain."
    )
    add_step.__signature__ = _method_signature(constructor, "Workflow")  # type: ignore[attr-defined]
    return add_step


def _decorates_step(
    constructor: Callable[P, StepSpec], name: str, doc: str
) -> Callable[Concatenate[Workflow, P], Callable[[F], F]]:
    """A :class:`Workflow` decorator method: the step ``constructor`` builds is added with the
    decorated function as its handler. The step is built when the method is called, so a bad
    argument raises there, before any function is decorated."""

    @functools.wraps(constructor)
    def decorator(self: Workflow, /, *args: P.args, **kwargs: P.kwargs) -> Callable[[F], F]:
        spec = constructor(*args, **kwargs)

        def decorate(fn: F) -> F:
            if not callable(fn):
                raise TypeError(f"step '{spec['id']}' decorates a callable, got {fn!r}")
            self._append(spec, fn)
            return fn

        return decorate

    _named(decorator, name)
    decorator.__doc__ = doc
    decorator.__signature__ = _method_signature(constructor, "Callable[[F], F]")  # type: ignore[attr-defined]
    return decorator


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
        concurrency: Mapping[str, Any] | None = None,
        notify: Sequence[Mapping[str, Any]] | None = None,
        version: int | None = None,
        module: str | None = None,
    ) -> None:
        steps.check_id(id, "a workflow id")
        self.id = id
        self.version = version
        self.description = description
        self.input_schema = copy.deepcopy(input_schema)
        self.limits = copy.deepcopy(limits)
        self.concurrency = copy.deepcopy(concurrency)
        self.notify = None if notify is None else [dict(entry) for entry in notify]
        # The module that defined the builder: a reload of it replaces the builder, another
        # module defining the same id is an error (see workflows.registry).
        self.module = module or sys._getframe(1).f_globals.get("__name__", "?")
        self._steps: list[StepSpec] = []
        self._ids: set[str] = set()
        self._output: Any = None
        self._on_failure: list[StepSpec] = []
        # The version start() runs, saved on its first call in this process.
        self._saved_version: int | None = None
        registry.add_builder(self)

    def __repr__(self) -> str:
        return f"<Workflow {self.id!r} from {self.module}: {len(self._steps)} steps>"

    # -- adding steps --

    def add(self, spec: Mapping[str, Any]) -> Workflow:
        """Append a step spec (from a constructor of :mod:`workflows.steps`, or a raw dict)."""
        self._append(steps.one_step(spec, f"workflow '{self.id}' step"))
        return self

    def _append(self, spec: StepSpec, fn: Callable[..., Any] | None = None) -> None:
        ids = list(steps.step_ids(spec))
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

    step = _decorates_step(
        steps.task,
        "step",
        """Decorator: add a ``task`` step whose handler is the decorated function.

        The function is registered for (workflow id, step id), and under ``handler`` too when
        that is given, and is returned unchanged.
        """,
    )
    agent = _decorates_step(
        steps.agent, "agent", "Decorator: like :meth:`step`, for an ``agent`` step."
    )

    def handler(self, step_id: str) -> Callable[[F], F]:
        """Decorator: register the handler of a nested task or agent step, adding no step."""
        steps.check_id(step_id)

        def register(fn: F) -> F:
            registry.register(self.id, step_id, fn)
            return fn

        return register

    task = _adds_step(steps.task)
    wait_for = _adds_step(steps.wait_event, "wait_for")
    sleep = _adds_step(steps.sleep)
    sleep_until = _adds_step(steps.sleep_until)
    approval = _adds_step(steps.approval)
    parallel = _adds_step(steps.parallel)
    foreach = _adds_step(steps.foreach)
    loop = _adds_step(steps.loop)
    subworkflow = _adds_step(steps.subworkflow)
    condition = _adds_step(steps.condition)
    recipe = _adds_step(steps.recipe)
    http = _adds_step(steps.http)
    mcp_tool = _adds_step(steps.mcp_tool)
    write_kb = _adds_step(steps.write_kb)
    handoff = _adds_step(steps.handoff)

    def on_failure(self, *specs: Mapping[str, Any]) -> Workflow:
        """Set the document's ``on_failure`` steps (step specs of :mod:`workflows.steps`):
        they run when a step's failure would fail the run, read ``${error}``, and complete
        the run with the last one's output. Register the handlers of their task steps with
        :meth:`handler`. Calling it again replaces them."""
        built = [steps.one_step(spec, f"workflow '{self.id}' on_failure step") for spec in specs]
        if not built:
            raise ValueError(f"workflow '{self.id}': on_failure takes at least one step")
        previous = {step_id for spec in self._on_failure for step_id in steps.step_ids(spec)}
        seen = self._ids - previous
        for spec in built:
            for step_id in steps.step_ids(spec):
                if step_id in seen:
                    raise ValueError(f"step id '{step_id}' is used twice in workflow '{self.id}'")
                seen.add(step_id)
        self._on_failure, self._ids = built, seen
        return self

    def output(self, template: Any) -> Workflow:
        """Set the run's ``output`` template."""
        self._output = copy.deepcopy(template)
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
        if self.concurrency is not None:
            doc["concurrency"] = self.concurrency
        if self.notify is not None:
            doc["notify"] = self.notify
        doc["steps"] = self._steps
        if self._output is not None:
            doc["output"] = self._output
        if self._on_failure:
            doc["on_failure"] = self._on_failure
        return copy.deepcopy(doc)

    def save(self, user: AbstractBaseUser | None = None) -> SaveResult:
        """Save the document as a version: the same body again returns the same version."""
        return client.document_save(document=self.document(), user=user)

    def start(
        self, input: Any, idempotency_key: str | None = None, *, priority: int | None = None
    ) -> Any:
        """Start a run of the version this builder defines; returns the run.

        The document is saved on the first call in this process (the same body keeps its
        version), so the run executes the code that started it, not whatever was saved last.
        """
        if self._saved_version is None:
            self._saved_version = self.save().version.number
        return client.run_start(
            workflow=self.id,
            input=input,
            version=self._saved_version,
            idempotency_key=idempotency_key,
            priority=priority,
        )


def workflow(
    id: str,
    *,
    description: str | None = None,
    input_schema: Mapping[str, Any] | None = None,
    limits: Mapping[str, Any] | None = None,
    concurrency: Mapping[str, Any] | None = None,
    notify: Sequence[Mapping[str, Any]] | None = None,
    version: int | None = None,
) -> Workflow:
    """A builder for the workflow ``id``; the arguments are the document's top-level fields."""
    return Workflow(
        id,
        description=description,
        input_schema=input_schema,
        limits=limits,
        concurrency=concurrency,
        notify=notify,
        version=version,
        module=sys._getframe(1).f_globals.get("__name__", "?"),
    )


def handler(name: str) -> Callable[[F], F]:
    """Register the decorated function under a handler name, for ``task(..., handler=name)``."""

    def register(fn: F) -> F:
        registry.register_named(name, fn)
        return fn

    return register
