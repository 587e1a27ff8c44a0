"""The built-in chat prompt format (ChatML, as Qwen2 models use it), which the built-in model is
trained on, and the fallback for checkpoints that ship no chat template of their own.

A conversation is a run of turns ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; a prompt that asks
for a reply ends with the opening of an assistant turn, ``<|im_start|>assistant\\n``. The model
ends its reply with ``<|im_end|>``, one of its end-of-sequence ids. An image sits in a turn's
content as :data:`IMAGE_BLOCK`, a video as :data:`VIDEO_BLOCK`; the engine expands each to the
patch tokens of its image or video.

This module is the one place that spells ChatML: as Python for the training script
(:func:`conversation_prompt`) and as the Jinja text :data:`CHATML_TEMPLATE` that
:mod:`engine.text.chat_template` renders when a checkpoint has no template
(``pdserve generate --chat``, ``pdserve client --chat``, the router's OpenAI door). The two render
the same text. The template also renders tool calling in the Qwen family's format (the tools
listed in a system turn, calls as ``<tool_call>`` JSON blocks, results as ``<tool_response>``
blocks in a user turn), which :func:`conversation_prompt` does not spell.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

ROLES = ("system", "user", "assistant")
IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"
_REPLY_OPENING = "<|im_start|>assistant\n"


def _turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def chat_turn(role: str, content: str) -> str:
    """One complete turn; the role must be one of :data:`ROLES` (ValueError otherwise)."""
    if role not in ROLES:
        raise ValueError(f"unknown chat role {role!r}; expected one of {', '.join(ROLES)}")
    return _turn(role, content)


def conversation_prompt(turns: Iterable[tuple[str, str]]) -> str:
    """The prompt text for ``(role, content)`` turns in order, ending where the assistant's reply
    begins.

    Roles are written as given, unchecked: a server passes through whatever roles its clients
    send (OpenAI clients also use e.g. ``developer`` or ``tool``) and validates them itself.
    """
    return "".join(_turn(role, content) for role, content in turns) + _REPLY_OPENING


def chat_prompt(user: str, system: str | None = None) -> str:
    """The prompt text for one user message (after an optional system message), ending where the
    assistant's reply begins."""
    head = [("system", system)] if system else []
    return conversation_prompt([*head, ("user", user)])


# The built-in template's words for tools: the system turn that lists them (each as one line of
# JSON) and says how to call them, in the tool format of Qwen2.5 and Qwen3 (JSON inside
# <tool_call></tool_call>, results inside <tool_response></tool_response> in a user turn).
TOOLS_INTRO = ("# Tools\n\nThese functions are available, each described by one line of JSON "
               "inside <tools></tools>:\n<tools>")
TOOLS_HOW_TO_CALL = (
    "\n</tools>\n\nTo call functions, answer with one block per call, each holding a JSON object "
    "with the function's name and its arguments:\n<tool_call>\n"
    '{"name": <function name>, "arguments": <the arguments as a JSON object>}\n</tool_call>')

# ChatML as a chat template: a message's content is a string or a list of parts ({"type": "text",
# "text": ...}, {"type": "image"}, {"type": "video"}); a missing content renders as empty. With
# ``tools``, a system turn lists them first (holding the first message's content when that is
# a system message); an assistant message's ``tool_calls`` (OpenAI's form, whose
# ``function.arguments`` is a JSON object or its text) follow its content as <tool_call> blocks;
# a run of ``tool`` messages is one user turn of <tool_response> blocks. Without tools, tool
# calls and tool messages it renders exactly :func:`conversation_prompt`'s text.
CHATML_TEMPLATE = (
    "{% macro text(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content is defined %}{% for part in content %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}" + IMAGE_BLOCK
    + "{% elif part['type'] == 'video' %}" + VIDEO_BLOCK
    + "{% endif %}{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% macro tool_call(call) %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>\\n{\"name\": ' }}{{ fn['name'] | tojson }}{{ ', \"arguments\": ' }}"
    "{% if fn['arguments'] is string %}{{ fn['arguments'] }}"
    "{% else %}{{ fn['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endmacro %}"
    "{% set system_first = messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if system_first %}{{ text(messages[0]['content']) }}{{ '\\n\\n' }}{% endif %}"
    "{{ " + json.dumps(TOOLS_INTRO) + " }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ " + json.dumps(TOOLS_HOW_TO_CALL) + " }}{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and system_first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ text(message['content']) }}{{ '\\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{% set shown = text(message['content']) %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{{ shown }}"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}"
    "{% if shown or not loop.first %}{{ '\\n' }}{% endif %}{{ tool_call(call) }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
