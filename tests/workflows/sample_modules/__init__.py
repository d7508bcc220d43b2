"""Workflow modules that tests of ``sync_workflows`` import by dotted path."""
