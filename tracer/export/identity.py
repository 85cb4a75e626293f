"""Who a traced process is: container, and in Kubernetes its pod.

Two sources, both optional and both failing soft:

- ``/proc/PID/cgroup`` names the container (docker, containerd, cri-o, podman; cgroup
  v1 and v2, cgroupfs and systemd drivers) and, under Kubernetes, the pod's uid.
- The Kubernetes API server, with the agent's in-cluster service account, names the
  pod, namespace, container and node of that container id. One list call per refresh
  (the pods of this node when ``NODE_NAME`` is set), cached; a miss refreshes at most
  every ``refresh_s``. An error is counted in ``stats`` and warned about once, and the
  span goes out without ``k8s.*`` attributes.

The attributes are OpenTelemetry resource conventions (``container.id``,
``k8s.pod.name``, ``k8s.namespace.name``, ``k8s.container.name``, ``k8s.node.name``,
``k8s.pod.uid``). ``service.name`` comes from the pod's ``app.kubernetes.io/name`` or
``app`` label when there is one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracer.events.schema import ProcessInfo

log = logging.getLogger("tokentrace.identity")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_LABELS = ("app.kubernetes.io/name", "app")

# One path component that names a container: an optional runtime prefix, 64 hex
# digits, an optional ".scope". conmon scopes (cri-o's monitor) are not containers.
_CONTAINER = re.compile(
    r"^(?:(?P<prefix>docker|cri-containerd|crio|libpod|containerd)-)?"
    r"(?P<id>[0-9a-f]{64})(?:\.scope)?$")
_POD_UID = re.compile(r"pod(?P<uid>[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_]"
                      r"[0-9a-f]{4}[-_][0-9a-f]{12})")
_RUNTIMES = {"docker": "docker", "cri-containerd": "containerd", "containerd": "containerd",
             "crio": "cri-o", "libpod": "podman"}


@dataclass(frozen=True)
class CgroupIdentity:
    """What a process's cgroup path says of it (empty strings where it says nothing)."""

    container_id: str = ""
    runtime: str = ""  # docker, containerd, cri-o, podman, or "" when not in the path
    pod_uid: str = ""  # with dashes, as the API server writes it


def parse_cgroup(text: str) -> CgroupIdentity:
    """Parse the text of /proc/PID/cgroup (any cgroup version, any driver).

    The innermost path component naming a 64-hex-digit container wins; the runtime is
    taken from its prefix (``cri-containerd-``, ``crio-``, ``docker-``, ``libpod-``) or
    from a parent directory (``/docker/<id>``); the pod uid from a ``pod<uid>``
    component (underscores, as the systemd driver writes them, become dashes).
    """
    best = CgroupIdentity()
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        comps = [c for c in parts[2].split("/") if c]
        for i in range(len(comps) - 1, -1, -1):
            m = _CONTAINER.match(comps[i])
            if not m:
                continue
            runtime = _RUNTIMES.get(m.group("prefix") or "", "")
            if not runtime and i > 0:
                runtime = _RUNTIMES.get(comps[i - 1], "")
            pod = ""
            for c in comps[:i]:
                pm = _POD_UID.search(c)
                if pm:
                    pod = pm.group("uid").replace("_", "-")
            found = CgroupIdentity(m.group("id"), runtime, pod)
            # the unified (v2) line or the first v1 line naming a container; prefer
            # one that also names the pod
            if not best.container_id or (pod and not best.pod_uid):
                best = found
            break
    return best


def read_cgroup(pid: int, proc: Path = Path("/proc")) -> CgroupIdentity:
    """``parse_cgroup`` of a live process; empty if it is gone or unreadable."""
    try:
        return parse_cgroup((proc / str(pid) / "cgroup").read_text())
    except (OSError, UnicodeDecodeError):
        return CgroupIdentity()


@dataclass(frozen=True)
class PodIdentity:
    """One container of one pod, as the API server describes it."""

    namespace: str
    pod_name: str
    pod_uid: str
    container_name: str
    node_name: str
    labels: dict[str, str] = field(default_factory=dict, hash=False)

    def attributes(self) -> dict[str, str]:
        a = {"k8s.namespace.name": self.namespace, "k8s.pod.name": self.pod_name,
             "k8s.pod.uid": self.pod_uid, "k8s.container.name": self.container_name,
             "k8s.node.name": self.node_name}
        return {k: v for k, v in a.items() if v}

    @property
    def service_name(self) -> str | None:
        for label in SERVICE_LABELS:
            if self.labels.get(label):
                return self.labels[label]
        return None


def pods_by_container(pod_list: dict[str, Any]) -> dict[str, PodIdentity]:
    """container id -> identity, from the JSON of a ``PodList``.

    Container ids in ``status.containerStatuses[].containerID`` are
    ``<runtime>://<id>``; init and ephemeral containers count too."""
    out: dict[str, PodIdentity] = {}
    for pod in pod_list.get("items") or []:
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        status = pod.get("status") or {}
        for key in ("containerStatuses", "initContainerStatuses",
                    "ephemeralContainerStatuses"):
            for cs in status.get(key) or []:
                cid = (cs.get("containerID") or "").rsplit("://", 1)[-1]
                if not cid:
                    continue
                out[cid] = PodIdentity(
                    namespace=meta.get("namespace", ""), pod_name=meta.get("name", ""),
                    pod_uid=meta.get("uid", ""), container_name=cs.get("name", ""),
                    node_name=spec.get("nodeName", ""), labels=dict(meta.get("labels") or {}))
    return out


class KubeClient:
    """A read-only client of the API server's pod list, with a bearer token."""

    def __init__(self, base_url: str, token: str = "", ca_file: str | None = None,
                 node_name: str = "", timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.node_name = node_name
        self.timeout_s = timeout_s
        self._ssl: ssl.SSLContext | None = None
        if self.base_url.startswith("https:"):
            self._ssl = ssl.create_default_context(cafile=ca_file)

    @classmethod
    def in_cluster(cls, env: dict[str, str] | None = None,
                   account: Path = SERVICE_ACCOUNT) -> "KubeClient | None":
        """The client for the pod's service account, or None outside Kubernetes.

        ``TOKENTRACE_K8S_API`` overrides the API server URL (a kubectl proxy, say)."""
        env = dict(os.environ if env is None else env)
        url = env.get("TOKENTRACE_K8S_API", "")
        if not url:
            host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
            if not host:
                return None
            host = f"[{host}]" if ":" in host else host
            url = f"https://{host}:{port or 443}"
        try:
            token = (account / "token").read_text().strip()
        except OSError:
            token = ""
        ca = account / "ca.crt"
        return cls(url, token, str(ca) if ca.exists() else None, env.get("NODE_NAME", ""))

    def list_pods(self) -> dict[str, Any]:
        """GET the pods of this node (all pods when the node is unknown)."""
        url = f"{self.base_url}/api/v1/pods"
        if self.node_name:
            url += "?" + urllib.parse.urlencode(
                {"fieldSelector": f"spec.nodeName={self.node_name}"})
        req = urllib.request.Request(url, headers={"Accept": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as resp:
            return json.loads(resp.read())


class IdentityResolver:
    """Resource attributes of traced processes: container from cgroups, pod from the
    API server. Safe to call from any thread; never raises for a lookup failure."""

    def __init__(self, kube: KubeClient | None = None, live: bool = True,
                 refresh_s: float = 10.0, proc: Path = Path("/proc")) -> None:
        self.kube = kube
        self.live = live  # False in replay: the pids are not this machine's now
        self.refresh_s = refresh_s
        self.proc = proc
        self.stats: Counter[str] = Counter()
        self._pods: dict[str, PodIdentity] = {}
        self._last_list = float("-inf")
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    @classmethod
    def from_env(cls, live: bool = True) -> "IdentityResolver":
        return cls(KubeClient.in_cluster(), live=live)

    def container(self, pid: int, info: ProcessInfo | None) -> CgroupIdentity:
        """The container of ``pid``: its live cgroup, else what the capture recorded."""
        cg = read_cgroup(pid, self.proc) if self.live else CgroupIdentity()
        if not cg.container_id and info is not None and info.container_id:
            cg = CgroupIdentity(info.container_id)
        return cg

    def pod(self, container_id: str) -> PodIdentity | None:
        """The pod container ``container_id`` belongs to, or None (not found, no API)."""
        if self.kube is None or not container_id:
            return None
        with self._lock:
            hit = self._pods.get(container_id)
            if hit is not None:
                self.stats["identity.k8s_cache_hits"] += 1
                return hit
            if time.monotonic() - self._last_list < self.refresh_s:
                self.stats["identity.k8s_not_found"] += 1
                return None
            self._last_list = time.monotonic()
            try:
                self._pods = pods_by_container(self.kube.list_pods())
                self.stats["identity.k8s_lists"] += 1
            except (OSError, urllib.error.URLError, ValueError, ssl.SSLError) as e:
                self.stats["identity.k8s_errors"] += 1
                self._warn("k8s", f"pod lookup at {self.kube.base_url} failed ({e}); "
                           "spans go out without k8s.* attributes")
                return None
            hit = self._pods.get(container_id)
            if hit is None:
                self.stats["identity.k8s_not_found"] += 1
            return hit

    def attributes(self, pid: int, info: ProcessInfo | None) -> dict[str, str]:
        """``container.*`` and ``k8s.*`` resource attributes, plus ``service.name``
        when the pod's labels name the service."""
        cg = self.container(pid, info)
        out: dict[str, str] = {}
        if cg.container_id:
            out["container.id"] = cg.container_id
        if cg.runtime:
            out["container.runtime"] = cg.runtime
        if cg.pod_uid:
            out["k8s.pod.uid"] = cg.pod_uid
        pod = self.pod(cg.container_id)
        if pod is not None:
            out.update(pod.attributes())
            if pod.service_name:
                out["service.name"] = pod.service_name
        else:
            out.update(self.node_attributes())
        return out

    def node_attributes(self) -> dict[str, str]:
        """``k8s.node.name`` of the node the agent runs on, where it is known."""
        if self.kube is not None and self.kube.node_name:
            return {"k8s.node.name": self.kube.node_name}
        return {}

    def _warn(self, kind: str, msg: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("tokentrace: warning: %s", msg)


def identity_attributes(ctx: Any, pid: int, info: ProcessInfo | None) -> dict[str, str]:
    """The hook for span resources: ``ctx.identity``'s attributes, or just the recorded
    container id when no resolver is set (tests, library use)."""
    resolver = getattr(ctx, "identity", None)
    if resolver is None:
        return {"container.id": info.container_id} if info and info.container_id else {}
    return resolver.attributes(pid, info)


def node_attributes(ctx: Any) -> dict[str, str]:
    """The hook for the agent's own resource: the node it runs on, where known."""
    resolver = getattr(ctx, "identity", None)
    return resolver.node_attributes() if resolver is not None else {}
