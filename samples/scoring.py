"""Score the tracer's per-request GPU shares against a server's own ground truth.

The truth is the JSON lines a server wrote about itself (``samples/batching`` engines,
or ``samples/hf/truth`` inside HF ``transformers serve``): per engine step its members
(request id, phase, query tokens), its kernel launches and its GPU time. A request's
true share of a step is what it made the step cost: the engine's own marginal launches
and GPU time where it knows them (``members[].cost``, ``members[].time_ns``: the
stand-in engine's, whose modelled kernel time grows with each member's query tokens),
otherwise the step-cost model of
``tracer.correlate.costmodel`` fitted to the truth's steps with their exact membership
and token counts. The tracer has to infer membership and tokens from the outside, so
the difference measures what it got wrong.

Errors are reported as mean absolute error over the mean true value ("MAE/mean") of
per-request kernel launches, and of per-request GPU-time *shares* (each request's
fraction of the requests' total: the tracer's GPU time is step occupancy, the truth's
is device time, so only the split is comparable).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from typing import Any, Iterable

from tracer.correlate.costmodel import Member, StepModel, fit, member_costs

Lines = Iterable[str | dict[str, Any]]


def parse(lines: Lines) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Truth steps (with their per-step kernels merged in) and request lines by id."""
    docs = [json.loads(x) if isinstance(x, str) else x for x in lines
            if not isinstance(x, str) or x.strip()]
    steps = [d for d in docs if d.get("type") == "step"]
    kernels = {d["step"]: d for d in docs if d.get("type") == "step_kernels"}
    for s in steps:
        k = kernels.get(s["step"])
        if k is not None and s.get("rank", 0) == 0:
            s.setdefault("launches", k["launches"])
            s["kernel_ns"] = k["kernel_ns"]
    requests = {d["id"]: d for d in docs if d.get("type") == "request"}
    return steps, requests


def _members(s: dict[str, Any]) -> list[Member]:
    return [Member(prefill=m["phase"] in ("prefill", "whole"),
                   tokens=float(m.get("tokens", 0)) if m["phase"] != "decode" else 0.0)
            for m in s["members"]]


TIME = "gpu_ns"  # the truth's GPU time: "gpu_ns" (CUDA events) or "wall" (its stamps)


def step_time(s: dict[str, Any], time: str = TIME) -> float:
    """A truth step's GPU time in ns: CUDA events around it on the engine's stream,
    else (or with ``time="wall"``) the engine's own stamps around it."""
    if time == "gpu_ns" and s.get("gpu_ns"):
        return float(s["gpu_ns"])
    return float(s["t_end_ns"] - s["t_start_ns"])


def truth_model(steps: list[dict[str, Any]], quantity: str, time: str = TIME) -> StepModel:
    """The step-cost model of the truth's own steps (exact members and tokens)."""
    from tracer.correlate.costmodel import features
    rows = []
    for s in steps:
        y = step_time(s, time) if quantity == "time" else s.get("launches")
        if y is None or not s["members"]:
            continue
        rows.append((*features(_members(s)), float(y)))
    return fit(rows)


def truth_shares(steps: list[dict[str, Any]], time: str = TIME) -> dict[str, dict[str, float]]:
    """Per request id: true launches, GPU time (ns), steps (rank 0) and emitting steps."""
    models = {q: truth_model(steps, q, time) for q in ("launches", "time")}
    out: dict[str, dict[str, float]] = defaultdict(
        lambda: {"launches": 0.0, "time_ns": 0.0, "steps": 0, "emitting_steps": 0})
    for s in steps:
        ms = s["members"]
        if not ms:
            continue
        members = _members(s)
        for q, key in (("launches", "launches"), ("time", "time_ns")):
            total = step_time(s, time) if q == "time" else s.get("launches")
            if total is None:
                continue
            own = "cost" if q == "launches" else "time_ns"
            if all(own in m for m in ms) and (q == "launches" or time == "gpu_ns"):
                # the engine knows what each member added: fixed part shared equally
                fixed = total - sum(m[own] for m in ms)
                costs = [fixed / len(ms) + m[own] for m in ms]
            else:
                costs = member_costs(models[q], members)
            tot = sum(costs) or 1.0
            for m, c in zip(ms, costs):
                out[m["id"]][key] += total * c / tot
        for m in ms:
            if s.get("rank", 0) == 0:
                out[m["id"]]["steps"] += 1
                out[m["id"]]["emitting_steps"] += bool(m.get("emits"))
    return dict(out)


def errors(pairs: list[tuple[float, float]]) -> dict[str, float | None]:
    """(truth, estimate) pairs -> mean and p95 relative error, MAE/mean."""
    pairs = [(t, e) for t, e in pairs if t == t and t > 0]
    if not pairs:
        return {"mean_rel": None, "p95_rel": None, "mae_over_mean": None, "n": 0}
    rel = sorted(abs(e - t) / t for t, e in pairs)
    mae = statistics.fmean(abs(e - t) for t, e in pairs)
    return {"mean_rel": round(statistics.fmean(rel), 4),
            "p95_rel": round(rel[min(len(rel) - 1, int(0.95 * len(rel)))], 4),
            "mae_over_mean": round(mae / statistics.fmean(t for t, _ in pairs), 4),
            "n": len(pairs)}


def request_spans(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Request spans by response id (their queue/prefill/decode children carry none)."""
    out = {}
    for s in spans:
        a = s.get("attributes", s)
        rid = a.get("gen_ai.response.id")
        if rid:
            out[rid] = a
    return out


def score(truth_lines: Lines, spans: list[dict[str, Any]],
          report: dict[str, Any] | None = None, time: str = TIME) -> dict[str, Any]:
    """Kernel-share and GPU-time-share errors of ``spans`` against the truth."""
    steps, requests = parse(truth_lines)
    truth = truth_shares(steps, time)
    got = request_spans(spans)
    matched = [r for r in truth if r in got]
    kern = [(truth[r]["launches"], float(got[r].get("tokentrace.gpu.kernel_launches", 0)))
            for r in matched]
    t_true = sum(truth[r]["time_ns"] for r in matched) or 1.0
    t_est = sum(float(got[r].get("tokentrace.gpu.time_ms", 0)) for r in matched) or 1.0
    time_share = [(truth[r]["time_ns"] / t_true,
                   float(got[r].get("tokentrace.gpu.time_ms", 0)) / t_est) for r in matched]
    steps_off = sum(1 for r in matched if got[r].get("tokentrace.gpu.steps") != truth[r]["steps"])
    models = {q: truth_model(steps, q, time).describe() for q in ("launches", "time")}
    out: dict[str, Any] = {
        "requests_truth": len(truth), "requests_traced": len(matched),
        "steps_truth": len(steps),
        "kernel_share": errors(kern), "gpu_time_share": errors(time_share),
        "requests_with_wrong_step_count": steps_off,
        "chunked_prefill_requests": sum(1 for r in matched
                                        if truth[r]["steps"] > truth[r]["emitting_steps"]),
        "truth_models": models,
        "launches_truth_matched": round(sum(t for t, _ in kern), 1),
        "launches_charged_matched": round(sum(e for _, e in kern), 1),
    }
    if report is not None:
        out["tracer"] = {k: v for k, v in report.items()
                         if k.startswith(("gpu_", "capture.", "ipc_"))}
        obs = report.get("gpu_step_launches")
        if obs:
            out["charged_over_observed"] = round(report.get("gpu_step_launches_charged", 0) / obs, 6)
    return out


def replay(capture_path: str, price: float | None = 3.0,
           items: Iterable[Any] | None = None) -> tuple[list[dict[str, Any]], Any]:
    """Replay a capture through the analysis (no BPF): its JSONL spans and the pipeline
    (for ``report()`` and ``reconciliation()``). ``items``: these records instead of the
    capture's own (a capture edited by a test), under its header."""
    import io

    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from tracer.correlate.cost import GpuPricing
    from tracer.events import capture
    from tracer.export.context import ExportContext
    from tracer.export.jsonl import JsonlSpanExporter
    from tracer.export.spans import SpanBuilder
    from tracer.pipeline import Pipeline

    reader = capture.CaptureReader(capture_path)
    ctx = ExportContext(capture_id=reader.header["capture_id"], host=reader.header.get("host", ""))
    buf = io.StringIO()
    spans = SpanBuilder(ctx, [SimpleSpanProcessor(JsonlSpanExporter(buf))])
    pricing = GpuPricing.resolve(price=price, model=reader.header.get("gpu_model") or "replay")
    pipeline = Pipeline([spans], ctx, pricing=pricing)
    for item in reader if items is None else items:
        pipeline.feed(item)
    pipeline.close()
    return [json.loads(line) for line in buf.getvalue().splitlines()], pipeline


def main(argv: list[str] | None = None) -> None:
    """python -m samples.scoring CAPTURE TRUTH: replay and score against the truth."""
    import argparse
    import gzip
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("capture")
    p.add_argument("truth")
    args = p.parse_args(argv)
    opener = gzip.open if args.truth.endswith(".gz") else open
    with opener(args.truth, "rt") as f:
        truth = f.read().splitlines()
    spans, pipeline = replay(args.capture)
    out = score(truth, spans, pipeline.report())
    out["reconciliation_balanced"] = pipeline.reconciliation()["balanced"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
