"""The host allocator's setup for a CPU engine (engine/device.py): applied once per process,
and in effect on this project's glibc machines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine import device


def test_thresholds_are_set_once_and_hold_on_glibc() -> None:
    assert device.keep_freed_memory() is True  # Linux with glibc here
    assert device.keep_freed_memory() is True and len(device._applied) == 1


def test_a_cpu_engine_sets_them_in_its_process(tmp_path: Path) -> None:
    # a fresh interpreter, whose engine sets them: a 20 MB block then comes from the heap
    # (mallinfo2 counts the blocks glibc mmaps: hblks)
    code = (
        "import ctypes, torch\n"
        "from engine.builtin.tiny_model import write_tiny_model\n"
        "from engine.config import EngineConfig\n"
        "from engine.llm_engine import LLMEngine\n"
        "from engine import device\n"
        f"LLMEngine(write_tiny_model({str(tmp_path / 'tiny')!r}), EngineConfig(num_pages=8))\n"
        "assert device._applied == [True]\n"
        "class Info(ctypes.Structure):\n"
        "    _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', 'hblks',"
        " 'hblkhd', 'usmblks', 'fsmblks', 'uordblks', 'fordblks', 'keepcost')]\n"
        "libc = ctypes.CDLL('libc.so.6'); libc.mallinfo2.restype = Info\n"
        "before = libc.mallinfo2().hblks\n"
        "t = torch.empty(20 << 20, dtype=torch.uint8); t.fill_(1)\n"
        "print('MMAPPED', libc.mallinfo2().hblks - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MMAPPED 0" in out.stdout  # a 20 MB tensor came from the heap, not from mmap
