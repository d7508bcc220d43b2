"""The worker's task: run one attempt of a step. Thin: the id in, the service does the rest."""

from __future__ import annotations

import os

from celery import shared_task
from celery.exceptions import Ignore

from . import execution


@shared_task(name="workers.execute_step", bind=True, ignore_result=True)
def execute_step(self, step_run_id: int) -> str:
    """Idempotent: a duplicate delivery finds the attempt claimed and does nothing. Its own
    attempt handed back (this worker lacks the handler), it ends REJECTED."""
    worker = f"{self.request.hostname or 'worker'}:{os.getpid()}"
    _, soft_limit = self.request.timelimit or (None, None)
    queue = (self.request.delivery_info or {}).get("routing_key")
    try:
        return execution.execute(step_run_id, worker=worker, soft_limit=soft_limit, queue=queue)
    except execution.HandedBack as handed_back:
        # Not SUCCESS in Flower: REJECTED (see report_handed_back).
        execution.report_handed_back(self, str(handed_back))
        raise Ignore(str(handed_back)) from None
