"""The router's OpenAI-compatible HTTP door, end to end: one ``pdserve decode`` worker behind
``pdserve router --colocated ... --http-port 0``, called with the official ``openai`` client and
compared with the gRPC door; and a router whose worker is not there, whose ``/v1/models`` says
503 until it is ready.
"""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from PIL import Image

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from proto.pdserve.v1 import worker_pb2 as wpb
from tests.cluster.harness import Node, free_port, start_node, stop_node

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow


@dataclass
class Door:
    router: Node
    http_port: int
    model: str
    decode: str  # the decode worker's address

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def door(tiny_dir: Path) -> Iterator[Door]:
    nodes: list[Node] = []
    try:
        nodes.append(start_node(["decode", "--model", str(tiny_dir), "--host", "127.0.0.1",
                                 "--port", "0", "--num-pages", "256"]))
        router = start_node(["router", "--model", str(tiny_dir), "--host", "127.0.0.1",
                             "--colocated", nodes[0].address, "--port", "0",
                             "--http-port", "0"])
        nodes.append(router)
        http = [line for line in router.log if line.startswith("HTTP ")]
        assert http, f"no HTTP line before READY: {router.log}"
        yield Door(router, int(http[0].split()[1]), tiny_dir.name, nodes[0].address)
    finally:
        for node in reversed(nodes):
            stop_node(node)


def png_data_url(size: tuple[int, int] = (56, 56)) -> str:
    img = Image.new("RGB", size)
    for x in range(size[0]):
        for y in range(size[1]):
            img.putpixel((x, y), (x * 4 % 256, y * 4 % 256, (x + y) % 256))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_streaming_chat_with_image_ends_with_usage(door: Door) -> None:
    stream = door.client().chat.completions.create(
        model=door.model, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [
                      {"type": "text", "text": "what is in"},
                      {"type": "image_url", "image_url": {"url": png_data_url()}},
                      {"type": "text", "text": "this picture?"}]}])
    chunks = list(stream)
    assert chunks, "no chunks"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text
    assert finishes[-1] in ("stop", "length")
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None and 1 <= usage.completion_tokens <= 8
    assert usage.prompt_tokens > 20  # the expanded image placeholders are counted
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_equals_grpc_door(door: Door) -> None:
    prompt = "The quick brown fox"
    res = door.client().completions.create(model=door.model, prompt=prompt, max_tokens=12,
                                           temperature=0)
    with grpc.insecure_channel(door.router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        msgs = list(stub.Generate(gpb.GenerateRequest(
            text=prompt, sampling=gpb.SamplingParams(max_new_tokens=12))))
    assert res.choices[0].text == "".join(m.text for m in msgs)
    assert res.choices[0].finish_reason == msgs[-1].finish_reason
    assert res.usage is not None
    assert res.usage.completion_tokens == msgs[-1].usage.completion_tokens
    assert res.usage.prompt_tokens == msgs[-1].usage.prompt_tokens


def test_streaming_completion_matches_non_streaming(door: Door) -> None:
    client = door.client()
    whole = client.completions.create(model=door.model, prompt="one two three", max_tokens=10,
                                      temperature=0)
    chunks = list(client.completions.create(model=door.model, prompt="one two three",
                                            max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def get_json(url: str) -> tuple[int, dict[str, Any]]:
    """GET ``url``: its HTTP status and JSON body, errors included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_and_health(door: Door) -> None:
    """``/health`` and ``/v1/models`` answer 200 once the router has polled its workers (503
    before), and the model list names the served model."""
    root = f"http://127.0.0.1:{door.http_port}"
    deadline = time.monotonic() + 30
    while (health := get_json(f"{root}/health"))[0] != 200:
        assert health[0] == 503 and time.monotonic() < deadline, health
        time.sleep(0.1)
    assert health[1] == {"status": "ok"}
    models = door.client().models.list()
    assert [m.id for m in models.data] == [door.model]


def test_models_is_503_while_no_worker_is_ready(tiny_dir: Path) -> None:
    """A router whose only worker address has nothing listening is not ready: ``/v1/models``
    answers 503 with an OpenAI error body carrying the readiness reason ``/health`` gives, and
    the SDK raises it (rather than listing a model no request can reach)."""
    nobody = free_port()
    router = start_node(["router", "--model", str(tiny_dir), "--host", "127.0.0.1",
                         "--colocated", f"127.0.0.1:{nobody}", "--port", "0",
                         "--http-port", "0", "--served-model-name", "tiny-chat"])
    try:
        [http] = [line.split()[1] for line in router.log if line.startswith("HTTP ")]
        root = f"http://127.0.0.1:{http}"
        status, body = get_json(f"{root}/v1/models")
        assert status == 503, body
        error = body["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "unavailable")
        assert error["message"].startswith("not ready: no decode worker is reachable (")
        assert f"127.0.0.1:{nobody}: GetLoad failed" in error["message"]
        health = get_json(f"{root}/health")
        assert health[0] == 503 and health[1]["status"] == "not ready"
        assert health[1]["reason"].startswith("no decode worker is reachable (")
        client = openai.OpenAI(base_url=f"{root}/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as err:
            client.models.list()
        assert err.value.status_code == 503
    finally:
        stop_node(router)


def test_bad_requests_are_400(door: Door) -> None:
    client = door.client()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=door.model, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError) as err:  # the shared validator's refusal
        client.completions.create(model=door.model, prompt="hi", max_tokens=10**6)
    assert "max_new_tokens" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=door.model, max_tokens=4, messages=[
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    req = urllib.request.Request(f"{door.base_url}/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(req, timeout=10)
    assert http_err.value.code == 400
    assert json.loads(http_err.value.read())["error"]["type"] == "invalid_request_error"


def test_stop_string_cuts_the_text(door: Door) -> None:
    client = door.client()
    whole = client.completions.create(model=door.model, prompt="alpha beta", max_tokens=16,
                                      temperature=0).choices[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    assert stop, whole
    cut = client.completions.create(model=door.model, prompt="alpha beta", max_tokens=16,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].text == whole[:whole.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=door.model, prompt="alpha beta",
                                            max_tokens=16, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text



def test_n_choices_are_the_seeded_grpc_generations(door: Door) -> None:
    """``n = 2`` with a seed: choice ``i`` is what the gRPC door generates with ``seed + i``;
    the prompt is counted once and the completions are summed."""
    kw = {"model": door.model, "prompt": "one two", "max_tokens": 6, "temperature": 1.0,
          "seed": 11}
    res = door.client().completions.create(n=2, **kw)
    with grpc.insecure_channel(door.router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        runs = [list(stub.Generate(gpb.GenerateRequest(text="one two", sampling=gpb.SamplingParams(
            max_new_tokens=6, temperature=1.0, seed=11 + i)))) for i in range(2)]
    assert [c.index for c in res.choices] == [0, 1]
    assert [c.text for c in res.choices] == ["".join(m.text for m in r) for r in runs]
    assert res.usage is not None
    assert res.usage.prompt_tokens == runs[0][-1].usage.prompt_tokens
    assert res.usage.completion_tokens == sum(r[-1].usage.completion_tokens for r in runs)
    chunks = list(door.client().completions.create(n=2, stream=True, **kw))
    for i in range(2):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) \
            == res.choices[i].text


def test_grpc_stop_string_cuts_the_text_and_frees_the_worker(door: Door) -> None:
    with grpc.insecure_channel(door.router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        whole = "".join(m.text for m in stub.Generate(gpb.GenerateRequest(
            text="alpha beta", sampling=gpb.SamplingParams(max_new_tokens=24, ignore_eos=True))))
        stop = whole[len(whole) // 3:len(whole) // 3 + 2]
        sampling = gpb.SamplingParams(max_new_tokens=24, ignore_eos=True,
                                      stop=["never there", stop])
        msgs = list(stub.Generate(gpb.GenerateRequest(text="alpha beta", sampling=sampling)))
    assert "".join(m.text for m in msgs) == whole[:whole.find(stop)]
    assert msgs[-1].finished and msgs[-1].finish_reason == "stop"
    assert msgs[-1].usage.completion_tokens == sum(len(m.token_ids) for m in msgs) <= 24
    with grpc.insecure_channel(door.decode) as ch:
        stub_w = worker_pb2_grpc.DecodeWorkerStub(ch)
        deadline = time.monotonic() + 15
        while (load := stub_w.GetLoad(wpb.GetLoadRequest())).kv_pages_used:
            assert time.monotonic() < deadline, load
            time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_frees_the_worker(door: Door, stream: bool) -> None:
    """A call for 2,000 tokens dropped (its socket closed) while the worker generates: a stream
    after its first chunks, a plain call while it waits for its whole answer. The door cancels
    the generation, so the worker holds no request and no page, and the router's request line
    says it was cancelled short of its 2,000 tokens."""
    import http.client

    rid = f"goes-away-{stream}"
    conn = http.client.HTTPConnection("127.0.0.1", door.http_port, timeout=60)
    body = json.dumps({"model": door.model, "prompt": "def main():", "max_tokens": 2000,
                       "ignore_eos": True, "stream": stream})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                   "x-request-id": rid})
    with grpc.insecure_channel(door.decode) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200
            chunks = 0
            while chunks < 3:  # a few events: the generation runs on the worker
                chunks += resp.readline().startswith(b"data: {")
        deadline = time.monotonic() + 15
        while not stub.GetLoad(wpb.GetLoadRequest()).running_requests:
            assert time.monotonic() < deadline, "the worker never got the request"
            time.sleep(0.01)
        assert conn.sock is not None
        conn.sock.close()  # the client goes away
        conn.close()
        gone = time.monotonic()
        while (load := stub.GetLoad(wpb.GetLoadRequest())).running_requests \
                or load.kv_pages_used:
            assert time.monotonic() < gone + 15, load
            time.sleep(0.05)
    while not (lines := [x for x in door.router.log if f'"request_id":"{rid}"' in x]):
        assert time.monotonic() < gone + 15, "no request line"
        time.sleep(0.05)
    [line] = [json.loads(x) for x in lines]
    assert line["status"] == "CANCELLED" and line["completion_tokens"] < 2000, line
