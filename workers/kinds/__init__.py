"""The step kinds whose bodies run on workers and call the world outside: models (``recipe``),
HTTP (``http``), MCP tools (``mcp_tool``) and knowledge bases (``write_kb``). One module
each; :func:`plug_in` (from
``WorkersConfig.ready()``) imports them, which registers them in ``workflows.kinds`` in every
process that loads the project (web, worker, beat), so the planner, the validator and the
pre-flight at start know them wherever they run.
"""

from __future__ import annotations


def plug_in() -> None:
    """Import each kind module here, for its registration (it calls workflows.kinds.register)."""
    from . import http, mcp_tool, recipe, write_kb  # noqa: F401
