"""The process-wide registry of step handlers and workflow builders.

A ``task`` or ``agent`` step runs the Python function registered under its key: the step's
``handler`` name when the document gives one, else ``"<workflow id>.<step id>"`` (contract
section 1). Both live in one namespace, so ``{"handler": "support_ticket.classify"}`` finds the
function that ``@support.step("classify")`` registered.

Handlers are found by name only. A worker never imports a dotted path that came from the
database: what it can run is exactly what its own ``WORKFLOW_MODULES`` registered.

Invariants:

- one key holds one function. Registering a different function under a taken key raises
  ``ValueError``, unless it is the same object or has the same ``__module__`` and
  ``__qualname__`` (a module reloaded in development), in which case the newer one replaces it;
- one workflow id holds one builder, by the same rule: a builder created again by the module
  that created it first replaces it in place, a builder from another module raises.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .builder import Workflow

Handler = Callable[..., Any]

_lock = threading.RLock()
_handlers: dict[str, Handler] = {}
_builders: dict[str, Workflow] = {}


def handler_key(workflow_id: str, step_id: str) -> str:
    """The key a step without a ``handler`` name is looked up by."""
    return f"{workflow_id}.{step_id}"


def step_handler(workflow_id: str, step_id: str, handler_name: str | None = None) -> str:
    """The handler a step runs: its ``handler`` name when it gives one (only that name:
    falling back would run a function the document did not ask for), else
    ``<workflow>.<step>``. Workers, the start check and the unservable wait all ask here."""
    return handler_name if handler_name else handler_key(workflow_id, step_id)


def _identity(fn: object) -> tuple[str | None, str | None]:
    return getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)


def _same_definition(old: object, new: object) -> bool:
    if old is new:
        return True
    module, qualname = _identity(new)
    return module is not None and qualname is not None and _identity(old) == (module, qualname)


def _describe(fn: object) -> str:
    module, qualname = _identity(fn)
    if module and qualname:
        return f"{module}.{qualname}"
    return repr(fn)


def _register(key: str, fn: Handler, what: str) -> None:
    if not callable(fn):
        raise TypeError(f"the handler for {what} must be callable, got {fn!r}")
    with _lock:
        old = _handlers.get(key)
        if old is not None and not _same_definition(old, fn):
            raise ValueError(
                f"a different handler is already registered for {what}: "
                f"{_describe(old)} (now {_describe(fn)})"
            )
        _handlers[key] = fn


def register(workflow_id: str, step_id: str, fn: Handler) -> None:
    """Register ``fn`` for the step ``step_id`` of ``workflow_id``."""
    _register(
        handler_key(workflow_id, step_id),
        fn,
        f"step '{step_id}' of workflow '{workflow_id}' (key '{handler_key(workflow_id, step_id)}')",
    )


def register_named(name: str, fn: Handler) -> None:
    """Register ``fn`` under a handler name that steps can give as ``"handler": name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a handler name must be a non-empty string, got {name!r}")
    _register(name, fn, f"handler name '{name}'")


def lookup(workflow_id: str, step_id: str, handler_name: str | None = None) -> Handler | None:
    """The function that runs this step here, or ``None`` when this process has none.

    A step's ``handler`` name wins: when it is given, only that name is looked up. Falling
    back to ``<workflow>.<step>`` would run a function the document did not ask for; a
    worker without the named handler answers ``unservable`` so another worker can take it.
    """
    key = step_handler(workflow_id, step_id, handler_name)
    with _lock:
        return _handlers.get(key)


def handler_names() -> list[str]:
    """Every registered key, sorted: the handlers this process can serve."""
    with _lock:
        return sorted(_handlers)


def add_builder(builder: Workflow) -> None:
    """Record a builder; called by ``workflows.builder.Workflow`` when it is created."""
    with _lock:
        old = _builders.get(builder.id)
        if old is not None and old is not builder and old.module != builder.module:
            raise ValueError(
                f"workflow '{builder.id}' is already defined by module '{old.module}' "
                f"(now also by '{builder.module}'); a workflow id is defined in one place"
            )
        # Replacing keeps the first position: dicts keep the insertion order of a key.
        _builders[builder.id] = builder


def builders() -> list[Workflow]:
    """Every builder created in this process, one per workflow id, in creation order."""
    with _lock:
        return list(_builders.values())


def clear() -> None:
    """Forget every handler and builder. For tests."""
    with _lock:
        _handlers.clear()
        _builders.clear()


@dataclass(frozen=True)
class Snapshot:
    handlers: dict[str, Handler] = field(default_factory=dict)
    builders: dict[str, Workflow] = field(default_factory=dict)


def snapshot() -> Snapshot:
    """The registry's current content, to :func:`restore` after a test."""
    with _lock:
        return Snapshot(dict(_handlers), dict(_builders))


def restore(state: Snapshot) -> None:
    with _lock:
        _handlers.clear()
        _handlers.update(state.handlers)
        _builders.clear()
        _builders.update(state.builders)


def override(name: str, fn: Handler) -> None:
    """Put ``fn`` under ``name`` whatever holds it: the ``djflow`` fixture's stubs
    (``workflows.testing``), undone by :func:`restore` at the end of the test."""
    if not callable(fn):
        raise TypeError(f"the handler for '{name}' must be callable, got {fn!r}")
    with _lock:
        _handlers[name] = fn
