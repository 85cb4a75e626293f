"""Continuous batching traced from the outside, scored against the server's own truth.

Each layout of ``samples.batching.server`` (engine thread; engine process over a unix
socket; two tensor-parallel rank processes with an all-reduce per step) runs on the
stand-in libcuda/libnccl under real probes while the openai client sends streamed and
whole requests at concurrency 8. The engine writes which requests were in each step;
the tracer, which sees only syscalls and driver calls, must charge each request
nearly the launches the truth gives it (``bench/accuracy.py`` does the scoring).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.accuracy import run_case
from samples.gpu.build import build
from tracer.correlate.cost import GpuPricing

# measured at concurrency 8 (bench/results/accuracy.json): 1-4% with 64 requests, 1.5-2%
# with 48 on an idle VM; 48 requests dilute the cold start (8 arrivals at once, seen by
# the tracer before the engine process has them) that a loaded 2-vCPU machine stretches
MAX_SHARE_ERROR = {"thread": 0.05, "process": 0.05, "tp2": 0.08}


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gpu"))


@pytest.mark.parametrize("layout", ["thread", "process", "tp2"])
def test_requests_are_charged_their_share_of_the_steps_they_were_in(layout, libs, tmp_path):
    # 192 requests: the first few, which arrive at once, and the last few, in a
    # batch that empties, are placed a step off more often than the rest. And in the
    # process layouts a request's hand-off to the engine process can lag its arrival
    # by ~10 ms: until the engine's prefill chunk is learned, its prefill is placed
    # from the first step after the arrival, a few steps early (one such request took
    # 16 launches from its neighbour). On the process layout, 96 requests scored
    # 0.006-0.051 in ten quiet runs and 0.0527 in a CI run; 192 requests 0.019-0.028
    # in six, and 0.004-0.0115 in four once the learned chunk capped each prefill.
    r = run_case(layout, concurrency=8, requests=192, device="cpu", libs=libs,
                 work=tmp_path, max_batch=16)
    t = r["tracer"]
    assert r["requests_traced"] == r["requests_truth"] == 192
    assert r["kernel_share"]["n"] == 192
    assert r["kernel_share"]["mae_over_mean"] <= MAX_SHARE_ERROR[layout], r
    # nothing lost, and (almost) every launch charged to someone
    assert all(v == 0 for k, v in t.items() if k.startswith("capture.lost"))
    # every launch in a step is charged (no idle steps were traced) and the books balance
    assert t["gpu_step_launches_charged"] == pytest.approx(t["gpu_step_launches"], rel=0.01)
    assert t.get("gpu_step_ranges_tokens", 0) > 0
    if layout != "thread":
        assert t.get("ipc_links", 0) >= (2 if layout == "tp2" else 1)
    if layout == "tp2":
        assert t.get("gpu_steps_joined_nccl", 0) > 0 and t.get("gpu_steps_unjoined", 0) == 0


def test_spans_carry_phases_and_cost(libs, tmp_path: Path):
    pricing = GpuPricing.resolve(price=3.6, model="NVIDIA H100 80GB HBM3")
    r = run_case("thread", concurrency=4, requests=8, device="cpu", libs=libs,
                 work=tmp_path, max_batch=16, keep_spans=True, pricing=pricing)
    spans = r["spans"]
    requests = [s for s in spans if s["attributes"].get("gen_ai.response.id")]
    assert len(requests) == 8
    for s in requests:
        a = s["attributes"]
        assert a["tokentrace.gpu.attribution"] in ("step_model", "step_equal")
        assert a["tokentrace.gpu.time_method"] == "step_span" and a["tokentrace.gpu.time_ms"] > 0
        assert a["tokentrace.gpu.prefill_launches"] + a["tokentrace.gpu.decode_launches"] == \
            pytest.approx(a["tokentrace.gpu.kernel_launches"], abs=0.01)
        # 3.6 USD per GPU-hour is 1e-6 USD per GPU-millisecond
        assert a["tokentrace.cost.usd"] == pytest.approx(a["tokentrace.gpu.time_ms"] * 1e-6,
                                                         rel=1e-3, abs=1e-9)
        assert a["tokentrace.gpu.model"] == "NVIDIA H100 80GB HBM3"
        kids = {c["name"]: c for c in spans if c.get("parent_span_id") == s["span_id"]}
        assert "prefill" in kids, a
        assert kids["prefill"]["attributes"]["tokentrace.phase"] == "prefill"


def test_sampled_launch_probes_keep_each_requests_share_close(libs, tmp_path):
    """--gpu-sample 0.3: the launch probes are attached 30% of each half second, the
    steps they did not see whole are estimated from the thread's steps they did (of
    the same shape, and of those the one whose copies moved the nearest bytes), and
    each request's launches stay close to the engine's truth. The stand-in's launches
    grow with a batch's members, its copies' calls do not but their bytes do: the mean
    error over the mean was 0.025-0.072 in nine runs, totals within 4.1% (by shape
    alone: 0.11-0.18, totals up to 10.7% over, and 13% in a CI run); 0.011 with every
    launch counted; charged only what the probes saw, requests got ~30%. 192 requests
    (~10 s, 20 periods): the error is mostly which steps a period's window saw whole
    (the stand-in's prefills change its launches more than its copies' bytes tell), so
    it shrinks with the periods: 96 requests scored 0.032-0.109 in nine runs and 0.125
    in a CI run, 192 scored 0.035-0.067 in six, totals within 3.2%."""
    r = run_case("thread", concurrency=8, requests=192, device="cpu", libs=libs,
                 work=tmp_path, max_batch=16, gpu_sample=0.3, gpu_sample_period_s=0.5)
    t = r["tracer"]
    assert r["requests_traced"] == r["requests_truth"] == 192
    assert r["kernel_share"]["mae_over_mean"] <= 0.12, r
    assert r["launches_charged_matched"] == pytest.approx(r["launches_truth_matched"],
                                                          rel=0.1), r
    assert t["gpu_steps_estimated"] > t["gpu_steps_counted"] > 0
    assert t.get("gpu_steps_unestimated", 0) == 0
    assert t["gpu_step_launches_charged"] == pytest.approx(t["gpu_step_launches"], rel=0.01)
    assert all(v == 0 for k, v in t.items() if k.startswith("capture.lost"))
