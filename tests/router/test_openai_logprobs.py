"""Log-probabilities and the tokenizer endpoints through the OpenAI door of a disaggregated
cluster (prefill, decode and a router with ``--http-port``), called with the ``openai`` client
and held against transformers: completions ``logprobs`` with ``echo`` (the prompt's, computed on
the prefill worker and returned in its ``Prefill`` response), chat ``logprobs``/``top_logprobs``
streamed and whole (the first token's alternatives ride the aux row from the prefill), vLLM's
``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, the 400s of bad fields, and no page or
room left behind."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from proto.pdserve.v1 import worker_pb2 as wpb
from tests.cluster.harness import Node, running
from tests.cluster.stats import assert_all_idle

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow
ARGS = ["--host", "127.0.0.1", "--port", "0", "--num-pages", "128", "--page-size", "8"]
PROMPT = "the quick brown fox jumps over the lazy dog and"


@dataclass
class Cluster:
    client: openai.OpenAI
    workers: list[Node]
    router: Node

    def grpc_ids(self, text: str, max_tokens: int, **sampling: Any  # noqa: ANN401
                 ) -> tuple[list[int], list[float]]:
        """The output ids of ``text`` through the router's gRPC door, and their logprobs
        (greedy unless ``sampling`` says otherwise)."""
        with grpc.insecure_channel(self.router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            params = gpb.SamplingParams(**{"temperature": 0, **sampling},
                                        max_new_tokens=max_tokens, logprobs=True)
            msgs = list(stub.Generate(gpb.GenerateRequest(text=text, sampling=params),
                                      timeout=60))
            return ([t for m in msgs for t in m.token_ids],
                    [lp for m in msgs for lp in m.logprobs])


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    model = ["--model", str(tiny_dir)]
    with running(["prefill", *model, *ARGS], ["decode", *model, *ARGS]) as workers:
        router = ["router", *model, "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                  "--prefill", workers[0].address, "--decode", workers[1].address]
        with running(router) as [door]:
            port = next(int(ln.split()[1]) for ln in door.log if ln.startswith("HTTP "))
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                   max_retries=0, timeout=60)
            yield Cluster(client, workers, door)


@pytest.fixture(scope="module")
def oracle(tiny_dir: Path) -> Any:  # noqa: ANN401 - transformers model
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(tiny_dir).eval()


def reference(oracle: Any, ids: list[int]) -> torch.Tensor:  # noqa: ANN401
    """transformers' log-probabilities of every position ``[n, V]``."""
    with torch.no_grad():
        logits = oracle(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def tokenize(tiny_dir: Path, text: str) -> list[int]:
    from engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_dir)
    assert tok is not None
    return tok.encode(text)


def test_completion_echo_logprobs_equal_transformers(cluster: Cluster, oracle: Any,
                                                     tiny_dir: Path) -> None:
    client, workers = cluster.client, cluster.workers
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0,
                                    logprobs=3, echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    prompt_ids = tokenize(tiny_dir, PROMPT)
    n = len(prompt_ids)
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == n + out.usage.completion_tokens == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text  # every token's text, the echoed prompt's too
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    ids = [*prompt_ids, *cluster.grpc_ids(PROMPT, 4)[0]]
    assert len(ids) == len(lp.tokens)
    ref = reference(oracle, ids)
    want = ref[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-4, rtol=0)
    for p, top in enumerate(lp.top_logprobs[1:]):
        # the token itself and its 3 alternatives, keyed by text: tokens that end inside a
        # character all read U+FFFD and share one key
        assert 1 <= len(top) <= 4
        best = ref[p].topk(3).values.tolist()
        assert max(top.values()) == pytest.approx(best[0], abs=1e-4)
        assert all(any(abs(v - b) < 1e-4 for b in [*best, want[p].item()])
                   for v in top.values())
    # greedy: each generated token is the most likely one
    for top, value in zip(lp.top_logprobs[n:], lp.token_logprobs[n:], strict=True):
        assert value == pytest.approx(max(top.values()), abs=1e-6)
    assert_all_idle([w.address for w in workers])


def test_chat_top_logprobs_streamed_equal_whole(cluster: Cluster) -> None:
    client, workers = cluster.client, cluster.workers
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    # each token's own bytes join into the exact text (a token's text may end mid-character)
    joined = bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")
    assert joined == whole.choices[0].message.content
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=2,
                                            stream=True)
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs
                for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=6,
                                           temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == whole.choices[0].message.content
    assert_all_idle([w.address for w in workers])


def test_sampled_logprobs_are_the_models(cluster: Cluster, oracle: Any,  # noqa: ANN401
                                         tiny_dir: Path) -> None:
    """At temperature 2 the sampled tokens' log-probabilities are still the model's own
    (transformers' at temperature 1), and the HTTP door reports what the gRPC door does for the
    same seed."""
    sampling = {"temperature": 2.0, "seed": 7}
    out_ids, lps = cluster.grpc_ids(PROMPT, 8, **sampling)
    ids = [*tokenize(tiny_dir, PROMPT), *out_ids]
    ref = reference(oracle, ids)[len(ids) - len(out_ids) - 1 : -1]
    want = ref.gather(1, torch.tensor(out_ids).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(lps), want, atol=1e-4, rtol=0)
    assert (ref.argmax(dim=-1) != torch.tensor(out_ids)).any()  # the temperature mattered
    out = cluster.client.completions.create(model="m", prompt=PROMPT, max_tokens=8, logprobs=5,
                                            **sampling)
    torch.testing.assert_close(torch.tensor(out.choices[0].logprobs.token_logprobs),
                               torch.tensor(lps), atol=1e-6, rtol=0)


def test_echo_of_a_one_token_prompt(cluster: Cluster) -> None:
    """A one-token prompt has no prompt log-probability, but its echo still lists the token
    (with ``null``), then the completion's."""
    out = cluster.client.completions.create(model="m", prompt=[5], max_tokens=2, temperature=0,
                                            logprobs=1, echo=True)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    assert_all_idle([w.address for w in cluster.workers])


@pytest.mark.parametrize("path,body,field", [
    ("completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("completions", {"prompt": "a", "echo": "yes"}, "echo"),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
              "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "logprobs": 1}, "logprobs"),
])
def test_bad_logprob_fields_are_400(cluster: Cluster, path: str, body: dict[str, Any],
                                    field: str) -> None:
    client = cluster.client
    call = client.completions.create if path == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError, match=field):
        call(model="m", max_tokens=2, **body)


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tokenizer_endpoints(cluster: Cluster, tiny_dir: Path) -> None:
    """vLLM's /tokenize, /detokenize and /tokenizer_info: the served tokenizer's ids, the chat
    template's prompt (the one chat completions count, tools included), clear 400s."""
    root = str(cluster.client.base_url).removesuffix("/v1/")
    status, got = post(f"{root}/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert status == 200 and got["tokens"] == tokenize(tiny_dir, PROMPT)
    assert got["count"] == len(got["tokens"])
    status, back = post(f"{root}/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and back["prompt"] == PROMPT
    messages = [{"role": "user", "content": PROMPT}]
    status, chat = post(f"{root}/tokenize", {"messages": messages})
    usage = cluster.client.chat.completions.create(model="m", messages=messages, max_tokens=1,
                                                   temperature=0).usage
    assert status == 200 and chat["count"] == usage.prompt_tokens
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    status, offered = post(f"{root}/tokenize", {"messages": messages, "tools": tools})
    usage = cluster.client.chat.completions.create(model="m", messages=messages, max_tokens=1,
                                                   temperature=0, tools=tools).usage
    assert status == 200 and offered["count"] == usage.prompt_tokens > chat["count"]
    with urllib.request.urlopen(f"{root}/tokenizer_info", timeout=30) as resp:
        info = json.loads(resp.read())
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    for path, body, field in (("tokenize", {"prompt": 3}, "prompt"),
                              ("tokenize", {"prompt": "a", "add_special_tokens": "no"},
                               "add_special_tokens"),
                              ("detokenize", {"tokens": [-1]}, "tokens"),
                              ("detokenize", {"tokens": [10**9]}, "tokens")):
        status, err = post(f"{root}/{path}", body)
        assert status == 400 and field in err["error"]["message"], (path, body, err)


def test_the_prefill_worker_scores_the_prompt(cluster: Cluster, oracle: Any,  # noqa: ANN401
                                              tiny_dir: Path) -> None:
    """A pipeline-free prefill reports that it scores prompts, and its ``Prefill`` response
    carries them, equal to transformers: the door's echo above reads these."""
    prefill, decode = (w.address for w in cluster.workers)
    ids = tokenize(tiny_dir, PROMPT)
    req = wpb.WorkerRequest(room=4242, request_id="scored", token_ids=ids,
                            sampling=gpb.SamplingParams(max_new_tokens=2, prompt_logprobs=2))
    with grpc.insecure_channel(prefill) as pch, grpc.insecure_channel(decode) as dch:
        pstub = worker_pb2_grpc.PrefillWorkerStub(pch)
        load = pstub.GetLoad(wpb.GetLoadRequest(), timeout=5)
        assert load.scores_prompts
        stream = worker_pb2_grpc.DecodeWorkerStub(dch).Decode(
            wpb.DecodeRequest(request=req, prefill_bootstrap=load.bootstrap), timeout=60)
        resp = pstub.Prefill(wpb.PrefillRequest(request=req), timeout=60)
        msgs = list(stream)
    assert not any(m.prompt_logprobs for m in msgs)  # the decode never computed the prompt
    want = reference(oracle, ids)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(list(resp.prompt_logprobs)), want, atol=1e-4, rtol=0)
    assert [len(t.token_ids) for t in resp.prompt_top_logprobs] == [2] * (len(ids) - 1)
    assert_all_idle([prefill, decode])


def test_logit_bias_steers_the_output(cluster: Cluster) -> None:
    """OpenAI's ``logit_bias`` through the disaggregated door: -100 on the greedy first token
    (from the prefill) and on the next one (from the decode) takes the second choice each
    time, as the alternatives of an unbiased request say; the log-probabilities stay the
    model's; bad biases are 400s naming the field."""
    client = cluster.client
    free = client.completions.create(model="m", prompt=PROMPT, max_tokens=1, temperature=0,
                                     logprobs=2)
    top = free.choices[0].logprobs.top_logprobs[0]
    ids, _ = cluster.grpc_ids(PROMPT, 1)
    second = sorted(top.items(), key=lambda kv: -kv[1])[1]
    biased = client.completions.create(model="m", prompt=PROMPT, max_tokens=1, temperature=0,
                                       logprobs=0, logit_bias={str(ids[0]): -100})
    lp = biased.choices[0].logprobs
    assert (lp.tokens[0], lp.token_logprobs[0]) == (second[0], pytest.approx(second[1], abs=1e-5))
    got, _ = cluster.grpc_ids(PROMPT, 4, logit_bias={ids[0]: -100.0})
    plain, _ = cluster.grpc_ids(PROMPT, 4)
    assert got[0] != plain[0] and ids[0] not in got
    for bias, word in (({"5": 101}, "logit_bias of token 5"), ({"x": 1}, "'logit_bias' keys"),
                       ({"10000000": 1}, "outside the vocabulary"), ([1], "'logit_bias' must")):
        with pytest.raises(openai.BadRequestError, match=word):
            client.completions.create(model="m", prompt=PROMPT, max_tokens=1,
                                      logit_bias=bias)  # type: ignore[arg-type]
    assert_all_idle([w.address for w in cluster.workers])
