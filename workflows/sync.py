"""Saving every builder's document: what ``manage.py sync_workflows`` and worker start-up
(``config/celery.py``) do with ``WORKFLOW_MODULES``.

The modules are imported here, after Django is set up; each builder they create records itself
in :mod:`workflows.registry`, and its document is saved through :mod:`workflows.client`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import client, registry
from .errors import EngineError

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

    from .services import SaveResult

__all__ = ["SyncError", "sync_modules"]


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

    builders = registry.builders()
    results: dict[str, SaveResult] = {}
    failures: dict[str, EngineError] = {}
    pending = builders
    while pending:
        failures = {}
        for builder in pending:
            try:
                results[builder.id] = client.document_save(document=builder.document(), user=user)
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
