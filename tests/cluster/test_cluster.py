"""Whole clusters end to end: real ``pdserve prefill`` / ``decode`` / ``router`` processes on
loopback with real Mooncake over TCP, called through the router's generated gRPC stubs.

One set of workers (two prefill nodes, one decode node) serves three routers: 1P1D (the first
prefill only), 2P1D (both prefills) and colocated (the decode node prefilling locally). Pages are
few and the prefill chunk is smaller than the longest prompt, so chunked prefill, per-chunk KV
pushes and the decode's prealloc back-pressure all take part. Every greedy output is compared
token for token (and text) with the in-process :class:`engine.llm_engine.LLMEngine`.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from engine.builtin.tiny_model import tiny_config_dict
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import GenerationResult, LLMEngine, Prompt
from engine.multimodal.inputs import ImageInput
from engine.multimodal.mrope import num_image_tokens
from proto.convert import patches_message
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from proto.pdserve.v1 import worker_pb2 as wpb
from tests.cluster.harness import Node, start_all, stop_all
from tests.cluster.stats import get_stats

pytestmark = pytest.mark.slow

PAGE_SIZE = 8
CHUNK = 48  # prefill --max-num-batched-tokens: smaller than the longest prompts below
PREFILL_PAGES = 192
DECODE_PAGES = 320
NUM_STREAMS = 32
STREAM_TIMEOUT_S = 120.0
ROUTER_LOAD_REFRESH_S = 1.0  # router.config.RouterConfig.load_refresh_s
SPECIAL = tiny_config_dict()
IMAGE_PAD = SPECIAL["image_token_id"]
VISION_START = SPECIAL["vision_start_token_id"]
VISION_END = SPECIAL["vision_end_token_id"]
MERGE = SPECIAL["vision_config"]["spatial_merge_size"]
WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing about "
         "rivers, mountains and the colour of the evening sky").split()


# ---- requests and their expected outputs ---------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One request in both forms: the public API message and the engine's prompt."""

    name: str
    request: gpb.GenerateRequest
    prompt: Prompt
    params: SamplingParams


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A deterministic RGB PNG made with Pillow."""
    img = Image.new("RGB", (width, height))
    img.putdata([((x * 7 + seed) % 256, (y * 13 + seed) % 256, (x * y + 3 * seed) % 256)
                 for y in range(height) for x in range(width)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def patches(seed: int, grid: tuple[int, int, int]) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Random float32 image patches ``[t*h*w, 1176]`` for ``grid`` (what the processor makes)."""
    t, h, w = grid
    rng = np.random.default_rng(seed)
    return rng.standard_normal((t * h * w, 3 * 2 * 14 * 14)).astype("f4"), grid


def text_of(i: int, words: int) -> str:
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))


def ids_of(i: int, n: int) -> list[int]:
    return [(i * 37 + j * 11) % 500 for j in range(n)]


def make_case(i: int) -> Case:
    """Request ``i``: text, token ids, text + PNG, or ids / text + patches, in turn; prompt
    lengths from a few tokens to several prefill chunks, output lengths from 2 to 40."""
    new = 2 + (i * 17) % 39
    ignore_eos = i % 5 != 0  # some may stop early on EOS: finish reasons must match too
    sampling = gpb.SamplingParams(max_new_tokens=new, ignore_eos=ignore_eos)
    params = SamplingParams(max_new_tokens=new, ignore_eos=ignore_eos)
    kind = i % 4
    if kind == 0:
        text = text_of(i, 2 + (i * 7) % 60)
        return Case(f"text{i}", gpb.GenerateRequest(text=text, sampling=sampling),
                    Prompt(text=text), params)
    if kind == 1:
        ids = ids_of(i, 3 + (i * 29) % 160)
        return Case(f"ids{i}", gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids),
                                                   sampling=sampling),
                    Prompt(token_ids=ids), params)
    if kind == 2:
        size = [(56, 84), (84, 56), (168, 224), (112, 112)][(i // 4) % 4]
        image = png(*size, seed=i)
        text = text_of(i, 1 + i % 20)
        return Case(f"png{i}", gpb.GenerateRequest(text=text, images=[gpb.Image(encoded=image)],
                                                   sampling=sampling),
                    Prompt(text=text, images=[image]), params)
    array, grid = patches(i, [(1, 4, 4), (1, 8, 6), (2, 4, 4)][(i // 4) % 3])
    msg = gpb.Image(patches=patches_message(array, grid))
    image_input = ImageInput(torch.from_numpy(array.copy()), grid)
    if (i // 4) % 2:
        text = text_of(i, 3 + i % 15)
        return Case(f"patches-text{i}", gpb.GenerateRequest(text=text, images=[msg],
                                                            sampling=sampling),
                    Prompt(text=text, images=[image_input]), params)
    # the router expands one placeholder per image; the engine takes the expanded ids
    head, tail = [*ids_of(i, 5), VISION_START], [VISION_END, *ids_of(i + 1, 4 + i % 40)]
    ids = [*head, IMAGE_PAD, *tail]
    expanded = [*head, *[IMAGE_PAD] * num_image_tokens(grid, MERGE), *tail]
    return Case(f"patches-ids{i}", gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids),
                                                       images=[msg], sampling=sampling),
                Prompt(token_ids=expanded, images=[image_input]), params)


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    return [make_case(i) for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def expected(tiny_dir: Path, cases: list[Case]) -> list[GenerationResult]:
    """The in-process engine's outputs for ``cases`` (computed once)."""
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=2048, page_size=PAGE_SIZE,
                                              max_num_batched_tokens=CHUNK))
    return engine.generate([c.prompt for c in cases], [c.params for c in cases])


def assert_same(msgs: Sequence[gpb.GenerateResponse], exp: GenerationResult, name: str) -> None:
    """A stream equals an engine result: tokens, text, finish reason and usage."""
    assert msgs, name
    assert [t for m in msgs for t in m.token_ids] == exp.token_ids, name
    assert "".join(m.text for m in msgs) == exp.text, name
    assert all(not m.finished for m in msgs[:-1]) and msgs[-1].finished, name
    assert msgs[-1].finish_reason == exp.finish_reason.value, name
    assert msgs[-1].usage.prompt_tokens == len(exp.prompt_token_ids), name
    assert msgs[-1].usage.completion_tokens == len(exp.token_ids), name


# ---- the cluster -------------------------------------------------------------------------------


@dataclass
class Cluster:
    """Two prefill workers, one decode worker, and one router per topology."""

    prefills: list[Node]
    decode: Node
    routers: dict[str, Node]  # "1p1d", "2p1d", "colocated"
    channels: list[grpc.Channel] = field(default_factory=list)

    def stub(self, topology: str) -> generate_pb2_grpc.GenerationStub:
        channel = grpc.insecure_channel(self.routers[topology].address)
        self.channels.append(channel)
        return generate_pb2_grpc.GenerationStub(channel)

    def workers(self) -> list[tuple[str, Callable[[], wpb.LoadReport]]]:
        """``(address, GetLoad)`` for every worker."""
        out: list[tuple[str, Callable[[], wpb.LoadReport]]] = []
        for node in self.prefills:
            pstub = worker_pb2_grpc.PrefillWorkerStub(self._channel(node))
            out.append((node.address, lambda s=pstub: s.GetLoad(wpb.GetLoadRequest(), timeout=5)))
        dstub = worker_pb2_grpc.DecodeWorkerStub(self._channel(self.decode))
        out.append((self.decode.address,
                    lambda: dstub.GetLoad(wpb.GetLoadRequest(), timeout=5)))
        return out

    def _channel(self, node: Node) -> grpc.Channel:
        channel = grpc.insecure_channel(node.address)
        self.channels.append(channel)
        return channel

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Poll every worker until it holds no pages, rooms or requests."""
        deadline = time.monotonic() + timeout_s
        for address, get_load in self.workers():
            while True:
                load = get_load()
                if (load.kv_pages_used, load.rooms_active, load.running_requests,
                        load.waiting_requests) == (0, 0, 0, 0):
                    break
                assert time.monotonic() < deadline, f"worker {address} still busy:\n{load}"
                time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    model = ["--model", str(tiny_dir), "--port", "0", "--page-size", str(PAGE_SIZE)]
    prefill = ["prefill", *model, "--num-pages", str(PREFILL_PAGES),
               "--max-num-batched-tokens", str(CHUNK)]
    decode = ["decode", *model, "--num-pages", str(DECODE_PAGES),
              "--max-num-batched-tokens", str(4 * CHUNK)]
    workers = start_all([prefill, prefill, decode])
    routers: list[Node] = []
    c: Cluster | None = None
    try:
        p1, p2, d = workers
        base = ["router", "--model", str(tiny_dir), "--port", "0"]
        routers = start_all([
            [*base, "--prefill", p1.address, "--decode", d.address],
            [*base, "--prefill", f"{p1.address},{p2.address}", "--decode", d.address],
            [*base, "--colocated", d.address],
        ])
        c = Cluster([p1, p2], d, dict(zip(("1p1d", "2p1d", "colocated"), routers, strict=True)))
        yield c
    finally:
        if c is not None:
            for channel in c.channels:
                channel.close()
        stop_all(routers)
        stop_all(workers)


def run_all(stub: generate_pb2_grpc.GenerationStub,
            cases: Sequence[Case]) -> list[list[gpb.GenerateResponse]]:
    """Every case as its own concurrent stream; the messages of each, in case order."""
    def one(case: Case) -> list[gpb.GenerateResponse]:
        return list(stub.Generate(case.request, timeout=STREAM_TIMEOUT_S))

    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(one, cases))


@dataclass
class LoadWatcher:
    """Polls every prefill's ``GetLoad`` in the background; remembers which ever had work."""

    probes: list[tuple[str, Callable[[], wpb.LoadReport]]]
    busy: dict[str, int] = field(default_factory=dict)  # address -> most rooms seen at once
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> LoadWatcher:
        self.busy = {address: 0 for address, _ in self.probes}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for address, get_load in self.probes:
                load = get_load()
                work = load.rooms_active + load.running_requests + load.waiting_requests
                self.busy[address] = max(self.busy[address], work)
            time.sleep(0.002)


@pytest.fixture(scope="module")
def disagg_1p1d(cluster: Cluster, cases: list[Case]) -> list[list[gpb.GenerateResponse]]:
    """The 32 streams through the 1P1D router (run once, shared by the tests below)."""
    return run_all(cluster.stub("1p1d"), cases)


# ---- outputs -------------------------------------------------------------------------------------


def test_1p1d_concurrent_streams_equal_engine(
    cluster: Cluster, cases: list[Case], expected: list[GenerationResult],
    disagg_1p1d: list[list[gpb.GenerateResponse]],
) -> None:
    for case, msgs, exp in zip(cases, disagg_1p1d, expected, strict=True):
        assert_same(msgs, exp, case.name)
    cluster.wait_idle()


def test_2p1d_concurrent_streams_equal_engine_and_both_prefills_work(
    cluster: Cluster, cases: list[Case], expected: list[GenerationResult]
) -> None:
    # The prefills are shared with the 1P1D router: let the 2P1D router's periodic GetLoad
    # (every second) see them idle, or a stale report of earlier work steers every room away.
    cluster.wait_idle()
    time.sleep(ROUTER_LOAD_REFRESH_S + 0.5)
    probes = cluster.workers()[:2]
    with LoadWatcher(probes) as watcher:
        results = run_all(cluster.stub("2p1d"), cases)
    for case, msgs, exp in zip(cases, results, expected, strict=True):
        assert_same(msgs, exp, case.name)
    assert all(n > 0 for n in watcher.busy.values()), f"a prefill node did no work: {watcher.busy}"
    cluster.wait_idle()


def test_colocated_equals_disaggregated(
    cluster: Cluster, cases: list[Case], expected: list[GenerationResult],
    disagg_1p1d: list[list[gpb.GenerateResponse]],
) -> None:
    stub = cluster.stub("colocated")
    assert stub.GetModelInfo(gpb.GetModelInfoRequest()).mode == "colocated"
    results = run_all(stub, cases)
    for case, co, dis, exp in zip(cases, results, disagg_1p1d, expected, strict=True):
        assert [t for m in co for t in m.token_ids] == [t for m in dis for t in m.token_ids], \
            case.name
        assert "".join(m.text for m in co) == "".join(m.text for m in dis), case.name
        assert co[-1].finish_reason == dis[-1].finish_reason, case.name
        assert_same(co, exp, case.name)
    cluster.wait_idle()


# ---- cancellation and streaming ------------------------------------------------------------------


@dataclass
class Reader:
    """Reads one stream on a thread, recording messages and the error that ended it."""

    stream: Iterator[gpb.GenerateResponse]
    msgs: list[gpb.GenerateResponse] = field(default_factory=list)
    error: grpc.RpcError | None = None
    thread: threading.Thread | None = None

    def start(self) -> Reader:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            for msg in self.stream:
                self.msgs.append(msg)
        except grpc.RpcError as exc:
            self.error = exc

    def join(self, timeout_s: float = STREAM_TIMEOUT_S) -> Reader:
        assert self.thread is not None
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "stream did not end"
        return self


def test_cancel_mid_stream_and_before_first_token_frees_every_node(
    cluster: Cluster, cases: list[Case], expected: list[GenerationResult]
) -> None:
    """``mid`` reserves most of the decode pool (worst case of 2000 new tokens), so ``early``
    (77 pages worst case) waits in the decode's prealloc queue and the prefill's bootstrap gate
    for as long as ``mid`` runs: it is cancelled there, before any token of it exists."""
    stub = cluster.stub("2p1d")
    others = [i for i, c in enumerate(cases) if c.params.max_new_tokens >= 20][:4]
    readers = [Reader(stub.Generate(cases[i].request, timeout=STREAM_TIMEOUT_S)).start()
               for i in others]
    mid = stub.Generate(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=[3, 1, 4, 1, 5]),
        sampling=gpb.SamplingParams(max_new_tokens=2000, ignore_eos=True)),
        timeout=STREAM_TIMEOUT_S)
    first = next(mid)
    assert not first.finished and len(first.token_ids) < 2000
    early = stub.Generate(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=ids_of(99, 600)),
        sampling=gpb.SamplingParams(max_new_tokens=16, ignore_eos=True)),
        timeout=STREAM_TIMEOUT_S)
    early_reader = Reader(early).start()
    probes = cluster.workers()[:2]
    deadline = time.monotonic() + 30.0
    while not any(get_load().waiting_tokens >= 600 for _, get_load in probes):
        assert early_reader.error is None, early_reader.error
        assert time.monotonic() < deadline, "the long prompt never reached a prefill node"
        time.sleep(0.01)
    early.cancel()  # type: ignore[attr-defined]
    early_reader.join()
    assert early_reader.msgs == [], "the stream produced a token before it was cancelled"
    assert early_reader.error is not None
    assert early_reader.error.code() == grpc.StatusCode.CANCELLED
    mid.cancel()  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as err:
        list(mid)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    for i, reader in zip(others, readers, strict=True):
        reader.join()
        assert reader.error is None, (cases[i].name, reader.error)
        assert_same(reader.msgs, expected[i], cases[i].name)
    cluster.wait_idle(timeout_s=5.0)


def test_first_message_arrives_long_before_the_last(cluster: Cluster) -> None:
    new = 400
    request = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids_of(7, 60)),
                                  sampling=gpb.SamplingParams(max_new_tokens=new,
                                                              ignore_eos=True))
    start = time.perf_counter()
    stream = cluster.stub("1p1d").Generate(request, timeout=STREAM_TIMEOUT_S)
    first = next(stream)
    ttft = time.perf_counter() - start
    rest = list(stream)
    total = time.perf_counter() - start
    assert not first.finished and len(first.token_ids) < new // 4
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == new
    assert rest[-1].finished and len(rest) >= 2
    assert ttft < total / 4, f"first message after {ttft:.3f}s of {total:.3f}s"
    cluster.wait_idle()


# ---- prefix caching ----------------------------------------------------------------------------


PREFIX = [100 + (j * 13) % 397 for j in range(15 * PAGE_SIZE)]  # 15 pages shared by the prompts


def _prefix_case(name: str, ids: list[int], image: ImageInput | None = None) -> Case:
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    sampling = gpb.SamplingParams(max_new_tokens=6, ignore_eos=True)
    if image is None:
        return Case(name, gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids), sampling=sampling),
                    Prompt(token_ids=ids), params)
    # the router expands the one placeholder; the engine takes the expanded ids
    at = ids.index(IMAGE_PAD)
    expanded = [*ids[:at], *[IMAGE_PAD] * num_image_tokens(image.grid_thw, MERGE),
                *ids[at + 1:]]
    msg = gpb.Image(patches=patches_message(image.patches.numpy(), image.grid_thw))
    return Case(name, gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids), images=[msg],
                                          sampling=sampling),
                Prompt(token_ids=expanded, images=[image]), params)


def test_shared_prefixes_hit_every_cache_and_equal_the_engine_without_one(
    cluster: Cluster, tiny_dir: Path
) -> None:
    """Prompts sharing a 15-page prefix, one after the other: the first fills the prefill's and
    the decode's caches; then the prefill computes only the tail (``usage.cached_tokens``) and
    sends only the pages the decode lacks (``kv_pages_not_sent`` on both sides), in 1P1D, 2P1D
    and colocated (the decode's own cache). Two prompts that differ only in their image share
    the blocks before it, never after. Every output equals an engine without a prefix cache."""
    images = [ImageInput(torch.from_numpy(patches(seed, (1, 4, 4))[0]), (1, 4, 4))
              for seed in (1, 2)]
    vision = [*ids_of(5, 20), VISION_START, IMAGE_PAD, VISION_END, *ids_of(6, 9)]
    cases = [_prefix_case(f"tail{i}", [*PREFIX, *ids_of(50 + i, 5 + 3 * i)]) for i in range(4)]
    cases += [_prefix_case(f"image{i}", [*PREFIX, *vision], image)
              for i, image in enumerate(images)]
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=512, page_size=PAGE_SIZE,
                                              max_num_batched_tokens=CHUNK,
                                              enable_prefix_cache=False))
    expected = engine.generate([c.prompt for c in cases], [c.params for c in cases])
    p1, decode = cluster.prefills[0].address, cluster.decode.address
    before = {a: get_stats(a) for a in (p1, decode)}
    topologies = ["1p1d", "1p1d", "2p1d", "colocated", "1p1d", "1p1d"]
    cached = []
    for case, exp, topology in zip(cases, expected, topologies, strict=True):
        msgs = list(cluster.stub(topology).Generate(case.request, timeout=STREAM_TIMEOUT_S))
        assert_same(msgs, exp, case.name)
        cached.append(msgs[-1].usage.cached_tokens)
    after = {a: get_stats(a) for a in (p1, decode)}
    shared = len(PREFIX)
    assert cached[0] == 0  # nobody held the prefix yet
    assert cached[1] == cached[3] == shared  # the prefill's cache, then the decode's own
    assert cached[2] in (0, shared)  # whichever prefill the 2P1D router picked
    # the image starts in page 17 (of 8 tokens): pages 0-16 are shared, none after it
    image_page = (shared + 20) // PAGE_SIZE
    assert cached[4] <= image_page * PAGE_SIZE and cached[5] == image_page * PAGE_SIZE
    spared = {a: after[a].kv_pages_not_sent - before[a].kv_pages_not_sent for a in after}
    # tail1 and image0 (1P1D) found the 15 pages on the decode, image1 found 17; the decode
    # counts the 2P1D room (tail2) too, the first prefill only if it ran it
    assert spared[p1] >= 15 + 15 + 17 and spared[decode] >= 15 * 3 + 17, spared
    assert after[p1].kv_bytes_not_sent > before[p1].kv_bytes_not_sent
    assert after[decode].prefix_cache_hit_tokens > before[decode].prefix_cache_hit_tokens
    assert 0 < after[decode].prefix_cache_hit_rate <= 1
    assert after[decode].kv_pages_cached > 0  # kept after the requests ended: not a leak
    cluster.wait_idle()


def test_cancel_while_a_shared_prefix_is_in_use(cluster: Cluster, tiny_dir: Path) -> None:
    """Two streams hold the same cached prefix pages; cancelling one mid-stream leaves the
    other's pages alone (it completes equal to the engine) and frees everything after."""
    survivor = _prefix_case("survivor", [*PREFIX, *ids_of(70, 7)])
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=512, page_size=PAGE_SIZE,
                                              enable_prefix_cache=False))
    [exp] = engine.generate([survivor.prompt], [survivor.params])
    stub = cluster.stub("1p1d")
    list(stub.Generate(survivor.request, timeout=STREAM_TIMEOUT_S))  # the prefix is cached now
    victim = stub.Generate(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=[*PREFIX, *ids_of(71, 9)]),
        sampling=gpb.SamplingParams(max_new_tokens=1000, ignore_eos=True)),
        timeout=STREAM_TIMEOUT_S)
    next(victim)  # running on the decode, on the shared pages
    reader = Reader(stub.Generate(survivor.request, timeout=STREAM_TIMEOUT_S)).start()
    victim.cancel()  # type: ignore[attr-defined]
    reader.join()
    assert reader.error is None, reader.error
    assert_same(reader.msgs, exp, survivor.name)
    assert reader.msgs[-1].usage.cached_tokens == len(PREFIX)
    cluster.wait_idle()


# ---- pipeline-parallel prefill ------------------------------------------------------------------


def test_two_stage_prefill_concurrent_streams_equal_engine(
    tiny_dir: Path, cases: list[Case], expected: list[GenerationResult]
) -> None:
    """The same 32 streams through a prefill split into two pipeline stages (one layer each)."""
    model = ["--model", str(tiny_dir), "--port", "0", "--page-size", str(PAGE_SIZE)]
    stage = ["prefill", *model, "--num-pages", str(PREFILL_PAGES),
             "--max-num-batched-tokens", str(CHUNK), "--pp-size", "2"]
    [last] = start_all([[*stage, "--pp-rank", "1"]])
    nodes = [last]
    try:
        nodes += start_all([[*stage, "--pp-rank", "0", "--pp-next", last.address],
                            ["decode", *model, "--num-pages", str(DECODE_PAGES),
                             "--max-num-batched-tokens", str(4 * CHUNK)]])
        first, decode = nodes[1], nodes[2]
        nodes += start_all([["router", "--model", str(tiny_dir), "--port", "0",
                             "--prefill", first.address, "--decode", decode.address]])
        channel = grpc.insecure_channel(nodes[3].address)
        try:
            stub = generate_pb2_grpc.GenerationStub(channel)
            streams = run_all(stub, cases)
            # the longest prompts again: the stages have no prefix cache, the decode does, so
            # both stages skip the pages it holds (Destination.cached_pages)
            longest = sorted(range(len(cases)), key=lambda i: -len(expected[i].prompt_token_ids))
            again = longest[:8]
            repeats = run_all(stub, [cases[i] for i in again])
        finally:
            channel.close()
        for case, msgs, exp in zip(cases, streams, expected, strict=True):
            assert_same(msgs, exp, case.name)
        for i, msgs in zip(again, repeats, strict=True):
            assert_same(msgs, expected[i], cases[i].name)
        assert get_stats(decode.address).kv_pages_not_sent > 8
        idle = Cluster([first, last], decode, {})
        try:
            idle.wait_idle(timeout_s=15.0)
        finally:
            for ch in idle.channels:
                ch.close()
    finally:
        stop_all(nodes[::-1])
