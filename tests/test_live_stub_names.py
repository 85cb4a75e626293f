"""Kernel names for handles resolved before the tracer attached, from the CUDA
runtime's host stubs, on a real process with real uprobes: samples/gpu/stub_workload.c
registers and resolves every kernel (lazy loading, at a first launch) before the tracer
attaches, then launches through the stand-in libcudart.so.12's cudaLaunchKernel*
variants into the stand-in libcuda.so.1. Its own stubs are named from its .symtab, the
stripped libttkernels.so's by its registration code (even the one with no symbol); a name the driver's probe saw wins; a runtime call that failed before the
driver names nothing; the runtime probes go once naming is quiet, and every launch is
counted exactly once throughout. Handles launched with no name (the Triton-like driver
launch; a kernel first launched once naming had closed) are handed back to naming and
named from their driver objects, confirmed by the workload's own strings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from samples.gpu.build import build_stubs
from tracer.correlate.connections import TrackerOptions
from tracer.events import wire
from tracer.probes.session import CaptureConfig
from tracer.runner import TraceRun

C = wire.CONSTANTS
STEPS = 40
QUIET_S = 1.0
STUB_SITES = 6  # cudaLaunchKernel, _ptsz, Cooperative, _ptsz, ExC, _ptsz


@pytest.fixture(scope="module")
def stub_build(tmp_path_factory):
    return build_stubs(tmp_path_factory.mktemp("stubs"))


class Workload:
    """samples/gpu/stub_workload: one command, one JSON line."""

    def __init__(self, paths, tmp: Path) -> None:
        env = dict(os.environ, TT_STANDIN_COUNTS=str(tmp / "cuda.json"),
                   TT_STANDIN_CUDART_COUNTS=str(tmp / "cudart.json"),
                   TT_STANDIN_KERNEL_NS="2000", CUDA_MODULE_LOADING="LAZY")
        self.p = subprocess.Popen([str(paths["stub_workload"])], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        self.ready = json.loads(self.p.stdout.readline())
        assert self.ready["ready"]
        self.launches: Counter[str] = Counter()

    def ask(self, cmd: str) -> dict[str, int]:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        got = json.loads(self.p.stdout.readline())["launches"]
        self.launches.update(got)
        return got

    def quit(self) -> None:
        self.p.stdin.write("quit\n")
        self.p.stdin.close()
        assert self.p.wait(30) == 0


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_kernels_resolved_before_attach_are_named_by_their_host_stubs(stub_build, tmp_path):
    w = Workload(stub_build, tmp_path)
    cap = tmp_path / "stubs.ttcap"
    run = TraceRun(CaptureConfig(pids=[w.p.pid], stub_names_quiet_s=QUIET_S,
                                 stub_names_max_s=30.0),
                   [], TrackerOptions(), record=str(cap))
    run.start()
    stubs = run.session.gpu.stubs
    try:
        # attached with libcudart found, although the process is idle
        assert stubs.open and len(stubs.attached) == STUB_SITES, stubs.state()
        uprobes_open = run.session.gpu.uprobes.sites_attached()
        w.ask(f"run {STEPS}")
        # 8 stubs named: the program's 4 by their symbols (registered in a loop, so its
        # registration code holds no constants), the stripped library's 4 (the hidden
        # one has no symbol at all) by their registration code
        _wait(lambda: stubs.named + sum(stubs.unresolved.values()) >= 8,
              f"stubs not resolved: {stubs.state()}")
        assert stubs.named == 8 and not stubs.unresolved, stubs.state()
        assert stubs.open  # a few ms of launches: not quiet yet
        # launches of known kernels only: quiet after QUIET_S of them
        w.ask("spin 3")
        # closed ~QUIET_S into the spin; detaching takes up to ~0.1 s per probe here
        _wait(lambda: not stubs.open, f"naming still open: {stubs.state()}")
        assert stubs.state()["busy_s"] < 3
        assert "no new host stub" in stubs.closed_why and not stubs.attached
        stubs.join_detach()  # the detach runs on its own thread
        assert run.session.gpu.uprobes.sites_attached() == uprobes_open - STUB_SITES
        # nothing a runtime call left half-way stays behind to be paired on reopening
        assert len(run.session.bpf[b"stub_pending"]) == 0
        # warmed up before attach, launched first now: the probes are gone; its handle,
        # seen launched with no name, is handed back to naming within 2 s
        w.ask("after 30")
        time.sleep(2.5)
        w.quit()
    finally:
        report = run.stop()
    assert run.error is None

    (proc,) = run.pipeline.gpu.summary()["processes"]
    launches = w.launches
    truth = json.loads((tmp_path / "cuda.json").read_text())
    runtime = json.loads((tmp_path / "cudart.json").read_text())
    # every launch counted once: the runtime probes count nothing
    assert proc["kernel_launches"] == sum(launches.values())
    assert proc["kernel_launches"] == truth["launches"] - w.ready["warmup_launches"]
    assert runtime["runtime_failed"] == STEPS + 0  # the unregistered address, per step
    top = Counter()
    unknown = []
    for k in proc["top_kernels"]:
        if k["name"].startswith("unknown@"):
            unknown.append(k["launches"])
        else:
            top[k["name"]] += k["launches"]
    named = {n: c for n, c in launches.items() if not n.startswith("unknown:") and c}
    named["_Z13hidden_kernelPf"] = named.get("_Z13hidden_kernelPf", 0) + launches["unknown:hidden"]
    # the Triton-like kernel: named from its driver object once handed back unnamed,
    # confirmed by the string the workload looked it up with (no cubin holds it)
    named["triton_poi_fused_0"] = launches["unknown:triton"]
    # exe_kern4, first launched once naming had closed: named from its driver object
    # once handed back unnamed (CUDA 12 stubs keep no handle variable to read again)
    named["_Z12tt_exe_kern4Pf"] = launches["unknown:exe_kern4"]
    assert dict(top) == named and not unknown
    # the driver saw _Z12tt_late_livePf resolved: its stub's own symbol never shows
    assert "_Z12tt_late_stubPf" not in top and top["_Z12tt_late_livePf"] == STEPS
    host = ("_Z12tt_exe_kern0Pf", "_Z12tt_exe_kern1Pf", "_Z12tt_exe_kern2Pf",
            "_Z12tt_exe_kern3Pf")
    registered = ("_Z13tt_so_kernel0Pf", "_Z13tt_so_kernel1Pf", "_Z13tt_so_kernel2Pf",
                  "_Z13hidden_kernelPf")
    kn = proc["kernel_names"]
    assert kn["host_stub"] == {"handles": 4, "launches": sum(launches[n] for n in host)}
    assert kn["registered_stub"] == {"handles": 4, "launches": 4 * STEPS}
    assert kn["live"] == {"handles": 1, "launches": STEPS}
    # the two named from driver objects: the stand-in has no cubins, so their names are
    # confirmed by strings of the workload (the names it registered or looked up)
    assert kn["unknown"]["handles"] == 0 and kn["host_stubs_seen"] == 8
    assert kn["driver_string"] == {"handles": 2, "launches": launches["unknown:triton"]
                                   + launches["unknown:exe_kern4"]}
    ledger = run.pipeline.gpu.processes[w.p.pid]
    assert {ledger.names[h]: s for h, s in ledger.name_sources.items()} == {
        **{n: C["NAME_HOST_STUB"] for n in host},
        **{n: C["NAME_REGISTERED_STUB"] for n in registered},
        "_Z12tt_late_livePf": C["NAME_MODULE_GET_FUNCTION"],
        "triton_poi_fused_0": C["NAME_DRIVER_STRING"],
        "_Z12tt_exe_kern4Pf": C["NAME_DRIVER_STRING"]}
    # the failed runtime call's stub was not given to the Triton-like launch after it
    assert report["capture.stub_stale"] == STEPS
    assert report["capture.stub_unresolved"] == 0
    assert report["capture.stubs_full"] == 0 and report["capture.lost_gpu"] == 0
    assert report["capture.gpu_attach_errors"] == 0

    # the capture replays to the same summary, names included
    again = tmp_path / "again.json"
    r = subprocess.run([sys.executable, "-m", "tracer", "replay", str(cap), "--quiet",
                        "--summary", str(again)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(again.read_text())["gpu"] == run.pipeline.gpu.summary()


def test_stub_naming_off_leaves_them_unknown_and_attaches_nothing(stub_build, tmp_path):
    """stub_names_quiet_s=0: the runtime's launch probes are never attached."""
    w = Workload(stub_build, tmp_path)
    run = TraceRun(CaptureConfig(pids=[w.p.pid], stub_names_quiet_s=0), [], TrackerOptions())
    run.start()
    try:
        stubs = run.session.gpu.stubs
        assert not stubs.open and not stubs.attached and stubs.sites
        w.ask("run 5")
        time.sleep(0.3)
        w.quit()
    finally:
        run.stop()
    (proc,) = run.pipeline.gpu.summary()["processes"]
    assert proc["kernel_launches"] == sum(w.launches.values())
    kn = proc["kernel_names"]
    assert kn["host_stub"]["handles"] == 0 and kn["live"]["handles"] == 1
    assert kn["unknown"]["handles"] == 9
