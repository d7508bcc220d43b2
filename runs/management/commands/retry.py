"""``manage.py retry --workflow W --status failed --user NAME``: bulk retry (runs.bulk)."""

from runs import bulk

from ..bulk_command import BulkCommand


class Command(BulkCommand):
    help = (
        "Retry, as a user, every failed top-level run the filters match that the user may "
        "operate, from its failed step (at least one filter)."
    )
    action = bulk.RETRY
    done_word = "retried"
