"""``standin:echo``: a clearly labelled offline stand-in for a model, used where no provider
is configured (the standalone, the examples). Always configured, never on the network.

Deterministic: the same request gets the same reply. Its text starts with
``[stand-in model]`` and echoes a digest of the last user message. With ``json`` it answers
JSON: for a ``json_schema``, a minimal instance valid for that schema (enum: the first value;
const; required properties, filled recursively; string "stand-in" within its length bounds;
number and integer: the minimum or 0; boolean false; array: ``minItems`` copies of its
item). ``pattern``, ``uniqueItems`` with several items, ``not`` and conditionals are not
honoured: a schema that needs them gets an instance that may not validate, which the recipe
step reports like any model's invalid output.
Usage: the input estimate, and a quarter of the reply's bytes (rounded up) for output.

Embeddings (:func:`embed`): a hashed bag of words, so the embedded default and the tests
retrieve by meaning-free but stable vectors without a key. Each lower-cased word is hashed
(BLAKE2b, 8 bytes) to one of ``dimensions`` buckets (384 unless asked) with a sign from
another bit of the hash, weighted ``1 + ln(count)``; the vector is scaled to length 1.
Texts sharing words are near in cosine distance, equal texts are equal vectors, and a
text of no word characters hashes as one word. Usage: a quarter of the bytes, rounded up,
per text.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections import Counter
from typing import Any, TypeVar

from .base import EmbedReply, ModelReply, ModelRequest, estimate_input_tokens
from .registry import Provider

T = TypeVar("T")

LABEL = "[stand-in model]"
# The size of all-MiniLM-L6-v2's vectors, a common local embeddings model.
EMBED_DIMENSIONS = 384
_WORD = re.compile(r"\w+")
STRING = "stand-in"
MAX_DEPTH = 32
_EXAMPLE_FORMATS = {
    "date": "2000-01-01",
    "date-time": "2000-01-01T00:00:00Z",
    "time": "00:00:00Z",
    "email": "stand-in@example.com",
    "uri": "https://example.com/stand-in",
    "url": "https://example.com/stand-in",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "192.0.2.1",
    "hostname": "example.com",
}


def call(provider: Provider, request: ModelRequest) -> ModelReply:
    text = _answer(request)
    return ModelReply(
        text=text,
        model=request.model,
        input_tokens=estimate_input_tokens(request),
        output_tokens=math.ceil(len(text.encode("utf-8")) / 4),
        stop_reason="end_turn",
        request_id=f"standin-{_digest(text)}",
    )


def embed(
    provider: Provider,
    model: str,
    texts: list[str],
    *,
    dimensions: int | None,
    timeout_s: float,
) -> EmbedReply:
    size = dimensions or EMBED_DIMENSIONS
    return EmbedReply(
        vectors=[embedding(text, size) for text in texts],
        model=model,
        input_tokens=sum(math.ceil(len(text.encode("utf-8")) / 4) for text in texts),
        request_id=f"standin-{_digest(chr(0).join(texts))}",
    )


def embedding(text: str, dimensions: int = EMBED_DIMENSIONS) -> list[float]:
    """The stand-in's vector of ``text`` (the module says how it is made)."""
    counts = Counter(_WORD.findall(text.lower())) or Counter([text.strip()])
    vector = [0.0] * dimensions
    for word, count in counts.items():
        hashed = _word_hash(word)
        sign = 1.0 if hashed >> 63 else -1.0
        vector[hashed % dimensions] += sign * (1.0 + math.log(count))
    norm = math.sqrt(sum(value * value for value in vector))
    if norm == 0.0:
        # Words cancelled out in every bucket they share: the first word's bucket stands in.
        vector[_word_hash(next(iter(counts))) % dimensions] = 1.0
        return vector
    return [value / norm for value in vector]


@functools.lru_cache(maxsize=65_536)
def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "big")


def _answer(request: ModelRequest) -> str:
    summary = _summary(_last_user_message(request))
    if not request.json:
        return f"{LABEL} {summary}"
    if request.json_schema is None:
        return json.dumps({"stand_in_model": summary})
    return json.dumps(instance(request.json_schema))


def _last_user_message(request: ModelRequest) -> str:
    for message in reversed(request.messages):
        if message.get("role") == "user":
            return message.get("content", "")
    return ""


def _summary(text: str) -> str:
    head = " ".join(text.split())[:80]
    return f"echo of {len(text)} characters (sha256 {_digest(text)}): {head!r}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def instance(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """A minimal JSON value valid for ``schema`` (within the limits the module states)."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return None
    if "$ref" in schema:
        return instance(_resolve(schema["$ref"], root), root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if isinstance(schema.get("allOf"), list) and schema["allOf"]:
        return instance(_merged(schema, root), root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return instance(schema[key][0], root, depth + 1)
    return _BY_TYPE[_type_of(schema)](schema, root, depth)


def _resolve(ref: Any, root: Any) -> Any:
    """A local ``#/...`` reference; anything else resolves to nothing."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _merged(schema: dict[str, Any], root: Any) -> dict[str, Any]:
    """allOf folded into one schema: properties united, required lists joined."""
    merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
    for part in schema["allOf"]:
        part = _resolve(part["$ref"], root) if isinstance(part, dict) and "$ref" in part else part
        if not isinstance(part, dict):
            continue
        for key, value in part.items():
            if key == "properties" and isinstance(value, dict):
                merged["properties"] = {**merged.get("properties", {}), **value}
            elif key == "required" and isinstance(value, list):
                merged["required"] = [*merged.get("required", []), *value]
            else:
                merged.setdefault(key, value)
    return merged


def _type_of(schema: dict[str, Any]) -> str:
    declared = schema.get("type")
    if isinstance(declared, list):
        declared = next((t for t in declared if t != "null"), declared[0] if declared else None)
    if isinstance(declared, str) and declared in _BY_TYPE:
        return declared
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return "string"


def _object(schema: dict[str, Any], root: Any, depth: int) -> dict[str, Any]:
    properties = _field(schema, "properties", dict, {})
    required = _field(schema, "required", list, [])
    return {
        name: instance(properties.get(name, {}), root, depth + 1)
        for name in required
        if isinstance(name, str)
    }


def _field(schema: dict[str, Any], key: str, kind: type[T], otherwise: T) -> T:
    """``schema[key]`` when it is a ``kind``, else ``otherwise`` (a malformed keyword is
    ignored, as the validator would refuse the schema itself)."""
    value = schema.get(key)
    return value if isinstance(value, kind) else otherwise


def _array(schema: dict[str, Any], root: Any, depth: int) -> list[Any]:
    count = schema.get("minItems", 0) if isinstance(schema.get("minItems"), int) else 0
    prefix = _field(schema, "prefixItems", list, [])
    items = schema.get("items", {})
    return [
        instance(prefix[i] if i < len(prefix) else items, root, depth + 1) for i in range(count)
    ]


def _string(schema: dict[str, Any], root: Any, depth: int) -> str:
    text = _EXAMPLE_FORMATS.get(str(schema.get("format")), STRING)
    low = schema.get("minLength", 0)
    high = schema.get("maxLength")
    if isinstance(low, int) and len(text) < low:
        text = text + "-" * (low - len(text))
    if isinstance(high, int) and len(text) > high:
        text = text[:high]
    return text


def _number(schema: dict[str, Any], root: Any, depth: int) -> int | float:
    integer = _type_of(schema) == "integer"
    bound = {
        key: schema[key]
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
        if isinstance(schema.get(key), int | float) and not isinstance(schema[key], bool)
    }
    value: float = 0
    if "minimum" in bound:
        value = bound["minimum"]
    elif "exclusiveMinimum" in bound:
        value = bound["exclusiveMinimum"] + (1 if integer else 0.5)
    elif bound.get("maximum", 0) < 0:
        value = bound["maximum"]
    elif bound.get("exclusiveMaximum", 1) <= 0:
        value = bound["exclusiveMaximum"] - 1
    if integer:
        return math.ceil(value)
    return int(value) if float(value).is_integer() else value


_BY_TYPE: dict[str, Any] = {
    "object": _object,
    "array": _array,
    "string": _string,
    "number": _number,
    "integer": _number,
    "boolean": lambda schema, root, depth: False,
    "null": lambda schema, root, depth: None,
}
