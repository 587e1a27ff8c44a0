"""Conversions between protobuf messages and plain Python values (no engine types here:
the nodes build their own objects from these values)."""

from __future__ import annotations

from typing import Any

import numpy as np

from proto.pdserve.v1 import generate_pb2 as pb

MAX_PATCH_BYTES = 256 << 20


class ConversionError(ValueError):
    """A message whose content cannot be converted (wrong shapes, sizes, values)."""


def sampling_kwargs(msg: pb.SamplingParams, default_max_new_tokens: int) -> dict[str, Any]:
    """Keyword arguments of ``engine.core.request.SamplingParams`` from the wire message; an unset
    optional field takes the engine's default (the router has filled in the checkpoint's)."""
    out: dict[str, Any] = {
        "top_p": float(msg.top_p) if msg.top_p else 1.0,
        "max_new_tokens": int(msg.max_new_tokens) or default_max_new_tokens,
        "stop_token_ids": tuple(int(t) for t in msg.stop_token_ids),
        "seed": int(msg.seed) if msg.HasField("seed") else None,
        "ignore_eos": bool(msg.ignore_eos),
        "logprobs": bool(msg.logprobs),
        "stop": tuple(msg.stop),
    }
    for name in _OPTIONAL_FLOATS:
        if msg.HasField(name):
            out[name] = float(getattr(msg, name))
    if msg.HasField("top_k"):
        out["top_k"] = int(msg.top_k)
    if msg.top_logprobs:
        out["top_logprobs"] = int(msg.top_logprobs)
    if msg.HasField("prompt_logprobs"):
        out["prompt_logprobs"] = int(msg.prompt_logprobs)
    if msg.HasField("structured_output"):
        out["structured_output"] = (msg.structured_output.kind, msg.structured_output.value)
    if msg.logit_bias:
        out["logit_bias"] = tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items()))
    return out


_OPTIONAL_FLOATS = ("temperature", "min_p", "repetition_penalty", "frequency_penalty",
                    "presence_penalty")


def sampling_message(kwargs: dict[str, Any]) -> pb.SamplingParams:
    """The wire message for a dict of ``SamplingParams`` fields (the inverse of the above:
    every field present in ``kwargs`` is set)."""
    msg = pb.SamplingParams(
        max_new_tokens=kwargs["max_new_tokens"], stop_token_ids=list(kwargs["stop_token_ids"]),
        ignore_eos=kwargs["ignore_eos"], logprobs=kwargs["logprobs"],
        stop=list(kwargs.get("stop", ())),
    )
    for name in (*_OPTIONAL_FLOATS, "top_p", "top_k", "top_logprobs", "prompt_logprobs"):
        if kwargs.get(name) is not None:
            setattr(msg, name, kwargs[name])
    if kwargs.get("seed") is not None:
        msg.seed = kwargs["seed"]
    if kwargs.get("structured_output") is not None:
        kind, value = kwargs["structured_output"]
        msg.structured_output.kind, msg.structured_output.value = kind, value
    msg.logit_bias.update(dict(kwargs.get("logit_bias", ())))
    return msg


def patches_array(msg: pb.ImagePatches) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``(patches float32 [n, d], grid (t, h, w))`` from the wire; shapes are checked here,
    their agreement with the model by the engine."""
    if len(msg.shape) != 2 or len(msg.grid_thw) != 3:
        raise ConversionError("image patches need a 2-D shape and a 3-value grid_thw")
    n, d = int(msg.shape[0]), int(msg.shape[1])
    if len(msg.data) != n * d * 4 or len(msg.data) > MAX_PATCH_BYTES:
        raise ConversionError(
            f"image patches: {len(msg.data)} bytes do not hold float32 {n}x{d} "
            f"(or exceed {MAX_PATCH_BYTES} bytes)"
        )
    array = np.frombuffer(msg.data, dtype="<f4").reshape(n, d)
    t, h, w = (int(x) for x in msg.grid_thw)
    return array, (t, h, w)


def patches_message(array: np.ndarray, grid: tuple[int, int, int]) -> pb.ImagePatches:
    data = np.ascontiguousarray(array, dtype="<f4")
    return pb.ImagePatches(data=data.tobytes(), shape=list(data.shape), grid_thw=list(grid))


def video_message(
    array: np.ndarray, grid: tuple[int, int, int], second_per_grid: float
) -> pb.Video:
    """A patches-source ``Video`` (the form workers take): float32 ``[t*h*w, d]`` patches, their
    grid and the seconds one temporal grid step covers."""
    return pb.Video(patches=patches_message(array, grid), second_per_grid=second_per_grid)


def video_patches(msg: pb.Video) -> tuple[np.ndarray, tuple[int, int, int], float]:
    """``(patches, grid, second_per_grid)`` of a worker-side ``Video``: the source must be
    patches and ``second_per_grid`` resolved (positive and finite), else ConversionError."""
    if msg.WhichOneof("source") != "patches":
        raise ConversionError("a worker video must carry patches (the router decodes frames)")
    second = float(msg.second_per_grid)
    if not (np.isfinite(second) and second > 0):
        raise ConversionError(f"video second_per_grid must be positive, got {second}")
    array, grid = patches_array(msg.patches)
    return array, grid, second
