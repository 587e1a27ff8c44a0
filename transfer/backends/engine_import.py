"""Importing Mooncake's transfer engine, with an error that says what to fix when it cannot load.

The import fails in three ways that need three different remedies, told apart from the error:

- the ``mooncake`` package (or its ``mooncake.engine`` module) is not installed: pip install the
  extra for the memory the KV cache lives in (``pdserve[mooncake]`` host, ``pdserve[cuda]`` CUDA
  GPU, ``pdserve[ascend]`` Ascend NPU);
- the package is installed but a shared library its engine links failed to load (the RDMA verbs
  and connection manager libraries, NUMA, ...): the library is named, with the apt-get line;
- the CUDA build is installed where the CUDA runtime (``libcudart``) is not: install the host
  build through its extra, or the CUDA runtime.

Every failure becomes a :class:`~transfer.errors.BackendUnavailableError` chained to the
original error.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from transfer.errors import BackendUnavailableError

ENGINE_MODULE = "mooncake.engine"
SYSTEM_LIBRARIES_APT = "apt-get install -y libibverbs1 librdmacm1 libnuma1"
_EXTRA_OF_KIND = {"cpu": "mooncake", "cuda": "cuda", "npu": "ascend"}
_MEMORY_OF_EXTRA = {"mooncake": "host memory", "cuda": "CUDA GPU memory too",
                    "ascend": "Ascend NPU memory too"}
_SHARED_LIBRARY = re.compile(r"\b(lib[A-Za-z0-9_+-]+\.so(?:\.[0-9]+)*)")


def load_transfer_engine(kv_device: str = "") -> Any:
    """The ``TransferEngine`` class of the installed Mooncake build.

    ``kv_device`` names where the KV cache lives (``"cpu"``, ``"cuda:N"``, ``"npu:N"``; ""
    unknown) and picks the pip extra an error suggests. Raises
    :class:`BackendUnavailableError` explaining the failure (:func:`explain_import_failure`).
    """
    try:
        module = importlib.import_module(ENGINE_MODULE)
    except (ImportError, OSError) as exc:
        raise BackendUnavailableError(explain_import_failure(exc, kv_device)) from exc
    return module.TransferEngine


def pip_hint(kv_device: str = "") -> str:
    """The pip command that installs the engine build for memory on ``kv_device``."""
    extra = _EXTRA_OF_KIND.get(kv_device.partition(":")[0])
    if extra is None:
        return "pip install 'pdserve[mooncake]' (host memory) or 'pdserve[cuda]' (GPU memory too)"
    return f"pip install 'pdserve[{extra}]' ({_MEMORY_OF_EXTRA[extra]})"


def explain_import_failure(exc: BaseException, kv_device: str = "") -> str:
    """What went wrong importing the engine, and the command that fixes it."""
    if isinstance(exc, ModuleNotFoundError) and exc.name in ("mooncake", ENGINE_MODULE):
        return (f"the Mooncake transfer engine is not installed (no module {exc.name!r}): "
                + pip_hint(kv_device))
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return (f"the Mooncake transfer engine is installed but its Python dependency "
                f"{exc.name!r} is missing: reinstall it with {pip_hint(kv_device)}")
    found = _SHARED_LIBRARY.search(str(exc))
    if found is not None and found.group(1).startswith("libcudart"):
        return (f"the CUDA build of the Mooncake transfer engine is installed but the CUDA "
                f"runtime {found.group(1)} did not load ({exc}). On a machine without CUDA, "
                "install the host build in its place: pip uninstall -y mooncake-transfer-engine "
                "&& pip install 'pdserve[mooncake]'; with a GPU, install the CUDA runtime the "
                "build was made for")
    if found is not None:
        return (f"the Mooncake transfer engine is installed but the system library "
                f"{found.group(1)} it needs did not load ({exc}). Install the libraries it "
                f"links (Debian/Ubuntu): {SYSTEM_LIBRARIES_APT}")
    return (f"the Mooncake transfer engine is installed but failed to load ({exc}): reinstall "
            f"the build for this machine with {pip_hint(kv_device)}")
