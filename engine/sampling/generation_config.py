"""A checkpoint's ``generation_config.json``: the sampling defaults its authors ship.

Only the values that map onto :class:`engine.core.request.SamplingParams` are read: ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_new_tokens`` and ``do_sample``.
``do_sample: false`` means greedy (default temperature 0, whatever ``temperature`` says, as in
transformers); otherwise a given ``temperature`` is the default (as vLLM and SGLang read it).
A value the file leaves out (or sets to null) is None here: the server's own default applies. A
file that exists but is not a JSON object, or holds a value of the wrong type, is a
:class:`ConfigError`. Pure Python: the router reads it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine.config import read_json_object
from engine.errors import ConfigError

FILE_NAME = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """Per-field sampling defaults; None = not given by the checkpoint."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> GenerationDefaults:
        """The defaults of ``model_dir``'s ``generation_config.json`` (none without the file)."""
        path = Path(model_dir) / FILE_NAME
        if not path.is_file():
            return cls()
        return cls.from_dict(read_json_object(path), str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = FILE_NAME) -> GenerationDefaults:
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = raw.get(f.name)
            if value is None:
                continue
            want_int = f.name in ("top_k", "max_new_tokens")
            if isinstance(value, bool) or not isinstance(value, int if want_int else int | float) \
                    or not math.isfinite(value):
                kind = "an integer" if want_int else "a number"
                raise ConfigError(f"{where}: {f.name} must be {kind}, got {value!r}")
            values[f.name] = int(value) if want_int else float(value)
        do_sample = raw.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ConfigError(f"{where}: do_sample must be true or false, got {do_sample!r}")
        if do_sample is False:
            values["temperature"] = 0.0
        return cls(**values)
