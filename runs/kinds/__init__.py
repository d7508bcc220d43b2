"""The engine's own step kinds, one module each, registered in ``workflows.kinds`` when this
package is imported (the planner imports it, so they are there wherever plans are made).

``approval`` and ``handoff`` are ``approvals``' (registered from its ``AppConfig.ready()``);
``recipe``, ``http``, ``mcp_tool`` and ``write_kb`` are ``workers.kinds``' (from
``WorkersConfig.ready()``).
"""

from . import structure, subworkflow, task, time, wait_event

__all__ = ["structure", "subworkflow", "task", "time", "wait_event"]
