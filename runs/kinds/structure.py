"""Steps that hold other steps: ``parallel``, ``foreach`` and ``loop`` (composite) and
``condition`` (a branch). What they mean is the planner's walk itself (``runs.engine.plan``):
their rows are open while the steps inside run, and they are never attempts of their own
(``max_steps`` does not count them)."""

from __future__ import annotations

from workflows.kinds import Kind, Role, register

PARALLEL = register(Kind("parallel", Role.COMPOSITE))
FOREACH = register(Kind("foreach", Role.COMPOSITE))
LOOP = register(Kind("loop", Role.COMPOSITE))
CONDITION = register(Kind("condition", Role.BRANCH))
