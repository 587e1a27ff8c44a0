"""Partitions between serving hosts: a router, a prefill and two decodes, each a real ``pdserve``
process in a host of its own (:mod:`tests.netns.serving_hosts`), and links cut silently between
two of them while a request runs (no RST, no ICMP: each side finds out by its own timeouts and
keepalives), then healed.

- router <-> the streaming decode, longer than the keepalive finds a dead peer: the router's
  stream fails (``UNAVAILABLE``) and the request moves to the other decode, token for token equal
  to the engine; the cut decode's server finds the router gone too and frees the room while the
  link is still cut; no connection between them stays ESTABLISHED; healed, the decode serves
  again;
- router <-> the streaming decode, shorter than that: the stream stalls and resumes on the same
  decode, no failover;
- router <-> every decode: the request fails ``UNAVAILABLE`` well within its deadline;
- prefill <-> every decode in the middle of the prompt's KV transfer (the prefill's link capped,
  so the transfer lasts): the room fails on both sides (the KV handshake's heartbeat), the router
  runs the prompt again (retry or recompute); healed, the request completes equal to the engine;
- every link of the router, with no request running: the keepalive closes every idle connection
  on both sides (``ss``); the transfer connections between a prefill and a decode cut apart are
  checked the same way (an expected failure: see that test).

The nodes ping with ``--keepalive-time-s 1 --keepalive-timeout-s 2`` (a dead peer is found within
about 3 s) and give up on a P/D peer after 1 s (heartbeat 0.5 s); every test ends with the leak
check on every node (pages, aux and state slots, rooms, requests; the router's room table
included) and with every link healed. One cluster serves the whole module.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
import torch

from bench.netns_hosts import Hosts
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from proto.pdserve.v1 import generate_pb2 as gpb
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.streams import Stream, wait_for
from tests.netns.serving_hosts import Member, ServingHosts

pytestmark = pytest.mark.slow
KEEPALIVE_S = (1.0, 2.0)  # --keepalive-time-s, --keepalive-timeout-s
FOUND_WITHIN_S = sum(KEEPALIVE_S) + 3.0  # a dead peer found, with room for a loaded machine
KEEPALIVE = ["--keepalive-time-s", str(KEEPALIVE_S[0]), "--keepalive-timeout-s",
             str(KEEPALIVE_S[1])]
PAGE_SIZE, NUM_PAGES = 8, 1024
WORKER_FLAGS = ["--page-size", str(PAGE_SIZE), "--num-pages", str(NUM_PAGES),
                "--max-num-batched-tokens", "16", "--heartbeat-interval-s", "0.5",
                "--quarantine-s", "1", *KEEPALIVE]
DEADLINE_S = 60.0  # every request's
SHORT = [3, 1, 4, 1, 5, 9, 2, 6]
LONG_NEW = 2500  # a stream still running when a cut is found (the decode makes ~600 tokens/s)
LONG_PROMPT = [(j * 13) % 380 for j in range(1900)]  # ~1 MB of KV: 512 bytes a token
RATE_MBIT = 4.0  # the prefill's cap while its transfer is cut: the prompt's KV takes ~2 s


@pytest.fixture(scope="module")
def hosts(netns_ready: None) -> Iterator[Hosts]:
    with Hosts(4) as made:
        yield made


@pytest.fixture(scope="module")
def module_cluster(hosts: Hosts, tiny_dir: Path) -> Iterator[ServingHosts]:
    cluster = ServingHosts(hosts, tiny_dir, decodes=2, worker_flags=WORKER_FLAGS,
                           router_flags=KEEPALIVE)
    try:
        cluster.wait_serving()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def cluster(module_cluster: ServingHosts, hosts: Hosts) -> Iterator[ServingHosts]:
    """The module's cluster; after the test every link is plain again (healed, no cap) and
    every node holds nothing (the leak check, also after a failed or expected-to-fail test:
    a failure here is the teardown's own)."""
    yield module_cluster
    for host in hosts:
        host.link.heal()
        host.link.set()
    module_cluster.assert_idle()


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> LLMEngine:
    return LLMEngine(tiny_dir, EngineConfig(num_pages=4096, page_size=PAGE_SIZE))


@pytest.fixture(scope="module")
def want_long(engine: LLMEngine) -> list[int]:
    """The engine's greedy output of the long streams (computed once: seconds)."""
    return _greedy(engine, SHORT, LONG_NEW)


def _request(ids: Sequence[int], new: int) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=list(ids)),
                               sampling=gpb.SamplingParams(max_new_tokens=new, ignore_eos=True))


def _greedy(engine: LLMEngine, ids: Sequence[int], new: int) -> list[int]:
    """The engine's greedy output, computed on one thread as the nodes compute (with more,
    torch's threads spin against the nodes' processes on a small machine: 25x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        [result] = engine.generate([Prompt(token_ids=list(ids))],
                                   SamplingParams(max_new_tokens=new, ignore_eos=True))
    finally:
        torch.set_num_threads(threads)
    return list(result.token_ids)


def _router_stats(cluster: ServingHosts) -> tuple[int, int, int]:
    """The router's recoveries so far: KV retries, recomputes, decode failovers."""
    s = get_stats(cluster.router.door)
    return s.kv_retries, s.kv_recomputes, s.decode_failovers


def _streaming_decode(cluster: ServingHosts) -> Member:
    """The decode that runs the one request in flight."""
    running = [m for m in (cluster.decode(0), cluster.decode(1))
               if get_stats(m.door).requests_running]
    assert len(running) == 1, [m.name for m in running]
    return running[0]


def _serves_on(cluster: ServingHosts, *members: Member, timeout_s: float = 30.0) -> None:
    """Send short requests, one per decode at a time, until each of ``members`` completed one
    (healed: the router uses it again). Concurrent requests go to different decodes (the router
    counts its own at once), once the router reached them again and their cool-down after a
    failed request (a second or so) is over."""
    decodes = [m for m in cluster.members.values() if m.name.startswith("decode")]
    before = {m.name: get_stats(m.door).requests_total for m in members}
    deadline = time.monotonic() + timeout_s
    while True:
        streams = [Stream(cluster.stub(), _request(SHORT, 16), DEADLINE_S) for _ in decodes]
        for stream in streams:
            stream.join(DEADLINE_S)
            assert stream.error is None and len(stream.tokens) == 16, stream.error
        idle = [m.name for m in members if get_stats(m.door).requests_total == before[m.name]]
        if not idle:
            return
        assert time.monotonic() < deadline, f"{idle} get no request:\n{cluster.logs()}"
        time.sleep(0.2)


def _no_connection(cluster: ServingHosts, a: Member, b: Member) -> Callable[[], bool]:
    """Whether neither ``a`` nor ``b`` has a connection ESTABLISHED toward the other."""
    return lambda: not cluster.established(a, b) and not cluster.established(b, a)


def test_router_decode_cut_past_keepalive_fails_over(cluster: ServingHosts,
                                                      want_long: list[int]) -> None:
    """A cut longer than the keepalive's time and timeout: both ends close the connection
    while it is still cut (the decode frees the room), the router moves the stream to the
    other decode, and the client's stream completes, equal to the engine; healed, the cut
    decode serves again."""
    before = _router_stats(cluster)
    stream = Stream(cluster.stub(), _request(SHORT, LONG_NEW), DEADLINE_S)
    wait_for(lambda: len(stream.tokens) >= 20, "no token arrived")
    victim = _streaming_decode(cluster)
    cut_at = time.monotonic()
    cluster.router.host.link.cut(victim.host)
    # while the link is still cut: both ends found the other gone by keepalive; the decode's
    # server cancelled the stream and freed the room, the router failed over
    wait_for(_no_connection(cluster, cluster.router, victim),
             "a connection router <-> decode outlived the keepalive", FOUND_WITHIN_S)
    assert_all_idle([victim.door], FOUND_WITHIN_S)
    assert time.monotonic() - cut_at >= KEEPALIVE_S[1]  # found by the keepalive, not at once
    cluster.router.host.link.heal()
    stream.join(DEADLINE_S)
    assert stream.error is None, stream.error
    assert stream.tokens == want_long
    assert stream.ended_at - cut_at < DEADLINE_S
    retries, recomputes, failovers = _router_stats(cluster)
    assert (retries, recomputes, failovers - 1) == before
    cluster.assert_idle()
    _serves_on(cluster, victim)
    cluster.assert_idle()


def test_router_decode_short_cut_resumes_the_stream(cluster: ServingHosts,
                                                     want_long: list[int]) -> None:
    """A cut shorter than the keepalive's timeout: the stream stalls, then goes on where it
    was, on the same decode (no recovery), the connection kept."""
    before = _router_stats(cluster)
    stream = Stream(cluster.stub(), _request(SHORT, LONG_NEW), DEADLINE_S)
    wait_for(lambda: len(stream.tokens) >= 20, "no token arrived")
    victim = _streaming_decode(cluster)
    served = get_stats(victim.door).requests_total
    cluster.router.host.link.cut(victim.host)
    time.sleep(KEEPALIVE_S[1] / 4)  # the partition itself: nothing to wait for
    stalled = len(stream.tokens)
    assert stream.running and stalled < LONG_NEW
    assert cluster.established(cluster.router, victim), "the cut closed the connection"
    cluster.router.host.link.heal()
    stream.join(DEADLINE_S)
    assert stream.error is None, stream.error
    assert stream.tokens == want_long
    assert _router_stats(cluster) == before
    assert get_stats(victim.door).requests_total == served  # the same decode, no second room
    cluster.assert_idle()


def test_router_cut_from_every_decode_fails_unavailable(cluster: ServingHosts) -> None:
    """No decode is reachable any more: the request ends ``UNAVAILABLE``, naming a decode, long
    before its deadline; nothing stays held, also on the decodes cut off (their servers cancel
    the stream); healed, both decodes serve again."""
    stream = Stream(cluster.stub(), _request(SHORT, LONG_NEW), DEADLINE_S)
    wait_for(lambda: len(stream.tokens) >= 20, "no token arrived")
    decodes = [cluster.decode(0), cluster.decode(1)]
    cut_at = time.monotonic()
    cluster.router.host.link.cut(*(d.host for d in decodes))
    stream.join(DEADLINE_S)
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE, \
        stream.error
    assert "decode worker" in str(stream.error.details())
    assert stream.ended_at - cut_at < 2 * FOUND_WITHIN_S  # found dead, then no other decode
    assert_all_idle([d.door for d in decodes], FOUND_WITHIN_S)
    cluster.router.host.link.heal()
    cluster.assert_idle()
    _serves_on(cluster, *decodes)
    cluster.assert_idle()


def test_prefill_decode_cut_mid_transfer_runs_the_prompt_again(cluster: ServingHosts,
                                                               engine: LLMEngine) -> None:
    """The prefill cut from both decodes while it pushes a long prompt's KV (its link capped,
    so the transfer lasts): the room fails on both sides, and the router runs the prompt again
    (on the prefill, whose new transfer waits for the heal, or on the decode itself); the
    request completes equal to the engine, and nothing stays held. The cut lasts past the
    decode's quarantine, so the failed room's pages are free to reuse while the prefill's
    stalled write could still land."""
    want = _greedy(engine, LONG_PROMPT, 8)
    before = _router_stats(cluster)
    prefill = cluster.prefill
    prefill.host.link.set(rate_mbit=RATE_MBIT)
    stream = Stream(cluster.stub(), _request(LONG_PROMPT, 8), DEADLINE_S)
    wait_for(lambda: get_stats(prefill.door).kv_pages_used > 0, "the prefill never started")
    cut_at = time.monotonic()
    prefill.host.link.cut(cluster.decode(0).host, cluster.decode(1).host)
    wait_for(lambda: _router_stats(cluster) != before, "the room never failed", FOUND_WITHIN_S)
    time.sleep(2.0)  # the partition lasts past the quarantine (1 s): nothing to wait for
    prefill.host.link.set()
    prefill.host.link.heal()
    stream.join(DEADLINE_S)
    assert stream.error is None, stream.error
    assert stream.tokens == want
    assert stream.ended_at - cut_at < DEADLINE_S
    retries, recomputes, failovers = _router_stats(cluster)
    assert retries + recomputes > sum(before[:2]) and failovers == before[2]
    cluster.assert_idle()


def test_partition_closes_the_routers_idle_connections(cluster: ServingHosts) -> None:
    """The router cut from every worker with no request running: within the keepalive's time
    and timeout, neither side keeps a connection ESTABLISHED toward the other (without
    keepalive an idle connection would stay so for ever, and one with unanswered data for the
    15 minutes of TCP's retransmissions); healed, the router serves again."""
    router, workers = cluster.router, [cluster.prefill, cluster.decode(0), cluster.decode(1)]
    for w in workers:
        assert cluster.established(router, w) and cluster.established(w, router), w.name
    router.host.link.cut(*(w.host for w in workers))
    for w in workers:
        wait_for(_no_connection(cluster, router, w),
                 f"a connection router <-> {w.name} outlived the keepalive", FOUND_WITHIN_S)
    router.host.link.heal()
    cluster.wait_serving()
    _serves_on(cluster, *workers)
    cluster.assert_idle()


def test_partition_closes_the_transfer_connections(cluster: ServingHosts) -> None:
    """The prefill and a decode cut apart with no room in transfer: within the P/D peer
    timeout and the keepalive, neither keeps a connection ESTABLISHED toward the other (the
    handshake connection: its keepalive and user timeout, and a reset once the peer is found
    dead; the idle Mooncake connections: kernel keepalive on the decode's transfer engine's
    listening sockets and on the connections the prefill's engine opened,
    :mod:`transfer.backends.keepalive`). After the heal the pair serves again at once."""
    prefill, decode = cluster.prefill, cluster.decode(0)
    _serves_on(cluster, decode)  # a room went through: the transfer connections exist
    assert cluster.established(prefill, decode) and cluster.established(decode, prefill)
    prefill.host.link.cut(decode.host)
    try:
        wait_for(_no_connection(cluster, prefill, decode), "", FOUND_WITHIN_S + 1.0)
    except AssertionError:
        raise AssertionError(
            f"connections outlived the peer timeout and the keepalive: prefill -> decode "
            f"{cluster.established(prefill, decode)}, decode -> prefill "
            f"{cluster.established(decode, prefill)}") from None
    prefill.host.link.heal()
    before = _router_stats(cluster)
    _serves_on(cluster, decode)
    # the prefill's first write over the connection the partition ended is made again over a
    # new one (MooncakeKVManager._write): no request after the heal needed a retry
    assert _router_stats(cluster) == before
    cluster.assert_idle()
