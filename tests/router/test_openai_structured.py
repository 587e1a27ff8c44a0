"""Structured outputs through the OpenAI door, called with the ``openai`` client, on four
paths over the built-in model: disaggregated and colocated, each with and without EAGLE.

Every path returns, for every grammar of the suite (``tests/structured_schemas.py`` and a regex,
a choice, an EBNF grammar and ``json_object``), exactly the in-process engine's greedy output under
the same grammar (which ``tests/engine/sampling/test_structured.py`` holds to the model's own
tokens wherever the grammar allowed them), and that output validates. The three spellings
(``response_format``, ``structured_outputs``, ``guided_*``) are taken, streamed and whole, on both
endpoints; malformed fields are refused by the door and grammars that cannot be enforced by the
workers, each with a 400 naming the problem; cancelled constrained streams leave nothing held.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from engine.builtin import builtin_model_dir
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from tests.cluster.harness import Node, running
from tests.cluster.stats import assert_all_idle, get_stats
from tests.structured_schemas import MAX_TOKENS, SCHEMAS, check_json

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow
BUILTIN = builtin_model_dir()
NODE = ["--host", "127.0.0.1", "--port", "0", "--num-pages", "512", "--page-size", "16"]
PROMPT = "config = "
OTHER = {  # vLLM's structured_outputs beside the schemas
    "regex": {"regex": r"[a-z]{2,6}-[0-9]{1,3}"},
    "choice": {"choice": ["import os", "from sys import path", "pass"]},
    "grammar": {"grammar": 'root ::= "def " name "(" name? ")"\nname ::= [a-z_]{1,8}'},
}


@dataclass
class Door:
    client: openai.OpenAI
    workers: list[str]  # the gRPC addresses of the workers behind it


def body(name: str) -> dict[str, Any]:
    """The body fields asking for grammar ``name`` (the client's ``extra_body``: its
    completions call has no ``response_format``): schemas alternate between OpenAI's
    ``response_format`` and vLLM's ``structured_outputs`` and ``guided_json``."""
    if name in OTHER:
        return {"structured_outputs": OTHER[name]}
    if name == "json_object":
        return {"response_format": {"type": "json_object"}}
    schema = SCHEMAS[name]
    spelling = list(SCHEMAS).index(name) % 3
    if spelling == 0:
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "reply", "schema": schema}}}
    if spelling == 1:
        return {"structured_outputs": {"json": schema}}
    return {"guided_json": json.dumps(schema)}


def grammar_of(name: str) -> tuple[str, str]:
    if name in OTHER:
        [(kind, value)] = OTHER[name].items()
        return kind, value if isinstance(value, str) else json.dumps(value)
    if name == "json_object":
        return "json_object", ""
    return "json_schema", json.dumps(SCHEMAS[name])


NAMES = [*SCHEMAS, *OTHER, "json_object"]


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    """The in-process engine's greedy output text under each grammar (without its stop)."""
    engine = LLMEngine(BUILTIN, EngineConfig(num_pages=512, page_size=16, max_num_seqs=32))
    results = engine.generate(
        [Prompt(text=PROMPT)] * len(NAMES),
        [SamplingParams(max_new_tokens=MAX_TOKENS, structured_output=grammar_of(n))
         for n in NAMES])
    assert engine.tokenizer is not None
    assert all(r.finish_reason.value == "stop" for r in results)
    return {n: engine.tokenizer.decode(r.token_ids[:-1]) for n, r in zip(NAMES, results,
                                                                           strict=True)}


@pytest.fixture(scope="module")
def doors() -> Iterator[dict[str, Door]]:
    model, draft = ["--model", str(BUILTIN)], ["--draft", str(BUILTIN / "draft")]
    with running(["prefill", *model, *NODE, *draft], ["prefill", *model, *NODE],
                 ["decode", *model, *NODE, *draft, "--num-draft-tokens", "4"],
                 ["decode", *model, *NODE]) as [drafting, prefill, eagle, plain]:
        paths = {"disaggregated eagle": (["--prefill", drafting.address, "--decode",
                                          eagle.address], [drafting, eagle]),
                 "disaggregated": (["--prefill", prefill.address, "--decode", plain.address],
                                   [prefill, plain]),
                 "colocated eagle": (["--colocated", eagle.address], [eagle]),
                 "colocated": (["--colocated", plain.address], [plain])}
        routers = [["router", *model, "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                    *args] for args, _ in paths.values()]
        with running(*routers) as nodes:
            yield {name: Door(_client(node), [w.address for w in workers])
                   for (name, (_, workers)), node in zip(paths.items(), nodes, strict=True)}


def _client(router: Node) -> openai.OpenAI:
    port = next(int(ln.split()[1]) for ln in router.log if ln.startswith("HTTP "))
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                         timeout=120)


def check(name: str, text: str) -> None:
    """``text`` satisfies grammar ``name``."""
    if name in SCHEMAS:
        check_json(text, SCHEMAS[name])
    elif name == "json_object":
        assert isinstance(json.loads(text), dict)
    elif name == "choice":
        assert text in OTHER["choice"]["choice"]
    else:
        assert text, name


@pytest.mark.parametrize("path", ["disaggregated eagle", "disaggregated", "colocated eagle",
                                  "colocated"])
def test_every_grammar_gives_the_engines_output_on_every_path(
        doors: dict[str, Door], expected: dict[str, str], path: str) -> None:
    door = doors[path]

    def complete(name: str) -> tuple[str, str | None]:
        out = door.client.completions.create(model="m", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                             temperature=0, extra_body=body(name))
        return out.choices[0].text, out.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        got = dict(zip(NAMES, pool.map(complete, NAMES), strict=True))
    for name in NAMES:
        text, finish = got[name]
        assert (text, finish) == (expected[name], "stop"), name
        check(name, text)
    if "eagle" in path:  # the rounds ran: drafts were verified under the masks, and kept
        assert get_stats(door.workers[-1]).accepted_tokens > 0
    assert_all_idle(door.workers)


def test_chat_streams_a_json_schema_reply(doors: dict[str, Door]) -> None:
    door = doors["disaggregated eagle"]
    schema = SCHEMAS["flat object"]
    stream = door.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=MAX_TOKENS, temperature=0.7, seed=3, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema,
                                                                "strict": True}})
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "stop"
    check_json(text, schema)
    whole = door.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=MAX_TOKENS, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert whole.choices[0].message.content == text
    assert_all_idle(door.workers)


@pytest.mark.parametrize(("fields", "message"), [
    ({"response_format": {"type": "xml"}}, "'response_format.type' 'xml' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "'response_format.json_schema.schema' is required"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "'response_format' and 'guided_regex' both ask for a structured output"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "'structured_outputs' must set exactly one of"),
    ({"structured_outputs": {"choice": []}},
     "'structured_outputs.choice' must be a non-empty list"),
    ({"guided_json": "{oops"}, "'guided_json' is not valid JSON"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True},
     "ignore_eos cannot be combined with a structured output"),
    # refused by the workers, which hold the grammar library
    ({"guided_json": {"type": "object", "not": {"required": ["a"]}}},
     "json_schema: 'not' at # is not supported"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "invalid grammar"),
])
@pytest.mark.parametrize("path", ["disaggregated", "colocated"])
def test_bad_structured_output_fields_get_a_400_naming_them(
        doors: dict[str, Door], fields: dict[str, Any], message: str, path: str) -> None:
    door = doors[path]
    with pytest.raises(openai.BadRequestError) as caught:
        door.client.completions.create(model="m", prompt=PROMPT, max_tokens=8,
                                       extra_body=fields)
    assert message in str(caught.value), caught.value
    assert_all_idle(door.workers)


@pytest.mark.parametrize("path", ["disaggregated eagle", "colocated"])
def test_cancelled_constrained_streams_leave_nothing_held(doors: dict[str, Door],
                                                          path: str) -> None:
    door = doors[path]

    def read_a_little(name: str) -> int:
        stream = door.client.completions.create(
            model="m", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, stream=True,
            extra_body=body(name))
        seen = 0
        for _ in stream:
            seen += 1
            if seen == 2:
                break
        stream.close()
        return seen

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(read_a_little, NAMES))
    assert_all_idle(door.workers)
