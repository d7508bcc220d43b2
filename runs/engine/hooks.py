"""What apps above the engine plug into its timers and its reconciler (``approvals`` does, from
its ``AppConfig.ready()``): the engine calls them and never imports those apps.

- A timer purpose of an app's own (an approval's reminder): what firing it does. Such timers
  never advance their run: they only send something.
- A reconciler repair: a pass over what a lost message or a crash left behind (mails never
  sent), run on every reconciler tick after the engine's own, in registration order.
- A budget watcher: told, in the transaction that made an attempt wait for budget, which
  run and attempt (``approvals`` notifies the workflow's operators in-app and by e-mail).
- A purge step: what an app deletes of its own, in the transaction that deletes runs
  (``runs.retention``), before the runs' rows go (the rows that would block their deletion,
  such as an approval's decisions, which are protected from a cascade on purpose).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

# purpose -> fire(step_run_id)
_timers: dict[str, Callable[[int], None]] = {}
# name -> repair(now, batch) -> rows acted on
_repairs: dict[str, Callable[[datetime, int], int]] = {}
# name -> notify(run id, step run id)
_budget: dict[str, Callable[[Any, int], None]] = {}
# name -> purge(run ids) -> {model label: rows deleted}
_purges: dict[str, Callable[[list[Any]], dict[str, int]]] = {}


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


def on_purge(name: str, purge: Callable[[list[Any]], dict[str, int]]) -> None:
    _purges[name] = purge


def purges() -> list[tuple[str, Callable[[list[Any]], dict[str, int]]]]:
    return list(_purges.items())


def on_budget_exceeded(name: str, notify: Callable[[Any, int], None]) -> None:
    _budget[name] = notify


def budget_exceeded(run_id: Any, step_run_id: int) -> None:
    """Tell the watchers that an attempt of the run now waits for budget."""
    for notify in _budget.values():
        notify(run_id, step_run_id)
