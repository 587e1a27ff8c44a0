"""The checkpoint's chat template (engine/text/chat_template.py) against transformers'
``apply_chat_template(..., tokenize=False, add_generation_prompt=True)``: where it is found, what
it renders (text, images, videos, several turns, special tokens), the ChatML fallback, the
sandbox and the errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from engine.errors import ConfigError, InvalidRequestError
from engine.text.chat import CHATML_TEMPLATE, IMAGE_BLOCK, VIDEO_BLOCK, conversation_prompt
from engine.text.chat_template import BUILTIN_SOURCE, ChatTemplate, user_message

BUILTIN = Path(__file__).resolve().parents[3] / "engine" / "builtin" / "tiny-qwen2-vl"

# A Qwen2-VL-style template: a default system turn, numbered vision placeholders with
# add_vision_id, a refusal of unknown roles; block tags on their own lines, so trim_blocks and
# lstrip_blocks decide the whitespace.
QWEN2_VL_STYLE = """{% set seen = namespace(images=0, videos=0) %}
{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
    {% if message['content'] is string %}
{{ message['content'] }}<|im_end|>
    {% else %}
        {% for part in message['content'] %}
            {% if part['type'] == 'image' or 'image' in part %}
                {% set seen.images = seen.images + 1 %}
                {% if add_vision_id %}Picture {{ seen.images }}: {% endif %}
<|vision_start|><|image_pad|><|vision_end|>
            {%- elif part['type'] == 'video' or 'video' in part %}
                {% set seen.videos = seen.videos + 1 %}
                {% if add_vision_id %}Video {{ seen.videos }}: {% endif %}
<|vision_start|><|video_pad|><|vision_end|>
            {%- elif 'text' in part %}
{{ part['text'] }}
            {%- endif %}
        {% endfor %}
<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

TEXT: list[dict[str, Any]] = [{"role": "user", "content": "Write a function."}]
WITH_IMAGES: list[dict[str, Any]] = [{"role": "user", "content": [
    {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
    {"type": "text", "text": "what differs?"}]}]
WITH_VIDEO: list[dict[str, Any]] = [{"role": "system", "content": "Watch closely."},
              {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Why?"}]}]
MULTI_TURN: list[dict[str, Any]] = [{"role": "system", "content": "be brief"},
              {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"}]},
              {"role": "assistant", "content": "a cat"},
              {"role": "assistant", "content": None},
              {"role": "user", "content": [{"type": "video"}, {"type": "image"},
                                           {"type": "text", "text": "and now?"}]}]


def checkpoint(path: Path, config: dict[str, Any] | None = None) -> Path:
    """A tokenizer directory: the built-in model's tokenizer.json and ``config`` as
    tokenizer_config.json (none when ``config`` is None)."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(BUILTIN / "tokenizer.json", path / "tokenizer.json")
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def oracle(model_dir: Path, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    out = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert isinstance(out, str)
    return out


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("qwen") / "ckpt",
                      {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                       "chat_template": QWEN2_VL_STYLE})


@pytest.mark.parametrize("messages", [TEXT, WITH_IMAGES, WITH_VIDEO, MULTI_TURN],
                         ids=["text", "images", "video", "multi-turn"])
def test_renders_as_transformers(qwen_dir: Path, messages: list[dict[str, Any]]) -> None:
    template = ChatTemplate.from_dir(qwen_dir)
    assert template.source == "tokenizer_config.json"
    assert template.text == QWEN2_VL_STYLE
    got = template.render(messages)
    assert got == oracle(qwen_dir, messages)
    images = sum(isinstance(m["content"], list) and {"type": "image"} in m["content"]
                 for m in messages)
    assert (IMAGE_BLOCK in got) == bool(images)


def test_placeholders_land_where_the_template_puts_them(qwen_dir: Path) -> None:
    got = ChatTemplate.from_dir(qwen_dir).render(MULTI_TURN)
    assert got.count(IMAGE_BLOCK) == 2 and got.count(VIDEO_BLOCK) == 1
    assert f"look{IMAGE_BLOCK}<|im_end|>" in got
    assert f"<|im_start|>user\n{VIDEO_BLOCK}{IMAGE_BLOCK}and now?<|im_end|>" in got
    default_system = ChatTemplate.from_dir(qwen_dir).render(TEXT)
    assert default_system.startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_each_file_location_is_found(tmp_path: Path) -> None:
    marker = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
    jinja_dir = checkpoint(tmp_path / "jinja")
    (jinja_dir / "chat_template.jinja").write_text(marker + "jinja")
    config_dir = checkpoint(tmp_path / "config", {"chat_template": marker + "config"})
    processor_dir = checkpoint(tmp_path / "processor")
    (processor_dir / "chat_template.json").write_text(json.dumps({"chat_template": marker}))
    for path, source in ((jinja_dir, "chat_template.jinja"),
                         (config_dir, "tokenizer_config.json"),
                         (processor_dir, "chat_template.json")):
        template = ChatTemplate.from_dir(path)
        assert template.source == source
        assert template.render(TEXT) == oracle(path, TEXT, chat_template=template.text)
    # transformers' own loading: the tokenizer reads tokenizer_config.json and
    # chat_template.jinja (the processor reads chat_template.json)
    for path in (jinja_dir, config_dir):
        assert ChatTemplate.from_dir(path).render(TEXT) == oracle(path, TEXT)


def test_chat_template_jinja_wins_as_in_transformers(tmp_path: Path) -> None:
    both = checkpoint(tmp_path / "both", {"chat_template": "config"})
    (both / "chat_template.jinja").write_text("jinja")
    (both / "chat_template.json").write_text(json.dumps({"chat_template": "processor"}))
    assert ChatTemplate.from_dir(both).render(TEXT) == oracle(both, TEXT) == "jinja"
    (both / "chat_template.jinja").unlink()
    assert ChatTemplate.from_dir(both).render(TEXT) == oracle(both, TEXT) == "config"


def test_list_of_templates_uses_default(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "list", {"chat_template": [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": QWEN2_VL_STYLE}]})
    template = ChatTemplate.from_dir(path)
    assert template.text == QWEN2_VL_STYLE
    assert template.render(MULTI_TURN) == oracle(path, MULTI_TURN)
    bad = checkpoint(tmp_path / "nodefault", {"chat_template": [{"name": "a", "template": "x"}]})
    with pytest.raises(ConfigError, match="none of them 'default'"):
        ChatTemplate.from_dir(bad)


def test_special_tokens_and_tojson_as_transformers(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "special", {
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>", "pad_token": None,
        "chat_template": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|"
                         "{% for m in messages %}{{ m | tojson }}{% endfor %}"})
    messages = [{"role": "user", "content": [{"type": "text", "text": "héllo <b>"}],
                 "name": "x"}]
    template = ChatTemplate.from_dir(path)
    assert template.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    assert template.render(messages) == oracle(path, messages)


def test_no_template_is_chatml(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "plain", {"eos_token": "<|im_end|>"})
    template = ChatTemplate.from_dir(path)
    assert template.source == BUILTIN_SOURCE and template.text == CHATML_TEMPLATE
    assert ChatTemplate.from_dir(checkpoint(tmp_path / "bare")).source == BUILTIN_SOURCE
    turns = [("system", "s"), ("user", "a"), ("assistant", "b"), ("developer", "c")]
    assert template.render([{"role": r, "content": c} for r, c in turns]) == \
        conversation_prompt(turns)
    got = template.render(MULTI_TURN)
    assert got == conversation_prompt([
        ("system", "be brief"), ("user", f"look{IMAGE_BLOCK}"), ("assistant", "a cat"),
        ("assistant", ""), ("user", f"{VIDEO_BLOCK}{IMAGE_BLOCK}and now?")])
    assert got == oracle(path, MULTI_TURN, chat_template=CHATML_TEMPLATE)


def test_user_message() -> None:
    assert user_message("hi") == {"role": "user", "content": "hi"}
    assert user_message("hi", images=2, videos=1)["content"] == [
        {"type": "image"}, {"type": "image"}, {"type": "video"}, {"type": "text", "text": "hi"}]
    assert ChatTemplate.builtin().render([user_message("hi", images=1)]) == \
        conversation_prompt([("user", f"{IMAGE_BLOCK}hi")])


@pytest.mark.parametrize("text", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__len__() }}",
    "{{ messages.append(1) }}",
    "{% set x = messages[0].update({'role': 'system'}) %}",
    "{{ raise_exception('nope') }}",
])
def test_the_sandbox_refuses_escapes(text: str) -> None:
    template = ChatTemplate(text, "test")
    with pytest.raises(InvalidRequestError, match=r"the chat template \(test\) cannot render"):
        template.render(TEXT)


def test_bad_messages_and_templates_are_clear_errors(qwen_dir: Path, tmp_path: Path) -> None:
    template = ChatTemplate.from_dir(qwen_dir)
    with pytest.raises(InvalidRequestError, match="unknown role: robot"):
        template.render([{"role": "robot", "content": "beep"}])
    with pytest.raises(InvalidRequestError, match="must be an object"):
        template.render(["hi"])  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].content: a bytes"):
        template.render([{"role": "user", "content": b"hi"}])
    broken = checkpoint(tmp_path / "broken", {"chat_template": "{% for m in %}"})
    with pytest.raises(ConfigError, match="tokenizer_config.json does not compile"):
        ChatTemplate.from_dir(broken)
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        ChatTemplate.from_dir(tmp_path / "badjson")
    wrong = checkpoint(tmp_path / "wrong", {"chat_template": 3})
    with pytest.raises(ConfigError, match="must be a string or a list"):
        ChatTemplate.from_dir(wrong)
