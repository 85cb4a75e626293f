"""A kernel first launched after attach, once naming had closed, is still named: real
probes on a real process. The process (the CUDA 13-style stand-ins of
samples/gpu/build.py: a stripped library whose host stubs keep their handles in
statics, launching through the stand-in libcuda.so.1) warms up three kernels before the
tracer attaches; they are named at attach from their handle variables. Then it launches
a kernel for the first time: its burst carries a handle with no name, the agent hands
it to the pre-attach naming, which reads the handle variables again and names it
(stub_slot). A registered name no cubin confirms is not given from its variable; its
driver object's name, confirmed by a string of the library, is (driver_string)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from samples.gpu.build import build, build_k13
from tracer.correlate.connections import TrackerOptions
from tracer.events import wire
from tracer.probes.session import CaptureConfig
from tracer.runner import TraceRun

pytestmark = pytest.mark.bpf
C = wire.CONSTANTS

CHILD = """
import ctypes, json, sys
cuda = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
rt = ctypes.CDLL(sys.argv[2], mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL(sys.argv[3])
rt.tt_handle_named.restype = ctypes.c_void_p
def launch(kernels):
    for k in kernels:
        for _ in range(5):
            getattr(lib, k)()
    cuda.cuCtxSynchronize()
launch(["k13_a", "k13_b", "k13_d"])  # warmed up before the tracer attaches
print(json.dumps({n: rt.tt_handle_named(n.encode()) for n in ("_Z5k13_av", "_Z5k13_bv", "_Z5k13_dv")}), flush=True)
for line in sys.stdin:
    ks = line.split()
    launch(ks)
    names = {"k13_c": "_Z5k13_cv", "k13_ghost": "_Z9k13_ghostv"}
    print(json.dumps({names[k]: rt.tt_handle_named(names[k].encode()) for k in ks if k in names}), flush=True)
"""


def test_a_kernel_first_launched_after_naming_closed_is_named_from_its_variable(tmp_path):
    gpu = build(tmp_path / "gpu")
    k13 = build_k13(tmp_path / "k13")
    env = dict(os.environ, TT_STANDIN_COUNTS=str(tmp_path / "cuda.json"))
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(gpu["libcuda"]),
                          str(k13["libttk13rt"]), str(k13["libttk13"])],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        handles = json.loads(p.stdout.readline())
        run = TraceRun(CaptureConfig(pids=[p.pid], stub_names_quiet_s=0.3), [],
                       TrackerOptions(), record=str(tmp_path / "cap.ttcap"))
        run.start()
        ledger = run.pipeline.gpu

        def names() -> dict[int, tuple[str, int]]:
            proc = ledger.processes.get(p.pid)
            return {} if proc is None else {h: (n, proc.name_sources[h])
                                            for h, n in proc.names.items()}

        deadline = time.monotonic() + 20
        while len(names()) < 3:  # the warmed-up kernels, from their variables at attach
            assert time.monotonic() < deadline, names()
            time.sleep(0.05)
        assert names() == {h: (n, C["NAME_STUB_SLOT"]) for n, h in handles.items()}
        time.sleep(1.0)  # any naming window is long closed
        p.stdin.write("k13_c k13_ghost k13_a\n")
        p.stdin.flush()
        new = json.loads(p.stdout.readline())
        deadline = time.monotonic() + 20
        while new["_Z5k13_cv"] not in names():
            assert time.monotonic() < deadline, names()
            time.sleep(0.05)
        time.sleep(2.5)  # a second look finds nothing more to name
        summary = run.stop()
    finally:
        p.stdin.close()
        p.wait(10)
    got = names()
    assert got[new["_Z5k13_cv"]] == ("_Z5k13_cv", C["NAME_STUB_SLOT"])
    # registered, but in no cubin of the library: never given from its handle variable;
    # its driver object's name is confirmed by a string of the library only (weaker
    # evidence, its own source)
    assert got[new["_Z9k13_ghostv"]] == ("_Z9k13_ghostv", C["NAME_DRIVER_STRING"])
    proc = ledger.processes[p.pid]
    launches = sum(t.kernel_launches for t in proc.threads.values())
    assert launches == 15  # every launch after attach counted, named or not
    pre = run.session.gpu.prenames.state()
    assert pre["counts"]["stub_slot: rereads"] >= 1
    assert pre["counts"]["stub_slot: named by a reread"] == 1
    assert summary.get("capture.lost_gpu", 0) == 0
    # the names are in the capture: a replay names the same handles
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "tracer", "replay", str(tmp_path / "cap.ttcap"),
                        "--quiet", "--summary", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (rp,) = json.loads(out.read_text())["gpu"]["processes"]
    assert rp["kernel_names"]["stub_slot"] == {"handles": 2, "launches": 10}  # c and a
    assert rp["kernel_names"]["driver_string"] == {"handles": 1, "launches": 5}  # the ghost
    assert rp["kernel_names"]["unknown"] == {"handles": 0, "launches": 0}
