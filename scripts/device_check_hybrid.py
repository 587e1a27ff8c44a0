"""Section ``f_hybrid`` of ``scripts/device_check.py``: the hybrid (Qwen3.5) and Qwen3-VL paths on
the device, in three parts, each recorded on its own in ``res`` (a part that fails or raises
leaves the others' results; the section raises at the end if one raised):

* ``kernels``: the linear-attention kernels :func:`engine.attention.linear.select.linear_kernels`
  picks for the device (flash-linear-attention's gated delta rule and causal-conv1d's conv, where
  importable on CUDA; never run on a GPU before) against the torch reference on the same device.
  One mixed batch (continued prefill chunks from non-zero slot states, one shorter than the conv's
  ``K - 1``, one-token decode rows, a fresh prefill of two delta-rule chunks) on slots out of
  order, for Qwen3.5's linear head shapes (2 key heads, 4 value heads, head size 128) and the tiny
  checkpoint's (head size 16), float32 and bfloat16; the inputs are strided views as the model
  hands them over. Compared: the outputs, and the pool's conv and recurrent states afterwards
  (the slots the batch owns, and every other slot untouched). A kernel that comes from the torch
  reference itself is skipped with its reason (off CUDA, or its library not importable): skipped
  counts as ok.
* ``vs_transformers``: :class:`~engine.llm_engine.LLMEngine` float32 greedy on the tiny Qwen3.5
  and Qwen3-VL checkpoints (:func:`engine.builtin.tiny_qwen3.write_tiny_qwen3_model`, which
  transformers loads as well) equals transformers' ``generate`` of the same checkpoint on the
  same device: text prompts and image prompts, all in one batch with a step budget of 32 tokens
  (prompts in many chunks, prefill and decode rows in one forward). An architecture whose class
  the installed transformers lacks is skipped with the reason.
* ``mtp``: Qwen3.5 drafting with its own MTP module (``draft="mtp"``, an
  :class:`~decode_node.spec.eagle_engine.EagleEngine` chain of 3) equals plain decoding token for
  token, on a checkpoint whose drafts are accepted part of the time (both the accepted and the
  rejected path must run); once per ``engine.config.VERIFY_STATES`` mode. Reports drafted,
  accepted, rounds and acceptance length.
"""

from __future__ import annotations

import importlib.util
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from device_check_context import Context
from device_check_models import Case, compare, hf_greedy, hf_load, png_bytes

from engine.attention.linear import select
from engine.builtin.tiny_model import TINY_VOCAB
from engine.builtin.tiny_qwen3 import QWEN3_ARCHS, make_mtp_predictable, write_tiny_qwen3_model
from engine.builtin.tiny_tokenizer import SPECIAL_TOKENS
from engine.config import VERIFY_STATES
from engine.core.request import SamplingParams
from engine.llm_engine import GenerationResult, LLMEngine, Prompt

Part = Callable[[Context, dict[str, Any]], None]

# ---- part 1: the linear-attention kernels --------------------------------------------------

# (key heads, value heads, key head size, value head size): Qwen3.5's linear layers' head size
# over fewer heads, and the tiny checkpoint of the other parts (what the engine runs there)
SHAPES = {"qwen3_5": (2, 4, 128, 128), "tiny": (2, 4, 16, 16)}
# bfloat16 (what serves) first; every case compiles the libraries' kernels for its shape and
# dtype (fla autotunes them), so no new case starts once the part has run KERNELS_SOFT_S
CASE_ORDER = (("qwen3_5", torch.bfloat16), ("tiny", torch.bfloat16), ("qwen3_5", torch.float32),
              ("tiny", torch.float32))
KERNELS_SOFT_S = 60.0
CONV_KERNEL = 4
NUM_SLOTS = 16
# the mixed batch: (tokens, slot, fresh); a fresh slot is zeroed as at a request's admission
BATCH = ((70, 5, False), (1, 2, False), (37, 9, False), (1, 0, False), (2, 7, False),
         (1, 11, False), (100, 3, True))
# Errors are scaled by the reference's largest magnitude ("scaled_err"). A wrong row, slot,
# layout, head mapping or scale is off by O(0.1 .. 1) of it; rounding is far below:
# - conv float32: the same products summed in another order, ~1e-6;
# - conv bfloat16: the reference rounds to bfloat16 after the conv and again after the silu,
#   the library once at the end: one or two bfloat16 steps (2 ** -8 = 4e-3 each);
# - delta rule float32: a Triton kernel may multiply float32 operands in TF32 (tl.dot's
#   default, whatever torch's allow_tf32 says: 10-bit mantissa, ~5e-4 per product) over chunks
#   of 64 tokens, the reference in true float32. (fla's chunked kernel refuses float32 inputs
#   outright, an AssertionError recorded as the case's error: the engine's float32 prefill
#   raises the same there);
# - delta rule bfloat16: fla takes its dot products' operands (keys, queries, the state) in
#   bfloat16, the reference computes in float32 from the same bfloat16 inputs, and the output
#   is rounded to bfloat16 (4e-3).
# The conv state is a copy of the last K - 1 inputs: byte-equal in both dtypes.
TOL = {
    "conv": {torch.float32: 1e-4, torch.bfloat16: 2e-2},
    "delta_rule": {torch.float32: 5e-3, torch.bfloat16: 5e-2},
}
LIBRARIES = {  # kernel -> (its library's module, the library's distributions)
    "conv": ("causal_conv1d", ("causal-conv1d",)),
    "delta_rule": ("fla", ("flash-linear-attention", "fla-core")),
}


def _installed(module: str, dists: tuple[str, ...]) -> str:
    """A library's version, or ``"not installed"`` (not imported: ``select`` does that)."""
    if importlib.util.find_spec(module) is None:
        return "not installed"
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return "installed (version unknown)"


class _Lines(logging.Handler):
    """Keeps the messages of one logger (``select``'s warning of a library it cannot import)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage()[:500])


def _err(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Max absolute error, the reference's max magnitude, and the error scaled by it."""
    err = float((ours.float() - ref.float()).abs().max()) if ref.numel() else 0.0
    scale = float(ref.float().abs().max()) if ref.numel() else 0.0
    return {"max_abs_err": err, "ref_max_abs": scale, "scaled_err": err / max(scale, 1e-6)}


@dataclass(frozen=True)
class _Batch:
    """The mixed batch of :data:`BATCH` on a device, for one head shape."""

    device: str
    shape: tuple[int, int, int, int]
    gen: torch.Generator
    starts: list[int]
    slots: torch.Tensor  # [B] int64
    fresh: list[int]
    others: torch.Tensor  # the slots no sequence owns

    @classmethod
    def of(cls, device: str, shape: tuple[int, int, int, int]) -> _Batch:
        used = {s for _, s, _ in BATCH}
        return cls(device, shape, torch.Generator(device=device).manual_seed(0),
                   list(accumulate((n for n, _, _ in BATCH), initial=0)),
                   torch.tensor([s for _, s, _ in BATCH], dtype=torch.int64, device=device),
                   [s for _, s, f in BATCH if f],
                   torch.tensor([s for s in range(NUM_SLOTS) if s not in used], device=device))

    @property
    def tokens(self) -> int:
        return self.starts[-1]

    @property
    def channels(self) -> int:
        hk, hv, dk, dv = self.shape
        return 2 * hk * dk + hv * dv

    def randn(self, *size: int) -> torch.Tensor:
        return torch.randn(*size, generator=self.gen, device=self.device)


def _conv_case(b: _Batch, dtype: torch.dtype, kernels: select.LinearAttentionKernels
               ) -> dict[str, Any]:
    """The device's conv against the torch reference on the mixed batch, from the same pool."""
    hv, dv = b.shape[1], b.shape[3]
    t, channels = b.tokens, b.channels
    # the model's conv input is a column block of its fused projection (q/k/v, z, b, a): a
    # strided view
    x = b.randn(t, channels + hv * dv + 2 * hv).to(dtype)[:, :channels]
    weight = (b.randn(channels, CONV_KERNEL) * 0.5).to(dtype)
    state = b.randn(NUM_SLOTS, channels, CONV_KERNEL - 1).to(dtype)
    state[b.fresh] = 0
    runs = []
    for fn in (select.TORCH_KERNELS.conv, kernels.conv):
        pool = state.clone()
        runs.append((fn(x, weight, None, b.starts, pool, b.slots), pool))
    (ref_y, ref_s), (y, s) = runs
    verdict: dict[str, Any] = {
        "from": kernels.conv_from, "out": _err(y, ref_y),
        "state_equal": torch.equal(s[b.slots], ref_s[b.slots]),
        "state": _err(s[b.slots], ref_s[b.slots]),
        "others_untouched": torch.equal(s[b.others], state[b.others])}
    verdict["ok"] = (verdict["out"]["scaled_err"] <= TOL["conv"][dtype]
                     and verdict["state_equal"] and verdict["others_untouched"])
    return verdict


def _rule_case(b: _Batch, dtype: torch.dtype, kernels: select.LinearAttentionKernels
               ) -> dict[str, Any]:
    """The device's gated delta rule against the torch reference on the mixed batch, from the
    same pool."""
    hk, hv, dk, dv = b.shape
    t, key_dim = b.tokens, hk * dk
    # q, k, v: column blocks of the conv's output, reshaped to heads (strided views)
    mixed = b.randn(t, b.channels).to(dtype)
    q = mixed[:, :key_dim].reshape(t, hk, dk)
    k = mixed[:, key_dim : 2 * key_dim].reshape(t, hk, dk)
    v = mixed[:, 2 * key_dim :].reshape(t, hv, dv)
    # log decays -rate * softplus(a) as the model makes them (float32), rates slow to fast
    rate = torch.logspace(-2.0, 0.5, hv, device=b.device)
    g = -rate * F.softplus(b.randn(t, hv))
    beta = torch.sigmoid(b.randn(t, hv)).to(dtype)
    state = b.randn(NUM_SLOTS, hv, dk, dv) * 0.3
    state[b.fresh] = 0
    runs = []
    for rule in (select.TORCH_KERNELS.delta_rule, kernels.delta_rule):
        pool = state.clone()
        runs.append((rule(q, k, v, g, beta, b.starts, pool, b.slots), pool))
    (ref_o, ref_s), (o, s) = runs
    verdict: dict[str, Any] = {
        "from": kernels.delta_rule_from, "out": _err(o, ref_o),
        "state": _err(s[b.slots], ref_s[b.slots]),
        "others_untouched": torch.equal(s[b.others], state[b.others]),
        "out_dtype": str(o.dtype).removeprefix("torch."),
        "state_dtype": str(s.dtype).removeprefix("torch.")}
    tol = TOL["delta_rule"][dtype]
    verdict["ok"] = (verdict["out"]["scaled_err"] <= tol and verdict["state"]["scaled_err"] <= tol
                     and verdict["others_untouched"] and o.dtype == v.dtype
                     and s.dtype == torch.float32)
    return verdict


KernelCase = Callable[[_Batch, torch.dtype, select.LinearAttentionKernels], dict[str, Any]]
KERNEL_CASES: dict[str, KernelCase] = {"conv": _conv_case, "delta_rule": _rule_case}


def _guarded(fn: KernelCase, b: _Batch, dtype: torch.dtype,
             kernels: select.LinearAttentionKernels) -> dict[str, Any]:
    """``fn``'s verdict, or its exception as a failed one (the other kernels and cases still
    run: fla's chunked rule, for one, refuses float32 inputs)."""
    try:
        return fn(b, dtype, kernels)
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000],
                "traceback": traceback.format_exc()[-2000:]}


def part_kernels(ctx: Context, part: dict[str, Any]) -> None:
    """Part 1: the device's linear-attention kernels against the torch reference."""
    # {"causal_conv1d": version or "not installed", "fla": ...}
    part["libraries"] = {module: _installed(module, dists) for module, dists in LIBRARIES.values()}
    log = logging.getLogger(select.__name__)
    lines = _Lines()
    log.addHandler(lines)
    try:
        kernels = select.linear_kernels(torch.device(ctx.device))
    finally:
        log.removeHandler(lines)
    part["conv_from"], part["delta_rule_from"] = kernels.conv_from, kernels.delta_rule_from
    part["select_log"] = lines.lines
    which = [name for name, source in (("conv", kernels.conv_from),
                                       ("delta_rule", kernels.delta_rule_from))
             if source != "torch"]
    dev = torch.device(ctx.device).type
    # why a kernel is the torch reference: off CUDA, or its library is missing (or, installed,
    # failed to import: select_log says why)
    why = {name: f"{module} {part['libraries'][module]}"
           for name, (module, _) in LIBRARIES.items()}
    for name in LIBRARIES:
        if name not in which:
            part[f"{name}_skipped"] = (f"torch reference on {dev}"
                                       + (f" ({why[name]})" if dev == "cuda" else ""))
    if not which:
        part["ok"] = True
        part["skipped"] = f"torch reference on {dev}" + (
            f": {', '.join(why.values())}" if dev == "cuda" else "")
        part["summary"] = f"skipped: {part['skipped']}"
        return
    cases: dict[str, dict[str, Any]] = {}
    part["cases"] = cases
    start = time.monotonic()
    for shape_name, dtype in CASE_ORDER:
        key = f"{shape_name}_{str(dtype).removeprefix('torch.')}"
        if cases and time.monotonic() - start > KERNELS_SOFT_S:
            cases[key] = {"skipped": f"time: the part ran past {KERNELS_SOFT_S:.0f}s"}
            continue
        batch = _Batch.of(ctx.device, SHAPES[shape_name])
        case: dict[str, Any] = {"tokens": batch.tokens, "channels": batch.channels}
        for name in which:
            case[name] = _guarded(KERNEL_CASES[name], batch, dtype, kernels)
            ctx.sync()
        case["ok"] = all(case[name]["ok"] for name in which)
        cases[key] = case
        ctx.save()
    run = {k: c for k, c in cases.items() if "skipped" not in c}
    bad = [k for k, c in run.items() if not c["ok"]]
    part["ok"] = not bad
    part["summary"] = (
        f"{len(run) - len(bad)}/{len(run)} cases match the torch reference ("
        + ", ".join(f"{n} from {part[f'{n}_from']}: {_worst(run, n)}" for n in which) + ")"
        + (f"; failing: {', '.join(bad)}" if bad else "")
        + (f"; {len(cases) - len(run)} skipped for time" if len(run) < len(cases) else ""))


def _worst(cases: dict[str, dict[str, Any]], name: str) -> str:
    """The largest scaled output error of kernel ``name`` over ``cases``, and how many raised."""
    errs = [c[name]["out"]["scaled_err"] for c in cases.values() if "out" in c[name]]
    raised = sum("error" in c[name] for c in cases.values())
    return ((f"worst scaled err {max(errs):.1e}" if errs else "no result")
            + (f", {raised} raised" if raised else ""))


# ---- part 2: Qwen3.5 and Qwen3-VL against transformers ---------------------------------------

HF_CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration",
              "qwen3_vl": "Qwen3VLForConditionalGeneration"}
HF_TOKENS, QUICK_HF_TOKENS = 24, 8
STEP_TOKENS = 32  # the engine's step budget: prompts in chunks, prefill beside decode rows


def _ids(n: int, seed: int) -> list[int]:
    """``n`` random ordinary (non-special) ids of the tiny Qwen3 vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_VOCAB - len(SPECIAL_TOKENS), (n,), generator=gen).tolist()


def _cases(engine: LLMEngine, quick: bool) -> list[Case]:
    """Text prompts (when not quick, one of 150 tokens: three delta-rule chunks) and image
    prompts, each image through the engine's own processor and chat format."""
    a, b = png_bytes(96, 64, 5), png_bytes(64, 128, 6)
    images = [("image", Prompt(text="What is in the picture?", images=[a]))]
    texts = [("text_23", _ids(23, 0))]
    if not quick:
        texts += [("text_150", _ids(150, 1)), ("text_5", _ids(5, 2))]
        images += [("two_images", Prompt(text="Compare the two pictures.", images=[a, b]))]
    cases = [Case(name, ids) for name, ids in texts]
    for name, prompt in images:
        prepared = engine.prepare(prompt)
        cases.append(Case(name, prepared.token_ids, prepared.images))
    return cases


def _prompt(case: Case) -> Prompt:
    return Prompt(token_ids=case.token_ids, images=case.images)


def part_vs_transformers(ctx: Context, part: dict[str, Any]) -> None:
    """Part 2: our engine (float32) against transformers on the device, both architectures
    (one that raises is recorded as failed and the other still runs)."""
    import transformers

    part["transformers"] = transformers.__version__
    new = QUICK_HF_TOKENS if ctx.quick else HF_TOKENS
    part["new_tokens"] = new
    archs: dict[str, dict[str, Any]] = {}
    part["archs"] = archs
    for arch in QWEN3_ARCHS:
        cls_name = HF_CLASSES[arch]
        if getattr(transformers, cls_name, None) is None:
            archs[arch] = {"ok": True, "skipped": f"transformers {transformers.__version__} "
                                                  f"has no {cls_name}"}
            continue
        archs[arch] = res = {"ok": False}
        try:
            _vs_transformers(ctx, arch, cls_name, new, res)
        except Exception as exc:
            _failed(res, exc)
        ctx.free()
        ctx.save()
    part["ok"] = all(r["ok"] for r in archs.values())
    part["summary"] = "; ".join(_arch_summary(arch, r) for arch, r in archs.items()) + (
        f" ({new} tokens, float32)")


def _vs_transformers(ctx: Context, arch: str, cls_name: str, new: int, res: dict[str, Any]
                     ) -> None:
    """One architecture's tiny checkpoint: our greedy tokens, then transformers', into ``res``."""
    path = write_tiny_qwen3_model(ctx.work / f"tiny-{arch}", arch)
    engine = LLMEngine(path, ctx.engine_config(dtype="float32", num_pages=256,
                                               max_num_batched_tokens=STEP_TOKENS))
    cases = _cases(engine, ctx.quick)
    image_token = engine.model_config.image_token_id
    greedy = SamplingParams(max_new_tokens=new, ignore_eos=True)
    res["stage"] = "ours"
    ours = [r.token_ids for r in engine.generate([_prompt(c) for c in cases], greedy)]
    stats = engine.stats()
    res["hybrid"] = engine.states is not None
    res["slots_and_pages_free"] = (stats["kv_pages_used"] == 0
                                   and stats.get("state_slots_used", 0) == 0)
    del engine
    ctx.free()
    res["stage"] = "transformers"
    hf = hf_load(path, "float32", ctx.device, cls_name)
    # plain argmax on both sides: the checkpoint names an end-of-sequence id (the Qwen2-VL one
    # of the other sections has none), which min_new_tokens would mask out where our
    # ignore_eos only keeps going after it
    hf.generation_config.eos_token_id = None
    refs = [hf_greedy(hf, c, new, image_token) for c in cases]
    del hf
    del res["stage"]
    res["prompts"] = verdicts = [compare(c.name, o, r, len(c.token_ids))
                                 for c, o, r in zip(cases, ours, refs, strict=True)]
    res["equal"] = sum(v["equal"] for v in verdicts)
    res["ok"] = res["equal"] == len(verdicts) and res["slots_and_pages_free"]


def _arch_summary(arch: str, r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"{arch} skipped ({r['skipped']})"
    if "error" in r:
        return f"{arch} raised in {r.get('stage', 'setup')}: {r['error'][:80]}"
    return f"{arch} {r['equal']}/{len(r['prompts'])} equal"


def _failed(res: dict[str, Any], exc: Exception) -> None:
    """Record ``exc`` (raised inside ``res``'s run) as its failure."""
    res["ok"] = False
    res["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    res["traceback"] = traceback.format_exc()[-2000:]


# ---- part 3: MTP drafting against plain decoding ---------------------------------------------

MTP_K = 3
MTP_TOKENS, QUICK_MTP_TOKENS = 32, 16


def part_mtp(ctx: Context, part: dict[str, Any]) -> None:
    """Part 3: Qwen3.5 with its MTP module drafting equals plain decoding on the device, for
    each way the engine keeps a verify's states (one that raises is recorded as failed)."""
    path = make_mtp_predictable(write_tiny_qwen3_model(ctx.work / "tiny-qwen3_5-mtp", "qwen3_5",
                                                       mtp=True))
    new = QUICK_MTP_TOKENS if ctx.quick else MTP_TOKENS
    greedy = SamplingParams(max_new_tokens=new, ignore_eos=True)
    base = {"dtype": "float32", "num_pages": 256, "max_num_batched_tokens": STEP_TOKENS}
    plain_engine = LLMEngine(path, ctx.engine_config(**base))
    prompts = [Prompt(token_ids=list(range(1, 30))), Prompt(token_ids=[5, 6, 7])]
    image = plain_engine.prepare(Prompt(text="What is in the picture?",
                                        images=[png_bytes(96, 64, 7)]))
    prompts.append(Prompt(token_ids=image.token_ids, images=image.images))
    plain = plain_engine.generate(prompts, greedy)
    del plain_engine
    ctx.free()
    part["k"], part["new_tokens"] = MTP_K, new
    runs: dict[str, dict[str, Any]] = {}
    part["runs"] = runs
    for mode in VERIFY_STATES:  # each way of keeping a verify window's linear-attention states
        runs[mode] = run = {"ok": False}
        try:
            _mtp_run(ctx, path, {**base, "verify_states": mode}, prompts, plain, greedy, run)
        except Exception as exc:  # the other mode still runs
            _failed(run, exc)
        ctx.free()
        ctx.save()
    part["ok"] = all(r["ok"] for r in runs.values())
    part["summary"] = "; ".join(
        f"{name} raised: {r['error'][:80]}" if "error" in r else
        f"{name}: {sum(v['equal'] for v in r['prompts'])}/{len(r['prompts'])} equal, "
        f"accepted {r['accepted']}/{r['drafted']}" for name, r in runs.items()
    ) + f" (k={MTP_K}, {new} tokens)"


def _mtp_run(ctx: Context, path: Path, config: dict[str, Any], prompts: list[Prompt],
             plain: list[GenerationResult], greedy: SamplingParams, run: dict[str, Any]) -> None:
    """One MTP engine (``config``): its tokens against ``plain``'s, and its counts, into
    ``run``."""
    from decode_node.spec.eagle_engine import EagleEngine

    engine = LLMEngine(path, ctx.engine_config(**config, lookahead_tokens=MTP_K), draft="mtp")
    spec = EagleEngine(engine, engine.load_draft(), MTP_K)
    got = spec.generate(prompts, greedy)
    st, stats = spec.stats, engine.stats()
    verdicts = [compare(f"prompt_{i}", g.token_ids, p.token_ids, len(p.prompt_token_ids))
                for i, (g, p) in enumerate(zip(got, plain, strict=True))]
    run.update(drafted=st.drafted, accepted=st.accepted, rounds=st.rounds,
               acceptance_length=round(st.acceptance_length, 3),
               slots_and_pages_free=(stats["kv_pages_used"] == 0
                                     and stats.get("state_slots_used", 0) == 0),
               prompts=verdicts)
    # drafts accepted and rejected: both ways of keeping the states ran
    run["both_paths"] = 0 < st.accepted < st.drafted
    run["ok"] = (all(v["equal"] for v in verdicts) and st.rounds > 0 and run["both_paths"]
                 and run["slots_and_pages_free"])


# ---- the section -----------------------------------------------------------------------------

PARTS: tuple[tuple[str, Part], ...] = (
    ("kernels", part_kernels),
    ("vs_transformers", part_vs_transformers),
    ("mtp", part_mtp),
)


def check_hybrid(ctx: Context, res: dict[str, Any]) -> None:
    """(f) the three parts above, each into ``res[name]``; ok when every part is (a skipped
    part is). Raises after the last part when one raised (its error and traceback are in its
    entry)."""
    errors: list[tuple[str, Exception]] = []
    for name, body in PARTS:
        part: dict[str, Any] = {"ok": False}
        res[name] = part
        start = time.monotonic()
        try:
            body(ctx, part)
        except Exception as exc:  # the other parts still run (BaseException: the run ends)
            part["ok"] = False
            part["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            part["traceback"] = traceback.format_exc()[-3000:]
            part.setdefault("summary", f"error: {part['error'][:150]}")
            errors.append((name, exc))
        finally:
            part["elapsed_s"] = round(time.monotonic() - start, 1)
            ctx.free()
            ctx.save()
    res["ok"] = all(res[name]["ok"] for name, _ in PARTS)
    res["summary"] = " | ".join(f"{name}: {'' if res[name]['ok'] else 'FAIL '}"
                                f"{res[name].get('summary', '')}" for name, _ in PARTS)
    if errors:
        first, err = errors[0]
        raise RuntimeError(f"part {', '.join(n for n, _ in errors)} raised; first ({first}): "
                           f"{type(err).__name__}: {err}"[:2000]) from err
