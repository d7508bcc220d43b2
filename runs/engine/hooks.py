"""What apps above the engine plug into its timers and its reconciler (``approvals`` does, from
its ``AppConfig.ready()``): the engine calls them and never imports those apps.

- A timer purpose of an app's own (an approval's reminder): what firing it does. Such timers
  never advance their run: they only send something.
- A reconciler repair: a pass over what a lost message or a crash left behind (mails never
  sent), run on every reconciler tick after the engine's own, in registration order.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

# purpose -> fire(step_run_id)
_timers: dict[str, Callable[[int], None]] = {}
# name -> repair(now, batch) -> rows acted on
_repairs: dict[str, Callable[[datetime, int], int]] = {}


def on_timer(purpose: str, fire: Callable[[int], None]) -> None:
    _timers[purpose] = fire


def timer_handler(purpose: str) -> Callable[[int], None] | None:
    return _timers.get(purpose)


def timer_purposes() -> frozenset[str]:
    return frozenset(_timers)


def repair(name: str, part: Callable[[datetime, int], int]) -> None:
    _repairs[name] = part


def repairs() -> list[tuple[str, Callable[[datetime, int], int]]]:
    return list(_repairs.items())
