"""``pdserve client``: call a router's ``Generate`` and stream the answer to the terminal.

Text goes to stdout as it arrives (one flush per message) followed by a newline; ``--json``
prints one JSON object at the end instead. gRPC errors print ``error: <CODE>: <details>`` on
stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.chat import chat_prompt

if TYPE_CHECKING:
    import grpc

EXIT_ERROR = 2


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="prompt text")
    p.add_argument("--target", default="127.0.0.1:50051", help="router HOST:PORT")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="PNG/JPEG image (repeatable, prompt order)")
    p.add_argument("--token-ids", metavar="1,2,3", help="the prompt as token ids (instead of text)")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message in the chat format (engine/chat.py)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="0 = the router's default")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=0.0, help="0 means off (1.0)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--request-id", default="")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="deadline in seconds")
    p.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="PEM CA certificate (or the router's self-signed one): connect over TLS")
    p.add_argument("--auth-token-file", default=None, metavar="FILE",
                   help="send 'authorization: Bearer <token>' with the token in FILE")


def build_request(args: argparse.Namespace) -> Any:
    """The ``GenerateRequest`` for ``args``; raises ValueError on unusable flags."""
    from proto.pdserve.v1 import generate_pb2 as gpb

    sampling = gpb.SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
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
        except ValueError:
            raise ValueError(f"--token-ids must be comma-separated integers, got "
                             f"{args.token_ids!r}") from None
        req.token_ids.ids.extend(ids)
    elif args.prompt is not None:
        req.text = chat_prompt(args.prompt) if args.chat else args.prompt
    else:
        raise ValueError("give a prompt text or --token-ids")
    for path in args.image:
        req.images.add(encoded=Path(path).read_bytes())
    return req


def run_client(args: argparse.Namespace) -> int:
    """Stream one request; returns the exit status."""
    import grpc

    from proto.pdserve.v1 import generate_pb2_grpc
    from serving.auth import bearer_metadata, read_secret
    from serving.server import MAX_MESSAGE_BYTES

    try:
        req = build_request(args)
        metadata = bearer_metadata(read_secret(args.auth_token_file))
        ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    result: dict[str, Any] = {"request_id": "", "token_ids": [], "text": "",
                              "finish_reason": "", "usage": {}}
    try:
        with _channel(args.target, options, ca) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            for msg in stub.Generate(req, timeout=args.timeout, metadata=metadata):
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
    if args.json:
        print(json.dumps(result))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


def _channel(target: str, options: list[tuple[str, int]], ca: bytes | None) -> grpc.Channel:
    import grpc

    if ca is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca),
                               options=options)


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
