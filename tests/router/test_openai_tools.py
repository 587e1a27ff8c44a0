"""OpenAI tool calling at the HTTP door (:mod:`router.openai_tools`): the request fields, the
prompt, the grammar of a forced ``tool_choice``, the Qwen-format parser (whole and streamed, split
anywhere), and end to end through a router over a decode worker, called with the ``openai``
client: a named function and ``required`` return calls whose arguments validate against the
tools' schemas, whole and streamed, and bad fields are 400s naming them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.builtin import builtin_model_dir
from engine.text.chat_template import ChatTemplate
from router.openai_request import BadRequest, chat_call, chat_prompt, completion_call
from router.openai_response import Chunks, Outcome
from router.openai_tools import (
    ListedCallParser,
    NamedCallParser,
    TaggedCallParser,
    ToolCallParser,
    required_schema,
    tool_use,
)
from tests.cluster.harness import Node, running
from tests.cluster.stats import assert_all_idle

openai = pytest.importorskip("openai")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"],
    "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 5}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "a forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "clock": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n' \
       '</tool_call>'
CALL2 = '<tool_call>\n{"name": "clock", "arguments": {"zone": "CET"}}\n</tool_call>'


def body(**fields: Any) -> dict[str, Any]:  # noqa: ANN401
    return {"messages": ASK, "tools": TOOLS, **fields}


def calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    """A message's calls as (name, arguments' value)."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []]


# ---- the parser ------------------------------------------------------------------------------


@pytest.mark.parametrize("text,content,found", [
    (CALL, None, [("get_weather", {"city": "Paris", "days": 2})]),
    ("Let me look.\n" + CALL + "\n" + CALL2 + "\n", "Let me look.",
     [("get_weather", {"city": "Paris", "days": 2}), ("clock", {"zone": "CET"})]),
    ("  \n" + CALL, None, [("get_weather", {"city": "Paris", "days": 2})]),
    ('<tool_call>\n{"name": "clock"}\n</tool_call>', None, [("clock", {})]),
    ("no calls, < tool_call > nor <tool", "no calls, < tool_call > nor <tool", []),
    ("  ", "  ", []),
    ("", "", []),
])
def test_parses_qwen_tool_calls(text: str, content: str | None,
                                found: list[tuple[str, Any]]) -> None:
    message = TaggedCallParser().whole(text)
    assert message["content"] == content
    assert calls(message) == found
    for call in message.get("tool_calls", []):
        assert call["type"] == "function" and call["id"].startswith("call_")
        int(call["id"][len("call_"):], 16)
    assert len({c["id"] for c in message.get("tool_calls", [])}) == len(found)


@pytest.mark.parametrize("text", [
    'a <tool_call>\n{"name": "clock", "arguments": {"zone": \n</tool_call> b',  # bad JSON
    '<tool_call>["clock"]</tool_call>',  # not a call object
    '<tool_call>{"name": "clock", "arguments": "CET"}</tool_call>',  # arguments not an object
    "x " + CALL[:-3],  # never closed (cut short)
])
def test_malformed_blocks_stay_content(text: str) -> None:
    parser = TaggedCallParser()
    assert parser.whole(text) == {"role": "assistant", "content": text}
    assert parser.finish_reason("stop") == "stop"


def test_malformed_block_beside_a_call() -> None:
    bad = '<tool_call>{"name": 1}</tool_call>'
    message = TaggedCallParser().whole(f"{CALL}\n{bad} done")
    assert message["content"] == f"\n{bad} done"
    assert calls(message) == [("get_weather", {"city": "Paris", "days": 2})]


XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}, "filters": {"type": "object"},
                                     "exact": {"type": "boolean"}, "n": {"type": "integer"}}}}}


@pytest.mark.parametrize("text,content,found", [
    (XML_CALL, None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("Checking.\n" + XML_CALL + "\n" + CALL2, "Checking.",
     [("get_weather", {"city": "Paris", "days": 3}), ("clock", {"zone": "CET"})]),
    ('<tool_call>\n<function=lookup>\n<parameter=q>\n42\n</parameter>\n<parameter=filters>\n'
     '{"lang": "en"}\n</parameter>\n<parameter=exact>\ntrue\n</parameter>\n<parameter=n>\n'
     'many\n</parameter>\n</function>\n</tool_call>', None,
     [("lookup", {"q": "42", "filters": {"lang": "en"}, "exact": True, "n": "many"})]),
    ("<tool_call>\n<function=clock>\n</function>\n</tool_call>", None, [("clock", {})]),
    ("<tool_call>\n<function=unknown>\n<parameter=a>\n[1, 2]\n</parameter>\n</function>\n"
     "</tool_call>", None, [("unknown", {"a": "[1, 2]"})]),  # no schema: text
])
def test_parses_the_xml_calls_of_qwen3_coder_and_qwen3_5(text: str, content: str | None,
                                                         found: list[tuple[str, Any]]) -> None:
    """The XML form, each value typed by the function's schema (string properties stay text,
    others are read as JSON when they are JSON)."""
    message = TaggedCallParser([*TOOLS, LOOKUP]).whole(text)
    assert (message["content"], calls(message)) == (content, found)
    for cut in range(len(text) + 1):  # and streamed, split anywhere
        got, _ = stream(TaggedCallParser([*TOOLS, LOOKUP]), [text[:cut], text[cut:]])
        assert (got["content"], calls(got)) == (content, found), cut


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=clock>\nnow\n<parameter=zone>\nCET\n</parameter>\n</function>\n"
    "</tool_call>",  # text beside the parameters
    "<tool_call>\n<function=clock>\n<parameter=zone>\nCET\n</function>\n</tool_call>",
    "<tool_call>\n<function=clock>\n</tool_call>",  # the function never closes
])
def test_malformed_xml_calls_stay_content(text: str) -> None:
    assert TaggedCallParser(TOOLS).whole(text) == {"role": "assistant", "content": text}


def stream(parser: ToolCallParser, pieces: list[str]) -> tuple[dict[str, Any], list[Any]]:
    """Feed ``pieces`` and finish; returns the message the deltas add up to (as an openai SDK
    user accumulates them) and the deltas."""
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content, made = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = made.setdefault(call["index"], {"function": {"arguments": ""}})
            entry.update({k: call[k] for k in ("id", "type") if k in call})
            entry["function"]["name"] = call["function"].get("name",
                                                             entry["function"].get("name"))
            entry["function"]["arguments"] += call["function"]["arguments"]
    message = parser.message()
    assert content == (message["content"] or "")
    assert [made[i] for i in sorted(made)] == message.get("tool_calls", [])
    return message, deltas


SPLIT = ["Hi <tool_call> " + CALL + "\n\n" + CALL2 + " <tool_call>{}</tool_call> bye  ",
         'pre\n<tool_call>\n{"name": "clock", "arguments": {"zone": "UTC"}}\n</tool_call>\n',
         "x " + CALL[:-3]]


@pytest.mark.parametrize("text", SPLIT)
def test_any_split_of_the_stream_gives_the_same_message(text: str) -> None:
    whole = TaggedCallParser().whole(text)
    for cut in range(len(text) + 1):
        got, _ = stream(TaggedCallParser(), [text[:cut], text[cut:]])
        assert (got["content"], calls(got)) == (whole["content"], calls(whole)), cut
    got, deltas = stream(TaggedCallParser(), list(text))  # a character at a time
    assert (got["content"], calls(got)) == (whole["content"], calls(whole))
    assert all("<tool" not in d.get("content", "") or "</tool_call>" in d["content"]
               for d in deltas[:-1])  # no partial tag goes out as content (but a bad block)


def test_a_possible_tag_is_held_back_and_calls_go_out_when_they_close() -> None:
    parser = TaggedCallParser()
    assert parser.feed("Sure <tool") == {"content": "Sure"}
    assert parser.feed("_call>\n{\"name\": \"clock\", ") == {}
    delta = parser.feed('"arguments": {"zone": "CET"}}\n</tool_call>\n')
    assert delta["tool_calls"][0]["function"] == {"name": "clock", "arguments": '{"zone": "CET"}'}
    assert delta["tool_calls"][0]["index"] == 0 and "content" not in delta
    assert parser.feed(CALL)["tool_calls"][0]["index"] == 1
    assert parser.finish() == {}
    assert parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "length"


def test_named_function_streams_its_arguments() -> None:
    text = '{"city": "Oslo", "days": 3}'
    for cut in range(len(text) + 1):
        message, deltas = stream(NamedCallParser("get_weather"), [text[:cut], text[cut:]])
        assert message["content"] is None
        assert calls(message) == [("get_weather", {"city": "Oslo", "days": 3})]
        assert deltas[0 if cut else 1]["tool_calls"][0]["function"]["name"] == "get_weather"
    empty, _ = stream(NamedCallParser("clock"), [])
    assert empty["tool_calls"][0]["function"] == {"name": "clock", "arguments": ""}


def test_required_array_calls_go_out_as_each_item_closes() -> None:
    text = ' [{"name": "clock", "parameters": {"zone": "CET"}} ,\n' \
           '{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}]'
    found = [("clock", {"zone": "CET"}), ("get_weather", {"city": "Rome", "days": 1})]
    for cut in range(len(text) + 1):
        message, _ = stream(ListedCallParser(), [text[:cut], text[cut:]])
        assert message["content"] is None and calls(message) == found
    parser = ListedCallParser()
    assert parser.feed(text[:text.index("} ,") + 1])["tool_calls"][0]["function"]["name"] == \
        "clock"
    cut_short = ListedCallParser().whole(text[:-20])  # an output cut by max_tokens
    assert calls(cut_short) == found[:1] and cut_short["content"].startswith(" ,\n{")
    assert ListedCallParser().whole('{"zone": 1}') == {"role": "assistant",
                                                      "content": '{"zone": 1}'}


def test_whole_response_has_the_calls_and_finish_reason() -> None:
    chunk = Chunks("chatcmpl-1", "m", chat=True)
    outs = [Outcome(finish_reason="stop", tools=TaggedCallParser()),
            Outcome(finish_reason="stop", tools=TaggedCallParser()), Outcome(finish_reason="stop")]
    whole = chunk.whole([CALL, "plain", CALL], outs)
    first, second, third = whole["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    assert calls(first["message"]) == [("get_weather", {"city": "Paris", "days": 2})]
    assert second["finish_reason"] == "stop"
    assert second["message"] == {"role": "assistant", "content": "plain"}
    assert third["message"] == {"role": "assistant", "content": CALL}  # no tools: text


# ---- requests --------------------------------------------------------------------------------


def test_tools_are_rendered_and_auto_parses() -> None:
    call = chat_call(body(), "r")
    assert call.tools is not None and call.tools.choice == "auto"
    assert isinstance(call.tools.parser(), TaggedCallParser)
    assert not call.request.sampling.HasField("structured_output")
    assert call.request.text == ChatTemplate.builtin().render(ASK, tools=TOOLS)
    assert json.dumps(TOOLS[0]) in call.request.text


def test_none_renders_no_tools_and_parses_nothing() -> None:
    plain = chat_call({"messages": ASK}, "r")
    for fields in ({"tool_choice": "none"}, {"tools": [], "tool_choice": None}):
        call = chat_call({"messages": ASK, "tools": TOOLS, **fields}, "r")
        assert call.request.text == plain.request.text
        assert call.tools is not None and call.tools.parser() is None
    assert plain.tools is not None and plain.tools.choice == "none"


def test_named_function_is_its_parameters_schema() -> None:
    call = chat_call(body(tool_choice={"type": "function", "function": {"name": "clock"}}), "r")
    grammar = call.request.sampling.structured_output
    assert grammar.kind == "json_schema" and json.loads(grammar.value) == CLOCK
    assert isinstance(call.tools and call.tools.parser(), NamedCallParser)
    bare = [{"type": "function", "function": {"name": "ping"}}]
    named = {"type": "function", "function": {"name": "ping"}}
    free = chat_call({"messages": ASK, "tools": bare, "tool_choice": named}, "r")
    assert json.loads(free.request.sampling.structured_output.value) == {"type": "object"}


def test_required_is_vllms_array_schema() -> None:
    call = chat_call(body(tool_choice="required"), "r")
    grammar = call.request.sampling.structured_output
    schema = json.loads(grammar.value)
    assert grammar.kind == "json_schema" and schema == {
        "type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                              "parameters": SCHEMAS[name]},
             "required": ["name", "parameters"]} for name in ("get_weather", "clock")]}}
    good = [{"name": "clock", "parameters": {"zone": "UTC"}},
            {"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "clock", "parameters": {"city": "Rome", "days": 2}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_moves_defs_to_the_top() -> None:
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"],
        "$defs": {"point": point}}}} for n in ("a", "b")]
    schema = required_schema(tools)
    assert schema["$defs"] == {"point": point}
    assert all("$defs" not in item["properties"]["parameters"]
               for item in schema["items"]["anyOf"])
    jsonschema.validate([{"name": "b", "parameters": {"p": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "parameters": {"p": {"x": "1"}}}], schema)
    tools[1]["function"]["parameters"]["$defs"] = {"point": {"type": "string"}}
    with pytest.raises(BadRequest, match=r"define '\$defs/point' differently"):
        required_schema(tools)


NAMED = {"type": "function", "function": {"name": "clock"}}


@pytest.mark.parametrize("fields,word", [
    ({"tools": {"a": 1}}, "'tools' must be a list"),
    ({"tools": ["clock"]}, r"'tools\[0\]' must be an object"),
    ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, r"'tools\[0\].type'"),
    ({"tools": [{"type": "function"}]}, r"'tools\[0\].function' must be an object"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, r"function.name' must be"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": "{}"}}]},
     r"'tools\[0\].function.parameters' must be a JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "a", "description": 1}}]},
     "description' must be a string"),
    ({"tools": [{"type": "function", "function": {"name": "a", "strict": "yes"}}]},
     "strict' must be a boolean"),
    ({"tools": TOOLS + TOOLS[:1]}, "names the function 'get_weather' twice"),
    ({"tool_choice": "any"}, "'tool_choice' must be .* not 'any'"),
    ({"tool_choice": {"type": "function", "name": "clock"}}, "'tool_choice' must be"),
    ({"tool_choice": {"type": "function", "function": {"name": "now"}}},
     "'tool_choice' names the function 'now', which 'tools' lacks"),
    ({"tools": None, "tool_choice": "required"}, "'tool_choice' 'required' needs 'tools'"),
    ({"tools": [], "tool_choice": "auto"}, "'tool_choice' 'auto' needs 'tools'"),
    ({"tools": None, "tool_choice": NAMED}, "'tool_choice' 'clock' needs 'tools'"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "'tool_choice' .* and 'response_format' both constrain the output"),
    ({"tool_choice": NAMED, "structured_outputs": {"regex": "a"}},
     "and 'structured_outputs' both"),
    ({"tool_choice": NAMED, "guided_json": {"type": "object"}}, "and 'guided_json' both"),
    ({"functions": [{"name": "a"}]}, "'functions' is not supported"),
    ({"function_call": "auto"}, "'function_call' is not supported"),
    ({"messages": [{"role": "assistant", "tool_calls": {}}]},
     r"messages\[0\].tool_calls must be a list"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     r"messages\[0\].tool_calls\[0\] must be an object with a 'function'"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "clock", "arguments": "{zone"}}]}]},
     r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"),
])
def test_bad_tool_fields_are_400_naming_them(fields: dict[str, Any], word: str) -> None:
    with pytest.raises(BadRequest, match=word):
        chat_call(body(**fields), "r")


def test_forced_choice_may_sit_beside_a_text_response_format() -> None:
    call = chat_call(body(tool_choice="required", response_format={"type": "text"}), "r")
    assert call.request.sampling.structured_output.kind == "json_schema"
    assert tool_use(body(response_format={"type": "json_object"})).grammar() is None  # auto


def test_completions_take_no_tools() -> None:
    for fields in ({"tools": TOOLS}, {"tool_choice": "auto"}):
        with pytest.raises(BadRequest, match="only taken by /v1/chat/completions"):
            completion_call({"prompt": "x", **fields}, "r")
    completion_call({"prompt": "x", "tools": [], "tool_choice": "none"}, "r")


def test_past_calls_and_results_are_rendered_as_qwen_templates_want() -> None:
    """The door turns each past call's arguments text into its JSON value (and a null content
    into ""), as vLLM does: the prompt equals transformers' rendering of what vLLM passes the
    template, on the published Qwen2.5 template (which prints arguments with ``tojson``) and on
    the built-in one."""
    from transformers import PreTrainedTokenizerFast

    def turns(weather: Any, clock: Any, content: str | None) -> list[dict[str, Any]]:  # noqa: ANN401
        return [*ASK, {"role": "assistant", "content": content, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": weather}},
            {"id": "call_2", "type": "function", "function": {"name": "clock", "arguments": clock}}
        ]}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "9am"}]

    sent = turns('{"city": "Paris", "days": 2}', "", None)  # as OpenAI clients send them
    vllm = turns({"city": "Paris", "days": 2}, {}, "")  # as vLLM hands them to the template
    root = Path(__file__).resolve().parents[2]
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(root / "engine/builtin/tiny-qwen2-vl/tokenizer.json"))
    qwen25 = (root / "tests/engine/text/templates/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    for text in (qwen25, ChatTemplate.builtin().text):
        assert chat_prompt(sent, ChatTemplate(text, "t"), TOOLS).text == tok.apply_chat_template(
            vllm, tools=TOOLS, chat_template=text, tokenize=False, add_generation_prompt=True)
    assert chat_prompt(sent, None, TOOLS).text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "clock", '
        '"arguments": {}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n'
        "</tool_response>\n<tool_response>\n9am\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


# ---- end to end ------------------------------------------------------------------------------

NODE = ["--host", "127.0.0.1", "--port", "0", "--num-pages", "512", "--page-size", "16"]
MAX_TOKENS = 640  # JSON may hold runs of up to 32 whitespace characters


@dataclass
class Door:
    client: Any  # openai.OpenAI
    workers: list[Node]


@pytest.fixture(scope="module")
def door() -> Iterator[Door]:
    """A router with its HTTP door over one colocated decode worker, on the built-in model."""
    model = ["--model", str(builtin_model_dir())]
    with running(["decode", *model, *NODE]) as [decode]:
        router = ["router", *model, "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                  "--colocated", decode.address]
        with running(router) as [node]:
            port = next(int(ln.split()[1]) for ln in node.log if ln.startswith("HTTP "))
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                   max_retries=0, timeout=120)
            yield Door(client, [decode])


def create(door: Door, stream: bool, **fields: Any) -> tuple[Any, list[dict[str, Any]]]:  # noqa: ANN401
    """One chat call with the tools; returns the finish reasons and each choice's message (a
    stream's deltas accumulated as openai SDK users do)."""
    kwargs = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": MAX_TOKENS,
              "temperature": 0, **fields}
    if not stream:
        resp = door.client.chat.completions.create(**kwargs)
        return ([c.finish_reason for c in resp.choices],
                [c.message.model_dump() for c in resp.choices])
    reasons: dict[int, str] = {}
    messages: dict[int, dict[str, Any]] = {}
    for chunk in door.client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            msg = messages.setdefault(choice.index, {"content": None, "tool_calls": []})
            if choice.delta.content:
                msg["content"] = (msg["content"] or "") + choice.delta.content
            for delta in choice.delta.tool_calls or []:
                if delta.index == len(msg["tool_calls"]):
                    msg["tool_calls"].append({"id": delta.id, "type": delta.type, "function": {
                        "name": delta.function.name, "arguments": ""}})
                msg["tool_calls"][delta.index]["function"]["arguments"] += \
                    delta.function.arguments or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return [reasons[i] for i in sorted(reasons)], [messages[i] for i in sorted(messages)]


def check_calls(message: dict[str, Any], names: set[str]) -> list[str]:
    """Every call names one of ``names`` and its arguments validate; returns the names."""
    assert message["tool_calls"], message
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        assert name in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    return [c["function"]["name"] for c in message["tool_calls"]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_function_is_called(door: Door, stream: bool) -> None:
    reasons, messages = create(door, stream, n=2, seed=3, temperature=1.0, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    assert reasons == ["tool_calls", "tool_calls"]
    for message in messages:
        assert message["content"] is None
        assert check_calls(message, {"get_weather"}) == ["get_weather"]


def test_required_calls_one_of_the_tools_whole_and_streamed(door: Door) -> None:
    reasons, [whole] = create(door, False, tool_choice="required")
    assert reasons == ["tool_calls"] and whole["content"] is None
    check_calls(whole, set(SCHEMAS))
    reasons, [streamed] = create(door, True, tool_choice="required")
    assert reasons == ["tool_calls"] and streamed["content"] is None
    assert [c["function"] for c in streamed["tool_calls"]] == \
        [c["function"] for c in whole["tool_calls"]]


# a grammar that makes the model write a call in the Qwen format, to see ``auto`` parse it
FORCED_CALL = (r'Checking\.\n<tool_call>\n\{"name": "clock", "arguments": '
               r'\{"zone": "[A-Z]{3}"\}\}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_parses_what_the_model_writes(door: Door, stream: bool) -> None:
    """``auto`` answers what the parser makes of the text generated for the prompt with the
    tools (the same prompt through /v1/completions): free text, and a call a regex makes the
    model write; ``none`` answers as without tools."""
    prompt = ChatTemplate.builtin().render(ASK, tools=TOOLS)
    for grammar in ({}, {"structured_outputs": {"regex": FORCED_CALL}}):
        limit = 120 if grammar else 24
        text = door.client.completions.create(model="tiny", prompt=prompt, max_tokens=limit,
                                              temperature=0, extra_body=grammar).choices[0].text
        expected = TaggedCallParser().whole(text)
        reasons, [message] = create(door, stream, max_tokens=limit, extra_body=grammar)
        assert (message["content"], calls(message)) == (expected["content"], calls(expected))
        assert reasons == ["tool_calls" if grammar else "length"]
    assert message["content"] == "Checking." and calls(message)[0][0] == "clock"
    _, [plain] = create(door, stream, max_tokens=12, tool_choice="none")
    answer = door.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12,
                                                 temperature=0).choices[0].message
    assert plain["content"] == answer.content and not plain.get("tool_calls")


def test_bad_tool_choice_is_400(door: Door) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        door.client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "launch"}})
    assert "'tool_choice' names the function 'launch'" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        door.client.chat.completions.create(model="tiny", messages=ASK, tool_choice="required")
    assert "'tool_choice' 'required' needs 'tools'" in str(err.value)
    assert_all_idle([w.address for w in door.workers])
