"""``--device`` / ``--dtype`` resolution (engine/device.py), tensors following the device, and a
bfloat16 engine on the CPU.

Accelerator branches are reached by faking the runtime (``torch.cuda`` answers, a stand-in
``torch_npu`` module): what is checked there is the choice ``auto`` makes and the one-line errors,
never a real GPU or NPU run. The bfloat16 engine is checked against transformers in bfloat16 on
the first tokens of a text and an image prompt (the two round differently, so later tokens may
part), and against our own float32 engine on the first token's log-probability.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from cli.engine_args import DTYPE_CHOICES as CLI_DTYPE_CHOICES
from engine.config import EngineConfig, VisionConfig
from engine.core.request import SamplingParams
from engine.device import (
    DTYPE_CHOICES,
    DTYPES,
    dtype_name,
    parse_device_name,
    resolve_device,
    resolve_dtype,
)
from engine.errors import ConfigError, DeviceError
from engine.llm_engine import LLMEngine, Prompt
from engine.models.layers import MropeRotary
from engine.models.qwen2_vl.vision import VisionTower
from tests.engine.test_generation_vs_transformers import cases

CPU = torch.device("cpu")
META = torch.device("meta")  # a device that is not the host, on every machine


# ---------------------------------------------------------------- faked runtimes


def no_gpu(mp: pytest.MonkeyPatch, *, cuda_build: bool) -> None:
    mp.setattr(torch.version, "cuda", "12.8" if cuda_build else None)
    mp.setattr(torch.version, "hip", None, raising=False)
    mp.setattr(torch.cuda, "is_available", lambda: False)


def gpus(mp: pytest.MonkeyPatch, count: int) -> None:
    mp.setattr(torch.version, "cuda", "12.8")
    mp.setattr(torch.cuda, "is_available", lambda: True)
    mp.setattr(torch.cuda, "device_count", lambda: count)
    mp.setattr(torch.cuda, "current_device", lambda: 0)


def no_torch_npu(mp: pytest.MonkeyPatch) -> None:
    mp.setitem(sys.modules, "torch_npu", None)  # import raises ModuleNotFoundError


def torch_npu_without_npus(mp: pytest.MonkeyPatch) -> None:
    fake = ModuleType("torch_npu")
    fake.__version__ = "2.13.0.fake"  # type: ignore[attr-defined]
    mp.setitem(sys.modules, "torch_npu", fake)
    mp.setattr(torch, "npu", SimpleNamespace(is_available=lambda: False, device_count=lambda: 0,
                                             current_device=lambda: 0), raising=False)


# ---------------------------------------------------------------- resolve_device


def test_auto_is_the_cpu_without_cuda_or_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    no_gpu(monkeypatch, cuda_build=True)
    no_torch_npu(monkeypatch)
    assert resolve_device("auto") == CPU
    torch_npu_without_npus(monkeypatch)  # torch_npu imports but sees no NPU: still the CPU
    assert resolve_device("auto") == CPU
    assert resolve_device("cpu") == CPU


def test_auto_prefers_cuda_and_names_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match="only 2 CUDA"):
        resolve_device("cuda:2")


def test_cuda_on_a_cpu_build_of_torch_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    no_gpu(monkeypatch, cuda_build=False)
    with pytest.raises(DeviceError) as err:
        resolve_device("cuda")
    msg = str(err.value)
    assert "\n" not in msg
    assert f"this torch ({torch.__version__}) has no CUDA" in msg
    assert "download.pytorch.org/whl/cu" in msg and "pip install torch" in msg


def test_cuda_torch_without_a_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    no_gpu(monkeypatch, cuda_build=True)
    with pytest.raises(DeviceError, match="no CUDA device visible") as err:
        resolve_device("cuda:0")
    assert "CUDA_VISIBLE_DEVICES" in str(err.value) and "\n" not in str(err.value)


def test_npu_without_torch_npu_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    no_torch_npu(monkeypatch)
    with pytest.raises(DeviceError) as err:
        resolve_device("npu")
    msg = str(err.value)
    assert "\n" not in msg
    assert "install torch_npu (Ascend's PyTorch adapter)" in msg and "CANN" in msg


def test_npu_with_torch_npu_but_no_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    torch_npu_without_npus(monkeypatch)
    with pytest.raises(DeviceError, match="no NPU visible .*ASCEND_RT_VISIBLE_DEVICES"):
        resolve_device("npu:0")


@pytest.mark.parametrize("name", ["tpu", "gpu", "", "cpu:0", "auto:1", "cuda:x", "cuda:-1",
                                  "npu:"])
def test_unknown_devices_list_the_choices(name: str) -> None:
    with pytest.raises(DeviceError, match="choose one of auto, cpu, cuda, npu"):
        resolve_device(name)
    with pytest.raises(ConfigError):  # what the servers and the CLI already report
        parse_device_name(name)


def test_parse_device_name() -> None:
    assert parse_device_name("cuda:3") == ("cuda", 3)
    assert parse_device_name("npu") == ("npu", None)
    assert parse_device_name("auto") == ("auto", None)


# ---------------------------------------------------------------- resolve_dtype


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    for name, dtype in DTYPES.items():
        assert resolve_dtype(name, CPU) == dtype
        assert dtype_name(dtype) == name
    with pytest.raises(DeviceError, match="choose one of auto, float32, bfloat16, float16"):
        resolve_dtype("float64", CPU)
    with pytest.raises(DeviceError, match="unsupported dtype"):
        dtype_name(torch.float64)
    assert CLI_DTYPE_CHOICES == DTYPE_CHOICES  # the CLI keeps torch-free copies of the names


# ---------------------------------------------------------------- tensors follow the device


def test_mrope_tables_are_made_on_the_positions_device() -> None:
    rotary = MropeRotary(rotary_dim=16, theta=10000.0, mrope_section=(2, 3, 3))
    pos = torch.arange(15).view(3, 5)
    host = rotary(pos, torch.float32)
    meta = rotary(pos.to(META), torch.bfloat16)
    for table in (meta.cos, meta.signed_sin, meta.swap):
        assert table.device == META
    assert meta.cos.dtype == torch.bfloat16 and host.swap.device == CPU
    assert rotary(pos.to(META), torch.bfloat16).swap is meta.swap  # copied once per device


def test_vision_tower_forward_stays_on_its_device() -> None:
    cfg = VisionConfig(depth=1, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2.0,
                       in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                       hidden_act="quick_gelu", rope_theta=10000.0)
    with torch.device(META):
        tower = VisionTower(cfg)
    grids = [(1, 4, 4), (1, 4, 4)]
    tables = tower._rotary(grids)  # built where the weights are, not on the host
    assert {tables.cos.device, tables.signed_sin.device, tables.swap.device} == {META}
    out = tower(torch.empty(2 * 16, cfg.patch_dim, device=META), grids)
    assert out.device == META and tuple(out.shape) == (8, 64)


# ---------------------------------------------------------------- a bfloat16 engine on the CPU


@pytest.fixture(scope="module")
def bf16_engine(hf_dir: Path) -> LLMEngine:
    return LLMEngine(hf_dir, EngineConfig(num_pages=64, page_size=8, dtype="bfloat16",
                                          device="auto"))


def test_engine_resolves_device_and_dtype(bf16_engine: LLMEngine) -> None:
    e = bf16_engine
    assert (e.device, e.dtype) == (CPU, torch.bfloat16)
    assert (e.config.device, e.config.dtype) == ("cpu", "bfloat16")  # resolved names
    assert e.model.device == CPU and e.model.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 and t.device == CPU for t in [*e.pool.k, *e.pool.v])


def test_engine_refuses_a_device_it_cannot_run(hf_dir: Path, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    no_gpu(monkeypatch, cuda_build=False)
    with pytest.raises(DeviceError, match="CUDA build of torch"):
        LLMEngine(hf_dir, EngineConfig(num_pages=8, device="cuda"))
    with pytest.raises(DeviceError, match="--dtype 'half'"):
        LLMEngine(hf_dir, EngineConfig(num_pages=8, dtype="half"))


@pytest.mark.parametrize("name", ["text_only", "one_image"])
def test_bf16_greedy_tokens_match_transformers_bf16(name: str, hf_dir: Path,
                                                    bf16_engine: LLMEngine) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    from tests.engine.test_generation_vs_transformers import reference

    ids, images = cases()[name]
    n = 8
    greedy = SamplingParams(max_new_tokens=n, ignore_eos=True)
    [ours] = bf16_engine.generate([Prompt(token_ids=ids, images=images)], greedy)
    bf16_engine.scheduler.check_no_leaks()
    vocab = bf16_engine.model_config.text.vocab_size
    assert len(ours.token_ids) == n and all(0 <= t < vocab for t in ours.token_ids)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    assert ours.token_ids == reference(hf, ids, images)[:n]
    f32 = LLMEngine(hf_dir, EngineConfig(num_pages=64, page_size=8))
    [ref32] = f32.generate([Prompt(token_ids=ids, images=images)], greedy)
    assert ours.logprobs[0] == pytest.approx(ref32.logprobs[0], abs=0.05)  # bf16 rounding only
