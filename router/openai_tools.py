"""OpenAI tool calling at the HTTP door: the request's ``tools`` and ``tool_choice``, and the tool
calls parsed out of the generated text, whole or streamed.

Requests (:func:`tool_use`): ``tools`` is a list of ``{"type": "function", "function": {"name",
"description"?, "parameters"? (a JSON schema), "strict"?}}``; ``tool_choice`` is ``"auto"`` (the
default when tools are given), ``"none"``, ``"required"`` or ``{"type": "function", "function":
{"name": ...}}``. The tools are rendered by the chat template (the checkpoint's, or the built-in
one: :data:`engine.text.chat.CHATML_TEMPLATE`), except with ``"none"``: then the template sees no
tools and the output is never parsed for calls, so the model answers in plain text.
``"required"`` and a named function are enforced by a grammar on the workers, as vLLM does: a
named function's output is its arguments (a JSON object matching its ``parameters``), and
``"required"`` produces a JSON array of at least one ``{"name", "parameters"}`` object, one per
call. With ``"auto"`` the model decides, and ``strict`` is not enforced. Legacy ``functions`` and
``function_call`` are not taken (:data:`router.openai_request.UNSUPPORTED`).

Output (:class:`ToolCallParser`): the Qwen family's format (Qwen2.5, Qwen3, and the built-in
template's), one or more ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks;
a block may instead hold the XML form of Qwen3-Coder and Qwen3.5, ``<function=NAME>`` with one
``<parameter=KEY>VALUE</parameter>`` per argument, each value typed by the function's
``parameters`` schema (a string property stays text; any other is read as JSON, and stays text when
it is not JSON). Text outside the blocks is the message's ``content`` (``null`` when only
whitespace is left beside the calls); a block whose JSON (or XML) is malformed stays in the content
as text, as vLLM leaves it. Each call gets an id ``call_<hex>`` and ``function.arguments`` as JSON
text, and a choice that made calls ends with ``finish_reason: "tool_calls"`` instead of ``"stop"``.
Streamed, text goes out as ``content`` deltas until a block opens (a trailing ``<tool`` that may
open one is held back), and each call as one ``tool_calls`` delta once its block closes (a named
function's arguments stream as they are generated). The whole response is what the stream's deltas
add up to, for any split of the text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from proto.pdserve.v1 import generate_pb2 as gpb
from router.errors import BadRequest

START = "<tool_call>"
END = "</tool_call>"
CHOICES = ("none", "auto", "required")
# The body fields that ask for a structured output: a forced tool choice is one already.
STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
_DEFS = ("$defs", "definitions")  # where a schema keeps the subschemas its $refs name

Delta = dict[str, Any]  # an OpenAI chat delta: "content" and/or "tool_calls"


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asks of tools: the ``tools`` to render (None for none), ``choice``
    (``none``, ``auto``, ``required`` or ``function``) and, for ``function``, its ``name``."""

    tools: list[dict[str, Any]] | None
    choice: str
    name: str | None = None

    def grammar(self) -> gpb.StructuredOutput | None:
        """The structured output that enforces the choice (``required`` and ``function``)."""
        if self.choice == "function":
            return _json_schema(_parameters(self._named()))
        if self.choice == "required":
            return _json_schema(required_schema(self.tools or []))
        return None

    def parser(self) -> ToolCallParser | None:
        """A fresh parser for one choice's output (None with ``none``: plain text)."""
        if self.choice == "function":
            assert self.name is not None
            return NamedCallParser(self.name)
        if self.choice == "required":
            return ListedCallParser()
        if self.choice == "auto":
            return TaggedCallParser(self.tools)
        return None

    def _named(self) -> dict[str, Any]:
        """The named function's definition."""
        return next(t["function"] for t in self.tools or [] if t["function"]["name"] == self.name)


def tool_use(body: dict[str, Any]) -> ToolUse:
    """The ``tools`` and ``tool_choice`` of a chat body, checked: every malformed field, a choice
    that needs tools without them, a named function not among them, and a forced choice beside
    another structured output are :class:`BadRequest` naming the field."""
    tools = _tools(body.get("tools"))
    choice, name = _choice(body.get("tool_choice"), tools)
    if choice in ("required", "function"):
        _refuse_other_grammar(body)
    return ToolUse(tools if choice != "none" else None, choice, name)


def refuse_tools(body: dict[str, Any]) -> None:
    """A :class:`BadRequest` for tools on ``/v1/completions``, which takes none."""
    if body.get("tools") not in (None, []) or body.get("tool_choice") not in (None, "none"):
        raise BadRequest("'tools' and 'tool_choice' are only taken by /v1/chat/completions")


def history_calls(calls: Any, where: str) -> list[dict[str, Any]]:  # noqa: ANN401 - JSON
    """An assistant message's ``tool_calls`` (OpenAI's form) as chat templates want them: each
    ``function.arguments`` JSON text parsed into its value (empty or missing: ``{}``), as vLLM
    does for Qwen2.5's and Qwen3's templates; ``where`` names the message in errors."""
    if not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        here = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{here} must be an object with a 'function' holding a string 'name'")
        out.append({**call, "function": {**fn, "arguments": _arguments(fn.get("arguments"),
                                                                       f"{here}.function")}})
    return out


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"``: an array of at least one ``{"name",
    "parameters"}`` object, the name one of the tools' and the parameters its schema. Subschemas
    the parameters keep under ``$defs`` (or ``definitions``) move to the top, where their
    ``$ref``s (``#/$defs/...``) point; one name with two different subschemas is a BadRequest."""
    defs: dict[str, dict[str, Any]] = {}
    items = []
    for tool in tools:
        params = dict(_parameters(tool["function"]))
        for key in _DEFS:
            for name, sub in (params.pop(key) if isinstance(params.get(key), dict) else {}).items():
                if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                    raise BadRequest(f"'tools': two tools define '{key}/{name}' differently")
        items.append({"type": "object",
                      "properties": {"name": {"type": "string",
                                              "enum": [tool["function"]["name"]]},
                                     "parameters": params},
                      "required": ["name", "parameters"]})
    return {"type": "array", "minItems": 1, "items": {"anyOf": items},
            **{key: subs for key, subs in defs.items() if subs}}


# ---- output ----------------------------------------------------------------------------------


class ToolCallParser:
    """Turns one choice's generated text into OpenAI chat deltas (:meth:`feed` each piece, then
    :meth:`finish`), and keeps the whole message they add up to (:meth:`message`)."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> Delta:
        """The delta of the next piece of text (empty while text is held back)."""
        return self._delta(*self._feed(text))

    def finish(self) -> Delta:
        """The delta of what was held back, once the output has ended."""
        return self._delta(*self._finish())

    def whole(self, text: str) -> dict[str, Any]:
        """The message of a whole output (for a parser not fed yet)."""
        self.feed(text)
        self.finish()
        return self.message()

    def message(self) -> dict[str, Any]:
        """The assistant message the deltas so far add up to: ``content`` (``null`` beside calls
        when it is only whitespace) and ``tool_calls`` (when there are any)."""
        content: str | None = "".join(self._content)
        if not self._calls:
            return {"role": "assistant", "content": content}
        if not content or not content.strip():
            content = None
        return {"role": "assistant", "content": content, "tool_calls": self._calls}

    def finish_reason(self, reason: str | None) -> str | None:
        """``"tool_calls"`` for a choice that stopped after making calls, else ``reason``."""
        return "tool_calls" if self._calls and reason == "stop" else reason

    def _feed(self, text: str) -> tuple[str, list[Delta]]:
        raise NotImplementedError

    def _finish(self) -> tuple[str, list[Delta]]:
        raise NotImplementedError

    def _new_call(self, name: str, arguments: str, unrecorded: int = 0) -> Delta:
        """The delta that opens a call, after those recorded and ``unrecorded`` others opened in
        the same piece."""
        return {"index": len(self._calls) + unrecorded, "id": f"call_{secrets.token_hex(12)}",
                "type": "function", "function": {"name": name, "arguments": arguments}}

    def _delta(self, content: str, calls: list[Delta]) -> Delta:
        """Record ``content`` and ``calls`` (openings, or arguments added to an open call) and
        return them as one delta."""
        out: Delta = {}
        if content:
            self._content.append(content)
            out["content"] = content
        for call in calls:
            if "id" in call:
                self._calls.append({k: v for k, v in call.items() if k != "index"}
                                   | {"function": dict(call["function"])})
            else:
                self._calls[call["index"]]["function"]["arguments"] += \
                    call["function"]["arguments"]
        if calls:
            out["tool_calls"] = calls
        return out


class TaggedCallParser(ToolCallParser):
    """``tool_choice: "auto"``: ``<tool_call>`` blocks among the text.

    Outside a block, text is sent as soon as it cannot be the start of one; whitespace right
    before a block is dropped (kept if the block turns out malformed), and after the last call
    trailing whitespace too. Without any call the content is the text exactly."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        # each function's parameter properties: how an XML call's values are typed
        self._properties = {t["function"]["name"]: _parameters(t["function"]).get("properties")
                            for t in tools or []}
        self._pending = ""  # outside a block: text not sent yet
        self._gap = ""  # the whitespace before the open block
        self._block: str | None = None  # inside a block: its text so far

    def _feed(self, text: str) -> tuple[str, list[Delta]]:
        content: list[str] = []
        calls: list[Delta] = []
        while text:
            if self._block is None:
                text = self._outside(self._pending + text, content)
            else:
                text = self._inside(self._block + text, content, calls)
        return "".join(content), calls

    def _outside(self, text: str, content: list[str]) -> str:
        """Send what of ``text`` is surely content; returns the rest once a block opens."""
        start = text.find(START)
        if start < 0:
            keep = _held(text)
            content.append(text[:len(text) - keep])
            self._pending = text[len(text) - keep:]
            return ""
        before = text[:start]
        sent = before.rstrip()
        content.append(sent)
        self._gap, self._pending, self._block = before[len(sent):], "", ""
        return text[start + len(START):]

    def _inside(self, text: str, content: list[str], calls: list[Delta]) -> str:
        """Close the block once ``text`` holds its end; returns the text after it."""
        end = text.find(END)
        if end < 0:
            self._block = text
            return ""
        call = _parse_call(text[:end]) or _parse_xml_call(text[:end], self._properties)
        if call is None:
            content.append(self._gap + START + text[:end + len(END)])
        else:
            calls.append(self._new_call(*call, unrecorded=len(calls)))
        self._gap, self._block = "", None
        return text[end + len(END):]

    def _finish(self) -> tuple[str, list[Delta]]:
        if self._block is not None:  # an unfinished block: its text is content
            rest = self._gap + START + self._block
        elif self._calls:
            rest = self._pending.rstrip()
        else:
            rest = self._pending
        self._pending, self._gap, self._block = "", "", None
        return rest, []


class NamedCallParser(ToolCallParser):
    """A named ``tool_choice``: the whole output is the arguments of one call to ``name``,
    streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def _feed(self, text: str) -> tuple[str, list[Delta]]:
        if not text:
            return "", []
        if not self._calls:
            return "", [self._new_call(self._name, text)]
        return "", [{"index": 0, "function": {"arguments": text}}]

    def _finish(self) -> tuple[str, list[Delta]]:
        return "", ([] if self._calls else [self._new_call(self._name, "")])


class ListedCallParser(ToolCallParser):
    """``tool_choice: "required"``: a JSON array of ``{"name", "parameters"}`` objects, each a
    call sent once its object closes. What is not such an array (an output cut short) becomes
    content when the output ends."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._at = 0  # where the next array element starts (after the array's "[")
        self._stuck = False  # something that is not a call: nothing more is parsed

    def _feed(self, text: str) -> tuple[str, list[Delta]]:
        self._text += text
        calls: list[Delta] = []
        while not self._stuck and (found := self._next_item()) is not None:
            item, end = found
            call = _listed_call(item)
            self._stuck = call is None
            if call is not None:
                calls.append(self._new_call(*call, unrecorded=len(calls)))
                self._at = end
        return "", calls

    def _next_item(self) -> tuple[Any, int] | None:
        """The next complete array element and where it ends, or None (none yet, or no more)."""
        text = self._text
        if not self._at:  # the array has not opened yet
            at = _skip(text, 0, " \t\r\n")
            if at >= len(text):
                return None
            self._stuck = text[at] != "["
            self._at = at + 1
        at = _skip(text, self._at, " \t\r\n,")
        if self._stuck or at >= len(text) or text[at] == "]":
            return None
        try:
            return json.JSONDecoder().raw_decode(text, at)
        except ValueError:
            return None  # not complete yet (or never: the rest is content at the end)

    def _finish(self) -> tuple[str, list[Delta]]:
        if not self._calls:
            return self._text, []
        rest = self._text[self._at:]
        return ("" if rest.strip(" \t\r\n") in ("", "]") else rest), []


# ---- pieces ----------------------------------------------------------------------------------


def _tools(value: Any) -> list[dict[str, Any]] | None:  # noqa: ANN401 - JSON
    """``tools``, checked (None or [] for none)."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise BadRequest("'tools' must be a list of tools")
    names: set[str] = set()
    for i, tool in enumerate(value):
        name = _tool(tool, f"tools[{i}]")
        if name in names:
            raise BadRequest(f"'tools' names the function {name!r} twice")
        names.add(name)
    return value


def _tool(tool: Any, where: str) -> str:  # noqa: ANN401 - JSON
    """One tool, checked; returns its function's name."""
    if not isinstance(tool, dict):
        raise BadRequest(f"'{where}' must be an object")
    if tool.get("type", "function") != "function":
        raise BadRequest(f"'{where}.type' must be 'function'")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"'{where}.function' must be an object")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadRequest(f"'{where}.function.name' must be a non-empty string")
    for key, kind, what in (("description", str, "a string"), ("parameters", dict,
                                                                "a JSON schema object"),
                            ("strict", bool, "a boolean")):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            raise BadRequest(f"'{where}.function.{key}' must be {what}")
    return str(fn["name"])


def _choice(value: Any, tools: list[dict[str, Any]] | None  # noqa: ANN401 - JSON
            ) -> tuple[str, str | None]:
    """``tool_choice`` as ``(choice, name)``."""
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, dict):
        fn = value.get("function")
        if value.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise BadRequest("'tool_choice' must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")
        choice, name = "function", fn["name"]
    elif value in CHOICES:
        choice, name = value, None
    else:
        raise BadRequest(f"'tool_choice' must be 'none', 'auto', 'required' or a function, "
                         f"not {value!r}")
    if choice != "none" and not tools:
        raise BadRequest(f"'tool_choice' {name or value!r} needs 'tools'")
    if name is not None and all(t["function"]["name"] != name for t in tools or []):
        raise BadRequest(f"'tool_choice' names the function {name!r}, which 'tools' lacks")
    return choice, name


def _refuse_other_grammar(body: dict[str, Any]) -> None:
    """A forced tool choice is a grammar already: refuse another structured output beside it."""
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise BadRequest("'tool_choice' (required or a named function) and 'response_format' "
                         "both constrain the output: give one")
    for key in STRUCTURED_FIELDS:
        if body.get(key) is not None:
            raise BadRequest(f"'tool_choice' (required or a named function) and '{key}' both "
                             "constrain the output: give one")


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema (any object when it has none)."""
    params = fn.get("parameters")
    return params if params is not None else {"type": "object"}


def _json_schema(schema: dict[str, Any]) -> gpb.StructuredOutput:
    return gpb.StructuredOutput(kind="json_schema", value=json.dumps(schema, ensure_ascii=False))


def _arguments(value: Any, where: str) -> Any:  # noqa: ANN401 - JSON
    """A past call's arguments as their JSON value."""
    if value is None or value == "":
        return {}
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise BadRequest(f"{where}.arguments is not valid JSON: {exc}") from exc


def _held(text: str) -> int:
    """How many characters at the end of ``text`` to hold back: a partial ``<tool_call>`` and
    the whitespace before it (which a block would drop)."""
    keep = next((n for n in range(min(len(START) - 1, len(text)), 0, -1)
                 if START.startswith(text[-n:])), 0)
    body = text[:len(text) - keep]
    return keep + len(body) - len(body.rstrip())


def _parse_call(block: str) -> tuple[str, str] | None:
    """A block's ``(name, arguments JSON)``, or None when it is not ``{"name": str,
    "arguments": object}`` (arguments left out: ``{}``)."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return call["name"], json.dumps(args, ensure_ascii=False)


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _parse_xml_call(block: str, properties: dict[str, Any]) -> tuple[str, str] | None:
    """A block's ``(name, arguments JSON)`` in the XML form (``<function=NAME>`` holding
    ``<parameter=KEY>VALUE</parameter>`` tags and whitespace only), or None. A value loses one
    newline at each end; it is typed by ``properties[NAME][KEY]``'s ``type``."""
    found = _XML_FUNCTION.fullmatch(block)
    if found is None:
        return None
    name, body = found.group(1).strip(), found.group(2)
    schema = properties.get(name)
    args: dict[str, Any] = {}
    at = 0
    for param in _XML_PARAMETER.finditer(body):
        if body[at:param.start()].strip():
            return None  # text between the parameters: not a call
        key = param.group(1).strip()
        args[key] = _xml_value(_trim_newline(param.group(2)),
                               schema.get(key) if isinstance(schema, dict) else None)
        at = param.end()
    if body[at:].strip():
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _trim_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _xml_value(text: str, schema: Any) -> Any:  # noqa: ANN401 - JSON
    """An XML parameter's value: text for a string property (or one without a schema or
    type), else its JSON value (text when it is not JSON)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _listed_call(item: Any) -> tuple[str, str] | None:  # noqa: ANN401 - JSON
    """A ``required`` array element's ``(name, arguments JSON)``, or None if it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
            or not isinstance(item.get("parameters"), dict):
        return None
    return item["name"], json.dumps(item["parameters"], ensure_ascii=False)


def _skip(text: str, at: int, chars: str) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at
