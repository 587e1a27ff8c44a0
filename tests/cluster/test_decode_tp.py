"""A decode worker with ``--tp-size 2`` (two processes, gloo) serving whole requests over real
gRPC: its streams equal the one-process engine's, no page stays held, and SIGTERM ends both
ranks' processes; a tp size that does not divide the heads is refused with one error line (EAGLE
with ``--tp-size``: tests/cluster/test_eagle_tp_cluster.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from tests.cluster.harness import ROOT, _env, running, stop_node
from tests.cluster.test_decode_colocated import decode_request

pytestmark = pytest.mark.slow


def rank_processes(pid: int) -> list[int]:
    """The process ids of ``pid``'s children that multiprocessing spawned (Linux)."""
    tasks = Path(f"/proc/{pid}/task")
    kids = [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def test_tp2_streams_equal_the_one_process_engine(tiny_dir: Path) -> None:
    prompts = [[1, 2, 3, 4, 5], list(range(10, 60))]
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=64))
    expected = engine.generate([Prompt(token_ids=p) for p in prompts],
                               SamplingParams(max_new_tokens=12, ignore_eos=True))
    args = ["decode", "--model", str(tiny_dir), "--port", "0", "--num-pages", "64",
            "--device", "cpu", "--tp-size", "2"]
    with running(args) as [d]:
        [rank1] = rank_processes(d.proc.pid)
        with grpc.insecure_channel(d.address) as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            futures = [stub.Decode(decode_request(i + 1, p, 12)) for i, p in enumerate(prompts)]
            for fut, exp in zip(futures, expected, strict=True):
                assert [t for m in fut for t in m.token_ids] == exp.token_ids
            load = stub.GetLoad(wpb.GetLoadRequest())
            assert load.kv_pages_used == 0 and load.running_requests == 0
        assert stop_node(d) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(rank1, 0)


def test_a_tp_size_the_heads_do_not_split_into_is_refused_with_one_error_line(
        tiny_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "decode", "--model", str(tiny_dir), "--port", "0",
         "--device", "cpu", "--tp-size", "3"], cwd=ROOT, env=_env(), capture_output=True,
        text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "tp size 3 must divide num_attention_heads (4)" in proc.stderr
    assert "Traceback" not in proc.stderr
