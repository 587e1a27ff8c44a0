"""The one table of the project's Triton kernels and every configuration their launchers can
pick, for the GPU-readiness suite (``test_gpu_readiness.py``).

Configurations are not written out by hand: each kernel's entry enumerates the launch inputs
(dtypes, head dims, group sizes, ``max_q``, tree or chain, split counts, fill widths) and asks the
launcher's own choice functions (:mod:`engine.attention.kernels.configs`,
the fill tile there too) what they launch, so the table cannot drift from
the code. This module must not import a kernel module (its kernels would be built in the
calling process, maybe under ``TRITON_INTERPRET=1``): kernels are named ``"module:function"``
and compiled in a subprocess (``compile_kernels.py``).

A new ``@triton.jit`` function is covered by adding an entry to :data:`KERNELS` (a launched
kernel) or :data:`HELPERS` (a function only called from kernels, compiled inside them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.attention.kernels.configs import (
    DTYPES,
    HEAD_DIM_PADS,
    MAX_GROUP,
    decode_launch,
    decode_splits,
    extend_launch,
    fill_tile,
    next_power_of_2,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "decode_node", "prefill_node", "transfer", "serving")
TRITON_TYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
TARGETS = (90, 80)  # compute capabilities: Hopper, Ampere
# largest dynamic shared memory one block may opt in to (CUDA programming guide, table 21)
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}


@dataclass(frozen=True)
class Job:
    """One compile: a kernel, its argument types and constexprs, for one target."""

    kernel: str  # "package.module:function"
    label: str
    signature: dict[str, str]  # every non-constexpr argument -> Triton type
    constexprs: dict[str, int | bool]
    aligned: tuple[str, ...]  # arguments hinted divisible by 16 (as a launch on torch tensors)
    num_warps: int = 4
    num_stages: int = 3
    arch: int = 90

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def id(self) -> str:
        return f"{self.kernel.split(':')[1]}[{self.label}]@sm{self.arch}"


@dataclass(frozen=True)
class Kernel:
    kernel: str
    configs: Callable[[], Iterator[Job]]  # one Job per configuration (arch filled in later)
    helpers: tuple[str, ...] = field(default=())


# -- paged attention (engine/attention/kernels/paged_attention.py) ------------------------------

_PA = "engine.attention.kernels.paged_attention"
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # every padded head dim, and one that needs masking
GROUPS = tuple(g for g in (1, 2, 4, 8, 16) if g <= MAX_GROUP)
MAX_QS = (1, 2, 4, 8, 16, 32, 64, 2048)  # decode-free steps: verify windows up to prefill chunks
WINDOW = 8  # a tree's window (a constexpr; its value changes index arithmetic only)
MAX_SPLITS = 16  # TritonPagedAttention's default max_splits


def _ptrs(names: str, ty: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), ty)


def _ints(names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), "i32")


def _extend_jobs() -> Iterator[Job]:
    assert {d for d in HEAD_DIMS if d == next_power_of_2(d)} >= set(HEAD_DIM_PADS)
    seen = set()
    for dtype in DTYPES:
        for dim in HEAD_DIMS:
            for tree in (False, True):
                for group in GROUPS:
                    for max_q in MAX_QS:
                        cfg = extend_launch(dtype, dim, group, max_q)
                        rows = cfg.block_q * cfg.group_pad
                        # the tile is (rows x D_PAD); GROUP only changes index arithmetic
                        key = (dtype, dim, tree, rows)
                        if key in seen:
                            continue
                        seen.add(key)
                        sig = {**_ptrs("q_ptr k_ptr v_ptr o_ptr", "*" + TRITON_TYPE[dtype]),
                               **_ptrs("q_starts kv_lens page_table", "*i32"),
                               "tree_mask": "*u8" if tree else "*i32", "scale": "fp32",
                               **_ints("stride_qt stride_qh stride_ot stride_oh stride_ks "
                                       "stride_kh stride_pt stride_tb stride_tq")}
                        yield Job(
                            f"{_PA}:_extend_kernel",
                            f"{dtype}-D{dim}-{'tree' if tree else 'chain'}-g{group}-rows{rows}",
                            sig,
                            {"GROUP": group, "GROUP_PAD": cfg.group_pad, "BLOCK_Q": cfg.block_q,
                             "D": dim, "D_PAD": cfg.d_pad, "BLOCK_N": cfg.block_n,
                             "PAGE_SIZE": 16, "DOT_F32": False, "TREE": tree,
                             "WINDOW": WINDOW if tree else 0},
                            ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "q_starts", "kv_lens",
                             "page_table", "tree_mask"),
                            cfg.num_warps, cfg.num_stages)


def _split_counts() -> list[int]:
    return sorted({decode_splits(s, h, MAX_SPLITS) for s in range(1, 129) for h in (1, 2, 8)})


def _decode_jobs() -> Iterator[Job]:
    seen = set()
    for dtype in DTYPES:
        for dim in HEAD_DIMS:
            for group in GROUPS:
                for splits in _split_counts():
                    cfg = decode_launch(dtype, dim, group)
                    # the split count changes arithmetic and the one-split store only
                    key = (dtype, dim, cfg.group_pad, splits > 1)
                    if key in seen:
                        continue
                    seen.add(key)
                    sig = {**_ptrs("q_ptr k_ptr v_ptr o_ptr", "*" + TRITON_TYPE[dtype]),
                           **_ptrs("part_o part_lse", "*fp32"),
                           **_ptrs("kv_lens page_table", "*i32"), "scale": "fp32",
                           **_ints("stride_qt stride_qh stride_ot stride_oh stride_ks stride_kh "
                                   "stride_pt num_heads")}
                    yield Job(f"{_PA}:_decode_kernel", f"{dtype}-D{dim}-g{group}-s{splits}", sig,
                              {"GROUP": group, "GROUP_PAD": cfg.group_pad, "NUM_SPLITS": splits,
                               "D": dim, "D_PAD": cfg.d_pad, "BLOCK_N": cfg.block_n,
                               "PAGE_SIZE": 16, "DOT_F32": False},
                              ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "part_o", "part_lse",
                               "kv_lens", "page_table"),
                              cfg.num_warps, cfg.num_stages)


def _merge_jobs() -> Iterator[Job]:
    pads = sorted({next_power_of_2(s) for s in _split_counts() if s > 1})
    for dtype in DTYPES:
        for dim in HEAD_DIMS:
            for pad in pads:
                splits = pad  # the widest split count of this padding
                sig = {"o_ptr": "*" + TRITON_TYPE[dtype], **_ptrs("part_o part_lse", "*fp32"),
                       **_ints("stride_ot stride_oh num_heads")}
                yield Job(f"{_PA}:_merge_kernel", f"{dtype}-D{dim}-s{splits}", sig,
                          {"NUM_SPLITS": splits, "SPLITS_PAD": pad, "D": dim,
                           "D_PAD": max(16, next_power_of_2(dim))},
                          ("o_ptr", "part_o", "part_lse"))


# -- speculative decoding's buffer fill (decode_node/spec/fill_triton.py) ------------------------

FILL_TOKENS = (1, 2, 3, 4, 5, 8, 16, 32, 64)  # num_tokens_per_bs: chains and draft trees
FILL_HIDDEN = (64, 8192)  # a tiny draft model and a wide one (BLOCK_H saturates)


def _fill_jobs() -> Iterator[Job]:
    i64 = ("input_ids positions mrope_positions out_cache_loc seq_lens req_indices "
           "num_correct_drafts num_accept_tokens select_index mrope_deltas "
           "src_input_ids src_positions src_out_cache_loc src_seq_lens src_req_indices "
           "src_num_correct_drafts src_num_accept_tokens src_mrope_deltas")
    seen = set()
    for dtype in DTYPES:
        for hidden in FILL_HIDDEN:
            for n in FILL_TOKENS:
                block_n, block_h, warps = fill_tile(n, hidden)
                if (dtype, n, block_h) in seen:
                    continue
                seen.add((dtype, n, block_h))
                sig = {**_ptrs(i64, "*i64"),
                       **_ptrs("hidden_states src_hidden_states", "*" + TRITON_TYPE[dtype]),
                       **_ptrs("temperatures src_temperatures", "*fp32"),
                       **_ints("raw_bs num_front_tokens pad_slot hidden_size mrope_stride"),
                       "seq_len_fill_value": "i64"}
                yield Job("decode_node.spec.fill_triton:_fill_rows", f"{dtype}-N{n}-H{hidden}",
                          sig, {"N": n, "BLOCK_N": block_n, "BLOCK_H": block_h},
                          tuple(k for k, v in sig.items() if v.startswith("*")), warps)


KERNELS: tuple[Kernel, ...] = (
    Kernel(f"{_PA}:_extend_kernel", _extend_jobs, helpers=("_attend",)),
    Kernel(f"{_PA}:_decode_kernel", _decode_jobs, helpers=("_attend",)),
    Kernel(f"{_PA}:_merge_kernel", _merge_jobs),
    Kernel("decode_node.spec.fill_triton:_fill_rows", _fill_jobs),
)
# functions only called from the kernels above (inlined, compiled with them)
HELPERS = {"_attend": "engine.attention.kernels.paged_attention"}


def all_jobs(archs: tuple[int, ...] = TARGETS) -> list[Job]:
    return [Job(**{**job.as_json(), "arch": arch})
            for kernel in KERNELS for job in kernel.configs() for arch in archs]


# -- the source tree's Triton functions ---------------------------------------------------------

# the decorator's arguments may span lines (``do_not_specialize=[...]``, no parentheses inside)
_DECORATED = re.compile(r"^@triton\.jit\b(?:\([^()]*\))?[^\n]*\n(?:@[^\n]*\n)*def (\w+)",
                        re.MULTILINE)
_CALLED = re.compile(r"\btriton\.jit\(\s*(\w+)\b(?!\s*=)")


def triton_functions(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Every Triton function in ``packages`` under ``root``: ``{name: module}``, whether
    decorated (``@triton.jit``) or wrapped (``triton.jit(fn, ...)``)."""
    found = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            text = path.read_text()
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            for name in _DECORATED.findall(text) + _CALLED.findall(text):
                found[name] = module
    return found


def covered() -> dict[str, str]:
    """The functions the table covers: ``{name: module}``."""
    names = {k.kernel.split(":")[1]: k.kernel.split(":")[0] for k in KERNELS}
    return {**names, **HELPERS}


def missing(found: dict[str, str]) -> list[str]:
    """``module:name`` of each found Triton function the table does not cover."""
    table = covered()
    return sorted(f"{mod}:{name}" for name, mod in found.items() if table.get(name) != mod)
