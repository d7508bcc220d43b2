"""``manage.py run_replay FILE [--document FILE] [--recipe NAME=VERSION|FILE] [--input JSON]
[--from-step ID] [--live] [--json]``: run an exported run again, offline, in this process,
and say what changed (CONTRACT section 16; ``config.replay`` does the work).

Exit 0: the run's output is the recorded one; 1: it differs; 2: a call had no recording
(without ``--live``); 3: the replay could not be made (the message says why).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    help = (
        "Replay an exported run (manage.py run_export) offline, in a private database, and "
        "print per step whether the output changed and the cost before and after. Exit 0 "
        "same output, 1 different, 2 a call with no recording, 3 no replay made."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", type=Path, help="the export (GET /runs/{id}/export)")
        parser.add_argument(
            "--document", type=Path, help="a workflow document (JSON) to run instead"
        )
        parser.add_argument(
            "--recipe",
            action="append",
            default=[],
            metavar="NAME=VERSION|FILE",
            help="run recipe NAME at a version the export holds, or from a recipe document "
            "(JSON); repeatable",
        )
        parser.add_argument("--input", help="the run's input (a JSON object) instead")
        parser.add_argument(
            "--from-step",
            help="keep the recorded outputs of the top-level steps before this one",
        )
        parser.add_argument(
            "--live",
            action="store_true",
            help="make a call with no equal recording for real (else: exit 2)",
        )
        parser.add_argument("--json", action="store_true", help="print the result as JSON")
        parser.add_argument(
            "--timeout",
            type=float,
            default=300.0,
            help="seconds the replay may take (default 300); past them, exit 3",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from config import replay

        try:
            data = replay.read_export(options["file"])
            wanted = replay.Options(
                document=options["document"],
                recipes=options["recipe"],
                from_step=options["from_step"],
                live=options["live"],
                timeout=options["timeout"],
            )
            if options["input"] is not None:
                try:
                    wanted.input = json.loads(options["input"])
                except ValueError as error:
                    raise replay.Unusable(f"--input: not JSON ({error})") from None
                wanted.input_given = True
            with replay.private_database():
                result = replay.replay(data, wanted)
                shown = _shown(result, as_json=options["json"])
        except replay.Unusable as unusable:
            self.stderr.write(f"run_replay: {unusable}")
            sys.exit(replay.EXIT_UNUSABLE)
        except Exception as error:
            # Whatever else stopped it, the replay was not made: never exit 1, which says
            # the output differs (--traceback shows where it stopped).
            if options["traceback"]:
                raise
            self.stderr.write(f"run_replay: the replay failed: {type(error).__name__}: {error}")
            sys.exit(replay.EXIT_UNUSABLE)
        self.stdout.write(shown)
        sys.exit(result.code)


def _shown(result: Any, *, as_json: bool) -> str:
    from runs.compare import compare

    comparison = compare(result.source, result.replayed, user=None, limits=None)
    if as_json:
        return json.dumps(
            {
                "exit": result.code,
                "status": result.status,
                "reused": result.reused,
                "unrecorded": [miss.as_json() for miss in result.misses],
                "live_calls": result.live_calls,
                "comparison": comparison.as_json(),
            },
            indent=2,
            ensure_ascii=False,
        )
    lines = [
        f"replayed run {result.source.id} ({result.source.workflow_id}): "
        f"{comparison.status_a} before, {comparison.status_b} now",
    ]
    reused = set(result.reused)
    for step in comparison.steps:
        where = "reused" if step.step_id in reused and not step.path else step.change
        lines.append(
            f"  {step.name}: {where}; {step.status_a or '-'} -> {step.status_b or '-'}; "
            f"cost {_money(step.cost_a)} -> {_money(step.cost_b)}"
        )
        if step.output_changed:
            lines += [f"      {line}" for line in step.output_diff.text.splitlines()]
        elif step.output_changed is None:
            lines.append("      (an output too large to compare here)")
        for call in step.calls:
            for what, changed, diff in (
                ("prompt", call.prompt_changed, call.prompt_diff),
                ("reply", call.reply_changed, call.reply_diff),
            ):
                if changed:
                    lines.append(f"      model call {call.position}: its {what} changed")
                    lines += [f"        {line}" for line in diff.text.splitlines()]
    said = {True: "changed", False: "the same", None: "too large to compare"}
    lines.append(
        f"output: {said[comparison.output_changed]}; cost "
        f"{_money(comparison.cost_a)} -> {_money(comparison.cost_b)}"
    )
    if comparison.output_changed:
        lines += [f"  {line}" for line in comparison.output_diff.text.splitlines()]
    for call in result.live_calls:
        lines.append(f"made live: {call}")
    for miss in result.misses:
        lines.append(f"no recording: step {miss.step}, {miss.what}")
        lines += [f"  {line}" for line in miss.difference.splitlines()]
    return "\n".join(lines)


def _money(value: Any) -> str:
    return "-" if value is None else f"${value}"
