"""Train the built-in tiny Qwen2-VL-architecture model and its EAGLE draft on CPU, from a seed.

    python scripts/train_tiny.py --out engine/builtin/tiny-qwen2-vl [--seed 0] [--steps N]
        [--draft-kind eagle3|eagle] [--draft-prompts P] [--draft-steps M] [--threads 2]
        [--draft-new-tokens T] [--target DIR]

With ``--target DIR`` only the draft is trained, against the target of ``DIR`` (its weights and
tokenizer, copied to ``--out`` unchanged; the settings must describe that target), and the
target's own ``TRAINING.md`` is kept below the draft's.

The corpus is the running interpreter's own standard library: the top-level ``*.py`` files of
``sysconfig.get_paths()["stdlib"]`` in sorted order (source and docstrings). Every
:data:`engine.builtin.stdlib_corpus.HOLDOUT_EVERY`-th file is held out for evaluation. A byte-level
BPE tokenizer is trained on the training files with the ``tokenizers`` library, the special tokens
of :mod:`engine.builtin.tiny_tokenizer` taking the last ids.

The target is the engine's own :class:`Qwen2VLModel` (the tiny vision tower included, so images
still work); training runs a functional causal forward over its modules (q/k/v/o and gate/up/down
projections, RMSNorm, 1-D rope, which equals mrope for text). The draft is then trained over the
target's own greedy continuations of corpus windows: row ``p`` = (feature of ``p``, token
``p + 1``) predicts the target's greedy token ``p + 2``. The default draft is an EAGLE-3 one
(:mod:`tiny_eagle3`: three target layers fused, its own vocabulary of the target's most frequent
tokens, trained unrolled over its own features as drafting runs it); ``--draft-kind eagle``
trains an EAGLE-1/2 head on the target's final-normed hidden states instead, with a regression
of its output feature onto the target's feature of ``p + 1`` and a second, unrolled pass that
feeds the draft its own features. Output layout of ``--out``: ``config.json``,
``model.safetensors``, ``tokenizer.json``, ``generation_config.json``,
``preprocessor_config.json``, ``draft/{config.json, model.safetensors}``, ``TRAINING.md``.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import platform
import shutil
import sys
import sysconfig
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import tiny_eagle3  # scripts/, beside this file
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tiny_settings import Settings
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.builtin.stdlib_corpus import heldout_prompts, read_text, split_files, stdlib_files
from engine.builtin.tiny_model import TINY_PREPROCESSOR, init_weights, tiny_config_dict
from engine.builtin.tiny_tokenizer import SPECIAL_TOKENS, special_token_ids
from engine.checkpoint import load_model
from engine.config import ModelConfig
from engine.models.eagle.draft import DraftConfig, EagleDraft, draft_config_dict
from engine.models.eagle.eagle3 import Draft
from engine.models.layers import RotaryTables
from engine.models.qwen2_vl.model import DecoderLayer, Qwen2VLModel
from engine.text.chat import chat_prompt, chat_turn

SAMPLE_PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):",
                  chat_prompt("Write a Python function fibonacci(n). Return the n-th Fibonacci "
                              "number."))
KVCache = list[tuple[torch.Tensor, torch.Tensor]]
TargetForward = Callable[[Qwen2VLModel, torch.Tensor], torch.Tensor]
TARGET_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
                "preprocessor_config.json")


# ---- corpus and tokenizer --------------------------------------------------------------------


def chat_examples(texts: list[str]) -> list[str]:
    """Chat turns made from the functions of ``texts`` that have a docstring: the user asks for
    the function by its signature and the docstring's first paragraph, the assistant answers
    with its (dedented) source. The order is the files' order, then the source order."""
    out: list[str] = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc, source = ast.get_docstring(node), ast.get_source_segment(text, node)
            if not doc or not source or node.name.startswith("__"):
                continue
            summary = " ".join(doc.split("\n\n")[0].split())
            request = f"Write a Python function {node.name}({ast.unparse(node.args)}). {summary}"
            out.append(chat_turn("user", request)
                       + chat_turn("assistant", textwrap.dedent(" " * node.col_offset + source)))
    return out


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE over ``texts`` with :data:`SPECIAL_TOKENS` as the last ids (as in
    :func:`engine.builtin.tiny_tokenizer.build_tiny_tokenizer`)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size(with_added_tokens=False) == vocab_size - len(SPECIAL_TOKENS)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def token_stream(tok: Tokenizer, texts: list[str], sep: int) -> torch.Tensor:
    """All texts' ids, each followed by ``sep`` ``[N]``."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(sep)
    return torch.tensor(ids, dtype=torch.long)


def config_dict(s: Settings) -> dict[str, Any]:
    """The target's ``config.json``: the tiny model's layout at this size."""
    raw = tiny_config_dict(s.vocab_size)
    half = s.hidden_size // s.num_heads // 2
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    raw["text_config"].update(
        hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads, max_position_embeddings=4096)
    raw["text_config"]["rope_parameters"]["mrope_section"] = section
    raw["vision_config"]["hidden_size"] = s.hidden_size
    raw["tie_word_embeddings"] = raw["text_config"]["tie_word_embeddings"] = True
    return raw


# ---- a functional causal forward over the engine's modules -----------------------------------


def rotary(model: Qwen2VLModel | Draft, start: int, length: int) -> RotaryTables:
    """Rope tables for 1-D positions ``start .. start + length - 1`` (all three mrope axes)."""
    pos = torch.arange(start, start + length).expand(3, length)
    return model.rotary(pos, torch.float32)


def layer_forward(layer: DecoderLayer, x: torch.Tensor, rot: RotaryTables,
                  cache: KVCache | None = None, index: int = 0) -> torch.Tensor:
    """One decoder layer over ``x`` ``[B, T, H]`` (causal); with ``cache``, appends this layer's
    K/V to ``cache[index]`` (or creates it) and attends to everything cached before."""
    a, (b, t, _) = layer.self_attn, x.shape
    h = layer.input_layernorm(x)
    q = rot.apply(a.q_proj(h).view(b, t, a.num_heads, a.head_dim)).transpose(1, 2)
    k = rot.apply(a.k_proj(h).view(b, t, a.num_kv_heads, a.head_dim)).transpose(1, 2)
    v = a.v_proj(h).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
    if cache is not None:
        if index < len(cache):
            k, v = torch.cat((cache[index][0], k), 2), torch.cat((cache[index][1], v), 2)
            cache[index] = (k, v)
        else:
            cache.append((k, v))
    causal = t > 1
    if causal and k.shape[2] != t:
        raise ValueError("a multi-token forward over a non-empty cache is not supported")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    x = x + a.o_proj(out.transpose(1, 2).reshape(b, t, -1))
    m = layer.mlp
    g = layer.post_attention_layernorm(x)
    return x + m.down_proj(m.act(m.gate_proj(g)) * m.up_proj(g))


def target_forward(model: Qwen2VLModel, ids: torch.Tensor, cache: KVCache | None = None,
                   start: int = 0) -> torch.Tensor:
    """Final-normed hidden states ``[B, T, H]`` of ``ids`` ``[B, T]`` at positions from
    ``start`` (what :meth:`Qwen2VLModel.forward` returns per token)."""
    x = F.embedding(ids, model.model.embed_tokens.weight)
    rot = rotary(model, start, ids.shape[1])
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, DecoderLayer)  # training builds every layer
        x = layer_forward(layer, x, rot, cache, i)
    return model.model.norm(x)


def draft_forward(draft: EagleDraft, embeds: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """The draft over rows ``(embedding of token p+1, feature of p)`` ``[B, T, H]`` each."""
    x = draft.fc(torch.cat((embeds, feats), dim=-1))
    x = layer_forward(draft.layer, x, rotary(draft, 0, x.shape[1]))
    return draft.norm(x)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def autocast(s: Settings) -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16_autocast)


# ---- training --------------------------------------------------------------------------------


def train_target(model: Qwen2VLModel, stream: torch.Tensor, s: Settings,
                 forward: TargetForward | None = None) -> list[float]:
    """Next-token training on random windows of ``stream``; returns the loss curve. ``forward``
    (default :func:`target_forward`) gives the final-normed hidden states of a batch of ids."""
    forward = forward or target_forward
    gen = torch.Generator().manual_seed(s.seed + 1)
    params = [p for n, p in model.named_parameters() if not n.startswith("visual.")]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))
    losses: list[float] = []
    model.train()
    for step in range(s.steps):
        starts = torch.randint(0, len(stream) - s.seq_len - 1, (s.batch_size,), generator=gen)
        batch = torch.stack([stream[i : i + s.seq_len + 1] for i in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s.steps, s.lr, s.warmup)
        with autocast(s):
            hidden = forward(model, batch[:, :-1])
            logits = model.lm_head(hidden).float()
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == s.steps - 1:
            print(f"target step {step:5d} loss {loss.item():.3f}", flush=True)
    model.eval()
    return losses


@torch.no_grad()
def greedy_continue(model: Qwen2VLModel, prompts: torch.Tensor, new: int, s: Settings
                    ) -> torch.Tensor:
    """``prompts`` ``[B, P]`` followed by ``new`` greedy tokens of the functional forward."""
    cache: KVCache = []
    with autocast(s):
        hidden = target_forward(model, prompts, cache)
    out = [prompts]
    tok = model.lm_head(hidden[:, -1:]).float().argmax(-1)
    for i in range(new):
        out.append(tok)
        if i == new - 1:
            break
        with autocast(s):
            hidden = target_forward(model, tok, cache, prompts.shape[1] + i)
        tok = model.lm_head(hidden).float().argmax(-1)
    return torch.cat(out, dim=1)


@torch.no_grad()
def draft_data(model: Qwen2VLModel, stream: torch.Tensor, s: Settings
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences of corpus prompts + the target's greedy continuations ``[N, T]``, the target's
    features ``[N, T, H]`` (an EAGLE-3 draft's: the outputs of its three layers ``[N, T, 3H]``)
    and its greedy next token at every index ``[N, T]``."""
    gen = torch.Generator().manual_seed(s.seed + 2)
    starts = torch.randint(0, len(stream) - s.draft_prompt_len, (s.draft_prompts,), generator=gen)
    prompts = torch.stack([stream[i : i + s.draft_prompt_len] for i in starts.tolist()])
    rot = rotary(model, 0, s.draft_prompt_len + s.draft_new_tokens)
    seqs, feats, nexts = [], [], []
    for chunk in prompts.split(128):
        seq = greedy_continue(model, chunk, s.draft_new_tokens, s)
        seqs.append(seq)
        if s.draft_kind == "eagle3":
            aux, nxt = tiny_eagle3.target_aux(model, seq, s.draft_layers, rot)
            feats.append(aux)
            nexts.append(nxt)
            continue
        with autocast(s):
            hidden = target_forward(model, seq)
        feats.append(hidden.float())
        nexts.append(model.lm_head(hidden).float().argmax(-1))
    return torch.cat(seqs), torch.cat(feats), torch.cat(nexts)


def train_draft(draft: EagleDraft, model: Qwen2VLModel, data: tuple[torch.Tensor, ...],
                s: Settings) -> list[float]:
    """Train the EAGLE head on (feature p, token p+1) -> target's greedy token p+2."""
    seqs, feats, nexts = data
    gen = torch.Generator().manual_seed(s.seed + 3)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.draft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses: list[float] = []
    draft.train()
    for step in range(s.draft_steps):
        idx = torch.randint(0, len(seqs), (s.draft_batch,), generator=gen)
        ids, h, labels = seqs[idx], feats[idx], nexts[idx]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s.draft_steps, s.draft_lr, s.warmup)
        emb = F.embedding(ids[:, 1:], embed)  # token p + 1
        want_h, want_t = h[:, 1:], labels[:, 1:]  # target feature and greedy token of p + 1
        with autocast(s):
            out = draft_forward(draft, emb, h[:, :-1])
            loss = draft_loss(out, want_h, want_t, head, s)
            # second pass: row p sees the draft's own output of row p - 1 as its feature
            own = torch.cat((h[:, :1], out[:, :-1].float()), dim=1)
            out2 = draft_forward(draft, emb, own)
            loss = loss + s.unroll_weight * draft_loss(out2, want_h, want_t, head, s)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == s.draft_steps - 1:
            with torch.no_grad():
                acc = (F.linear(out.float(), head).argmax(-1) == want_t).float().mean()
            print(f"draft step {step:5d} loss {loss.item():.3f} top1 {acc:.3f}", flush=True)
    draft.eval()
    return losses


def draft_loss(out: torch.Tensor, want_h: torch.Tensor, want_t: torch.Tensor,
               head: torch.Tensor, s: Settings) -> torch.Tensor:
    logits = F.linear(out, head).float()
    ce = F.cross_entropy(logits.flatten(0, 1), want_t.flatten())
    return ce + s.feature_weight * F.smooth_l1_loss(out.float(), want_h)


# ---- writing and checking --------------------------------------------------------------------


def write_checkpoint(out: Path, model: Qwen2VLModel, draft: Draft, draft_raw: dict[str, Any],
                     tok: Tokenizer, raw: dict[str, Any]) -> None:
    """Write the layout of the module docstring (float32 weights; lm_head tied to the embedding)."""
    (out / "draft").mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    special = special_token_ids(raw["text_config"]["vocab_size"])
    eos = [special["<|im_end|>"], special["<|endoftext|>"]]
    generation = {"eos_token_id": eos, "bos_token_id": special["<|endoftext|>"],
                  "max_new_tokens": 128}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    write_draft(out, draft, draft_raw)


def write_draft(out: Path, draft: Draft, draft_raw: dict[str, Any]) -> None:
    """``out/draft/{model.safetensors, config.json}``."""
    (out / "draft").mkdir(parents=True, exist_ok=True)
    dstate = {k: v.detach().contiguous() for k, v in draft.state_dict().items()}
    save_file(dstate, str(out / "draft" / "model.safetensors"), metadata={"format": "pt"})
    (out / "draft" / "config.json").write_text(json.dumps(draft_raw, indent=2) + "\n")


def evaluate(out: Path, tok: Tokenizer, held: list[Path], k: int = 4,
             new_tokens: int = 64) -> dict[str, Any]:
    """Engine samples, the transformers cross-check and EAGLE acceptance on held-out prompts."""
    from decode_node.spec.eagle_engine import EagleEngine
    from engine.config import EngineConfig
    from engine.core.request import SamplingParams
    from engine.llm_engine import LLMEngine, Prompt
    from engine.models.eagle.loader import load_draft

    greedy = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine = LLMEngine(out, EngineConfig(num_pages=1024, page_size=16))
    samples = engine.generate([Prompt(text=p) for p in SAMPLE_PROMPTS],
                              SamplingParams(max_new_tokens=48, ignore_eos=True))
    check_ids = tok.encode(SAMPLE_PROMPTS[0]).ids
    [ours] = engine.generate([Prompt(token_ids=check_ids)],
                             SamplingParams(max_new_tokens=16, ignore_eos=True))
    reference = transformers_greedy(out, check_ids, 16)
    prompts = [Prompt(token_ids=p)
               for p in heldout_prompts(lambda text: tok.encode(text).ids, held=held)]
    plain = engine.generate(prompts, greedy)
    spec_engine = LLMEngine(out, EngineConfig(num_pages=1024, page_size=16, lookahead_tokens=k))
    draft = load_draft(out / "draft", spec_engine.model_config.text, torch.float32)
    spec = EagleEngine(spec_engine, draft, k)
    got = spec.generate(prompts, greedy)
    return {
        "samples": {p: r.text for p, r in zip(SAMPLE_PROMPTS, samples, strict=True)},
        "matches_transformers": ours.token_ids == reference,
        "eagle_equals_plain": [g.token_ids for g in got] == [p.token_ids for p in plain],
        "acceptance_length": round(spec.stats.acceptance_length, 3),
        "k": k, "heldout_prompts": len(prompts), "new_tokens": new_tokens,
    }


def transformers_greedy(model_dir: Path, ids: list[int], new: int) -> list[int]:
    """Greedy continuation by transformers' ``generate`` on the saved checkpoint (float32)."""
    from transformers import Qwen2VLForConditionalGeneration

    hf = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        res = hf.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                          max_new_tokens=new, eos_token_id=None, do_sample=False,
                          pad_token_id=0)
    return res[0, len(ids):].tolist()


def append_target_report(out: Path, target: Path) -> None:
    """Append the target's own ``TRAINING.md`` to ``out``'s (a draft trained with ``--target``),
    its headings one level down."""
    with (out / "TRAINING.md").open("a") as f:
        f.write("\n# The target: its own TRAINING.md\n\n"
                + (target / "TRAINING.md").read_text().replace("\n# ", "\n## ")
                .removeprefix("# "))


def write_report(out: Path, s: Settings, command: str, facts: dict[str, Any],
                 title: str = "The built-in tiny model",
                 script: str = "scripts/train_tiny.py") -> None:
    """``TRAINING.md``: the command, the settings and the measured results."""
    sizes = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*"))
             if p.is_file() and p.name != "TRAINING.md"}
    lines = [
        f"# {title}: how it was made",
        "",
        f"Written by `{script}`; rebuild with (from the repository root):",
        "",
        "```", command, "```", "",
        "## Settings", "", "```json", json.dumps(asdict(s), indent=2), "```", "",
        "## Measured", "", "```json", json.dumps(facts, indent=2), "```", "",
        "## Files (bytes)", "", "```json", json.dumps(sizes, indent=2), "```", "",
    ]
    (out / "TRAINING.md").write_text("\n".join(lines))


def make_draft(model: Qwen2VLModel, data: tuple[torch.Tensor, ...], raw: dict[str, Any],
               s: Settings) -> tuple[Draft, dict[str, Any], list[float]]:
    """Train the draft of ``s.draft_kind`` on ``data``: the draft, its ``config.json`` and its
    loss curve."""
    text = raw["text_config"]
    if s.draft_kind == "eagle3":
        vocab = tiny_eagle3.vocabulary(data[2], s.draft_vocab_size, s.vocab_size)
        draft3 = tiny_eagle3.new_draft(text, s, vocab)
        init_weights(draft3, s.seed + 10)
        rot = rotary(draft3, 0, s.draft_prompt_len + s.draft_new_tokens - 1)
        losses = tiny_eagle3.train(draft3, model, data, vocab, rot, s, lr_at)
        return draft3, tiny_eagle3.draft_config(text, s), losses
    draft_raw = draft_config_dict(text, s.num_layers)
    draft = EagleDraft(DraftConfig.from_dict(draft_raw))
    init_weights(draft, s.seed + 10)
    return draft, draft_raw, train_draft(draft, model, data, s)


def parse_args() -> tuple[Path, Settings, bool, Path | None]:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--draft-kind", choices=["eagle3", "eagle"], default=d.draft_kind)
    p.add_argument("--draft-prompts", type=int, default=d.draft_prompts)
    p.add_argument("--draft-steps", type=int, default=d.draft_steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--draft-batch", type=int, default=d.draft_batch)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the matmuls")
    p.add_argument("--no-eval", action="store_true", help="skip the checks after training")
    p.add_argument("--draft-new-tokens", type=int, default=d.draft_new_tokens,
                   help="greedy tokens after each draft prompt (sets the positions it learns)")
    p.add_argument("--target", type=Path, default=None, metavar="DIR",
                   help="train only the draft, against this trained target (copied to --out)")
    a = p.parse_args()
    s = Settings(seed=a.seed, steps=a.steps, draft_steps=a.draft_steps, batch_size=a.batch_size,
                 hidden_size=a.hidden_size, num_layers=a.num_layers,
                 intermediate_size=a.intermediate_size, lr=a.lr, draft_batch=a.draft_batch,
                 threads=a.threads, bf16_autocast=a.bf16, draft_kind=a.draft_kind,
                 draft_prompts=a.draft_prompts, draft_new_tokens=a.draft_new_tokens)
    if s.draft_kind == "eagle3" and max(s.draft_layers) >= s.num_layers:
        p.error(f"the EAGLE-3 draft fuses target layers {list(s.draft_layers)}, but "
                f"--num-layers {s.num_layers} has layers 0..{s.num_layers - 1} "
                "(use --draft-kind eagle, or more layers)")
    if a.target is not None and a.target.resolve() == a.out.resolve():
        p.error("--out must differ from --target (the target's files are copied there)")
    return a.out, s, not a.no_eval, a.target


def trained_target(target: Path, s: Settings) -> tuple[Qwen2VLModel, Tokenizer, dict[str, Any]]:
    """The target of ``target`` (weights, tokenizer, ``config.json``), refused unless the
    settings describe it (the draft's shape follows them)."""
    raw = json.loads((target / "config.json").read_text())
    want, got = config_dict(s)["text_config"], raw["text_config"]
    differ = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    if differ:
        raise SystemExit(f"--target {target}: its config differs from the settings "
                         f"(key: (target, settings)): {differ}")
    _, model = load_model(target)
    return model, Tokenizer.from_file(str(target / "tokenizer.json")), raw


def copy_target(target: Path, out: Path) -> None:
    """The target's files into ``out`` (not its draft or report)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in TARGET_FILES:
        shutil.copyfile(target / name, out / name)


def main() -> None:
    out, s, check, target = parse_args()
    command = "python " + " ".join(["scripts/train_tiny.py", *sys.argv[1:]])
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    train_files, held = split_files(stdlib_files())
    texts = [read_text(f) for f in train_files]
    t0, c0 = time.perf_counter(), time.process_time()
    if target is None:
        tok = train_tokenizer(texts, s.vocab_size)
    else:
        model, tok, raw = trained_target(target, s)
    sep = special_token_ids(s.vocab_size)["<|endoftext|>"]
    chats = chat_examples(texts)
    stream = token_stream(tok, texts + chats, sep)
    print(f"{len(train_files)} training files, {len(chats)} chat examples, {len(held)} held out, "
          f"{len(stream)} tokens, "
          f"tokenizer {time.perf_counter() - t0:.1f}s", flush=True)
    t1 = time.perf_counter()
    target_losses: list[float] = []
    if target is None:
        raw = config_dict(s)
        model = Qwen2VLModel(ModelConfig.from_dict(raw))
        init_weights(model, s.seed)
        model.lm_head.weight = model.model.embed_tokens.weight
        target_losses = train_target(model, stream, s)
    t2 = time.perf_counter()
    model.requires_grad_(False)
    data = draft_data(model, stream, s)
    t3 = time.perf_counter()
    draft, draft_raw, draft_losses = make_draft(model, data, raw, s)
    t4 = time.perf_counter()
    if target is None:
        write_checkpoint(out, model, draft, draft_raw, tok, raw)
    else:
        copy_target(target, out)
        write_draft(out, draft, draft_raw)
    facts: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "stdlib": sysconfig.get_paths()["stdlib"],
        "train_files": len(train_files), "heldout_files": [f.name for f in held],
        "chat_examples": len(chats), "train_tokens": len(stream),
        "seconds": {"target": round(t2 - t1, 1), "draft_data": round(t3 - t2, 1),
                    "draft": round(t4 - t3, 1), "total": round(t4 - t0, 1)},
        "cpu_seconds_total": round(time.process_time() - c0, 1),
        "final_target_loss_avg20": (round(sum(target_losses[-20:]) / 20, 3) if target_losses
                                    else f"not trained: --target {target}"),
        "final_draft_loss_avg20": round(sum(draft_losses[-20:]) / 20, 3),
    }
    print(json.dumps(facts, indent=2), flush=True)
    if check:
        facts["eval"] = evaluate(out, tok, held)
        print(json.dumps(facts["eval"], indent=2), flush=True)
    write_report(out, s, command, facts)
    if target is not None:
        append_target_report(out, target)


if __name__ == "__main__":
    main()
