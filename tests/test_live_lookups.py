"""The probes on cuKernelGetFunction are a window (tracer/probes/lookups.py), on real
processes with real uprobes: samples/gpu/workload looks kernel 1's launch handle up
through the stand-in libcuda.so.1's cuKernelGetFunction before every launch, as
cuBLASLt does. Once look-ups go on with nothing new the probes are detached (the
stand-in counts more look-ups than the probes saw), every launch stays counted and
named, and the window opens again for a new process and for a launched handle with no
name, whose alias the next look-up then tells."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from samples.gpu.build import build
from tracer.correlate.connections import TrackerOptions
from tracer.probes.session import CaptureConfig
from tracer.runner import TraceRun

QUIET_S = 0.5
KERNELS = 4
NAMES = {f"_Z11tt_kernel_{k:02d}PfS_i" for k in range(KERNELS)}


@pytest.fixture(scope="module")
def gpu_build(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gpu"))


class Workload:
    """samples/gpu/workload --wait: started, then let go."""

    def __init__(self, paths, counts: Path, steps: int) -> None:
        # 0.1 ms per launch: a step takes ~0.5 ms, so the run outlasts the quiet time
        env = dict(os.environ, TT_STANDIN_COUNTS=str(counts), TT_STANDIN_KERNEL_NS="100000")
        self.counts = counts
        self.p = subprocess.Popen([str(paths["workload"]), "--wait", "--steps", str(steps),
                                   "--kernels", str(KERNELS)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        assert self.p.stdout.readline().strip() == "ready"

    def go(self) -> None:
        self.p.stdin.write("go\n")
        self.p.stdin.flush()

    def finish(self) -> dict[str, int]:
        assert self.p.stdout.readline().strip() == "done"
        assert self.p.wait(30) == 0
        return json.loads(self.counts.read_text())


def _wait(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _alias_lookups_seen(run: TraceRun) -> int:
    """cuKernelGetFunction calls the probes saw (the kernel's name_calls counts the
    look-ups by name too: one per kernel per process)."""
    return int(sum(run.session.bpf[b"name_calls"][ctypes.c_int(0)]))


def test_alias_lookups_go_quiet_and_come_back_when_needed(gpu_build, tmp_path):
    w1 = Workload(gpu_build, tmp_path / "w1.json", steps=5000)
    run = TraceRun(CaptureConfig(comms=["workload"], rescan_interval_s=0.2,
                                 alias_lookups_quiet_s=QUIET_S), [], TrackerOptions())
    run.start()
    lookups = run.session.gpu.lookups
    w2 = w3 = None
    try:
        _wait(lambda: lookups.open, f"not attached: {lookups.state()}")
        w1.go()
        # look-ups of one alias over and over: detached QUIET_S into them
        _wait(lambda: not lookups.open, f"still open: {lookups.state()}")
        state = lookups.state()
        assert "no new handle" in state["closed_why"] and state["attached"] == 0, state
        truth1 = w1.finish()
        seen1 = _alias_lookups_seen(run)
        # 1 + 5000 look-ups of the alias, 4 by name; the probes saw a fraction
        assert truth1["alias_lookups"] == 1 + 5000
        assert KERNELS < seen1 < 0.8 * truth1["alias_lookups"], (seen1, truth1)

        # a new process: the window opens for it, and its alias is told live
        w2 = Workload(gpu_build, tmp_path / "w2.json", steps=200)
        _wait(lambda: lookups.opened["a new process with libcuda"] >= 1,
              f"not opened for the new process: {lookups.state()}")
        w2.go()
        truth2 = w2.finish()

        # a process whose alias is looked up while the window is closed: the handle
        # launched with no name opens it again, and the next look-up names it
        assert run.control("alias-lookups off") == "ok alias-lookups off"
        w3 = Workload(gpu_build, tmp_path / "w3.json", steps=8000)
        # its libraries scanned (after w1, the process the probes were found through,
        # exited: they attach through w2 or w3), then the window closed again
        _wait(lambda: lookups.opened["a new process with libcuda"] >= 2,
              f"not opened for the third process: {lookups.state()}")
        assert run.control("alias-lookups off") == "ok alias-lookups off"
        assert not lookups.open
        w3.go()
        _wait(lambda: lookups.opened["a handle launched with no name"] >= 1,
              f"not opened for the unnamed handle: {lookups.state()}")
        truth3 = w3.finish()
    finally:
        for w in (w1, w2, w3):
            if w is not None and w.p.poll() is None:
                w.p.kill()
        run.stop()
    procs = {p["pid"]: p for p in run.pipeline.gpu.summary()["processes"]}
    for w, truth in ((w1, truth1), (w2, truth2), (w3, truth3)):
        proc = procs[w.p.pid]
        assert proc["kernel_launches"] == truth["launches"]
        top = {k["name"]: k["launches"] for k in proc["top_kernels"]}
        assert set(top) == NAMES, top  # every launch named, the alias's included
        assert sum(top.values()) == truth["launches"]
    # w3's alias was named by the driver's look-up, live, after the window reopened
    kn = procs[w3.p.pid]["kernel_names"]
    assert kn["live"]["handles"] == KERNELS and kn["unknown"]["handles"] == 0, kn
    assert not any("cuKernelGetFunction" in k for k in run.session.gpu.errors), \
        run.session.gpu.errors
