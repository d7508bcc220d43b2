"""``manage.py cancel --workflow W --status running --user NAME``: bulk cancel (runs.bulk)."""

from runs import bulk

from ..bulk_command import BulkCommand


class Command(BulkCommand):
    help = (
        "Cancel, as a user, every run the filters match that the user may operate and that "
        "has not ended (at least one filter)."
    )
    action = bulk.CANCEL
    done_word = "cancelled"
