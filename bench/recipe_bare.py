"""Bare Celery's side of the recipe benchmark (issue 14): a relay whose every hop makes the
model call the ``recipe`` step makes, through the same client code and SDK
(``workers.providers.call``), then enqueues the next hop.

Timed on the worker side, as ``bench.bare_celery`` is: the first hop stamps ``time.time()``
into Redis before its call, the last one after its call; the client only polls for the end
stamp. The worker includes this module with ``--include bench.recipe_bare`` and gets the
provider's variables (``OPENAI_API_KEY``, ``OPENAI_BASE_URL``) in its environment.
"""

from __future__ import annotations

import time
import uuid

from celery import shared_task

from bench.bare_celery import _elapsed, _keys, _redis
from tests.processes import CeleryProcess
from workers import providers

MODEL = "openai:gpt-4o-mini"
PROMPT = "Say hello."
MAX_TOKENS = 16


def request() -> providers.ModelRequest:
    """The request the engine's step sends (``recipe.run_recipe`` builds the same one)."""
    _, model = providers.split_model(MODEL)
    return providers.ModelRequest(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS
    )


@shared_task(name="bench.recipe_hop", ignore_result=True)
def recipe_hop(run: str, hop: int, hops: int) -> None:
    start_key, end_key, _ = _keys(run)
    if hop == 1:
        _redis().set(start_key, repr(time.time()))
    providers.call(MODEL, request())
    if hop < hops:
        recipe_hop.delay(run, hop + 1, hops)
    else:
        _redis().set(end_key, repr(time.time()))


def relay(hops: int, worker: CeleryProcess | None = None) -> float:
    """Milliseconds per hop of a relay of ``hops`` tasks, each making one model call and
    enqueuing the next."""
    run = uuid.uuid4().hex
    recipe_hop.delay(run, 1, hops)
    return _elapsed(run, timeout=30 + hops * 0.2, worker=worker) * 1000 / (hops - 1)


def warm_up(relays: int, hops: int, worker: CeleryProcess) -> None:
    """``relays`` relays at once, so every pool process imports the SDK and builds its client
    before anything is timed."""
    runs = [uuid.uuid4().hex for _ in range(relays)]
    for run in runs:
        recipe_hop.delay(run, 1, hops)
    for run in runs:
        _elapsed(run, timeout=60, worker=worker)
