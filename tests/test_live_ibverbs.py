"""ibverbs probes on a real process: the sample RDMA workload, compiled against the real
<infiniband/verbs.h>, posts and polls through the header's inline functions into a
stripped stand-in provider reached only through ctx->ops; real uprobes attach to the
exported libibverbs calls and, from the context they reveal, to the provider's
unexported functions. The tracer's totals must equal the stand-ins' own counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from samples.gpu.build import build_verbs
from tracer.correlate.connections import TrackerOptions
from tracer.probes.session import CaptureConfig
from tracer.runner import TraceRun

STEPS, THREADS = 150, 3


@pytest.fixture(scope="module")
def verbs_build(tmp_path_factory):
    return build_verbs(tmp_path_factory.mktemp("verbs"))


def trace_workload(paths, tmp: Path, args: list[str]):
    """Run the workload under a live capture; (process summary, library counts,
    provider counts, loss report, the session's provider files)."""
    env = dict(os.environ, TT_STANDIN_VERBS_COUNTS=str(tmp / "verbs.json"),
               TT_STANDIN_PROVIDER_COUNTS=str(tmp / "provider.json"))
    w = subprocess.Popen([str(paths["workload"]), "--wait", *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    assert w.stdout.readline().strip() == "ready"
    run = TraceRun(CaptureConfig(pids=[w.pid]), [], TrackerOptions(),
                   record=str(tmp / "verbs.ttcap"))
    run.start()
    try:
        w.stdin.write("go\n")
        w.stdin.flush()
        assert w.stdout.readline().strip() == "opened"
        # posts made before the provider's probes are attached are not seen (the
        # documented gap of one poll interval): start the traffic after it
        deadline = time.monotonic() + 20
        verbs = run.session.gpu.verbs
        while not any(len(p.functions) == 3 for p in list(verbs.providers.values())):
            assert time.monotonic() < deadline, f"provider not attached: {verbs.errors}"
            time.sleep(0.02)
        w.stdin.write("go\n")
        w.stdin.flush()
        assert w.stdout.readline().strip() == "done"
        assert w.wait(30) == 0
    finally:
        report = run.stop()
    doc = run.pipeline.gpu.summary()
    (proc,) = doc["processes"]
    assert proc["pid"] == w.pid
    lib = json.loads((tmp / "verbs.json").read_text())
    prov = json.loads((tmp / "provider.json").read_text())
    return proc, lib, prov, report, verbs.providers, doc


def test_posts_completions_and_registrations_match_the_libraries_exactly(verbs_build, tmp_path):
    proc, lib, prov, report, providers, _ = trace_workload(
        verbs_build, tmp_path, ["--steps", str(STEPS), "--threads", str(THREADS)])
    # the provider was found through ctx->ops: one stripped file, three functions
    (pf,) = providers.values()
    assert pf.path.endswith("/libibverbs/libttsim-rdmav34.so")
    assert set(pf.functions) == {"post_send", "post_recv", "poll_cq"}
    v = proc["ibverbs"]
    assert v["contexts"] == 1
    # posted work requests and bytes, by verb
    assert prov["send_wrs"]["send"] == THREADS * (STEPS * 6 + STEPS // 50)  # + 1 RNR / 50
    for verb in ("send", "rdma_write", "rdma_read"):
        assert v["posted"][verb]["wrs"] == prov["send_wrs"][verb], verb
        assert v["posted"][verb]["bytes"] == prov["send_bytes"][verb], verb
    assert v["posted"]["recv"]["wrs"] == prov["recv_wrs"]
    assert v["posted"]["recv"]["bytes"] == prov["recv_bytes"]
    assert sum(p["sges"] for k, p in v["posted"].items() if k != "recv") == prov["send_sges"]
    assert v["posted"]["recv"]["sges"] == prov["recv_sges"]
    assert v["post_send_calls"] == prov["post_send_calls"]
    assert v["post_recv_calls"] == prov["post_recv_calls"]
    # completions: by opcode, the RNR errors, received bytes only (the stand-in fills
    # byte_len of send completions too, which must not be counted)
    assert v["completions"] == prov["completions"]
    assert v["completion_errors"] == prov["completion_errors"] == THREADS * STEPS // 50
    assert v["completion_bytes"] == prov["completion_bytes"]
    assert v["polls"] == prov["polls"] and v["empty_polls"] == prov["empty_polls"]
    assert v["poll_errors"] == 0 and v["chains_cut"] == 0
    # per QP: the numbers are the provider's, and so is what happened on each
    assert set(v["qps"]) == set(prov["qps"])
    for qp, truth in prov["qps"].items():
        seen = v["qps"][qp]
        assert {k: seen.get(k, 0) for k in truth} == truth, qp
    # per thread: three workers with the same traffic
    workers = [t["ibverbs"] for t in proc["threads"].values() if t["ibverbs"]["posted"]]
    assert len(workers) == THREADS
    assert {w["posted"]["send"]["wrs"] for w in workers} == {prov["send_wrs"]["send"] // THREADS}
    # registered memory: ibv_reg_mr and ibv_reg_mr_iova both counted once
    mem = v["registered_memory"]
    assert (mem["reg_mr"], mem["reg_bytes"]) == (lib["reg_mr"], lib["reg_bytes"]) == (
        2 * THREADS, sum((1 << 20) + 4096 * t + 65536 for t in range(THREADS)))
    assert mem["dereg_mr"] == lib["dereg_mr"] == 2 * THREADS - 1
    assert (mem["live_bytes"], mem["live_regions"]) == (lib["reg_bytes"] - lib["dereg_bytes"], 1)
    assert mem["peak_bytes"] == lib["reg_bytes"] and mem["dereg_of_unknown"] == 0
    # QP state machine: every QP went INIT, RTR, RTS; the pairs point at each other;
    # the one invalid transition is counted as an error
    states = v["qp_states"]
    assert set(states) == set(prov["qps"])
    assert all(s["transitions"] == ["init", "rtr", "rts"] for s in states.values())
    for qp, s in states.items():
        assert states[str(s["dest_qp_num"])]["dest_qp_num"] == int(qp)
    assert sum(s["errors"] for s in states.values()) == 1
    assert sum(len(s["transitions"]) + s["errors"] for s in states.values()) == lib["modify_qp"]
    # nothing lost or cut, and the counters are reported
    assert report["capture.verbs_full"] == 0 and report["capture.verbs_cut"] == 0
    assert report["capture.lost_gpu"] == 0 and report["capture.gpu_attach_errors"] == 0


def test_replay_of_the_capture_gives_the_same_summary(verbs_build, tmp_path):
    _, _, _, _, _, live = trace_workload(verbs_build, tmp_path, ["--steps", "40"])
    again = tmp_path / "again.json"
    r = subprocess.run([sys.executable, "-m", "tracer", "replay", str(tmp_path / "verbs.ttcap"),
                        "--quiet", "--summary", str(again)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(again.read_text())["gpu"] == live


def test_chains_longer_than_the_probe_reads_are_reported_not_hidden(verbs_build, tmp_path):
    """40 sends of 2 sges need 120 reads, the probe makes 64: the post and the
    completions are still counted, the cut chains and their short bytes are reported."""
    proc, _, prov, report, _, _ = trace_workload(
        verbs_build, tmp_path, ["--steps", "20", "--batch", "40", "--error-every", "0"])
    v = proc["ibverbs"]
    assert v["post_send_calls"] == prov["post_send_calls"]
    assert v["completions"] == prov["completions"]
    assert v["chains_cut"] == 2 * 20  # every send chain and every receive chain
    assert report["capture.verbs_cut"] == v["chains_cut"]
    assert v["posted"]["send"]["wrs"] < prov["send_wrs"]["send"]


REAL = Path("/usr/lib/x86_64-linux-gnu/libibverbs.so.1")


def test_the_real_libibverbs_is_probed_at_its_default_symbol_versions(verbs_build):
    """Debian's libibverbs (installed with libibverbs-dev, which the stand-ins need)
    exports IBVERBS_1.0 compat duplicates: the probes go to the @@ default versions
    that nm names, every probe attaches, and ibv_reg_mr is left to ibv_reg_mr_iova2."""
    from tracer.probes import loader
    from tracer.probes.gpu import VERBS_PROBES, GpuProbes, exported_functions

    nm = subprocess.run(["nm", "-D", "--defined-only", str(REAL)], capture_output=True,
                        text=True, check=True).stdout
    default = {}
    for line in nm.splitlines():
        addr, _, name = line.split()
        if "@@" in name:
            default[name.split("@@")[0]] = int(addr, 16)
    found = exported_functions(str(REAL))
    for sym in ("ibv_open_device", "ibv_reg_mr", "ibv_dereg_mr", "ibv_modify_qp"):
        assert found[sym] == default[sym], sym
    bpf = loader.compile_program(("cuda", "ibverbs"))
    try:
        probes = GpuProbes(bpf)
        lib = probes._attach_file("ibverbs", str(REAL), VERBS_PROBES)
        assert not probes.errors
        assert set(lib.symbols) == {p.symbol for p in VERBS_PROBES} - {"ibv_reg_mr"}
    finally:
        bpf.cleanup()
