"""``pdserve generate``: batched in-process generation from text or exact token ids, plain or in
EAGLE rounds (``--draft``)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cli.engine_args import (
    add_draft_args,
    add_engine_args,
    add_tp_args,
    draft_dir,
    engine_config,
)
from cli.models import ensure_model
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

    from decode_node.spec.eagle_engine import EagleEngine
    from engine.llm_engine import GenerationResult, LLMEngine
    from engine.multimodal.inputs import ImageInput, VideoInput


DEFAULT_MAX_NEW_TOKENS = 128
# flags that, left unset, take the checkpoint's generation_config.json value (else the default)
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", help="prompt texts (each one is a request)")
    p.add_argument("--token-ids", action="append", default=[], metavar="1,2,3",
                   help="a prompt as comma-separated token ids (repeatable)")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="PNG/JPEG image given to every prompt, in order (repeatable)")
    p.add_argument("--image-patches", action="append", default=[], metavar="FILE.npy",
                   help="precomputed float32 patches [t*h*w, C*T*P*P] (repeatable, prompt order)")
    p.add_argument("--image-grid", action="append", default=[], metavar="T,H,W",
                   help="grid of the matching --image-patches")
    p.add_argument("--video-patches", action="append", default=[], metavar="FILE.npy",
                   help="precomputed float32 video patches [t*h*w, C*T*P*P] given to every "
                        "prompt (repeatable, prompt order)")
    p.add_argument("--video-grid", action="append", default=[], metavar="T,H,W",
                   help="grid of the matching --video-patches")
    p.add_argument("--video-second-per-grid", action="append", default=[], type=float,
                   metavar="S", help="seconds per temporal patch of the matching "
                                     "--video-patches (none given: 1.0 each)")
    p.add_argument("--chat", action="store_true",
                   help="each prompt text is a user message (after the images) in the "
                        "checkpoint's chat template (ChatML when it has none)")
    # unset sampling flags take the checkpoint's generation_config.json value, else the default
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="upper bound (default 128); generation also stops at the model's "
                        "end-of-sequence ids")
    p.add_argument("--temperature", type=float, default=None, help="0 (the default) is greedy")
    p.add_argument("--top-p", type=float, default=None, help="1 (the default) is off")
    p.add_argument("--top-k", type=int, default=None, help="0 (the default) is off")
    p.add_argument("--min-p", type=float, default=None, help="0 (the default) is off")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="1 (the default) is off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]; 0 = off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]; 0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(p)
    add_tp_args(p)
    add_draft_args(p, decode=True)


def _parse_ids(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        msg = f"{what} must be comma-separated integers, got {text!r}"
        raise InvalidRequestError(msg) from None


def _images(args: argparse.Namespace) -> list[bytes | ImageInput]:
    from engine.multimodal.inputs import ImageInput

    if len(args.image_patches) != len(args.image_grid):
        raise InvalidRequestError("give one --image-grid for each --image-patches")
    images: list[bytes | ImageInput] = [Path(f).read_bytes() for f in args.image]
    for path, grid_text in zip(args.image_patches, args.image_grid, strict=True):
        patches, grid = _load_patches(path, grid_text, "--image-grid")
        images.append(ImageInput(patches, grid))
    return images


def _videos(args: argparse.Namespace) -> list[VideoInput]:
    from engine.multimodal.inputs import VideoInput

    if len(args.video_patches) != len(args.video_grid):
        raise InvalidRequestError("give one --video-grid for each --video-patches")
    seconds = args.video_second_per_grid or [1.0] * len(args.video_patches)
    if len(seconds) != len(args.video_patches):
        raise InvalidRequestError(
            "give one --video-second-per-grid for each --video-patches, or none")
    videos = []
    for path, grid_text, secs in zip(args.video_patches, args.video_grid, seconds, strict=True):
        patches, grid = _load_patches(path, grid_text, "--video-grid")
        videos.append(VideoInput(patches, grid, secs))
    return videos


def _load_patches(
    path: str, grid_text: str, flag: str
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Float32 patches from a ``.npy`` file and the ``T,H,W`` grid given with ``flag``."""
    import numpy as np
    import torch

    grid = _parse_ids(grid_text, flag)
    if len(grid) != 3:
        raise InvalidRequestError(f"{flag} needs T,H,W, got {grid_text!r}")
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise InvalidRequestError(f"{path}: not a .npy array: {exc}") from exc
    patches = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    return patches, (grid[0], grid[1], grid[2])


def run_generate(args: argparse.Namespace) -> int:
    """Generate for every prompt in one batch; print each result, then a throughput line
    (or one JSON object per prompt with ``--json``)."""
    from engine.core.request import SamplingParams
    from engine.llm_engine import Prompt
    from engine.sampling.generation_config import GenerationDefaults

    model_dir = ensure_model(args.model)
    images = _images(args)
    videos = _videos(args)
    texts = _chat_texts(model_dir, args.prompts, len(images), len(videos)) if args.chat \
        else args.prompts
    prompts = [Prompt(text=t, images=images, videos=videos) for t in texts]
    prompts += [Prompt(token_ids=_parse_ids(t, "--token-ids"), images=images, videos=videos)
                for t in args.token_ids]
    if not prompts:
        raise InvalidRequestError("give at least one prompt text or --token-ids")
    defaults = GenerationDefaults.from_dir(model_dir)
    chosen = {name: getattr(args, name) if getattr(args, name) is not None
              else getattr(defaults, name) for name in _DEFAULTED}
    chosen["max_new_tokens"] = chosen["max_new_tokens"] or DEFAULT_MAX_NEW_TOKENS
    sampling = SamplingParams(
        **{name: value for name, value in chosen.items() if value is not None},
        seed=args.seed, ignore_eos=args.ignore_eos, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
    )
    engine, spec = _runner(model_dir, args)
    start = time.perf_counter()
    try:
        results = (spec or engine).generate(prompts, sampling)
    finally:
        engine.close()
    elapsed = time.perf_counter() - start
    for res in results:
        print(json.dumps(_as_json(res, spec)) if args.json else (res.text or str(res.token_ids)))
    if not args.json:
        total = sum(len(r.token_ids) for r in results)
        rounds = (f"; EAGLE: {spec.stats.acceptance_length:.2f} tokens per round"
                  if spec is not None else "")
        print(f"[{len(results)} prompts, {total} tokens in {elapsed:.2f}s: "
              f"{total / max(elapsed, 1e-9):.1f} tokens/s{rounds}]")
    return 0


def _runner(model_dir: Path, args: argparse.Namespace) -> tuple[LLMEngine, EagleEngine | None]:
    """The engine, and with ``--draft`` the EAGLE rounds over it (the engine then looks ahead
    as far as a round writes)."""
    from dataclasses import replace

    from decode_node.spec.eagle_engine import EagleEngine, spec_refusal
    from decode_node.spec.tree import TreeShape
    from engine.config import ModelConfig
    from engine.errors import ConfigError
    from engine.llm_engine import LLMEngine

    config = engine_config(args)
    if args.draft is None:
        return LLMEngine(model_dir, config), None
    shape = TreeShape(args.num_draft_tokens, args.draft_topk, args.draft_steps)  # checks flags
    refusal = spec_refusal(ModelConfig.from_dir(model_dir).text, shape)
    if refusal is not None:  # before anything loads
        raise ConfigError(refusal)
    engine = LLMEngine(model_dir, replace(config, lookahead_tokens=shape.lookahead),
                       draft=draft_dir(args, model_dir))
    try:
        return engine, EagleEngine(engine, engine.load_draft(), args.num_draft_tokens,
                                   args.draft_topk, args.draft_steps)
    except BaseException:
        engine.close()
        raise


def _chat_texts(model_dir: Path, prompts: list[str], images: int, videos: int) -> list[str]:
    """Each prompt as one user message, its ``images`` image parts and ``videos`` video parts
    first, in the checkpoint's chat template (engine/text/chat_template.py)."""
    from engine.text.chat_template import ChatTemplate, user_message

    template = ChatTemplate.from_dir(model_dir)
    return [template.render([user_message(t, images=images, videos=videos)]) for t in prompts]


def _as_json(res: GenerationResult, spec: EagleEngine | None) -> dict[str, object]:
    """One prompt's result; with ``--draft`` also its drafted and accepted tokens and rounds."""
    out: dict[str, object] = {
        "request_id": res.request_id,
        "prompt_token_ids": res.prompt_token_ids,
        "token_ids": res.token_ids,
        "text": res.text,
        "logprobs": res.logprobs,
        "finish_reason": res.finish_reason.value,
    }
    if spec is not None:
        stats = spec.request_stats.get(res.request_id)
        out["drafted_tokens"] = stats.drafted if stats else 0
        out["accepted_tokens"] = stats.accepted if stats else 0
        out["rounds"] = stats.rounds if stats else 0
    return out
