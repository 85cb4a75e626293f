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
    assert proc["top_kernels"][:15] == live["top_kernels"]
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
