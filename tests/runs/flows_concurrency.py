"""A workflow limited per customer, for the concurrency keys' end-to-end test (loaded with
WORKFLOW_MODULES). Its body notes when it ran in the side table (tests.runs.flows), so the
test sees real executions, not only what the journal says."""

from __future__ import annotations

import os
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
    # The test starts every run before any body ends (however slow the machine), then
    # creates this file.
    release = input.get("release")
    deadline = time.monotonic() + 30
    while release and not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(float(input.get("seconds", 1.0)))
    done(row)
    return {"customer": input["customer"], "n": input["n"]}
