"""``manage.py preflight WORKFLOW [--number N] [--input JSON | --input-file PATH]``.

Runs the checks ``POST /api/v1/runs`` makes before it starts anything
(``workflows.preflight.start_problems``): the input against the version's schema (when one is
given), named recipes, knowledge bases, MCP servers and tools that exist, configured model
providers, and a worker that served each handler within ``DJFLOW_UNSERVABLE_SECONDS``. It prints
each problem by the field a start would name, and exits 1 when there is any: a deploy script or
CI job can run it before switching traffic to a new version. A handler no live worker serves
now, though one served it within that window (workers restarting), is printed as a warning and
exits 0, as ``POST /runs`` accepts such a start (its run waits for a worker). It starts nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from workflows import selectors
from workflows.errors import NotFound
from workflows.preflight import NO_INPUT, start_problems, start_warnings

# An input file is a start's body: bounded like one (DJFLOW_MAX_BODY_BYTES is larger).
MAX_INPUT_BYTES = 1_048_576


class Command(BaseCommand):
    help = "Check what starting a run of a workflow would check, without starting it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("workflow", help="the workflow's id")
        parser.add_argument("--number", type=int, help="a version number (default: the latest)")
        given = parser.add_mutually_exclusive_group()
        given.add_argument("--input", help="the run's input, as JSON")
        given.add_argument("--input-file", help="a file holding the run's input, as JSON")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            version = selectors.version_get(
                workflow_id=options["workflow"], number=options["number"]
            )
        except NotFound as missing:
            raise CommandError("; ".join(e.message for e in missing.errors)) from None
        problems = start_problems(version, self._input(options))
        name = f"{version.workflow_id} version {version.number}"
        warnings = start_warnings(version, problems)
        for warning in warnings:
            self.stdout.write(f"warning: {warning.field}: {warning.message}")
        if not problems:
            waits = " (a run waits for a worker)" if warnings else ""
            self.stdout.write(f"{name}: every check passes{waits}")
            return
        for problem in problems:
            self.stdout.write(f"{problem.field or '(run)'}: {problem.message}")
        raise CommandError(f"{name}: {len(problems)} check(s) failed", returncode=1)

    def _input(self, options: dict[str, Any]) -> Any:
        text = options["input"]
        where = "--input"
        if options["input_file"]:
            where = "--input-file"
            path = Path(options["input_file"])
            try:
                with path.open("rb") as file:
                    raw = file.read(MAX_INPUT_BYTES + 1)
            except OSError as error:
                raise CommandError(f"{where}: {error.strerror or error}") from None
            if len(raw) > MAX_INPUT_BYTES:
                raise CommandError(f"{where}: larger than {MAX_INPUT_BYTES} bytes")
            text = raw.decode("utf-8", errors="replace")
        if text is None:
            return NO_INPUT
        try:
            return json.loads(text)
        except ValueError as error:
            raise CommandError(f"{where}: not JSON ({error})") from None
