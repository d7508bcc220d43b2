"""The deployment's own workflow that files support answers in a knowledge base and reads
them back into a recipe's prompt (issue 36's squat): ``support-answers`` is written and
read, ``support-style`` only read."""

from __future__ import annotations

from workflows.sdk import workflow

support = workflow("sample_support")
support.add(
    {
        "id": "file",
        "kind": "write_kb",
        "kb": "support-answers",
        "key": "${input.ticket}",
        "content": "${input.answer}",
    }
)
support.add(
    {
        "id": "answer",
        "kind": "recipe",
        "prompt": "Answer ${input.ticket} from ${context}",
        "context": {"kb": "support-answers"},
    }
)
support.add(
    {
        "id": "style",
        "kind": "recipe",
        "prompt": "Style: ${context}",
        "context": {"kb": "support-style"},
    }
)
