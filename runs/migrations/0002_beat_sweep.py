"""Install the engine's one beat entry: the 1-second sweep (STYLE.md: periodic work is code)."""

from django.db import migrations

TASK_NAME = "djflow: sweep (every second)"


def install(apps, schema_editor):
    IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    every_second, _ = IntervalSchedule.objects.get_or_create(every=1, period="seconds")
    PeriodicTask.objects.update_or_create(
        name=TASK_NAME,
        defaults={
            "task": "runs.sweep",
            "interval": every_second,
            "queue": "engine",
            "enabled": True,
            # A tick that waited past the next one is worthless: drop it, the next comes.
            "expire_seconds": 5,
            "description": "Advances runs with a due retry, deadline or lost worker.",
        },
    )


def uninstall(apps, schema_editor):
    apps.get_model("django_celery_beat", "PeriodicTask").objects.filter(name=TASK_NAME).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0001_initial"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(install, uninstall)]
