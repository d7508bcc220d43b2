import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from config import tracing

# Before the application loads its middleware: Django's instrumentation adds its own.
tracing.setup("web", django=True)
application = get_asgi_application()
