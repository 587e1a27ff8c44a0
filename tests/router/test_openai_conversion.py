"""The HTTP door's JSON conversion without a server: OpenAI bodies -> ``GenerateRequest``
(:mod:`router.openai_request`), and statuses, stop strings -> responses
(:mod:`router.openai_response`, :func:`router.http_door.error_response`)."""

from __future__ import annotations

import json

import grpc
import pytest

from engine.core.request import MAX_SEED, SamplingParams
from engine.text.chat import IMAGE_BLOCK, chat_turn, conversation_prompt
from engine.text.chat import chat_prompt as engine_chat_prompt
from router.errors import DoorError
from router.http_door import error_response
from router.openai_request import BadRequest, chat_call, chat_prompt, completion_call, door_seed
from router.relay import StopMatcher
from serving.overload import retry_metadata


def test_status_mapping() -> None:
    for code, status in ((grpc.StatusCode.INVALID_ARGUMENT, 400),
                         (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
                         (grpc.StatusCode.UNAVAILABLE, 503),
                         (grpc.StatusCode.DEADLINE_EXCEEDED, 504)):
        resp = error_response(DoorError(code, "no", retry_metadata(1500)))
        assert resp.status == status
        assert json.loads(resp.text)["error"]["message"] == "no"
        if status == 429:
            assert resp.headers["Retry-After"] == "2"


def test_stop_matcher() -> None:
    m = StopMatcher(["XYZ"])
    assert m.feed("abcX") == "ab"
    assert m.feed("Y") == "c"
    assert m.feed("Zrest") == "" and m.hit


def test_chat_prompt_with_an_image() -> None:
    chat = chat_prompt([{"role": "user", "content": [
        {"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert chat.text == ("<|im_start|>user\na<|vision_start|><|image_pad|><|vision_end|><|im_end|>"
                         "\n<|im_start|>assistant\n")
    assert chat.images == [b"\x00\x00\x00"]


def test_door_prompt_is_the_engine_chat_template() -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
                {"role": "user", "content": [
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": "data:image/jpeg;base64,AAAA"},
                    {"type": "text", "text": "this?"}]}]
    chat = chat_prompt(messages)
    text, images = chat.text, chat.images
    assert text == conversation_prompt([("system", "be brief"), ("user", "hi"),
                                        ("assistant", "hello"),
                                        ("user", f"and{IMAGE_BLOCK}this?")])
    assert text == (chat_turn("system", "be brief") + chat_turn("user", "hi")
                    + chat_turn("assistant", "hello") + chat_turn("user", f"and{IMAGE_BLOCK}this?")
                    + "<|im_start|>assistant\n")
    assert images == [b"\x00\x00\x00"]
    one = chat_prompt([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert one.text == engine_chat_prompt("u", system="s")


def test_door_passes_roles_through_and_checks_the_json() -> None:
    text = chat_prompt([{"role": "developer", "content": None}]).text
    assert text == "<|im_start|>developer\n<|im_end|>\n<|im_start|>assistant\n"
    for messages, word in (([], "non-empty list"), ([{"content": "x"}], "string 'role'"),
                           ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be"),
                           ([{"role": "user", "content": [{"type": "audio"}]}], "parts must"),
                           ([{"role": "user", "content": [{"type": "image_url",
                                                           "image_url": "https://x/y.png"}]}],
                            "data: URL")):
        with pytest.raises(BadRequest, match=word):
            chat_prompt(messages)


def test_chat_call_carries_the_stream_options_and_stops() -> None:
    call = chat_call({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                      "stream": True, "stream_options": {"include_usage": True},
                      "stop": ["", "x"]}, "r1")
    assert call.chat and call.stream and call.include_usage
    assert call.request.sampling.stop == ["x"] and call.n == 1
    assert call.request.request_id == "r1"
    assert call.request.text == engine_chat_prompt("hi")
    assert call.request.sampling.max_new_tokens == 5


@pytest.mark.parametrize(("seed", "wire"), [(7, 7), (-1, MAX_SEED), (MAX_SEED, MAX_SEED),
                                            (MAX_SEED + 1, 0), (-(2**70), 0), (2**70 + 3, 3)])
def test_any_integer_seed_is_one_the_engine_takes(seed: int, wire: int) -> None:
    """OpenAI's seed is any integer; the door reduces it into the engine's range (it used to
    reduce modulo 2**64, and the validator refused ``-1`` as 18446744073709551615)."""
    call = chat_call({"messages": [{"role": "user", "content": "hi"}], "seed": seed}, "r1")
    assert call.request.sampling.seed == wire
    SamplingParams(seed=call.request.sampling.seed).validate(vocab_size=8)  # does not raise
    assert door_seed(wire + 1) == (0 if wire == MAX_SEED else wire + 1)  # choice i: seed + i


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function"}]), ("tool_choice", "auto"),  # malformed: no function
    ("suffix", "end"), ("prompt_logprobs", 1), ("best_of", 3)])  # not honoured yet
def test_fields_refused_are_named(field: str, value: object) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(BadRequest, match=field):
        chat_call(body, "r")


def test_off_values_of_unsupported_fields_pass() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "text"},
            "tools": [], "tool_choice": "none", "logit_bias": {}, "best_of": 1}
    assert chat_call(body, "r").n == 1


def test_completion_prompt_forms() -> None:
    """A string, a batch of one string or of one id list, and token ids (a single one too)."""
    for prompt, text, ids in (("hi", "hi", []), (["hi"], "hi", []), ([[1, 2]], "", [1, 2]),
                              ([1, 2], "", [1, 2]), ([5], "", [5])):
        req = completion_call({"prompt": prompt}, "r").request
        assert (req.text, list(req.token_ids.ids)) == (text, ids), prompt
    for bad in ([], [[]], ["a", "b"], [1.5], [-1], None):
        with pytest.raises(BadRequest, match="prompt"):
            completion_call({"prompt": bad}, "r")
