"""An AI example (CONTRACT section 10): a JSON recipe triages a ticket, a condition reads its
answer, and a text recipe drafts the reply for the branch taken.

Its recipe steps name no model: they use ``DJFLOW_DEFAULT_MODEL``. ``manage.py standalone``
sets that to the offline stand-in (``standin:echo``, whose answers start with
``[stand-in model]`` and whose JSON fits the schema it was asked for) when no provider is
configured, so the example runs to the end on a laptop with nothing installed; with
``OPENAI_API_KEY`` (or ``ANTHROPIC_API_KEY``) and ``DJFLOW_DEFAULT_MODEL`` set, a real model
answers.

Load it with ``WORKFLOW_MODULES=workflows.examples.ticket_triage``.
"""

from __future__ import annotations

from workflows.sdk import recipe, when, workflow

TRIAGE_SCHEMA = {
    "type": "object",
    "required": ["kind", "urgency"],
    "additionalProperties": False,
    "properties": {
        "kind": {"enum": ["bug", "question"]},
        "urgency": {"enum": ["low", "high"]},
    },
}

triage = workflow(
    "ticket_triage",
    description="A model triages a ticket (JSON); a condition routes it; a model drafts the reply.",
    input_schema={
        "type": "object",
        "required": ["ticket"],
        "properties": {"ticket": {"type": "string", "minLength": 1, "maxLength": 20000}},
    },
    # A run spends at most 50 cents on models: each call's worst case is reserved first.
    limits={"max_steps": 20, "run_timeout_ms": 300_000, "max_cost_usd": 0.5},
)

triage.recipe(
    "classify",
    system="You triage customer support tickets. Answer with a JSON object only.",
    prompt=(
        'Is this ticket a "bug" or a "question", and is its urgency "low" or "high"?\n\n'
        "${input.ticket}"
    ),
    output="json",
    output_schema=TRIAGE_SCHEMA,
    max_tokens=100,
)

triage.condition(
    "route",
    if_=when("steps.classify.output.kind", "eq", "bug"),
    then=[
        recipe(
            "draft_bug_reply",
            input="${input}",
            system="You write short, kind replies to customers.",
            prompt=(
                "The customer reported a bug. Thank them, say the team is on it, and ask for "
                "the steps to reproduce it if the ticket lacks them.\n\nTicket: ${input.ticket}"
            ),
            max_tokens=300,
        )
    ],
    else_=[
        recipe(
            "draft_answer",
            input="${input}",
            system="You answer customers' questions briefly.",
            prompt="Answer this question from a customer.\n\nQuestion: ${input.ticket}",
            max_tokens=300,
        )
    ],
)

triage.output(
    {
        "kind": "${steps.classify.output.kind}",
        "urgency": "${steps.classify.output.urgency}",
        "reply": "${steps.route.output}",
    }
)
