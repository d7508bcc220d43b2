"""Run-end webhooks and ``parallel`` ``all_settled`` on a real worker process.

One worker (127.0.0.1 allowed, a short back-off) runs a workflow whose parallel step lets
every branch settle although one fails; its run completes, and the webhook for
``completed`` reaches a local receiver that refuses the first two deliveries: the worker
retries it until it answers, with the same body and a signature the receiver verifies. The
entry for ``failed`` is never sent.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from runs import services
from runs.models import NotifyDelivery, Run
from tests.processes import wait_for
from tests.workers.flows_notify import settled
from tests.workers.http_servers import reply, serving
from workflows.services import definition_save

FLOWS = ["tests.workers.flows_notify"]
SECRET = "whsec-e2e-5f1c0a9e"


def test_all_settled_and_a_webhook_retried_until_the_receiver_answers(
    celery_worker, celery_processes
) -> None:
    answers = iter([503, 502])

    def flaky(h) -> None:
        reply(h, next(answers, 200), "thanks")

    with serving({"/done": flaky, "/failed": lambda h: reply(h, 200)}) as server:
        celery_worker(
            workflow_modules=FLOWS,
            env={"DJFLOW_HTTP_ALLOW": "127.0.0.1", "DJFLOW_NOTIFY_BACKOFF_SECONDS": "0.3"},
        )
        document = settled.document()
        document["notify"] = [
            {"url": server.url("/done"), "events": ["completed"], "secret": SECRET},
            {"url": server.url("/failed"), "events": ["failed", "timed_out"]},
        ]
        definition_save(document=document)
        run = services.run_start(workflow="settled_e2e", input={"n": 7}).run

        def delivered() -> NotifyDelivery | None:
            row = NotifyDelivery.objects.filter(run=run, status="delivered").first()
            return row

        row = wait_for(delivered, timeout=30, interval=0.1, message=celery_processes.logs)

    done = Run.objects.get(id=run.id)
    assert done.status == "completed", done.error
    assert done.output == {"good": "succeeded", "bad": "failed", "pair": "succeeded"}
    par = done.steps.get(step_id="par")
    assert par.status == "succeeded"
    assert par.output == {
        "good": {"status": "succeeded", "output": 70, "error": None},
        "bad": {
            "status": "failed",
            "output": None,
            "error": {"class": "fatal", "message": "this branch fails", "step": "bad"},
        },
        "pair": {"status": "succeeded", "output": {"got": 8}, "error": None},
    }

    # Retried until the receiver answered: three POSTs of the same bytes, each signed.
    assert (row.event, row.attempts, row.response_status) == ("completed", 3, 200)
    posts = [seen for seen in server.seen if seen.path == "/done"]
    assert len(posts) == 3 and len({seen.body for seen in posts}) == 1
    for seen in posts:
        expected = "sha256=" + hmac.new(SECRET.encode(), seen.body, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(seen.headers["X-Djflow-Signature"], expected)
        assert seen.headers["X-Djflow-Delivery"] == str(row.id)
    body = json.loads(posts[0].body)
    assert (body["id"], body["status"], body["output"]) == (str(run.id), "completed", done.output)
    # The entry for failed and timed_out: no row, nothing sent.
    assert [seen.path for seen in server.seen if seen.path != "/done"] == []
    assert list(NotifyDelivery.objects.filter(run=run).values_list("entry", flat=True)) == [0]
