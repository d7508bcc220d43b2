"""``manage.py cancel`` and ``manage.py retry``: the bulk actions of ``POST
/api/v1/runs/cancel`` and ``/retry`` for scripts, with the same filters (checked by the
API's own serializer), as a named user, through the same service (``runs.bulk``)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from runs import bulk
from runs.serializers import RunListQuerySerializer
from workflows.errors import EngineError

from .scripting import acting_user, add_user_argument, refused, serializer_refused


class BulkCommand(BaseCommand):
    action: str
    done_word: str

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--workflow", help="runs of this workflow")
        parser.add_argument("--status", help="runs in this status")
        parser.add_argument("--account", help="runs of this account")
        parser.add_argument("--created-after", help="runs created at or after (ISO 8601)")
        parser.add_argument("--created-before", help="runs created before (ISO 8601)")
        parser.add_argument(
            "--dry-run", action="store_true", help="print how many runs it would affect, only"
        )
        parser.add_argument(
            "--background",
            action="store_true",
            help="hand the batches to the workers and return at once (default: do them here, "
            "and print what was done)",
        )
        add_user_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        user = acting_user(options["user"])
        given = {
            name: options[name]
            for name in RunListQuerySerializer.FILTERS
            if options.get(name) is not None
        }
        query = RunListQuerySerializer(data=given)
        if not query.is_valid():
            raise serializer_refused(query.errors)
        try:
            started = bulk.bulk_action_start(
                action=self.action,
                user=user,
                dry_run=options["dry_run"],
                send=options["background"],
                **query.validated_data,
            )
        except EngineError as error:
            raise refused(error) from None
        self.stdout.write(f"affected: {started.affected}")
        if started.action is None:
            return
        self.stdout.write(f"bulk action: {started.action.id}")
        if options["background"]:
            return
        finished = bulk.bulk_action_finish(bulk_id=started.action.id)
        self.stdout.write(f"{self.done_word}: {finished.done}")
        self.stdout.write(f"passed over: {finished.skipped}")
