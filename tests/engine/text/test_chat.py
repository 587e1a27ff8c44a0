"""The chat prompt format: the exact ChatML layout, and refusal of unknown roles."""

from __future__ import annotations

import pytest

from engine.text.chat import chat_prompt, chat_turn, conversation_prompt


def test_prompt_layout() -> None:
    assert chat_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat_prompt("hi", system="be brief") == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown chat role 'robot'"):
        chat_turn("robot", "beep")


def test_conversation_layout() -> None:
    turns = [("system", "s"), ("user", "a"), ("assistant", "b"), ("user", "c")]
    assert conversation_prompt(turns) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
        "<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert conversation_prompt(turns[1:2]) == chat_prompt("a")


def test_conversation_writes_other_roles_as_given() -> None:
    assert conversation_prompt([("tool", "42")]) == (
        "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
