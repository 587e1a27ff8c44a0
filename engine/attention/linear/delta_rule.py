"""The gated delta rule over a flat varlen batch (torch reference).

Per value head, with the key ``k_t`` and query ``q_t`` l2-normalised (eps 1e-6) and the query
scaled by ``Dk ** -0.5``, the state ``S`` ``[Dk, Dv]`` of a sequence advances token by token:

    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t

Value head ``h`` reads key head ``h // (Hv // Hk)``. A one-token sequence takes that step (all
of them in one batched step); a longer one goes through the equivalent chunked form, chunks of
64 from its first token, starting from its slot's state. That is the split transformers' Qwen3.5
makes (recurrent for one token with a cache, chunked otherwise), so outputs match it closely.
The chunks of all longer sequences are stacked (each sequence's last one zero-padded), so memory
follows the tokens, and the scan over chunks steps every sequence still running together: the
Python loop runs as many times as the longest sequence has chunks.

The chunked form, for a chunk starting from state ``S0`` with ``G_t`` the cumulative log decay
inside the chunk: the corrected values ``u`` solve the unit lower-triangular system
``u_t + sum_{s<t} beta_t exp(G_t - G_s) (k_t . k_s) u_s = beta_t (v_t - exp(G_t) S0^T k_t)``;
then ``o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s`` and the chunk ends
in ``exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T``.

A speculative verify window (``B`` sequences of ``n`` rows) takes the one-token step on every
row, over one running state per sequence, and writes no slot. It keeps either the state after
every row (:func:`gated_delta_rule_window`, ``[B, n, Hv, Dk, Dv]``) or only the rows' inputs to
the state update (:func:`gated_delta_rule_window_inputs`, :class:`WindowInputs`: ``Dk + Dv + 2``
floats per row and value head against ``Dk * Dv``); from those, :func:`replay_window` steps
each slot's untouched state through its accepted rows again, with the same arithmetic, so both
leave the same bits in the pool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.attention.linear import native
from engine.attention.linear.varlen import span_rows, split_varlen

CHUNK = 64
L2_EPS = 1e-6


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    q_starts: Sequence[int],
    state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The rule's output for every token of the batch: ``[T, Hv, Dv]`` in ``v``'s dtype.

    ``q``, ``k`` ``[T, Hk, Dk]`` (not yet normalised), ``v`` ``[T, Hv, Dv]``, ``g`` ``[T, Hv]``
    (log decay, float32), ``beta`` ``[T, Hv]``; sequence ``b`` owns rows
    ``q_starts[b]:q_starts[b + 1]`` (host offsets). ``state`` ``[num_slots, Hv, Dk, Dv]``
    float32 is the pool's tensor for this layer and ``slots`` ``[B]`` int64 the sequences'
    (distinct) slots: slot ``slots[b]`` starts sequence ``b`` and afterwards holds its state
    after its last token; no other slot changes. Computes in float32.
    """
    num_v_heads = v.shape[1]
    if num_v_heads % k.shape[1]:
        raise ValueError(f"{num_v_heads} value heads do not split over {k.shape[1]} key heads")
    split = split_varlen(q_starts, slots, v.shape[0])
    qf, kf = _normalised(q, k, num_v_heads)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if split.num_single:
        rows = split.single_rows
        q1, k1, v1, g1, b1 = (t.index_select(0, rows) for t in (qf, kf, vf, gf, bf))
        o = _step_in_pool(q1, k1, v1, g1, b1, state, split.single_slots)
        out.index_copy_(0, rows, o.to(v.dtype))
    if split.spans:
        layout = _ChunkLayout(split.spans, v.device)
        slot = split.span_slots.index_select(0, layout.order)
        qc, kc, vc, gc, bc = (layout.pad(layout.gather(t)) for t in (qf, kf, vf, gf, bf))
        o, s = _chunked(qc, kc, vc, gc, bc, state.index_select(0, slot), layout)
        state.index_copy_(0, slot, s)
        out.index_copy_(0, layout.rows, layout.unpad(o).to(v.dtype))
    return out


def _normalised(q: torch.Tensor, k: torch.Tensor, num_v_heads: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` in float32, l2-normalised, ``q`` scaled, each key head repeated for the
    value heads that read it: ``[T, Hv, Dk]`` each."""
    group = num_v_heads // k.shape[1]
    qf, kf = (x.float() for x in (q, k))
    qf = qf * torch.rsqrt(qf.square().sum(-1, keepdim=True) + L2_EPS) * q.shape[-1] ** -0.5
    kf = kf * torch.rsqrt(kf.square().sum(-1, keepdim=True) + L2_EPS)
    if group == 1:  # as many key heads as value heads (Qwen3.5's small models): no copy
        return qf, kf
    return qf.repeat_interleave(group, dim=1), kf.repeat_interleave(group, dim=1)


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ``N`` sequences: ``q``, ``k`` ``[N, H, Dk]``, ``v`` ``[N, H, Dv]``, ``g``,
    ``beta`` ``[N, H]``, state ``s`` ``[N, H, Dk, Dv]``; returns the output ``[N, H, Dv]`` and
    the new state (``s`` itself is left as it was)."""
    new = torch.empty(s.shape, dtype=s.dtype, device=s.device)
    out = _one_token(q, k, v, g, beta, s, new, None)
    assert out is not None
    return out, new


def _advance(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             s: torch.Tensor) -> torch.Tensor:
    """The state update of :func:`_step` alone: the new state, in a tensor of its own (``s``
    is left as it was)."""
    new = torch.empty(s.shape, dtype=s.dtype, device=s.device)
    _one_token(None, k, v, g, beta, s, new, None)
    return new


def _step_in_pool(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """:func:`_step` over the pool's slots ``slots`` ``[N]`` (distinct), updated where they
    are: the outputs ``[N, H, Dv]``, the same bits as :func:`_step` on gathered states."""
    out = _one_token(q, k, v, g, beta, state, state, slots)
    assert out is not None
    return out


def _one_token(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
               slots: torch.Tensor | None) -> torch.Tensor | None:
    """Every one-token step of the rule (decode rows, verify windows, replays) goes through
    here, so all of them compute the same bits on one machine: the state of row ``b``, read
    from ``src`` at ``slots[b]`` (None: at ``b``), advanced by one token into ``dst`` at the
    same index (``dst`` is ``src``, the pool, when ``slots`` is given), and the output
    ``[N, H, Dv]`` float32 read from it (None without ``q``). On a CPU with the native kernel
    (``native``), its fused step; otherwise the torch ops (:func:`_one_token_torch`)."""
    if (src.device.type == "cpu" and dst.is_contiguous()
            and src.dtype == dst.dtype == torch.float32):
        kernel = native.one_token_kernel()
        if kernel is not None:
            return native.one_token(kernel, q, k, v, g, beta, src.contiguous(), dst, slots)
    return _one_token_torch(q, k, v, g, beta, src, dst, slots)


def _one_token_torch(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                     slots: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`_one_token` in torch ops (the native kernel's twin, and the accelerators' step).

    Over the pool (``slots`` given), slots on the host (a CPU pool) are taken in runs of
    consecutive slots, each run a view of the pool stepped in place: no gathered copy of the
    states and no scatter back, which moved as many bytes as the step itself. The allocator
    hands out the lowest free slot, so a batch's slots are few runs (one, for requests that
    started together). Slots on an accelerator are not read back to the host: their states are
    gathered, stepped and scattered."""
    if slots is None:
        _update(k, v, g, beta, src, dst)
        return None if q is None else _read(q, dst)
    assert src is dst, "over slots, the step is in place"
    if slots.device.type != "cpu":
        s = src.index_select(0, slots)
        _update(k, v, g, beta, s, s)
        dst.index_copy_(0, slots, s)
        return None if q is None else _read(q, s)
    host = slots.tolist()
    order = sorted(range(len(host)), key=host.__getitem__)
    if order == list(range(len(host))) and host == list(range(host[0], host[0] + len(host))):
        run = dst[host[0]:host[0] + len(host)]  # one run in batch order: no index at all
        _update(k, v, g, beta, run, run)
        return None if q is None else _read(q, run)
    out = None if q is None else torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    start = 0
    for end in range(1, len(order) + 1):
        if end < len(order) and host[order[end]] == host[order[end - 1]] + 1:
            continue
        rows = torch.tensor(order[start:end], dtype=torch.int64)
        first = host[order[start]]
        run = dst[first:first + end - start]
        k1, v1, g1, b1 = (t.index_select(0, rows) for t in (k, v, g, beta))
        _update(k1, v1, g1, b1, run, run)
        if out is not None and q is not None:
            out.index_copy_(0, rows, _read(q.index_select(0, rows), run))
        start = end
    return out


def _update(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            s: torch.Tensor, out: torch.Tensor) -> None:
    """Write the state after one token, from ``s``, into ``out`` (contiguous; ``s`` itself for
    an update in place): the torch ops' arithmetic of a one-token step.

    The decay is applied to the vector the state gives back (``(e^g S)^T k = e^g (S^T k)``)
    rather than to the state before reading it, and the write is one rank-1 ``baddbmm_`` into
    the decayed state: two passes over the states (a read, then the decayed state updated in
    place) where decaying first, then reading and adding an outer product made five, with
    three state-sized temporaries (3.2x faster at 32 sequences of Qwen3.5's 16 x 128 x 128)."""
    n, h, dk, dv = s.shape
    decay = g.exp()  # [N, H]
    seen = torch.bmm(k.reshape(n * h, 1, dk), s.reshape(n * h, dk, dv)).view(n, h, dv)
    delta = (v - decay.unsqueeze(-1) * seen) * beta.unsqueeze(-1)  # [N, H, Dv]
    torch.mul(s, decay[..., None, None], out=out)
    out.view(n * h, dk, dv).baddbmm_(k.reshape(n * h, dk, 1), delta.reshape(n * h, 1, dv))


def _read(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``S^T q`` per sequence and head: ``q`` ``[N, H, Dk]``, ``s`` ``[N, H, Dk, Dv]`` ->
    ``[N, H, Dv]``."""
    n, h, dk, dv = s.shape
    return torch.bmm(q.reshape(n * h, 1, dk), s.reshape(n * h, dk, dv)).view(n, h, dv)


class _ChunkLayout:
    """Where the tokens of several sequences go when each is cut into whole chunks (its last
    one zero-padded) and all chunks are stacked, chunk-major: sequences longest first
    (``order``, indexes into the spans), so the sequences still running at chunk ``c`` are a
    prefix (``active[c]`` of them), and chunk ``c`` of sequence ``m`` at stacked index
    ``starts[c] + m``: the running sequences' chunk ``c`` is the slab
    ``starts[c] : starts[c] + active[c]``, which the scan over chunks reads and writes as a
    view. Token ``i`` of sequence ``m`` goes to position ``i % CHUNK`` of stacked chunk
    ``starts[i // CHUNK] + m`` (``chunk``, ``pos``), read from batch row ``rows``."""

    def __init__(self, spans: Sequence[tuple[int, int]], device: torch.device) -> None:
        order = sorted(range(len(spans)), key=lambda m: spans[m][0] - spans[m][1])
        spans = [spans[m] for m in order]
        counts = [math.ceil((end - start) / CHUNK) for start, end in spans]
        self.active = [sum(n > c for n in counts) for c in range(counts[0])]
        self.starts = list(accumulate(self.active, initial=0))
        self.num_chunks = self.starts[-1]
        self.order = torch.tensor(order, dtype=torch.int64, device=device)
        self.rows = span_rows(spans, device)
        # the spans (in this order) are rows 0, 1, 2, ... of the batch, one after the other
        self.from_zero = spans[0][0] == 0 and all(
            a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        starts = torch.tensor(self.starts[:-1], dtype=torch.int64, device=device)
        chunk, pos = [], []
        for m, (start, end) in enumerate(spans):
            i = torch.arange(end - start, device=device)
            chunk.append(starts.index_select(0, i // CHUNK) + m)
            pos.append(i % CHUNK)
        self.chunk, self.pos = torch.cat(chunk), torch.cat(pos)  # [R] each, in ``rows`` order

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The batch rows of the spans, in ``rows`` order (``x`` itself when they are all of
        its rows in order)."""
        if self.from_zero and self.rows.shape[0] == x.shape[0]:
            return x
        return x.index_select(0, self.rows)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``x`` ``[R, H, ...]`` (in ``rows`` order) laid out as chunks, head-major and
        contiguous: ``[num_chunks, H, CHUNK, ...]`` (one write of zeros, one scatter). Zero
        padding leaves a state as it is (no decay, no write) and its outputs are never read."""
        padded = x.new_zeros(self.num_chunks, x.shape[1], CHUNK, *x.shape[2:])
        padded[self.chunk, :, self.pos] = x
        return padded

    def unpad(self, o: torch.Tensor) -> torch.Tensor:
        """The rows of chunked outputs ``o`` ``[num_chunks, H, CHUNK, ...]``, in ``rows``
        order: ``[R, H, ...]``."""
        return o[self.chunk, :, self.pos]


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, s: torch.Tensor, layout: _ChunkLayout
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences of ``layout`` from states ``s`` ``[M, H, Dk, Dv]`` (in ``layout.order``; a
    tensor of the caller's own, stepped in place and returned as the final states):
    ``q``, ``k`` ``[num_chunks, H, CHUNK, Dk]``, ``v`` ``[num_chunks, H, CHUNK, Dv]``, ``g``,
    ``beta`` ``[num_chunks, H, CHUNK]``, all contiguous. Returns the outputs
    ``[num_chunks, H, CHUNK, Dv]`` and the final states (module docstring for the algebra).
    Everything inside a chunk is computed for all chunks at once; the scan over chunks steps
    every running sequence together, on slabs of the stacked chunks (no gather, no scatter)."""
    dk, dv = k.shape[-1], v.shape[-1]
    cum = g.cumsum(-1)  # G_t
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    # exp(G_t - G_s) for s <= t, 0 above the diagonal (masked before exp: no overflow)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, -math.inf).exp()
    k_beta = k * beta.unsqueeze(-1)
    # the system's strictly lower part; solve_triangular(unitriangular) takes the diagonal as 1
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    rhs = torch.empty(*v.shape[:-1], dv + dk, dtype=v.dtype, device=v.device)
    torch.mul(v, beta.unsqueeze(-1), out=rhs[..., :dv])
    torch.mul(k_beta, cum.exp().unsqueeze(-1), out=rhs[..., dv:])
    # solved where the right-hand side is (no copy of it)
    torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True, out=rhs)
    u_free, u_state = rhs.split([dv, dk], dim=-1)  # u = u_free - u_state @ S0
    scores = q @ k.transpose(-1, -2) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = (k * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for c, running in enumerate(layout.active):
        slab = slice(layout.starts[c], layout.starts[c] + running)
        now = s[:running]
        u = torch.baddbmm(u_free[slab].flatten(0, 1), u_state[slab].flatten(0, 1),
                          now.flatten(0, 1), alpha=-1).view(u_free[slab].shape)
        torch.matmul(q_decayed[slab], now, out=out[slab])
        out[slab] += scores[slab] @ u
        now.mul_(chunk_decay[slab]).add_(k_to_end[slab] @ u)
    return out, s


@dataclass(frozen=True)
class WindowInputs:
    """What the state updates of a verify window of ``B`` sequences of ``n`` rows read, as its
    steps read them (float32): ``k`` ``[B, n, Hv, Dk]`` (l2-normalised, each key head repeated
    for its value heads), ``v`` ``[B, n, Hv, Dv]``, ``g`` and ``beta`` ``[B, n, Hv]``. With the
    state a sequence started from, they give its state after any number of its rows
    (:func:`replay_window`)."""

    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @property
    def nbytes(self) -> int:
        """The bytes the four tensors hold."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.g, self.beta))


def gated_delta_rule_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    n: int,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over ``B`` sequences of ``n`` rows each (a speculative verify window), leaving
    the pool untouched: the inputs as :func:`gated_delta_rule`'s (sequence ``b`` owns rows
    ``b * n .. b * n + n - 1``), its state read from slot ``slots[b]`` of ``state``.

    Every row takes the one-token recurrent step (the arithmetic of a decode row, so a verified
    row's output is the one plain decoding computes). Returns the outputs ``[B * n, Hv, Dv]`` in
    ``v``'s dtype and the state after each row ``[B, n, Hv, Dk, Dv]`` float32 (index ``a - 1``:
    the state after the sequence's first ``a`` rows)."""
    qs, inputs = _window_inputs(q, k, v, g, beta, n)
    s = state.index_select(0, slots)  # [B, Hv, Dk, Dv]
    after = torch.empty(slots.shape[0], n, *s.shape[1:], dtype=torch.float32, device=v.device)
    return _window_outputs(qs, inputs, s, after).to(v.dtype), after


def gated_delta_rule_window_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    n: int,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, WindowInputs]:
    """:func:`gated_delta_rule_window` keeping each row's inputs instead of its state: the same
    outputs (the same steps, over one running state), and the window's :class:`WindowInputs`
    for :func:`replay_window`. The pool stays untouched."""
    qs, inputs = _window_inputs(q, k, v, g, beta, n)
    return _window_outputs(qs, inputs, state.index_select(0, slots)).to(v.dtype), inputs


def replay_window(inputs: WindowInputs, state: torch.Tensor, slots: torch.Tensor,
                  accepted: torch.Tensor) -> None:
    """After :func:`gated_delta_rule_window_inputs` over slots ``slots`` ``[B]`` of ``state``
    (untouched since): slot ``slots[b]`` of each of the first ``R`` sequences takes its state
    after its first ``accepted[b]`` rows (``accepted`` ``[R]`` int64, each in ``1..n``; those
    ``R`` slots distinct). No other slot changes.

    The state is replayed from the slot's with the window's own steps, every sequence of the
    window stepping together (the rows past a sequence's count, and the sequences past ``R``,
    keep their state as it is), so each step has the window's shapes and arithmetic: the state
    written is bit for bit the one :func:`gated_delta_rule_window` returns at
    ``accepted[b] - 1``."""
    r = accepted.shape[0]
    counts = accepted.new_zeros(slots.shape[0])
    counts[:r] = accepted
    s = state.index_select(0, slots)
    for j in range(int(accepted.max()) if r else 0):  # the longest accepted prefix
        stepped = _advance(inputs.k[:, j], inputs.v[:, j], inputs.g[:, j], inputs.beta[:, j], s)
        s = torch.where((counts > j)[:, None, None, None], stepped, s)
    state.index_copy_(0, slots[:r], s[:r])


def _window_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, n: int) -> tuple[torch.Tensor, WindowInputs]:
    """A window's queries ``[B, n, Hv, Dk]`` and its :class:`WindowInputs` (float32, each
    tensor its own storage: none keeps a larger activation alive)."""
    num_v_heads = v.shape[1]
    if num_v_heads % k.shape[1]:
        raise ValueError(f"{num_v_heads} value heads do not split over {k.shape[1]} key heads")
    b = v.shape[0] // n
    qf, kf = _normalised(q, k, num_v_heads)

    def seqs(t: torch.Tensor) -> torch.Tensor:  # [B * n, ...] -> [B, n, ...] float32
        return t.float().contiguous().view(b, n, *t.shape[1:])

    qs, ks, vs, gs, bs = (seqs(t) for t in (qf, kf, v, g, beta))
    return qs, WindowInputs(ks, vs, gs, bs)


def _window_outputs(qs: torch.Tensor, inputs: WindowInputs, s: torch.Tensor,
                    after: torch.Tensor | None = None) -> torch.Tensor:
    """Every row of the window from states ``s`` ``[B, Hv, Dk, Dv]``: the one-token step, row
    after row, over one running state; its outputs ``[B * n, Hv, Dv]`` float32. With ``after``
    ``[B, n, Hv, Dk, Dv]``, ``after[:, j]`` takes the state after row ``j``."""
    b, n, num_v_heads = qs.shape[:3]
    out = torch.empty(b, n, num_v_heads, inputs.v.shape[-1], dtype=torch.float32,
                      device=qs.device)
    for j in range(n):
        out[:, j], s = _step(qs[:, j], inputs.k[:, j], inputs.v[:, j], inputs.g[:, j],
                             inputs.beta[:, j], s)
        if after is not None:
            after[:, j] = s
    return out.view(b * n, num_v_heads, -1)
