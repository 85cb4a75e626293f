"""Process, container and pod identity of traced processes.

Cgroup parsing runs on cgroup files as runtimes write them; container lookup on real
processes placed in real cgroups named like containers; the pod lookup against a real
HTTP(S) server that serves an API-server pod list."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import ssl
import subprocess
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import ROOT, free_port
from tracer.events.schema import ProcessInfo
from tracer.export.context import ExportContext
from tracer.export.identity import (
    CgroupIdentity, IdentityResolver, KubeClient, parse_cgroup, pods_by_container, read_cgroup,
)
from tracer.export.spans import resource_for
from tracer.probes import procfs

PODS = ROOT / "tests" / "fixtures" / "k8s" / "pods-node-gpu-1.json"
ENGINE = "5b1c3e9d2f7a4c6b8e0d1f2a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e"
TGI = "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f9e8d"
POD_UID = "7e0f1b2a-4c3d-4e5f-8a9b-0c1d2e3f4a5b"
DOCKER = "3f2a9c1be4d5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f"

# /proc/PID/cgroup as each runtime and cgroup driver writes it
CGROUPS: dict[str, tuple[str, CgroupIdentity]] = {
    "docker cgroup v1 (cgroupfs)": (
        f"12:pids:/docker/{DOCKER}\n11:memory:/docker/{DOCKER}\n"
        f"2:cpu,cpuacct:/docker/{DOCKER}\n1:name=systemd:/docker/{DOCKER}\n0::/system.slice/"
        "containerd.service\n",
        CgroupIdentity(DOCKER, "docker")),
    "docker cgroup v2 (systemd)": (
        f"0::/system.slice/docker-{DOCKER}.scope\n", CgroupIdentity(DOCKER, "docker")),
    "kubernetes containerd cgroup v2 (systemd)": (
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{POD_UID.replace('-', '_')}.slice/cri-containerd-{ENGINE}.scope\n",
        CgroupIdentity(ENGINE, "containerd", POD_UID)),
    "kubernetes containerd cgroup v1 (cgroupfs)": (
        f"12:memory:/kubepods/burstable/pod{POD_UID}/{ENGINE}\n"
        f"11:pids:/kubepods/burstable/pod{POD_UID}/{ENGINE}\n1:name=systemd:/kubepods/"
        f"burstable/pod{POD_UID}/{ENGINE}\n",
        CgroupIdentity(ENGINE, "", POD_UID)),
    "kubernetes guaranteed QoS cgroup v1": (
        f"4:cpuset:/kubepods/pod{POD_UID}/{ENGINE}\n", CgroupIdentity(ENGINE, "", POD_UID)),
    "kubernetes cri-o cgroup v2": (
        "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
        f"{POD_UID.replace('-', '_')}.slice/crio-{TGI}.scope\n",
        CgroupIdentity(TGI, "cri-o", POD_UID)),
    "seen from inside a cgroup namespace": (
        "0::/../../kubepods-burstable.slice/kubepods-burstable-pod"
        f"{POD_UID.replace('-', '_')}.slice/cri-containerd-{ENGINE}.scope\n",
        CgroupIdentity(ENGINE, "containerd", POD_UID)),
    "kind: pod inside a docker node": (
        f"0::/system.slice/docker-{DOCKER}.scope/kubelet.slice/kubelet-kubepods.slice/"
        f"kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod"
        f"{POD_UID.replace('-', '_')}.slice/cri-containerd-{ENGINE}.scope\n",
        CgroupIdentity(ENGINE, "containerd", POD_UID)),
    "rootless podman": (
        "0::/user.slice/user-1000.slice/user@1000.service/user.slice/"
        f"libpod-{DOCKER}.scope/container\n", CgroupIdentity(DOCKER, "podman")),
    "cri-o conmon is not the container": (
        f"0::/kubepods.slice/kubepods-pod{POD_UID.replace('-', '_')}.slice/"
        f"crio-conmon-{TGI}.scope\n", CgroupIdentity()),
    "host process (systemd session)": (
        "0::/user.slice/user-0.slice/session-3.scope\n", CgroupIdentity()),
    "host process, 32-hex-digit cgroup name": (
        "4:memory:/process_api/b0eb26d8629c8a7ce628fb091f303ae5\n1:cpu:/\n0::/\n",
        CgroupIdentity()),
}


@pytest.mark.parametrize("case", sorted(CGROUPS))
def test_parse_cgroup(case: str) -> None:
    text, want = CGROUPS[case]
    assert parse_cgroup(text) == want


def test_pod_list_maps_every_container_id() -> None:
    pods = pods_by_container(json.loads(PODS.read_text()))
    assert set(pods) == {ENGINE, TGI, "c0ffee00" * 8,
                         "a17c9d0e5b3f48e2c6d1a09b7e4f3c2d1b0a99887766554433221100ffeeddcc"}
    engine = pods[ENGINE]
    assert (engine.namespace, engine.pod_name, engine.container_name, engine.node_name,
            engine.pod_uid) == ("inference", "vllm-llama-6d5f8b7c9-x2x7q", "engine", "gpu-1",
                                POD_UID)
    assert engine.service_name == "vllm-llama"  # app.kubernetes.io/name
    assert pods[TGI].service_name == "tgi-small"  # app
    assert pods["c0ffee00" * 8].container_name == "metrics-sidecar"


# ---- real processes in real cgroups ------------------------------------------------------


@contextmanager
def process_in_cgroup(hierarchy: Path, rel: str) -> Iterator[int]:
    """A real `sleep` moved into cgroup ``rel`` (created, then removed) of a hierarchy."""
    if os.geteuid() != 0:
        raise AssertionError("creating cgroups needs root (`make test` runs as root)")
    parts = Path(rel).parts
    created = [hierarchy.joinpath(*parts[:i]) for i in range(1, len(parts) + 1)]
    for d in created:
        d.mkdir()
    proc = subprocess.Popen(["sleep", "60"])
    try:
        (created[-1] / "cgroup.procs").write_text(str(proc.pid))
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
        for d in reversed(created):
            for _ in range(50):  # the cgroup empties asynchronously after the kill
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)


V2 = Path("/sys/fs/cgroup/unified") if Path("/sys/fs/cgroup/unified/cgroup.procs").exists() \
    else Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/pids")


@pytest.mark.parametrize("layout", ["v2-systemd-containerd", "v1-cgroupfs"])
def test_container_of_a_real_process_in_a_kubernetes_cgroup(layout: str) -> None:
    tag = uuid.uuid4().hex[:8]
    uid = f"{tag}-1111-4222-8333-444455556666"
    cid = (tag * 8)[:64]
    if layout == "v1-cgroupfs":
        if not (V1 / "cgroup.procs").exists():
            raise AssertionError(f"this machine has no cgroup v1 pids hierarchy at {V1}")
        hierarchy, top, runtime = V1, f"tt-{tag}", ""
        rel = f"{top}/kubepods/burstable/pod{uid}/{cid}"
    else:
        hierarchy, top, runtime = V2, f"tt-{tag}.slice", "containerd"
        rel = (f"{top}/kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
               f"cri-containerd-{cid}.scope")
    with process_in_cgroup(hierarchy, rel) as pid:
        assert read_cgroup(pid) == CgroupIdentity(cid, runtime, uid)
        # the capture records the same container id for the process
        assert procfs.container_id(pid) == cid
        attrs = IdentityResolver(live=True).attributes(pid, None)
        want = {"container.id": cid, "k8s.pod.uid": uid}
        if runtime:
            want["container.runtime"] = runtime
        assert attrs == want
    assert not (hierarchy / top).exists()


def test_a_host_process_has_no_container() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        text = Path(f"/proc/{proc.pid}/cgroup").read_text()
        assert read_cgroup(proc.pid) == parse_cgroup(text)
        assert IdentityResolver(live=True).attributes(proc.pid, None) == {}
    finally:
        proc.kill()
        proc.wait()
    assert read_cgroup(proc.pid) == CgroupIdentity()  # gone: empty, no exception


def test_resource_of_a_real_process() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        # Popen returns when exec closes the child's error pipe, which the kernel does
        # before it lays out the new arguments: cmdline can still read empty (seen
        # once in CI), so wait for the new image
        deadline = time.monotonic() + 5
        while procfs.cmdline(proc.pid) != ("sleep", "30") and time.monotonic() < deadline:
            time.sleep(0.01)
        info = ProcessInfo(pid=proc.pid, ts=0, comm=procfs.comm(proc.pid),
                           exe=procfs.exe(proc.pid), cmdline=procfs.cmdline(proc.pid),
                           ppid=procfs.ppid(proc.pid))
        ctx = ExportContext(host="node-a", processes={proc.pid: info},
                            identity=IdentityResolver(live=True))
        attrs = dict(resource_for(ctx, proc.pid).attributes)
        ctx.capture_cmdline = True  # opted in
        asked = dict(resource_for(ctx, proc.pid).attributes)
    finally:
        proc.kill()
        proc.wait()
    assert attrs["process.pid"] == proc.pid
    assert attrs["process.parent_pid"] == os.getpid()
    assert attrs["process.executable.path"] == os.path.realpath(shutil.which("sleep") or "")
    assert "process.command_line" not in attrs  # command lines carry keys: not by default
    assert asked["process.command_line"] == "sleep 30"
    assert attrs["service.name"] == "sleep"
    assert attrs["host.name"] == "node-a"
    assert not any(k.startswith(("k8s.", "container.")) for k in attrs)


# ---- the API server ---------------------------------------------------------------------


class FakeApiServer(http.server.ThreadingHTTPServer):
    """Serves a recorded pod list at /api/v1/pods; logs requests; can fail on demand."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.requests: list[tuple[str, str]] = []
        self.status = 200
        super().__init__(("127.0.0.1", free_port()), _Handler)

    @property
    def url(self) -> str:
        scheme = "https" if isinstance(self.socket, ssl.SSLSocket) else "http"
        return f"{scheme}://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeApiServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.requests.append((self.path, self.headers.get("Authorization", "")))
        ok = self.path.split("?")[0] == "/api/v1/pods" and self.server.status == 200
        body = self.server.body if ok else b'{"kind":"Status","status":"Failure"}'
        self.send_response(self.server.status if ok or self.server.status != 200 else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def api_server(tls: Path | None = None) -> Iterator[FakeApiServer]:
    srv = FakeApiServer(PODS.read_bytes())
    if tls is not None:
        sc = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        sc.load_cert_chain(tls / "tls.crt", tls / "tls.key")
        srv.socket = sc.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def test_pod_lookup_names_the_pod_and_the_service_and_caches() -> None:
    with api_server() as srv:
        r = IdentityResolver(KubeClient(srv.url, token="t0ken", node_name="gpu-1"))
        info = ProcessInfo(pid=1, ts=0, comm="python3", exe="/usr/bin/python3",
                           cmdline=("python3", "-m", "vllm.entrypoints.openai.api_server"),
                           container_id=ENGINE)
        ctx = ExportContext(host="gpu-1", processes={4242: info},
                            identity=IdentityResolver(r.kube, live=False))
        attrs = dict(resource_for(ctx, 4242).attributes)
        assert attrs["k8s.pod.name"] == "vllm-llama-6d5f8b7c9-x2x7q"
        assert attrs["k8s.namespace.name"] == "inference"
        assert attrs["k8s.container.name"] == "engine"
        assert attrs["k8s.node.name"] == "gpu-1"
        assert attrs["k8s.pod.uid"] == POD_UID
        assert attrs["container.id"] == ENGINE
        assert attrs["service.name"] == "vllm-llama"  # the label, not the module
        # an explicit --service-name still wins
        ctx.service_name = "mine"
        assert resource_for(ctx, 4242).attributes["service.name"] == "mine"
        # the other pods of the node come from the same, cached, list
        assert r.attributes(7, ProcessInfo(7, 0, "tgi", "", (), container_id=TGI))[
            "service.name"] == "tgi-small"
        assert r.attributes(7, ProcessInfo(7, 0, "tgi", "", (), container_id=ENGINE))[
            "k8s.container.name"] == "engine"
        assert r.stats["identity.k8s_lists"] == 1 and r.stats["identity.k8s_cache_hits"] == 1
        lists = [p for p, _ in srv.requests]
        assert lists[0] == "/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-1"
        assert all(auth == "Bearer t0ken" for _, auth in srv.requests)
        # an unknown container: one refresh at most per refresh_s, then counted misses
        r.refresh_s = 3600
        n = len(srv.requests)
        assert r.pod("f" * 64) is None and r.pod("e" * 64) is None
        assert len(srv.requests) == n
        assert r.stats["identity.k8s_not_found"] == 2


def test_pod_lookup_fails_soft_and_counts() -> None:
    with api_server() as srv:
        srv.status = 403  # the ClusterRole is missing
        r = IdentityResolver(KubeClient(srv.url, node_name="gpu-1"), live=False, refresh_s=0)
        info = ProcessInfo(1, 0, "python3", "", ("python3", "serve.py"), container_id=ENGINE)
        assert r.attributes(1, info) == {"container.id": ENGINE, "k8s.node.name": "gpu-1"}
        assert r.stats["identity.k8s_errors"] == 1
        srv.status = 200  # fixed: the next lookup after refresh_s succeeds
        assert r.attributes(1, info)["k8s.pod.name"] == "vllm-llama-6d5f8b7c9-x2x7q"
    dead = IdentityResolver(KubeClient(f"http://127.0.0.1:{free_port()}", timeout_s=2),
                            live=False)
    assert dead.pod(ENGINE) is None
    assert dead.stats["identity.k8s_errors"] == 1
    ctx = ExportContext(processes={1: info}, identity=dead)
    from tracer.pipeline import Pipeline
    assert Pipeline([], ctx).report()["identity.k8s_errors"] == 1


def test_in_cluster_client_over_tls_with_the_service_account(tmp_path: Path) -> None:
    tls = tmp_path / "tls"
    tls.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=kubernetes", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(tls / "tls.key"), "-out", str(tls / "tls.crt")],
                   check=True, capture_output=True)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("sa-token\n")
    shutil.copy(tls / "tls.crt", account / "ca.crt")
    with api_server(tls) as srv:
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
               "KUBERNETES_SERVICE_PORT": str(srv.server_address[1]), "NODE_NAME": "gpu-1"}
        kube = KubeClient.in_cluster(env, account)
        assert kube is not None and kube.base_url == srv.url
        pod = IdentityResolver(kube, live=False).pod(TGI)
        assert pod is not None and pod.pod_name == "tgi-small-0"
        assert srv.requests[-1][1] == "Bearer sa-token"
        # a CA that did not sign the server's certificate is refused, and counted
        (account / "ca.crt").write_bytes(Path(ssl.get_default_verify_paths().cafile
                                              or "/etc/ssl/certs/ca-certificates.crt")
                                         .read_bytes())
        strict = IdentityResolver(KubeClient.in_cluster(env, account), live=False)
        assert strict.pod(TGI) is None and strict.stats["identity.k8s_errors"] == 1
    assert KubeClient.in_cluster({}, account) is None  # not in Kubernetes
