"""``pdserve launch`` on a local Ray cluster: serves over gRPC, answers like the colocated
engine, and Ctrl-C leaves no server, actor or Ray process behind. Its prefill runs in two
pipeline stages (``--prefill-pp-size 2``: the second started first, the draft on it), the whole
launch path otherwise being that of tests/deploy/test_launch_errors.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from engine.builtin.tiny_model import write_tiny_draft, write_tiny_model
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc

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


def test_launch_serves_and_shuts_down_cleanly(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "launch-model")
    write_tiny_draft(model / "draft")
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "launch", "--model", str(model),
                             "--port", "0", "--draft", "auto", "--num-draft-tokens", "2",
                             "--prefill-pp-size", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    try:
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
        assert address is not None, "".join(log)
        assert address.startswith("127.0.0.1:")  # single node: loopback only
        request = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, 2, 3, 4]),
                                      sampling=gpb.SamplingParams(max_new_tokens=12,
                                                                  ignore_eos=True))
        with grpc.insecure_channel(address) as ch:
            msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=60))
        got = [t for m in msgs for t in m.token_ids]
        engine = LLMEngine(model, EngineConfig(num_pages=64))
        [expected] = engine.generate([Prompt(token_ids=[1, 2, 3, 4])],
                                     SamplingParams(max_new_tokens=12, ignore_eos=True))
        assert got == expected.token_ids  # EAGLE on (the draft was passed on) changes nothing
        assert msgs[-1].usage.drafted_tokens > 0
        assert len(processes_matching("--pp-rank")) == 2  # one server per stage
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
