"""Structured-output fields of OpenAI request bodies -> ``SamplingParams.structured_output``.

Three spellings, of which a body may use one:

* OpenAI's ``response_format``: ``{"type": "text"}`` (free text), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
* vLLM's ``structured_outputs``: an object with exactly one of ``json`` (a schema, as an object
  or its JSON text), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF) and
  ``json_object: true``;
* vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``.

Only the shape is checked here (the router has no grammar library): whether a schema, pattern or
grammar can be enforced is the workers' check, whose refusal reaches the client as a 400 naming
the problem. Anything malformed here is a :class:`BadRequest` naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from proto.pdserve.v1 import generate_pb2 as gpb
from router.errors import BadRequest

# vLLM's structured_outputs keys (and their guided_* names) -> grammar kinds
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice",
               "grammar": "grammar", "json_object": "json_object"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_output(body: dict[str, Any]) -> gpb.StructuredOutput | None:
    """The grammar ``body`` asks its output to match, or None for free text."""
    found = [(key, _parse(key, body[key])) for key in ("response_format", "structured_outputs",
                                                        *_GUIDED) if body.get(key) is not None]
    asked = [(key, spec) for key, spec in found if spec is not None]
    if len(asked) > 1:
        raise BadRequest(f"'{asked[0][0]}' and '{asked[1][0]}' both ask for a structured output: "
                         "give one")
    return asked[0][1] if asked else None


def _parse(key: str, value: Any) -> gpb.StructuredOutput | None:
    if key == "response_format":
        return _response_format(value)
    if key == "structured_outputs":
        return _vllm(value)
    return _vllm_value(_GUIDED[key], value, key)


def _response_format(value: Any) -> gpb.StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise BadRequest("'response_format' must be an object with a string 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return gpb.StructuredOutput(kind="json_object")
    if kind != "json_schema":
        raise BadRequest(f"'response_format.type' {kind!r} is not supported: use 'text', "
                         "'json_object' or 'json_schema'")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest("'response_format.json_schema' must be an object with a 'schema'")
    if not isinstance(spec.get("name", ""), str):
        raise BadRequest("'response_format.json_schema.name' must be a string")
    if "schema" not in spec:
        raise BadRequest("'response_format.json_schema.schema' is required")
    return _schema(spec["schema"], "response_format.json_schema.schema")


def _vllm(value: Any) -> gpb.StructuredOutput | None:
    if not isinstance(value, dict):
        raise BadRequest("'structured_outputs' must be an object")
    unknown = sorted(k for k in value if k not in _VLLM_KINDS)
    if unknown:
        raise BadRequest(f"'structured_outputs.{unknown[0]}' is not supported: give one of "
                         f"{', '.join(_VLLM_KINDS)}")
    asked = [k for k, v in value.items() if v is not None and v is not False]
    if len(asked) != 1:
        raise BadRequest("'structured_outputs' must set exactly one of "
                         f"{', '.join(_VLLM_KINDS)}")
    return _vllm_value(asked[0], value[asked[0]], f"structured_outputs.{asked[0]}")


def _vllm_value(key: str, value: Any, where: str) -> gpb.StructuredOutput:
    kind = _VLLM_KINDS[key]
    if kind == "json_schema":
        return _schema(value, where)
    if kind == "json_object":
        if value is not True:
            raise BadRequest(f"'{where}' must be true")
        return gpb.StructuredOutput(kind="json_object")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(
                isinstance(o, str) and o for o in value):
            raise BadRequest(f"'{where}' must be a non-empty list of non-empty strings")
        return gpb.StructuredOutput(kind="choice", value=json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{where}' must be a non-empty string")
    return gpb.StructuredOutput(kind=kind, value=value)


def _schema(value: Any, where: str) -> gpb.StructuredOutput:
    """A JSON schema given as an object (or ``true``), or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise BadRequest(f"'{where}' is not valid JSON: {exc}") from exc
    if value is not True and not isinstance(value, dict):
        raise BadRequest(f"'{where}' must be a JSON schema object")
    return gpb.StructuredOutput(kind="json_schema",
                                value=json.dumps(value, ensure_ascii=False))
