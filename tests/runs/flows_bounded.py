"""Workflows of the stored-bytes tests (``tests/runs/test_run_bytes.py``): each one echoes
or grows a value, the amplifications DJFLOW_MAX_RUN_BYTES bounds (issue 36)."""

from __future__ import annotations

from typing import Any

from workflows.sdk import task, workflow

LIMITS = {"run_timeout_ms": 120_000, "max_steps": 5_000}

# A foreach whose items each take the whole run input and answer it: the input stored once
# an item, the outputs once more each, collected into the foreach's output and the run's.
echo_input = workflow("bounded_echo_input", limits=LIMITS)
echo_input.foreach("fan", items="${input.items}", do=task("item", input="${input}"))


@echo_input.handler("item")
def _echo(ctx: Any, input: Any, prior: Any) -> Any:
    return input


# A foreach of small items whose outputs are large: what the cap counts is written by the
# workers, concurrently, one completion at a time.
echo_output = workflow("bounded_echo_output", limits=LIMITS)
echo_output.foreach(
    "fan",
    items="${input.items}",
    do=task("item", input={"size": "${input.size}", "index": "${index}"}),
)


@echo_output.handler("item")
def _blob(ctx: Any, input: Any, prior: Any) -> Any:
    return "x" * (input["size"] - 2)


# The same with on_error: continue on the foreach: a run limit still fails the run.
echo_output_continue = workflow("bounded_echo_output_continue", limits=LIMITS)
echo_output_continue.foreach(
    "fan",
    items="${input.items}",
    do=task("item", input={"size": "${input.size}", "index": "${index}"}),
    on_error="continue",
)
echo_output_continue.handler("item")(_blob)

# A parallel whose branches each echo the run input.
echo_parallel = workflow("bounded_echo_parallel", limits=LIMITS)
echo_parallel.parallel(
    "fan", branches={f"b{i}": task(f"branch_{i}", input="${input}") for i in range(8)}
)
for _i in range(8):
    echo_parallel.handler(f"branch_{_i}")(_echo)

# A loop whose iterations each answer the previous one doubled.
grow = workflow("bounded_grow", limits=LIMITS)
grow.loop(
    "grow",
    max_iterations=40,
    do=task("double", input={"seed": "${input.seed}", "previous": "${iter.previous}"}),
)


@grow.handler("double")
def _double(ctx: Any, input: Any, prior: Any) -> Any:
    previous = input["previous"] or input["seed"]
    return previous + previous


# A chain of subworkflows each echoing its input: every run of the chain counts its own.
chain_leaf = workflow("bounded_chain_leaf", limits=LIMITS)
chain_leaf.step("echo")(_echo)
chain_leaf.output("${steps.echo.output}")
chain_mid = workflow("bounded_chain_mid", limits=LIMITS)
chain_mid.step("echo")(_echo)
chain_mid.subworkflow("down", workflow="bounded_chain_leaf", input="${steps.echo.output}")
chain_root = workflow("bounded_chain_root", limits=LIMITS)
chain_root.step("echo")(_echo)
chain_root.subworkflow("down", workflow="bounded_chain_mid", input="${steps.echo.output}")

ALL = [
    echo_input,
    echo_output,
    echo_output_continue,
    echo_parallel,
    grow,
    chain_leaf,
    chain_mid,
    chain_root,
]
