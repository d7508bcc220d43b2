"""The builder split by job (issue 13): which module may import what, and one constructor per
step kind.

An AST scan, so imports written inside functions count too (an ``import`` at run time is a
dependency all the same). The import-linter contracts say the same for whole packages; this
guards the rule that ``workflows.client`` alone, of ``workflows``, reaches ``runs``.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from workflows import builder, failures, registry, schema, steps

ROOT = Path(__file__).resolve().parents[2]
# The layers above workflows: only the run client may call them.
ABOVE_WORKFLOWS = ("runs", "workers", "approvals")
# Users' code imports workflows.sdk; the project's own modules import what it re-exports from
# where it lives. workflows/examples is users' code, kept as the contract writes it.
ENGINE_PACKAGES = ("config", "runs", "workers", "approvals", "workflows")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, anywhere in it: ``from a import b`` yields ``a`` and
    ``a.b`` (``b`` may be a module), relative imports resolved."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(f"{p}.") for p in packages)


def _python_files(*packages: str) -> list[Path]:
    return sorted(f for p in packages for f in (ROOT / p).rglob("*.py"))


def test_the_scan_sees_imports_inside_functions_and_relative_ones() -> None:
    client = ROOT / "workflows" / "client.py"
    assert "runs.services" in set(imported_modules(client))
    assert "workflows.services" in set(imported_modules(client))


@pytest.mark.parametrize("path", _python_files("workflows"), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_client_in_workflows_imports_runs_workers_or_approvals(path: Path) -> None:
    if path == ROOT / "workflows" / "client.py":
        return
    above = sorted(m for m in imported_modules(path) if _within(m, ABOVE_WORKFLOWS))
    assert not above, f"{path.relative_to(ROOT)} imports {above}: go through workflows.client"


def test_the_engine_does_not_import_the_public_sdk_module() -> None:
    users_code = (ROOT / "workflows" / "sdk.py", ROOT / "workflows" / "examples")
    offenders = {
        str(path.relative_to(ROOT))
        for path in _python_files(*ENGINE_PACKAGES)
        if not any(path == u or u in path.parents for u in users_code)
        and "workflows.sdk" in set(imported_modules(path))
    }
    assert not offenders, (
        f"import from the module that does the job, not workflows.sdk: {offenders}"
    )


def test_every_workflow_method_that_adds_a_step_is_made_from_its_constructor() -> None:
    """No constructor is written twice: a builder method wraps the module-level constructor
    of its kind, and says so in its signature and in ``help()``."""
    made = {
        name: value.__wrapped__
        for name, value in vars(builder.Workflow).items()
        if hasattr(value, "__wrapped__")
    }
    assert made == {
        "step": steps.task,
        "agent": steps.agent,
        "task": steps.task,
        "wait_for": steps.wait_event,
        "sleep": steps.sleep,
        "sleep_until": steps.sleep_until,
        "approval": steps.approval,
        "parallel": steps.parallel,
        "foreach": steps.foreach,
        "loop": steps.loop,
        "subworkflow": steps.subworkflow,
        "condition": steps.condition,
        "recipe": steps.recipe,
        "http": steps.http,
        "mcp_tool": steps.mcp_tool,
        "write_kb": steps.write_kb,
        "handoff": steps.handoff,
    }
    state = registry.snapshot()
    try:
        bound = builder.Workflow("split_probe", module=__name__).approval
    finally:
        registry.restore(state)
    constructor = inspect.signature(steps.approval)
    assert inspect.signature(bound) == constructor.replace(return_annotation="Workflow")
    assert bound.__doc__ and bound.__doc__.startswith(steps.approval.__doc__ or "?")
    assert builder.Workflow.wait_for.__qualname__ == "Workflow.wait_for"


def test_step_failure_bounds_its_delay_as_the_schema_does() -> None:
    # failures.py keeps its own copy of the bound so that handlers need not load jsonschema.
    assert failures.MAX_DURATION_MS == schema.MAX_DURATION_MS
