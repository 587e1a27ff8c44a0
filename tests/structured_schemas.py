"""JSON schemas for the structured-output tests through the engine and the servers.

Each schema's language is finite (bounded numbers, strings, arrays and nesting), so a greedy
model that wanders inside it still ends: JSON's whitespace runs are bounded too
(``engine.sampling.grammar.MAX_JSON_WHITESPACE``), and :data:`MAX_TOKENS` covers the longest
output any of them admits on the built-in model. Together they cover what users send: objects
(nested, optional and extra keys), arrays, enums, ranges, patterns, formats, ``anyOf``/``oneOf``,
``$ref`` and pydantic's style.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

MAX_TOKENS = 640

_SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}
_SHORT_STR = {"type": "string", "maxLength": 6}

SCHEMAS: dict[str, Any] = {
    "flat object": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                              "maximum": 150},
        "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]},
    "nested objects": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": _SMALL_INT,
            "address": {"type": "object", "properties": {"zip": {"type": "string",
                                                                  "pattern": "^[0-9]{5}$"}},
                        "required": ["zip"]}},
            "required": ["id", "address"]}},
        "required": ["user"]},
    "array of objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"x": _SMALL_INT}, "required": ["x"]}},
    "string enum": {"enum": ["red", "green", "blue"]},
    "mixed enum": {"enum": [1, "a", None, True, {"x": [1, 2]}]},
    "integer range": {"type": "integer", "minimum": -5, "maximum": 120},
    "exclusive integer range": {"type": "integer", "exclusiveMinimum": 0,
                                "exclusiveMaximum": 10},
    "multipleOf": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 1000},
    "string pattern": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}-[0-9]{2}$"},
    "string lengths": {"type": "string", "minLength": 2, "maxLength": 5},
    "boolean": {"type": "boolean"},
    "null": {"type": "null"},
    "anyOf": {"anyOf": [_SMALL_INT, {"type": "string", "maxLength": 4},
                        {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]},
    "disjoint oneOf": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                 {"type": "boolean"}]},
    "nullable type list": {"type": "object", "properties": {"v": {"type": ["string", "null"],
                                                                  "maxLength": 3}},
                           "required": ["v"]},
    "optional fields": {"type": "object", "properties": {
        "a": _SMALL_INT, "b": {"type": "string", "maxLength": 4}, "c": {"type": "boolean"}},
        "required": ["b"]},
    "additionalProperties false": {"type": "object", "properties": {"k": _SMALL_INT},
                                   "required": ["k"], "additionalProperties": False},
    "defs and ref": {"$defs": {"point": {"type": "object", "properties": {
        "x": _SMALL_INT, "y": _SMALL_INT}, "required": ["x", "y"]}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
                                         "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"]},
    "const": {"const": {"version": 2, "tags": ["a", "b"]}},
    "prefixItems": {"type": "array", "prefixItems": [_SMALL_INT, _SHORT_STR,
                                                     {"type": "boolean"}],
                    "items": False, "minItems": 3},
    "formats": {"type": "object", "properties": {
        "day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"}},
                "required": ["day", "id"]},
    "nested arrays": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "maxItems": 3, "items": _SMALL_INT}},
    "pydantic style": {"title": "Reply", "type": "object", "properties": {
        "answer": {"title": "Answer", "description": "the answer", "type": "string",
                   "maxLength": 6},
        "score": {"anyOf": [_SMALL_INT, {"type": "null"}], "default": None}},
        "required": ["answer"], "additionalProperties": False},
}


def check_json(text: str, schema: Any) -> Any:
    """The JSON value of ``text``, validated against ``schema`` (raises if either fails)."""
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value
