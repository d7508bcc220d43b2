"""``manage.py sync_workflows``: save the documents of the builders in ``WORKFLOW_MODULES``."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from workflows.sync import SyncError, sync_modules


class Command(BaseCommand):
    help = (
        "Import the modules in settings.WORKFLOW_MODULES (or --module) and save each workflow "
        "builder's document as a version. The same body again keeps its version, so running "
        "this twice creates nothing the second time."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--module",
            action="append",
            dest="modules",
            metavar="DOTTED.PATH",
            help="a module to import instead of settings.WORKFLOW_MODULES (repeatable)",
        )

    def handle(self, *args: Any, modules: list[str] | None = None, **options: Any) -> None:
        names = modules if modules else list(settings.WORKFLOW_MODULES)
        try:
            results = sync_modules(names)
        except SyncError as exc:
            self._report(exc.saved)
            raise CommandError(f"sync_workflows failed:\n{exc}") from exc
        if not results:
            self.stderr.write("No workflow builders found: set WORKFLOW_MODULES or pass --module.")
        self._report(results)

    def _report(self, results: list[tuple[str, Any]]) -> None:
        for workflow_id, result in results:
            state = "created" if result.created else "unchanged"
            self.stdout.write(f"{workflow_id} v{result.version.number} {state}")
