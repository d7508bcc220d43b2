"""``manage.py run_export RUN_ID [-o FILE]``: the run's export (runs.export), as trusted code
sees it (secrets masked, tracebacks shown), to FILE or standard output."""

from __future__ import annotations

import os
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runs import export
from workflows.errors import NotFound


class Command(BaseCommand):
    help = "Write one run's export (format djflow-run-export) to FILE or standard output."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("run_id", help="the run's id")
        parser.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")

    def handle(self, *args: Any, run_id: str, output: str | None, **options: Any) -> None:
        try:
            found = export.run_export(run_id=run_id)
        except NotFound as missing:
            raise CommandError(f"no run {run_id!r}") from missing
        if output is None:
            for chunk in found.chunks():
                self.stdout.write(chunk, ending="")
            self.stdout.flush()
            return
        # Written beside FILE and moved over it once whole: an export that fails half-way
        # leaves no FILE that looks complete.
        partial = f"{output}.part"
        try:
            with open(partial, "w", encoding="utf-8") as out:
                for chunk in found.chunks():
                    out.write(chunk)
            os.replace(partial, output)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
