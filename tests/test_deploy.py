"""deploy/: Kubernetes manifests against the API schemas, the agent's command line
against the CLI, collector and Jaeger configs against each other, the image recipe's
steps on Debian 12, and the Grafana dashboard against the metrics really exposed."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT
from tracer.cli import build_parser
from tracer.export.context import ExportContext
from tracer.export.metrics import PrometheusSink

DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
K8S_VERSIONS = [kubernetes_validate.latest_version(), "1.30.0"]  # 1.30: appArmorProfile


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def objects() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object, over every manifest."""
    return {(d["kind"], d["metadata"]["name"]): d for p in MANIFESTS for d in docs(p)}


def test_the_manifests_are_all_there() -> None:
    kinds = {k for k, _ in objects()}
    assert {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap",
            "DaemonSet", "Deployment", "Service"} <= kinds
    assert {p.name for p in MANIFESTS} == {"tokentrace.yaml", "jaeger.yaml",
                                           "otel-collector.yaml"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_validate_strictly_against_the_kubernetes_schema(path: Path,
                                                                   version: str) -> None:
    for d in docs(path):
        kubernetes_validate.validate(d, version, strict=True)


def test_the_validator_rejects_a_wrong_manifest() -> None:
    ds = copy.deepcopy(objects()[("DaemonSet", "tokentrace")])
    ds["spec"]["template"]["spec"]["hostPid"] = True  # misspelt: strict mode refuses it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSIONS[0], strict=True)
    ds = copy.deepcopy(objects()[("DaemonSet", "tokentrace")])
    ds["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "many"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSIONS[0], strict=True)


def _agent() -> tuple[dict[str, Any], dict[str, Any]]:
    ds = objects()[("DaemonSet", "tokentrace")]
    pod = ds["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_daemonset_privileges_are_the_documented_least_set() -> None:
    pod, c = _agent()
    assert pod["hostPID"] is True
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    added = set(sc["capabilities"]["add"])
    assert added == {"BPF", "PERFMON", "SYS_RESOURCE", "SYS_PTRACE", "DAC_READ_SEARCH"}
    guide = (ROOT / "docs" / "deploy.md").read_text()
    for cap in added:  # every capability the manifest asks for is explained
        assert f"CAP_{cap}" in guide
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    host = {path: volumes[m["name"]].get("hostPath", {}).get("path")
            for path, m in mounts.items()}
    assert host["/sys/kernel/tracing"] == "/sys/kernel/tracing"
    assert host["/sys/kernel/debug"] == "/sys/kernel/debug"
    assert host["/lib/modules"] == "/lib/modules" and mounts["/lib/modules"]["readOnly"]
    assert host["/usr/src"] == "/usr/src" and mounts["/usr/src"]["readOnly"]
    if sc.get("readOnlyRootFilesystem"):
        assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_the_service_account_may_list_pods_and_nothing_else() -> None:
    objs = objects()
    pod, _ = _agent()
    ns = objs[("DaemonSet", "tokentrace")]["metadata"]["namespace"]
    sa = objs[("ServiceAccount", pod["serviceAccountName"])]
    assert sa["metadata"]["namespace"] == ns
    bindings = [b for (k, _), b in objs.items() if k == "ClusterRoleBinding"
                and {"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                     "namespace": ns} in b["subjects"]]
    assert len(bindings) == 1
    role = objs[("ClusterRole", bindings[0]["roleRef"]["name"])]
    # the identity module's one call: GET /api/v1/pods (list, core group)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list"]}]


def agent_argv(tmp_path: Path) -> list[str]:
    """What the DaemonSet's shell command passes to `tokentrace`, with the ConfigMap's
    settings as environment, run by a real /bin/sh."""
    _, c = _agent()
    objs = objects()
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    for src in c["envFrom"]:
        env.update(objs[("ConfigMap", src["configMapRef"]["name"])]["data"])
    fake = tmp_path / "tokentrace"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    r = subprocess.run([*c["command"], *c["args"]], env=env, capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout)


def test_the_agent_command_is_a_valid_tokentrace_run(tmp_path: Path) -> None:
    argv = agent_argv(tmp_path)
    args = build_parser().parse_args(argv)
    assert args.command == "run" and args.quiet and args.otlp_metrics
    assert args.port or args.comm or args.pid  # something to trace
    pod, c = _agent()
    metrics_port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
    assert args.prometheus == ("0.0.0.0", metrics_port)
    tmpl = objects()[("DaemonSet", "tokentrace")]["spec"]["template"]["metadata"]
    assert tmpl["annotations"]["prometheus.io/port"] == str(metrics_port)
    # the OTLP endpoint is the collector's gRPC port
    host, port = args.otlp.rsplit(":", 1)
    svc = service_port(host, "otlp-grpc")
    assert int(port) == svc


def service_port(host: str, port_name: str) -> int:
    """The port of a cluster DNS name (svc.ns.svc.cluster.local), checked to exist."""
    name, ns = host.split(".")[:2]
    svc = objects()[("Service", name)]
    assert svc["metadata"]["namespace"] == ns
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    # the service selects the pods whose container exposes that port
    sel = svc["spec"]["selector"]
    dep = [d for (k, _), d in objects().items() if k == "Deployment"
           and d["spec"]["template"]["metadata"]["labels"].items() >= sel.items()]
    assert len(dep) == 1
    cports = {p["name"]: p["containerPort"] for c in dep[0]["spec"]["template"]["spec"]
              ["containers"] for p in c["ports"]}
    assert ports[port_name]["targetPort"] in cports
    return ports[port_name]["port"]


def check_pipelines(cfg: dict[str, Any]) -> None:
    """Every component a collector pipeline names is defined (as otelcol checks)."""
    for ext in cfg["service"].get("extensions", []):
        assert ext in cfg["extensions"], ext
    for name, p in cfg["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for comp in p.get(kind, []):
                assert comp in (cfg.get(kind) or {}), f"{name}: {kind} {comp} undefined"


@pytest.mark.parametrize("app,config_map", [("jaeger", "jaeger-config"),
                                            ("otel-collector", "otel-collector-config")])
def test_collector_configs_are_whole_and_mounted_as_written(app: str, config_map: str) -> None:
    text = (DEPLOY / app / "config.yaml").read_text()
    cm = objects()[("ConfigMap", config_map)]
    assert cm["data"]["config.yaml"] == text
    cfg = yaml.safe_load(text)
    check_pipelines(cfg)
    dep = objects()[("Deployment", app)]
    spec = dep["spec"]["template"]["spec"]
    mount = spec["containers"][0]["volumeMounts"][0]["mountPath"]
    assert any(a.endswith(f"{mount}/config.yaml") for a in spec["containers"][0]["args"])
    assert spec["volumes"][0]["configMap"]["name"] == config_map
    # the OTLP receiver listens where the pod says it does
    cports = {p["name"]: p["containerPort"] for p in spec["containers"][0]["ports"]}
    grpc = cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert int(grpc.rsplit(":", 1)[1]) == cports["otlp-grpc"]


def test_collector_sends_spans_to_jaeger() -> None:
    cfg = yaml.safe_load((DEPLOY / "otel-collector" / "config.yaml").read_text())
    exporters = cfg["service"]["pipelines"]["traces"]["exporters"]
    endpoint = cfg["exporters"][exporters[0]]["endpoint"]
    host, port = endpoint.rsplit(":", 1)
    assert int(port) == service_port(host, "otlp-grpc")
    assert host.split(".")[0] == "jaeger"


# ---- the image -----------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            ins, _, rest = line.partition(" ")
            out.append((ins.upper(), rest.strip()))
    return out


def test_image_recipe_builds_on_debian_12(tmp_path: Path) -> None:
    """The Dockerfile's own steps, run on this Debian 12 machine (the image's base):
    its apt packages exist in Debian, its COPY set is enough to install tokentrace, and
    the venv it makes imports Debian's bcc and runs `tokentrace doctor`."""
    steps = dockerfile()
    assert steps[0][0] == "FROM" and steps[0][1].startswith("debian:12")
    assert "bookworm" in Path("/etc/os-release").read_text()
    runs = [a for i, a in steps if i == "RUN"]
    apt = next(r for r in runs if "apt-get install" in r)
    words = shlex.split(apt.split("apt-get install", 1)[1].split("&&")[0])
    packages = [w for w in words if not w.startswith("-")]
    assert "python3-bpfcc" in packages and "bcc" not in packages
    for pkg in packages:
        r = subprocess.run(["apt-cache", "show", "--no-all-versions", pkg],
                           capture_output=True, text=True)
        assert r.returncode == 0 and f"Package: {pkg}" in r.stdout, f"no Debian package {pkg}"
        assert subprocess.run(["dpkg", "-s", pkg], capture_output=True).returncode == 0, \
            f"{pkg} is not installed here (make setup installs python3-bpfcc)"
    src, opt = tmp_path / "src", tmp_path / "opt"
    src.mkdir()
    for ins, a in steps:
        if ins == "COPY":
            *sources, dest = shlex.split(a)
            for s in sources:
                for f in ROOT.glob(s):
                    target = Path(str(dest).replace("/src", str(src)))
                    if f.is_dir():
                        shutil.copytree(f, target, ignore=shutil.ignore_patterns("__pycache__"))
                    else:
                        shutil.copy(f, target / f.name if dest.endswith("/") else target)
    install = next(r for r in runs if "pip install" in r)
    assert "apt-get" not in install
    cmd = install.replace("/opt/tokentrace", str(opt / "tokentrace")).replace("/src", str(src))
    cmd = cmd.replace("python3 -m venv", "/usr/bin/python3 -m venv")  # Debian's, as in the image
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not src.exists(), cmd  # the recipe cleans up after itself
    entry = next(a for i, a in steps if i == "ENTRYPOINT")
    exe = opt / "tokentrace" / "bin" / json.loads(entry)[0]
    r = subprocess.run([str(exe), "doctor", "--no-load", "--json"], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=120)
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert checks["bcc"]["ok"] and "/usr/lib/python3/dist-packages/bcc" in checks["bcc"]["detail"]


# ---- the dashboard ---------------------------------------------------------------------


def exposed_sample_names() -> set[str]:
    """Sample names a real PrometheusSink exposes, from a scrape of it: an agent's,
    whose overhead meter has measured (its health metrics appear only then)."""
    ctx = ExportContext()
    ctx.drops = {"probe_cpu_estimates": 1, "probe_cpu_ppm": 5_000,
                 "probe_cpu_probe_ns": 10_000_000, "probe_cpu_traced_ns": 2_000_000_000}
    sink = PrometheusSink(0, "127.0.0.1", ctx=ctx)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics") as r:
            text = r.read().decode()
    finally:
        sink.close()
    names = set()
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("tokentrace_"):
            continue
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",),
                    "gauge": ("",)}
        names.update(fam.name + s for s in suffixes[fam.type])
    return names


# the agent's own: its share of the time traced, its probes' cost, its lost records
AGENT_PANELS = {10, 11, 12}


def test_dashboard_queries_use_metrics_the_exporter_exposes() -> None:
    dash = json.loads((DEPLOY / "grafana" / "tokentrace-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    used = {n for e in exprs for n in re.findall(r"\btokentrace_[a-z0-9_]+", e)}
    # the exporter's own health (label values capped) is not a per-model panel
    exposed = {n for n in exposed_sample_names()
               if not n.startswith("tokentrace_label_values_capped")}
    assert used <= exposed, f"queries name metrics nobody exposes: {used - exposed}"
    families = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in exposed}
    assert {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in used} == families
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["type"] == "prometheus" and p["targets"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")")
            # every panel is per model but the agent's own health (no model label)
            assert 'model_name=~"$model"' in t["expr"] or p["id"] in AGENT_PANELS, p["title"]
