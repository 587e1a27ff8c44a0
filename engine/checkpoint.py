"""Loading and saving checkpoints of every supported family in the Hugging Face safetensors
layout.

Accepts one ``model.safetensors``, a sharded set listed in ``model.safetensors.index.json``, and
both naming schemes (``model.layers.*`` / ``visual.*`` as published for Qwen2-VL, and
``model.language_model.*`` / ``model.visual.*`` as Qwen3-VL and Qwen3.5 are published and newer
transformers name modules in memory). A Qwen3.5 checkpoint's ``mtp.*`` module (its
multi-token-prediction draft) is not the target model's and is not read with it
(:func:`read_module` reads it alone).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.models.qwen3_5.model import Qwen35Model
from engine.models.qwen3_vl.model import Qwen3VLModel
from engine.parallel.group import SINGLE, TPGroup
from engine.parallel.shard import TensorPart, TextShard

_LAYER_PREFIX = "model.layers."
_NOT_TARGET = ("mtp.",)  # a Qwen3.5 checkpoint's MTP draft
_MODELS: dict[str, type[Qwen2VLModel]] = {
    "qwen2_vl": Qwen2VLModel, "qwen2_5_vl": Qwen2VLModel, "qwen3_vl": Qwen3VLModel,
    "qwen3_5": Qwen35Model,
}
_RENAMES = (
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def canonical_name(name: str) -> str:
    """The published checkpoint's name for a tensor named ``name`` in any accepted layout."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def indexed_files(index: Path) -> list[Path]:
    """The shard files a Hugging Face ``*.index.json`` lists (its ``weight_map``'s values, in a
    stable order), refused naming them unless every one is beside it."""
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [index.parent / s for s in shards]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: unreadable index: {exc}") from exc
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index.parent}: shards listed in the index are missing: {missing}")
    return files


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return indexed_files(index)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weight files")
    return files


def layer_of(name: str) -> int | None:
    """The decoder layer a canonical tensor name belongs to (None for any other tensor)."""
    if not name.startswith(_LAYER_PREFIX):
        return None
    index = name[len(_LAYER_PREFIX) :].split(".", 1)[0]
    return int(index) if index.isdigit() else None


def read_state_dict(
    model_dir: Path, layers: range | None = None, device: str | torch.device = "cpu",
    shard: TextShard | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint under their canonical names, read straight onto ``device``
    (no host copy of the whole checkpoint first); with ``layers``, the decoder layers outside it
    are not read at all (a pipeline stage's share); with ``shard``, only a tensor-parallel
    rank's part of each split tensor is read (:meth:`TextShard.part_of`). On the ``meta``
    device nothing is read: each tensor is an empty one of its file's shape and dtype (what
    tracing a forward without its weights needs)."""
    state: dict[str, torch.Tensor] = {}
    meta = torch.device(device).type == "meta"
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu" if meta else str(device)) as f:
                if meta:
                    f = _MetaReader(f)
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    canonical = canonical_name(name)
                    if canonical.startswith(_NOT_TARGET):
                        continue
                    layer = layer_of(canonical)
                    if shard is not None and not shard.holds(canonical):
                        continue
                    if layers is None or layer is None or layer in layers:
                        part = shard.part_of(canonical) if shard is not None else None
                        state[canonical] = f.get_tensor(name) if part is None else _read_part(
                            f.get_slice(name), part)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises several unrelated types on bad files
            raise CheckpointError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc
    return state


def read_module(model_dir: Path, prefix: str, device: str | torch.device = "cpu"
                ) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint whose canonical names start with ``prefix`` (a module the
    target model does not read, such as Qwen3.5's ``mtp.``), named without it and read straight
    onto ``device`` (on ``meta``: shapes and dtypes only, as :func:`read_state_dict`); empty
    when the checkpoint has none."""
    state: dict[str, torch.Tensor] = {}
    meta = torch.device(device).type == "meta"
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu" if meta else str(device)) as f:
                if meta:
                    f = _MetaReader(f)
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    canonical = canonical_name(name)
                    if canonical.startswith(prefix):
                        state[canonical[len(prefix) :]] = f.get_tensor(name)
        except Exception as exc:  # safetensors raises several unrelated types on bad files
            raise CheckpointError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc
    return state


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


class _MetaReader:
    """A safetensors file seen as ``meta`` tensors: its names, shapes and dtypes, no data."""

    def __init__(self, f: Any) -> None:  # noqa: ANN401 - safetensors' file handle
        self._f = f

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        sl = self._f.get_slice(name)
        return torch.empty(sl.get_shape(), dtype=_SAFETENSORS_DTYPES[sl.get_dtype()],
                           device="meta")

    def get_slice(self, name: str) -> torch.Tensor:
        return self.get_tensor(name)


def _read_part(tensor: Any, part: TensorPart) -> torch.Tensor:
    """The rows (``part.dim`` 0) or columns (``part.dim`` 1) of ``part``'s spans of a
    safetensors slice, concatenated in order, read without the rest of the tensor."""
    pieces = [tensor[start:stop] if part.dim == 0 else tensor[:, start:stop]
              for start, stop in part.spans]
    assert all(isinstance(p, torch.Tensor) for p in pieces)
    if len(pieces) == 1:
        return pieces[0].contiguous()
    return torch.cat(pieces, dim=part.dim)


class _NoInit(TorchFunctionMode):
    """``torch.nn.init``'s initialisers return their tensor untouched: a model built to be loaded
    needs no initial values, and ``normal_`` on the meta device would import ``torch._dynamo``
    (seconds of every process's first load, each tensor-parallel rank's included)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", layers: range | None = None, tp: TPGroup = SINGLE,
) -> tuple[ModelConfig, Qwen2VLModel]:
    """Build the model of ``model_dir`` and load its weights (strict: every tensor must match)
    onto ``device`` in ``dtype``. The weights go from the files to the device directly.

    With ``layers`` only those decoder layers are read and built (see :func:`keep_layers`): a
    pipeline stage holds its share of the weights and never the rest. With a ``tp`` group of
    several ranks, the decoder layers hold and read this rank's slices only
    (:mod:`engine.parallel.shard`)."""
    path = Path(model_dir)
    cfg = ModelConfig.from_dir(path)
    shard = TextShard.of(cfg.text, tp.rank, tp.size) if tp.size > 1 else None
    with torch.device("meta"), _NoInit():
        model = _MODELS[cfg.model_type](cfg, tp)
    if layers is not None:
        keep_layers(model, layers)
    if tp.rank > 0:
        keep_decoder(model)
    state = read_state_dict(path, layers, device, shard)
    expected = set(model.state_dict().keys())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match config.json (model_type {cfg.model_type}): "
            f"missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
        )
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: tensor shapes do not match config.json: {exc}") from exc
    if cfg.tie_word_embeddings and tp.rank == 0:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype)
    model.eval().requires_grad_(False)
    model.fuse()
    return cfg, model


def keep_layers(model: Qwen2VLModel, layers: range) -> Qwen2VLModel:
    """Drop every decoder layer outside ``layers`` (a pipeline stage's share).

    The dropped layers become empty modules, so ``model.model.layers[i]`` keeps its global index
    ``i``; only :meth:`Qwen2VLModel.forward_layers` over ``layers`` may run afterwards.
    :func:`load_model` applies it before reading any weight.
    """
    n = len(model.model.layers)
    if not (0 <= layers.start < layers.stop <= n and layers.step == 1):
        raise CheckpointError(f"layer range {layers} is not a contiguous part of 0..{n - 1}")
    for i in range(n):
        if i not in layers:
            model.model.layers[i] = torch.nn.Module()
    return model


def keep_decoder(model: Qwen2VLModel) -> Qwen2VLModel:
    """Drop the embedding, the LM head and the vision tower: a tensor-parallel rank other than 0
    runs only :meth:`Qwen2VLModel.forward` over the embeddings rank 0 sends it.
    :func:`load_model` applies it before reading any weight."""
    for owner, name in ((model, "visual"), (model, "lm_head"), (model.model, "embed_tokens")):
        delattr(owner, name)
    return model


_SAMPLE_BYTES = 1 << 20


def model_fingerprint(model_dir: str | Path) -> str:
    """A short hash that differs between checkpoints: ``config.json``, and per weight file its
    size and its first and last MiB (header included). Two nodes exchange KV only when their
    fingerprints agree; hashing samples keeps this fast for checkpoints of any size."""
    path = Path(model_dir)
    digest = hashlib.sha256()
    config = json.loads((path / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    for file in weight_files(path):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            digest.update(f.read(_SAMPLE_BYTES))
            f.seek(max(0, size - _SAMPLE_BYTES))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:32]


def save_weights(model: Qwen2VLModel, model_dir: str | Path) -> None:
    """Write ``model.safetensors`` under the published names (tied LM head omitted)."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(Path(model_dir) / "model.safetensors"), metadata={"format": "pt"})
