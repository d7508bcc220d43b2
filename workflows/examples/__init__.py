"""Example workflows, written with the builder. Name one in ``WORKFLOW_MODULES`` to load it."""
