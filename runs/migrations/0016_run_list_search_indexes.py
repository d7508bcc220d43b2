# The runs page (/runs/): its account filter, newest first, and its exact search by
# correlation or idempotency key across workflows (runs.models.Run.Meta.indexes).

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0015_run_reruns"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="run",
            index=models.Index(fields=["account", "-created_at", "-id"], name="run_account_newest"),
        ),
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                condition=models.Q(("correlation__isnull", False)),
                fields=["correlation"],
                name="run_correlation",
            ),
        ),
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                condition=models.Q(("idempotency_key__isnull", False)),
                fields=["idempotency_key"],
                name="run_idempotency_key",
            ),
        ),
    ]
