"""``manage.py start WORKFLOW --input JSON --user NAME``: start a run, print its id.

Through ``run_start``, as ``POST /api/v1/runs``, with the named user's permissions: a user
who may not start the workflow is refused as the API would refuse them."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from runs import services
from workflows.errors import EngineError
from workflows.forms import json_from_text

from ..scripting import acting_user, add_user_argument, refused


class Command(BaseCommand):
    help = "Start a run of a workflow as a user; prints the run's id."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("workflow", help="the workflow's id")
        parser.add_argument("--input", default="null", help="the run's input, as JSON")
        # Not --version: every command has that one (Django's own version).
        parser.add_argument(
            "--workflow-version", type=int, help="pin a version (default: the latest)"
        )
        parser.add_argument("--idempotency-key", help="the same key starts no second run")
        parser.add_argument("--correlation", help="a reference of your own, kept on the run")
        parser.add_argument("--account", help="the account its model calls count against")
        # Checked by run_start (0 to 9, the API's refusal): argparse's own would say less.
        parser.add_argument(
            "--priority", type=int, help="0 (lowest) to 9 (highest), default 5 (POST /runs's)"
        )
        add_user_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        user = acting_user(options["user"])
        try:
            # The admin's JSON rules (the API parser's): no NaN, \u0000, lone surrogate or
            # nesting past the limit, which the database or the service would fail on.
            given = json_from_text(options["input"])
        except ValidationError as error:
            raise CommandError(f"--input: {'; '.join(error.messages)}") from None
        try:
            result = services.run_start(
                workflow=options["workflow"],
                input=given,
                version=options["workflow_version"],
                idempotency_key=options["idempotency_key"],
                correlation=options["correlation"],
                account=options["account"],
                priority=options["priority"],
                user=user,
            )
        except EngineError as error:
            raise refused(error) from None
        self.stdout.write(str(result.run.id))
