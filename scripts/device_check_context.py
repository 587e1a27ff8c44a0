"""What every section of ``scripts/device_check.py`` shares: the device, the time budget, a
scratch folder, the tiny transformers-written checkpoint (built once), and engine configs on the
device."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from device_check_models import TinyPrompts, tiny_cases, write_tiny_hf

from engine.config import EngineConfig


@dataclass
class Context:
    """Settings and shared state of one run. ``save`` writes the report as it stands."""

    device: str
    quick: bool
    work: Path  # scratch folder for checkpoints (never the output folder)
    deadline: float  # time.monotonic() by which the run must be over
    save: Callable[[], None]
    _tiny: tuple[Path, TinyPrompts] | None = field(default=None, repr=False)

    def remaining(self) -> float:
        """Seconds left of the budget."""
        return self.deadline - time.monotonic()

    def tiny(self) -> tuple[Path, TinyPrompts]:
        """The tiny transformers-written checkpoint and its prompts (written on first use)."""
        if self._tiny is None:
            path = write_tiny_hf(self.work / "tiny-hf")
            self._tiny = (path, tiny_cases(path))
        return self._tiny

    def sync(self) -> None:
        """Wait for the device's queued work (timings)."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def free(self) -> None:
        """Return cached device memory after a section's models are dropped."""
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def engine_config(self, **kwargs: Any) -> EngineConfig:  # noqa: ANN401
        """An :class:`EngineConfig` on this device."""
        return EngineConfig(device=self.device, **kwargs)
