"""Run trees: the operator's cap on the runs one root may start and their pace
(runs.engine.trees), kept on a new table beside the root's row, and the ``tree_pace`` timer
of a child run waiting for its tree's pace. A new, empty table and a choices change (no
schema change on the timers): no lock on the runs' own table."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0026_run_stored_bytes"),
    ]

    operations = [
        migrations.CreateModel(
            name="RunTree",
            fields=[
                (
                    "root_run",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="+",
                        serialize=False,
                        to="runs.run",
                    ),
                ),
                ("runs", models.PositiveIntegerField(default=0)),
                ("paced_until", models.DateTimeField(blank=True, null=True)),
            ],
        ),
        migrations.AlterField(
            model_name="timer",
            name="purpose",
            field=models.CharField(
                choices=[
                    ("sleep", "Sleep"),
                    ("wait_timeout", "Wait Timeout"),
                    ("step_deadline", "Step Deadline"),
                    ("run_deadline", "Run Deadline"),
                    ("retry_backoff", "Retry Backoff"),
                    ("approval_timeout", "Approval Timeout"),
                    ("approval_reminder", "Approval Reminder"),
                    ("unservable", "Unservable"),
                    ("in_doubt", "In Doubt"),
                    ("tree_pace", "Tree Pace"),
                ],
                max_length=20,
            ),
        ),
    ]
