"""The checkpoint's chat template: found, compiled in a sandbox, rendered.

A checkpoint carries its template in one of three places, looked for in this order (the order in
which transformers' tokenizer and processor let one override another):

1. ``chat_template.jinja``: the template text;
2. ``tokenizer_config.json``: its ``chat_template`` key, a string or a list of
   ``{"name", "template"}`` entries of which the one named ``default`` is used;
3. ``chat_template.json``: ``{"chat_template": ...}`` (the processor's file), same two forms.

A checkpoint with none of them gets the built-in ChatML (:data:`engine.text.chat.CHATML_TEMPLATE`).

Templates are Jinja, compiled once by :class:`ChatTemplate` in an immutable sandbox (naming an
attribute that starts with ``_`` or a mutating method is an error, so a template from the Hub
cannot reach Python's internals) with the conventions templates are written for: ``trim_blocks`` and
``lstrip_blocks``, ``{% break %}``/``{% continue %}``, the globals ``raise_exception(message)`` and
``strftime_now(format)``, and a ``tojson`` filter that does not escape HTML. A render sees
``messages``, ``add_generation_prompt``, ``tools`` (the request's tool definitions, or ``None``),
``documents`` (``None``: not served) and the tokenizer's named special tokens (``bos_token``,
``eos_token``, ... as ``tokenizer_config.json`` spells them).

A message is a JSON object with a ``role`` and a ``content`` that is a string or a list of parts:
``{"type": "text", "text": ...}``, ``{"type": "image"}``, ``{"type": "video"}``; the template
decides where each image and video placeholder goes. Keys whose value is ``None`` are dropped
before rendering (OpenAI clients send ``"content": null``), as transformers does. Other keys
pass through as given: an assistant message's ``tool_calls`` and a ``tool`` message's
``tool_call_id`` are the template's to render (Qwen2.5's and Qwen3's templates want each call's
``function.arguments`` as a JSON object, which the OpenAI door makes of the JSON text clients send,
as vLLM does).

A template that does not compile is a :class:`ConfigError` at load; one that fails or raises on
a request's messages is that request's :class:`InvalidRequestError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import ConfigError, InvalidRequestError
from engine.text.chat import CHATML_TEMPLATE

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
BUILTIN_SOURCE = "builtin ChatML"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")

Message = Mapping[str, Any]


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template: ``text`` (the Jinja source), ``source`` (the file it came from,
    or ``"builtin ChatML"``) and the special tokens it renders with.

    Construction compiles ``text`` and raises ConfigError if it does not compile; :meth:`render`
    is thread-safe (a compiled template holds no state between renders).
    """

    text: str
    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = _environment().from_string(self.text)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"the chat template in {self.source} does not compile: {exc}") \
                from exc
        object.__setattr__(self, "_compiled", compiled)

    @classmethod
    def builtin(cls) -> ChatTemplate:
        """The built-in ChatML template."""
        return cls(CHATML_TEMPLATE, BUILTIN_SOURCE)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate:
        """The checkpoint's template (see the module docstring for where it is looked for), or
        the built-in ChatML; raises ConfigError on an unreadable or malformed file."""
        model_dir = Path(model_dir)
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        config = _read_json(config_path)
        special = _special_tokens(config, config_path)
        jinja_path = model_dir / TEMPLATE_FILE
        if jinja_path.is_file():
            try:
                text = jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"cannot read {jinja_path}: {exc}") from exc
            return cls(text, TEMPLATE_FILE, special)
        if config.get("chat_template") is not None:
            return cls(_pick_default(config["chat_template"], config_path), TOKENIZER_CONFIG_FILE,
                       special)
        processor_path = model_dir / PROCESSOR_TEMPLATE_FILE
        processor = _read_json(processor_path)
        if processor.get("chat_template") is not None:
            return cls(_pick_default(processor["chat_template"], processor_path),
                       PROCESSOR_TEMPLATE_FILE, special)
        return cls(CHATML_TEMPLATE, BUILTIN_SOURCE, special)

    def render(self, messages: Sequence[Message], *, tools: Sequence[Message] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (ending where the assistant's reply begins when
        ``add_generation_prompt``), offering ``tools`` (OpenAI's ``{"type": "function",
        "function": {"name", "description", "parameters"}}`` objects, passed to the template as
        transformers' ``apply_chat_template(tools=...)`` passes them; None: no tools); raises
        InvalidRequestError when the messages or tools are not JSON objects or the template fails
        or raises on them."""
        plain = _objects(messages, "messages", drop_none=True)
        offered = None if tools is None else _objects(tools, "tools", drop_none=False)
        try:
            return self._compiled.render(**self.special_tokens, messages=plain, tools=offered,
                                         documents=None,
                                         add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # whatever a template raises over these messages is theirs
            raise InvalidRequestError(
                f"the chat template ({self.source}) cannot render these messages: "
                f"{type(exc).__name__}: {exc}") from exc


def user_message(text: str, images: int = 0, videos: int = 0) -> dict[str, Any]:
    """One user message: ``text`` alone, or as parts after ``images`` image parts and ``videos``
    video parts (the order of the prompts a single-turn ``--chat`` with media writes)."""
    if not images and not videos:
        return {"role": "user", "content": text}
    parts: list[dict[str, str]] = [{"type": "image"} for _ in range(images)]
    parts += [{"type": "video"} for _ in range(videos)]
    parts.append({"type": "text", "text": text})
    return {"role": "user", "content": parts}


# ---- pieces ----------------------------------------------------------------------------------


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, refusing an unsafe attribute as soon as it is named (Jinja's own
    sandbox hands back an undefined value that only fails when used, so ``{{ x.__class__ }}``
    would render as empty)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} "
                            "is not allowed in a chat template")


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON text of ``value``, without Jinja's HTML escaping (templates write JSON for models)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _objects(items: Sequence[Message], where: str, *, drop_none: bool) -> list[dict[str, Any]]:
    """``items`` (a list of JSON objects) rebuilt from plain JSON types, without their ``None``
    values when ``drop_none``."""
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise InvalidRequestError(f"chat {where} must be a list of objects")
    plain = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise InvalidRequestError(f"{where}[{i}] must be an object")
        plain.append({str(k): _plain(v, f"{where}[{i}].{k}")
                      for k, v in item.items() if v is not None or not drop_none})
    return plain


def _plain(value: Any, where: str) -> Any:
    """``value`` rebuilt from plain JSON types (so a template sees no caller's objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise InvalidRequestError(f"{where}: a {type(value).__name__} is not a JSON value")


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's content; ``{}`` when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _pick_default(value: Any, path: Path) -> str:
    """The template of a ``chat_template`` value: a string, or the ``default`` of a list of
    ``{"name", "template"}`` entries."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
            isinstance(e, dict) and isinstance(e.get("name"), str)
            and isinstance(e.get("template"), str) for e in value):
        named = {e["name"]: e["template"] for e in value}
        if "default" in named:
            return named["default"]
        raise ConfigError(f"{path}: chat_template names {sorted(named)}, none of them 'default'")
    raise ConfigError(f"{path}: chat_template must be a string or a list of "
                      "{'name', 'template'} objects")


def _special_tokens(config: Mapping[str, Any], path: Path) -> dict[str, str]:
    """The named special tokens of ``tokenizer_config.json`` (a string, or an added-token object
    with its ``content``)."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise ConfigError(f"{path}: {name} must be a string or an object with a 'content'")
        tokens[name] = value
    return tokens
