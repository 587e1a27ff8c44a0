"""The committed generated gRPC modules are exactly what proto/generate.sh produces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ["generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py",
             "worker_pb2.py", "worker_pb2.pyi", "worker_pb2_grpc.py",
             "admin_pb2.py", "admin_pb2.pyi", "admin_pb2_grpc.py"]


def test_generated_modules_are_current(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(["bash", str(ROOT / "proto" / "generate.sh"), str(tmp_path)], check=True,
                   env=env)
    for name in GENERATED:
        fresh = (tmp_path / "pdserve" / "v1" / name).read_text()
        committed = (ROOT / "proto" / "pdserve" / "v1" / name).read_text()
        assert fresh == committed, f"proto/pdserve/v1/{name} is stale: run bash proto/generate.sh"


def test_generated_modules_import() -> None:
    from proto.pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

    req = worker_pb2.DecodeRequest(request=worker_pb2.WorkerRequest(room=2**63 - 1))
    assert worker_pb2.DecodeRequest.FromString(req.SerializeToString()).request.room == 2**63 - 1
    assert generate_pb2.GenerateRequest(text="hi").WhichOneof("input") == "text"
    assert hasattr(worker_pb2_grpc, "DecodeWorkerStub")
