"""Install the engine's one beat entry: the 1-second sweep."""

from django.db import migrations

from runs.beat import OLD_SWEEP as SWEEP, install_beat_entries


def install(apps, schema_editor):
    install_beat_entries(
        apps.get_model("django_celery_beat", "IntervalSchedule"),
        apps.get_model("django_celery_beat", "PeriodicTask"),
    )


def uninstall(apps, schema_editor):
    apps.get_model("django_celery_beat", "PeriodicTask").objects.filter(name=SWEEP).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0001_initial"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(install, uninstall)]
