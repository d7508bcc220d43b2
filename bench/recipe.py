"""``python -m bench.recipe``: the engine's own overhead per model call (issue 14).

A ``recipe`` step against a local model server that answers at once, beside a bare Celery
task making the same SDK call, in one sitting; the target is within 1.5x.

- The model server (``tests.model_server.ModelServer``, OpenAI's chat completions wire format)
  runs in a thread of this process and answers every call at once with a short fixed text and
  its usage, so what is left is the client code, the SDK, the engine and the broker.
- One bench worker (``bench.common.running_worker``: ``celery -A config worker -P prefork``,
  the project's settings) gets ``OPENAI_API_KEY`` and ``OPENAI_BASE_URL`` pointing at it and
  includes ``bench.recipe_bare``.
- Bare: a relay of ``steps`` hops, each a task calling
  ``workers.providers.call("openai:gpt-4o-mini", ...)`` (the client code and SDK the step
  uses) and then enqueuing the next hop; worker-side stamps in Redis, ms per hop.
- Engine: one run of a workflow of ``steps`` sequential inline ``recipe`` steps (same model,
  prompt and ``max_tokens``), saved with ``definition_save`` and started with ``run_start``;
  timed from the journal (the first step's start to the last step's finish), ms per step.

Both sides are warmed up first (the first call in a pool process imports the SDK, about
0.3 s), then measured in turn, ``--repeat`` rounds, and the medians compared.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

from bench import common
from tests.model_server import Answer, ModelServer, Recorded

TARGET = 1.5
WARM_STEPS = 5
# bench.flows' longer no-op sequence: the engine's own cost of a step without a model call.
FLOOR_STEPS = 200


@dataclass(frozen=True)
class Rounds:
    """Every round's figures, ms per step (engine) and per hop (bare); ``floor_*`` are the
    same worker's no-op ``task`` steps and no-op relay, when measured."""

    engine: list[float]
    bare: list[float]
    floor_engine: list[float]
    floor_bare: list[float]

    def rows(self, steps: int) -> list[common.Row]:
        rows = [
            common.Row(
                f"{steps} recipe steps vs relay of SDK calls",
                "ms/call",
                statistics.median(self.engine),
                statistics.median(self.bare),
                True,
            )
        ]
        if self.floor_engine:
            rows.append(
                common.Row(
                    f"{FLOOR_STEPS} no-op steps vs no-op relay (the floor)",
                    "ms/step",
                    statistics.median(self.floor_engine),
                    statistics.median(self.floor_bare),
                    True,
                )
            )
        return rows


def _answer(request: Recorded) -> Answer:
    """Every call answered at once, with the same short text and usage."""
    return Answer(text="Hello.", input_tokens=9, output_tokens=2)


def workflow_document(workflow_id: str, steps: int) -> dict[str, object]:
    """``steps`` inline ``recipe`` steps in sequence, each the call a bare hop makes."""
    from bench.recipe_bare import MAX_TOKENS, MODEL, PROMPT

    step = {"kind": "recipe", "model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    return {
        "id": workflow_id,
        "limits": {"run_timeout_ms": 3_600_000},
        "steps": [{"id": f"s{n}", **step} for n in range(steps)],
    }


def save_workflow(steps: int) -> str:
    from workflows.services import definition_save

    workflow_id = f"bench_recipe_{steps}"
    definition_save(document=workflow_document(workflow_id, steps))
    return workflow_id


# --account-budget: the runs' account, given a budget (issue 39: what reserving against an
# account's budget adds to a recipe step).
ACCOUNT = "bench_account"


def engine_sequential(workflow_id: str, steps: int, account: str | None = None) -> float:
    """Milliseconds per step of one run of ``steps`` recipe steps, from the journal."""
    from bench import engine

    run_ids = engine._start_runs(workflow_id, 1, account)
    engine._wait(run_ids, timeout=60 + steps * 0.5)
    return engine._span(run_ids) * 1000 / (steps - 1)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """This process's environment with ``values``, as it was afterwards: a start checks that
    the step's provider is configured (pre-flight), here as in the worker."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def measure(
    steps: int = 100,
    repeat: int = 3,
    concurrency: int = 2,
    loglevel: str = "warning",
    floor: bool = True,
    account_budget: bool = False,
) -> Rounds:
    """Both sides on one worker, one model server, in one sitting; ``repeat`` rounds of
    bare then engine (then, with ``floor``, the no-op relay and no-op steps on the same
    worker). ``bench.common.configure()`` must have run."""
    from bench import bare_celery
    from bench import engine as noop_engine
    from bench import recipe_bare as bare

    rounds = Rounds(engine=[], bare=[], floor_engine=[], floor_bare=[])
    from decimal import Decimal

    from runs.models import Account
    from runs.services import account_save

    # The runs are on one named account either way (its model slots are counted in Redis,
    # which an empty account skips): the figures differ by the budget alone.
    account = ACCOUNT
    Account.objects.filter(name=account).delete()
    if account_budget:
        account_save(name=account, budget_usd=Decimal(1_000_000), period="day", user=None)
    with ModelServer(default=_answer) as server, _environ(server.openai_env()):
        workflow_id = save_workflow(steps)
        warm_id = save_workflow(WARM_STEPS)
        with common.running_worker(
            concurrency=concurrency,
            loglevel=loglevel,
            include=("bench.recipe_bare", "bench.bare_celery"),
            workflow_modules=noop_engine.WORKFLOW_MODULES,
            env=server.openai_env(),
        ) as worker:
            # Every pool process imports the SDK and opens its connections on both paths.
            bare.warm_up(2 * concurrency, WARM_STEPS, worker)
            from bench import engine

            warm = engine._start_runs(warm_id, 2 * concurrency)
            engine._wait(warm, timeout=60)
            if floor:
                bare_celery.relay(20, worker)
            for _ in range(repeat):
                rounds.bare.append(bare.relay(steps, worker))
                rounds.engine.append(engine_sequential(workflow_id, steps, account))
                if floor:
                    rounds.floor_bare.append(bare_celery.relay(FLOOR_STEPS, worker))
                    rounds.floor_engine.append(noop_engine.engine_sequential(FLOOR_STEPS))
    return rounds


def report(rounds: Rounds, steps: int) -> str:
    lines = [
        f"round {n + 1}: engine {e:.2f} ms/step, bare {b:.2f} ms/hop, ratio {e / b:.2f}x"
        for n, (e, b) in enumerate(zip(rounds.engine, rounds.bare, strict=True))
    ]
    return "\n".join([*lines, common.format_table(rounds.rows(steps))])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.recipe", description=__doc__)
    parser.add_argument("--steps", type=int, default=100, help="steps (hops) of a run")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the median")
    parser.add_argument("--concurrency", type=int, default=2, help="worker pool size")
    parser.add_argument("--loglevel", default="warning", help="the worker's log level")
    parser.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="leave out the no-op steps beside the no-op relay (the engine's own floor)",
    )
    parser.add_argument(
        "--account-budget",
        action="store_true",
        help="start the runs on an account with a (daily, ample) budget: every call reserves "
        "against it",
    )
    args = parser.parse_args(argv)

    common.configure()
    rounds = measure(
        args.steps, args.repeat, args.concurrency, args.loglevel, args.floor, args.account_budget
    )
    print(
        f"worker: celery -A config worker -P prefork -c {args.concurrency} -l {args.loglevel}, "
        f"broker {common.REDIS_URL}; median of {args.repeat}; ratio = engine / bare "
        f"(target: {TARGET}x)"
    )
    print(report(rounds, args.steps), flush=True)


if __name__ == "__main__":
    main()
