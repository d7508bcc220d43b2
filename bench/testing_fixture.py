"""Seconds per test of the ``djflow`` fixture (issue 38's goal: under 0.5 s): a support
workflow with a 30-day sleep, a stubbed task, a recipe answered by the model stub and an
approval, tested through the fixture as an author's test would, ``--repeat`` times in one
pytest session (pytest-django's test database, made once, is not counted).

    .venv/bin/python -m bench.testing_fixture --repeat 20

Prints the median and the slowest of setup + call + teardown per test. It uses the tests'
settings (pyproject.toml's pytest section: DATABASE_URL and the rest from the environment).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

PROJECT = Path(__file__).resolve().parent.parent
CASE = """
import pytest

# The support workflow of the plugin's tests: a stubbed task, a 30-day sleep, a recipe and an
# approval.
from tests.workflows.test_testing_plugin import DAY, support


@pytest.mark.parametrize("round", range(REPEAT))
def test_support(djflow, round):
    djflow.stub("tp_support.classify", returns={"tier": "gold"})
    djflow.model(reply="We will refund you.")
    run = djflow.start(support, input={"question": "refund?"})
    djflow.advance(30 * DAY)
    djflow.approve(run, "review", by="lead@example.com")
    assert run.status == "completed", run.error
"""


QUIET = ("-n", "0", "-q", "-p", "no:cacheprovider")


class Durations:
    """Each test's setup + call + teardown, from pytest's own reports."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.passed = 0

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        self.passed += report.when == "call" and report.passed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    durations = Durations()
    with tempfile.TemporaryDirectory() as folder:
        case = Path(folder) / "bench_testing_fixture.py"
        case.write_text(CASE.replace("REPEAT", str(args.repeat)))
        # The plugin as its entry point loads it (an install may predate the entry point).
        (Path(folder) / "conftest.py").write_text(
            "from workflows import testing\n\n\ndef pytest_configure(config):\n"
            "    testing.load(config.pluginmanager)\n"
        )
        code = pytest.main(
            # The project's pytest settings (pytest-django's DJANGO_SETTINGS_MODULE, the
            # services' defaults), as its own tests have them.
            ["-c", str(PROJECT / "pyproject.toml"), "--rootdir", str(PROJECT), str(case), *QUIET],
            plugins=[durations],
        )
    if code != 0 or durations.passed != args.repeat:
        print(f"{durations.passed} of {args.repeat} tests passed", file=sys.stderr)
        return int(code) or 1
    # The first test's setup makes the test database: not the fixture's cost.
    seconds = list(durations.seconds.values())[1:]
    print(
        f"djflow fixture, a 30-day sleep + approval + recipe + stubbed task: "
        f"median {statistics.median(seconds):.3f} s per test, slowest {max(seconds):.3f} s "
        f"({len(seconds)} tests)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
