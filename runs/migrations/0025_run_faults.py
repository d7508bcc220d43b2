"""Run faults: a periodic pass that failed on a run, and until when it leaves the run alone
(runs.engine.isolation). A new, empty table: no lock on the runs' own."""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0024_run_distribution_statistics"),
    ]

    operations = [
        migrations.CreateModel(
            name="RunFault",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("pass_name", models.CharField(max_length=60)),
                ("error", models.TextField()),
                ("failures", models.PositiveIntegerField(default=1)),
                ("first_failed_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("last_failed_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("retry_at", models.DateTimeField()),
                (
                    "run",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="faults",
                        to="runs.run",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(fields=("run", "pass_name"), name="run_fault_run_pass")
                ],
            },
        ),
    ]
