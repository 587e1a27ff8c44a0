"""The chat prompt format (ChatML, as Qwen2 models use it), which the built-in model is trained on.

A conversation is a run of turns ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; a prompt that asks
for a reply ends with the opening of an assistant turn, ``<|im_start|>assistant\\n``. The model
ends its reply with ``<|im_end|>``, one of its end-of-sequence ids.
"""

from __future__ import annotations

ROLES = ("system", "user", "assistant")


def chat_turn(role: str, content: str) -> str:
    """One complete turn."""
    if role not in ROLES:
        raise ValueError(f"unknown chat role {role!r}; expected one of {', '.join(ROLES)}")
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def chat_prompt(user: str, system: str | None = None) -> str:
    """The prompt text for one user message (after an optional system message), ending where the
    assistant's reply begins."""
    head = chat_turn("system", system) if system else ""
    return head + chat_turn("user", user) + "<|im_start|>assistant\n"
