"""``pdserve launch`` fails cleanly: a failed or interrupted launch leaves no actor, server or Ray
head it started; a Ray cluster already running here is reused; clusters with different
``--name``s run side by side, and a name already running is a one-line error; every failure is
one ``error:`` line on stderr. A detached launch with ``--http-port`` records its OpenAI URL,
which ``status`` shows.

The Ray tests after the first share one Ray head: the one the first detached launch (cluster
``a``) starts, which cluster ``b`` then reuses; the last test stops ``a`` (the head stays, ``b``
still runs on it) and then ``b``, the last pdserve cluster on it, which stops the head too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine.builtin.tiny_model import write_tiny_model
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from tests.deploy.test_launch import processes_matching

ROOT = Path(__file__).resolve().parents[2]
RAY_PROCESSES = ("raylet", "gcs_server")


def pdserve(cache: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                          text=True, env=_env(cache), cwd=ROOT, timeout=timeout, check=False)


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "PDSERVE_CACHE": str(cache), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT)}


def one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    """The single ``error:`` line of a failed command, checked to name every one of ``words``."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def wait_gone(*texts: str, timeout_s: float = 30) -> list[str]:
    """Wait until no process command line contains any of ``texts``; those still left."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for t in texts for p in processes_matching(t)]) and \
            time.monotonic() < deadline:
        time.sleep(0.3)
    return left


def generate(address: str) -> int:
    request = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[5, 6]),
                                  sampling=gpb.SamplingParams(max_new_tokens=3, ignore_eos=True))
    with grpc.insecure_channel(address) as ch:
        msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=60))
    return sum(len(m.token_ids) for m in msgs)


def ready_address(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return next(ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("READY "))


# ------------------------------------------------------------------ without Ray


def test_a_bad_name_is_a_one_line_error(tmp_path: Path) -> None:
    for command in ("launch", "status", "stop"):
        one_line_error(pdserve(tmp_path, command, "--name", "a/b"), "--name 'a/b'")


def test_a_usage_error_is_one_line(tmp_path: Path) -> None:
    proc = pdserve(tmp_path, "launch", "--prefill", "two")
    assert proc.returncode == 2
    one_line_error(proc, "pdserve launch: argument --prefill", "'two'")


def test_status_and_stop_without_ray_say_the_cluster_is_not_running(tmp_path: Path) -> None:
    """Before, the answer was Ray's own error naming only its ``--address`` flag."""
    no_ray_here()
    for command in ("status", "stop"):
        proc = pdserve(tmp_path, command, "--name", "nope")
        assert proc.returncode == 1
        one_line_error(proc, "no pdserve cluster named 'nope' is running (no Ray cluster runs "
                             "here)")


def test_a_ray_address_nothing_listens_on_fails_at_once(tmp_path: Path) -> None:
    """``launch --address``, and ``status``/``stop`` of a detached cluster whose recorded Ray
    cluster is gone: one line within seconds (Ray itself retried for minutes: a ``stop`` took
    over 2 minutes)."""
    dead = "127.0.0.1:1"
    (tmp_path / "launch-gone.json").write_text(f'{{"router": "127.0.0.1:2", "ray": "{dead}"}}')
    start = time.monotonic()
    for command in ("status", "stop"):
        one_line_error(pdserve(tmp_path, command, "--name", "gone", timeout=60),
                       "no pdserve cluster named 'gone' is running",
                       f"no Ray cluster answers at {dead}")
    proc = pdserve(tmp_path, "launch", "--address", dead, "--name", "x", timeout=60)
    assert proc.returncode == 2
    one_line_error(proc, f"no Ray cluster answers at {dead}")
    assert time.monotonic() - start < 45


# ------------------------------------------------------------------ on a real local Ray


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("launch-errors") / "model")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("launch-errors-cache")


def no_ray_here() -> None:
    if any(processes_matching(p) for p in RAY_PROCESSES):
        pytest.skip("a Ray cluster already runs on this machine")


@pytest.mark.slow
def test_a_failed_detached_launch_stops_the_head_it_started(model: Path, cache: Path) -> None:
    no_ray_here()
    proc = pdserve(cache, "launch", "--detach", "--name", "broken", "--model", str(model),
                   "--port", "0", "--worker-args=--no-such-flag")
    one_line_error(proc, "broken/", "did not start", "--no-such-flag")
    assert not wait_gone(*RAY_PROCESSES, str(model))
    assert not (cache / "ray-head.json").exists()


@pytest.fixture(scope="module")
def clusters(model: Path, cache: Path) -> Iterator[dict[str, str]]:
    """Clusters ``a`` (whose detached launch starts the Ray head) and ``b`` (which reuses it,
    with an HTTP door on a free port): each name's router address. ``ray stop`` after the module
    ends whatever is left."""
    no_ray_here()
    try:
        a = pdserve(cache, "launch", "--detach", "--name", "a", "--model", str(model),
                    "--port", "0")
        assert "using the Ray cluster at" not in a.stdout  # none ran: it started one
        b = pdserve(cache, "launch", "--detach", "--name", "b", "--model", str(model),
                    "--port", "0", "--http-port", "0")
        assert "using the Ray cluster at" in b.stdout, b.stdout  # the running head: reused
        yield {"a": ready_address(a), "b": ready_address(b)}
    finally:
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop"], capture_output=True,
                       check=False)


@pytest.mark.slow
def test_two_named_clusters_run_side_by_side(clusters: dict[str, str], cache: Path,
                                             model: Path) -> None:
    assert clusters["a"] != clusters["b"]
    assert generate(clusters["a"]) == 3 and generate(clusters["b"]) == 3
    status = pdserve(cache, "status", "--name", "b")
    assert status.returncode == 0 and "servers alive: 3/3" in status.stdout, status
    assert clusters["b"] in status.stdout
    # b's HTTP door: recorded by its detached launch, shown by status, and serving
    url = json.loads((cache / "launch-b.json").read_text())["openai"]
    assert f"openai: {url}\n" in status.stdout, status.stdout
    with urllib.request.urlopen(f"{url.removesuffix('/v1')}/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok"}
    a_status = pdserve(cache, "status", "--name", "a").stdout
    assert "openai:" not in a_status and json.loads(
        (cache / "launch-a.json").read_text())["openai"] is None  # no --http-port, no door
    one_line_error(pdserve(cache, "launch", "--detach", "--name", "a", "--model", str(model),
                           "--port", "0"), "named 'a' is already running")
    one_line_error(pdserve(cache, "status", "--name", "zz"), "'zz'", "running: a, b")


@pytest.mark.slow
def test_a_failed_launch_on_a_running_ray_leaves_it_and_its_clusters(
        clusters: dict[str, str], model: Path, cache: Path) -> None:
    proc = pdserve(cache, "launch", "--name", "c", "--model", str(model), "--port", "0",
                   "--worker-args=--no-such-flag")
    one_line_error(proc, "c/", "did not start", "--no-such-flag")
    assert processes_matching("raylet")  # not this launch's head: it stays
    assert generate(clusters["a"]) == 3


@pytest.mark.slow
def test_an_interrupted_start_up_leaves_no_server(clusters: dict[str, str], model: Path,
                                                 cache: Path, tmp_path: Path) -> None:
    """Ctrl-C and SIGTERM while the servers start (two launches at once, d-2 and d-15)."""
    procs = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        path = tmp_path / f"d-{sig}"  # the same model under another path tells d's apart
        path.symlink_to(model)
        procs[sig, path] = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "launch", "--name", f"d-{int(sig)}", "--model",
             str(path), "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=_env(cache), cwd=ROOT)
    try:
        for (sig, path), proc in procs.items():
            deadline = time.monotonic() + 60
            while not processes_matching(f"decode --model {path}") and \
                    proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            proc.send_signal(sig)  # its servers are starting: none serves yet
        errors = [proc.communicate(timeout=60)[1] for proc in procs.values()]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for proc, err in zip(procs.values(), errors, strict=True):
        assert proc.returncode == 130 and err.strip() == "error: interrupted", err
    assert not wait_gone(*(str(path) for _, path in procs))
    assert "d-" not in pdserve(cache, "status", "--name", "zz").stderr  # no actor of d left


@pytest.mark.slow
def test_stop_by_name_and_the_last_stop_stops_the_head(clusters: dict[str, str], cache: Path,
                                                      model: Path) -> None:
    stopped = pdserve(cache, "stop", "--name", "a")
    assert stopped.returncode == 0 and "stopped the pdserve cluster 'a'" in stopped.stdout
    one_line_error(pdserve(cache, "stop", "--name", "a"), "no pdserve cluster named 'a'",
                   "(running: b)")
    assert processes_matching("raylet")  # b still runs on the head a's launch started
    assert generate(clusters["b"]) == 3
    stopped = pdserve(cache, "stop", "--name", "b")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not wait_gone(*RAY_PROCESSES, str(model))  # the last cluster: its head went too
    assert not (cache / "ray-head.json").exists()
