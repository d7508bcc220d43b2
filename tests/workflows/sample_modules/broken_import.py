"""A workflow module whose import fails."""

from __future__ import annotations

import tests.workflows.sample_modules.no_such_module  # noqa: F401
from workflows.sdk import workflow

never = workflow("sample_never")
never.sleep("nap", ms=1)
