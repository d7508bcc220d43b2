"""The pytest plugin for workflow authors (contract section 16), registered through the
``pytest11`` entry point: the fixture ``djflow`` runs workflows in the test's process on the
test database, with no broker, no beat and no network, on a virtual clock.

    def test_the_ticket_waits_a_month(djflow):
        djflow.define(support)
        djflow.stub("support.classify", returns={"tier": "gold"})
        run = djflow.start("support", input={"ticket": 7})
        djflow.advance(30 * 86400)
        assert run.status == "completed"

Inert unless a test asks for ``djflow``: loading the plugin imports pytest only, so it
coexists with any project's conftest (our own suite loads it too, installed editable). The
engine it drives (``config.inprocess``) is imported inside the fixture: Django is set up by
then, and this module, at the bottom of the layers, names no app above it at import.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


def load(manager: pytest.PytestPluginManager) -> None:
    """Load this plugin under its entry point's name ``djflow``, unless it is loaded: for a
    session whose djflow install predates the entry point (an editable install is not made
    again when an entry point changes). Loading it under a second name would be refused."""
    import sys

    this = sys.modules[__name__]
    # is_registered: loaded by its module's name (``-p workflows.testing``) counts too.
    if not manager.has_plugin("djflow") and not manager.is_registered(this):
        manager.register(this, "djflow")


@pytest.fixture
def djflow(db: None, settings: Any) -> Iterator[Any]:
    """The engine in this process: ``define``, ``start``, ``advance``, ``approve``,
    ``reject``, ``send_event``, ``stub``, ``model``, ``tool``, ``http`` (see
    ``config.inprocess.Djflow``). Every call returns with the engine idle."""
    from config.inprocess import installed

    with installed(settings) as engine:
        yield engine
