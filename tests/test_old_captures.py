"""Captures written by older tokentrace versions replay with today's code.

Each wire version added record kinds without changing an earlier layout, so a capture
of any readable version must still decode and give the analysis it gave when it was
recorded. The v1 (HTTP/1 OpenAI, gRPC KServe) and v2 (PyTorch on an H200) captures
are replayed by their own tests; these are v3 captures recorded by the v3 code itself
(samples/captures/wire3/record_wire3.py) from the GPU and ibverbs stand-ins, with the
summary that code computed live. Today's replay must give the same counts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import CAPTURES
from tracer.events import capture, wire

WIRE3 = CAPTURES / "wire3"

# Quantities counted from records (not derived from timing or names), compared exactly.
GPU_KEYS = ("kernel_launches", "graph_launches", "bursts", "memcpy_bytes", "memcpy_calls",
            "memset_bytes", "memset_calls", "nccl_bytes", "nccl_ops", "sync_calls",
            "device_memory", "nccl_communicators")
VERBS_KEYS = ("posted", "post_send_calls", "post_recv_calls", "completions",
              "completion_errors", "completion_bytes", "polls", "empty_polls", "qps",
              "registered_memory", "qp_states")


def replay(path, tmp_path) -> dict:
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, "-m", "tracer", "replay", str(path), "--quiet",
                        "--summary", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ["gpu-standin", "verbs-standin"])
def test_wire3_capture_is_what_the_v3_code_wrote(name):
    reader = capture.CaptureReader(WIRE3 / f"{name}.ttcap")
    assert reader.header["wire_version"] == 3 < wire.WIRE_VERSION
    kinds = {int.from_bytes(item[:4], "little") for item in reader if isinstance(item, bytes)}
    assert not reader.truncated and reader.corrupt is None
    assert wire.CONSTANTS["KIND_KSTUB"] not in kinds  # a v4 kind cannot be in a v3 file
    if name == "gpu-standin":
        assert wire.CONSTANTS["KIND_KCOUNT"] in kinds  # 20 kernels per step > 16 slots


def test_wire3_gpu_capture_replays_to_the_live_v3_summary(tmp_path):
    (old,) = json.loads((WIRE3 / "gpu-standin.summary.json").read_text())["processes"]
    (new,) = replay(WIRE3 / "gpu-standin.ttcap", tmp_path)["gpu"]["processes"]
    for key in GPU_KEYS:
        assert new[key] == old[key], key
    # the stand-in's own truth: 2 threads x 40 steps x 20 kernels, a graph every 5th step
    assert new["kernel_launches"] == 2 * 40 * 20
    assert new["graph_launches"] == 2 * 40 // 5
    assert sorted(t["kernel_launches"] for t in new["threads"].values()) == [800, 800]
    names = {k["name"] for k in new["top_kernels"]}
    assert names == {k["name"] for k in old["top_kernels"]}
    assert len(names) == 20


def test_wire3_verbs_capture_replays_to_the_live_v3_summary(tmp_path):
    (old,) = json.loads((WIRE3 / "verbs-standin.summary.json").read_text())["processes"]
    (new,) = replay(WIRE3 / "verbs-standin.ttcap", tmp_path)["gpu"]["processes"]
    for key in VERBS_KEYS:
        assert new["ibverbs"][key] == old["ibverbs"][key], key
    assert new["ibverbs"]["posted"]["send"]["wrs"] > 0
