"""GPU attribution on a real process: a synchronous server calls the stand-in
libcuda.so.1 for each request (launches, then a stream sync), real uprobes and socket
probes trace it, and every span must carry exactly the launches the server made for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from samples.gpu.build import build
from tests.live import spans_by_response_id, traced

KERNELS = 3
MAX_TOKENS = [1, 2, 3, 5, 8, 13, 4, 7, 11, 6, 1, 9, 16, 2, 10, 3, 12, 5, 20, 7]


@pytest.fixture()
def server(tmp_path: Path):
    paths = build(tmp_path / "gpu")
    truth = tmp_path / "truth.json"
    env = dict(os.environ, TT_LIBCUDA=str(paths["libcuda"]), TT_SYNC_TRUTH=str(truth),
               TT_SYNC_KERNELS=str(KERNELS), TT_STANDIN_KERNEL_NS="20000")
    p = subprocess.Popen([sys.executable, "-m", "samples.gpu_sync_server"],
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline().split()
        assert line[:1] == ["ready"], line
        yield p, int(line[1]), truth
    finally:
        p.terminate()
        p.wait(10)


def complete(port: int, max_tokens: int) -> dict:
    body = json.dumps({"model": "tiny-gpt", "prompt": "hello there",
                       "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_every_span_carries_exactly_its_own_launches(server):
    p, port, truth_path = server
    with traced(pids=[p.pid]) as got:
        answers = [complete(port, n) for n in MAX_TOKENS]
    truth = json.loads(truth_path.read_text())
    assert [truth[a["id"]]["steps"] for a in answers] == MAX_TOKENS
    spans = {rid: s["attributes"] for rid, s in spans_by_response_id(got.spans).items()}
    assert set(spans) == set(truth)
    for rid, a in spans.items():
        assert a["tokentrace.gpu.kernel_launches"] == truth[rid]["launches"], rid
        assert isinstance(a["tokentrace.gpu.kernel_launches"], int)
        assert a["tokentrace.gpu.attribution"] == "same_thread"
        assert a["tokentrace.gpu.graph_launches"] == 0
        # one burst per decode step, each cut by its stream sync
        assert a["tokentrace.gpu.bursts"] == truth[rid]["steps"]
        # the stand-in sleeps 20 us per launch at each sync: the wait is charged here
        assert a["tokentrace.gpu.sync_wait_ms"] >= truth[rid]["launches"] * 0.020 * 0.9
    assert sum(truth[r]["launches"] for r in truth) == KERNELS * sum(MAX_TOKENS)
    assert got.report.get("gpu_steps_unattributed", 0) == 0
    assert got.report.get("gpu_bursts_late", 0) == 0


def test_an_idle_server_still_gets_its_last_span_out(server):
    """After the last request nothing more happens on any socket; the tracer's own
    periodic counter report moves the stream's clock, so the held span is released
    within a couple of seconds instead of waiting for the next request or for exit."""
    import time
    p, port, _ = server
    with traced(pids=[p.pid]) as got:
        answer = complete(port, 3)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not got.records:
            time.sleep(0.1)
        released_while_running = [r for r in got.records
                                  if r.llm_response and r.llm_response.response_id == answer["id"]]
    assert released_while_running, "the span waited for the tracer to stop"
    assert released_while_running[0].gpu["gpu.kernel_launches"] == 3 * KERNELS
