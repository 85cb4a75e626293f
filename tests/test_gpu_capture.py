"""Replay of a capture recorded on a real GPU (NVIDIA H200, driver 580, PyTorch 2.11 +
CUDA 13) by bench/gpu_validate.py: the analysis here, with no BPF and no GPU, must give
what the live tracer computed there, and the recorded validation must show the live
counts agreeing with PyTorch's profiler (CUPTI)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import CAPTURES

CAP = CAPTURES / "torch-h200.ttcap"
VALIDATION = json.loads((CAPTURES / "torch-h200.validation.json").read_text())


def test_replay_gives_the_live_summary(tmp_path):
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, "-m", "tracer", "replay", str(CAP), "--quiet",
                        "--summary", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (proc,) = json.loads(out.read_text())["gpu"]["processes"]
    (live,) = VALIDATION["torch"]["summary_after_capture"]
    for key in ("kernel_launches", "graph_launches", "memcpy_bytes", "memcpy_calls",
                "sync_calls", "bursts", "device_memory"):
        assert proc[key] == live[key], key
    got = [{"name": k["name"], "launches": k["launches"]} for k in proc["top_kernels"][:15]]
    assert got == live["top_kernels"]
    assert all(k["readable"] and len(k["readable"]) <= 80 for k in proc["top_kernels"])
    # real kernel names came through: PyTorch's, cuBLAS's and the Triton kernel
    names = " ".join(k["name"] for k in proc["top_kernels"])
    assert "triton_" in names and "_ZN2at6native" in names


def test_recorded_validation_agrees_with_the_profiler():
    t = VALIDATION["torch"]
    eager, graph = t["eager"], t["graph"]
    assert eager["tracer"]["launches"] == eager["profiler"]["profiler_gpu_kernels"]
    assert eager["tracer"]["launches"] == sum(eager["profiler"]["profiler_api_calls"].values())
    assert eager["tracer"]["named"] == eager["tracer"]["launches"]
    assert graph["tracer"]["graph_launches"] == graph["profiler"]["profiler_api_calls"]["cudaGraphLaunch"]
    assert t["drops"]["lost_gpu"] == 0
    nccl = VALIDATION["nccl"]
    for rank in nccl["ranks"]:
        n, b = rank["nccl"]["allreduce"]
        assert n == nccl["truth"]["allreduce_per_rank"]
        assert b == n * nccl["truth"]["bytes_per_allreduce"]
    assert {r["communicators"][0]["rank"] for r in nccl["ranks"]} == {0, 1}


def test_console_gpu_rows_show_the_totals_and_rates_of_the_replayed_capture():
    """The console's GPU rows over the real H200 capture: a row when totals changed,
    none when they did not, totals equal to the ledger's, the rate since the last row."""
    import io

    from tracer.correlate.gpu import GpuLedger
    from tracer.events import capture, schema
    from tracer.events.gpu import GpuEvent
    from tracer.export.console import ConsoleTable, _n
    from tracer.export.context import ExportContext

    items = [i if not isinstance(i, (bytes, bytearray)) else schema.decode(bytes(i))
             for i in capture.CaptureReader(CAP)]
    gpu = [e for e in items if isinstance(e, GpuEvent)]
    out = io.StringIO()
    console = ConsoleTable(ExportContext(), out)
    console.gpu = ledger = GpuLedger()
    half = len(gpu) // 2
    for e in gpu[:half]:
        ledger.handle(e)
    console.gpu_tick(now=100.0)
    first = ledger.processes[gpu[0].pid]
    seen_first = sum(t.kernel_launches for t in first.threads.values())
    console.gpu_tick(now=101.0)  # too soon: nothing printed
    for e in gpu[half:]:
        ledger.handle(e)
    console.gpu_tick(now=110.0)
    console.gpu_tick(now=120.0)  # nothing changed: no row
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:4] == ["GPU", "PID", "LAUNCH/s", "LAUNCHES"]
    rows = [ln.split() for ln in lines[1:]]
    assert len(rows) == 2 and {r[1] for r in rows} == {str(gpu[0].pid)}
    total = sum(t.kernel_launches for t in first.threads.values())
    assert rows[0][3] == _n(seen_first) and rows[1][3] == _n(total)
    assert rows[0][2] == "-" and rows[1][2] == _n((total - seen_first) / 10.0)
    # the last column: the share of launches named (every kernel of the H200 run was)
    assert lines[0].split()[-1] == "NAMED" and rows[1][-1] == "100%"
