"""The door's reading of the structured-output fields (router/openai_structured.py): each of
the three spellings becomes the same grammar on the wire, free text stays unconstrained, and
malformed fields are refused naming the field (the cluster tests cover what the workers
refuse)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.errors import BadRequest
from router.openai_request import chat_call, completion_call
from router.openai_structured import structured_output

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                "strict": True}}},
    {"structured_outputs": {"json": SCHEMA}},
    {"structured_outputs": {"json": json.dumps(SCHEMA)}},
    {"guided_json": SCHEMA},
    {"guided_json": json.dumps(SCHEMA)},
])
def test_every_spelling_of_a_schema_is_the_same_grammar(fields: dict[str, Any]) -> None:
    spec = structured_output(fields)
    assert spec is not None
    assert (spec.kind, json.loads(spec.value)) == ("json_schema", SCHEMA)


@pytest.mark.parametrize(("fields", "kind", "value"), [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes", "no"]'),
    ({"guided_choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
])
def test_other_kinds(fields: dict[str, Any], kind: str, value: str) -> None:
    spec = structured_output(fields)
    assert spec is not None and (spec.kind, spec.value) == (kind, value)


def test_free_text_and_absent_fields_set_nothing() -> None:
    assert structured_output({}) is None
    assert structured_output({"response_format": {"type": "text"}}) is None
    call = chat_call({"messages": [{"role": "user", "content": "hi"}],
                      "response_format": {"type": "text"}}, "r")
    assert not call.request.sampling.HasField("structured_output")


def test_both_endpoints_carry_the_grammar_to_the_workers() -> None:
    fields = {"response_format": {"type": "json_object"}}
    chat = chat_call({"messages": [{"role": "user", "content": "hi"}], **fields}, "r")
    completion = completion_call({"prompt": "hi", **fields}, "r")
    for call in (chat, completion):
        assert call.request.sampling.structured_output.kind == "json_object"


@pytest.mark.parametrize(("fields", "message"), [
    ({"response_format": "json"}, "'response_format' must be an object"),
    ({"response_format": {"type": "json_schema"}}, "'response_format.json_schema' must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
     "'response_format.json_schema.name' must be a string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "'response_format.json_schema.schema' must be a JSON schema object"),
    ({"structured_outputs": "a+"}, "'structured_outputs' must be an object"),
    ({"structured_outputs": {"yaml": "a"}}, "'structured_outputs.yaml' is not supported"),
    ({"structured_outputs": {}}, "must set exactly one of"),
    ({"structured_outputs": {"json_object": "yes"}}, "'structured_outputs.json_object' must be"),
    ({"guided_regex": ""}, "'guided_regex' must be a non-empty string"),
    ({"guided_choice": ["a", ""]}, "'guided_choice' must be a non-empty list"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
     "'structured_outputs' and 'guided_choice' both ask"),
])
def test_malformed_fields_are_refused_naming_them(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message.replace("(", r"\(").replace("[", r"\[")):
        structured_output(fields)
