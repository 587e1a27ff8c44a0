"""Shared fixtures: tiny checkpoints written by transformers and by our own code; and the
session's end through :func:`serving.process_exit.exit_process`, so that transfer engines the
tests kept (``tests/transfer/xfer_peer.py``) are not destroyed one second each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serving.process_exit import exit_process

_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The last hook, after the summary: exit with the session's status now if engines were
    kept (else pytest ends the ordinary way)."""
    if _EXIT_STATUS in config.stash:
        exit_process(config.stash[_EXIT_STATUS])

HF_TEXT = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    "eos_token_id": None,
    "bos_token_id": None,
}
HF_VISION = {
    "depth": 2,
    "embed_dim": 32,
    "hidden_size": 64,
    "num_heads": 4,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
HF_SPECIAL = {
    "image_token_id": 380,
    "video_token_id": 381,
    "vision_start_token_id": 378,
    "vision_end_token_id": 379,
}


def write_hf_checkpoint(path: Path, seed: int = 0, tie: bool = False) -> Path:
    """A random tiny Qwen2-VL checkpoint written by transformers' own ``save_pretrained``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(text_config=dict(HF_TEXT), vision_config=dict(HF_VISION),
                        tie_word_embeddings=tie, **HF_SPECIAL)
    return _save_random(Qwen2VLForConditionalGeneration, cfg, path, seed)


def _save_random(model_cls: type, cfg: object, path: Path, seed: int) -> Path:
    """``model_cls(cfg)`` with seeded random weights, saved by its own ``save_pretrained``."""
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():  # larger weights than the default init, so logits are far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf") / "ckpt")


@pytest.fixture(scope="session")
def hf_model(hf_dir: Path):  # noqa: ANN201 - transformers model
    """transformers' model of :func:`hf_dir`: the oracle of the generation tests."""
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(hf_dir).eval()


@pytest.fixture(scope="session")
def hf_one_kv_head_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`hf_dir`'s shape with 1 KV head (4 query heads): tensor-parallel ranks replicate
    it."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(text_config=dict(HF_TEXT, num_key_value_heads=1),
                        vision_config=dict(HF_VISION), **HF_SPECIAL)
    path = tmp_path_factory.mktemp("hf_kv1") / "ckpt"
    return _save_random(Qwen2VLForConditionalGeneration, cfg, path, seed=1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.builtin.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


# ---------------------------------------------------------------- Qwen2.5-VL (helper QWEN25)
# windows of 56 px = 2x2 merged patches (4x4 patches), so a (1, 8, 12) grid splits into 6
# windows and a (1, 6, 10) one into uneven ones; block 1 attends over whole frames, block 0 and
# block 2 over windows
HF25_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "out_hidden_size": 64,
    "intermediate_size": 48,
    "num_heads": 4,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1],
    "tokens_per_second": 2,
}


def write_hf_qwen2_5_checkpoint(path: Path, seed: int = 0) -> Path:
    """A random tiny Qwen2.5-VL checkpoint written by transformers' own ``save_pretrained``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(text_config=dict(HF_TEXT), vision_config=dict(HF25_VISION),
                           **HF_SPECIAL)
    return _save_random(Qwen2_5_VLForConditionalGeneration, cfg, path, seed)


@pytest.fixture(scope="session")
def hf25_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_qwen2_5_checkpoint(tmp_path_factory.mktemp("hf25") / "ckpt")


@pytest.fixture(scope="session")
def hf25_model(hf25_dir: Path):  # noqa: ANN201 - transformers model
    """transformers' model of :func:`hf25_dir`: the oracle of the Qwen2.5-VL tests."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(hf25_dir).eval()


# ---------------------------------------------------------------- Qwen3-VL and Qwen3.5
# head_dim 16 (explicit), interleaved mrope over all 8 frequencies; a patch-16 tower whose
# 4 x 4 position table is interpolated to every grid, DeepStack from blocks 0 and 2
HF3_TEXT = {
    **HF_TEXT,
    "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                        "mrope_interleaved": True, "rope_theta": 10000.0},
}
HF3_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "out_hidden_size": 64,
    "intermediate_size": 48,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 2],
}
# four layers, two of each kind, the full-attention ones gated with a half-width rotation
HF35_TEXT = {
    **HF3_TEXT,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1],
                        "mrope_interleaved": True, "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5},
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
HF35_VISION = {k: v for k, v in HF3_VISION.items() if k != "deepstack_visual_indexes"}


def write_hf_qwen3_vl_checkpoint(path: Path, seed: int = 0, **text: object) -> Path:
    """A random tiny Qwen3-VL checkpoint written by transformers' own ``save_pretrained``."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(text_config={**HF3_TEXT, **text}, vision_config=dict(HF3_VISION),
                        **HF_SPECIAL)
    return _save_random(Qwen3VLForConditionalGeneration, cfg, path, seed)


def write_hf_qwen3_5_checkpoint(path: Path, seed: int = 0, **text: object) -> Path:
    """A random tiny Qwen3.5 checkpoint written by transformers' own ``save_pretrained``."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    cfg = Qwen3_5Config(text_config={**HF35_TEXT, **text}, vision_config=dict(HF35_VISION),
                        **HF_SPECIAL)
    return _save_random(Qwen3_5ForConditionalGeneration, cfg, path, seed)


@pytest.fixture(scope="session")
def hf3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_qwen3_vl_checkpoint(tmp_path_factory.mktemp("hf3") / "ckpt")


@pytest.fixture(scope="session")
def hf3_model(hf3_dir: Path):  # noqa: ANN201 - transformers model
    """transformers' model of :func:`hf3_dir`: the oracle of the Qwen3-VL tests."""
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(hf3_dir).eval()


@pytest.fixture(scope="session")
def hf35_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_qwen3_5_checkpoint(tmp_path_factory.mktemp("hf35") / "ckpt")


@pytest.fixture(scope="session")
def hf35_model(hf35_dir: Path):  # noqa: ANN201 - transformers model
    """transformers' model of :func:`hf35_dir`: the oracle of the Qwen3.5 tests."""
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(hf35_dir).eval()


@pytest.fixture(scope="session")
def hf3_one_kv_head_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`hf3_dir`'s shape with 1 KV head (4 query heads): tensor-parallel ranks replicate
    it."""
    path = tmp_path_factory.mktemp("hf3_kv1") / "ckpt"
    return write_hf_qwen3_vl_checkpoint(path, seed=1, num_key_value_heads=1)


@pytest.fixture(scope="session")
def hf3_one_kv_head_model(hf3_one_kv_head_dir: Path):  # noqa: ANN201 - transformers model
    """transformers' model of :func:`hf3_one_kv_head_dir`."""
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(hf3_one_kv_head_dir).eval()


@pytest.fixture(scope="session")
def hf35_one_kv_head_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`hf35_dir`'s shape with 1 KV head in its full-attention layers (4 query heads):
    tensor-parallel ranks replicate it."""
    path = tmp_path_factory.mktemp("hf35_kv1") / "ckpt"
    return write_hf_qwen3_5_checkpoint(path, seed=1, num_key_value_heads=1)


@pytest.fixture(scope="session")
def hf35_one_kv_head_model(hf35_one_kv_head_dir: Path):  # noqa: ANN201 - transformers model
    """transformers' model of :func:`hf35_one_kv_head_dir`."""
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(hf35_one_kv_head_dir).eval()


@pytest.fixture(scope="session")
def qwen35_mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5 checkpoint (``make-tiny-model --arch qwen3_5``) with a random MTP module:
    ``mtp.*`` tensors and ``mtp_num_hidden_layers: 1``, which transformers ignores."""
    from engine.builtin.tiny_qwen3 import write_tiny_qwen3_model

    return write_tiny_qwen3_model(tmp_path_factory.mktemp("qwen35_mtp") / "ckpt", "qwen3_5",
                                  mtp=True)
