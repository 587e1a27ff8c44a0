"""``pdserve launch`` on a local Ray cluster: serves over gRPC, answers like the colocated
engine, and Ctrl-C leaves no server, actor or Ray process behind. Its prefill runs in two
pipeline stages (``--prefill-pp-size 2``: the second started first, the draft on it), the whole
launch path otherwise being that of tests/deploy/test_launch_errors.py. The hybrid built-in
(``--model builtin:hybrid --draft mtp``) serves the same way, its MTP head drafting. With
``--http-port 0`` the launch prints the router's OpenAI URL, which the ``openai`` SDK uses: the
model list, and streamed completions and chat completions equal to the whole answers;
lm-evaluation-harness and AIPerf then run against the same launched cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch

from engine.builtin import builtin_hybrid_model_dir, builtin_model_dir
from engine.builtin.tiny_model import write_tiny_draft, write_tiny_model
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.text.tokenizer import Tokenizer
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from tests.cluster.stats import assert_all_idle, get_stats
from tests.deploy import aiperf_run, lm_eval_run

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def processes_matching(text: str) -> list[str]:
    """Command lines of live processes that contain ``text``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd:
            found.append(cmd)
    return found


def start_launch(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """``pdserve launch --port 0 ARGS`` in a subprocess, and its router's address once READY."""
    proc, address, _ = start_launch_logged(tmp_path, *args)
    return proc, address


def start_launch_logged(tmp_path: Path, *args: str
                        ) -> tuple[subprocess.Popen[str], str, list[str]]:
    """:func:`start_launch`, with the launch's output lines up to READY."""
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "launch", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    address = None
    deadline = time.monotonic() + 300  # a loaded 2-core machine starts Ray slowly
    log = []
    while time.monotonic() < deadline and address is None:
        line = proc.stdout.readline()
        if not line:
            break
        log.append(line)
        if line.startswith("READY "):
            address = line.split()[1]
    if address is None:
        proc.kill()
        proc.wait()
        raise AssertionError("".join(log))
    assert address.startswith("127.0.0.1:")  # single node: loopback only
    return proc, address, log


def stream(address: str, ids: list[int], new_tokens: int) -> list[gpb.GenerateResponse]:
    request = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids),
                                  sampling=gpb.SamplingParams(max_new_tokens=new_tokens,
                                                              ignore_eos=True))
    with grpc.insecure_channel(address) as ch:
        return list(generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=60))


def stop_launch(proc: subprocess.Popen[str], model: Path) -> None:
    """Ctrl-C: the launch says it stopped, exits 0, and leaves no server of ``model`` and no
    Ray process behind."""
    try:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out
        assert "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = processes_matching(str(model)) + processes_matching("raylet")
        if not left:
            break
        time.sleep(0.5)
    assert not left, left


def test_launch_serves_and_shuts_down_cleanly(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "launch-model")
    write_tiny_draft(model / "draft")
    proc, address = start_launch(tmp_path, "--model", str(model), "--draft", "auto",
                                 "--num-draft-tokens", "2", "--prefill-pp-size", "2")
    try:
        msgs = stream(address, [1, 2, 3, 4], 12)
        got = [t for m in msgs for t in m.token_ids]
        engine = LLMEngine(model, EngineConfig(num_pages=64))
        [expected] = engine.generate([Prompt(token_ids=[1, 2, 3, 4])],
                                     SamplingParams(max_new_tokens=12, ignore_eos=True))
        assert got == expected.token_ids  # EAGLE on (the draft was passed on) changes nothing
        assert msgs[-1].usage.drafted_tokens > 0
        assert len(processes_matching("--pp-rank")) == 2  # one server per stage
    finally:
        stop_launch(proc, model)


def test_launch_serves_the_hybrid_builtin_with_its_mtp_head(tmp_path: Path) -> None:
    """``pdserve launch --model builtin:hybrid --draft mtp``: the workers get the shipped
    Qwen3.5-shaped sibling, its trained MTP head drafts and is accepted, and the stream is plain
    decoding's."""
    model = builtin_hybrid_model_dir()
    tok = Tokenizer.from_dir(model)
    assert tok is not None
    ids = tok.encode("def fibonacci(n):\n")
    proc, address = start_launch(tmp_path, "--model", "builtin:hybrid", "--draft", "mtp",
                                 "--num-draft-tokens", "3")
    try:
        msgs = stream(address, ids, 24)
        got = [t for m in msgs for t in m.token_ids]
        [expected] = LLMEngine(model, EngineConfig(num_pages=64)).generate(
            [Prompt(token_ids=ids)], SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert got == expected.token_ids
        usage = msgs[-1].usage
        assert 0 < usage.accepted_tokens <= usage.drafted_tokens, usage
    finally:
        stop_launch(proc, model)


@dataclass(frozen=True)
class OpenAILaunch:
    url: str  # the door's OpenAI base URL, from the launch's ``openai:`` line
    router: str  # the router's gRPC address, from its READY line
    workers: list[str]  # the prefill and decode servers' addresses


@pytest.fixture(scope="module")
def openai_launch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAILaunch]:
    """``pdserve launch --model builtin --http-port 0 --served-model-name tiny-chat``, shared by
    the module's last tests (it runs until the module ends: no launch may come after them); Ctrl-C
    then leaves nothing running."""
    tmp_path = tmp_path_factory.mktemp("openai-launch")
    proc, router, log = start_launch_logged(tmp_path, "--model", "builtin", "--http-port", "0",
                                            "--served-model-name", "tiny-chat")
    try:
        [url] = [ln.split()[1] for ln in log if ln.startswith("openai: ")]
        yield OpenAILaunch(url, router, router_workers(tmp_path / "cache"))
    finally:
        stop_launch(proc, builtin_model_dir())


def router_workers(cache: Path) -> list[str]:
    """The server addresses a launch gave its router (``--prefill A --decode B``), read from the
    command line of the router process that has the launch's ``PDSERVE_CACHE`` (``cache``: the
    launch's own Ray head passes it on)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if cmd[1:4] == ["-m", "cli.main", "router"] and f"PDSERVE_CACHE={cache}" in env:
            return [a for flag in ("--prefill", "--decode")
                    for a in cmd[cmd.index(flag) + 1].split(",")]
    raise AssertionError(f"no router process has PDSERVE_CACHE={cache}")


def test_launch_serves_the_openai_api_on_its_http_port(openai_launch: OpenAILaunch,
                                                       tmp_path: Path) -> None:
    """``pdserve launch --http-port 0 --served-model-name NAME`` on the built-in tiny model: the
    ``openai:`` line names the router's HTTP door, the SDK lists NAME there once the workers are
    ready, and a streamed completion and a streamed chat completion at temperature 0 each add up
    to the whole answer; a JSON-schema reply and a named tool call validate against their
    schema; lm-evaluation-harness runs its two task kinds."""
    url = openai_launch.url
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1"), url
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    assert [m.id for m in ready_models(client)] == ["tiny-chat"]
    kw: dict[str, Any] = {"model": "tiny-chat", "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(prompt="def add(a, b):", **kw).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(
        prompt="def add(a, b):", stream=True, **kw) if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == whole and whole
    messages: Any = [{"role": "user", "content": "say hello"}]
    answer = client.chat.completions.create(messages=messages, **kw)
    whole = answer.choices[0].message.content or ""
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=messages, stream=True, **kw) if c.choices]
    assert "".join(pieces) == whole and whole
    check_structured_and_tools(client, messages)
    check_lm_eval(client, url, tmp_path)


def check_structured_and_tools(client: openai.OpenAI, messages: Any) -> None:  # noqa: ANN401
    """``response_format`` with a JSON schema, and a named tool, through the SDK."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    kw: dict[str, Any] = {"model": "tiny-chat", "max_tokens": 256, "temperature": 0,
                          "messages": messages}
    reply = client.chat.completions.create(
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        **kw)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)
    tools: Any = [{"type": "function", "function": {"name": "pick", "parameters": schema}}]
    called = client.chat.completions.create(
        tools=tools, tool_choice={"type": "function", "function": {"name": "pick"}}, **kw)
    [call] = called.choices[0].message.tool_calls or []
    assert call.function.name == "pick"
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.skipif(not aiperf_run.AIPERF.exists() and not os.environ.get("CI"),
                    reason="AIPerf is not installed (scripts/test.sh installs it into "
                           ".venv/aiperf)")
def test_aiperf_loads_the_openai_door(openai_launch: OpenAILaunch, tmp_path: Path) -> None:
    """AIPerf, a load generator of the ecosystem, through the door as a user runs it: 24 streamed
    chat completions, 4 at a time, of 16-token prompts asking for 8 tokens with ``ignore_eos``.
    Its exports show every request completed without error with exactly 8 output tokens, and a
    TTFT and an ITL for each; the router admitted exactly those 24, and afterwards no node holds
    a page, slot, room or request."""
    client = openai.OpenAI(base_url=openai_launch.url, api_key="x", max_retries=0, timeout=60)
    ready_models(client)
    admitted = get_stats(openai_launch.router).requests_total
    result = aiperf_run.profile(openai_launch.url.removesuffix("/v1"), "tiny-chat",
                                builtin_model_dir(), tmp_path / "aiperf", requests=24,
                                concurrency=4, input_tokens=16, output_tokens=8)
    summary = result.summary
    assert summary["error_summary"] == [] and not summary["was_cancelled"], summary
    assert summary["completed_request_count"]["avg"] == 24, summary["completed_request_count"]
    assert summary["request_error_rate"]["avg"] == 0
    for name in ("time_to_first_token", "inter_token_latency"):
        assert summary[name]["unit"] == "ms" and summary[name]["count"] == 24, summary[name]
    assert len(result.records) == 24
    for record in result.records:
        metrics = record["metrics"]
        assert record.get("error") is None, record
        assert metrics["output_sequence_length"]["value"] == 8, metrics
        assert metrics["usage_completion_tokens"]["value"] == 8, metrics
        assert metrics["time_to_first_token"]["value"] > 0, metrics
        assert metrics["inter_token_latency"]["value"] > 0, metrics
    assert get_stats(openai_launch.router).requests_total - admitted == 24
    assert_all_idle([openai_launch.router, *openai_launch.workers])


def check_lm_eval(client: openai.OpenAI, url: str, tmp_path: Path) -> None:
    """lm-evaluation-harness's two task kinds through the door: the generation task's targets
    are the model's own greedy answers (exact match 1), and every multiple-choice
    log-likelihood and its greedy flag equal transformers' over lm-eval's own tokenization."""
    questions = ["def add(a, b):", "import os", "for i in range(10):"]
    greedy = [client.completions.create(model="tiny-chat", prompt=q, max_tokens=6, temperature=0,
                                        stop=["\n\n"]).choices[0].text for q in questions]
    mc = [{"question": q, "choices": [g, " pass", "\nfoo bar"], "answer": 0}
          for q, g in zip(questions, greedy, strict=True)]
    gen = [{"question": q, "answer": g} for q, g in zip(questions, greedy, strict=True)]
    tasks = lm_eval_run.write_tasks(tmp_path / "tasks", mc, gen, max_tokens=6)
    samples = lm_eval_run.run(url, "tiny-chat", tasks, tmp_path / "lm-eval")
    assert [s["exact_match"] for s in samples["pdserve_gen"]] == [1.0] * len(questions)
    # imported here: transformers imports Triton, which must not happen before the Triton
    # tests set TRITON_INTERPRET (tests/engine/attention/test_attention_triton.py)
    from transformers import Qwen2VLForConditionalGeneration

    oracle = Qwen2VLForConditionalGeneration.from_pretrained(builtin_model_dir()).eval()
    tok = Tokenizer.from_dir(builtin_model_dir())
    assert tok is not None
    pairs = [(args["arg_0"], args["arg_1"], resp[0])
             for s in samples["pdserve_mc"]
             for args, resp in zip(s["arguments"].values(), s["resps"], strict=True)]
    assert len(pairs) == 3 * len(questions)
    for context, continuation, (loglikelihood, is_greedy) in pairs:
        want, want_greedy = reference_loglikelihood(oracle, tok, context, continuation)
        assert float(loglikelihood) == pytest.approx(want, abs=1e-3), (context, continuation)
        assert (is_greedy == "True") == want_greedy, (context, continuation)


def reference_loglikelihood(oracle: Any, tok: Tokenizer, context: str,  # noqa: ANN401
                            continuation: str) -> tuple[float, bool]:
    """transformers' log-likelihood of ``continuation`` after ``context``, and whether it is the
    greedy one, over the tokens lm-eval sends (its pair encoding: trailing spaces of the context
    move to the continuation, which is the whole's tokens after the context's)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    ctx = tok.encode(context)
    ids = tok.encode(context + continuation)
    with torch.no_grad():
        logits = oracle(input_ids=torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    rows = range(len(ctx), len(ids))
    total = sum(logprobs[p - 1, ids[p]].item() for p in rows)
    return total, all(int(logits[p - 1].argmax()) == ids[p] for p in rows)


def ready_models(client: openai.OpenAI, timeout_s: float = 60) -> list[Any]:
    """The door's model list, once its router has a ready worker pair (503 before)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return list(client.models.list().data)
        except openai.InternalServerError as exc:
            assert exc.status_code == 503 and time.monotonic() < deadline, exc
            time.sleep(0.2)
