"""min_p, repetition/frequency/presence penalties, generation_config.json defaults, stop strings
in the relay and EAGLE's lossless acceptance under penalties, each against a reference written
here in plain torch (or plain Python) on the logits."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from decode_node.spec.accept import accept_greedy, accept_sampled
from engine.core.request import Request, SamplingParams
from engine.errors import ConfigError, InvalidRequestError
from engine.sampling.generation_config import GenerationDefaults
from engine.sampling.penalties import apply_penalties, chain_scores, history_of
from engine.sampling.sampler import Sampler, make_generator, sampling_probs
from engine.text.tokenizer import Tokenizer
from proto.convert import sampling_kwargs, sampling_message
from proto.pdserve.v1 import generate_pb2 as gpb
from router.preprocess import ModelAssets, Preprocessor
from router.relay import END, Outgoing, relay

V = 24


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2.5  # [n, V]


def ref_penalize(row: torch.Tensor, prompt: list[int], output: list[int],
                 p: SamplingParams) -> torch.Tensor:
    """The rules of SamplingParams, token by token."""
    out = row.clone()
    for tok in set(prompt) | set(output):
        x = float(out[tok])
        out[tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for tok, count in Counter(output).items():
        out[tok] -= p.frequency_penalty * count + p.presence_penalty
    for tok, bias in p.logit_bias:
        out[tok] += bias
    return out


def ref_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """temperature, then top-k, then top-p over what top-k kept, then min-p; renormalised."""
    probs = torch.softmax(row.double() / p.temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    keep = order[: p.top_k] if p.top_k else order
    mass = sum(float(probs[t]) for t in keep)
    nucleus, acc = [], 0.0
    for t in keep:
        if acc >= p.top_p * mass and p.top_p < 1.0:
            break
        nucleus.append(t)
        acc += float(probs[t])
    top = float(probs[nucleus[0]])
    final = [t for t in nucleus if float(probs[t]) >= p.min_p * top] or nucleus[:1]
    out = torch.zeros_like(probs)
    out[final] = probs[final]
    return out / out.sum()


def _request(prompt: list[int], output: list[int], p: SamplingParams) -> Request:
    return Request("r", prompt, p, output_token_ids=list(output))


PENALTIES = [SamplingParams(repetition_penalty=1.7), SamplingParams(repetition_penalty=0.6),
             SamplingParams(frequency_penalty=0.9), SamplingParams(presence_penalty=-1.3),
             SamplingParams(repetition_penalty=1.3, frequency_penalty=-0.4, presence_penalty=2.0),
             SamplingParams(logit_bias=((3, 5.0), (9, -100.0), (11, 100.0))),
             SamplingParams(repetition_penalty=1.4, logit_bias=((4, -2.5),))]


@pytest.mark.parametrize("params", PENALTIES)
def test_penalties_equal_the_rules_and_greedy_takes_their_argmax(params: SamplingParams) -> None:
    logits = _logits(3, seed=1)
    prompts, outputs = [[1, 2, 3, 3], [5], [7, 8]], [[3, 4, 4, 4, 9], [], [8, 8, 1]]
    reqs = [_request(pr, out, params) for pr, out in zip(prompts, outputs, strict=True)]
    reqs[1] = _request([5], [], SamplingParams())  # a row without penalties stays as it is
    got = apply_penalties(logits, reqs)
    for i, r in enumerate(reqs):
        want = ref_penalize(logits[i], r.prompt_token_ids, r.output_token_ids, r.sampling)
        torch.testing.assert_close(got[i], want)
    tokens, lps = Sampler().sample(logits, [r.sampling for r in reqs], [None] * 3, got)
    assert tokens == got.argmax(-1).tolist()
    raw = torch.log_softmax(logits, -1)  # logprobs stay the model's own distribution
    assert lps == pytest.approx([float(raw[i, t]) for i, t in enumerate(tokens)], abs=1e-6)


def test_no_penalties_is_no_copy_and_histories_update_incrementally() -> None:
    logits = _logits(2)
    assert apply_penalties(logits, [_request([1], [2], SamplingParams())] * 2) is logits
    req = _request([1, 1, 6], [2], SamplingParams(frequency_penalty=1.0))
    history_of(req, V, logits.device)
    req.output_token_ids += [2, 6, 7]
    hist = history_of(req, V, logits.device)
    assert hist.counts.tolist() == torch.bincount(torch.tensor([2, 2, 6, 7]), minlength=V).tolist()
    assert hist.prompt_seen.nonzero().flatten().tolist() == [1, 6]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, min_p=0.2),
    SamplingParams(temperature=1.5, min_p=0.05, top_k=9),
    SamplingParams(temperature=1.0, min_p=0.3, top_p=0.7),
    SamplingParams(temperature=2.0, min_p=0.1, top_k=12, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=1.0),
])
def test_min_p_with_the_other_filters_equals_the_reference(params: SamplingParams) -> None:
    logits = _logits(4, seed=2)
    got = sampling_probs(logits, [params] * 4)
    for i in range(4):
        torch.testing.assert_close(got[i].double(), ref_probs(logits[i], params), atol=1e-6,
                                   rtol=1e-5)


def test_sampler_draws_from_the_penalized_min_p_distribution() -> None:
    params = SamplingParams(temperature=1.2, min_p=0.08, repetition_penalty=1.5,
                            presence_penalty=0.7, seed=3)
    row = _logits(1, seed=5)[0]
    req = _request([0, 1, 2], [2, 3, 3], params)
    n = 3000
    scores = apply_penalties(row.expand(n, V).contiguous(), [req] * n)
    tokens, _ = Sampler().sample(row.expand(n, V), [params] * n, [None] * n, scores)
    want = ref_probs(ref_penalize(row, [0, 1, 2], [2, 3, 3], params), params)
    observed = torch.bincount(torch.tensor(tokens), minlength=V).double()
    assert set(observed.nonzero().flatten().tolist()) <= set(want.nonzero().flatten().tolist())
    kept = want > 0
    expected = want[kept] * n
    chi2 = float(((observed[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 3.0 * int(kept.sum()) + 20, (chi2, observed, expected)


@pytest.mark.parametrize(("field", "value"), [
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")), ("frequency_penalty", 2.5),
    ("presence_penalty", -2.01), ("presence_penalty", True), ("stop", ("",)),
    ("stop", ["x"]), ("stop", tuple("abcdefghijklmnopq")),
    ("logit_bias", ((1, 100.5),)), ("logit_bias", ((-1, 1.0),)), ("logit_bias", ((1, 1.0),
                                                                                  (1, -1.0))),
    ("logit_bias", ((1, float("nan")),)), ("logit_bias", {1: 1.0}),
    ("logit_bias", tuple((t, 1.0) for t in range(1025))),
])
def test_out_of_range_values_are_refused(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value}).validate()


def test_wire_round_trip_keeps_every_field() -> None:
    p = SamplingParams(temperature=0.5, top_p=0.25, top_k=3, max_new_tokens=7, seed=9,
                       min_p=0.125, repetition_penalty=1.25, frequency_penalty=-0.5,
                       presence_penalty=0.75, stop=("a", "bc"), logit_bias=((3, 1.5), (7, -2.0)))
    assert SamplingParams(**sampling_kwargs(sampling_message(dataclasses.asdict(p)), 1)) == p
    assert SamplingParams(**sampling_kwargs(gpb.SamplingParams(), 5)) == SamplingParams(
        max_new_tokens=5)


# ---- generation_config.json defaults ---------------------------------------------------------

def test_generation_config_file(tmp_path: Path) -> None:
    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": None,
         "repetition_penalty": 1.05, "max_new_tokens": 64, "eos_token_id": [1, 2]}))
    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults(
        temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_new_tokens=64)
    assert GenerationDefaults.from_dict({"do_sample": False, "temperature": 0.7}).temperature == 0
    for bad in ({"top_k": 1.5}, {"temperature": "hot"}, {"do_sample": "yes"}):
        with pytest.raises(ConfigError):
            GenerationDefaults.from_dict(bad)


def test_checkpoint_defaults_fill_only_unset_fields(tiny_dir: Path) -> None:
    defaults = GenerationDefaults(temperature=0.75, top_p=0.5, top_k=20, min_p=0.0625,
                                  repetition_penalty=1.125, max_new_tokens=9)  # float32-exact
    assets = dataclasses.replace(ModelAssets.from_dir(tiny_dir), generation=defaults)
    prep = Preprocessor(assets, max_new_tokens_default=32, max_images=1)
    filled = prep._sampling(gpb.SamplingParams())  # noqa: SLF001 - the defaults step itself
    got = SamplingParams(**sampling_kwargs(filled, 0))
    assert got == SamplingParams(temperature=0.75, top_p=0.5, top_k=20, min_p=0.0625,
                                 repetition_penalty=1.125, max_new_tokens=9)
    given = gpb.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                               repetition_penalty=1.0, max_new_tokens=4)
    got = SamplingParams(**sampling_kwargs(prep._sampling(given), 0))  # noqa: SLF001
    assert got == SamplingParams(max_new_tokens=4)
    plain = Preprocessor(ModelAssets.from_dir(tiny_dir), 32, 1)
    got = SamplingParams(**sampling_kwargs(plain._sampling(gpb.SamplingParams()), 0))  # noqa: SLF001
    assert got == SamplingParams(max_new_tokens=32)
    with pytest.raises(InvalidRequestError, match="repetition_penalty"):
        plain._sampling(gpb.SamplingParams(repetition_penalty=0.0))  # noqa: SLF001


# ---- stop strings in the relay (every door) --------------------------------------------------

class _Run:
    """What the relay uses of a RoomRun; :meth:`feed` plays the decode stream, one message at
    a time."""

    def __init__(self, prompt_len: int) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.aborted = False
        self.scores_due = False  # no prompt log-probabilities asked for
        self.decode = SimpleNamespace(address="d")
        self.request = SimpleNamespace(token_ids=[0] * prompt_len)
        self.closed = 0

    async def feed(self, msgs: list[gpb.GenerateResponse]) -> None:
        for m in msgs:
            if self.closed:
                return
            self.queue.put_nowait(m)
            await asyncio.sleep(0.001)
        self.queue.put_nowait(END)

    def close(self) -> None:
        self.closed += 1


def _relay(tok: Tokenizer, msgs: list[gpb.GenerateResponse], stops: tuple[str, ...]
           ) -> tuple[list[gpb.GenerateResponse], _Run]:
    async def go() -> tuple[list[gpb.GenerateResponse], _Run]:
        run = _Run(5)
        feeder = asyncio.create_task(run.feed(msgs))
        outgoing = Outgoing("r", [0] * 5, tok.detokenizer(), False, stops)
        out = [m async for m in relay(run, outgoing)]  # type: ignore[arg-type]
        await feeder
        return out, run
    return asyncio.run(go())


def test_relay_cuts_at_the_first_stop_string_and_ends_the_room(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    assert tok is not None
    ids = tok.encode("alpha beta gamma delta epsilon")
    full = tok.decode(ids)
    msgs = [gpb.GenerateResponse(token_ids=[t]) for t in ids]
    msgs.append(gpb.GenerateResponse(finished=True, finish_reason="length",
                                     usage=gpb.Usage(prompt_tokens=5,
                                                     completion_tokens=len(ids))))
    out, run = _relay(tok, msgs, ())
    assert "".join(m.text for m in out) == full and run.closed == 0
    stop = full[full.index("gam"):full.index("gam") + 4]
    out, run = _relay(tok, msgs, ("zzz", stop))
    assert "".join(m.text for m in out) == full[: full.index(stop)]
    last = out[-1]
    assert last.finished and last.finish_reason == "stop" and run.closed == 1
    sent = sum(len(m.token_ids) for m in out)
    assert sent < len(ids) and last.usage.completion_tokens == sent
    assert last.usage.prompt_tokens == 5
    out, run = _relay(tok, msgs, ("epsilon",))  # in the last message: the worker's usage stays
    assert "".join(m.text for m in out) == full[: full.index("epsilon")]
    assert out[-1].finish_reason == "stop" and out[-1].usage.completion_tokens == len(ids)


# ---- EAGLE stays lossless under penalties ----------------------------------------------------

def test_speculative_sampling_keeps_the_penalized_target_distribution() -> None:
    """Rounds of K = 2 drafts from a fixed q near the unpenalized target, verified against
    position-wise target logits with penalties through :func:`chain_scores`: the first two
    committed tokens follow the penalized target's joint distribution P(t1) P(t2 | t1)."""
    gen = torch.Generator().manual_seed(0)
    vocab = 3
    target = torch.randn(4, vocab, generator=gen) * 0.7  # [position, V] raw logits
    q = torch.softmax(target[:2] + 0.3 * torch.randn(2, vocab, generator=gen), dim=-1)
    trials = 3000
    draws = iter(torch.multinomial(q, 4 * trials, replacement=True, generator=gen).T.tolist())
    params = SamplingParams(temperature=1.0, repetition_penalty=2.5, frequency_penalty=0.8,
                            presence_penalty=0.5)
    prompt = [1]
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def verify_probs(out: list[int], drafts: list[int]) -> torch.Tensor:
        key = (*out, *drafts)
        if key not in cache:
            req = _request(prompt, out, params)
            start = len(out)
            cache[key] = sampling_probs(chain_scores(req, drafts, target[start:start + 3]),
                                        [params] * 3)
        return cache[key]

    pairs: Counter[tuple[int, int]] = Counter()
    for _ in range(trials):
        out: list[int] = []
        while len(out) < 2:
            drafts = next(draws)
            out += accept_sampled(drafts, verify_probs(out, drafts), q, gen)
        pairs[(out[0], out[1])] += 1
    expected = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t1 in range(vocab):
        p1 = ref_probs(ref_penalize(target[0], prompt, [], params), params)
        p2 = ref_probs(ref_penalize(target[1], prompt, [t1], params), params)
        expected[t1] = p1[t1] * p2 * trials
    observed = torch.tensor([[pairs[(a, b)] for b in range(vocab)] for a in range(vocab)],
                            dtype=torch.float64)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 26.1, (chi2, observed, expected)  # p = 0.001 at 8 degrees of freedom


def test_greedy_verify_compares_with_the_penalized_argmax() -> None:
    logits = _logits(3, seed=7)
    params = SamplingParams(repetition_penalty=3.0, frequency_penalty=2.0)
    req = _request([0], [5], params)
    drafts = [int(logits[0].argmax()), int(logits[1].argmax())]
    scores = chain_scores(req, drafts, logits)
    for j in range(3):
        want = ref_penalize(logits[j], [0], [5, *drafts[:j]], params)
        torch.testing.assert_close(scores[j], want)
    assert accept_greedy(drafts, scores.argmax(-1).tolist()) == accept_greedy(
        drafts, [int(ref_penalize(logits[j], [0], [5, *drafts[:j]], params).argmax())
                 for j in range(3)])
    assert make_generator(None) is None  # greedy needs no generator


def test_eagle_greedy_with_penalties_equals_plain_decoding(tiny_dir: Path,
                                                           tmp_path: Path) -> None:
    """End to end on the tiny model: the engine penalizes every step's logits with the prompt
    and output history, and EAGLE's greedy verify with penalties commits exactly those tokens."""
    from decode_node.spec.eagle_engine import EagleEngine
    from engine.builtin.tiny_model import write_tiny_draft
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine, Prompt
    from engine.models.eagle.loader import load_draft

    prompts = [Prompt(token_ids=[5, 6, 7, 5, 6, 7, 5, 6])]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.8,
                            frequency_penalty=0.5, presence_penalty=0.25)
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=32, page_size=8, lookahead_tokens=3))
    want = engine.generate(prompts, params)
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert want[0].token_ids != plain[0].token_ids  # the penalties matter here
    draft = load_draft(write_tiny_draft(tmp_path / "draft"), engine.model_config.text,
                       torch.float32)
    spec = EagleEngine(engine, draft, 3)
    got = spec.generate(prompts, params)
    assert got[0].token_ids == want[0].token_ids
    assert spec.stats.rounds > 0


def test_logit_bias_steers_greedy_and_eagle_alike(tiny_dir: Path, tmp_path: Path) -> None:
    """A bias of -100 on the model's greedy token moves greedy decoding off it, +100 on a token
    makes every step take it; the log-probabilities stay the model's own; EAGLE's greedy verify
    under the same biases commits exactly those tokens; a token outside the vocabulary is
    refused by name."""
    from decode_node.spec.eagle_engine import EagleEngine
    from engine.builtin.tiny_model import write_tiny_draft
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine, Prompt
    from engine.models.eagle.loader import load_draft

    prompts = [Prompt(token_ids=[5, 6, 7, 5, 6, 7, 5, 6])]
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=32, page_size=8, lookahead_tokens=3))
    [free] = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                     top_logprobs=2))
    first, second = free.top_logprobs[0].token_ids
    banned = SamplingParams(max_new_tokens=12, ignore_eos=True, logit_bias=((first, -100.0),))
    [steered] = engine.generate(prompts, banned)
    assert steered.token_ids[0] == second and first not in steered.token_ids
    assert steered.logprobs[0] == pytest.approx(free.top_logprobs[0].logprobs[1], abs=1e-5)
    [forced] = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True,
                                                       logit_bias=((42, 100.0),)))
    assert forced.token_ids == [42] * 6
    draft = load_draft(write_tiny_draft(tmp_path / "draft"), engine.model_config.text,
                       torch.float32)
    spec = EagleEngine(engine, draft, 3)
    assert spec.generate(prompts, banned)[0].token_ids == steered.token_ids
    assert spec.stats.rounds > 0
    with pytest.raises(InvalidRequestError, match="logit_bias has a token id outside"):
        engine.add_request([1, 2], sampling=SamplingParams(logit_bias=((10**6, 1.0),)))
    engine.scheduler.check_no_leaks()
