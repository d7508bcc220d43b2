"""The worker's task: run one attempt of a step. Thin: the id in, the service does the rest."""

from __future__ import annotations

import os
from typing import Any

from celery import Task, shared_task
from celery.exceptions import Retry

from . import execution


@shared_task(name="workers.execute_step", bind=True, ignore_result=True)
def execute_step(self: Task[Any, Any], step_run_id: int) -> str:
    """Idempotent: a duplicate delivery finds the attempt claimed and does nothing. Its own
    attempt handed back (this worker lacks the handler), it ends RETRY."""
    worker = f"{self.request.hostname or 'worker'}:{os.getpid()}"
    _, soft_limit = self.request.timelimit or (None, None)
    queue = (self.request.delivery_info or {}).get("routing_key")
    try:
        return execution.execute(step_run_id, worker=worker, soft_limit=soft_limit, queue=queue)
    except execution.HandedBack as handed_back:
        # Celery's own "this message will be delivered again" (task-retried: RETRY in
        # Flower, the reason as its exception), without Celery sending it again: the
        # attempt is offered again by the engine. Returning showed SUCCESS; Ignore sends no
        # event (STARTED for ever); Reject(requeue=False) sends task-failed (FAILURE, and
        # task_failure: an alert for a routine hand-back) and its task-rejected ranks below
        # STARTED in Celery's event state.
        raise Retry(str(handed_back), exc=handed_back) from None
