"""A handler only some workers have: the other workers answer ``unservable``."""

from __future__ import annotations

from typing import Any

from workflows.sdk import handler


@handler("not.registered.anywhere")
def served(ctx: Any, input: Any, prior: Any) -> Any:
    return {"served_by": "flows_extra"}
