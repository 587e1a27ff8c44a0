"""``pdserve client``: call a router's ``Generate`` and stream the answer to the terminal.

Text goes to stdout as it arrives (one flush per message) followed by a newline; ``--json``
prints one JSON object at the end instead. gRPC errors print ``error: <CODE>: <details>`` on
stderr and exit with status 2. ``--target A,B`` names several routers in front of the same
workers: :class:`router.client.RouterClient` fails over between them.

``--chat`` renders the prompt here, with the chat template the router serves: the client asks
``GetModelInfo`` for it first (a router that reports none gets the built-in ChatML) and sends the
rendered text. ``ModelInfo`` carries no special tokens, so a template that writes ``bos_token``
or ``eos_token`` itself renders them empty here; the HTTP door renders with them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.arg_types import UINT32_MAX, UINT64_MAX, int_in, positive_float
from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.text.chat_template import ChatTemplate
    from router.client import RouterClient

EXIT_ERROR = 2


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="prompt text")
    p.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT[,HOST:PORT...]",
                   help="the router; several, comma-separated, are tried in order: a router "
                        "that is unavailable, before or during the stream, hands the request to "
                        "the next (a stream already started only when greedy or seeded: see "
                        "docs/deploy.md, 'Two routers')")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="PNG/JPEG image (repeatable, prompt order)")
    p.add_argument("--video-frames", action="append", default=[], metavar="A.png,B.png",
                   help="one video as its encoded frames in time order (repeatable; frame "
                        "videos come before --video-patches ones, after the images)")
    p.add_argument("--video-fps", type=float, default=0.0, metavar="F",
                   help="frames per second of every --video-frames video (0: the model's default)")
    p.add_argument("--video-patches", action="append", default=[], metavar="F.npy",
                   help="one video as float32 patches [t*h*w, patch_dim] in a .npy file "
                        "(repeatable, each with its --video-grid)")
    p.add_argument("--video-grid", action="append", default=[], metavar="T,H,W",
                   help="the patch grid of the --video-patches file at the same position")
    p.add_argument("--video-second-per-grid", type=float, default=0.0, metavar="S",
                   help="seconds per temporal grid step of every video (0: derived from the fps "
                        "for frames, 1.0 for patches)")
    p.add_argument("--token-ids", metavar="1,2,3", help="the prompt as token ids (instead of text)")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message (after the images) in the chat "
                        "template the router serves (GetModelInfo)")
    p.add_argument("--max-new-tokens", type=int_in(0, UINT32_MAX), default=0,
                   help="0 = the router's default")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 means greedy (unset: the checkpoint's generation_config.json, else 0)")
    p.add_argument("--top-p", type=float, default=None, help="1 means off (unset: checkpoint's)")
    p.add_argument("--top-k", type=int_in(0, UINT32_MAX), default=None,
                   help="0 means off (unset: checkpoint's)")
    p.add_argument("--min-p", type=float, default=None, help="0 means off (unset: checkpoint's)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="1 means off (unset: checkpoint's)")
    p.add_argument("--frequency-penalty", type=float, default=None, help="in [-2, 2]; 0 = off")
    p.add_argument("--presence-penalty", type=float, default=None, help="in [-2, 2]; 0 = off")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="a stop string: the text ends before it (repeatable)")
    p.add_argument("--seed", type=int_in(0, UINT64_MAX), default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--request-id", default="")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--timeout", type=positive_float, default=None, metavar="S",
                   help="deadline in seconds")
    p.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="PEM CA certificate (or the router's self-signed one): connect over TLS")
    p.add_argument("--auth-token-file", default=None, metavar="FILE",
                   help="send 'authorization: Bearer <token>' with the token in FILE")


def build_request(args: argparse.Namespace, template: ChatTemplate | None = None) -> Any:
    """The ``GenerateRequest`` for ``args``, a ``--chat`` prompt rendered with ``template`` (None:
    the built-in ChatML); raises ValueError on unusable flags, InvalidRequestError when the
    template refuses the message."""
    from engine.text.chat_template import ChatTemplate, user_message
    from proto.pdserve.v1 import generate_pb2 as gpb

    sampling = gpb.SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
                                  stop=args.stop)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty"):
        if getattr(args, name) is not None:  # unset fields take the checkpoint's defaults
            setattr(sampling, name, getattr(args, name))
    if args.seed is not None:
        sampling.seed = args.seed
    req = gpb.GenerateRequest(request_id=args.request_id, sampling=sampling)
    if args.token_ids is not None:
        if args.prompt is not None:
            raise ValueError("give a prompt text or --token-ids, not both")
        if args.chat:
            raise ValueError("--chat formats a prompt text; it does not apply to --token-ids")
        try:
            ids = [int(x) for x in args.token_ids.split(",") if x.strip()]
            valid = all(0 <= i <= UINT32_MAX for i in ids)
        except ValueError:
            valid = False
        if not valid:
            raise ValueError(f"--token-ids must be comma-separated integers in [0, {UINT32_MAX}], "
                             f"got {args.token_ids!r}")
        req.token_ids.ids.extend(ids)
    elif args.prompt is not None:
        message = user_message(args.prompt, images=len(args.image),
                               videos=len(args.video_frames) + len(args.video_patches))
        req.text = (template or ChatTemplate.builtin()).render([message]) if args.chat \
            else args.prompt
    else:
        raise ValueError("give a prompt text or --token-ids")
    for path in args.image:
        req.images.add(encoded=Path(path).read_bytes())
    req.videos.extend(_videos(args))
    return req


def _videos(args: argparse.Namespace) -> list[Any]:
    """The request's ``Video`` messages: ``--video-frames`` ones, then ``--video-patches`` ones;
    raises ValueError on unusable flags, OSError on unreadable files."""
    import numpy as np

    from proto.convert import patches_message
    from proto.pdserve.v1 import generate_pb2 as gpb

    if len(args.video_grid) != len(args.video_patches):
        raise ValueError(f"give one --video-grid per --video-patches: {len(args.video_patches)} "
                         f"patch files, {len(args.video_grid)} grids")
    seconds = args.video_second_per_grid
    out = []
    for paths in args.video_frames:
        frames = [Path(f.strip()).read_bytes() for f in paths.split(",") if f.strip()]
        out.append(gpb.Video(frames=gpb.VideoFrames(frames=frames, fps=args.video_fps),
                             second_per_grid=seconds))
    for path, grid_text in zip(args.video_patches, args.video_grid, strict=True):
        array = np.load(path, allow_pickle=False)
        if array.ndim != 2 or array.dtype.kind != "f":
            raise ValueError(f"{path}: video patches must be a 2-D float array, got "
                             f"{array.dtype} {array.shape}")
        try:
            t, h, w = (int(x) for x in grid_text.split(","))
        except ValueError:
            raise ValueError(f"--video-grid must be T,H,W, got {grid_text!r}") from None
        out.append(gpb.Video(patches=patches_message(array, (t, h, w)), second_per_grid=seconds))
    return out


def run_client(args: argparse.Namespace) -> int:
    """Stream one request; returns the exit status."""
    import grpc

    from router.client import RouterClient
    from serving.auth import bearer_metadata, read_secret
    from serving.server import MAX_MESSAGE_BYTES

    try:
        req = build_request(args)  # flags checked before any call; --chat renders again below
        metadata = bearer_metadata(read_secret(args.auth_token_file))
        ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
        targets = [t.strip() for t in args.target.split(",") if t.strip()]
        if not targets:
            raise ValueError(f"--target names no router: {args.target!r}")
    except (ValueError, OSError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    # RouterClient adds the default keepalive: a router that vanished mid-stream ends the call
    # (UNAVAILABLE) within about 10 s, also without --timeout
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    result: dict[str, Any] = {"request_id": "", "token_ids": [], "text": "",
                              "finish_reason": "", "usage": {}}
    try:
        with RouterClient(targets, root_cert=ca, metadata=metadata, options=options) as client:
            if args.chat:
                req = build_request(args, _router_template(client, args.timeout))
            for msg in client.generate(req, timeout=args.timeout):
                _accumulate(result, msg)
                if not args.json and msg.text:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
    except grpc.RpcError as exc:
        if not args.json:
            sys.stdout.write("\n")
        code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
        details = exc.details() if hasattr(exc, "details") else str(exc)
        print(f"error: {code}: {details}", file=sys.stderr)
        return EXIT_ERROR
    except EngineError as exc:  # the router's chat template does not compile or refuses
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(result))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


def _router_template(client: RouterClient, timeout: float | None) -> ChatTemplate:
    """The chat template the router serves (GetModelInfo), or ChatML if it reports none."""
    from engine.text.chat_template import ChatTemplate

    info = client.model_info(timeout)
    if not info.chat_template:
        return ChatTemplate.builtin()
    return ChatTemplate(info.chat_template, f"the router's {info.chat_template_source}",
                        dict(info.chat_special_tokens))


def _accumulate(result: dict[str, Any], msg: Any) -> None:
    result["request_id"] = msg.request_id
    result["token_ids"].extend(msg.token_ids)
    result["text"] += msg.text
    if msg.logprobs:
        result.setdefault("logprobs", []).extend(msg.logprobs)
    if msg.finished:
        result["finish_reason"] = msg.finish_reason
        u = msg.usage
        result["usage"] = {"prompt_tokens": u.prompt_tokens,
                           "completion_tokens": u.completion_tokens,
                           "drafted_tokens": u.drafted_tokens,
                           "accepted_tokens": u.accepted_tokens}
