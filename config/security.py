"""Limits on who may knock how often: the API's request rates and the sign-in lockout.

Both count in a store every process shares. The API's throttles count in Django's cache
(``CACHE_URL``: the database by default, Redis when set): a per-process memory cache would
give each gunicorn worker and each process of the standalone its own count, so N processes
would allow N times the rate. Failed sign-ins are counted by django-axes in the database.
"""

from __future__ import annotations

import time
from typing import Any

from axes.backends import AxesStandaloneBackend
from django.conf import settings
from django.core.cache import DEFAULT_CACHE_ALIAS, caches
from django.core.cache import cache as default_cache
from django.core.cache.backends.db import DatabaseCache
from django.db import connections, router, transaction
from django.http import HttpRequest
from rest_framework import throttling
from rest_framework.settings import api_settings


class LoginLockoutBackend(AxesStandaloneBackend):
    """django-axes's check, for sign-ins that come over HTTP (the sign-in page, the admin's).

    ``authenticate()`` without a request (``manage.py shell``, a script on the server) is not a
    sign-in from the network: there is no address to count and nobody to lock out, so it goes
    on to the next backend instead of failing as upstream's does.
    """

    def authenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> None:
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)


def client_ip(request: HttpRequest) -> str | None:
    """The address a sign-in came from: ``REMOTE_ADDR``, or behind ``DJFLOW_TRUSTED_PROXIES``
    proxies the address the outermost of them saw (each appends the address it received from
    to ``X-Forwarded-For``; what a client wrote to the left of that may be forged)."""
    proxies = settings.DJFLOW_TRUSTED_PROXIES
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if proxies and forwarded:
        hops = [hop.strip() for hop in forwarded.split(",") if hop.strip()]
        if hops:
            return hops[-min(proxies, len(hops))]
    return request.META.get("REMOTE_ADDR")


class _RatesFromSettings:
    """DRF binds its rates when the throttle module is imported; these read them on each
    request, so a changed setting (a test's) applies."""

    scope: str

    def get_rate(self) -> str | None:
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)


class _FixedWindow(_RatesFromSettings):
    """A count per client and window (the rate's period, aligned to the epoch), incremented
    atomically in the shared cache, instead of DRF's history: DRF reads the client's list of
    request times, appends one and writes it back, so requests at once all read the same list
    and all pass (768 in 41 s against 600/min, from parallel clients).

    Invariant: within one window, at most ``num_requests`` requests of a client pass, however
    many arrive at once and in however many processes (:func:`count_hit`). A client may make
    up to twice the rate across a window's boundary (the end of one, the start of the next);
    Retry-After is the time left in the window."""

    rate: str | None
    num_requests: int
    duration: int
    cache: Any
    key: str | None
    # get_cache_key is DRF's (the User and Anon throttles below): "throttle_<scope>_<ident>".

    def allow_request(self, request: Any, view: Any) -> bool:
        if self.rate is None:
            return True
        self.key = self.get_cache_key(request, view)
        if self.key is None:
            return True
        now = time.time()
        window = int(now // self.duration)
        self._left = (window + 1) * self.duration - now
        # The window after the key (the key's start is DRF's, which the cache culls by).
        # DRF's cache is Django's proxy of the default alias: the backend itself, to tell
        # which atomic count it has.
        cache = caches[DEFAULT_CACHE_ALIAS] if self.cache is default_cache else self.cache
        count = count_hit(cache, f"{self.key}:{window}", self.duration)
        return count <= self.num_requests

    def wait(self) -> float | None:
        return max(self._left, 1.0)


def count_hit(cache: Any, key: str, seconds: int) -> int:
    """Count one hit of ``key`` (kept ``seconds`` and a little) and return the new count,
    atomically: Redis's INCR, the local memory's lock, and on the database cache the key's
    row locked (``SELECT ... FOR UPDATE``) for its read and write. Other caches (the files
    of the embedded default, one host) count as Django's ``incr`` does: a read and a write."""
    ttl = seconds + 1
    if isinstance(cache, DatabaseCache):
        return _count_in_database(cache, key, ttl)
    for _ in range(3):
        cache.add(key, 0, ttl)
        try:
            return int(cache.incr(key))
        except ValueError:
            continue  # expired between the add and the increment: add it again
    return 1


def _count_in_database(cache: DatabaseCache, key: str, ttl: int) -> int:
    db = router.db_for_write(cache.cache_model_class)
    connection = connections[db]
    # The row first (an insert that loses to another's is a no-op), so there is one to lock.
    cache.add(key, 0, ttl)
    with transaction.atomic(using=db):
        if connection.features.has_select_for_update:
            table = connection.ops.quote_name(cache._table)
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT cache_key FROM {table} WHERE cache_key = %s FOR UPDATE",
                    [cache.make_and_validate_key(key)],
                )
        count = int(cache.get(key) or 0) + 1
        cache.set(key, count, ttl)
    return count


class UserRateThrottle(_FixedWindow, throttling.UserRateThrottle):
    """Requests per signed-in user (token or session): ``DJFLOW_API_THROTTLE_USER``."""


class AnonRateThrottle(_FixedWindow, throttling.AnonRateThrottle):
    """Anonymous requests per client address: ``DJFLOW_API_THROTTLE_ANON``."""
