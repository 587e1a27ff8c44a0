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
the same text.
"""

from __future__ import annotations

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


# ChatML as a chat template: a message's content is a string or a list of parts ({"type": "text",
# "text": ...}, {"type": "image"}, {"type": "video"}); a missing content renders as empty.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is defined %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}" + IMAGE_BLOCK
    + "{% elif part['type'] == 'video' %}" + VIDEO_BLOCK
    + "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
