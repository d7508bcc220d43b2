"""``format: "regex"`` in the workers (issue 36, deliver 1): a subworkflow's input and a
recipe's ``output_schema`` are judged by RE2 in a real worker process, never by Python's
``re`` (tests/workflows/test_regex_format.py has the web's side).

Before: 10,000 nested parentheses in a subworkflow's input raised RecursionError in the worker
(the run stuck, the reconciler failing on it every 30 s), and case-insensitive classes held
the worker for seconds each few KB.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from runs import services
from runs.models import Run
from tests.model_server import Answer, ModelServer
from tests.processes import wait_for
from workflows.services import definition_save

pytestmark = [pytest.mark.slow]

NESTED = "(" * 10_000 + "a" + ")" * 10_000
CLASSES = ["(?i)[a-zà-ÿ]", "(?i)[k-z\u03b1-\u03c9]", "(?i)[\u0100-\u017f]", "(?i)[^\u0400-\u04ff]"]
PATTERN_SCHEMA = {
    "type": "object",
    "properties": {
        "pattern_field": {"type": "string", "format": "regex"},
        "patterns": {"type": "array", "items": {"type": "string", "format": "regex"}},
    },
}
TERMINAL = ("completed", "failed", "cancelled", "timed_out")


def finished(run_id: Any, logs: Any, timeout: float = 60.0) -> Run:
    def ended() -> Run | None:
        run = Run.objects.get(id=run_id)
        return run if run.status in TERMINAL else None

    return wait_for(ended, timeout=timeout, interval=0.1, message=logs)


def start(workflow_id: str, input: Any) -> Run:
    # plan_now=False: the first advance, and so the child's start, is the worker's.
    return services.run_start(workflow=workflow_id, input=input, plan_now=False).run


def test_a_subworkflows_input_and_a_recipes_reply_are_judged_by_re2_in_the_worker(
    model_server: ModelServer, celery_worker, celery_processes, monkeypatch
) -> None:
    env = model_server.openai_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    celery_worker(env=env)
    logs = celery_processes.logs
    definition_save(
        document={
            "id": "rx_child",
            "input_schema": PATTERN_SCHEMA,
            "steps": [{"id": "nap", "kind": "sleep", "ms": 1}],
        }
    )
    definition_save(
        document={
            "id": "rx_parent",
            "steps": [
                {"id": "call", "kind": "subworkflow", "workflow": "rx_child", "input": "${input}"}
            ],
        }
    )

    # What Python's re choked on passes at once: RE2 compiles it.
    for input in ({"pattern_field": NESTED}, {"patterns": CLASSES * 250}):
        started = time.monotonic()
        run = finished(start("rx_parent", input).id, logs)
        assert run.status == "completed", run.error
        assert time.monotonic() - started < 30
        assert Run.objects.get(parent_run=run).status == "completed"

    # What RE2 refuses fails the subworkflow step, naming the field, and starts no child.
    for bad, field in [
        ({"pattern_field": "(a)\\1"}, "input.pattern_field"),
        ({"patterns": ["ok", "(?=look)"]}, "input.patterns[1]"),
    ]:
        run = finished(start("rx_parent", bad).id, logs)
        assert run.status == "failed"
        assert run.error["class"] == "invalid_input", run.error
        assert field in run.error["message"] and "RE2" in run.error["message"]
        assert not Run.objects.filter(parent_run=run).exists()

    # A recipe's output_schema against the model's reply, in the worker.
    definition_save(
        document={
            "id": "rx_recipe",
            "limits": {"run_timeout_ms": 120_000},
            "steps": [
                {
                    "id": "ask",
                    "kind": "recipe",
                    "model": "openai:gpt-4o-mini",
                    "prompt": "Write a rule.",
                    "output": "json",
                    "output_schema": {
                        "type": "object",
                        "required": ["rule"],
                        "properties": {"rule": {"type": "string", "format": "regex"}},
                    },
                }
            ],
        }
    )
    model_server.enqueue(Answer(json={"rule": NESTED}))
    run = finished(start("rx_recipe", {}).id, logs)
    assert run.status == "completed", run.error
    assert run.output == {"rule": NESTED}

    # A backreference twice (the reply and the re-ask's): invalid_output, RE2's reason.
    model_server.enqueue(Answer(json={"rule": "(a)\\1"}), Answer(json={"rule": "(?<=a)b"}))
    run = finished(start("rx_recipe", {}).id, logs)
    assert run.status == "failed"
    assert run.error["class"] == "invalid_output", run.error
    assert "rule" in run.error["message"] and "RE2" in run.error["message"]
    assert json.dumps(run.error).count("(") < 100
