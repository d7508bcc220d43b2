"""Knowledge-base examples (CONTRACT section 10): one workflow keeps a resolved ticket's
answer in the knowledge base ``support-answers``; a second answers a new ticket with the best
of those answers retrieved into its prompt (``${context}``).

Run ``kb_remember_answer`` first (``{"ticket_id": "T-1", "ticket": "Export crashes",
"answer": "Clear the export cache, then export again."}``): its ``write_kb`` step creates the
knowledge base on its first write, and a second run with a changed answer writes version 2
of the same key. Then ``kb_answer_ticket`` with ``{"ticket": "The export crashes again"}``:
its start checks that the knowledge base exists (pre-flight), its recipe step retrieves the
three best passages for the ticket's words and records which (key, version, score) on the
model call. The answering recipe names no model: ``DJFLOW_DEFAULT_MODEL``, which
``manage.py standalone`` sets to the offline stand-in when no provider is configured; the
stand-in echoes the start of the prompt, where the passages are.

Load it with ``WORKFLOW_MODULES=workflows.examples.kb_support``.
"""

from __future__ import annotations

from workflows.sdk import workflow

KB = "support-answers"

remember = workflow(
    "kb_remember_answer",
    description="Keep a resolved ticket's answer in the support-answers knowledge base.",
    input_schema={
        "type": "object",
        "required": ["ticket_id", "ticket", "answer"],
        "properties": {
            "ticket_id": {"type": "string", "minLength": 1, "maxLength": 200},
            "ticket": {"type": "string", "minLength": 1, "maxLength": 500},
            "answer": {"type": "string", "minLength": 1, "maxLength": 50000},
        },
    },
    limits={"max_steps": 10, "run_timeout_ms": 120_000},
)
# The key is the ticket: answering it again writes a new version, the same answer again none.
remember.write_kb(
    "remember",
    kb=KB,
    key="${input.ticket_id}",
    title="${input.ticket}",
    content="${input.answer}",
)
remember.output("${steps.remember.output}")

answer = workflow(
    "kb_answer_ticket",
    description="Answer a ticket with the best past answers retrieved as context.",
    input_schema={
        "type": "object",
        "required": ["ticket"],
        "properties": {"ticket": {"type": "string", "minLength": 1, "maxLength": 20000}},
    },
    limits={"max_steps": 10, "run_timeout_ms": 300_000, "max_cost_usd": 0.5},
)
answer.recipe(
    "answer",
    system="You answer customer support tickets, using the past answers given when they fit.",
    prompt=(
        "${context}\n\n---\nThe passages above are past answers from the support team. "
        "Answer this ticket briefly:\n\n${input.ticket}"
    ),
    context={"kb": KB, "query": "${input.ticket}", "top_k": 3},
    max_tokens=300,
)
answer.output({"reply": "${steps.answer.output}"})
