"""EAGLE speculative decoding over the engine: draft, verify, accept, draft-extend.

Notation (per request): ``S`` = tokens whose KV is in both the target and the draft cache; the
bonus token ``b`` (the last committed token) sits at index ``S`` without KV; ``K`` drafts
``d_1..d_K`` are guesses for indices ``S+1..S+K``; ``A`` = accepted drafts + 1.

* **Prefill** runs through the scheduler in chunks. After the target's forward over a chunk, the
  draft runs over the same rows: row ``p`` pairs the target feature of ``p`` with token ``p+1``
  (the next chunk's first token, or the sampled bonus on the last chunk), at row ``p``'s own 3-D
  position and KV slot. The last row's output predicts ``d_1``.
* **Draft decode** (``K - 1`` forwards): step ``i`` feeds ``d_{i+1}`` with the previous draft
  output as feature at 1-D position ``S + i``, writing draft KV at slot ``S + i``; positions
  advance after each forward.
* **Verify**: the target over ``[b, d_1..d_K]`` at positions ``S..S+K`` (causal), KV at slots
  ``S..S+K``. Acceptance is greedy or lossless rejection sampling, against the target's logits
  with the request's penalties applied row by row (row ``j`` counts ``d_1..d_j`` as output), and
  min-p among the filters. The drafts come from the draft's own unpenalized distribution: any
  ``q`` keeps acceptance lossless.
* **Draft extend**: the draft over the same ``K + 1`` rows with the verify's features and the
  committed tokens shifted by one, at the very positions tensor the verify used; row ``A - 1``
  (``select_index``) seeds the next round. Rows ``>= A`` write KV past ``S + A`` that nothing reads
  before it is overwritten.

Every forward's mrope positions come from :func:`engine.multimodal.mrope.mrope_from_1d` applied to
that forward's final 1-D positions (the prompt's rope table for prompt rows), so their column count
always equals the forward's token count.

Host reads: a round reads the device once. Each draft step's tokens (argmax, or drawn with the
request's generator) stay on the device and feed the next draft forward; the verify input is
the bonus (known on the host) before them; acceptance runs for the whole batch on the device
(:mod:`decode_node.spec.accept`); then :func:`read_outcome` brings back, in one copy, each
request's ``A``, its committed tokens, their log-probabilities, a tree's accepted path, and the
alternatives of the requests that ask for ``top_logprobs``. The hybrid state keep and the draft
extend take ``A`` from that copy, and the draft's pick of the next round's ``d_1`` from the
extend's seeds stays on the device (:class:`DraftState`). Only a request with a grammar reads
more (its drafts, to mask its verify rows on the host: :mod:`engine.sampling.structured`).

Draft trees (EAGLE-2, ``topk > 1`` or ``steps != K``): the round drafts a tree instead of the
chain and verifies it in one forward under a tree mask (:mod:`decode_node.spec.tree_round`); the
chain (``topk == 1``, ``steps == K``) runs exactly the path above. A tree's drafts are the
draft's top-``k`` tokens whatever the request's sampling; a sampled request's tree is verified
losslessly with the drafts as point masses (:func:`~decode_node.spec.accept.accept_tree`). A
tree round drafts from the seed feature itself, so its requests' states hold no ``d_1``.

A hybrid target (linear-attention layers, Qwen3.5): the verify reads each request's state slot
without writing it and keeps the state after every window row; once ``A`` is known the slot takes
the state after rows ``0..A-1`` (``b, d_1..d_{A-1}``: exactly the tokens whose KV the round
commits; :meth:`SpecGraphRunner.keep_states`), so rejected drafts leave no trace and the next
round starts from the state plain decoding would hold. Drafts have no linear layers (an EAGLE
draft's or an MTP module's layer is full attention): their KV past ``S + A`` is overwritten as
always. Under tensor parallelism every rank keeps its own heads' states of the same rows
(:attr:`engine.parallel.messages.Command.KEEP_STATES`). Trees are refused with a hybrid target
(:func:`spec_refusal`).

A round's page tables, slots and deltas come from the engine runner's persistent batch
(:meth:`SpecGraphRunner.round_inputs`, once per round); each draft decode step only adds its
row positions and their slots (array operations, one copy to the device).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from decode_node.spec.accept import (
    Accepted,
    chain_greedy,
    chain_outcome,
    chain_sampled,
    draw,
    generator_of,
    row_probs,
    rows_of,
)
from decode_node.spec.graph_runner import RoundInputs, SpecGraphRunner
from decode_node.spec.tree import TreeShape
from decode_node.spec.tree_round import TreeRounds
from engine.attention.backend import AttentionBatch
from engine.config import TextConfig
from engine.core.request import Request, SamplingParams, TopLogprobs
from engine.core.scheduler import SchedulerOutput
from engine.errors import ConfigError
from engine.llm_engine import GenerationResult, LLMEngine, Prompt, StepResult
from engine.models.eagle.eagle3 import Draft
from engine.multimodal.mrope import mrope_from_1d
from engine.runner.draft_runner import DraftRunner
from engine.runner.input_batch import to_device
from engine.sampling.penalties import chain_scores

# (phase, request ids per row, 1-D positions [T], mrope positions [3, T]) of every forward
PositionLog = Callable[[str, list[str], torch.Tensor, torch.Tensor], None]
HYBRID_TREE_REASON = ("a draft tree (--draft-topk above 1, or --draft-steps other than "
                      "--num-draft-tokens) with a hybrid model is not supported: its verify "
                      "would have to keep the linear-attention state of every tree path; "
                      "draft a chain")


def spec_refusal(text: TextConfig, shape: TreeShape) -> str | None:
    """Why the EAGLE loop cannot decode a model of ``text`` in rounds of ``shape``, or None
    when it can: a hybrid model keeps its accepted tokens' linear-attention states for a chain
    only (:data:`HYBRID_TREE_REASON`)."""
    return HYBRID_TREE_REASON if text.is_hybrid and not shape.is_chain else None


@dataclass
class DraftState:
    """The draft's seed for a request's next round, on the device (nothing of it is read on
    the host)."""

    feature: torch.Tensor  # [H] the draft output that predicts d_1
    token: torch.Tensor | None  # [] int64 d_1 (None in tree rounds: they draft from the feature)
    q: torch.Tensor | None  # [V] the distribution d_1 was drawn from (None when greedy, or a tree)


@dataclass(frozen=True)
class Picked:
    """The draft's token per row, and the distributions the sampled rows' were drawn from."""

    tokens: torch.Tensor  # [B] int64
    q: torch.Tensor | None  # [m, V], one row per sampled request in batch order; None if none
    rows: list[int]  # the batch indices of the sampled requests

    def dists(self) -> list[torch.Tensor | None]:
        """Each row's distribution ``[V]`` (None where it was greedy)."""
        out: list[torch.Tensor | None] = [None] * self.tokens.shape[0]
        if self.q is not None:
            for j, i in enumerate(self.rows):
                out[i] = self.q[j]
        return out


@dataclass(frozen=True)
class Outcome:
    """What a round commits, per request in batch order, on the host (:func:`read_outcome`)."""

    tokens: list[list[int]]  # the A tokens to commit
    logprobs: list[list[float]]  # each one's log-probability under its verify row
    tops: list[list[TopLogprobs | None]]  # their alternatives ([] unless the request asks)
    paths: list[list[int]]  # a tree's accepted path (node indices from the root); [] for chains


@dataclass
class SpecStats:
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def acceptance_length(self) -> float:
        """Average tokens committed per verify round (accepted drafts + the bonus)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


class EagleEngine:
    """An :class:`LLMEngine` whose decoding runs in EAGLE rounds of ``k`` draft tokens: a chain,
    or a tree of ``k`` nodes drafted ``steps`` deep with ``topk`` children per expanded node
    (:class:`~decode_node.spec.tree.TreeShape`)."""

    def __init__(self, engine: LLMEngine, draft: Draft, k: int, topk: int = 1,
                 steps: int | None = None) -> None:
        self.shape = TreeShape(k, topk, steps)
        refusal = spec_refusal(engine.model_config.text, self.shape)
        if refusal is not None:
            raise ConfigError(refusal)
        if engine.scheduler.config.lookahead_tokens < self.shape.lookahead:
            raise ValueError(f"the engine's lookahead_tokens must be at least "
                             f"{self.shape.lookahead} (num_draft_tokens, or a tree's "
                             "topk * (steps - 1) - 1 draft scratch)")
        self.engine, self.k = engine, k
        self.drafter = DraftRunner(engine, draft)
        self.graph = SpecGraphRunner(engine, self.drafter, k)
        self.trees = None if self.shape.is_chain else TreeRounds(
            engine, self.drafter, self.graph, self.shape, self._log_rows)
        self.states: dict[str, DraftState] = {}
        self.stats = SpecStats()
        self.request_stats: dict[str, SpecStats] = {}
        self.position_log: PositionLog | None = None

    # ---- the loop --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> StepResult:
        sched = self.engine.scheduler
        new: dict[str, tuple[Request, int]] = {}  # tokens per request over the whole step
        finished: list[Request] = []
        out = sched.schedule(prefill_only=True)
        if out.items:
            samples, fwd = self.engine.forward_states(out)
            self._log("prefill", out, fwd.mrope)
            seeds = self.drafter.prefill(out, samples, fwd)
            self._log("draft_prefill", out, fwd.mrope)
            reqs = [it.request for it in out.items if it.request.request_id in seeds]
            for r in reqs:
                self.seed(r, seeds[r.request_id])
            sampled = [it.request for it in out.items if it.needs_sample]
            done = sched.update(out, samples, fwd.tops)
            new.update((r.request_id, (r, 1)) for r in sampled if r.num_output_tokens == 1)
            finished += done
        ready = [r for r in sched.decoding() if r.request_id in self.states]
        if ready:
            grown, done = self._round(ready)
            for r, n in grown:
                new[r.request_id] = (r, new.get(r.request_id, (r, 0))[1] + n)
            finished += done
        for r in finished:
            self.states.pop(r.request_id, None)
        return StepResult(list(new.values()), finished)

    def generate(
        self, prompts: Sequence[Prompt], sampling: SamplingParams
    ) -> list[GenerationResult]:
        reqs = []
        for prompt in prompts:
            p = self.engine.prepare(prompt)
            reqs.append(self.engine.add_request(p.token_ids, p.images, sampling, videos=p.videos))
        while self.engine.scheduler.has_unfinished():
            self.step()
        return [self.engine.result(r) for r in reqs]

    def seed(self, req: Request, feature: torch.Tensor) -> None:
        """Start ``req``'s rounds from the draft feature that predicts its first draft token
        (the draft prefill's last row, here or on the prefill node)."""
        feature = feature.to(self.graph.bufs.device, self.engine.model.dtype)
        if self.trees is not None:  # a tree drafts from the feature itself
            self.states[req.request_id] = DraftState(feature, None, None)
            return
        pick = self._pick(feature.unsqueeze(0), [req])
        self.states[req.request_id] = DraftState(feature, pick.tokens[0], pick.dists()[0])

    # ---- one speculative round -------------------------------------------------------------

    def _round(self, reqs: list[Request]) -> tuple[list[tuple[Request, int]], list[Request]]:
        if self.trees is not None:
            return self._tree_round(self.trees, reqs)
        n = self.k + 1
        starts = self._grow(reqs, n)
        rnd = self.graph.round_inputs(reqs, starts)
        device = self.graph.bufs.device
        drafts, q = self._draft_decode(rnd)
        # a no-op on the drafts' tensor; host lists also pass (tests that force the drafts)
        drafts = torch.as_tensor(drafts, dtype=torch.int64, device=device)
        rows = [r.request_id for r in reqs for _ in range(n)]
        # verify: [b, d_1..d_K] at S..S+K, through the static buffers
        (bonus,) = to_device([np.array([r.output_token_ids[-1] for r in reqs], dtype=np.int64)],
                             device)
        hidden, features = self.graph.verify(rnd, torch.cat([bonus.unsqueeze(1), drafts],
                                                            dim=1).flatten())
        self._log_graph("verify", rows)
        logits = self.engine.model.logits(hidden).view(len(reqs), n, -1)
        accepted = chain_outcome(drafts, *self._accept(reqs, drafts, q, logits))
        out = read_outcome(accepted, logits, [r.sampling.top_logprobs for r in reqs])
        lengths = [len(c) for c in out.tokens]
        self.graph.keep_states(lengths)  # a hybrid model's accepted states
        # draft extend over the verified window, at the same positions; select_index rows
        seeds = self.graph.draft_extend(rnd, accepted.tokens.flatten(), features,
                                        [a - 1 for a in lengths])
        self._log_graph("draft_extend", rows)
        return self._commit(reqs, starts, out, seeds)

    def _tree_round(self, trees: TreeRounds, reqs: list[Request]
                    ) -> tuple[list[tuple[Request, int]], list[Request]]:
        reach = max(self.k + 1, self.shape.scratch)  # verify window or draft scratch
        starts = self._grow(reqs, reach)
        rnd = self.graph.round_inputs(reqs, starts)
        verdict = trees.verify(rnd, torch.stack([self.states[r.request_id].feature
                                                 for r in reqs]))
        out = read_outcome(verdict.accepted, verdict.logits,
                           [r.sampling.top_logprobs for r in reqs])
        seeds = trees.extend(rnd, verdict, out.paths)
        return self._commit(reqs, starts, out, seeds)

    def _grow(self, reqs: list[Request], reach: int) -> list[int]:
        """Give each request the pages of ``reach`` tokens past its ``S``; the ``S``s."""
        starts = [r.num_computed_tokens for r in reqs]
        for r, s in zip(reqs, starts, strict=True):
            self.engine.scheduler.grow(r, s + reach)
        return starts

    def _draft_decode(self, rnd: RoundInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``K - 1`` draft forwards from each request's seed; returns the drafts ``d_1..d_K``
        ``[B, K]`` and, for the sampled requests (batch order), the distributions they were drawn
        from ``[m, K, V]`` (None when every request is greedy). All on the device: each step's
        tokens feed the next forward directly."""
        reqs = rnd.reqs
        states = [self.states[r.request_id] for r in reqs]
        firsts = [st.token for st in states if st.token is not None]
        assert len(firsts) == len(states), "a chain round starts from every request's d_1"
        tokens = [torch.stack(firsts)]  # [B] per step
        dists = [st.q for st in states if st.q is not None]  # the sampled requests'
        qs = [torch.stack(dists)] if dists else []  # [m, V] per step
        feats = torch.stack([st.feature for st in states])  # [B, H]
        starts = np.array(rnd.starts, dtype=np.int64)
        for i in range(self.k - 1):
            pos_np = starts + i  # [B]: step i runs at S + i
            batch = self._batch(rnd, pos_np)
            (pos,) = to_device([pos_np], batch.slot_mapping.device)
            mrope = mrope_from_1d(pos, rnd.deltas)  # derived from the final positions of this step
            feats = self._draft_forward(tokens[-1], feats, mrope, batch)
            self._log_rows("draft_decode", [r.request_id for r in reqs], mrope, pos)
            pick = self._pick(feats, reqs)
            tokens.append(pick.tokens)
            if pick.q is not None:
                qs.append(pick.q)
        return torch.stack(tokens, dim=1), torch.stack(qs, dim=1) if qs else None

    def _accept(self, reqs: list[Request], drafts: torch.Tensor, q: torch.Tensor | None,
                logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The accepted drafts per request ``[B]`` and the token after them ``[B]``, from the
        verify logits ``[B, K + 1, V]`` (greedy, or rejection sampling against ``q``
        ``[m, K, V]`` for the sampled requests), on the device."""
        scores = self._scores(reqs, drafts, logits)
        sampled = [i for i, r in enumerate(reqs) if not r.sampling.is_greedy]
        if not sampled:
            return chain_greedy(drafts, scores.argmax(dim=-1))
        assert q is not None
        n, vocab = scores.shape[1], scores.shape[2]
        p = row_probs(rows_of(scores, sampled).reshape(-1, vocab),
                      [reqs[i].sampling for i in sampled for _ in range(n)])
        drawn = chain_sampled(rows_of(drafts, sampled), p.view(len(sampled), n, vocab), q,
                              [generator_of(reqs[i]) for i in sampled])
        if len(sampled) == len(reqs):
            return drawn
        accepted, last = chain_greedy(drafts, scores.argmax(dim=-1))
        accepted[sampled], last[sampled] = drawn
        return accepted, last

    def _scores(self, reqs: list[Request], drafts: torch.Tensor,
                logits: torch.Tensor) -> torch.Tensor:
        """The verify logits ``[B, K + 1, V]`` with each request's penalties and grammar
        applied row by row (:func:`chain_scores`); ``logits`` itself when no request has
        either."""
        rows = [i for i, r in enumerate(reqs)
                if r.sampling.has_penalties or r.sampling.structured_output is not None]
        if not rows:
            return logits
        scores = logits.clone()
        for i in rows:
            req, raw = reqs[i], logits[i]
            row = chain_scores(req, drafts[i], raw)
            if req.sampling.structured_output is not None:  # host-side: reads the drafts
                row = self.engine.structured.mask_chain(req, drafts[i].tolist(), raw, row)
            scores[i] = row
        return scores

    def _commit(self, reqs: list[Request], starts: list[int], out: Outcome,
                seeds: torch.Tensor) -> tuple[list[tuple[Request, int]], list[Request]]:
        """Hand the scheduler each request's committed tokens and seed its next round from
        ``seeds`` ``[B, H]`` (a chain's ``d_1`` is picked here, on the device)."""
        new, finished = [], []
        pick = self._pick(seeds, reqs) if self.trees is None else None
        dists = pick.dists() if pick is not None else []
        for i, (r, c) in enumerate(zip(reqs, out.tokens, strict=True)):
            before = r.num_output_tokens
            done = self.engine.scheduler.commit(r, starts[i] + len(c),
                                                list(zip(c, out.logprobs[i], strict=True)),
                                                out.tops[i])
            new.append((r, r.num_output_tokens - before))
            stats = self.request_stats.setdefault(r.request_id, SpecStats())
            for s in (stats, self.stats):
                s.drafted += self.k
                s.accepted += len(c) - 1
                s.rounds += 1
            if done:
                finished.append(r)
            elif pick is None:
                self.states[r.request_id] = DraftState(seeds[i], None, None)
            else:
                self.states[r.request_id] = DraftState(seeds[i], pick.tokens[i], dists[i])
        return new, finished

    # ---- helpers ---------------------------------------------------------------------------

    def _draft_forward(self, ids: torch.Tensor, features: torch.Tensor, mrope: torch.Tensor,
                       batch: AttentionBatch) -> torch.Tensor:
        return self.drafter.forward(ids, features, mrope, batch)

    def _pick(self, feats: torch.Tensor, reqs: list[Request]) -> Picked:
        """The draft's token per row of ``feats`` ``[B, H]`` (argmax, or drawn with the
        request's settings and generator) and the distributions of the drawn ones, on the
        device."""
        sampled = [i for i, r in enumerate(reqs) if not r.sampling.is_greedy]
        if not sampled:
            return Picked(self.drafter.greedy_tokens(feats), None, [])
        logits = self.drafter.logits(feats)
        q = row_probs(rows_of(logits, sampled), [reqs[i].sampling for i in sampled])  # [m, V]
        drawn = draw(q, [generator_of(reqs[i]) for i in sampled])
        if len(sampled) == len(reqs):
            return Picked(drawn, q, sampled)
        tokens = logits.argmax(dim=-1)
        tokens[sampled] = drawn
        return Picked(tokens, q, sampled)

    def _batch(self, rnd: RoundInputs, pos: np.ndarray) -> AttentionBatch:
        """Attention inputs for one draft token per request at absolute index ``pos`` ``[B]``:
        its KV slot is that index through the request's pages (kept apart from its rope
        position)."""
        batch, n = self.engine.runner.batch, len(rnd.reqs)
        (slots,) = to_device([batch.slots(rnd.rows, pos)], rnd.page_table.device)
        return AttentionBatch.build([1] * n, (pos + 1).tolist(), rnd.page_table[:n], slots)

    def _log(self, phase: str, out: SchedulerOutput, mrope: torch.Tensor) -> None:
        if self.position_log is not None:
            rows = [it.request.request_id for it in out.items for _ in range(it.num_tokens)]
            pos = torch.cat([torch.arange(it.start, it.start + it.num_tokens) for it in out.items])
            self.position_log(phase, rows, pos, mrope)

    def _log_rows(self, phase: str, rows: list[str], mrope: torch.Tensor,
                  pos: torch.Tensor) -> None:
        if self.position_log is not None:
            self.position_log(phase, rows, pos, mrope)

    def _log_graph(self, phase: str, rows: list[str]) -> None:
        """Log the (1-D, mrope) positions the last static-buffer forward read, for the audit."""
        if self.position_log is not None:
            pos, mrope = self.graph.positions(len(rows) // self.graph.n)
            self.position_log(phase, rows, pos.clone(), mrope.clone())


def read_outcome(accepted: Accepted, logits: torch.Tensor, ks: list[int]) -> Outcome:
    """A round's outcome on the host, from its one device -> host copy: each request's ``A``
    tokens, their log-probabilities under their verify rows (``logits`` ``[B, N, V]``, row
    ``j`` scoring committed token ``j``: the model's own distribution, as the sampler reports),
    a tree's accepted path, and for each request ``i`` that asks (``ks[i] > 0``) its committed
    tokens' ``ks[i]`` alternatives. Log-probabilities travel as their float32 bit patterns in the
    int64 copy (as :func:`engine.sampling.sampler._to_host` does), so they come back exactly."""
    bsz, n = accepted.tokens.shape
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, N, V]
    picked = logprobs.gather(2, accepted.tokens.unsqueeze(2)).squeeze(2)  # [B, N]
    parts = [accepted.lengths, accepted.tokens.flatten(), _bits(picked)]
    if accepted.path is not None:
        parts.append(accepted.path.flatten())
    asking = [i for i, k in enumerate(ks) if k > 0]
    width = max(ks, default=0)
    if asking:
        values, ids = logprobs[asking].topk(width, dim=-1)  # [m, N, width]
        parts += [ids.flatten(), _bits(values)]
    host = torch.cat(parts).cpu().numpy()  # the round's one read
    fields = iter(np.split(host, np.cumsum([p.numel() for p in parts])[:-1]))
    lengths = next(fields).tolist()
    tokens, lps = next(fields).reshape(bsz, n), _floats(next(fields)).reshape(bsz, n)
    paths = next(fields).reshape(bsz, n) if accepted.path is not None else None
    tops: list[list[TopLogprobs | None]] = [[] for _ in range(bsz)]
    if asking:
        top_ids = next(fields).reshape(len(asking), n, width)
        top_lps = _floats(next(fields)).reshape(len(asking), n, width)
        for j, i in enumerate(asking):
            k = ks[i]
            tops[i] = [TopLogprobs(tuple(top_ids[j, r, :k].tolist()),
                                   tuple(top_lps[j, r, :k].tolist()))
                       for r in range(lengths[i])]
    return Outcome([tokens[i, :a].tolist() for i, a in enumerate(lengths)],
                   [lps[i, :a].tolist() for i, a in enumerate(lengths)], tops,
                   [paths[i, :a].tolist() if paths is not None else [] for i, a in
                    enumerate(lengths)])


def _bits(values: torch.Tensor) -> torch.Tensor:
    """Float32 ``values`` as their bit patterns, flat int64 (exact through an int64 copy)."""
    return values.float().contiguous().view(torch.int32).to(torch.int64).flatten()


def _floats(bits: np.ndarray) -> np.ndarray:
    """The float32 values of :func:`_bits`' patterns, on the host."""
    return bits.astype(np.int32).view(np.float32)
