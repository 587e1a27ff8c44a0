"""``pdserve generate``: batched in-process generation from text or exact token ids."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cli.engine_args import add_engine_args, engine_config
from cli.models import ensure_model
from engine.chat import chat_prompt
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.inputs import ImageInput
    from engine.llm_engine import GenerationResult


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
    p.add_argument("--chat", action="store_true",
                   help="each prompt text is a user message in the chat format (engine/chat.py)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="upper bound; generation also stops at the model's end-of-sequence ids")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(p)


def _parse_ids(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        msg = f"{what} must be comma-separated integers, got {text!r}"
        raise InvalidRequestError(msg) from None


def _images(args: argparse.Namespace) -> list[bytes | ImageInput]:
    import numpy as np
    import torch

    from engine.inputs import ImageInput

    if len(args.image_patches) != len(args.image_grid):
        raise InvalidRequestError("give one --image-grid for each --image-patches")
    images: list[bytes | ImageInput] = [Path(f).read_bytes() for f in args.image]
    for path, grid_text in zip(args.image_patches, args.image_grid, strict=True):
        grid = _parse_ids(grid_text, "--image-grid")
        if len(grid) != 3:
            raise InvalidRequestError(f"--image-grid needs T,H,W, got {grid_text!r}")
        try:
            array = np.load(path, allow_pickle=False)
        except ValueError as exc:
            raise InvalidRequestError(f"{path}: not a .npy array: {exc}") from exc
        patches = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        images.append(ImageInput(patches, (grid[0], grid[1], grid[2])))
    return images


def run_generate(args: argparse.Namespace) -> int:
    """Generate for every prompt in one batch; print each result, then a throughput line
    (or one JSON object per prompt with ``--json``)."""
    from engine.llm_engine import LLMEngine, Prompt
    from engine.request import SamplingParams

    model_dir = ensure_model(args.model)
    images = _images(args)
    texts = [chat_prompt(t) for t in args.prompts] if args.chat else args.prompts
    prompts = [Prompt(text=t, images=images) for t in texts]
    prompts += [Prompt(token_ids=_parse_ids(t, "--token-ids"), images=images)
                for t in args.token_ids]
    if not prompts:
        raise InvalidRequestError("give at least one prompt text or --token-ids")
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_new_tokens=args.max_new_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(model_dir, engine_config(args))
    start = time.perf_counter()
    results = engine.generate(prompts, sampling)
    elapsed = time.perf_counter() - start
    for res in results:
        print(json.dumps(_as_json(res)) if args.json else (res.text or str(res.token_ids)))
    if not args.json:
        total = sum(len(r.token_ids) for r in results)
        print(f"[{len(results)} prompts, {total} tokens in {elapsed:.2f}s: "
              f"{total / max(elapsed, 1e-9):.1f} tokens/s]")
    return 0


def _as_json(res: GenerationResult) -> dict[str, object]:
    return {
        "request_id": res.request_id,
        "prompt_token_ids": res.prompt_token_ids,
        "token_ids": res.token_ids,
        "text": res.text,
        "logprobs": res.logprobs,
        "finish_reason": res.finish_reason.value,
    }
