"""The database cache's table (CACHES, ``dbcache://djflow_cache`` by default): the API's
throttles count in it, so ``migrate`` alone makes a working install. Does nothing when
CACHE_URL names another backend; ``createcachetable`` makes it after a later switch."""

from django.core.management import call_command
from django.db import migrations


def create_cache_table(apps, schema_editor) -> None:
    call_command("createcachetable", database=schema_editor.connection.alias, verbosity=0)


class Migration(migrations.Migration):
    dependencies: list[tuple[str, str]] = []

    operations = [migrations.RunPython(create_cache_table, migrations.RunPython.noop)]
