"""An ``http`` step on a real worker process: one worker, started with 127.0.0.1 allowed,
runs four runs of one workflow against a local server the test serves, and the journal
shows what the contract says for each."""

from __future__ import annotations

import json
import re
import time

from runs import services
from runs.models import Run, StepRun
from tests.processes import wait_for
from tests.workers.http_servers import reply, serving
from workflows.services import definition_save

TERMINAL = ("completed", "failed", "cancelled", "timed_out")
DOCUMENT = {
    "id": "http_e2e",
    "limits": {"run_timeout_ms": 60_000},
    "steps": [
        {
            "id": "call",
            "kind": "http",
            "method": "POST",
            "url": "${input.url}",
            "headers": {"X-Run": "${input.tag}"},
            "body": {"tag": "${input.tag}"},
            # No back-off, so the retry needs no timer (and no beat): Retry-After 0 is honoured.
            "retry": {"max_attempts": 3, "backoff": "none"},
        }
    ],
}


# The attempt's deadline reaches the body (ctx.deadline_at): it fails retryable with its own
# message, about a tenth of timeout_ms early, before the worker's alarm would end it as class
# timeout.
SLOW = {
    "id": "http_e2e_slow",
    "limits": {"run_timeout_ms": 60_000},
    "steps": [
        {
            "id": "call",
            "kind": "http",
            "method": "GET",
            "url": "${input.url}",
            "timeout_ms": 800,
            "retry": {"max_attempts": 1},
        }
    ],
}


def test_http_steps_on_a_real_worker(celery_worker, celery_processes) -> None:
    counts: dict[str, int] = {}

    def flaky(h) -> None:
        counts["flaky"] = counts.get("flaky", 0) + 1
        if counts["flaky"] == 1:
            reply(h, 503, "busy", {"Retry-After": "0"})
        else:
            reply(h, 200, json.dumps({"second": True}), {"Content-Type": "application/json"})

    def echo(h) -> None:
        sent = json.loads(h.body)
        answer = {"got": sent, "header": h.headers["X-Run"]}
        reply(h, 200, json.dumps(answer), {"Content-Type": "application/json"})

    routes = {
        "/echo": echo,
        "/flaky": flaky,
        "/meta": lambda h: reply(h, 302, "", {"Location": "http://169.254.169.254/latest/"}),
        "/mute": lambda h: time.sleep(3),
    }
    with serving(routes) as server:
        celery_worker(env={"DJFLOW_HTTP_ALLOW": "127.0.0.1"})
        definition_save(document=DOCUMENT)
        cases = {
            "echo": server.url("/echo?token=abc"),
            "flaky": server.url("/flaky"),
            "missing": server.url("/missing"),
            "meta": server.url("/meta"),
        }
        runs = {
            tag: services.run_start(workflow="http_e2e", input={"url": url, "tag": tag}).run
            for tag, url in cases.items()
        }
        definition_save(document=SLOW)
        slow_input = {"url": server.url("/mute")}
        runs["slow"] = services.run_start(workflow="http_e2e_slow", input=slow_input).run

        def ended() -> dict[str, Run] | None:
            found = {tag: Run.objects.get(id=run.id) for tag, run in runs.items()}
            return found if all(r.status in TERMINAL for r in found.values()) else None

        done = wait_for(ended, timeout=20, interval=0.1, message=celery_processes.logs)

    def attempts(tag: str) -> list[StepRun]:
        return list(StepRun.objects.filter(run=done[tag]).order_by("attempt"))

    echo_run = done["echo"]
    assert echo_run.status == "completed", echo_run.error
    [echoed] = attempts("echo")
    assert echoed.output["status"] == 200
    assert echoed.output["body"] == {"got": {"tag": "echo"}, "header": "echo"}
    assert echoed.output["headers"]["content-type"] == "application/json"
    # The attempt's input is the request as the planner resolved it.
    assert echoed.input["url"] == cases["echo"] and echoed.input["headers"] == {"X-Run": "echo"}

    assert done["flaky"].status == "completed", done["flaky"].error
    first, second = attempts("flaky")
    assert (first.status, first.error["class"], first.error["retry_after_ms"]) == (
        "failed",
        "retryable",
        0,
    )
    assert (second.attempt, second.status, second.output["body"]) == (
        2,
        "succeeded",
        {"second": True},
    )

    missing = done["missing"]
    assert (missing.status, missing.error["class"]) == ("failed", "fatal")
    assert "answered 404" in missing.error["message"]
    assert len(attempts("missing")) == 1

    meta = done["meta"]
    assert (meta.status, meta.error["class"]) == ("failed", "fatal")
    assert meta.error["message"] == (
        "http: 169.254.169.254 is a cloud metadata address; DJFLOW_HTTP_ALLOW does not list it"
    )
    assert len(attempts("meta")) == 1

    slow = done["slow"]
    assert (slow.status, slow.error["class"]) == ("failed", "retryable"), slow.error
    found = re.fullmatch(r"http: timed out after (\d+) ms \(GET (.*)\)", slow.error["message"])
    assert found and 600 <= int(found[1]) <= 720 and found[2] == server.url("/mute")
