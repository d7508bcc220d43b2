"""A run's stored bytes: the running total of what its journal holds, checked against
DJFLOW_MAX_RUN_BYTES (runs.engine.store.charging). A column with a constant default: added
without rewriting the runs table (Postgres 11+), existing runs counted from 0."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0025_run_faults"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="stored_bytes",
            field=models.BigIntegerField(db_default=0, default=0),
        ),
    ]
