"""A workflow limited per customer, for the concurrency keys' end-to-end test (loaded with
WORKFLOW_MODULES). Its body notes when it ran in the side table (tests.runs.flows), so the
test sees real executions, not only what the journal says."""

from __future__ import annotations

import time
from typing import Any

from workflows.sdk import workflow

from .flows import done, note

per_customer = workflow(
    "per_customer_e2e",
    concurrency={"key": "${input.customer}", "limit": 2},
)


@per_customer.step("work")
def work(ctx: Any, input: Any, prior: Any) -> Any:
    row = note(ctx)
    time.sleep(float(input.get("seconds", 1.0)))
    done(row)
    return {"customer": input["customer"], "n": input["n"]}
