"""The in-process engine: model, KV pool, scheduler, runner and sampler in one loop.

``LLMEngine.step()`` is schedule -> execute -> sample -> update. ``generate()`` runs prompts to
completion in one batch (continuous batching with chunked prefill). Servers build on the same
pieces; this class is what ``pdserve generate`` and the benchmarks use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.linear.states import LinearStates
from engine.attention.select import backend_name, make_attention
from engine.checkpoint import load_model
from engine.config import EngineConfig, ModelConfig, TextConfig, VerifyStates
from engine.core.page_allocator import PageAllocator
from engine.core.prefix_cache import PrefixCache
from engine.core.request import FinishReason, Request, SamplingParams, TopLogprobs
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.core.state_checkpoints import StateCheckpoints
from engine.core.state_slots import StateSlotAllocator
from engine.device import dtype_name, keep_freed_memory, resolve_device, resolve_dtype
from engine.errors import ConfigError, InvalidRequestError
from engine.kv.pool import KVPool, pages_for_budget
from engine.kv.state_pool import StatePool
from engine.models.eagle.eagle3 import Draft
from engine.models.eagle.loader import draft_source, load_draft
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.multimodal.image_processor import (
    process_image,
    validate_patches,
)
from engine.multimodal.inputs import ImageInput, RequestState, VideoInput, build_state
from engine.multimodal.prompt_layout import expand_prompt, processor_configs
from engine.multimodal.video_timestamps import default_timestamps
from engine.multimodal.visual_digest import visual_keys
from engine.parallel.driver import TPDriver
from engine.parallel.group import SINGLE
from engine.parallel.rank import RankAttach
from engine.parallel.shard import TextShard
from engine.runner.cuda_graph import DEFAULT_CAPTURE_SIZES, capture_sizes_for
from engine.runner.decode_graphs import DecodeGraphs
from engine.runner.model_runner import ModelRunner, StepForward
from engine.sampling.logprobs import record_prompt_logprobs, top_logprobs
from engine.sampling.penalties import apply_penalties
from engine.sampling.sampler import Sampler, make_generator
from engine.sampling.structured import StructuredOutputs
from engine.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Prompt:
    """One prompt: text or token ids, images (encoded bytes or precomputed patches) and videos
    (precomputed patches)."""

    text: str | None = None
    token_ids: Sequence[int] | None = None
    images: Sequence[bytes | ImageInput] = ()
    videos: Sequence[VideoInput] = ()


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt ready for :meth:`LLMEngine.add_request`: token ids with every placeholder
    expanded, and the validated images and videos (each list in its own prompt order)."""

    token_ids: list[int]
    images: list[ImageInput]
    videos: list[VideoInput]


@dataclass(frozen=True)
class StepResult:
    """What one step did: the requests that got new tokens (how many: their last output tokens),
    and the requests that finished (among them, or aborted ones)."""

    new_tokens: list[tuple[Request, int]]
    finished: list[Request]


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only
    logprobs: list[float]
    text: str | None  # None when the model has no tokenizer
    finish_reason: FinishReason
    # what the request's sampling asked for (Request's fields of the same names), else empty
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)


def hybrid_states(text: TextConfig, layers: range, num_slots: int, dtype: torch.dtype,
                  device: torch.device, shard: TextShard, *, verify_states: VerifyStates
                  ) -> LinearStates | None:
    """The state pool of a hybrid model's linear layers among ``layers`` (``num_slots`` slots,
    one per request that may run) over ``shard``'s linear-attention heads (a tensor-parallel
    rank's), keeping a verify window's states as ``verify_states`` says
    (``EngineConfig.verify_states``), or None for a model without linear attention."""
    lin, ids = shard.linear_here, text.linear_layers(layers)
    if lin is None or not ids:
        return None
    pool = StatePool(num_slots, ids, lin.conv_channels, lin.conv_kernel, lin.num_v_heads,
                     lin.head_k_dim, lin.head_v_dim, dtype, device)
    return LinearStates(pool, verify_states=verify_states)


def graph_sizes(config: EngineConfig, max_bs: int) -> list[int]:
    """The padded batch sizes graphs are captured at: ``config.cuda_graph_sizes`` (default
    :data:`~engine.runner.cuda_graph.DEFAULT_CAPTURE_SIZES`) below ``max_bs``, and ``max_bs``."""
    return capture_sizes_for(max_bs, config.cuda_graph_sizes or DEFAULT_CAPTURE_SIZES)


def decode_graphs_for(engine: LLMEngine, attn: AttentionBackend, *, enabled: bool
                      ) -> DecodeGraphs:
    """Static decode buffers sized for ``engine``: its batch limit, its longest request, its
    scratch page; ``enabled=False`` runs them eagerly (what tests use on a CPU)."""
    sched = engine.scheduler.config
    return DecodeGraphs(engine.model, attn, max_bs=sched.max_num_seqs,
                        max_pages=-(-sched.max_model_len // sched.page_size),
                        pad_page=engine.scratch_page, enabled=enabled,
                        sizes=graph_sizes(engine.config, sched.max_num_seqs))


class LLMEngine:
    """A Qwen2-VL-architecture model serving requests from one process.

    ``config.device`` and ``config.dtype`` are resolved once (``auto`` included, see
    :mod:`engine.device`; a device this machine cannot run raises ``DeviceError``) into
    :attr:`device` and :attr:`dtype`, and :attr:`config` holds the resolved names. The weights,
    the KV pool and the request generators live on that device; a step copies its sampled tokens
    to the host once.

    With ``config.tp_size`` ``N > 1`` this engine is rank 0 of ``N`` tensor-parallel processes
    (:mod:`engine.parallel.driver`): it starts the others, holds its share of the decoder and of
    every KV page (:attr:`pool` has this rank's key/value heads), schedules and samples; decode
    steps run eagerly (no CUDA graphs). :meth:`close` ends the other processes. ``rank_attach`` runs
    in each other rank's process once its pool exists (:data:`engine.parallel.rank.RankAttach`: a
    node registers that rank's KV with its own transfer engine there); what each returned is
    :attr:`rank_payloads`. With ``config.layers`` too (a pipeline stage), every rank holds
    those layers only; the stage's forward runs through :attr:`runner`'s ``peers``.

    ``draft``: an EAGLE draft directory this engine's draft loop runs (:meth:`load_draft`), or
    ``"mtp"`` for the checkpoint's own MTP module (:func:`engine.models.eagle.loader.draft_source`);
    with several ranks, each holds its share of the draft's layer and a draft pool of its
    key/value heads, and its attach hook gets both pools.
    """

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, *,
                 rank_attach: RankAttach | None = None, draft: str | Path | None = None) -> None:
        config = config or EngineConfig()
        self.device = resolve_device(config.device)
        self.dtype = dtype = resolve_dtype(config.dtype, self.device)
        self.config = config = replace(config, device=str(self.device), dtype=dtype_name(dtype))
        if self.device.type == "cpu":
            keep_freed_memory()
        model_config = ModelConfig.from_dir(model_dir)
        text = model_config.text
        shard = TextShard.of(text, 0, config.tp_size)  # this rank's heads
        kv_heads = shard.num_kv_heads
        layers = config.layers if config.layers is not None else range(text.num_hidden_layers)
        kv_layers = text.attention_layers(layers)  # a hybrid model's linear layers hold no KV
        num_pages = config.num_pages or pages_for_budget(
            config.kv_budget_bytes, len(kv_layers), config.page_size, kv_heads, text.head_dim,
            dtype,
        )
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.image_config = processor_configs(model_dir, model_config)[0]
        self.draft_dir = draft_source(draft, model_dir) if draft is not None else None
        self.model_config, self.model = self._load(model_dir, config, num_pages, rank_attach)
        # one page more than the allocator hands out: a scratch page that padded rows of a
        # static-shape forward may write into (see decode_node/spec/graph_runner.py)
        self.scratch_page = num_pages
        self.pool = KVPool(num_pages + 1, config.page_size, kv_heads, text.head_dim,
                           kv_layers, dtype, self.device)
        allocator = PageAllocator(num_pages)
        self.states = hybrid_states(text, layers, config.state_pool_slots, dtype, self.device,
                                    shard, verify_states=config.verify_states)
        slots = StateSlotAllocator(config.num_state_slots) if self.states is not None else None
        cache = None
        if config.enable_prefix_cache:
            checkpoints = None
            if self.states is not None:  # the pool's slots after the requests' hold them
                checkpoints = StateCheckpoints(config.state_checkpoints, config.num_state_slots,
                                               config.state_checkpoint_interval, config.page_size)
            cache = PrefixCache(config.page_size, allocator, checkpoints)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_pages=num_pages,
                page_size=config.page_size,
                max_model_len=config.max_model_len or text.max_position_embeddings,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                eos_token_ids=self.model_config.eos_token_ids,
                vocab_size=text.vocab_size,
                lookahead_tokens=config.lookahead_tokens,
            ),
            allocator,
            cache,
            slots,
        )
        attn = make_attention(self.pool)
        self.runner = ModelRunner(self.model, attn)
        self.runner.peers = self.tp
        self.runner.states = self.states
        if (config.graphs and self.device.type == "cuda" and backend_name(self.pool) == "triton"
                and self.tp is None and self.states is None):
            self.runner.decode_graphs = decode_graphs_for(self, attn, enabled=True)
        self.sampler = Sampler()
        self.structured = StructuredOutputs(model_dir)
        self._next_id = 0

    def _load(self, model_dir: str | Path, config: EngineConfig, num_pages: int,
              attach: RankAttach | None) -> tuple[ModelConfig, Qwen2VLModel]:
        """The model; with ``config.tp_size`` ranks, rank 0's share, once the other ranks'
        processes (:attr:`tp`, None with one rank) have loaded theirs (they are daemons: they
        end with this process however ``__init__`` ends)."""
        self.tp: TPDriver | None = None
        if config.tp_size > 1:
            self.tp = TPDriver(model_dir, config, num_pages, attach, self.draft_dir)
        try:
            loaded = load_model(model_dir, self.dtype, self.device, config.layers,
                                self.tp.group if self.tp else SINGLE)
            if self.tp is not None:
                self.tp.connect(self.device)
        except BaseException:
            self.close()
            raise
        return loaded

    def load_draft(self) -> Draft:
        """The draft of :attr:`draft_dir` on this engine's device and dtype (rank 0's share of
        its layer under TP); ``ConfigError`` without one, or when it does not fit."""
        if self.draft_dir is None:
            raise ConfigError("this engine was built without a draft")
        return load_draft(self.draft_dir, self.model_config.text, self.model.dtype, self.device,
                          tp=self.model.tp)

    @property
    def rank_payloads(self) -> list[bytes]:
        """What ``rank_attach`` returned in ranks ``1..`` (empty with one rank)."""
        return list(self.tp.payloads) if self.tp is not None else []

    def close(self) -> None:
        """End the other tensor-parallel ranks' processes (nothing to do with one rank); the
        engine cannot step afterwards. Idempotent."""
        if self.tp is not None:
            self.tp.close()

    # ---- requests ------------------------------------------------------------------------------

    def prepare(self, prompt: Prompt) -> PreparedPrompt:
        """Tokenize and preprocess a prompt: token ids with image and video placeholders
        expanded, and the images' and videos' patches."""
        images = [self._image_input(im) for im in prompt.images]
        videos = [_video_input(i, v) for i, v in enumerate(prompt.videos)]
        if (prompt.text is None) == (prompt.token_ids is None):
            raise InvalidRequestError("give exactly one of text and token_ids")
        if prompt.token_ids is not None:
            return PreparedPrompt([int(t) for t in prompt.token_ids], images, videos)
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer.json: send token_ids instead")
        return PreparedPrompt(self._encode_text(prompt.text or "", images, videos), images,
                              videos)

    def new_request(
        self,
        token_ids: Sequence[int],
        images: Sequence[ImageInput] = (),
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        videos: Sequence[VideoInput] = (),
    ) -> Request:
        """A validated request, not yet queued; raises :class:`InvalidRequestError`."""
        sampling = sampling or SamplingParams()
        sampling.validate(self.model_config.text.vocab_size)
        self.structured.check(sampling)
        state = build_state(token_ids, images, self.model_config, videos,
                            sampling.resumed_tokens)
        state.generator = make_generator(sampling.seed, self.device)
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        keys: tuple[tuple[int, bytes], ...] = ()
        if self.scheduler.prefix_cache is not None:
            cfg = self.model_config
            keys = visual_keys(state, token_ids, (cfg.image_token_id, cfg.video_token_id),
                               sampling.resumed_tokens)
        return Request(request_id, list(token_ids), sampling, payload=state, visual_keys=keys)

    def add_request(
        self,
        token_ids: Sequence[int],
        images: Sequence[ImageInput] = (),
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        videos: Sequence[VideoInput] = (),
    ) -> Request:
        """Validate and queue one request; raises :class:`InvalidRequestError` on bad input."""
        req = self.new_request(token_ids, images, sampling, request_id, videos=videos)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> Request | None:
        return self.scheduler.abort(request_id)

    # ---- prefix cache and figures --------------------------------------------------------------

    def disable_prefix_cache(self) -> None:
        """Turn the prefix cache off for good, dropping what it holds (a node whose pages
        travel between processes calls this: its KV paths do not know about shared pages)."""
        self.scheduler.disable_prefix_cache()

    def stats(self) -> dict[str, float]:
        """Page and prefix-cache figures, in ``Admin.GetStats`` names. ``kv_pages_used`` are
        held by requests (0 once every request finished: anything else is a leak);
        ``kv_pages_cached`` are held only by the prefix cache (evictable on demand, not a
        leak); ``kv_pages_free`` are in the allocator. The three add up to ``kv_pages_total``.
        The prefix cache's counters (``prefix_cache_*``) are there only while it is on; a hybrid
        model's state slots (``state_slots_*``: held by running requests, 0 once all finished)
        only for such a model."""
        sched = self.scheduler
        cache = sched.prefix_cache
        out: dict[str, float] = {
            "kv_pages_total": sched.allocator.num_pages,
            "kv_pages_free": sched.allocator.num_free,
            "kv_pages_used": sched.num_request_pages,
            "kv_pages_cached": sched.num_cached_only_pages,
        }
        if sched.state_slots is not None and self.states is not None:
            out.update(state_slots_total=sched.state_slots.num_slots,
                       state_slots_used=sched.state_slots.num_used,
                       state_bytes_per_slot=self.states.pool.bytes_per_slot)
        checkpoints = cache.checkpoints if cache is not None else None
        if checkpoints is not None and self.states is not None:
            ck = checkpoints.stats
            out.update(state_checkpoints_total=checkpoints.num_slots,
                       state_checkpoints_cached=checkpoints.num_cached,
                       state_checkpoint_bytes=self.states.pool.bytes_per_slot,
                       state_checkpoints_saved=ck.saved,
                       state_checkpoints_restored=ck.restored,
                       state_checkpoints_evicted=ck.evicted)
        if cache is not None:
            st = cache.stats
            out.update(prefix_cache_pages=cache.num_cached_pages,
                       prefix_cache_queries=st.queries,
                       prefix_cache_queried_tokens=st.queried_tokens,
                       prefix_cache_hit_tokens=st.hit_tokens,
                       prefix_cache_hit_rate=st.hit_tokens / max(1, st.queried_tokens),
                       prefix_cache_inserted_blocks=st.inserted_blocks,
                       prefix_cache_evicted_blocks=st.evicted_blocks)
        return out

    # ---- the loop ------------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Run one scheduler step: schedule, forward, sample, update."""
        out = self.scheduler.schedule()
        if not out.items:
            return StepResult([], [])
        samples, fwd = self.forward_states(out)
        sampled = [it.request for it in out.items if it.needs_sample]
        counts = [r.num_output_tokens for r in sampled]
        finished = self.scheduler.update(out, samples, fwd.tops)
        grown = [(r, 1) for r, n in zip(sampled, counts, strict=True) if r.num_output_tokens > n]
        return StepResult(grown, finished)

    def forward_states(
        self, out: SchedulerOutput
    ) -> tuple[list[tuple[int, float]], StepForward]:
        """Run the model over a scheduled step and sample: one ``(token, logprob)`` per item
        with ``needs_sample``, in item order (the input of ``Scheduler.update``), and the
        forward's tensors (for a draft model) with the sampled tokens' alternatives
        (``fwd.tops``, for ``Scheduler.update`` too); the prompt log-probabilities of the requests
        that ask are recorded on them."""
        fwd = self.runner.run(out)
        record_prompt_logprobs(out, fwd.hidden, self.model.logits)
        logits = self.model.logits(fwd.hidden[fwd.sample_rows])
        sampled = [it.request for it in out.items if it.needs_sample]
        params = [r.sampling for r in sampled]
        gens = [_state(r).generator for r in sampled]
        scores = self.structured.mask(sampled, logits, apply_penalties(logits, sampled))
        tokens, logprobs = self.sampler.sample(logits, params, gens, scores)
        fwd.tops = top_logprobs(logits, [p.top_logprobs for p in params])
        return list(zip(tokens, logprobs, strict=True)), fwd

    def generate(
        self, prompts: Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerationResult]:
        """Run ``prompts`` to completion together; results in prompt order."""
        per = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        prepared = [self.prepare(p) for p in prompts]
        reqs: list[Request] = []
        try:
            for p, params in zip(prepared, per, strict=True):
                reqs.append(self.add_request(p.token_ids, p.images, params, videos=p.videos))
        except Exception:
            for req in reqs:  # all or nothing: a bad prompt leaves no sibling queued
                self.abort(req.request_id)
            raise
        while self.scheduler.has_unfinished():
            self.step()
        return [self.result(r) for r in reqs]

    def result(self, req: Request) -> GenerationResult:
        assert req.finish_reason is not None, "result() of an unfinished request"
        text = self.tokenizer.decode(req.output_token_ids) if self.tokenizer else None
        return GenerationResult(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                                list(req.output_logprobs), text, req.finish_reason,
                                list(req.output_top_logprobs), list(req.prompt_logprobs),
                                list(req.prompt_top_logprobs))

    # ---- helpers -------------------------------------------------------------------------------

    def _image_input(self, image: bytes | ImageInput) -> ImageInput:
        if isinstance(image, ImageInput):
            patches = image.patches
            if not isinstance(patches, torch.Tensor):
                raise InvalidRequestError(
                    f"patches must be a tensor, got {type(patches).__name__}")
            patches = patches.detach().contiguous()
            if patches.dtype != torch.float32:
                raise InvalidRequestError(f"patches must be float32, got {patches.dtype}")
            processed = validate_patches(patches.cpu().numpy(), image.grid_thw, self.image_config)
            return ImageInput(patches, processed.grid_thw)
        processed = process_image(image, self.image_config)
        return ImageInput(torch.from_numpy(processed.patches), processed.grid_thw)

    def _encode_text(
        self, text: str, images: list[ImageInput], videos: list[VideoInput]
    ) -> list[int]:
        """Token ids of ``text``; each image placeholder (``<|image_pad|>``) becomes that image's
        tokens and each video placeholder (``<|video_pad|>``) that video's. Without image
        (video) placeholders, the images (videos) are put before the text, images first."""
        assert self.tokenizer is not None
        cfg = self.model_config
        stamps = [_timestamps(i, v, cfg.vision.temporal_patch_size) if cfg.is_qwen3 else []
                  for i, v in enumerate(videos)]
        return expand_prompt(self.tokenizer.encode(text), cfg, [im.grid_thw for im in images],
                             [v.grid_thw for v in videos], stamps, self.tokenizer.encode)


def _timestamps(i: int, video: VideoInput, temporal_patch_size: int) -> list[float]:
    """A Qwen3 video's seconds per temporal patch: its own, else from ``second_per_grid``."""
    grid_t = video.grid_thw[0]
    if not video.timestamps:
        return default_timestamps(grid_t, video.second_per_grid, temporal_patch_size)
    if len(video.timestamps) != grid_t:
        raise InvalidRequestError(f"video {i}: {len(video.timestamps)} timestamps for "
                                  f"{grid_t} temporal patches")
    return list(video.timestamps)


def _video_input(i: int, video: VideoInput) -> VideoInput:
    """``video`` with contiguous float32 patches; its grid, shape and seconds are checked with
    the prompt (``build_state``)."""
    if not isinstance(video, VideoInput):
        raise InvalidRequestError(f"video {i}: expected a VideoInput, got {type(video).__name__}")
    patches = video.patches
    if not isinstance(patches, torch.Tensor) or patches.dtype != torch.float32:
        raise InvalidRequestError(f"video {i}: patches must be a float32 tensor")
    if not bool(torch.isfinite(patches).all()):
        raise InvalidRequestError(f"video {i}: patches contain NaN or infinite values")
    return replace(video, patches=patches.contiguous())


def _state(req: Request) -> RequestState:
    assert isinstance(req.payload, RequestState)
    return req.payload
