"""Bad input on the wire, end to end: every case gets a clear status, the node keeps serving and
every node ends empty (the leak check).

Covered here (the rest is in ``test_router.py``, ``test_validator_fuzz.py``,
``tests/engine/test_bad_inputs.py`` and the transfer tests): bytes that are not a protobuf sent
raw to the public and internal methods, unknown protobuf fields, a prompt beyond the model's
context, absurd sampling values as they arrive on the wire, messages over the size limit on
every node's gRPC port and on the HTTP door, and a decode that registers with a prefill's KV
bootstrap endpoint without the cluster's internal secret.

The cluster (1P1D, with the HTTP door) runs with ``--internal-token-file`` everywhere; a second
router pairs the same prefill with a decode that was given no secret.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from router.http_door import MAX_BODY_BYTES
from serving.auth import internal_metadata
from serving.server import MAX_MESSAGE_BYTES
from tests.cluster.harness import Node
from tests.cluster.stats import assert_all_idle
from tests.cluster.test_cluster import start_all, stop_all

pytestmark = pytest.mark.slow
SECRET = "internal-secret-for-bad-input"
META = internal_metadata(SECRET)
CONTEXT = 4096  # the tiny model's max_model_len
GOOD = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[5, 6, 7, 8]),
                           sampling=gpb.SamplingParams(max_new_tokens=6, ignore_eos=True))


@dataclass
class Cluster:
    prefill: Node
    decode: Node
    router: Node
    rogue_decode: Node  # no --internal-token-file
    rogue_router: Node  # the prefill above + the rogue decode
    http_port: int

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in (self.prefill, self.decode, self.router, self.rogue_decode,
                                    self.rogue_router)]

    def assert_idle_and_serving(self) -> None:
        """A good request is served (same tokens as before) and every node is empty."""
        with grpc.insecure_channel(self.router.address) as ch:
            msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(GOOD, timeout=60))
        assert msgs[-1].finished and sum(len(m.token_ids) for m in msgs) == 6
        assert_all_idle(self.addresses, metadata=META)


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    secret = tmp_path_factory.mktemp("secret") / "internal"
    secret.write_text(SECRET + "\n")
    token = ["--internal-token-file", str(secret)]
    model = ["--model", str(tiny_dir), "--port", "0", "--page-size", "8", "--num-pages", "700"]
    workers = start_all([["prefill", *model, *token], ["decode", *model, *token],
                         ["decode", *model]])
    routers: list[Node] = []
    try:
        p, d, rogue = workers
        base = ["router", "--model", str(tiny_dir), "--port", "0", *token]
        routers = start_all([[*base, "--prefill", p.address, "--decode", d.address,
                              "--http-port", "0"],
                             [*base, "--prefill", p.address, "--decode", rogue.address]])
        [http] = [int(line.split()[1]) for line in routers[0].log if line.startswith("HTTP ")]
        yield Cluster(p, d, routers[0], rogue, routers[1], http)
    finally:
        stop_all(routers)
        stop_all(workers)


def raw_call(address: str, method: str, body: bytes, *, streaming: bool) -> grpc.RpcError:
    """Send ``body`` as is to ``method``; returns the error the call must end with."""
    with grpc.insecure_channel(address) as ch:
        if streaming:
            call = ch.unary_stream(method)  # no serializers: bytes in, bytes out
            with pytest.raises(grpc.RpcError) as err:
                list(call(body, timeout=30, metadata=META))
        else:
            with pytest.raises(grpc.RpcError) as err:
                ch.unary_unary(method)(body, timeout=30, metadata=META)
    return err.value


NOT_PROTOBUF = [b"\xff\xff\xff\xff", b"\x0a\xff\x01", b"\x12\x05abc", b"\x08" + b"\x80" * 11]


def test_bytes_that_are_not_a_protobuf(cluster: Cluster) -> None:
    """Refused before any servicer runs, on the router and on both kinds of worker, as the
    caller's error (INVALID_ARGUMENT naming the method and the parser's reason)."""
    targets = [(cluster.router, "/pdserve.v1.Generation/Generate", True),
               (cluster.prefill, "/pdserve.v1.PrefillWorker/Prefill", False),
               (cluster.decode, "/pdserve.v1.DecodeWorker/Decode", True)]
    for node, method, streaming in targets:
        for body in NOT_PROTOBUF:
            err = raw_call(node.address, method, body, streaming=streaming)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, body, err)
            assert f"{method}: malformed request" in (err.details() or ""), err.details()
    cluster.assert_idle_and_serving()


def test_unknown_fields_are_ignored(cluster: Cluster) -> None:
    """Fields this version does not know (a newer client) are skipped: same answer."""
    unknown = (b"\xf8\x06\x2a"  # field 111, varint 42
               b"\x82\x07\x03abc"  # field 112, 3 bytes
               b"\x8d\x07\x00\x00\x80\x3f")  # field 113, fixed32
    sampling = GOOD.sampling.SerializeToString() + unknown
    body = GOOD.SerializeToString() + unknown + b"\x2a" + bytes([len(sampling)]) + sampling
    with grpc.insecure_channel(cluster.router.address) as ch:
        want = [t for m in generate_pb2_grpc.GenerationStub(ch).Generate(GOOD, timeout=60)
                for t in m.token_ids]
        call = ch.unary_stream("/pdserve.v1.Generation/Generate",
                               response_deserializer=gpb.GenerateResponse.FromString)
        got = [t for m in call(body, timeout=60) for t in m.token_ids]
    assert got == want and len(got) == 6
    cluster.assert_idle_and_serving()


def _bad_values() -> list[tuple[str, gpb.GenerateRequest]]:
    ids = gpb.TokenIds(ids=[1, 2, 3])

    def sampling(**kw: object) -> gpb.GenerateRequest:
        return gpb.GenerateRequest(token_ids=ids, sampling=gpb.SamplingParams(**kw))

    return [
        ("prompt beyond the context", gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=[1] * (CONTEXT + 1)))),
        ("huge prompt", gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[2] * 100_000))),
        ("huge text", gpb.GenerateRequest(text="word " * 50_000)),
        ("temperature inf", sampling(temperature=math.inf)),
        ("temperature -inf", sampling(temperature=-math.inf)),
        ("temperature 1e30", sampling(temperature=1e30)),
        ("top_p nan", sampling(top_p=math.nan)),
        ("top_p inf", sampling(top_p=math.inf)),
        ("max_new_tokens 2^32-1", sampling(max_new_tokens=2**32 - 1)),
        ("seed 2^64-1", sampling(seed=2**64 - 1)),
        ("stop id 2^32-1", sampling(stop_token_ids=[2**32 - 1])),
    ]


def test_absurd_values_are_invalid_argument(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        for name, req in _bad_values():
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, timeout=60))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.value)
            assert err.value.details(), name
    cluster.assert_idle_and_serving()


def test_top_k_beyond_the_vocabulary_is_no_filter(cluster: Cluster) -> None:
    """``top_k`` is unsigned on the wire (a negative value arrives as 2^32-1): at or above the
    vocabulary it filters nothing, so greedy output is unchanged."""
    req = gpb.GenerateRequest()
    req.CopyFrom(GOOD)
    req.sampling.top_k = 2**32 - 1
    with grpc.insecure_channel(cluster.router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        want = [t for m in stub.Generate(GOOD, timeout=60) for t in m.token_ids]
        assert [t for m in stub.Generate(req, timeout=60) for t in m.token_ids] == want
    cluster.assert_idle_and_serving()


def test_messages_over_the_limit_on_every_grpc_port(cluster: Cluster) -> None:
    """64 MiB per message on every server: a bigger one is RESOURCE_EXHAUSTED, before any
    servicer (or token check) sees it."""
    big = b"\x0a" + b"\x80\x80\x80\x20" + b"x" * (MAX_MESSAGE_BYTES + 1)  # field 1, 64 MiB+1
    for node in (cluster.router, cluster.prefill, cluster.decode):
        err = raw_call(node.address, "/pdserve.v1.Admin/GetStats", big, streaming=False)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (node.address, err)
        assert "larger than max" in (err.details() or ""), err.details()
    req = gpb.GenerateRequest(text="x", images=[gpb.Image(encoded=b"\0" * MAX_MESSAGE_BYTES)])
    with grpc.insecure_channel(cluster.router.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(generate_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    cluster.assert_idle_and_serving()


def test_http_body_over_the_limit_is_413(cluster: Cluster) -> None:
    url = f"http://127.0.0.1:{cluster.http_port}/v1/completions"
    body = json.dumps({"model": "m", "prompt": "x" * (MAX_BODY_BYTES + 1)}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 413
    ok = urllib.request.Request(url, data=json.dumps(
        {"model": "m", "prompt": "hello", "max_tokens": 3}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(ok, timeout=60) as resp:
        assert json.loads(resp.read())["choices"][0]["finish_reason"] in ("length", "stop")
    cluster.assert_idle_and_serving()


def test_decode_without_the_internal_secret_is_refused_by_the_bootstrap(
    cluster: Cluster,
) -> None:
    """The rogue decode accepts the router's calls (it checks no token) but the prefill's KV
    bootstrap endpoint refuses its registration: the request fails with a clear status, both
    workers drop the room, and the cluster with the secret keeps serving."""
    with grpc.insecure_channel(cluster.rogue_router.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(generate_pb2_grpc.GenerationStub(ch).Generate(GOOD, timeout=60))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
    assert "missing or wrong internal token" in (err.value.details() or ""), err.value
    assert SECRET not in (err.value.details() or "")
    cluster.assert_idle_and_serving()
