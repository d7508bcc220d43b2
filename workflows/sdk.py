"""The Python builder for workflow documents (contract section 6): the names users' code
imports, gathered from the modules that do each job.

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

Where each name lives (the project's own code imports from there, never from here):
:mod:`workflows.steps` the step constructors, guards and :class:`RetryPolicy`;
:mod:`workflows.builder` :class:`Workflow`, :func:`workflow` and :func:`handler`;
:mod:`workflows.failures` :class:`StepFailure`, which handlers raise and the worker catches;
:mod:`workflows.client` :func:`send_event` (and a builder's ``save``/``start``);
:mod:`workflows.sync` :func:`sync_modules` and :class:`SyncError`.
"""

from __future__ import annotations

from .builder import Workflow, handler, workflow
from .client import send_event
from .failures import StepFailure
from .steps import (
    RetryPolicy,
    agent,
    all_,
    any_,
    approval,
    condition,
    foreach,
    handoff,
    http,
    loop,
    mcp_tool,
    not_,
    parallel,
    recipe,
    sleep,
    sleep_until,
    subworkflow,
    task,
    wait_event,
    wait_for,
    when,
    write_kb,
)
from .sync import SyncError, sync_modules

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
