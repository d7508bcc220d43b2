"""The workers' tasks: run one attempt of a step; embed a knowledge-base document and sweep
for those a lost message left unembedded. Thin: the id in, the service does the rest."""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Task, shared_task
from celery.exceptions import Retry

from . import batches, execution, kb_embed, notify, providers

logger = logging.getLogger(__name__)


@shared_task(name="workers.execute_step", bind=True, ignore_result=True)
def execute_step(self: Task[Any, Any], step_run_id: int, more: list[int] | None = None) -> str:
    """Idempotent: a duplicate delivery finds the attempt claimed and does nothing. Its own
    attempt handed back (this worker lacks the handler), it ends RETRY. ``more``: attempts
    of the same fan-out sent in the same message, run after it (workers.batches)."""
    worker = f"{self.request.hostname or 'worker'}:{os.getpid()}"
    _, soft_limit = self.request.timelimit or (None, None)
    delivery = self.request.delivery_info or {}
    queue = delivery.get("routing_key")
    try:
        return execution.execute(
            step_run_id,
            worker=worker,
            soft_limit=soft_limit,
            queue=queue,
            more=batches.bounded(more),
            priority=delivery.get("priority"),
        )
    except execution.HandedBack as handed_back:
        # Celery's own "this message will be delivered again" (task-retried: RETRY in
        # Flower, the reason as its exception), without Celery sending it again: the
        # attempt is offered again by the engine. Returning showed SUCCESS; Ignore sends no
        # event (STARTED for ever); Reject(requeue=False) sends task-failed (FAILURE, and
        # task_failure: an alert for a routine hand-back) and its task-rejected ranks below
        # STARTED in Celery's event state.
        raise Retry(str(handed_back), exc=handed_back) from None


@shared_task(name="workers.advance_runs", bind=True, ignore_result=True, acks_late=True)
def advance_runs(self: Task[Any, Any], run_ids: list[str]) -> int:
    """A batch of fired timers' runs (the timer tick's): advance each, and run its next step
    here when this worker serves it. Idempotent: an advance plans from the journal under the
    run's lock, and a claimed attempt is not claimed again."""
    worker = f"{self.request.hostname or 'worker'}:{os.getpid()}"
    _, soft_limit = self.request.timelimit or (None, None)
    # The queues this worker consumes (-Q, or every declared one): an attempt for another
    # queue goes to the workers that consume it.
    queues = set(self.app.amqp.queues.consume_from)
    return execution.advance_and_execute(
        run_ids, worker=worker, queues=queues, soft_limit=soft_limit
    )


# Back-off of a document's embedding after a retryable failure: 10 s, 20 s, ... at most
# 5 minutes, 6 tries in all; then the sweep sends it again later (kb_embed.QUEUED_FOR_S).
EMBED_RETRIES = 5
EMBED_BACKOFF_S = 10
EMBED_BACKOFF_MAX_S = 300


@shared_task(name="workers.embed_kb_document", bind=True, ignore_result=True, acks_late=True)
def embed_kb_document(self: Task[Any, Any], document_id: int) -> str:
    """Embed one knowledge-base document version (kb_embed.embed_document). Idempotent: a
    version embedded already is not sent to the model again."""
    try:
        return kb_embed.embed_document(document_id)
    except providers.ModelError as error:
        model = (providers.embeddings_model() or providers.EmbeddingsModel("?", None)).name
        tries = self.request.retries
        if error.error_class == "retryable" and tries < EMBED_RETRIES:
            backoff = min(EMBED_BACKOFF_MAX_S, EMBED_BACKOFF_S * 2**tries)
            wait = max(backoff, (error.retry_after_ms or 0) / 1000)
            logger.warning(
                "knowledge-base embedding of document %s by %s failed (try %d), again in %gs: %s",
                document_id,
                model,
                tries + 1,
                wait,
                error,
            )
            raise self.retry(countdown=wait, max_retries=EMBED_RETRIES) from None
        logger.error(
            "knowledge-base embedding of document %s by %s failed, %s: %s",
            document_id,
            model,
            error.error_class if error.error_class == "fatal" else f"after {tries + 1} tries",
            error,
        )
        kb_embed.remember_failure(document_id, model, str(error))
        return "failed"


@shared_task(name="workers.sweep_kb_embeddings", ignore_result=True)
def sweep_kb_embeddings() -> int:
    """Beat: send the current versions still missing an embedding (kb_embed.sweep)."""
    return kb_embed.sweep()


@shared_task(name="workers.deliver_notification", ignore_result=True, acks_late=True)
def deliver_notification(delivery_id: int) -> str:
    """One attempt at a run-end webhook; a failed attempt sends the next itself, after its
    back-off (workers.notify). Idempotent: a message for a row claimed, not due or settled
    sends nothing."""
    return notify.deliver(delivery_id)
