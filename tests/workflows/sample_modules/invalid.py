"""A valid workflow and one whose document the schema rejects (a duration out of range)."""

from __future__ import annotations

from workflows.sdk import workflow

fine = workflow("sample_fine")
fine.sleep("nap", ms=5)

invalid = workflow("sample_invalid")
invalid.sleep("forever", ms=315_360_000_001)
