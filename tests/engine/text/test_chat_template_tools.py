"""Tool calling in chat templates (engine/text/chat_template.py, the built-in template of
engine/text/chat.py): ``render(messages, tools=...)`` against transformers'
``apply_chat_template(..., tools=..., tokenize=False, add_generation_prompt=True)`` on the
published Qwen2.5 and Qwen3 templates (``templates/``, test data) and on the built-in one, and the
built-in one's tool format held to Qwen3's: the same tool list, calls and tool results, in its own
words."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.errors import InvalidRequestError
from engine.text.chat import CHATML_TEMPLATE, IMAGE_BLOCK, conversation_prompt
from engine.text.chat_template import ChatTemplate

BUILTIN = Path(__file__).resolve().parents[3] / "engine" / "builtin" / "tiny-qwen2-vl"
TEMPLATES = Path(__file__).resolve().parent / "templates"
QWEN25 = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city, «today»",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
# A conversation through tool calls, with arguments as chat templates want them (JSON values;
# the door makes them of the JSON text OpenAI clients send, as vLLM does).
CALLS: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21°C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "assistant", "content": "Sunny, at noon."},
    {"role": "user", "content": "And Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [  # content null arrives as ""
        {"id": "call_3", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "call_3", "content": "rain"},
]
NO_SYSTEM = CALLS[1:]


def oracle(template: str, messages: list[dict[str, Any]],
           tools: list[dict[str, Any]] | None) -> str:
    """transformers' rendering of ``messages`` and ``tools`` with ``template``."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(BUILTIN / "tokenizer.json"))
    out = tok.apply_chat_template(messages, tools=tools, chat_template=template,
                                  tokenize=False, add_generation_prompt=True)
    assert isinstance(out, str)
    return out


@pytest.mark.parametrize("name,text", [("qwen2.5", QWEN25), ("qwen3", QWEN3),
                                       ("builtin", CHATML_TEMPLATE)])
@pytest.mark.parametrize("messages", [CALLS, NO_SYSTEM], ids=["system", "no-system"])
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_renders_tools_as_transformers(name: str, text: str, messages: list[dict[str, Any]],
                                       tools: list[dict[str, Any]] | None) -> None:
    got = ChatTemplate(text, name).render(messages, tools=tools)
    assert got == oracle(text, messages, tools)
    assert ('<tools>\n{"type": "function"' in got) == (tools is not None)  # the tool list
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in got
    assert "<|im_start|>user\n<tool_response>\nsunny, 21°C\n</tool_response>\n<tool_response>" \
           "\n12:00\n</tool_response><|im_end|>\n" in got


def _parts(text: str) -> tuple[str, str, str]:
    """A tool prompt as (the system turn's opening up to its tool list, the tool list, the rest
    after the system turn)."""
    head, _, rest = text.partition("<tools>\n")
    listed, _, rest = rest.partition("\n</tools>")
    return head.split("# Tools")[0], listed, rest.split("<|im_end|>\n", 1)[1]


@pytest.mark.parametrize("messages", [CALLS, NO_SYSTEM], ids=["system", "no-system"])
def test_builtin_tool_format_is_qwen3s(messages: list[dict[str, Any]]) -> None:
    """The built-in template puts the system message, the tool list, the calls and the tool
    results where Qwen3's does: only the words around the tool list differ."""
    builtin, qwen3 = ChatTemplate.builtin(), ChatTemplate(QWEN3, "qwen3")
    ours = builtin.render(messages, tools=TOOLS)
    assert _parts(ours) == _parts(qwen3.render(messages, tools=TOOLS))
    assert _parts(ours)[1] == "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS)
    assert ours.startswith("<|im_start|>system\n" + ("Be brief.\n\n" if messages is CALLS else ""))
    assert "<tool_call>" in ours.split("<|im_end|>")[0]  # how to call, in the system turn
    assert builtin.render(messages) == qwen3.render(messages)  # and without tools


def test_builtin_without_tools_is_chatml() -> None:
    turns = [("system", "s"), ("user", f"a{IMAGE_BLOCK}"), ("assistant", "b"), ("developer", "c")]
    messages = [{"role": r, "content": c} for r, c in turns]
    builtin = ChatTemplate.builtin()
    assert builtin.render(messages) == builtin.render(messages, tools=[]) == \
        conversation_prompt(turns)
    assert builtin.render(messages, add_generation_prompt=False) == \
        conversation_prompt(turns)[:-len("<|im_start|>assistant\n")]


def test_builtin_prints_arguments_text_as_it_is() -> None:
    """Arguments given as JSON text are printed unchanged (Qwen3's way), objects as JSON."""
    messages = [{"role": "assistant", "content": [{"type": "text", "text": "ok"}], "tool_calls": [
        {"function": {"name": "f", "arguments": '{"x":1}'}},
        {"name": "g", "arguments": {"y": [1, "é"]}}]}]
    assert ChatTemplate.builtin().render(messages, add_generation_prompt=False) == (
        '<|im_start|>assistant\nok\n<tool_call>\n{"name": "f", "arguments": {"x":1}}\n'
        '</tool_call>\n<tool_call>\n{"name": "g", "arguments": {"y": [1, "é"]}}\n</tool_call>'
        "<|im_end|>\n")


def test_builtin_tool_results_with_parts_and_a_first_tool_message() -> None:
    messages = [{"role": "tool", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "user", "content": "next"}]
    assert ChatTemplate.builtin().render(messages) == (
        "<|im_start|>user\n<tool_response>\nab\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n")


def test_tools_must_be_json_objects() -> None:
    with pytest.raises(InvalidRequestError, match="chat tools must be a list"):
        ChatTemplate.builtin().render(CALLS, tools="get_weather")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"tools\[0\] must be an object"):
        ChatTemplate.builtin().render(CALLS, tools=["get_weather"])  # type: ignore[list-item]
