"""The chat prompt format: the exact ChatML layout, and refusal of unknown roles."""

from __future__ import annotations

import pytest

from engine.chat import chat_prompt, chat_turn


def test_prompt_layout() -> None:
    assert chat_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat_prompt("hi", system="be brief") == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown chat role 'robot'"):
        chat_turn("robot", "beep")
