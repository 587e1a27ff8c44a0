"""The tokenizer endpoints vLLM serves beside its OpenAI API, for clients that tokenize through
the server (lm-evaluation-harness's ``remote`` tokenizer, load generators):

- ``POST /tokenize`` ``{"prompt": str, "add_special_tokens": bool}`` or ``{"messages": [...]}``
  (rendered with the served chat template and the body's ``tools``/``tool_choice``, as
  ``/v1/chat/completions`` does) -> ``{"tokens", "count", "max_model_len"}``;
- ``POST /detokenize`` ``{"tokens": [ids]}`` -> ``{"prompt": str}`` (special tokens kept);
- ``GET /tokenizer_info`` -> the special tokens (``eos_token``, ``bos_token``, ``pad_token``),
  the chat template and the vocabulary size.

Plain functions of a request body and the model's assets; :class:`BadRequest` (HTTP 400) for
anything unusable, including a model without a tokenizer.
"""

from __future__ import annotations

from typing import Any

from engine.text.tokenizer import Tokenizer
from router.openai_request import BadRequest, chat_prompt
from router.openai_tools import tool_use
from router.preprocess import ModelAssets


def tokenize(body: dict[str, Any], assets: ModelAssets) -> dict[str, Any]:
    """``/tokenize``: the token ids of a prompt, or of chat messages after the template."""
    tok = _tokenizer(assets)
    special = body.get("add_special_tokens", "messages" not in body)
    if not isinstance(special, bool):
        raise BadRequest("'add_special_tokens' must be a boolean")
    if "messages" in body:
        tools = tool_use(body).tools
        text = chat_prompt(body["messages"], assets.chat_template, tools).text
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        raise BadRequest("'prompt' must be a string (or give 'messages')")
    ids = tok.encode(text, add_special_tokens=special)
    return {"tokens": ids, "count": len(ids), "max_model_len": assets.max_model_len}


def detokenize(body: dict[str, Any], assets: ModelAssets) -> dict[str, Any]:
    """``/detokenize``: the text of token ids."""
    tok = _tokenizer(assets)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < assets.vocab_size
            for t in ids):
        raise BadRequest(f"'tokens' must be a list of token ids below {assets.vocab_size}")
    return {"prompt": tok.decode(ids, skip_special_tokens=False)}


def tokenizer_info(assets: ModelAssets) -> dict[str, Any]:
    """``/tokenizer_info``: special tokens (the chat template's; EOS else the config's first),
    the chat template and the vocabulary size."""
    tok = _tokenizer(assets)
    special = dict(assets.chat_template.special_tokens)
    eos = special.get("eos_token") or _first_token(tok, assets.config.eos_token_ids)
    return {"eos_token": eos, "bos_token": special.get("bos_token"),
            "pad_token": special.get("pad_token"),
            "chat_template": assets.chat_template.text, "vocab_size": assets.vocab_size,
            "max_model_len": assets.max_model_len}


def _first_token(tok: Tokenizer, ids: tuple[int, ...]) -> str | None:
    return tok.id_to_token(ids[0]) if ids else None


def _tokenizer(assets: ModelAssets) -> Tokenizer:
    if assets.tokenizer is None:
        raise BadRequest("the served model has no tokenizer (tokenizer.json)")
    return assets.tokenizer
