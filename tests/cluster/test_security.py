"""Security of the serving ports: TLS and a bearer token on the public API, a shared secret on
internal ports, open health and reflection, loopback binding by default.

The fast tests run :func:`serving.server.start_server` in-process; the slow one runs a real router
(TLS + bearer token + internal token) in front of a colocated decode node that requires the
internal token, and the ``pdserve client`` command against it.
"""

from __future__ import annotations

import asyncio
import datetime
import inspect
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cli.main import build_parser
from proto.pdserve.v1 import admin_pb2, admin_pb2_grpc, generate_pb2_grpc, worker_pb2_grpc
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import worker_pb2 as wpb
from serving.admin import SERVICE_NAME as ADMIN
from serving.auth import (
    ServerSecurity,
    TlsFiles,
    bearer,
    bearer_metadata,
    internal,
    internal_metadata,
)
from serving.server import start_server
from tests.cluster.harness import ROOT, Node, _env, start_node, stop_node
from tests.cluster.stats import assert_all_idle, get_stats

TOKEN = "s3cret-public-token"
SECRET = "internal-shared-secret"


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed EC certificate for ``localhost`` / ``127.0.0.1``: (cert.pem, key.pem)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _stats() -> dict[str, int]:
    return {"kv_pages_used": 3}


async def _serve(security: ServerSecurity) -> tuple[grpc.aio.Server, int]:
    server, port, _ = await start_server([], role="test", stats=_stats, security=security)
    return server, port


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# ---- tokens, in-process -----------------------------------------------------------------------


def test_bearer_token_guards_admin_but_not_health_or_reflection() -> None:
    async def main() -> None:
        server, port = await _serve(ServerSecurity(requirements=(bearer(TOKEN, [ADMIN]),)))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                admin = admin_pb2_grpc.AdminStub(ch)
                req = admin_pb2.GetStatsRequest()
                assert await _code(admin.GetStats(req)) == grpc.StatusCode.UNAUTHENTICATED
                wrong = bearer_metadata("not-it")
                assert await _code(admin.GetStats(req, metadata=wrong)) == \
                    grpc.StatusCode.UNAUTHENTICATED
                raw = (("authorization", TOKEN),)  # without the "Bearer " scheme
                assert await _code(admin.GetStats(req, metadata=raw)) == \
                    grpc.StatusCode.UNAUTHENTICATED
                stats = await admin.GetStats(req, metadata=bearer_metadata(TOKEN))
                assert (stats.role, stats.kv_pages_used) == ("test", 3)
                health = health_pb2_grpc.HealthStub(ch)
                reply = await health.Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                refl = reflection_pb2_grpc.ServerReflectionStub(ch)
                async for msg in refl.ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
                    names = {s.name for s in msg.list_services_response.service}
                    assert ADMIN in names
                    break
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_internal_token_is_its_own_header() -> None:
    async def main() -> None:
        server, port = await _serve(ServerSecurity(requirements=(internal(SECRET, [ADMIN]),)))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                admin = admin_pb2_grpc.AdminStub(ch)
                req = admin_pb2.GetStatsRequest()
                assert await _code(admin.GetStats(req, metadata=bearer_metadata(SECRET))) == \
                    grpc.StatusCode.UNAUTHENTICATED
                both = (*bearer_metadata(TOKEN), *internal_metadata(SECRET))
                assert (await admin.GetStats(req, metadata=both)).kv_pages_used == 3
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_tls_server_refuses_plaintext_and_serves_verified_clients(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)

    async def main() -> None:
        server, port = await _serve(ServerSecurity(tls=TlsFiles.read(cert, key)))
        try:
            creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as ch:
                stats = await admin_pb2_grpc.AdminStub(ch).GetStats(admin_pb2.GetStatsRequest(),
                                                                    timeout=10)
                assert stats.kv_pages_used == 3
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = admin_pb2_grpc.AdminStub(ch).GetStats(admin_pb2.GetStatsRequest(),
                                                             timeout=5)
                assert await _code(call) in (grpc.StatusCode.UNAVAILABLE,
                                             grpc.StatusCode.DEADLINE_EXCEEDED)
        finally:
            await server.stop(0)

    asyncio.run(main())


# ---- loopback by default ------------------------------------------------------------------------


def _non_loopback_ip() -> str | None:
    """This machine's address on its default route, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 1))
            ip = str(s.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_every_node_binds_loopback_by_default() -> None:
    parser = build_parser()
    for argv in (["router", "--colocated", "h:1"], ["prefill"], ["decode"]):
        assert parser.parse_args(argv).host == "127.0.0.1", argv
    assert inspect.signature(start_server).parameters["host"].default == "127.0.0.1"
    from transfer.bootstrap.prefill import PrefillBootstrapServer

    assert inspect.signature(PrefillBootstrapServer).parameters["host"].default == "127.0.0.1"

    async def main() -> None:
        server, port = await _serve(ServerSecurity())
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                pass
            ip = _non_loopback_ip()
            if ip is not None:  # the port is not reachable on the machine's other address
                with pytest.raises(OSError):
                    socket.create_connection((ip, port), timeout=2).close()
        finally:
            await server.stop(0)

    asyncio.run(main())


# ---- a real cluster --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[Node, Node, Path, Path]]:
    """(router, decode, cert, token file): the router over TLS with a bearer token, the decode
    requiring the internal token from it."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(d)
    token, secret = d / "token", d / "internal"
    token.write_text(TOKEN + "\n")
    secret.write_text(SECRET)
    decode = start_node(["decode", "--model", str(tiny_dir), "--port", "0", "--num-pages", "128",
                         "--internal-token-file", str(secret)])
    try:
        router = start_node(["router", "--model", str(tiny_dir), "--port", "0",
                             "--colocated", decode.address, "--tls-cert", str(cert),
                             "--tls-key", str(key), "--auth-token-file", str(token),
                             "--internal-token-file", str(secret), "--http-port", "0"])
        try:
            yield router, decode, cert, token
        finally:
            stop_node(router)
    finally:
        stop_node(decode)


@pytest.mark.slow
def test_secured_cluster_end_to_end(secured: tuple[Node, Node, Path, Path]) -> None:
    router, decode, cert, token = secured
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[5, 6, 7, 8]),
                              sampling=gpb.SamplingParams(max_new_tokens=6, ignore_eos=True))
    with grpc.secure_channel(router.address, creds) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30,
                              metadata=bearer_metadata("wrong"))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        msgs = list(stub.Generate(req, timeout=60, metadata=bearer_metadata(TOKEN)))
        assert sum(len(m.token_ids) for m in msgs) == 6 and msgs[-1].finished
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    # the internal port refuses callers without the shared secret (health stays open)
    with grpc.insecure_channel(decode.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.DecodeWorkerStub(ch).GetLoad(wpb.GetLoadRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        load = worker_pb2_grpc.DecodeWorkerStub(ch).GetLoad(
            wpb.GetLoadRequest(), timeout=10, metadata=internal_metadata(SECRET))
        assert load.kv_pages_total == 128
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        get_stats(router.address, root_cert=cert.read_bytes())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    both = (*bearer_metadata(TOKEN), *internal_metadata(SECRET))
    assert_all_idle([router.address], metadata=both, root_cert=cert.read_bytes())
    assert_all_idle([decode.address], metadata=both)


@pytest.mark.slow
def test_client_command_with_tls_and_token(secured: tuple[Node, Node, Path, Path]) -> None:
    router, _, cert, token = secured
    base = [sys.executable, "-m", "cli.main", "client", "--target", router.address,
            "--token-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos", "--json",
            "--timeout", "60", "--tls-ca", str(cert)]
    run = subprocess.run([*base, "--auth-token-file", str(token)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert '"finish_reason": "length"' in run.stdout
    run = subprocess.run(base, cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 2 and "UNAUTHENTICATED" in run.stderr, run.stderr


@pytest.mark.slow
def test_http_door_serves_https_and_requires_the_bearer_token(
        secured: tuple[Node, Node, Path, Path]) -> None:
    router, decode, cert, _ = secured
    [port] = [int(line.split()[1]) for line in router.log if line.startswith("HTTP ")]
    base = f"https://127.0.0.1:{port}"
    ctx = ssl.create_default_context(cafile=str(cert))
    body = json.dumps({"model": "m", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0,
                       "ignore_eos": True}).encode()

    def post(headers: dict[str, str], path: str = "/v1/completions",
             data: bytes = body) -> tuple[int, dict[str, object]]:
        req = urllib.request.Request(f"{base}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        status, answer = post(headers)
        assert status == 401, (headers, answer)
        assert answer["error"]["type"] == "authentication_error"  # type: ignore[index]
    status, answer = post({"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, answer
    tokenize = json.dumps({"prompt": "a"}).encode()
    assert post({}, "/tokenize", tokenize)[0] == 401  # the tokenizer's endpoints too
    assert post({"Authorization": f"Bearer {TOKEN}"}, "/tokenize", tokenize)[0] == 200
    assert answer["usage"]["completion_tokens"] == 3  # type: ignore[index]
    with urllib.request.urlopen(f"{base}/health", context=ctx, timeout=10) as resp:
        assert resp.status == 200  # open, like gRPC health
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # no plaintext HTTP
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
    both = (*bearer_metadata(TOKEN), *internal_metadata(SECRET))
    assert_all_idle([router.address], metadata=both, root_cert=cert.read_bytes())
    assert_all_idle([decode.address], metadata=both)
