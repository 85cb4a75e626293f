"""Per-request attribution accuracy against the sample servers' own ground truth.

For each layout of ``samples.batching.server`` (engine thread, engine process, two
tensor-parallel ranks) and each concurrency, the server runs under the tracer (real
probes) while ``samples.batching.load`` sends requests; the server writes, per engine
step, which requests were in it, its launches and its GPU time. A request's true share
of a step is the step's launches (GPU time) divided equally among the step's members,
the rule the tracer estimates from the outside. Reported per case:

* kernel-share error: mean and p95 of |tracer - truth| / truth per request, and the
  mean absolute error as a fraction of the mean true share;
* GPU-time error: the same for ``tokentrace.gpu.time_ms`` (step occupancy: first launch
  to the end of the step's wait) vs the engine's own stamps around each step, shared
  the same way (and, in the JSON, vs the truth's ``gpu_ns``: CUDA-event time on a GPU,
  the stand-in's modelled kernel time on the CPU, which does not include the CPU
  forward pass the CPU sample runs inside each step);
* steps error: requests whose step count differs from the truth;
* TTFT error: |tracer TTFT - server TTFT| for streamed requests, the server's being
  its handler's start to the first token handed to the stream (both stamped in Python
  next to the syscalls the tracer sees); the error against the client's own TTFT
  (request built to first chunk parsed, in the openai client) is in the JSON too.

The truth counts a request in the steps that prefilled a chunk of a long prompt before
its first token; nothing outside the process shows those (the request emits nothing),
so the tracer charges a request from the step that made its first token: chunked
prefill is the main source of kernel-share error and is reported as its own count.

    python bench/accuracy.py [--layouts thread,process,tp2] [--concurrency 1,8,32]
        [--requests 64] [--device cpu|cuda] [--out bench/results/accuracy.json]

On a GPU host, ``--device cuda`` runs the real tiny GPT on the GPU (no stand-ins);
there the truth has no launch counts, so the kernel-share error is not computed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from samples.gpu.build import build  # noqa: E402
from tests.live import traced  # noqa: E402


def start_server(layout: str, device: str, truth: Path, libs: dict[str, Path] | None,
                 max_batch: int, log: Path) -> tuple[subprocess.Popen[str], int]:
    cmd = [sys.executable, "-m", "samples.batching.server", "--port", "0", "--layout", layout,
           "--device", device, "--truth", str(truth), "--max-batch", str(max_batch)]
    if libs is not None:
        cmd += ["--libcuda", str(libs["libcuda"])]
        if layout == "tp2":
            cmd += ["--libnccl", str(libs["libnccl"])]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=open(log, "w"),
                         text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = p.stdout.readline() if p.stdout else ""
        if line.startswith("ready"):
            return p, int(line.split()[1])
        if not line and p.poll() is not None:
            break
    p.kill()
    raise RuntimeError(f"{layout} server did not start: {log.read_text()[-2000:]}")


def stop_server(p: subprocess.Popen[str]) -> None:
    import signal
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(p.pid, signal.SIGKILL)


def truth_shares(lines: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per request id: true launches, GPU ns, steps (rank 0), server TTFT ns."""
    out: dict[str, dict[str, float]] = {}
    for d in lines:
        if d.get("type") == "step":
            members = d.get("members") or []
            for m in members:
                t = out.setdefault(m["id"], {"launches": 0.0, "gpu_ns": 0.0, "span_ns": 0.0,
                                             "steps": 0, "emitting_steps": 0})
                if d.get("launches") is None:
                    t["launches"] = float("nan")
                else:
                    t["launches"] += d["launches"] / len(members)
                t["gpu_ns"] += (d.get("gpu_ns") or 0) / len(members)
                if d.get("rank", 0) == 0:
                    t["span_ns"] += (d["t_end_ns"] - d["t_start_ns"]) / len(members)
                if d.get("rank", 0) == 0:
                    t["steps"] += 1
                    t["emitting_steps"] += bool(m.get("emits"))
    for d in lines:
        if d.get("type") == "request" and d["id"] in out:
            out[d["id"]]["ttft_ns"] = d["first_token_ns"] - d["arrival_ns"]
    return out


def errors(pairs: list[tuple[float, float]]) -> dict[str, float | None]:
    pairs = [(t, e) for t, e in pairs if t == t and t > 0]  # drop NaN / zero truths
    if not pairs:
        return {"mean_rel": None, "p95_rel": None, "mae_over_mean": None, "n": 0}
    rel = sorted(abs(e - t) / t for t, e in pairs)
    mae = statistics.fmean(abs(e - t) for t, e in pairs)
    return {"mean_rel": round(statistics.fmean(rel), 4),
            "p95_rel": round(rel[min(len(rel) - 1, int(0.95 * len(rel)))], 4),
            "mae_over_mean": round(mae / statistics.fmean(t for t, _ in pairs), 4),
            "n": len(pairs)}


def run_case(layout: str, concurrency: int, requests: int, device: str,
             libs: dict[str, Path] | None, work: Path, max_batch: int,
             keep_spans: bool = False, pricing: Any = None) -> dict[str, Any]:
    """Serve ``requests`` at ``concurrency`` under the tracer and score the spans."""
    truth_path = work / f"truth-{layout}-{concurrency}.jsonl"
    truth_path.unlink(missing_ok=True)
    p, port = start_server(layout, device, truth_path, libs, max_batch,
                           work / f"server-{layout}-{concurrency}.log")
    try:
        client_out = work / f"client-{layout}-{concurrency}.json"
        with traced(pids=[p.pid], settle=1.0, pricing=pricing) as got:
            subprocess.run([sys.executable, "-m", "samples.batching.load",
                            "--url", f"http://127.0.0.1:{port}", "--requests", str(requests),
                            "--concurrency", str(concurrency), "--out", str(client_out),
                            "--seed", str(concurrency)], cwd=ROOT, check=True, timeout=600)
            time.sleep(0.5)  # the last steps' bursts and the hold window
    finally:
        stop_server(p)
    lines = [json.loads(x) for x in truth_path.read_text().splitlines() if x.strip()]
    truth = truth_shares(lines)
    spans = {}
    for s in got.spans:
        a = s["attributes"]
        rid = a.get("gen_ai.response.id")
        if rid:  # request spans only: their queue/prefill/decode children carry no id
            spans[rid] = a
    matched = [rid for rid in truth if rid in spans]
    kern = [(truth[r]["launches"], float(spans[r].get("tokentrace.gpu.kernel_launches", 0)))
            for r in matched]
    # the tracer's GPU time is step occupancy (first launch to the end of the wait),
    # summed over ranks; the engine's own stamps around each step are its truth
    ranks = 2 if layout == "tp2" else 1
    gpu = [(ranks * truth[r]["span_ns"] / 1e6, float(spans[r].get("tokentrace.gpu.time_ms", 0)))
           for r in matched]
    gpu_events = [(truth[r]["gpu_ns"] / 1e6, float(spans[r].get("tokentrace.gpu.time_ms", 0)))
                  for r in matched]
    steps_off = sum(1 for r in matched
                    if spans[r].get("tokentrace.gpu.steps") != truth[r]["steps"])
    emit_off = sum(1 for r in matched
                   if spans[r].get("tokentrace.gpu.steps") != truth[r]["emitting_steps"])
    client = json.loads(client_out.read_text()).get("requests", {})
    streamed = [r for r in matched if client.get(r, {}).get("streamed")
                and spans[r].get("tokentrace.time_to_first_token") is not None]
    ttft = [abs(spans[r]["tokentrace.time_to_first_token"] * 1e9 - truth[r]["ttft_ns"]) / 1e6
            for r in streamed if truth[r].get("ttft_ns")]
    ttft_client = [abs(spans[r]["tokentrace.time_to_first_token"] * 1e9
                       - client[r]["ttft_ns"]) / 1e6 for r in streamed if client[r].get("ttft_ns")]
    out = {
        "layout": layout, "concurrency": concurrency, "device": device,
        "requests_truth": len(truth), "requests_traced": len(matched),
        "steps_truth": sum(1 for d in lines if d.get("type") == "step"),
        "kernel_share": errors(kern), "gpu_time": errors(gpu),
        "requests_with_wrong_step_count": steps_off,
        "requests_with_wrong_emitting_step_count": emit_off,
        "chunked_prefill_requests": sum(1 for r in matched
                                        if truth[r]["steps"] > truth[r]["emitting_steps"]),
        "gpu_time_vs_truth_gpu_ns": errors(gpu_events),
        "ttft_abs_err_ms": {"mean": round(statistics.fmean(ttft), 3) if ttft else None,
                            "max": round(max(ttft), 3) if ttft else None},
        "ttft_abs_err_vs_client_ms": {
            "mean": round(statistics.fmean(ttft_client), 3) if ttft_client else None,
            "max": round(max(ttft_client), 3) if ttft_client else None},
        "tracer": {k: v for k, v in got.report.items()
                   if k.startswith(("gpu_", "capture.", "ipc_"))},
    }
    if keep_spans:
        out["spans"] = got.spans
    return out


def run_hf_case(continuous: bool, concurrency: int, requests: int, device: str, work: Path,
                model: Path, keep: Path | None = None, pricing: Any = None) -> dict[str, Any]:
    """HF ``transformers serve`` (a server nobody here wrote) under the tracer: its
    truth comes from ``samples/hf/truth`` inside the server, never from the tracer.
    With ``keep``, the capture, truth and client results are copied there."""
    from samples.hf.serve import HfServer

    name = f"hf-{'cb' if continuous else 'plain'}-c{concurrency}"
    truth_path, cap = work / f"{name}.truth.jsonl", work / f"{name}.ttcap"
    truth_path.unlink(missing_ok=True)
    server = HfServer(model, truth_path, work / f"{name}.log", continuous, device)
    try:
        server.wait_ready()
        server.warm_up()
        client_out = work / f"{name}.client.json"
        with traced(pids=[server.pid], settle=1.0, pricing=pricing, record=str(cap)) as got:
            subprocess.run([sys.executable, "-m", "samples.batching.load", "--url", server.url,
                            "--requests", str(requests), "--concurrency", str(concurrency),
                            "--out", str(client_out), "--seed", str(concurrency),
                            "--model", str(model), "--max-tokens", "24:150",
                            "--words", "5:300", "--stream-share", "0.75",
                            "--usage-share", "1.0"], cwd=ROOT, check=True, timeout=900)
            time.sleep(0.5)
        server.flush_truth()
    finally:
        server.stop()
    if keep is not None:  # one file per case: the device tool brings back few files
        import tarfile
        keep.mkdir(parents=True, exist_ok=True)
        with tarfile.open(keep / f"{name}.tgz", "w:gz") as tar:
            for f in (cap, truth_path, client_out, work / f"{name}.log"):
                tar.add(f, arcname=f.name)
    from samples.scoring import score
    out = {"server": name, "concurrency": concurrency, "device": device,
           **score(truth_path.read_text().splitlines(), got.spans, got.report)}
    return out


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| layout | conc. | requests | kernel share MAE/mean | p95 rel. | GPU time MAE/mean "
            "| step count off (all / emitting) | chunked prefill "
            "| TTFT err mean / max (ms) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        k, g, t = r["kernel_share"], r["gpu_time"], r["ttft_abs_err_ms"]
        rows.append(f"| {r['layout']} | {r['concurrency']} | {r['requests_traced']}/"
                    f"{r['requests_truth']} | {k['mae_over_mean']} | {k['p95_rel']} | "
                    f"{g['mae_over_mean']} | "
                    f"{r['requests_with_wrong_step_count']} / "
                    f"{r['requests_with_wrong_emitting_step_count']} | "
                    f"{r['chunked_prefill_requests']} | {t['mean']} / {t['max']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="batching", choices=("batching", "hf-cb", "hf-plain"),
                    help="our batching samples (--layouts) or HF transformers serve")
    ap.add_argument("--keep", type=Path, help="copy HF captures, truths and client results here")
    ap.add_argument("--layouts", default="thread,process,tp2")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", default="64",
                    help="requests per case, or one count per concurrency (hf: 48,128,384)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/accuracy.json"))
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tt-accuracy-"))
    results = []
    if args.server.startswith("hf-"):
        from samples.hf.model import build as build_model
        model = build_model(work / "tiny-llama")
        conc = [int(x) for x in args.concurrency.split(",")]
        counts = [int(x) for x in args.requests.split(",")]
        for c, n in zip(conc, counts * len(conc) if len(counts) == 1 else counts):
            r = run_hf_case(args.server == "hf-cb", c, n, args.device, work, model, args.keep)
            print(json.dumps(r), flush=True)
            results.append(r)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"server": args.server, "device": args.device,
                                              "requests": args.requests,
                                              "results": results}, indent=1) + "\n")
        return 0
    libs = build(work / "gpu") if args.device == "cpu" else None
    for layout in args.layouts.split(","):
        for c in (int(x) for x in args.concurrency.split(",")):
            r = run_case(layout, c, int(args.requests.split(",")[0]), args.device, libs, work,
                         args.max_batch)
            print(json.dumps(r), flush=True)
            results.append(r)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": args.device, "requests": args.requests,
                                          "max_batch": args.max_batch,
                                          "results": results}, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
