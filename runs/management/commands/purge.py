"""``manage.py purge --older-than DAYS [--status S ...] [--dry-run]``: delete ended runs
(whole trees, with everything of theirs) that ended more than DAYS days ago, and print how
many rows of what it deleted (or, dry, would delete). The same code as the retention beat
entry (``runs.retention``); like every command without a user, it acts as the site's
operator (it needs the database, not an account)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from runs import retention
from runs.status import RUN_TERMINAL


class Command(BaseCommand):
    help = "Delete ended runs older than --older-than days (only ended runs; whole trees)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            type=int,
            required=True,
            metavar="DAYS",
            help="runs that ended more than this many days ago",
        )
        parser.add_argument(
            "--status",
            action="append",
            choices=sorted(RUN_TERMINAL),
            help="only runs that ended so (repeat for several; default: every ended status)",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="print what it would delete; delete nothing"
        )
        parser.add_argument(
            "--batch",
            type=int,
            default=settings.DJFLOW["RETENTION_BATCH"],
            help="run trees per transaction (default DJFLOW_RETENTION_BATCH)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        days = options["older_than"]
        if days < 0:
            raise CommandError(f"--older-than: must be 0 or more days, not {days}")
        if options["batch"] < 1:
            raise CommandError(f"--batch: must be at least 1, not {options['batch']}")
        statuses = sorted(set(options["status"] or RUN_TERMINAL))
        report = retention.retention_purge(
            older_than=dict.fromkeys(statuses, timedelta(days=days)),
            dry_run=options["dry_run"],
            batch=options["batch"],
        )
        verb = "would delete" if options["dry_run"] else "deleted"
        self.stdout.write(
            f"{verb} {report.runs} run(s) ({', '.join(statuses)}) older than {days} day(s)"
        )
        for line in report.lines():
            self.stdout.write(f"  {line}")
        if report.kept_live:
            self.stdout.write(f"kept {report.kept_live} run tree(s) with a run not ended")
