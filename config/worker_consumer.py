"""The worker's consumer (``CELERY_WORKER_CONSUMER``): Celery's own, kept alive through a
broker restart.

When the broker connection breaks, Celery 5.7 first collects the broken connection (which
closes its channels and detaches its transport) and then closes it again. With kombu 5.7's
Redis transport, a channel that was polling (BRPOP) when the connection broke is left half
closed by the first pass; the second pass drops its Redis pool and tries to requeue its
unacknowledged messages (``acks_late`` tasks still running) through the detached transport:
``AttributeError``, which Celery does not ignore there, and the worker's main process dies
("Unrecoverable error"). Ignoring that error is not enough: the channel is left with no pool,
and the next task to finish dies the same way when its message is acknowledged. Found by
``tests/runs/test_recovery_e2e.py`` restarting Redis mid-run.

So a connection that was collected is not closed again: collecting it released it already,
and its channels keep their Redis pools, through which the tasks still running acknowledge
their messages once the broker is back (or log that they could not). A close that does run
(collecting failed half way) and fails is logged: the consumer goes on to reconnect either
way. Nothing the engine needs is lost with the broken connection: the reconciler offers again
what is left ``scheduled``.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer

logger = logging.getLogger(__name__)


class Consumer(CeleryConsumer):
    def on_connection_error_after_connected(self, exc: Exception) -> None:
        broken = self.connection
        if broken is not None:
            close = broken.close

            def close_once(*args: Any, **kwargs: Any) -> None:
                # kombu's Connection.collect() leaves it with no transport (``_transport``
                # is private; the public ``transport`` would create a new one).
                if broken._transport is None:
                    return
                try:
                    close(*args, **kwargs)
                except Exception:
                    logger.warning("closing the broken broker connection failed", exc_info=True)

            # Only this connection, which Celery drops right after closing it.
            broken.close = close_once
        super().on_connection_error_after_connected(exc)
