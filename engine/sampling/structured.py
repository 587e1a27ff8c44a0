"""Structured outputs in the step: each request's grammar, in step with its output, masking the
scores its tokens are chosen from (and, with EAGLE, the rows its drafts are verified against).

A request asks with ``SamplingParams.structured_output`` (``(kind, value)``, see
:class:`engine.sampling.grammar.GrammarSpec`). :meth:`StructuredOutputs.check` compiles the
grammar when the request arrives (a grammar that cannot be served is its
:class:`InvalidRequestError`), so the step never meets a bad one and pays only the cached lookup.
Its matcher lives in ``Request.grammar`` (made on first use, as the penalties' token history
lives in ``Request.history``) and catches up with the request's output each time it is used:
whatever committed tokens (a step's sample, an EAGLE round, the prefill node's first token that
a decode node adopted, output resumed after a failover), the mask always follows exactly the
tokens the request holds.

Masks apply to the *scores* (the penalized logits), never to the raw logits: the reported
log-probabilities stay the model's own, as for every other filter. The grammar module (and
xgrammar, which imports transformers) is imported only when a request first asks for a grammar.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.core.request import Request, SamplingParams
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.sampling.grammar import GrammarCompiler, GrammarMatcher, GrammarSpec


class StructuredOutputs:
    """The grammars of one served model (its directory's tokenizer, vocabulary and EOS ids);
    thread-safe: requests are checked on server threads while the step loop masks."""

    def __init__(self, model_dir: str | Path) -> None:
        self._model_dir = Path(model_dir)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def check(self, sampling: SamplingParams) -> None:
        """Compile ``sampling``'s grammar, if it has one (cached per grammar); raise
        :class:`InvalidRequestError` naming what cannot be served."""
        if sampling.structured_output is None:
            return
        compiler = self.compiler()
        compiler.compiled(_spec(sampling))
        outside = [t for t in sampling.stop_token_ids if t >= compiler.vocab_size]
        if outside:
            raise InvalidRequestError(f"stop token id {outside[0]} is outside the vocabulary")

    def compiler(self) -> GrammarCompiler:
        """The model's grammar compiler, built on first use; :class:`InvalidRequestError` when
        the model has no tokenizer (a grammar is text: it needs the tokens' spelling)."""
        with self._lock:
            if self._compiler is None:
                from engine.sampling.grammar import GrammarCompiler

                compiler = GrammarCompiler.from_model_dir(self._model_dir)
                if compiler is None:
                    raise InvalidRequestError("structured outputs need the model's "
                                              "tokenizer.json, which this model lacks")
                self._compiler = compiler
            return self._compiler

    def matcher(self, req: Request) -> GrammarMatcher:
        """``req``'s matcher (made on first use, kept in ``req.grammar``), having accepted every
        token ``req`` output so far (resumed output first)."""
        matcher = req.grammar
        if matcher is None:
            matcher = req.grammar = self.compiler().matcher(
                _spec(req.sampling), extra_stop_ids=req.sampling.stop_token_ids)
        assert isinstance(matcher, _matcher_class())
        resumed = req.sampling.resumed_tokens
        done = matcher.num_tokens
        if done < resumed:
            matcher.replay(req.prompt_token_ids[req.num_prompt_tokens - resumed + done:])
            done = resumed
        if done - resumed < req.num_output_tokens:
            matcher.replay(req.output_token_ids[done - resumed:])
        return matcher

    def mask(self, reqs: Sequence[Request], logits: torch.Tensor,
             scores: torch.Tensor) -> torch.Tensor:
        """The scores ``[n, V]`` (one row per request of ``reqs``) with each constrained
        request's disallowed next tokens at ``-inf``; ``scores`` itself when none is
        constrained. ``logits`` (the raw rows the log-probabilities come from) is never written:
        when ``scores`` is ``logits`` the masked rows go to a copy."""
        rows = [i for i, r in enumerate(reqs) if r.sampling.structured_output is not None]
        if not rows:
            return scores
        from engine.sampling.grammar import apply_mask

        bitmask = self.compiler().allocate_bitmask(len(reqs))
        for i in rows:
            self.matcher(reqs[i]).fill_bitmask(bitmask, i)
        out = scores.clone() if scores is logits else scores
        apply_mask(out, bitmask, rows)
        return out

    def mask_chain(self, req: Request, drafts: Sequence[int], logits: torch.Tensor,
                   scores: torch.Tensor) -> torch.Tensor:
        """The verify scores ``[K + 1, V]`` of ``[b, d_1..d_K]`` masked for ``req`` (row ``j``:
        the grammar after ``d_1..d_j``; rows past the first draft the grammar refuses are
        unreachable and stay as they are), so whatever acceptance commits satisfies it;
        ``scores`` itself without a grammar. ``logits`` as in :meth:`mask`."""
        if req.sampling.structured_output is None:
            return scores
        from engine.sampling.grammar import apply_mask

        bitmask = self.compiler().allocate_bitmask(len(drafts) + 1)
        self.matcher(req).fill_verify_bitmask(drafts, bitmask)
        out = scores.clone() if scores is logits else scores
        apply_mask(out, bitmask)
        return out

    def mask_tree(self, req: Request, tokens: Sequence[int], seen: torch.Tensor,
                  logits: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The verify scores ``[N, V]`` of a draft tree masked for ``req``: row ``j`` under the
        grammar after the drafted tokens on node ``j``'s path (``tokens[j]`` is node ``j``'s,
        node 0 the root; ``seen`` ``[N, N]`` bool its ancestors and itself, ancestors at lower
        indices). A node whose path the grammar refuses is never reached by acceptance: its row
        stays as it is. ``scores`` itself without a grammar; ``logits`` as in :meth:`mask`."""
        if req.sampling.structured_output is None:
            return scores
        from engine.sampling.grammar import apply_mask

        matcher = self.matcher(req)
        bitmask = self.compiler().allocate_bitmask(len(tokens))
        on_path = seen.cpu().tolist()
        for j in range(len(tokens)):
            path = [tokens[a] for a in range(1, j + 1) if on_path[j][a]]
            accepted = 0
            for token in path:
                if not matcher.accept(token):
                    break
                accepted += 1
            if accepted == len(path):
                matcher.fill_bitmask(bitmask, j)
            matcher.rollback(accepted)
        out = scores.clone() if scores is logits else scores
        apply_mask(out, bitmask)
        return out


def _matcher_class() -> type[GrammarMatcher]:
    from engine.sampling.grammar import GrammarMatcher

    return GrammarMatcher


def _spec(sampling: SamplingParams) -> GrammarSpec:
    from engine.sampling.grammar import GrammarSpec

    assert sampling.structured_output is not None
    kind, value = sampling.structured_output
    return GrammarSpec.parse(kind, value)
