"""Per-account model-call slots: at most ``limit`` model calls of one account in flight at
once, across every worker process and machine (CONTRACT section 10, Accounts).

Invariants:

- An account's slots are one Redis sorted set, ``djflow:slots:<account>``: one member per held
  slot (host, pid and a uuid), scored by the slot's expiry in milliseconds of the Redis
  server's own clock (TIME inside the script), so the worker machines' clocks do not matter.
- Taking a slot is one Lua script: drop the expired members, then add ours only while fewer
  than ``limit`` remain. Redis runs a script alone, so two callers never both take the last
  slot.
- A slot lapses ``ttl_seconds`` after it was last pushed forward. One thread per process
  pushes forward every slot the process holds every ``refresh_seconds`` (one pipelined round
  trip), so a live call keeps its slot however long it runs and a killed process's slots
  are free within ``ttl_seconds``. The set's key expires with its latest slot: an account no
  longer used leaves no key behind.
- Leaving ``held()`` frees the slot, whatever ends the block. A release and a refresh never
  cross: a refresh that read the slot finishes before the release removes it, so a released
  slot is never put back.
- Redis unreachable: the call goes ahead uncounted (fail open), with a warning at most once
  per ``warn_every_seconds`` and the counter ``djflow_model_slots_fail_open_total``. For
  ``retry_redis_seconds`` after a failure no call tries Redis, so an outage costs no time-out
  per call; then counting resumes by itself. A call let through uncounted is added to its
  account's set by the next refresh once Redis answers again and there is room, so long
  calls started during an outage count again after it.
- Fork-safe: an instance used in a forked child (Celery's prefork pool) forgets its parent's
  slots and starts its own refresh thread there (checked by ``os.getpid()``).
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
from django.conf import settings
from kombu.utils.url import maybe_sanitize_url
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from runs.metrics import (
    MODEL_CALLS_IN_FLIGHT,
    MODEL_SLOT_WAITS,
    MODEL_SLOTS_FAIL_OPEN,
    never_raises,
)

logger = logging.getLogger(__name__)

KEY_PREFIX = "djflow:slots:"
# Short enough that an unreachable Redis delays a model call by at most about a second
# (connect, or a read that never answers); a healthy one answers in well under a millisecond.
CONNECT_TIMEOUT_SECONDS = 0.5
READ_TIMEOUT_SECONDS = 0.5
# Polling for a free slot: the first pause, doubled up to the last, each with jitter so that
# waiters released together do not all ask again at once.
FIRST_PAUSE_SECONDS = 0.01
LONGEST_PAUSE_SECONDS = 0.2

# KEYS[1]: the account's set. ARGV: the holder, the limit, the ttl in ms.
# Returns 1 when the holder has a slot (taken now, or already held and pushed forward),
# 0 when the set is full. A holder whose slot lapsed gets it back only while there is room.
TAKE_SCRIPT = """
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1])
    or redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  local latest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', KEYS[1], latest[2])
  return 1
end
return 0
"""

# KEYS[1]: the account's set. Returns how many of its slots have not expired.
LIVE_SCRIPT = """
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
"""


class SlotsBusy(Exception):
    """No slot of the account freed within the wait."""

    def __init__(self, account: str, limit: int, waited: float) -> None:
        super().__init__(
            f"account {account!r} has {limit} model calls in flight "
            f"(DJFLOW_MODEL_CONCURRENCY); none finished within {waited:g}s"
        )
        self.account = account
        self.limit = limit
        self.waited = waited


@dataclass(eq=False)
class _Slot:
    account: str
    key: str
    member: str
    # Whether Redis may hold this member: a take was sent (it may have run even when its
    # answer timed out), or a refresh added it.
    maybe_stored: bool = False
    counted: bool = False
    started: float = field(default_factory=time.monotonic)


class AccountSlots:
    """The slots of every account, counted in the Redis at ``redis_url`` (None or "": not
    counted). One instance per process (``slots()``); thread-safe."""

    def __init__(
        self,
        redis_url: str | None,
        limit: int,
        *,
        ttl_seconds: float = 60.0,
        refresh_seconds: float = 15.0,
        retry_redis_seconds: float = 1.0,
        warn_every_seconds: float = 30.0,
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        if not 0 < refresh_seconds < ttl_seconds:
            raise ValueError("refresh_seconds must be above 0 and below ttl_seconds")
        self.limit = limit
        self.ttl_seconds = ttl_seconds
        self.refresh_seconds = refresh_seconds
        self.retry_redis_seconds = retry_redis_seconds
        self.warn_every_seconds = warn_every_seconds
        self.redis_url = redis_url or ""
        self._client: redis.Redis | None = None
        if redis_url:
            self._client = redis.Redis.from_url(
                redis_url,
                socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
                socket_timeout=READ_TIMEOUT_SECONDS,
                # No retries: redis.Redis() retries a refused connection 10 times with back-off
                # by default (4.6 s measured; from_url does not, today), which would hold a
                # model call for seconds instead of failing open at once.
                retry=Retry(NoBackoff(), 0),
            )
            self._take = self._client.register_script(TAKE_SCRIPT)
            self._live = self._client.register_script(LIVE_SCRIPT)
        self._start_process()

    @property
    def counting(self) -> bool:
        """Whether a Redis is configured (reachable or not)."""
        return self._client is not None

    def _start_process(self) -> None:
        """This process's own state: a forked child inherits its parent's, which is not its."""
        self._pid = os.getpid()
        self._lock = threading.Lock()  # guards the fields below
        # Held by a refresh from reading the slots until its round trip ends, and by a
        # release while it forgets its slot: a released slot is never pushed back in.
        self._refresh_lock = threading.Lock()
        self._holding: dict[str, _Slot] = {}
        self._refresher: threading.Thread | None = None
        self._stop = threading.Event()
        self._down_until = -math.inf
        self._down_error: BaseException | None = None
        self._warned_at: dict[str, float] = {}

    def _this_process(self) -> None:
        if os.getpid() != self._pid:
            self._start_process()

    def close(self) -> None:
        """Stop this process's refresh thread (slots still held then lapse after the ttl)."""
        self._stop.set()

    # --- holding a slot -----------------------------------------------------------------------

    @contextmanager
    def held(self, account: str, *, wait_seconds: float) -> Iterator[bool]:
        """Hold one of the account's slots while the block runs; yields True when a slot is
        held, False when the limit is not counted (Redis unreachable: fail open, logged and
        counted; or no Redis configured). Waits up to wait_seconds for a slot (polling with a
        short back-off), then raises SlotsBusy. Releases on exit, whatever happens."""
        self._this_process()
        if self._client is None:
            with _in_flight(account):
                yield False
            return
        slot = _Slot(account=account, key=KEY_PREFIX + account, member=self._new_member())
        try:
            counted = self._take_slot(slot, wait_seconds)
            with self._lock:
                self._holding[slot.member] = slot
            self._ensure_refresher()
            with _in_flight(account):
                yield counted
        finally:
            self._release(slot)

    def in_flight(self, account: str) -> int:
        """How many of the account's slots are live now, in every process (0 without Redis).
        Raises redis' RedisError when Redis is unreachable."""
        if self._client is None:
            return 0
        return int(self._live(keys=[KEY_PREFIX + account]))

    @staticmethod
    def _new_member() -> str:
        return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"

    def _take_slot(self, slot: _Slot, wait_seconds: float) -> bool:
        """True once the slot is taken, False when Redis is unreachable (fail open); raises
        SlotsBusy when the account's slots stay full for wait_seconds."""
        deadline = time.monotonic() + wait_seconds
        pause = FIRST_PAUSE_SECONDS
        while True:
            if self._redis_down():
                self._fail_open(slot.account)
                return False
            slot.maybe_stored = True  # before sending: the script may run whatever we hear
            try:
                taken = self._take(keys=[slot.key], args=[slot.member, self.limit, self._ttl_ms()])
            except RedisError as error:
                self._note_down(error)
                self._fail_open(slot.account)
                return False
            self._note_up()
            if taken:
                slot.counted = True
                if pause > FIRST_PAUSE_SECONDS:  # it waited for this slot
                    _count_wait(slot.account, "taken")
                return True
            slot.maybe_stored = False
            left = deadline - time.monotonic()
            if left <= 0:
                _count_wait(slot.account, "busy")
                raise SlotsBusy(slot.account, self.limit, wait_seconds)
            time.sleep(min(pause * random.uniform(0.5, 1.0), left))
            pause = min(pause * 2, LONGEST_PAUSE_SECONDS)

    def _release(self, slot: _Slot) -> None:
        with self._refresh_lock, self._lock:
            self._holding.pop(slot.member, None)
        if not slot.maybe_stored or self._client is None or self._redis_down():
            return  # never stored, or Redis is away: the slot lapses by itself after the ttl
        try:
            self._client.zrem(slot.key, slot.member)
        except RedisError as error:
            self._note_down(error)
            self._warn(
                "release",
                "model-call slots: could not free a slot of account %r in Redis (%s); it "
                "lapses by itself within %gs",
                slot.account,
                error,
                self.ttl_seconds,
            )
        else:
            self._note_up()

    def _ttl_ms(self) -> int:
        return math.ceil(self.ttl_seconds * 1000)

    # --- refreshing ---------------------------------------------------------------------------

    def _ensure_refresher(self) -> None:
        with self._lock:
            if self._refresher is not None and self._refresher.is_alive():
                return
            self._refresher = threading.Thread(
                target=self._refresh_loop,
                args=(self._stop,),
                name=f"djflow-model-slots-{os.getpid()}",
                daemon=True,
            )
            self._refresher.start()

    def _refresh_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.refresh_seconds):
            try:
                self.refresh()
            except Exception:  # the thread must outlive any one failure
                logger.exception("model-call slots: refresh failed")

    def refresh(self) -> None:
        """Push forward the expiry of every slot this process holds, in one round trip; a
        slot that lapsed (or was never counted) is added again while there is room."""
        if self._client is None or self._redis_down():
            return
        with self._refresh_lock:
            with self._lock:
                holding = list(self._holding.values())
            if not holding:
                return
            pipe = self._client.pipeline(transaction=False)
            for slot in holding:
                slot.maybe_stored = True
                self._take(
                    keys=[slot.key], args=[slot.member, self.limit, self._ttl_ms()], client=pipe
                )
            try:
                results = pipe.execute()
            except RedisError as error:
                self._note_down(error)
                self._warn(
                    "refresh",
                    "model-call slots: could not refresh %d slots in Redis (%s); calls go on",
                    len(holding),
                    error,
                )
                return
        self._note_up()
        for slot, kept in zip(holding, results, strict=True):
            self._note_refreshed(slot, bool(kept))

    @staticmethod
    def _note_refreshed(slot: _Slot, kept: bool) -> None:
        if kept and not slot.counted:
            logger.info("model-call slots: a call of account %r is counted again", slot.account)
        elif slot.counted and not kept:
            logger.warning(
                "model-call slots: a slot of account %r lapsed (its process paused longer than "
                "the ttl, or Redis lost it) and the account is full: the call goes on uncounted",
                slot.account,
            )
        slot.counted = kept

    # --- Redis unreachable --------------------------------------------------------------------

    def _redis_down(self) -> bool:
        with self._lock:
            return time.monotonic() < self._down_until

    def _note_down(self, error: BaseException) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.retry_redis_seconds
            self._down_error = error

    def _note_up(self) -> None:
        with self._lock:
            was_down, self._down_error = self._down_error, None
        if was_down is not None:  # a flapping Redis says so at most every warn_every_seconds
            self._warn(
                "back",
                "model-call slots: Redis at %s answers again; model calls are counted again",
                maybe_sanitize_url(self.redis_url),
            )

    def _fail_open(self, account: str) -> None:
        _count_fail_open()
        with self._lock:
            error = self._down_error
        self._warn(
            "fail-open",
            "model-call slots: Redis at %s is unreachable (%s): the model call of account %r "
            "goes ahead without counting it against DJFLOW_MODEL_CONCURRENCY, as do others "
            "until Redis answers (counted in djflow_model_slots_fail_open_total; this is "
            "logged at most every %gs)",
            maybe_sanitize_url(self.redis_url),
            error,
            account,
            self.warn_every_seconds,
        )

    def _warn(self, kind: str, message: str, *args: Any) -> None:
        """A warning of each kind at most once per warn_every_seconds: an outage must not
        log per call."""
        now = time.monotonic()
        with self._lock:
            if now - self._warned_at.get(kind, -math.inf) < self.warn_every_seconds:
                return
            self._warned_at[kind] = now
        logger.warning(message, *args)


# --- the process's instance -----------------------------------------------------------------


@contextmanager
def _in_flight(account: str) -> Iterator[None]:
    """The in-flight gauge up for the block's length. A gauge that fails (its file under the
    metrics folder gone, the disk full) is logged and the call goes on: counting never fails
    a model call, nor so its step (``runs.metrics``)."""
    gauge = _gauge_up(account)
    try:
        yield
    finally:
        if gauge is not None:
            _gauge_down(gauge)


def _gauge_up(account: str) -> Any:
    """The account's gauge, raised by one; None when that failed (logged)."""
    try:
        gauge = MODEL_CALLS_IN_FLIGHT.labels(account=account)
        gauge.inc()
    except Exception:
        logger.warning("metrics: the model calls in flight were not counted", exc_info=True)
        return None
    return gauge


@never_raises
def _gauge_down(gauge: Any) -> None:
    gauge.dec()


@never_raises
def _count_fail_open() -> None:
    MODEL_SLOTS_FAIL_OPEN.inc()


@never_raises
def _count_wait(account: str, outcome: str) -> None:
    MODEL_SLOT_WAITS.labels(account=account, outcome=outcome).inc()


_instance: tuple[int, AccountSlots] | None = None
_instance_lock = threading.Lock()


def _forget_instance_lock() -> None:
    global _instance_lock
    _instance_lock = threading.Lock()  # a fork may copy it locked by another thread


os.register_at_fork(after_in_child=_forget_instance_lock)


def slots() -> AccountSlots:
    """The process's instance, from ``settings.DJFLOW`` (built again in a forked child)."""
    global _instance
    with _instance_lock:
        if _instance is None or _instance[0] != os.getpid():
            if _instance is not None:
                _instance[1].close()
            conf = settings.DJFLOW
            _instance = (
                os.getpid(),
                AccountSlots(
                    conf["MODEL_SLOTS_REDIS_URL"] or None,
                    conf["MODEL_CONCURRENCY"],
                    ttl_seconds=conf["MODEL_SLOT_TTL_SECONDS"],
                    refresh_seconds=conf["MODEL_SLOT_TTL_SECONDS"] / 4,
                ),
            )
        return _instance[1]


def log_at_worker_start(**_: object) -> None:
    """Say once, when a worker starts, whether model calls are counted per account: the
    embedded default has no Redis and counts nothing."""
    conf = settings.DJFLOW
    if conf["MODEL_SLOTS_REDIS_URL"]:
        logger.info(
            "model calls: at most %d in flight per account, counted in Redis at %s",
            conf["MODEL_CONCURRENCY"],
            maybe_sanitize_url(conf["MODEL_SLOTS_REDIS_URL"]),
        )
    else:
        logger.warning(
            "model calls: not limited per account (DJFLOW_MODEL_CONCURRENCY=%d is not "
            "enforced): no Redis to count them in; set DJFLOW_MODEL_SLOTS_REDIS_URL",
            conf["MODEL_CONCURRENCY"],
        )
