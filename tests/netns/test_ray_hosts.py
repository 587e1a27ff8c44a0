"""``pdserve launch`` on a Ray cluster whose nodes are separate hosts (network namespaces on a
bridge, :mod:`tests.netns.ray_hosts`): a Ray head on host 0, Ray worker nodes joining it from
hosts 1-3 with custom resources (``prefill_host`` on host 1, ``decode_host`` on hosts 2 and 3;
host 2 has two addresses and its Ray node uses the second), and the launch run on host 0 with
``--address HEAD --prefill-resources '{"prefill_host": 1}' --decode-resources '{"decode_host":
1}'``.

- Every server runs inside the host Ray placed it on (all its threads in that namespace): the
  router on the head's host, the prefill on host 1, one decode on each of hosts 2 and 3; each
  advertises its Ray node's address (host 2's second one), never 127.0.0.1 nor an address of
  the machine's own namespace; a client on another host streams answers equal to the engine's
  greedy output through both decodes; ``status`` counts 4 of 4, and ``stop`` on host 0 ends
  the servers on every host.
- A driver that joins by address without the cluster's token fails at once, with one line that
  says what to set (Ray retried for 20 s and said only "Failed to connect").
- A decode's host leaves (every process on it killed: Ray node, actor, server) while streams
  run on it: they fail over to the other decode and end equal to the engine's output, new
  requests go to the survivor only, ``status`` names the lost server (Ray's own listing drops a
  dead actor), and nothing is held on the nodes left.

Each scenario ends with the leak check on every node still there (pages, aux slots, state
slots, rooms, requests: 0). The last test takes a host away from the module's Ray cluster: it
stays the module's last.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from bench.netns_hosts import Hosts, threads_outside
from engine.builtin import builtin_model_dir
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from tests.netns.ray_hosts import Client, RayHosts, Server, servers

pytestmark = pytest.mark.slow
PROMPTS = [[(i * 31 + j * 7) % 380 for j in range(6 + 5 * i)] for i in range(4)]
SHORT = 16  # new tokens of the placement test's streams
LONG = 200  # the leave test's: every stream still runs when its decode's host leaves
SECOND_ADDRESS = 101  # host 2's second address: 10.77.K.(101 + 2)


@dataclass
class Cluster:
    """The module's hosts and Ray cluster; ``node_ips[i]``: the address host ``i``'s Ray node
    uses."""

    hosts: Hosts
    ray: RayHosts
    node_ips: list[str]


@pytest.fixture(scope="module")
def cluster(netns_ready: None) -> Iterator[Cluster]:
    hosts = Hosts(4)
    rh = None
    try:
        second = str(hosts.subnet[SECOND_ADDRESS + 2])
        hosts[2].run(["ip", "addr", "add", f"{second}/{hosts.subnet.prefixlen}", "dev", "eth0"])
        rh = RayHosts(hosts)
        rh.join(1, {"prefill_host": 1})
        rh.join(2, {"decode_host": 1}, node_ip=second)
        rh.join(3, {"decode_host": 1})
        yield Cluster(hosts, rh, [hosts[0].address, hosts[1].address, second, hosts[3].address])
    finally:
        if rh is not None:
            rh.close()
        hosts.close()


@pytest.fixture(scope="module")
def greedy() -> dict[int, list[list[int]]]:
    """The in-process engine's greedy output of every prompt, by number of new tokens."""
    engine = LLMEngine(builtin_model_dir(), EngineConfig(num_pages=256))
    out = {}
    for n in (SHORT, LONG):
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        out[n] = [r.token_ids for r in engine.generate([Prompt(token_ids=p) for p in PROMPTS],
                                                       params)]
    return out


@pytest.fixture
def client(cluster: Cluster) -> Iterator[Client]:
    """A client on host 1 (not the router's host: its calls cross the bridge)."""
    c = Client(cluster.hosts[1])
    yield c
    c.stop()


def launch(cluster: Cluster, name: str) -> str:
    """``pdserve launch --detach`` of cluster ``name`` on host 0 (one prefill, two decodes,
    placed by resources); its router's address."""
    done = cluster.ray.pdserve(
        0, "launch", "--address", cluster.ray.head, "--name", name, "--model", "builtin",
        "--port", "0", "--decode", "2", "--prefill-resources", '{"prefill_host": 1}',
        "--decode-resources", '{"decode_host": 1}', "--detach")
    assert done.returncode == 0, done.stdout + done.stderr
    return next(ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith("READY "))


def placed(cluster: Cluster) -> dict[int, list[Server]]:
    """The pdserve servers inside each host, by host number."""
    return {i: servers(host) for i, host in enumerate(cluster.hosts)}


def machine_addresses() -> set[str]:
    """The IPv4 addresses of the machine's own namespace (the test process's)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[3].split("/")[0] for line in out.splitlines()}


def stop(cluster: Cluster, name: str) -> None:
    """``pdserve stop --name NAME`` on host 0: it exits 0 and no server is left on any host."""
    done = cluster.ray.pdserve(0, "stop", "--name", name)
    assert done.returncode == 0 and f"stopped the pdserve cluster {name!r}" in done.stdout, \
        done.stdout + done.stderr
    deadline = time.monotonic() + 30
    while any(placed(cluster).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(placed(cluster).values()), placed(cluster)


def test_launch_places_each_role_on_its_host(cluster: Cluster, client: Client,
                                             greedy: dict[int, list[list[int]]]) -> None:
    router = launch(cluster, "spread")
    try:
        on = placed(cluster)
        assert {i: [s.role for s in found] for i, found in on.items()} == \
            {0: ["router"], 1: ["prefill"], 2: ["decode"], 3: ["decode"]}
        for i, found in on.items():
            for server in found:
                assert threads_outside(server.pid, cluster.hosts[i].netns) == []
                if server.role != "router":  # a worker advertises its Ray node's address
                    assert server.flag("--advertise-host") == cluster.node_ips[i]
        [router_server] = on[0]
        prefill = router_server.flag("--prefill").split(",")
        decodes = router_server.flag("--decode").split(",")
        assert router.rsplit(":", 1)[0] == cluster.node_ips[0]
        assert [a.rsplit(":", 1)[0] for a in prefill] == [cluster.node_ips[1]]
        assert sorted(a.rsplit(":", 1)[0] for a in decodes) == sorted(cluster.node_ips[2:])
        ours = machine_addresses()
        for address in [router, *prefill, *decodes]:
            host = address.rsplit(":", 1)[0]
            assert host != "127.0.0.1" and host not in ours, address
        client.call("start", router, PROMPTS, SHORT)
        got = client.call("finish", 120.0)
        assert [(tokens, error) for tokens, error, _ in got] == \
            [(want, "") for want in greedy[SHORT]]
        served = [int(client.call("stats", d).get("requests_total", 0)) for d in decodes]
        assert all(served) and sum(served) == len(PROMPTS), served  # KV reached both hosts
        client.call("idle", [router, *prefill, *decodes], 15.0)
        status = cluster.ray.pdserve(0, "status", "--name", "spread")
        assert status.returncode == 0 and f"router: {router}\n" in status.stdout, \
            status.stdout + status.stderr
        assert "servers alive: 4/4\n" in status.stdout, status.stdout
    finally:
        stop(cluster, "spread")


def test_joining_without_the_clusters_token_fails_at_once(cluster: Cluster) -> None:
    """Ray's head here uses token authentication (as a head does on a machine with a token in
    ``~/.ray/auth_token``); a launch without ``RAY_AUTH_MODE=token`` is refused within seconds,
    with one line that says what to set (Ray's own ``ray.init`` retried for 20 s, logging a
    line a second, and then said "Failed to connect to Ray cluster at HEAD")."""
    env = {k: v for k, v in cluster.ray.env.items() if k != "RAY_AUTH_MODE"}
    start = time.monotonic()
    done = cluster.ray.pdserve(0, "launch", "--address", cluster.ray.head, "--name", "x",
                               "--model", "builtin", "--port", "0", "--detach", env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (
        f"error: the Ray cluster at {cluster.ray.head} refused this process's token: it uses "
        "token authentication, so set RAY_AUTH_MODE=token here and give the cluster's token "
        "(the RAY_AUTH_TOKEN environment variable, a file named by RAY_AUTH_TOKEN_PATH, or "
        "~/.ray/auth_token)\n"), done.stderr
    assert time.monotonic() - start < 15
    assert not any(placed(cluster).values())


def host_of(cluster: Cluster, address: str) -> int:
    """The number of the host whose Ray node uses ``address``'s host."""
    return cluster.node_ips.index(address.rsplit(":", 1)[0])


def test_a_decode_host_that_leaves_mid_stream(cluster: Cluster, client: Client,
                                             greedy: dict[int, list[list[int]]]) -> None:
    router = launch(cluster, "leave")
    try:
        decodes = placed(cluster)[0][0].flag("--decode").split(",")
        prefill = placed(cluster)[0][0].flag("--prefill")
        client.call("start", router, PROMPTS, LONG)
        deadline = time.monotonic() + 60
        while min(client.call("progress")) < 3:
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.02)
        running = {d: int(client.call("stats", d).get("requests_running", 0)) for d in decodes}
        victim = max(running, key=lambda d: running[d])
        [survivor] = [d for d in decodes if d != victim]
        assert running[victim] > 0, running
        cluster.ray.leave(host_of(cluster, victim))
        left_at = time.monotonic()
        # at once: the actor does not answer; after Ray marks the node dead it is not even
        # listed any more: both times status names the lost server
        check_status_names(cluster, "leave", victim, decodes)
        got = client.call("finish", 120.0)
        assert [(tokens, error) for tokens, error, _ in got] == \
            [(want, "") for want in greedy[LONG]], [(len(t), e) for t, e, _ in got]
        assert all(ended > left_at for _, _, ended in got)  # they were mid-stream
        failovers = int(client.call("stats", router).get("decode_failovers", 0))
        assert failovers >= running[victim], failovers
        before = int(client.call("stats", survivor).get("requests_total", 0))
        client.call("start", router, PROMPTS, SHORT)  # new requests: the survivor only
        got = client.call("finish", 120.0)
        assert [(tokens, error) for tokens, error, _ in got] == \
            [(want, "") for want in greedy[SHORT]]
        assert int(client.call("stats", router).get("decode_failovers", 0)) == failovers
        after = int(client.call("stats", survivor).get("requests_total", 0))
        assert after - before == len(PROMPTS)
        client.call("idle", [router, prefill, survivor], 15.0)
        cluster.ray.wait_left(cluster.node_ips[host_of(cluster, victim)])
        check_status_names(cluster, "leave", victim, decodes)
    finally:
        stop(cluster, "leave")


def check_status_names(cluster: Cluster, name: str, lost: str, decodes: list[str]) -> None:
    """``pdserve status`` counts 3 of 4 servers, names the decode at ``lost`` (labels follow
    the router's ``--decode`` list), and exits 1."""
    status = cluster.ray.pdserve(0, "status", "--name", name)
    assert status.returncode == 1, status.stdout + status.stderr
    assert "servers alive: 3/4\n" in status.stdout, status.stdout
    assert f"not running: decode-{decodes.index(lost)} " in status.stdout, status.stdout

