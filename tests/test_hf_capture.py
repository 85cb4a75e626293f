"""HF ``transformers serve`` on an H100, a server nobody here wrote, replayed against
the truth recorded inside it (``samples/hf/truth``: the engine's own step membership,
launches from torch.profiler, CUDA-event time). No GPU and no BPF here: the capture is
what the live tracer recorded (``bench/accuracy.py --server hf-cb|hf-plain``).

- ``hf-cb-c32-h100``: ``--continuous-batching``, 384 requests at concurrency 32 from the
  openai client (3 in 4 streamed, max_tokens 24-150, prompts of 5-300 words).
- ``hf-plain-c4-h100``: sequential ``generate`` (three synchronisations per streamed
  token, two per whole-response token), 32 requests at concurrency 4.
- ``hf-cb-c32-h100-sampled``: ``--continuous-batching``, 768 requests at concurrency 32,
  the tracer at its default (``--gpu-sample auto`` switched after ~10 s to 0.03 of each
  1-s period, with the copies, syncs and memsets): most steps' launches and GPU time
  are estimates (``bench/accuracy.py --server hf-cb --concurrency 32 --requests 768
  --device cuda --gpu-sample auto --gpu-sample-period 1 --keep DIR``).
"""

from __future__ import annotations

import dataclasses
import gzip
from collections import Counter
from typing import Any

import pytest

from samples.scoring import replay, score
from tests.conftest import CAPTURES
from tracer.events import capture, schema
from tracer.events.gpu import GpuSampling, KernelBurst

# measured by this replay (README, "Per-request attribution accuracy"): 0.7-1.4%
MAX_SHARE_ERROR = 0.05


@pytest.mark.parametrize("name", ["hf-cb-c32-h100", "hf-plain-c4-h100",
                                  "hf-cb-c32-h100-sampled"])
def test_shares_match_the_servers_own_truth(name):
    with gzip.open(CAPTURES / f"{name}.truth.jsonl.gz", "rt") as f:
        truth = f.read().splitlines()
    spans, pipeline = replay(str(CAPTURES / f"{name}.ttcap"))
    r = score(truth, spans, pipeline.report())
    assert r["requests_traced"] == r["kernel_share"]["n"] >= 32
    assert r["kernel_share"]["mae_over_mean"] <= MAX_SHARE_ERROR, r
    assert r["gpu_time_share"]["mae_over_mean"] <= MAX_SHARE_ERROR, r
    # every launch the tracer saw in a step is charged to a request (no idle steps
    # were traced): charged / observed is 1, and the books balance
    assert r["charged_over_observed"] == pytest.approx(1.0, abs=0.01)
    assert pipeline.reconciliation()["balanced"]
    # the tracer's step launches are the profiler's, request by request in sum
    assert r["launches_charged_matched"] == pytest.approx(r["launches_truth_matched"],
                                                          rel=0.01)


def test_whole_responses_are_not_charged_for_their_lifetime():
    """The defect this capture was filed with: a non-streamed request was charged every
    step of its lifetime (2,766 launches each, against 179 for a streamed request of the
    same length). Whole responses are now aligned by their output tokens."""
    spans, _ = replay(str(CAPTURES / "hf-serve-cb-h100.ttcap"))
    per_token = {True: [], False: []}
    for s in spans:
        a = s["attributes"]
        if a.get("gen_ai.usage.output_tokens") and "tokentrace.gpu.kernel_launches" in a:
            per_token[bool(a.get("tokentrace.request.stream"))].append(
                a["tokentrace.gpu.kernel_launches"] / a["gen_ai.usage.output_tokens"])
    streamed = sum(per_token[True]) / len(per_token[True])
    whole = sum(per_token[False]) / len(per_token[False])
    # one stream was already under way at attach: its tokens came before the capture
    assert len(per_token[True]) == 287 and len(per_token[False]) == 96
    assert whole == pytest.approx(streamed, rel=0.15), (whole, streamed)


def test_an_engine_whose_first_steps_take_seconds_is_split_by_a_provisional_model():
    """``samples/batching`` with steps of 6 launches + 4 per member + 25 per prefilling
    member, 64 requests at concurrency 12 on the stand-in libcuda whose kernels take
    their modelled time (``bench/accuracy.py --layouts thread --concurrency 12
    --step-cost 6,4,25``): 12 prompts at once make the first steps ~2 s each, so the
    32 steps a full model needs take a minute. Steps that waited 10 s are split by a
    model fitted on the steps so far (equal shares charged a decoding member as much as
    a prefilling one: kernel share MAE/mean 0.053, p95 0.43)."""
    name = "batching-slow-steps-c12"
    with gzip.open(CAPTURES / f"{name}.truth.jsonl.gz", "rt") as f:
        truth = f.read().splitlines()
    spans, pipeline = replay(str(CAPTURES / f"{name}.ttcap"))
    report = pipeline.report()
    r = score(truth, spans, report)
    assert r["requests_traced"] == 64 and r["requests_with_wrong_step_count"] == 0
    assert report["gpu_steps_provisional_model"] > 0
    assert r["kernel_share"]["mae_over_mean"] <= 0.001, r["kernel_share"]
    # GPU time against the engine's step stamps: the 32-token chunks learned put a
    # prompt's tokens in the steps that prefilled them (spread evenly: 0.062)
    wall = score(truth, spans, time="wall")["gpu_time_share"]
    assert wall["mae_over_mean"] <= 0.03, wall
    assert not [s for s in spans
                if s["attributes"].get("tokentrace.gpu.attribution") == "step_equal"]
    assert pipeline.reconciliation()["balanced"]


def test_a_prefill_is_not_placed_in_the_steps_before_its_hand_off_reached_the_engine():
    """``samples/batching`` in the process layout (an API process hands each request to
    the engine process), 96 requests at concurrency 8 on the VM, live
    (``bench/accuracy.py``'s ``run_case("process", ...)`` with ``record``). One request
    reached the API process 14 ms before the engine admitted it, while four steps ran
    with one or two members: placed from free slots after its arrival, it was charged
    11 steps (7 in truth) and 16 launches of its neighbour's, and the run scored 0.0375.
    The engine prefills 32 tokens a step; once that chunk is learned, a prefill takes no
    more steps than its prompt's chunks (one more where its prompt is estimated)."""
    name = "batching-process-handoff-c8"
    with gzip.open(CAPTURES / f"{name}.truth.jsonl.gz", "rt") as f:
        truth = f.read().splitlines()
    spans, pipeline = replay(str(CAPTURES / f"{name}.ttcap"))
    r = score(truth, spans, pipeline.report())
    assert r["requests_traced"] == 96
    assert r["kernel_share"]["mae_over_mean"] <= 0.02, r["kernel_share"]  # was 0.0375
    assert r["requests_with_wrong_step_count"] <= 8, r  # was 17
    lagged = [s["attributes"] for s in spans if s["attributes"].get("gen_ai.response.id")
              == "chatcmpl-c3006b9046a1441eb91e98d6"]
    assert len(lagged) == 1 and lagged[0]["tokentrace.gpu.steps"] == 8  # 7 + 1: estimated
    assert r["charged_over_observed"] == pytest.approx(1.0, abs=0.01)
    assert pipeline.reconciliation()["balanced"]


TIMES = ("ts", "ts_enter", "ts_exit", "first_ts", "last_ts", "ref_ts")


def _stalled(items: list[Any], stalls: list[tuple[int, int]]) -> list[Any]:
    """``items`` as if the server had stopped for ``d`` ns at each ``(t, d)``: every
    time stamp after ``t`` moved ``d`` later."""
    def moved(v: Any) -> Any:
        if isinstance(v, tuple):
            return tuple(moved(x) for x in v)
        return v + sum(d for t, d in stalls if v > t)

    out = []
    for item in items:
        if hasattr(item, "_fields"):
            item = item._replace(**{f: moved(getattr(item, f)) for f in item._fields
                                    if f in TIMES and getattr(item, f)})
        elif dataclasses.is_dataclass(item):
            item = dataclasses.replace(item, **{
                f.name: moved(getattr(item, f.name)) for f in dataclasses.fields(item)
                if f.name in TIMES and isinstance(getattr(item, f.name), (int, tuple))
                and getattr(item, f.name)})
        out.append(item)
    return out


def test_stalls_before_steps_seen_whole_leave_the_sampled_gpu_time_close():
    """The engine stopping between steps (a stall, or no request) just before a step a
    window saw whole: that step is its shape's reference, and its gap from the previous
    step's end was the stall. Taken as the gap, the steps of its shape that followed
    were given starts at their ends (GPU time ~0) until a window saw another: five
    300-ms stalls put into the live sampled capture made its GPU-time share MAE/mean
    0.0855, p95 0.36 (as recorded 0.0388, 0.14; a c32 run on the H100 scored 0.134).
    The reference now keeps the thread's median gap where its own looks idle."""
    name = "hf-cb-c32-h100-sampled"
    path = str(CAPTURES / f"{name}.ttcap")
    with gzip.open(CAPTURES / f"{name}.truth.jsonl.gz", "rt") as f:
        truth = f.read().splitlines()
    items = [schema.decode(i) if isinstance(i, bytes) else i
             for i in capture.CaptureReader(path)]
    bursts = [i for i in items if isinstance(i, KernelBurst)]
    switches = [i for i in items if isinstance(i, GpuSampling)]
    windows = [(a.ts, b.ts) for a, b in zip(switches, switches[1:])
               if a.enabled and not b.enabled]
    assert len(windows) > 10
    engine = Counter(b.tid for b in bursts).most_common(1)[0][0]
    steps = sorted((b for b in bursts if b.tid == engine), key=lambda b: b.first_ts)
    before_whole = [a.last_ts for a, b in zip(steps, steps[1:])
                    if a.copy_calls.get("d2h") and a.last_ts > windows[0][0]
                    and any(w0 <= b.first_ts and b.last_ts <= w1 for w0, w1 in windows)]
    picks = before_whole[::len(before_whole) // 5][:5]
    assert len(picks) == 5
    spans, pipeline = replay(path, items=_stalled(items, [(t + 1, 300_000_000)
                                                          for t in picks]))
    r = score(truth, spans, pipeline.report())
    assert r["requests_traced"] == 768 and pipeline.reconciliation()["balanced"]
    assert r["kernel_share"]["mae_over_mean"] <= 0.02, r["kernel_share"]
    # 0.0428 and 0.14 here, 0.0855 and 0.36 before
    assert r["gpu_time_share"]["mae_over_mean"] <= 0.055, r["gpu_time_share"]
    assert r["gpu_time_share"]["p95_rel"] <= 0.25, r["gpu_time_share"]
    assert pipeline.report()["gpu_step_gaps_idle"] >= 5
