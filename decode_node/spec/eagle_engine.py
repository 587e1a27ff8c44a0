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

Draft trees (EAGLE-2, ``topk > 1`` or ``steps != K``): the round drafts a tree instead of the
chain and verifies it in one forward under a tree mask (:mod:`decode_node.spec.tree_round`); the
chain (``topk == 1``, ``steps == K``) runs exactly the path above. A tree's drafts are the
draft's top-``k`` tokens whatever the request's sampling; a sampled request's tree is verified
losslessly with the drafts as point masses (:func:`~decode_node.spec.accept.accept_tree_sampled`).

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

from decode_node.spec.accept import accept_greedy, accept_sampled
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
from engine.multimodal.inputs import RequestState
from engine.multimodal.mrope import mrope_from_1d
from engine.runner.draft_runner import DraftRunner
from engine.runner.input_batch import to_device
from engine.sampling.logprobs import top_logprobs
from engine.sampling.penalties import chain_scores
from engine.sampling.sampler import sampling_probs

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
    """The draft's seed for a request's next round."""

    token: int  # d_1: the draft's guess for index S + 1
    feature: torch.Tensor  # [H] the draft output that predicted it
    q: torch.Tensor | None  # [V] the distribution d_1 was drawn from (None when greedy)


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
        feature = feature.to(self.engine.model.dtype)
        tokens, qs = self._pick(feature.unsqueeze(0), [req])
        self.states[req.request_id] = DraftState(tokens[0], feature, qs[0])

    # ---- one speculative round -------------------------------------------------------------

    def _round(self, reqs: list[Request]) -> tuple[list[tuple[Request, int]], list[Request]]:
        if self.trees is not None:
            return self._tree_round(self.trees, reqs)
        n = self.k + 1
        sched = self.engine.scheduler
        starts = [r.num_computed_tokens for r in reqs]
        for r, s in zip(reqs, starts, strict=True):
            sched.grow(r, s + n)
        rnd = self.graph.round_inputs(reqs, starts)
        drafts, qs = self._draft_decode(rnd)
        rows = [r.request_id for r in reqs for _ in range(n)]
        # verify: [b, d_1..d_K] at S..S+K, through the static buffers
        device = self.graph.bufs.device
        ids = torch.tensor([[r.output_token_ids[-1], *d] for r, d in zip(reqs, drafts,
                                                                         strict=True)],
                           device=device).flatten()
        hidden, features = self.graph.verify(rnd, ids)
        self._log_graph("verify", rows)
        logits = self.engine.model.logits(hidden).view(len(reqs), n, -1)
        committed = [self._accept(r, d, q, lg) for r, d, q, lg in zip(reqs, drafts, qs, logits,
                                                                       strict=True)]
        self.graph.keep_states([len(c) for c in committed])  # a hybrid model's accepted states
        # draft extend over the verified window, at the same positions; select_index rows
        ext = torch.tensor([c + [c[-1]] * (n - len(c)) for c in committed],
                           device=device).flatten()
        seeds = self.graph.draft_extend(rnd, ext, features, [len(c) - 1 for c in committed])
        self._log_graph("draft_extend", rows)
        tokens, seed_qs = self._pick(seeds, reqs)
        return self._commit(reqs, starts, committed, logits, tokens, seed_qs, seeds)

    def _tree_round(self, trees: TreeRounds, reqs: list[Request]
                    ) -> tuple[list[tuple[Request, int]], list[Request]]:
        sched = self.engine.scheduler
        starts = [r.num_computed_tokens for r in reqs]
        reach = max(self.k + 1, self.shape.scratch)  # verify window or draft scratch
        for r, s in zip(reqs, starts, strict=True):
            sched.grow(r, s + reach)
        rnd = self.graph.round_inputs(reqs, starts)
        out = trees.run(rnd, torch.stack([self.states[r.request_id].feature for r in reqs]))
        tokens, seed_qs = self._pick(out.seeds, reqs)
        return self._commit(reqs, starts, out.committed, out.logits, tokens, seed_qs, out.seeds)

    def _draft_decode(
        self, rnd: RoundInputs
    ) -> tuple[list[list[int]], list[list[torch.Tensor | None]]]:
        """``K - 1`` draft forwards; returns each request's drafts ``d_1..d_K`` and their
        distributions."""
        reqs = rnd.reqs
        states = [self.states[r.request_id] for r in reqs]
        drafts = [[st.token] for st in states]
        qs: list[list[torch.Tensor | None]] = [[st.q] for st in states]
        feats = torch.stack([st.feature for st in states])  # [B, H]
        starts = np.array(rnd.starts, dtype=np.int64)
        for i in range(self.k - 1):
            pos_np = starts + i  # [B]: step i runs at S + i
            batch = self._batch(rnd, pos_np)
            cur, pos = to_device([np.array([d[-1] for d in drafts], dtype=np.int64), pos_np],
                                 batch.slot_mapping.device)
            mrope = mrope_from_1d(pos, rnd.deltas)  # derived from the final positions of this step
            feats = self._draft_forward(cur, feats, mrope, batch)
            self._log_rows("draft_decode", [r.request_id for r in reqs], mrope, pos)
            tokens, step_qs = self._pick(feats, reqs)
            for d, q_list, tok, q in zip(drafts, qs, tokens, step_qs, strict=True):
                d.append(tok)
                q_list.append(q)
        return drafts, qs

    def _accept(self, req: Request, drafts: list[int], qs: list[torch.Tensor | None],
                logits: torch.Tensor) -> list[int]:
        """Tokens to commit for one request from its verify logits ``[K + 1, V]``."""
        scores = self.engine.structured.mask_chain(req, drafts, logits,
                                                   chain_scores(req, drafts, logits))
        if req.sampling.is_greedy:
            return accept_greedy(drafts, scores.argmax(dim=-1).tolist())
        p = sampling_probs(scores, [req.sampling] * scores.shape[0])
        q = torch.stack([x for x in qs if x is not None])
        return accept_sampled(drafts, p, q, _state(req).generator)

    def _commit(self, reqs: list[Request], starts: list[int], committed: list[list[int]],
                logits: torch.Tensor, tokens: list[int], qs: list[torch.Tensor | None],
                seeds: torch.Tensor) -> tuple[list[tuple[Request, int]], list[Request]]:
        new, finished = [], []
        logprobs = committed_logprobs(logits, committed)
        tops = committed_tops(logits, committed, [r.sampling.top_logprobs for r in reqs])
        for i, (r, c) in enumerate(zip(reqs, committed, strict=True)):
            lps = logprobs[i]
            before = r.num_output_tokens
            done = self.engine.scheduler.commit(r, starts[i] + len(c),
                                                list(zip(c, lps, strict=True)), tops[i])
            new.append((r, r.num_output_tokens - before))
            stats = self.request_stats.setdefault(r.request_id, SpecStats())
            for s in (stats, self.stats):
                s.drafted += self.k
                s.accepted += len(c) - 1
                s.rounds += 1
            if done:
                finished.append(r)
            else:
                self.states[r.request_id] = DraftState(tokens[i], seeds[i], qs[i])
        return new, finished

    # ---- helpers ---------------------------------------------------------------------------

    def _draft_forward(self, ids: torch.Tensor, features: torch.Tensor, mrope: torch.Tensor,
                       batch: AttentionBatch) -> torch.Tensor:
        return self.drafter.forward(ids, features, mrope, batch)

    def _pick(self, feats: torch.Tensor, reqs: list[Request]
              ) -> tuple[list[int], list[torch.Tensor | None]]:
        """The draft's token per row (argmax, or sampled with the request's settings) and the
        distribution it came from."""
        if all(r.sampling.is_greedy for r in reqs):
            return self.drafter.greedy_tokens(feats).tolist(), [None] * len(reqs)
        logits = self.drafter.logits(feats)
        tokens = logits.argmax(dim=-1).tolist()
        qs: list[torch.Tensor | None] = [None] * len(reqs)
        for i, r in enumerate(reqs):
            if not r.sampling.is_greedy:
                q = sampling_probs(logits[i : i + 1], [r.sampling])[0]
                tokens[i] = int(torch.multinomial(q, 1, generator=_state(r).generator).item())
                qs[i] = q
        return tokens, qs

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


def _state(req: Request) -> RequestState:
    assert isinstance(req.payload, RequestState)
    return req.payload


def committed_tops(logits: torch.Tensor, committed: list[list[int]],
                   ks: list[int]) -> list[list[TopLogprobs | None]]:
    """The ``ks[i]`` alternatives of request ``i``'s committed tokens, under the same verify rows
    as :func:`committed_logprobs` (empty lists where ``ks[i]`` is 0; no work when none asks)."""
    out: list[list[TopLogprobs | None]] = [[] for _ in committed]
    asking = [(i, j) for i, c in enumerate(committed) if ks[i] for j in range(len(c))]
    if not asking:
        return out
    ii, jj = (torch.tensor(x, device=logits.device) for x in zip(*asking, strict=True))
    for (i, _), top in zip(asking, top_logprobs(logits[ii, jj], [ks[i] for i, _ in asking]),
                           strict=True):
        out[i].append(top)
    return out


def committed_logprobs(logits: torch.Tensor, committed: list[list[int]]) -> list[list[float]]:
    """Each committed token's log-probability under its verify row: request ``i``'s ``j``-th
    token ``committed[i][j]`` under row ``logits[i, j]`` (``[B, N, V]``). Only the committed
    rows are normalized, in one call."""
    lens = [len(c) for c in committed]
    index = torch.tensor([[i, j, tok] for i, c in enumerate(committed) for j, tok in enumerate(c)],
                         dtype=torch.int64, device=logits.device)  # [M, 3]
    rows = torch.log_softmax(logits[index[:, 0], index[:, 1]], dim=-1)  # [M, V]
    flat = rows.gather(1, index[:, 2:]).squeeze(1).tolist()
    out, at = [], 0
    for n in lens:
        out.append(flat[at : at + n])
        at += n
    return out
