"""One more valid workflow, to check that several modules are synced together."""

from __future__ import annotations

from workflows.sdk import workflow

more = workflow("sample_more", description="Waits for a ping.")
more.wait_for("ping", event="ping", key="${input.id}", timeout_ms=60_000)
