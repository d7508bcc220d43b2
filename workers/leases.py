"""Lease renewal: one thread per worker process renews the leases of the attempts it runs.

A lapsed lease is how the engine learns that a worker was lost (its process killed, its
machine gone): the attempt is then failed as ``lost`` and, for ``at_least_once`` steps,
offered again. So while a body runs, its lease must be renewed; one long-lived thread does
it for every attempt of the process, which costs a step nothing when it is short.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from datetime import datetime

from django.conf import settings
from django.db import connection
from django.utils import timezone

from runs.models import StepRun
from runs.status import StepStatus

from .claims import lease_until

logger = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self) -> None:
        self._held: dict[int, tuple[uuid.UUID, datetime]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None

    def hold(self, step_run_id: int, claim: uuid.UUID, deadline: datetime) -> None:
        with self._lock:
            self._held[step_run_id] = (claim, deadline)
            # Threads do not survive a fork: a pool process starts its own on first use.
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
                self._thread.start()

    def release(self, step_run_id: int) -> None:
        with self._lock:
            self._held.pop(step_run_id, None)

    def held(self) -> dict[int, tuple[uuid.UUID, datetime]]:
        with self._lock:
            return dict(self._held)

    def renew(self) -> int:
        """Renew every held lease once; returns how many were renewed."""
        renewed = 0
        for step_run_id, (claim, deadline) in self.held().items():
            renewed += StepRun.objects.filter(
                id=step_run_id, status=StepStatus.RUNNING, claim=claim
            ).update(lease_expires_at=lease_until(timezone.now(), deadline))
        return renewed

    def _run(self) -> None:
        stop = threading.Event()
        while not stop.wait(settings.DJFLOW["LEASE_SECONDS"] / 3):
            if not self.held():
                continue
            try:
                self.renew()
            except Exception:  # a database blip: close, and the next round reconnects
                logger.warning("lease renewal failed", exc_info=True)
                connection.close()


keeper = LeaseKeeper()
