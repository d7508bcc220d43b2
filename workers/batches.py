"""The rest of a fan-out's message: attempts offered together, run one after another by the
task that received them, and handed to other workers as soon as one of them turns out slow.

A fan-out's attempts (foreach items, parallel branches) go out ``FAN_OUT_PER_MESSAGE`` to a
message (``runs.dispatch.offer_fan_out_on_commit``). Celery's own cycle per message (the
pool process reports, the worker acknowledges and fetches the next message) was most of a
no-op item's cost: on this 2-core machine the pool processes sat idle for the next message
half the time, and bare Celery's independent no-op tasks ran at about 3 ms a task a process
against 1.5 ms for an item's claim, body and record in process (issue 17, bench.fanout).

A message of several items must not make them wait behind a slow one (a model call of
seconds): while an item runs longer than ``HAND_OFF_SECONDS``, one thread per process
(this module's ``watch``) offers the rest of its message, one message each, to whichever
workers are free; the task then stops after its item. Each item is claimed on its own, as
before, so a rest offered twice (the thread and a redelivery) still runs each item once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runs.dispatch import MAX_PER_MESSAGE

logger = logging.getLogger(__name__)

# How long an item of a message may run before the rest of its message is offered to other
# workers. Short next to a model call or an HTTP request, long next to a no-op (about 2 ms).
HAND_OFF_SECONDS = 0.2
# How often the hand-off thread looks (its lateness is at most this).
_LOOK_SECONDS = 0.05


def bounded(more: Any) -> list[int]:
    """A message's ``more``: at most ``MAX_PER_MESSAGE`` - 1 attempt ids, each an integer (a
    message is read from the broker: what it says is bounded before anything acts on it); a
    malformed list is refused whole (its attempts stay scheduled: the reconciler offers
    them again), and a longer one is cut (logged)."""
    if not more:
        return []
    if not isinstance(more, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in more
    ):
        logger.error("a message's attempts are not a list of ids; ignored: %.200r", more)
        return []
    if len(more) >= MAX_PER_MESSAGE:
        logger.error(
            "a message carries %d attempts; the first %d run", len(more) + 1, MAX_PER_MESSAGE
        )
        return more[: MAX_PER_MESSAGE - 1]
    return more


@dataclass
class Rest:
    """The attempts of a message after the one running now; taken one at a time by the task,
    or all at once by the hand-off thread (whichever comes first gets each)."""

    ids: list[int]
    # Called with the ids left (and together=True for one message).
    offer: Callable[..., None]
    # Watched and offered even with no id left: the offer has more to do than offer ids
    # (a batch's results waiting to be recorded, workers.execution._Batch.run_ahead).
    always: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _running_since: float | None = None

    def next(self) -> int | None:
        with self._lock:
            return self.ids.pop(0) if self.ids else None

    def take(self) -> list[int]:
        with self._lock:
            taken, self.ids = self.ids, []
            return taken

    def hand_off(self) -> int:
        """Offer what is left through the broker (the task stops here); returns how many."""
        taken = self.take()
        if taken or self.always:
            self.offer(taken)
        return len(taken)

    def running(self) -> None:
        """An item starts: the thread offers the rest should it run past HAND_OFF_SECONDS."""
        if self.ids or self.always:
            with self._lock:
                self._running_since = time.monotonic()
            _watch(self)

    def ran(self) -> None:
        with self._lock:
            self._running_since = None

    def overdue(self, now: float) -> bool:
        with self._lock:
            since = self._running_since
        return since is not None and now - since >= HAND_OFF_SECONDS


class _Watcher:
    """One thread per process looking at the message being run (threads do not survive a
    fork: a pool process starts its own on first use)."""

    def __init__(self) -> None:
        self.current: Rest | None = None
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def watch(self, rest: Rest) -> None:
        self.current = rest
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="fan-out-hand-off")
                self._thread.daemon = True
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(_LOOK_SECONDS)
            rest = self.current
            if rest is None or not rest.overdue(time.monotonic()):
                continue
            self.current = None
            try:
                handed = rest.hand_off()
            except Exception:
                # The items stay scheduled: the reconciler offers them after
                # LOST_MESSAGE_SECONDS, like any attempt whose message was lost.
                logger.warning("could not hand off the rest of a message", exc_info=True)
            else:
                if handed:
                    logger.info("an item runs long: %d attempts offered to other workers", handed)


_watcher = _Watcher()


def _watch(rest: Rest) -> None:
    _watcher.watch(rest)
