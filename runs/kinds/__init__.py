"""The engine's own step kinds, one module each, registered in ``workflows.kinds`` when this
package is imported (the planner imports it, so they are there wherever plans are made).

``approval`` and ``handoff`` are ``approvals``' (registered from its ``AppConfig.ready()``);
``recipe``, ``http`` and ``write_kb`` are ``workers``' (``workers.kinds``). ``mcp_tool`` is
accepted in documents but has no module yet: a run that reaches one fails with class
``unsupported``.
"""

from . import structure, subworkflow, task, time, wait_event

__all__ = ["structure", "subworkflow", "task", "time", "wait_event"]
