"""A workflow of ``tests/test_standalone.py`` (loaded with WORKFLOW_MODULES): a parallel, then
a foreach, so that the embedded default's chords (the SQLAlchemy result backend's
``celery.chord_unlock``) carry a fan-out of each kind. Bodies touch no database: the embedded
default is SQLite."""

from __future__ import annotations

from workflows import registry
from workflows.sdk import parallel, task, workflow

fanned = workflow("standalone_fanned", limits={"run_timeout_ms": 120_000})
fanned.add(
    parallel(
        "both",
        branches={name: task(f"branch_{name}", input={"name": name}) for name in ("a", "b")},
    )
)
fanned.foreach("fan", items="${input.items}", do=task("item", input={"item": "${item}"}))

registry.register("standalone_fanned", "branch_a", lambda ctx, input, prior: input["name"])
registry.register("standalone_fanned", "branch_b", lambda ctx, input, prior: input["name"])
registry.register("standalone_fanned", "item", lambda ctx, input, prior: input["item"] * 2)
