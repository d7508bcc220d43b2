"""Test-only tasks that report from inside a real worker; ``--include tests.celery_probe``.

They write to Redis (the test broker's database, under ``probe:`` keys; the result backend's
when the broker is RabbitMQ) rather than return results, so a test reads what happened
without waiting on Celery's result reader.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import shared_task
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection


def probe_redis() -> redis.Redis:
    for url in (settings.CELERY_BROKER_URL, settings.CELERY_RESULT_BACKEND):
        if url.startswith(("redis://", "rediss://")):
            return redis.Redis.from_url(url)
    raise RuntimeError("the probes need Redis as the broker or the result backend")


@shared_task(name="tests.celery_probe.report", ignore_result=True)
def report(key: str) -> None:
    """Record where the task ran: the process, the database and the users it can see."""
    usernames = sorted(get_user_model().objects.values_list("username", flat=True))
    value = {"pid": os.getpid(), "database": connection.settings_dict["NAME"], "users": usernames}
    probe_redis().set(key, json.dumps(value), ex=300)


@shared_task(name="tests.celery_probe.hold", ignore_result=True)
def hold(key: str, seconds: float) -> None:
    """Say it started (with its pid), then keep a pool process busy."""
    probe_redis().set(key, os.getpid(), ex=300)
    time.sleep(seconds)
