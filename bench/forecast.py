"""``python -m bench.forecast``: how long ``workflows.forecast`` takes on a document of 500
steps (issue 39: the goal is under 50 ms), pure Python: no Django, no database.

The document mixes what the walk does work for: recipes (priced, JSON ones asking twice),
tasks with retries, foreach and loop steps with bodies of several steps, and conditions.
Prints the median and the slowest of ``--repeat`` forecasts::

    .venv/bin/python -m bench.forecast            # --steps 500 --repeat 50
"""

from __future__ import annotations

import argparse
import statistics
import time
from decimal import Decimal
from typing import Any

from workflows.forecast import Sources, forecast


def _price(model: str, input_tokens: int, output_tokens: int) -> Decimal:
    return Decimal(input_tokens) * Decimal("0.00000015") + Decimal(output_tokens) * Decimal(
        "0.0000006"
    )


def _recipe_of(step: Any) -> dict[str, Any]:
    return {**step, "max_tokens": 1024}


def document(steps: int) -> dict[str, Any]:
    """About ``steps`` steps, nested ones included."""
    made: list[dict[str, Any]] = []
    count = 0
    while count < steps:
        n = len(made)
        recipe = {
            "id": f"r{n}",
            "kind": "recipe",
            "prompt": "Sort ${input}",
            "model": "o:m",
            "output": "json" if n % 2 else "text",
        }
        made.append(recipe)
        made.append({"id": f"t{n}", "kind": "task", "handler": "h", "retry": {"max_attempts": 3}})
        made.append(
            {
                "id": f"f{n}",
                "kind": "foreach",
                "items": "${input.xs}",
                "max_items": 10,
                "do": [
                    {"id": f"fa{n}", "kind": "task", "handler": "h"},
                    {"id": f"fb{n}", "kind": "recipe", "prompt": "x", "model": "o:m"},
                ],
            }
        )
        made.append(
            {
                "id": f"c{n}",
                "kind": "condition",
                "if": {"path": "input.x", "equals": 1},
                "then": [{"id": f"ct{n}", "kind": "task", "handler": "h"}],
                "else": [
                    {
                        "id": f"ce{n}",
                        "kind": "loop",
                        "max_iterations": 3,
                        "do": {"id": f"cl{n}", "kind": "task", "handler": "h"},
                    }
                ],
            }
        )
        count += 9
    return {"id": "bench", "steps": made}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=50)
    options = parser.parse_args()
    doc = document(options.steps)
    sources = Sources(price=_price, recipe_of=_recipe_of)
    times = []
    for _ in range(options.repeat):
        started = time.perf_counter()
        result = forecast(doc, sources)
        times.append(time.perf_counter() - started)
    print(f"steps in document: about {options.steps}; per_step entries: {len(result.per_step)}")
    print(
        f"forecast: median {statistics.median(times) * 1000:.2f} ms, "
        f"slowest {max(times) * 1000:.2f} ms over {options.repeat}"
    )


if __name__ == "__main__":
    main()
